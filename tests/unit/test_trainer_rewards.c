// tests/unit/test_trainer_rewards.c — built-in rewards: final-answer extraction (\boxed with nesting, ####,
// last number), number normalisation, answer_match against string and number references (NaN when there is
// none), think_format, regex_format in both modes, the length rewards' formulas, the reward set's layout
// (scores[i * ld + f]) and every refusal of rewards_create with the option named.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "check_macros.h"
#include "trainer/rewards.h"

static void expect_extract(int line, const char *text, const char *want) {
    char *got = NULL;
    int rc = reward_extract_answer(text, &got);
    int ok = want ? (rc == 1 && got && strcmp(got, want) == 0) : (rc == 0 && got == NULL);
    if (!ok) {
        fprintf(stderr, "line %d: extract(%s) = rc %d '%s', want '%s'\n", line, text, rc, got ? got : "(none)",
                want ? want : "(none)");
        failures++;
    }
    free(got);
}

static void expect_number(int line, const char *text, double want) {
    double v = NAN;
    int rc = reward_parse_number(text, &v);
    if (rc != 0 || v != want) {
        fprintf(stderr, "line %d: parse_number(%s) = rc %d %.17g, want %.17g\n", line, text, rc, v, want);
        failures++;
    }
}

static void expect_not_number(int line, const char *text) {
    double v = NAN;
    if (reward_parse_number(text, &v) == 0) {
        fprintf(stderr, "line %d: parse_number(%s) accepted as %.17g, want refusal\n", line, text, v);
        failures++;
    }
}

// reference given as JSON text ("null" and missing are both no reference).
static void expect_match(int line, const char *completion, const char *ref_json, double want) {
    json_t *ref = ref_json ? json_loads(ref_json, JSON_DECODE_ANY, NULL) : NULL;
    double got = reward_answer_match(completion, ref);
    int ok = isnan(want) ? isnan(got) : got == want;
    if (!ok) {
        fprintf(stderr, "line %d: answer_match(%s, %s) = %g, want %g\n", line, completion, ref_json ? ref_json : "-",
                got, want);
        failures++;
    }
    json_decref(ref);
}

static void test_extract(void) {
    expect_extract(__LINE__, "so the answer is \\boxed{42}.", "42");
    expect_extract(__LINE__, "\\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}");
    expect_extract(__LINE__, "nested \\boxed{\\{a\\} + {b {c}}} end", "\\{a\\} + {b {c}}");
    expect_extract(__LINE__, "first \\boxed{7} then a truncated \\boxed{8", "7");
    expect_extract(__LINE__, "\\fbox{12}", "12");
    expect_extract(__LINE__, "$\\boxed 5$", "5");
    expect_extract(__LINE__, "work...\n#### 1,000\nthanks", "1,000");
    expect_extract(__LINE__, "#### The answer is 42 apples", "42");
    expect_extract(__LINE__, "#### 3\n#### 4", "4");
    expect_extract(__LINE__, "I have 3 apples and -5.5 pears.", "-5.5");
    expect_extract(__LINE__, "the ratio is 3/4", "3/4");
    expect_extract(__LINE__, "5-3 = 2", "2");
    expect_extract(__LINE__, "x = -3", "-3");
    expect_extract(__LINE__, "it is 12,345,678 total", "12,345,678");
    expect_extract(__LINE__, "value .5 here", ".5");
    expect_extract(__LINE__, "half is $\\frac{1}{2}$", "\\frac{1}{2}");
    expect_extract(__LINE__, "no numbers here", NULL);
    expect_extract(__LINE__, "", NULL);
    expect_extract(__LINE__, "#### \n7 then", "7");  // empty #### line falls back to the last number
}

