// trainer/train_config_internal.h — the option table shared by train_config.c (parsing),
// train_config_check.c (validation) and train_config_table.c (the table, help, Markdown, JSON dump).
#ifndef TANDEM_TRAINER_TRAIN_CONFIG_INTERNAL_H
#define TANDEM_TRAINER_TRAIN_CONFIG_INTERNAL_H

#include <stddef.h>

#include <jansson.h>

#include "trainer/train_config.h"

typedef enum {
    OPT_INT,       // int
    OPT_LONG,      // long
    OPT_F64,       // double
    OPT_OPT_F64,   // double with an int "has" flag at has_off (JSON null / "none" = unset, TRL's None)
    OPT_BOOL,      // int 0/1
    OPT_STR,       // char * (NULL = unset)
    OPT_ENUM,      // int enum value = index of the choice
    OPT_STRLIST,   // char ** + size_t count at count_off
    OPT_F64LIST,   // double * + size_t count at count_off (NULL = unset)
    OPT_CSV,       // char *: a list kept as one comma-separated string
} OptType;

enum {
    OPTF_GRPO = 1,        // set through grpo_options_set_json (GRPOConfig keys of trainer/grpo_loss.h)
    OPTF_ALIAS = 2,       // another spelling of `alias_of`; not listed separately
    OPTF_NO_VALUE = 4,    // writes another option's value (deprecated key): default shown as none, not dumped
    OPTF_FLAG_ONLY = 8,   // command line only (--config)
    OPTF_NULLABLE = 16,   // JSON null / "none" (TRL's None) sets null_value (OPT_INT, OPT_LONG, OPT_F64, OPT_BOOL)
};

typedef struct {
    const char *key;             // snake_case file key; the flag is --key with '_' -> '-'
    OptType type;
    size_t off;                  // value offset in TrainConfig
    size_t aux_off;              // OPT_OPT_F64: "has" flag; OPT_STRLIST / OPT_F64LIST: the count
    const char *(*choice)(int);  // OPT_ENUM: name of value i, "?" or NULL past the last
    unsigned flags;
    const char *alias_of;        // OPTF_ALIAS
    const char *group;           // section of the help and of docs/configuration.md
    const char *help;
    double null_value;           // OPTF_NULLABLE: the value that means TRL's None (-1 = unset bool)
} OptionSpec;

extern const OptionSpec train_options[];
extern const size_t train_options_count;

const OptionSpec *train_option_find(const char *key);
// Writes the current value of an option as text (as the help shows defaults) into buf.
void train_option_format(const TrainConfig *cfg, const OptionSpec *o, char *buf, size_t cap);
const char *train_option_type_name(const OptionSpec *o);

// Problems found in one pass over a file, the flags or the rules: each is a line of the report.
#define PROBLEMS_TEXT 16384
typedef struct {
    char text[PROBLEMS_TEXT];
    size_t used;
    int n;
} Problems;
void problems_add(Problems *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// 0 when there is none; else -1 with the report in err: the one problem, or "N problems:" and a line each.
int problems_report(const Problems *p, char *err, size_t err_len);

// The fate of a TRL key that is not a tandem option (train_config_trl.c).
typedef enum {
    TRL_NO_EFFECT,     // configures TRL's own machinery: any value accepted, nothing changes
    TRL_ONLY_VALUES,   // changes the output; only the values listed (TRL's default first) are accepted
} TrlFate;

typedef struct {
    const char *key;
    TrlFate fate;
    const char *values;                 // TRL_ONLY_VALUES: JSON array of the accepted values
    int (*accepts)(const json_t *v);    // or NULL: more values accepted than those listed
    const char *why;                    // why it has no effect / what tandem does instead and what to do
} TrlKey;

extern const TrlKey trl_keys[];
extern const size_t trl_keys_count;
const TrlKey *trl_key_find(const char *key);
// 1 when v is a value tandem accepts for k.
int trl_key_accepts(const TrlKey *k, const json_t *v);
const char *trl_fate_name(TrlFate f);

#endif
