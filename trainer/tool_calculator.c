// trainer/tool_calculator.c — recursive-descent arithmetic (grammar in tool_calculator.h).
#include "trainer/tool_calculator.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef __int128 i128;

typedef struct {
    int is_int;
    i128 i;
    double d;
} Value;

typedef struct {
    const char *s;
    size_t pos;
    int depth;
    char *err;       // the message, once something failed
    size_t err_len;
    int failed;
} Parser;

static void fail(Parser *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(Parser *p, const char *fmt, ...) {
    if (p->failed) return;
    p->failed = 1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->err, p->err_len, fmt, ap);
    va_end(ap);
}

static double as_double(Value v) { return v.is_int ? (double)v.i : v.d; }
static Value from_int(i128 i) { return (Value){.is_int = 1, .i = i}; }
static Value from_double(double d) { return (Value){.is_int = 0, .d = d}; }

static void skip_space(Parser *p) {
    while (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' || p->s[p->pos] == '\n' || p->s[p->pos] == '\r') p->pos++;
}

// Consumes op when the text continues with it.
static int accept(Parser *p, const char *op) {
    skip_space(p);
    size_t n = strlen(op);
    if (strncmp(p->s + p->pos, op, n) != 0) return 0;
    p->pos += n;
    return 1;
}

static void unexpected(Parser *p) {
    skip_space(p);
    char c = p->s[p->pos];
    if (!c) fail(p, "the expression ends too early (a number or '(' is missing at the end)");
    else fail(p, "unexpected '%c' at position %zu (use numbers, + - * / %% // ^ ** and parentheses)", c, p->pos + 1);
}

static Value parse_expr(Parser *p);
static Value parse_unary(Parser *p);

static int is_digit(char c) { return c >= '0' && c <= '9'; }

static Value parse_number(Parser *p) {
    skip_space(p);
    const char *start = p->s + p->pos;
    size_t k = 0;
    int is_int = 1;
    while (is_digit(start[k])) k++;
    size_t int_digits = k;
    if (start[k] == '.') {
        is_int = 0;
        k++;
        while (is_digit(start[k])) k++;
        if (k == 1) {
            unexpected(p);
            return from_int(0);
        }
    } else if (int_digits == 0) {
        unexpected(p);
        return from_int(0);
    }
    if (start[k] == 'e' || start[k] == 'E') {
        size_t e = k + 1;
        if (start[e] == '+' || start[e] == '-') e++;
        if (is_digit(start[e])) {
            is_int = 0;
            while (is_digit(start[e])) e++;
            k = e;
        }
    }
    p->pos += k;
    if (is_int) {
        i128 v = 0;
        for (size_t i = 0; i < k; i++)
            if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, start[i] - '0', &v)) {
                fail(p, "the number at position %zu has too many digits (integers up to 38 digits)",
                     (size_t)(start - p->s) + 1);
                return from_int(0);
            }
        return from_int(v);
    }
    char buf[128];
    if (k >= sizeof buf) {
        fail(p, "the number at position %zu is too long", (size_t)(start - p->s) + 1);
        return from_int(0);
    }
    memcpy(buf, start, k);
    buf[k] = '\0';
    return from_double(strtod(buf, NULL));
}

static Value parse_atom(Parser *p) {
    if (accept(p, "(")) {
        if (++p->depth > CALCULATOR_MAX_DEPTH) {
            fail(p, "parentheses nested deeper than %d", CALCULATOR_MAX_DEPTH);
            return from_int(0);
        }
        Value v = parse_expr(p);
        p->depth--;
        if (!p->failed && !accept(p, ")")) {
            skip_space(p);
            if (p->s[p->pos]) unexpected(p);
            else fail(p, "a ')' is missing at the end");
        }
        return v;
    }
    return parse_number(p);
}

static Value power(Parser *p, Value a, Value b) {
    if (a.is_int && b.is_int && b.i >= 0) {
        i128 r = 1, base = a.i, e = b.i;
        while (e > 0) {
            if ((e & 1) && __builtin_mul_overflow(r, base, &r)) goto big;
            e >>= 1;
            if (e > 0 && __builtin_mul_overflow(base, base, &base)) goto big;
        }
        return from_int(r);
    big:
        fail(p, "the power is larger than 38 digits");
        return from_int(0);
    }
    if (as_double(a) == 0 && as_double(b) < 0) {
        fail(p, "zero cannot be raised to a negative power");
        return from_int(0);
    }
    return from_double(pow(as_double(a), as_double(b)));
}

static Value parse_power(Parser *p) {
    Value a = parse_atom(p);
    if (p->failed) return a;
    if (accept(p, "**") || accept(p, "^")) {
        Value b = parse_unary(p);
        if (p->failed) return a;
        return power(p, a, b);
    }
    return a;
}

static Value parse_unary(Parser *p) {
    if (++p->depth > CALCULATOR_MAX_DEPTH) {
        fail(p, "signs and parentheses nested deeper than %d", CALCULATOR_MAX_DEPTH);
        return from_int(0);
    }
    Value v;
    if (accept(p, "-")) {
        v = parse_unary(p);
        if (v.is_int) {
            if (__builtin_sub_overflow((i128)0, v.i, &v.i)) fail(p, "the result is larger than 38 digits");
        } else {
            v.d = -v.d;
        }
    } else if (accept(p, "+")) {
        v = parse_unary(p);
    } else {
        v = parse_power(p);
    }
    p->depth--;
    return v;
}