static void test_numbers(void) {
    expect_number(__LINE__, "1,000", 1000.0);
    expect_number(__LINE__, "1000.0", 1000.0);
    expect_number(__LINE__, "3/4", 0.75);
    expect_number(__LINE__, "-7", -7.0);
    expect_number(__LINE__, "\\frac{3}{4}", 0.75);
    expect_number(__LINE__, "\\dfrac{-1}{2}", -0.5);
    expect_number(__LINE__, "-\\frac{1}{4}", -0.25);
    expect_number(__LINE__, "\\frac34", 0.75);
    expect_number(__LINE__, "1\\frac{1}{2}", 1.5);
    expect_number(__LINE__, "$1,234.5$", 1234.5);
    expect_number(__LINE__, "\\$18", 18.0);
    expect_number(__LINE__, "50\\%", 50.0);
    expect_number(__LINE__, "x = 5", 5.0);
    expect_number(__LINE__, "42.", 42.0);
    expect_number(__LINE__, "{7}", 7.0);
    expect_number(__LINE__, "1e3", 1000.0);
    expect_number(__LINE__, "12 \\text{ apples}", 12.0);
    expect_number(__LINE__, "\\text{9}", 9.0);
    expect_number(__LINE__, "90^\\circ", 90.0);
    expect_number(__LINE__, "1{,}000", 1000.0);
    expect_number(__LINE__, "\xe2\x88\x92" "4", -4.0);  // U+2212 minus sign
    expect_number(__LINE__, "\\left. 3 \\right.", 3.0);  // \left and \right are dropped (then the periods)
    expect_not_number(__LINE__, "\\left( 3 \\right)");  // parentheses are not part of a number
    expect_not_number(__LINE__, "1,00");
    expect_not_number(__LINE__, "1/0");
    expect_not_number(__LINE__, "\\frac{1}{0}");
    expect_not_number(__LINE__, "abc");
    expect_not_number(__LINE__, "3 4");
    expect_not_number(__LINE__, "");
    expect_not_number(__LINE__, "nan");
    expect_not_number(__LINE__, "inf");
    char longnum[160];
    memset(longnum, '7', 150);
    longnum[150] = '\0';
    expect_not_number(__LINE__, longnum);  // longer than any answer: refused, not truncated
}

static void test_answer_match(void) {
    expect_match(__LINE__, "The answer is \\boxed{1000}", "\"1,000\"", 1.0);
    expect_match(__LINE__, "The answer is \\boxed{1,000}", "1000", 1.0);
    expect_match(__LINE__, "#### 72", "\"Natalia sold 48/2 = 24 clips...\\n#### 72\"", 1.0);
    expect_match(__LINE__, "#### 71", "\"...\\n#### 72\"", 0.0);
    expect_match(__LINE__, "so \\boxed{\\frac{3}{4}}", "\"0.75\"", 1.0);
    expect_match(__LINE__, "so \\boxed{0.75}", "\"\\\\frac{3}{4}\"", 1.0);
    expect_match(__LINE__, "the result: -3", "-3", 1.0);
    expect_match(__LINE__, "the result: 3", "-3", 0.0);
    expect_match(__LINE__, "it is 1000.0", "1000", 1.0);
    expect_match(__LINE__, "\\boxed{B}", "\"B\"", 1.0);
    expect_match(__LINE__, "\\boxed{C}", "\"B\"", 0.0);
    expect_match(__LINE__, "\\boxed{x^2 + 1}", "\"x^2+1\"", 1.0);
    expect_match(__LINE__, "nothing", "5", 0.0);
    expect_match(__LINE__, "\\boxed{seven}", "7", 0.0);
    expect_match(__LINE__, "the MATH solution form", "\"so $\\\\boxed{12}$.\"", 0.0);
    expect_match(__LINE__, "\\boxed{12}", "\"so $\\\\boxed{12}$.\"", 1.0);
    expect_match(__LINE__, "large 1000001", "1000000", 0.0);  // relative 1e-9 is tighter than 1e-6
    expect_match(__LINE__, "42", NULL, NAN);
    expect_match(__LINE__, "42", "null", NAN);
    expect_match(__LINE__, "42", "\"\"", NAN);
    expect_match(__LINE__, "42", "true", NAN);
    expect_match(__LINE__, "42", "[42]", NAN);
}

