// trainer/train_config_internal.h — the option table shared by train_config.c (parsing),
// train_config_check.c (validation) and train_config_table.c (the table, help, Markdown, JSON dump).
#ifndef TANDEM_TRAINER_TRAIN_CONFIG_INTERNAL_H
#define TANDEM_TRAINER_TRAIN_CONFIG_INTERNAL_H

#include <stddef.h>

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
} OptionSpec;

extern const OptionSpec train_options[];
extern const size_t train_options_count;

const OptionSpec *train_option_find(const char *key);
// Writes the current value of an option as text (as the help shows defaults) into buf.
void train_option_format(const TrainConfig *cfg, const OptionSpec *o, char *buf, size_t cap);
const char *train_option_type_name(const OptionSpec *o);

#endif
