// Generation speed per weight type on this machine, for `voodoo quantize --max-slowdown` (issue #20): a token of
// generation reads every matmul weight once (a matrix-vector product each), so its time is about Σ over those
// tensors of weights × the type's seconds per weight. The table is measured once per machine and thread count with
// ggml's own CPU backend, the one libllama runs, and kept in the user's cache.
#pragma once

#include "ggml/gguf.h"
#include "ggml/types.h"

#include <map>
#include <string>
#include <vector>

namespace voodoo {

struct type_speed_table {
    int threads = 0;
    std::string machine;                          // the CPU's model name and core count (/proc/cpuinfo)
    std::map<ggml_type, double> seconds_per_weight;  // one mat-vec product, per weight
};

/// The table for `types` on `threads` threads (0 = every core): read from `path` when it holds every type for this
/// machine and thread count, else the missing types measured and the file rewritten (atomically). Each type: a
/// [4096 × R] weight in that type (64 quantized rows of normal(0, 1) values with unit importance, repeated so the
/// weight is ≈ 64 MiB, larger than the CPU's caches, as a model's weights are) times an f32 vector, in ggml's CPU
/// backend with `threads` threads; after one warm-up, the best of 5 runs, divided by the weights. "" as path: no
/// file. Throws voodoo::error when ggml has no CPU backend or the file cannot be written.
type_speed_table load_or_measure_type_speeds(const std::vector<ggml_type> & types, int threads, const std::string & path);

/// Where load_or_measure_type_speeds keeps the table by default: $XDG_CACHE_HOME/voodoo (else ~/.cache/voodoo)
/// /type-speed-t<threads>.json.
std::string default_speed_table_path(int threads);

/// The tensors a generated token reads whole: every 2-D `blk.*` weight, `output.weight`, and `token_embd.weight`
/// when it is the tied head (else a token reads one row of it).
bool read_per_token(const gguf_file & src, const gguf_tensor & t);

/// Predicted seconds of one generated token's matmuls for src with `type_of` (tensor name → type; tensors not in it
/// at their type in src). Throws voodoo::error naming a type the table lacks.
double predicted_token_seconds(const gguf_file & src, const std::map<std::string, ggml_type> & type_of,
                               const type_speed_table & table);

}  // namespace voodoo