static void test_think_and_lengths(void) {
    CHECK(reward_think_format("<think>\nreasoning\n</think>\nanswer") == 1.0);
    CHECK(reward_think_format("<think></think>") == 1.0);
    CHECK(reward_think_format("<think>\nreasoning only") == 0.0);
    CHECK(reward_think_format(" <think>x</think>") == 0.0);
    CHECK(reward_think_format("<think>a<think>b</think>") == 0.0);
    CHECK(reward_think_format("<think>a</think>b<think>") == 0.0);
    CHECK(reward_think_format("<think>a</think></think>") == 1.0);
    CHECK(reward_think_format("") == 0.0);

    // TRL's docstring example: Lmax 100, cache 20, 90 tokens -> -0.5.
    CHECK(reward_soft_overlong(90, 100, 20) == -0.5);
    CHECK(reward_soft_overlong(80, 100, 20) == 0.0);
    CHECK(reward_soft_overlong(81, 100, 20) == -1.0 / 20.0);
    CHECK(reward_soft_overlong(100, 100, 20) == -1.0);
    CHECK(reward_soft_overlong(101, 100, 20) == -1.0);
    CHECK(reward_soft_overlong(100, 100, 0) == 0.0);
    CHECK(reward_soft_overlong(101, 100, 0) == -1.0);

    CHECK(reward_length_penalty(0, 100, 0, 1.0) == 0.0);
    CHECK(reward_length_penalty(50, 100, 0, 1.0) == -0.5);
    CHECK(reward_length_penalty(100, 100, 0, 2.0) == -2.0);
    CHECK(reward_length_penalty(60, 100, 60, 1.0) == 0.0);
    CHECK(reward_length_penalty(80, 100, 60, 1.0) == -0.5);
    CHECK(reward_length_penalty(150, 100, 0, 1.0) == -1.5);
}

static void expect_create_refused(int line, const char *const *names, size_t n, const RewardOptions *o,
                                  const char *needle) {
    Rewards *r = NULL;
    char err[512] = "";
    int rc = rewards_create(&r, names, n, o, err, sizeof err);
    if (rc == 0 || r != NULL || !strstr(err, needle)) {
        fprintf(stderr, "line %d: expected refusal mentioning '%s', got rc %d '%s'\n", line, needle, rc, err);
        failures++;
    }
    rewards_free(r);
}

