// tests/reference/tools/trainer_config_tool.c — tandem-train's option handling on its own.
//   trainer_config_tool --markdown          prints the option tables of docs/configuration.md
//   trainer_config_tool --trl-markdown      prints its table of the TRL keys that are not options
//   trainer_config_tool --keys              prints {"options": [file keys and aliases], "trl": {key: {"fate":
//                                           "no effect" | "only values", "values": [...] | null, "why": ...}}}
//   trainer_config_tool --world-size N ARGS parses ARGS as tandem-train would, finalizes for N ranks and
//                                           prints {"config": <train_config_to_json>, "resolved":
//                                           {"steps_per_generation": .., "generation_batch_size": ..},
//                                           "ignored": [TRL keys ignored]} (exit 1 with the message when
//                                           refused; --help prints the help)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "trainer/train_config_internal.h"

static int print_keys(void) {
    json_t *opts = json_array(), *trl = json_object();
    for (size_t i = 0; i < train_options_count; i++)
        if (!(train_options[i].flags & OPTF_FLAG_ONLY)) json_array_append_new(opts, json_string(train_options[i].key));
    for (size_t i = 0; i < trl_keys_count; i++) {
        const TrlKey *k = &trl_keys[i];
        json_t *values = k->values ? json_loads(k->values, 0, NULL) : json_null();
        json_object_set_new(trl, k->key, json_pack("{s:s, s:o, s:s}", "fate", trl_fate_name(k->fate), "values",
                                                   values ? values : json_null(), "why", k->why));
    }
    json_t *root = json_pack("{s:o, s:o}", "options", opts, "trl", trl);
    char *txt = json_dumps(root, JSON_INDENT(1));
    int ok = txt != NULL;
    if (txt) puts(txt);
    free(txt);
    json_decref(root);
    return ok ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--markdown") == 0) {
        train_config_print_markdown(stdout);
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "--trl-markdown") == 0) {
        train_config_print_trl_markdown(stdout);
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "--keys") == 0) return print_keys();
    int world = 1, skip = 0;
    if (argc >= 3 && strcmp(argv[1], "--world-size") == 0) {
        world = atoi(argv[2]);
        skip = 2;
    }
    argv[skip] = argv[0];
    TrainConfig c;
    train_config_default(&c);
    char err[16384];
    int rc = train_config_parse_args(&c, argc - skip, argv + skip, err, sizeof err);
    if (rc == 1) {
        train_config_print_help(stdout);
        train_config_free(&c);
        return 0;
    }
    if (rc == 0) rc = train_config_finalize(&c, world, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "%s\n", err);
        train_config_free(&c);
        return 1;
    }
    char *json = train_config_to_json(&c);
    printf("{\"config\": %s, \"resolved\": {\"steps_per_generation\": %d, \"generation_batch_size\": %d}, "
           "\"ignored\": [", json ? json : "null", c.resolved_steps_per_generation, c.resolved_generation_batch_size);
    for (size_t i = 0; i < c.n_ignored; i++) printf("%s\"%s\"", i ? ", " : "", c.ignored[i]);
    printf("]}\n");
    free(json);
    train_config_free(&c);
    return json ? 0 : 1;
}
