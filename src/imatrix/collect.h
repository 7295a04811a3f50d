// `voodoo imatrix`: Σx² per input column of every matmul weight, collected by libllama's eval callback on the
// graph llama.cpp itself runs — llama-imatrix's statistic, for every architecture libllama supports.
#pragma once

#include "imatrix/imatrix.h"

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace voodoo {

namespace dist {
class process_group;
}

struct imatrix_options {
    std::string model;          // source GGUF
    std::string data_dir;       // a `voodoo data` folder; its train split is used
    int64_t max_chunks = 0;     // use the first max_chunks train chunks; 0 = all
    int n_threads = 0;          // 0 = all cores
};

/// Runs the model (libllama, CPU backend) over the train chunks of `data_dir`, one chunk per llama_decode with
/// logits for every position (so the output head runs on every token), the KV cache cleared between chunks and
/// kept in f32 with flash attention off (llama-imatrix's default f16 cache rounds K/V; here nothing is rounded
/// here that the weights do not round), and
/// collects what llama-imatrix --process-output collects (tools/imatrix/imatrix.cpp collect_imatrix):
///   - every GGML_OP_MUL_MAT whose weight (src0) is `blk.*` or `output.weight`, activations (src1) f32 with at
///     least 16 rows: in_sum2[col] += x[col]² over every row x in f32, counts += rows / n_mat;
///   - every GGML_OP_MUL_MAT_ID (MoE experts): per routed expert, in_sum2[expert, col] += x[col]², counts[expert]++.
/// chunk_size = the data's ctx, chunk_count = chunks run, datasets = the data's source files.
/// Throws voodoo::error when the tokens were made with another vocabulary, ctx < 16 (llama-imatrix skips such
/// batches), the model cannot be loaded, a decode fails, or an activation is not finite.
imatrix collect_imatrix(const imatrix_options & options);

/// The same statistic from Voodoo's LibTorch forward of the model (src/model: the architectures the runtime
/// supports) on `device`, for a GPU where libllama's CPU backend would take minutes (a 1.7B model: 7 min 19 s for
/// 128 chunks of 512 on 16 cores, docs/BENCHMARKS.md). The same chunks, the same matmuls (every weight of a
/// `blk.*` matmul, the output head under its own name or token_embd.weight when tied), the same counts; compute in
/// f32, each chunk's Σx² summed in f64 on the device and rounded to f32 once. Against libllama's it differs by
/// the two forwards' parity (tests/test_imatrix_torch.cpp bounds it). Chunks run `batch_tokens / ctx` at a time
/// (at least one). Expert tensors (qwen3moe, qwen35moe) count as llama.cpp's MUL_MAT_ID does: per expert, the Σx²
/// and the number of the tokens routed to it (moe_ffn's observer calls).
/// Throws voodoo::error as collect_imatrix does, and naming the tensor when a column sum is not finite.
///
/// Several ranks (issue #17; `pg` of N ranks, every rank calling with the same options): rank r runs the forwards
/// r, r + N, … (each of the single process's batches of chunks, whole), and one all-reduce sums every entry's f64
/// column sums and its counts; every rank returns the whole imatrix. The counts equal the single process's exactly;
/// the f64 sums differ from it only in the order of at most n_forwards additions of non-negative terms (relative
/// error ≤ γ_n in f64, Higham), far below half an f32 ulp, so each rounded column is the single process's or one
/// f32 ulp from it.
/// With `layers` true (`--parallel layers`: a model larger than one GPU) every forward runs rank to rank instead:
/// rank r holds the contiguous layers dist::balance_layers_of gives it (the first rank the embedding, the last the
/// output norm and the head), reads no other weights, runs its layers on the stream the rank before sent and passes
/// the result on. Each entry is then summed by one rank in the single process's order, and the all-reduce adds only
/// zeros to it: the single process's imatrix bit for bit (tests/test_dist.cpp).
imatrix collect_imatrix_torch(const imatrix_options & options, torch::Device device, int64_t batch_tokens = 8192,
                              dist::process_group * pg = nullptr, bool layers = false);

}  // namespace voodoo