static void test_set(void) {
    RewardOptions o;
    reward_options_default(&o);
    o.format_regex = "<answer>\\d+</answer>";
    o.max_completion_length = 10;
    o.soft_punish_cache = 4;
    o.length_penalty_coef = 1.0;
    const char *names[] = {"answer_match", "regex_format", "think_format", "length_penalty", "soft_overlong"};
    Rewards *r = NULL;
    char err[512] = "";
    CHECK(rewards_create(&r, names, 5, &o, err, sizeof err) == 0);
    if (!r) {
        fprintf(stderr, "rewards_create: %s\n", err);
        failures++;
        return;
    }
    CHECK(rewards_count(r) == 5);
    for (int i = 0; i < 5; i++) CHECK(strcmp(rewards_name(r, (size_t)i), names[i]) == 0);
    CHECK(rewards_name(r, 5) == NULL);

    json_t *cols_a = json_pack("{s:s}", "answer", "12"), *cols_none = json_object();
    RewardSample s[3] = {
        {.completion = "<answer>12</answer>", .completion_tokens = 5, .columns = cols_a},
        {.completion = "<think>x</think> 13 <answer>13</answer>", .completion_tokens = 8, .columns = cols_a},
        {.completion = "<answer>12</answer>\n", .completion_tokens = 12, .columns = cols_none},
    };
    const size_t ld = 7;  // room for two more columns after the built-ins
    double scores[3 * 7];
    for (size_t i = 0; i < 3 * ld; i++) scores[i] = 123.0;
    CHECK(rewards_score(r, s, 3, scores, ld, err, sizeof err) == 0);
    // sample 0: right answer, regex full match, no think, 5 of 10 tokens, not over 10 - 4.
    CHECK(scores[0 * ld + 0] == 1.0 && scores[0 * ld + 1] == 1.0 && scores[0 * ld + 2] == 0.0);
    CHECK(scores[0 * ld + 3] == -0.5 && scores[0 * ld + 4] == 0.0);
    // sample 1: wrong answer, regex does not match the whole text, think ok, 8 tokens: (6 - 8) / 4.
    CHECK(scores[1 * ld + 0] == 0.0 && scores[1 * ld + 1] == 0.0 && scores[1 * ld + 2] == 1.0);
    CHECK(scores[1 * ld + 3] == -0.8 && scores[1 * ld + 4] == -0.5);
    // sample 2: no answer column -> NaN; the trailing newline is outside the pattern, so no full match (as
    // Python's re.fullmatch); 12 > 10 tokens.
    CHECK(isnan(scores[2 * ld + 0]) && scores[2 * ld + 1] == 0.0 && scores[2 * ld + 4] == -1.0);
    CHECK(scores[2 * ld + 3] == -1.2);
    for (size_t i = 0; i < 3; i++) CHECK(scores[i * ld + 5] == 123.0 && scores[i * ld + 6] == 123.0);
    CHECK(rewards_score(r, s, 3, scores, 4, err, sizeof err) != 0 && strstr(err, "ld"));
    rewards_free(r);

    // regex in search mode finds the tag inside the longer text.
    const char *rx[] = {"regex_format"};
    o.format_regex_search = 1;
    CHECK(rewards_create(&r, rx, 1, &o, err, sizeof err) == 0);
    CHECK(rewards_score(r, s, 2, scores, 1, err, sizeof err) == 0);
    CHECK(scores[0] == 1.0 && scores[1] == 1.0);
    rewards_free(r);
    o.format_regex_search = 0;
    o.format_regex = "(?s)<think>.*</think>.*";  // inline DOTALL works
    CHECK(rewards_create(&r, rx, 1, &o, err, sizeof err) == 0);
    RewardSample t = {.completion = "<think>a\nb</think>\nc"};
    CHECK(rewards_score(r, &t, 1, scores, 1, err, sizeof err) == 0 && scores[0] == 1.0);
    rewards_free(r);
    o.format_regex = "<think>.*</think>.*";  // without it "." stops at the newline, as in Python
    CHECK(rewards_create(&r, rx, 1, &o, err, sizeof err) == 0);
    CHECK(rewards_score(r, &t, 1, scores, 1, err, sizeof err) == 0 && scores[0] == 0.0);
    rewards_free(r);
    // Invalid UTF-8 in a completion is not an error (PCRE2_MATCH_INVALID_UTF).
    o.format_regex = "ab";
    CHECK(rewards_create(&r, rx, 1, &o, err, sizeof err) == 0);
    RewardSample bad = {.completion = "a\xff" "b"};
    CHECK(rewards_score(r, &bad, 1, scores, 1, err, sizeof err) == 0 && scores[0] == 0.0);
    rewards_free(r);

    // n = 0 builds an empty set.
    CHECK(rewards_create(&r, NULL, 0, &o, err, sizeof err) == 0 && rewards_count(r) == 0);
    rewards_free(r);

    // Refusals, each naming the option.
    const char *unknown[] = {"answer_matchh"};
    expect_create_refused(__LINE__, unknown, 1, &o, "unknown built-in reward 'answer_matchh'");
    const char *twice[] = {"think_format", "think_format"};
    expect_create_refused(__LINE__, twice, 2, &o, "'think_format' is listed twice");
    RewardOptions b = o;
    b.format_regex = NULL;
    expect_create_refused(__LINE__, rx, 1, &b, "format_regex");
    b.format_regex = "(unclosed";
    expect_create_refused(__LINE__, rx, 1, &b, "format_regex: the pattern does not compile");
    const char *so[] = {"soft_overlong"};
    b = o;
    b.soft_punish_cache = 0;
    expect_create_refused(__LINE__, so, 1, &b, "soft_punish_cache");
    b.soft_punish_cache = 11;
    expect_create_refused(__LINE__, so, 1, &b, "soft_punish_cache");
    b = o;
    b.max_completion_length = 0;
    expect_create_refused(__LINE__, so, 1, &b, "max_completion_length");
    const char *lp[] = {"length_penalty"};
    b = o;
    b.length_penalty_coef = -1;
    expect_create_refused(__LINE__, lp, 1, &b, "length_penalty_coef");
    b = o;
    b.length_penalty_target = 10;
    expect_create_refused(__LINE__, lp, 1, &b, "length_penalty_target");
    const char *am[] = {"answer_match"};
    b = o;
    b.answer_column = "";
    expect_create_refused(__LINE__, am, 1, &b, "answer_column");
    json_decref(cols_a);
    json_decref(cols_none);
}

int main(void) {
    test_extract();
    test_numbers();
    test_answer_match();
    test_think_and_lengths();
    test_set();
    return check_exit_code("test_trainer_rewards");
}
