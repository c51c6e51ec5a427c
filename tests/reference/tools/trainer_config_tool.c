// tests/reference/tools/trainer_config_tool.c — tandem-train's option handling on its own.
//   trainer_config_tool --markdown          prints the option tables of docs/configuration.md
//   trainer_config_tool --world-size N ARGS parses ARGS as tandem-train would, finalizes for N ranks and
//                                           prints {"config": <train_config_to_json>, "resolved":
//                                           {"steps_per_generation": .., "generation_batch_size": ..},
//                                           "ignored": [TRL keys ignored]} (exit 1 with the message when
//                                           refused; --help prints the help)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/train_config.h"

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--markdown") == 0) {
        train_config_print_markdown(stdout);
        return 0;
    }
    int world = 1, skip = 0;
    if (argc >= 3 && strcmp(argv[1], "--world-size") == 0) {
        world = atoi(argv[2]);
        skip = 2;
    }
    argv[skip] = argv[0];
    TrainConfig c;
    train_config_default(&c);
    char err[1024];
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
