// `voodoo imatrix`: Σx² per input column of every matmul weight, collected by libllama's eval callback on the
// graph llama.cpp itself runs — llama-imatrix's statistic, for every architecture libllama supports.
#pragma once

#include "imatrix/imatrix.h"

#include <cstdint>
#include <string>

namespace voodoo {

struct imatrix_options {
    std::string model;          // source GGUF
    std::string data_dir;       // a `voodoo data` folder; its train split is used
    int64_t max_chunks = 0;     // use the first max_chunks train chunks; 0 = all
    int n_threads = 0;          // 0 = all cores
};

/// Runs the model (libllama, CPU backend) over the train chunks of `data_dir`, one chunk per llama_decode with
/// logits for every position (so the output head runs on every token), the KV cache cleared between chunks, and
/// collects what llama-imatrix --process-output collects (tools/imatrix/imatrix.cpp collect_imatrix):
///   - every GGML_OP_MUL_MAT whose weight (src0) is `blk.*` or `output.weight`, activations (src1) f32 with at
///     least 16 rows: in_sum2[col] += x[col]² over every row x in f32, counts += rows / n_mat;
///   - every GGML_OP_MUL_MAT_ID (MoE experts): per routed expert, in_sum2[expert, col] += x[col]², counts[expert]++.
/// chunk_size = the data's ctx, chunk_count = chunks run, datasets = the data's source files.
/// Throws voodoo::error when the tokens were made with another vocabulary, ctx < 16 (llama-imatrix skips such
/// batches), the model cannot be loaded, a decode fails, or an activation is not finite.
imatrix collect_imatrix(const imatrix_options & options);

}  // namespace voodoo
