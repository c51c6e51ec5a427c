// trainer/tool_calculator.h — the built-in "calculator" tool: evaluates an arithmetic expression, no eval.
//
// Grammar (white space anywhere between tokens):
//   expr   := term (('+' | '-') term)*
//   term   := unary (('*' | '/' | '%' | '//') unary)*
//   unary  := ('+' | '-') unary | power
//   power  := atom (('^' | '**') unary)?            right-associative, binds tighter than unary minus on its left
//   atom   := number | '(' expr ')'
//   number := digits ['.' digits] [('e' | 'E') ['+' | '-'] digits]   also '.5' and '5.'
// Integers are exact (128-bit: up to about 1.7e38; beyond that is an error, not a rounded answer): + - * % //,
// ^ with an exponent >= 0, and / when it divides evenly. Everything else is a double, printed with the fewest
// digits that read back to the same value (as Python's repr). % and // follow Python (floor), on integers only.
#ifndef TANDEM_TRAINER_TOOL_CALCULATOR_H
#define TANDEM_TRAINER_TOOL_CALCULATOR_H

#include <stddef.h>

#define CALCULATOR_MAX_CHARS 1000   // longer expressions are refused
#define CALCULATOR_MAX_DEPTH 64     // parentheses and unary signs nested deeper are refused

// Evaluates expr. 0 with the result text in out, or -1 with a message in out saying what is wrong and where
// (the message is meant for the policy: it reads it as the tool's answer).
int calculator_eval(const char *expr, char *out, size_t out_len);

#endif
