// trainer/output_dir.h — what a new run does about an earlier run in its --output-dir.
//
// tandem-train writes metrics.jsonl and checkpoint-N folders there (checkpoint-N.tmp while one is being written).
// A run that does not resume must not mix its files with an earlier run's: it would truncate the old
// metrics.jsonl and leave the old run's later checkpoints beside its own, and --resume latest would then pick
// one of those. So a run that does not resume refuses a folder holding them, or, with --overwrite-output-dir,
// deletes them first. Anything else in the folder is not tandem-train's and is left alone; an empty
// metrics.jsonl (a run that stopped before its first step) records nothing and is not an earlier run.
#ifndef TANDEM_TRAINER_OUTPUT_DIR_H
#define TANDEM_TRAINER_OUTPUT_DIR_H

#include <stddef.h>

// Rank 0, before the run writes anything. resume: the run's resume option (NULL: a new run), which continues
// the earlier run, so nothing is refused; with overwrite too, a resume folder inside dir (which overwrite would
// delete) is refused. removed gets the names deleted under overwrite, comma-separated ("" when none). Returns 0,
// or -1 with a message that says what was found and what to do.
int output_dir_prepare(const char *dir, const char *resume, int overwrite, char *removed, size_t removed_len,
                       char *err, size_t err_len);

#endif
