// shared/safetensors.h — reading and writing Hugging Face safetensors model files (docs/model-files.md).
//
// File format: 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {str: str}, "<tensor>": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...}
// then the data section; offsets are relative to the data section's start (byte 8 + N).
//
// Reader: a model folder holds model.safetensors, or model.safetensors.index.json ({"weight_map": {tensor: file}})
// plus its shard files. Every file is mmap'ed read-only and its header validated before any tensor is handed out;
// tensor data stays in the mapping until st_close. Every error message names the file and, where there is one,
// the tensor.
//
// Writer: collects (name, shape, source data) and writes model.safetensors, or shards
// model-0000i-of-0000N.safetensors plus model.safetensors.index.json when the total exceeds a maximum shard size.
// Files are written under a temporary name and renamed into place, so a crash never leaves a half-written model.
#ifndef TANDEM_SHARED_SAFETENSORS_H
#define TANDEM_SHARED_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define ST_ERR_INVALID (-1)  // a file's content is refused (corrupt, inconsistent or unsupported)
#define ST_ERR_IO      (-2)  // a file cannot be opened, mapped, read or written
#define ST_ERR_NOMEM   (-3)

#define ST_MAX_DIMS 8
#define ST_MAX_HEADER_BYTES 100000000ull   // the reference implementation's limit

// Every dtype the safetensors format defines. Any of them may be listed in a file; only F32, F16 and BF16 can be
// read as model parameters (st_read_f32 / st_read_bf16 refuse the others, naming the tensor).
typedef enum {
    ST_BOOL = 0, ST_U8, ST_I8, ST_F8_E5M2, ST_F8_E4M3, ST_F8_E5M2FNUZ, ST_F8_E4M3FNUZ, ST_F8_E8M0,
    ST_F4, ST_F6_E2M3, ST_F6_E3M2,
    ST_I16, ST_U16, ST_F16, ST_BF16,
    ST_I32, ST_U32, ST_F32,
    ST_I64, ST_U64, ST_F64, ST_C64,
    ST_DTYPE_COUNT
} StDtype;

const char *st_dtype_name(StDtype dtype);          // "BF16", ...
int st_dtype_bits(StDtype dtype);                   // 4, 6, 8, 16, 32 or 64
int st_dtype_from_name(const char *name, StDtype *out);  // 0, or -1 for a name the format does not define

typedef struct {
    const char *name;               // owned by the set
    StDtype dtype;
    int ndim;                       // 0 (scalar) .. ST_MAX_DIMS
    int64_t shape[ST_MAX_DIMS];
    uint64_t numel;                 // product of shape (1 for a scalar)
    const void *data;               // inside the read-only mapping; only byte alignment is guaranteed
    size_t nbytes;                  // numel * dtype bits / 8
    const char *file;               // file name inside the model folder, e.g. "model-00001-of-00002.safetensors"
    const char *path;               // the same file as opened (folder/file), used in messages
} StTensor;

typedef struct SafetensorsSet SafetensorsSet;

// Opens a model folder (model.safetensors preferred, as transformers does, else model.safetensors.index.json and
// its shards), or a single .safetensors file when model_dir names a regular file. Duplicate tensor names across
// shards, an index naming a missing file or a tensor its file lacks, and every header defect are refused.
int st_open(SafetensorsSet **out, const char *model_dir, char *err, size_t err_len);
// Validates an in-memory safetensors file named file_name (for messages). The buffer is not copied: it must stay
// alive and unchanged until st_close. Used by the fuzzer and by tests.
int st_parse_buffer(SafetensorsSet **out, const void *buf, size_t len, const char *file_name, char *err,
                    size_t err_len);
void st_close(SafetensorsSet *set);

size_t st_count(const SafetensorsSet *set);
const StTensor *st_tensor_at(const SafetensorsSet *set, size_t i);   // sorted by name
const StTensor *st_find(const SafetensorsSet *set, const char *name); // NULL when absent

// 0 when the tensor's dtype is a parameter dtype (F32, F16, BF16), else an error naming tensor, file and dtype.
int st_check_param(const StTensor *t, char *err, size_t err_len);
// 0 when the tensor has exactly this shape, else an error naming tensor and file with both shapes.
int st_check_shape(const StTensor *t, int ndim, const int64_t *shape, char *err, size_t err_len);
// Converts a parameter tensor to fp32 (exact for BF16, F16, F32). n must equal t->numel.
int st_read_f32(const StTensor *t, float *dst, size_t n, char *err, size_t err_len);
// Converts a parameter tensor to bf16 bit patterns (F32 and F16 rounded to nearest even). n must equal t->numel.
int st_read_bf16(const StTensor *t, uint16_t *dst, size_t n, char *err, size_t err_len);

// ---- writer ---------------------------------------------------------------------------------------------

typedef struct StWriter StWriter;

int st_writer_create(StWriter **out, char *err, size_t err_len);
void st_writer_free(StWriter *w);
// Queues a tensor stored as `dtype` (F32, BF16 or F16), converted from `data`, which holds numel elements of
// `src_dtype` (F32, BF16 or F16). `data` is read only by st_writer_write: keep it alive until then.
// Refuses an empty or reserved name, more than ST_MAX_DIMS dims, a negative dim, or an unsupported dtype.
int st_writer_add(StWriter *w, const char *name, StDtype dtype, int ndim, const int64_t *shape, const void *data,
                  StDtype src_dtype, char *err, size_t err_len);
// Writes every queued tensor (sorted by name) into dir (created if missing). With max_shard_bytes == 0 or a total
// that fits, one model.safetensors; otherwise shards of at most max_shard_bytes each (a larger tensor gets a
// shard of its own) and model.safetensors.index.json. The other layout's entry file (a stale index, or a stale
// model.safetensors that transformers would pick first) is removed. Duplicate names are refused here.
int st_writer_write(StWriter *w, const char *dir, uint64_t max_shard_bytes, char *err, size_t err_len);

#endif
