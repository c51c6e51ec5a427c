// trainer/rewards.h — built-in verifiable rewards: one score per (completion, reward function).
//
// Built-ins (the names --rewards accepts):
//   answer_match    1.0 when the completion's final answer equals the dataset's answer column, else 0.0;
//                   NaN ("no score") when the row has no usable answer (column missing, null, or not a string
//                   or number). Final answer of a completion, first that applies: the last complete
//                   \boxed{...} (or \fbox{...}; nested braces; also "\boxed 5"), the text after the last
//                   "####" (GSM8K) up to the end of its line, else the last number in the text (decimal,
//                   "1,000", "3/4", \frac{a}{b}). The reference is read the same way when it is a string
//                   holding "####" or \boxed (GSM8K / MATH solution texts), else taken whole; a JSON number is
//                   used as is. Both sides are then normalised (reward_parse_number) and compared numerically
//                   (equal within 1e-9 relative); when either side is not a number, their cleaned-up texts
//                   are compared with all whitespace removed (so "\boxed{B}" matches "B").
//   regex_format    1.0 when the completion matches --format-regex (PCRE2, UTF mode), else 0.0. Mode "full"
//                   (default) needs the whole completion to match (Python's re.fullmatch); "search" accepts a
//                   match anywhere (re.search). Flags as in Python's defaults: "." does not match a newline
//                   unless the pattern says (?s); "^"/"$" anchor the whole text unless it says (?m).
//   think_format    TRL's think_format_reward: 1.0 when the completion starts with "<think>", has no other
//                   "<think>" after it, and has a "</think>" after it (the regex
//                   ^<think>(?!.*<think>)(.*?)</think>.*$ under re.match with DOTALL|MULTILINE), else 0.0.
//   length_penalty  -coef * max(0, L - target) / max(1, Lmax - target): 0 up to `target` tokens, falling
//                   linearly to -coef at Lmax = max_completion_length (and beyond, in proportion).
//   soft_overlong   DAPO's soft overlong punishment, as TRL's get_soft_overlong_punishment(Lmax, Lcache):
//                   0 when L <= Lmax - Lcache; (Lmax - Lcache - L) / Lcache when Lmax - Lcache < L <= Lmax;
//                   -1 when L > Lmax. L counts completion tokens.
// Combining scores with reward_weights is the GRPO module's job; NaN is TRL's None and is left out of the
// group statistics there.
#ifndef TANDEM_TRAINER_REWARDS_H
#define TANDEM_TRAINER_REWARDS_H

#include <stddef.h>

#include <jansson.h>

typedef enum {
    REWARD_ANSWER_MATCH = 0,
    REWARD_REGEX_FORMAT,
    REWARD_THINK_FORMAT,
    REWARD_LENGTH_PENALTY,
    REWARD_SOFT_OVERLONG,
    REWARD_BUILTIN_COUNT
} RewardBuiltin;

// Names indexed by RewardBuiltin, NULL-terminated.
extern const char *const reward_builtin_names[REWARD_BUILTIN_COUNT + 1];
// Returns the RewardBuiltin of a name, or -1.
int reward_builtin_parse(const char *name);

typedef struct {
    const char *answer_column;     // column holding the reference answer (default "answer")
    const char *format_regex;      // pattern of regex_format (required when it is selected)
    int format_regex_search;       // 0: full match; 1: match anywhere
    int max_completion_length;     // Lmax of length_penalty and soft_overlong (tokens, > 0)
    int soft_punish_cache;         // Lcache of soft_overlong (tokens, 0 <= Lcache <= Lmax)
    double length_penalty_coef;    // coef of length_penalty (>= 0)
    int length_penalty_target;     // target of length_penalty (tokens, 0 <= target < Lmax)
} RewardOptions;

void reward_options_default(RewardOptions *o);

// One completion to score.
typedef struct {
    const char *completion;        // decoded completion text, UTF-8, NUL-terminated
    int completion_tokens;         // number of completion token ids (length rewards)
    const json_t *prompt;          // the dataset's prompt (text or messages); not read by the built-ins
    const json_t *columns;         // the dataset row's other columns (object), or NULL
} RewardSample;

typedef struct Rewards Rewards;

// Builds the selected built-ins, in the given order. Errors (unknown name — with the list of known names —,
// duplicate name, a regex that does not compile, options out of range for a selected reward) name the
// option. n may be 0.
int rewards_create(Rewards **out, const char *const *names, size_t n, const RewardOptions *opt, char *err,
                   size_t err_len);
void rewards_free(Rewards *r);
size_t rewards_count(const Rewards *r);
const char *rewards_name(const Rewards *r, size_t i);

// Scores n samples with every selected reward: scores[i * ld + f] for sample i and reward f (ld >= count,
// so the caller can leave columns for other reward sources). NaN means "no score". Returns 0, or a negative
// code on a failure that is not the sample's fault (out of memory, PCRE2 failing to run).
int rewards_score(const Rewards *r, const RewardSample *samples, size_t n, double *scores, size_t ld, char *err,
                  size_t err_len);

// ---- the pieces, for tests and for callers that need one ---------------------------------------------
// Final answer of a text (rules above). Returns 1 and a malloc'd *out when one is found, 0 when none
// (*out = NULL), -1 on out of memory.
int reward_extract_answer(const char *text, char **out);
// Cleans up a final answer (strips $, \left/\right, spacing commands, \text{} units, %, degrees, a
// leading "x =", a trailing period) and parses it: optional sign, then a decimal ("1,000", "1000.0",
// "1e3", ".5"), a fraction "a/b", \frac{a}{b} (\dfrac, \tfrac, \frac34), or a mixed number "1\frac{1}{2}".
// Returns 0 with *out set, or -1 when the text is not a number.
int reward_parse_number(const char *s, double *out);
// 1.0 / 0.0 / NaN for one completion against a reference value (string or number JSON; NULL = NaN).
double reward_answer_match(const char *completion, const json_t *reference);
double reward_think_format(const char *completion);
double reward_soft_overlong(int completion_tokens, int max_completion_len, int soft_punish_cache);
double reward_length_penalty(int completion_tokens, int max_completion_len, int target, double coef);

#endif
