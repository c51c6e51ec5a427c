// trainer/eval.h — `tandem-train eval`: a held-out JSONL scored through any OpenAI-compatible server with the
// built-in rewards; prints the mean of every reward and pass@k, with progress.
#ifndef TANDEM_TRAINER_EVAL_H
#define TANDEM_TRAINER_EVAL_H

// argv[0] is "eval". Returns the process exit code.
int eval_main(int argc, char **argv);

#endif
