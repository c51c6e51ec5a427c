// trainer/data.h — the training data: a JSONL file or a folder of *.jsonl shards, read by each rank for its
// own share only.
//
// Records. Every non-blank line is one JSON object (a blank or whitespace-only line is no record). A folder
// is read as the concatenation of its *.jsonl files in byte-wise name order (sub-folders are not entered).
// Record index g counts records over that concatenation from 0.
//   "prompt": a string (plain text), or a list of chat messages [{"role": ..., "content": ...}, ...]
//   "messages": a list of chat messages (instead of "prompt"; a row may not have both)
//   "completion": sft mode: the target — a string, or a list of messages when the prompt is messages.
//       An sft row with "messages" and no "completion" is a conversation: TRL's language modelling, the loss on
//       every token (its prompt, for max_prompt_length, is every message before the last, which must be
//       "assistant").
//   text_field ("text"): sft mode, a row with neither "prompt" nor "messages": language modelling on that string,
//       EOS text appended as TRL does; the loss is on every token.
//   any other key: a column, kept as JSON and handed to the rewards (answer_match reads one of them).
// Text prompts are tokenized with the tokenizer's special tokens (BOS where its post-processor adds one),
// as TRL's processing_class(text=...). Message prompts are rendered with the chat template and
// add_generation_prompt, then tokenized without special tokens (the template writes its own BOS).
// sft: as TRL's SFTTrainer for prompt/completion rows — text: tokenize prompt and prompt + completion + EOS
// token text; messages: render prompt (with generation prompt) and prompt + completion (without); the
// completion starts where the two token sequences first differ. The loss of a prompt/completion row is on its
// completion (completion_only_loss) or on every token; max_length cuts a sequence (keep_end: its last tokens),
// and a row left with no token to learn is skipped and counted as an over-long prompt is (TRL drops it).
//
// Sharding: rank r of N takes the records with g % N == r. Opening scans the files once for line starts
// (no JSON parsing) and keeps the byte offset of each of its own records, then parses and tokenizes each of its
// own records once, so that a malformed line stops the run at open, before any training step; only the offsets
// are kept, and a record is read and parsed again when it is handed out. No rank parses the dataset of another.
//
// Order: epoch e hands out the rank's records in stored order when shuffling is off; with shuffling, in a
// permutation that depends only on (seed, epoch, rank) and the shard size: a Fisher-Yates shuffle
// (i from n-1 down to 1, j uniform in [0, i] by rejection sampling) driven by splitmix64 seeded with
// seed ^ (0x9E3779B97F4A7C15 * (epoch + 1)) ^ (0xD1B54A32D192ED03 * (rank + 1)). The same seed, epoch and
// shard give the same order on every run; resuming at (epoch, position) continues it exactly.
//
// Prompts longer than max_prompt_length tokens are skipped (counted; see data_skipped) or, with
// refuse_overlong, an error naming the file, line and length. Malformed lines are errors naming file:line.
#ifndef TANDEM_TRAINER_DATA_H
#define TANDEM_TRAINER_DATA_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "shared/tokenizer/chat_template.h"
#include "shared/tokenizer/tokenizer.h"

typedef struct {
    const Tokenizer *tok;           // required
    const ChatTemplate *chat;       // required for message prompts (NULL: such a row is an error)
    const ChatRenderOptions *render; // NULL, or message prompts' render options (the tools' definitions of a
                                     // multi-turn run, trainer/tool_prompt.h); must outlive the reader
    int sft;                        // 1: rows need a completion (sft mode)
    int max_prompt_length;          // tokens; <= 0: no limit
    int refuse_overlong;            // 1: an over-long prompt is an error; 0: skipped and counted
    int rank, world_size;           // this rank's share: records with index % world_size == rank
    uint64_t seed;
    int shuffle;                    // 1: per-epoch shuffle of the shard (see above)
    // sft (TRL SFTConfig's meaning):
    const char *text_field;         // column of language-modelling rows; NULL: "text"
    int prompt_loss;                // 1: prompt/completion rows learn the prompt too (completion_only_loss false)
    int max_length;                 // > 0: sequences cut to this many tokens
    int keep_end;                   // 1: the cut keeps the last max_length tokens
} DataOptions;

typedef struct {
    json_t *prompt;                 // the row's prompt as given (string or message list), for reward services
    char *prompt_text;              // the text the model sees (template applied)
    int32_t *ids;                   // (n_ids) grpo: the prompt; sft: prompt + completion
    size_t n_ids;
    size_t prompt_len;              // leading ids that belong to the prompt (grpo: n_ids)
    size_t loss_start;              // sft: ids[i] for i >= loss_start are targets (predicted from ids[i - 1])
    json_t *columns;                // object: every key but "prompt"/"messages" (may be empty, never NULL)
    uint64_t record;                // global record index g
    char source[320];               // "file:line" for messages
} DataRow;

typedef struct DataReader DataReader;

// Opens path (a .jsonl file or a folder of them). Errors: missing path, empty folder, unreadable file,
// a shard with no record (world_size larger than the record count), a malformed record of this rank's share
// or (refuse_overlong) an over-long prompt: the first one's file:line and what is wrong, and how many more
// there are. Starts at epoch 0, position 0.
int data_open(DataReader **out, const char *path, const DataOptions *opt, char *err, size_t err_len);
void data_close(DataReader *d);

size_t data_total_records(const DataReader *d);   // every record of every rank
size_t data_shard_records(const DataReader *d);   // this rank's records

// Moves to (epoch, position): position counts records of this rank's order already handed out (skipped
// over-long prompts included). Used by resume. 0, or -1 when position > data_shard_records.
int data_seek(DataReader *d, uint64_t epoch, size_t position, char *err, size_t err_len);
void data_tell(const DataReader *d, uint64_t *epoch, size_t *position);

// Hands out the next usable record of the current epoch. Returns 1 (row filled; free with data_row_clear),
// 0 at the end of the epoch (call data_seek(d, epoch + 1, 0, ...) to go on), or a negative code with a
// message naming file:line.
int data_next(DataReader *d, DataRow *row, char *err, size_t err_len);
void data_row_clear(DataRow *row);

// Parses one record's text (a line of the file, its newline included or not) into row as data_next does for each
// record: the JSON object, its prompt / messages / completion checked, rendered and tokenized per opt (its
// tokenizer, chat template and sft; the reader's max_prompt_length and sharding are not applied here). src names
// the record in messages ("file:line"). 0 with row filled (free with data_row_clear; record and source are the
// reader's to set), or -1 with a message naming src and row left empty.
int data_parse_row(const DataOptions *opt, const char *text, size_t len, DataRow *row, const char *src, char *err,
                   size_t err_len);

// Prompts skipped for max_prompt_length since data_open.
size_t data_skipped(const DataReader *d);

#endif
