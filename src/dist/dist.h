// Several processes (issue #17): process groups from LibTorch's c10d, started from the variables torchrun and SLURM
// launchers set, and the layer sharding of a model over them (a pipeline: each rank holds contiguous layers, passes
// its activations forward and their gradients back).
#pragma once

#include "model/model.h"
#include "train/loss.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace voodoo::dist {

/// torchrun's rendezvous variables (https://pytorch.org/docs/stable/elastic/run.html, "Environment variables"):
/// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
struct launch_env {
    int rank = 0;
    int world_size = 1;
    int local_rank = 0;
    std::string master_addr = "127.0.0.1";
    int master_port = 29500;
};

/// The variables of this process, or nullopt when WORLD_SIZE is unset (a single process). Throws voodoo::error naming
/// the variable when one is malformed or missing beside WORLD_SIZE, or RANK is outside [0, WORLD_SIZE).
std::optional<launch_env> launch_env_from_environment();

/// True when this build has c10d's Gloo process group (its gloo headers were found at configure time).
bool have_gloo();

/// A c10d process group over TCP: a TCPStore at master_addr:master_port (rank 0 hosts it) and Gloo's transport, for
/// tensors on the CPU. Every collective blocks until done.
class process_group {
public:
    /// Joins the group; waits up to `timeout` for every rank. Throws voodoo::error naming MASTER_ADDR/MASTER_PORT
    /// when the rendezvous fails, or when this build has no Gloo (have_gloo()).
    process_group(const launch_env & env, std::chrono::seconds timeout = std::chrono::seconds(120));
    ~process_group();
    process_group(const process_group &) = delete;
    process_group & operator=(const process_group &) = delete;

    int rank() const { return rank_; }
    int size() const { return size_; }

    /// Point to point: `t` (contiguous, CPU) to rank `dst`; `recv` fills `t` (its shape and dtype must match what was
    /// sent) from rank `src`. `tag` tells apart messages between the same two ranks.
    void send(const torch::Tensor & t, int dst, int tag);
    void recv(torch::Tensor & t, int src, int tag);
    /// In-place sum over every rank of each tensor (CPU), element by element (one flat buffer per dtype on the wire).
    void all_reduce_sum(std::vector<torch::Tensor> & tensors);
    void barrier();

private:
    struct impl;
    std::unique_ptr<impl> p_;
    int rank_ = 0, size_ = 1;
};

/// Contiguous layer ranges for `ranks` ranks, balanced by bytes (issue #17): layer i weighs layer_bytes[i] (its
/// candidates' and teacher's bytes); rank r gets [first_r, end_r), in order, each non-empty, minimising the largest
/// rank's bytes (the linear partition problem, solved exactly by dynamic programming over the prefix sums).
/// `extra_first` and `extra_last` are the bytes the first rank holds besides its layers (the embedding) and the last
/// (the output head). Throws voodoo::error when there are fewer layers than ranks.
std::vector<std::pair<int64_t, int64_t>> balance_layers(const std::vector<int64_t> & layer_bytes, int ranks,
                                                        int64_t extra_first = 0, int64_t extra_last = 0);

/// One forward and backward of the distillation loss with the model's layers sharded over the ranks of `pg` (a
/// pipeline, GPipe's schedule with one micro-batch): rank r holds layers `layers` = [first, end) of its
/// balance_layers entry, the first rank also the embedding, the last the output norm, the head and the loss. The
/// teacher's and the student's residual streams go forward rank to rank (send/recv), the gradient of the student's
/// stream comes back; then the gradients of `gates` (every rank's leaves, the same on every rank; undefined grads
/// count as 0) are summed over the ranks, so each rank ends with every gate's whole gradient. With one rank (pg null
/// or of size 1) it is chunked_distill after hidden(). Returns CE and KL on every rank.
///
/// Exactness: each rank runs the same operations as the single process on its layers, and the gradient entering a
/// rank's first layer is the single process's, so every gate gradient is bit for bit the single process's, except
/// where one gate is used on two ranks (a head tied to the embedding): there the two parts are summed once, a + b,
/// which is what the single process does too. Tests: tests/test_dist.cpp.
/// tokens [B, T] int64 (CPU); the compute dtype of `model` is that of the streams sent.
distill_values sharded_distill_step(causal_lm & model, const torch::Tensor & tokens, weight_source & teacher,
                                    weight_source & student, process_group * pg, std::pair<int64_t, int64_t> layers,
                                    double lambda_kl, int64_t chunk, std::vector<torch::Tensor> & gates);

}  // namespace voodoo::dist
