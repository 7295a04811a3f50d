// Several processes (issue #17): process groups from LibTorch's c10d, started from the variables torchrun and SLURM
// launchers set, and the layer sharding of a model over them (a pipeline: each rank holds contiguous layers, passes
// its activations forward and their gradients back).
#pragma once

#include "ggml/gguf.h"
#include "model/model.h"
#include "train/gated.h"
#include "train/loss.h"

#include <torch/torch.h>

#include <array>
#include <chrono>
#include <deque>
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

/// A TCP port on 127.0.0.1 that nobody listens on now (the kernel's pick for port 0): MASTER_PORT for ranks this
/// process starts itself. Throws voodoo::error when no socket can be bound.
int free_tcp_port();

/// True when this build has c10d's Gloo process group (its gloo headers were found at configure time).
bool have_gloo();

/// True when this build has c10d's NCCL process group: a CUDA build against a LibTorch built with USE_C10D_NCCL
/// (PyTorch's own CUDA wheels are; Debian's CPU LibTorch is not) with nccl.h found at configure time.
bool have_nccl();

/// A c10d process group over TCP: a TCPStore at master_addr:master_port (rank 0 hosts it) and one of c10d's
/// backends: NCCL on `device` when it is a CUDA device and the build has NCCL (have_nccl()), else Gloo, whose
/// transport carries host memory (a CUDA tensor is staged through it). Each rank passes its own device
/// (cuda:LOCAL_RANK, one GPU a rank: NCCL refuses two ranks on one GPU). Every collective is done when it returns
/// (Gloo) or ordered before any later work on the device's current stream (NCCL; a later copy to the host waits).
class process_group {
public:
    /// Joins the group; waits up to `timeout` for every rank (the rendezvous and every collective). Throws
    /// voodoo::error naming MASTER_ADDR/MASTER_PORT when the rendezvous fails, or naming what to install when this
    /// build has no backend for `device` (neither NCCL nor Gloo).
    process_group(const launch_env & env, std::chrono::seconds timeout = std::chrono::seconds(120),
                  torch::Device device = torch::kCPU);
    ~process_group();
    process_group(const process_group &) = delete;
    process_group & operator=(const process_group &) = delete;

    /// "nccl" or "gloo".
    const char * backend() const;
    int rank() const { return rank_; }
    int size() const { return size_; }

    /// Point to point: `t` (any device; moved to the backend's: host memory for Gloo, the group's GPU for NCCL) to
    /// rank `dst`; `recv` fills `t` (its shape and dtype must match what was sent) from rank `src`. `tag` tells apart
    /// messages between the same two ranks under Gloo; NCCL matches them in order (its point to point has no tags),
    /// so the receiver must receive in the order the sender sends, as every caller here does.
    void send(const torch::Tensor & t, int dst, int tag);
    void recv(torch::Tensor & t, int src, int tag);
    /// In-place sum over every rank of each tensor (any device), element by element (one flat buffer per dtype on the
    /// wire; 16-bit floats summed in f32 and rounded once after).
    void all_reduce_sum(std::vector<torch::Tensor> & tensors);
    /// In-place element-wise maximum over every rank of `t` (any device).
    void all_reduce_max(torch::Tensor & t);
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

/// balance_layers for a GGUF: layer i weighs the elements of its blk.i.* tensors, the first rank also token_embd's and
/// the last every other tensor (the output norm and head). Throws voodoo::error as balance_layers does.
std::vector<std::pair<int64_t, int64_t>> balance_layers_of(const gguf_file & file, int ranks);

/// Whether a layer-sharded rank holding layers `layers` = [first, end) of `n_layer` uses the GGUF tensor `name` in
/// sharded_distill_step: blk.i.* for i in [first, end); token_embd on the first rank, and on the last too when the head
/// is tied to it (`tied_head`); every other tensor (the output norm, the head) on the last rank. The split
/// balance_layers_of weighs. A name "blk.<i>." whose i is not a number counts as no layer's (false).
bool layer_shard_uses(const std::string & name, std::pair<int64_t, int64_t> layers, int64_t n_layer, bool tied_head);

/// One rank's place in a pipeline of layer-sharded ranks (issue #17), for the forwards that are not training steps:
/// the probe and the selection's recipes (train/probe.h), whose every forward then runs rank to rank, so a rank reads
/// the teacher's and the candidates' weights of its own layers only. `layers` holds every rank's [first, end)
/// (balance_layers_of), so any rank knows where a forward that changes one tensor starts.
struct layer_pipeline {
    process_group * pg = nullptr;
    std::vector<std::pair<int64_t, int64_t>> layers;  // [rank] → [first, end), contiguous from 0 to n_layer
    int64_t n_layer = 0;
    bool tied_head = false;  // the head is token_embd (no output.weight)