// Python's floor division and modulo on integers.
static int floor_divmod(Parser *p, i128 a, i128 b, i128 *q, i128 *r) {
    if (b == 0) {
        fail(p, "division by zero");
        return -1;
    }
    i128 min = (i128)((unsigned __int128)1 << 127);
    if (a == min && b == -1) {
        fail(p, "the result is larger than 38 digits");
        return -1;
    }
    *q = a / b;
    *r = a % b;
    if (*r != 0 && ((*r < 0) != (b < 0))) {
        (*q)--;
        *r += b;
    }
    return 0;
}

static Value binary(Parser *p, char op, Value a, Value b) {
    if (a.is_int && b.is_int) {
        i128 r = 0, q, m;
        int over = 0;
        switch (op) {
        case '+': over = __builtin_add_overflow(a.i, b.i, &r); break;
        case '-': over = __builtin_sub_overflow(a.i, b.i, &r); break;
        case '*': over = __builtin_mul_overflow(a.i, b.i, &r); break;
        case '/':
            if (b.i == 0) {
                fail(p, "division by zero");
                return from_int(0);
            }
            if (floor_divmod(p, a.i, b.i, &q, &m) != 0) return from_int(0);
            if (m == 0) return from_int(q);
            return from_double((double)a.i / (double)b.i);
        case 'q':
        case '%':
            if (floor_divmod(p, a.i, b.i, &q, &m) != 0) return from_int(0);
            return from_int(op == 'q' ? q : m);
        }
        if (over) {
            fail(p, "the result is larger than 38 digits");
            return from_int(0);
        }
        return from_int(r);
    }
    double x = as_double(a), y = as_double(b);
    switch (op) {
    case '+': return from_double(x + y);
    case '-': return from_double(x - y);
    case '*': return from_double(x * y);
    case '/':
        if (y == 0) {
            fail(p, "division by zero");
            return from_int(0);
        }
        return from_double(x / y);
    default: fail(p, "%s needs integers", op == '%' ? "%" : "//"); return from_int(0);
    }
}

static Value parse_term(Parser *p) {
    Value v = parse_unary(p);
    while (!p->failed) {
        char op;
        if (accept(p, "**")) {  // only reachable as a stray operator: parse_power takes the valid ones
            p->pos -= 2;
            unexpected(p);
            break;
        } else if (accept(p, "*")) op = '*';
        else if (accept(p, "//")) op = 'q';
        else if (accept(p, "/")) op = '/';
        else if (accept(p, "%")) op = '%';
        else break;
        Value r = parse_unary(p);
        if (p->failed) break;
        v = binary(p, op, v, r);
    }
    return v;
}

static Value parse_expr(Parser *p) {
    Value v = parse_term(p);
    while (!p->failed) {
        char op;
        if (accept(p, "+")) op = '+';
        else if (accept(p, "-")) op = '-';
        else break;
        Value r = parse_term(p);
        if (p->failed) break;
        v = binary(p, op, v, r);
    }
    return v;
}

static void print_int(i128 v, char *out, size_t out_len) {
    char buf[48];
    size_t n = 0;
    unsigned __int128 u = v < 0 ? (unsigned __int128)0 - (unsigned __int128)v : (unsigned __int128)v;
    do {
        buf[n++] = (char)('0' + (int)(u % 10));
        u /= 10;
    } while (u);
    size_t k = 0;
    if (v < 0 && k + 1 < out_len) out[k++] = '-';
    while (n && k + 1 < out_len) out[k++] = buf[--n];
    out[k] = '\0';
}

// The shortest %g form that reads back to d, with ".0" on whole numbers (as Python prints floats).
static void print_double(double d, char *out, size_t out_len) {
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(out, out_len, "%.*g", prec, d);
        if (strtod(out, NULL) == d) break;
    }
    if (!strpbrk(out, ".e")) strncat(out, ".0", out_len - strlen(out) - 1);
}

int calculator_eval(const char *expr, char *out, size_t out_len) {
    if (!expr) {
        snprintf(out, out_len, "no expression given");
        return -1;
    }
    size_t n = strlen(expr);
    if (n > CALCULATOR_MAX_CHARS) {
        snprintf(out, out_len, "the expression is %zu characters long; at most %d", n, CALCULATOR_MAX_CHARS);
        return -1;
    }
    Parser p = {.s = expr, .err = out, .err_len = out_len};
    Value v = parse_expr(&p);
    if (!p.failed) {
        skip_space(&p);
        if (p.s[p.pos] == ')') fail(&p, "unmatched ')' at position %zu", p.pos + 1);
        else if (p.s[p.pos]) unexpected(&p);
    }
    if (p.failed) return -1;
    if (v.is_int) {
        print_int(v.i, out, out_len);
    } else if (!isfinite(v.d)) {
        snprintf(out, out_len, "the result is not a finite number");
        return -1;
    } else {
        print_double(v.d, out, out_len);
    }
    return 0;
}
