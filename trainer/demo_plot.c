// trainer/demo_plot.c — the demo's SVG chart (see trainer/demo.h). Plain SVG 1.1 text, no library: a plot area
// with a grid, x = GRPO step, y = 0..100 %, one polyline per series (id "reward", id "accuracy"), a marker
// with a <title> tooltip on every accuracy point, axis labels, a title and a legend.
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "trainer/demo.h"

enum { W = 760, H = 440, LEFT = 70, RIGHT = 30, TOP = 50, BOTTOM = 60 };

static double px(double x, int max_step) { return LEFT + (W - LEFT - RIGHT) * (max_step > 0 ? x / max_step : 0); }
static double py(double y) { return TOP + (H - TOP - BOTTOM) * (1.0 - (y < 0 ? 0 : y > 1 ? 1 : y)); }

// A step between x ticks giving at most ~10 ticks: 1, 2, 5 times a power of ten.
static int tick_step(int max_step) {
    for (int p = 1;; p *= 10) {
        if (max_step <= 10 * p) return p;
        if (max_step <= 20 * p) return 2 * p;
        if (max_step <= 50 * p) return 5 * p;
    }
}

static void escape(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '&') fputs("&amp;", f);
        else if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else fputc(*s, f);
    }
}

static void series(FILE *f, const char *id, const char *color, const DemoSeries *s, int max_step, int markers) {
    fprintf(f, "<polyline id=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"", id, color);
    for (int i = 0; i < s->n; i++) fprintf(f, "%s%.1f,%.1f", i ? " " : "", px(s->x[i], max_step), py(s->y[i]));
    fprintf(f, "\"/>\n");
    if (!markers) return;
    fprintf(f, "<g id=\"%s-points\" fill=\"%s\">\n", id, color);
    for (int i = 0; i < s->n; i++)
        fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\"><title>step %g: %.1f %%</title></circle>\n",
                px(s->x[i], max_step), py(s->y[i]), s->x[i], 100 * s->y[i]);
    fprintf(f, "</g>\n");
}

int demo_write_svg(const char *path, const char *title, const DemoSeries *reward, const DemoSeries *accuracy,
                   int max_step, char *err, size_t err_len) {
    FILE *f = fopen(path, "w");
    if (!f) {
        snprintf(err, err_len, "cannot write %s: %s", path, strerror(errno));
        return -1;
    }
    if (max_step < 1) max_step = 1;
    const double x0 = LEFT, x1 = W - RIGHT, y0 = TOP, y1 = H - BOTTOM;
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"%d\" height=\"%d\" "
               "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n"
               "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
               W, H, W, H);
    fprintf(f, "<text id=\"title\" x=\"%d\" y=\"28\" text-anchor=\"middle\" font-size=\"15\">", W / 2);
    escape(f, title);
    fprintf(f, "</text>\n<g id=\"grid\" stroke=\"#dddddd\" stroke-width=\"1\">\n");
    for (int k = 0; k <= 10; k += 2) fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", x0, py(k / 10.0), x1, py(k / 10.0));
    int ts = tick_step(max_step);
    for (int s = 0; s <= max_step; s += ts)
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", px(s, max_step), y0, px(s, max_step), y1);
    fprintf(f, "</g>\n<g id=\"axes\" stroke=\"black\" stroke-width=\"1\">\n"
               "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n"
               "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n</g>\n",
            x0, y1, x1, y1, x0, y0, x0, y1);
    fprintf(f, "<g id=\"y-ticks\" text-anchor=\"end\">\n");
    for (int k = 0; k <= 10; k += 2) fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">%d %%</text>\n", x0 - 6, py(k / 10.0) + 4, 10 * k);
    fprintf(f, "</g>\n<g id=\"x-ticks\" text-anchor=\"middle\">\n");
    for (int s = 0; s <= max_step; s += ts) fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">%d</text>\n", px(s, max_step), y1 + 18, s);
    fprintf(f, "</g>\n<text id=\"x-label\" x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">GRPO step</text>\n"
               "<text id=\"y-label\" transform=\"translate(18 %.1f) rotate(-90)\" text-anchor=\"middle\">"
               "mean reward / held-out accuracy</text>\n",
            (x0 + x1) / 2, H - 16, (y0 + y1) / 2);
    series(f, "reward", "#1f77b4", reward, max_step, 0);
    series(f, "accuracy", "#d62728", accuracy, max_step, 1);
    // Legend in the lower right, where both curves usually are not (they start low on the left and end high).
    double lx = x1 - 250, ly = y1 - 58;
    fprintf(f, "<g id=\"legend\">\n<rect x=\"%.1f\" y=\"%.1f\" width=\"240\" height=\"48\" fill=\"white\" "
               "stroke=\"#999999\"/>\n"
               "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#1f77b4\" stroke-width=\"2\"/>\n"
               "<text x=\"%.1f\" y=\"%.1f\">mean reward (training rollouts)</text>\n"
               "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#d62728\" stroke-width=\"2\"/>\n"
               "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"#d62728\"/>\n"
               "<text x=\"%.1f\" y=\"%.1f\">held-out accuracy (greedy, HTTP)</text>\n</g>\n</svg>\n",
            lx, ly, lx + 10, ly + 16, lx + 40, ly + 16, lx + 48, ly + 20, lx + 10, ly + 34, lx + 40, ly + 34, lx + 25,
            ly + 34, lx + 48, ly + 38);
    if (fclose(f) != 0) {
        snprintf(err, err_len, "cannot write %s: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}