    int rank() const;
    int size() const;
    /// This rank's [first, end).
    std::pair<int64_t, int64_t> mine() const { return layers.at(static_cast<size_t>(rank())); }
    /// Whether this rank reads tensor `name` in a forward (layer_shard_uses).
    bool uses(const std::string & name) const;
    /// The rank where a forward that differs from the source's only in `name` must start: the rank of layer l for
    /// "blk.l.…", the last rank for an untied head (output.weight: only the logits change), else the first.
    int start_of(const std::string & name) const;
    /// The one rank that counts `name` in a sum over ranks: the rank of its layer, the first rank for token_embd (also
    /// used by the last when tied), the last for every other tensor.
    int owner_of(const std::string & name) const;
};

/// Checks that every rank of `pg` passed the same `value` (a hash of its options and inputs; two collectives).
/// Throws voodoo::error on every rank, naming `what`, when any two differ.
void require_same_on_every_rank(process_group & pg, uint64_t value, const std::string & what);

/// Sums every gate's gradient over the ranks of `pg` (one all-reduce; an undefined gradient counts as 0), so every
/// rank ends with the whole gradient of every gate.
void sum_gate_gradients(process_group & pg, std::vector<torch::Tensor> & gates);

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
/// `scale`, `extra` and `lambda_ce` as chunked_distill's (the last rank backpropagates `extra`); with reduce_gates
/// false the gate gradients stay this rank's part (the trainer sums them once after accumulating micro-batches).
distill_values sharded_distill_step(causal_lm & model, const torch::Tensor & tokens, weight_source & teacher,
                                    weight_source & student, process_group * pg, std::pair<int64_t, int64_t> layers,
                                    double lambda_kl, int64_t chunk, std::vector<torch::Tensor> & gates,
                                    double scale = 1.0, const torch::Tensor & extra = {}, double lambda_ce = 1.0,
                                    bool reduce_gates = true);

/// Tensor parallelism (issue #17) over a process group: Megatron's f and g as autograd functions whose collectives
/// are c10d's (Gloo on the CPU). Every rank must run the same forwards and backwards in the same order (the
/// collectives pair up by order). The group must outlive every graph built with it.
class group_tensor_parallel : public tensor_parallel {
public:
    explicit group_tensor_parallel(process_group & pg) : pg_(pg) {}
    int rank() const override { return pg_.rank(); }
    int size() const override { return pg_.size(); }
    torch::Tensor copy_to(const torch::Tensor & x) const override;
    torch::Tensor reduce_from(const torch::Tensor & x) const override;
    torch::Tensor max_over(const torch::Tensor & x) const override;
    process_group & group() const { return pg_; }

private:
    process_group & pg_;
};

/// The shard of a full tensor `t` (PyTorch layout, as weight_source::get gives it) that rank `rank` of `size` holds
/// under tp_split_of(name): column- and vocabulary-parallel tensors keep rows tp_range(rows), row-parallel ones
/// columns tp_range(ne0); replicated ones whole. A view of `t`, so gradients flow back into the full tensor.
torch::Tensor tp_shard(const std::string & name, const torch::Tensor & t, int rank, int size);

/// One rank's view of a full weight_source under tensor parallelism: get() gives tp_shard of the full tensor,
/// rows() of a vocabulary-parallel tensor takes ids local to the rank's part of the vocabulary. For dense weights
/// (the teacher, the student's tensors without a menu); the gated tensors are sharded by shard_gated_tensor, so a
/// rank holds only its part of the candidates.
class tp_shard_source : public weight_source {
public:
    /// n_vocab: rows of the vocabulary-parallel tensors (model_hparams::n_vocab).
    tp_shard_source(weight_source & full, int64_t n_vocab, int rank, int size)
        : full_(full), n_vocab_(n_vocab), rank_(rank), size_(size) {}
    torch::Tensor get(const std::string & name) override;
    torch::Tensor rows(const std::string & name, const torch::Tensor & ids) override;
    bool has(const std::string & name) const override { return full_.has(name); }

private:
    weight_source & full_;
    int64_t n_vocab_;
    int rank_, size_;
};

/// Under tensor parallelism over `size` ranks: "" when every type of `types` fits every rank's part of tensor `t`
/// (row-parallel tensors are cut inside their rows, which must fall on the types' block boundaries), else the first
/// that does not, naming the tensor, the type, the rank's columns and what would work. The trainer asks before any
/// work.
std::string tp_split_problem(const gguf_tensor & t, const std::vector<ggml_type> & types, int size);

/// The shape (ggml order) of rank `rank`'s shard of tensor `t` under tensor parallelism over `size` ranks
/// (tp_split_of): rows tp_range_of(ne1) for column- and vocabulary-parallel tensors, columns tp_range_of(ne0) for
/// row-parallel ones, a replicated tensor whole. What shard_gated_tensor's candidates hold (bytes: tensor_bytes of it).
std::array<int64_t, 4> tp_shard_ne(const gguf_tensor & t, int rank, int size);

/// The candidates of rank `rank` of `size` for one gated tensor under tensor parallelism: the same menu, each
/// candidate's bytes cut to the rank's shard (tp_split_of: whole rows for column- and vocabulary-parallel tensors;
/// for row-parallel ones the blocks of each row inside the rank's columns), so that deq of the shard's bytes is the
/// shard of deq of the whole: the bytes llama.cpp quantized, not a re-quantization. The shard's gguf_tensor (name,
/// type, shape) is appended to `shapes`, which must outlive the result. The gate is not copied (set it).
/// Throws voodoo::error naming the tensor and the type when a row-parallel shard does not start and end on a block
/// boundary of a type of the menu (what would: a menu whose blocks divide the shard, or fewer ranks).
gated_tensor shard_gated_tensor(const gated_tensor & full, int rank, int size, std::deque<gguf_tensor> & shapes);

/// One forward and backward of the distillation loss under tensor parallelism: `model` set_tensor_parallel(tp),
/// `teacher` and `student` this rank's shards (tp_shard_source, gated_weights over shard_gated_tensor). Returns the
/// replicated CE and KL; then every gate's gradient (`gates`, the same leaves on every rank; every gated tensor is
/// split, so each rank holds the gradient of its shard) is summed over the ranks, so each rank ends with the whole
/// gradient. With a null or 1-rank tp, chunked_distill after hidden().
/// Exactness: the values and gradients are the single process's up to the order of sums (row-parallel products,
/// the gradient sums of f, the cross-rank log-sum-exp, the gates' sums over ranks). Tests: tests/test_dist.cpp.
distill_values tp_distill_step(causal_lm & model, const torch::Tensor & tokens, weight_source & teacher,
                               weight_source & student, const group_tensor_parallel * tp, double lambda_kl,
                               int64_t chunk, std::vector<torch::Tensor> & gates);

}  // namespace voodoo::dist
