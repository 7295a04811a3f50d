// The distillation loss over the vocabulary a chunk of positions at a time: the logits of a long
// sequence (B·T·V floats, 2.5 GB for one 2048-token sequence of a 151,936-token vocabulary) are never all
// alive at once, neither the student's nor the teacher's.
#pragma once

#include "model/model.h"

namespace voodoo {

struct distill_values {
    double ce = 0;   // mean next-token cross-entropy of the student, nats, over B·(T−1) positions
    double kl = 0;   // mean KL(teacher ‖ student), nats, over B·T positions
};

/// From the last hidden states of the student h_s and the teacher h_t ([B, T, n_embd] each, same device)
/// and the tokens [B, T]: CE and KL, with the head applied to `chunk` positions at a time (model.head, so
/// an architecture's logit transform applies). Logits and softmax are f32.
///
/// When `scale` ≠ 0 and h_s requires grad, also backpropagates scale · (λ_CE · CE + λ_KL · KL) through the
/// student: per chunk into a detached copy of h_s and of the student's head weight, then once through
/// the whole graph (`extra`, a scalar to add to the same backward, e.g. the size penalty, may be undefined).
/// The head weight is asked of `student` once (one mixture for a gated head).
/// Throws voodoo::error when shapes disagree or chunk < 1.
distill_values chunked_distill(causal_lm & model, const torch::Tensor & h_s, weight_source & student,
                               const torch::Tensor & h_t, weight_source & teacher, const torch::Tensor & tokens,
                               double lambda_kl, double scale, int64_t chunk, const torch::Tensor & extra = {},
                               double lambda_ce = 1.0);

/// Positions per chunk so that one chunk's f32 logits hold about `budget_bytes` (at least 1).
int64_t distill_chunk(int64_t n_vocab, int64_t budget_bytes);

/// The positions per chunk of the CE/KL when --loss-chunk is 0: one chunk's f32 logits [chunk, n_vocab] about 512 MB
/// on a GPU (PyTorch's caching allocator keeps the blocks), at most 31 MiB on the CPU. There each chunk's logits,
/// log-probabilities and their products come from malloc, and glibc maps every block of 32 MiB or more afresh and
/// unmaps it at free (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, mallopt(3)), so larger chunks fault in their pages at every
/// chunk. Measured on the 2-core machine (docs/BENCHMARKS.md, session 35): mix30M's CPU run 179 s with 512 MB chunks,
/// 96 s with 31 MiB ones (256 positions; 104 s at 128, 126 s at 64: the head is read once per chunk), peak RSS 2.2 →
/// 1.0 GiB. At least 1.
int64_t default_loss_chunk(int64_t n_vocab, bool on_gpu);

}  // namespace voodoo
