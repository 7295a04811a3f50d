// A causal language model built straight from a GGUF: its hyper-parameters and a forward that asks a
// weight_source for every tensor by its GGUF name, so the same model serves as teacher (the file's own
// weights) and student (gated mixtures of quantized candidates).
#pragma once

#include "model/blocks.h"
#include "model/hparams.h"
#include "model/weights.h"

#include <memory>

namespace voodoo {

class causal_lm {
public:
    virtual ~causal_lm() = default;

    /// tokens [B, T] int64 (ids < n_vocab; every sequence starts at position 0) → logits [B, T, n_vocab] f32,
    /// on tokens' device: head(hidden(tokens)). Holds no autograd state of its own: gradients flow only into
    /// what `w` returns. With set_recompute_layers, the graph refers to this model and to `w` until the backward,
    /// which asks `w` for the layers' weights again: both must outlive it, and `w`'s settings must not change before. Throws voodoo::error when tokens is not [B, T] int64 or an id is out of range.
    torch::Tensor forward(const torch::Tensor & tokens, weight_source & w);

    /// The last hidden states, after the output norm: tokens [B, T] → [B, T, n_embd] in the compute dtype.
    /// The loss code applies the head itself, a chunk of positions at a time (never all logits at once).
    virtual torch::Tensor hidden(const torch::Tensor & tokens, weight_source & w) = 0;

    /// Layer sharding (issue #17): layers [first, end) of hidden(), for a pipeline of ranks that each hold some
    /// layers. `input` undefined: start from the tokens' embeddings (first must be 0); else the residual stream
    /// entering layer `first`, [B, T, n_embd] in the compute dtype. Returns the residual stream leaving layer end − 1,
    /// or, when end = n_layer, hidden()'s output (after the output norm). The same arithmetic as hidden() on those
    /// layers, so a pipeline of calls over [0, a), [a, b), …, [z, n_layer) gives hidden() bit for bit. tokens [B, T]
    /// are still needed (positions). Throws voodoo::error for a range outside [0, n_layer] or an input of the
    /// wrong shape.
    torch::Tensor hidden_layers(const torch::Tensor & tokens, const torch::Tensor & input, int64_t first, int64_t end,
                                weight_source & w);

    /// Logits of hidden states x [..., n_embd] → [..., n_vocab] f32 through the output head (the observer
    /// sees it). Architectures with a logit transform (soft-capping, scaling) override it.
    virtual torch::Tensor head(const torch::Tensor & x, weight_source & w);

    /// The GGUF name of the output head's weight: "output.weight", or "token_embd.weight" when tied.
    std::string head_weight() const { return hp_.tied_output ? "token_embd.weight" : "output.weight"; }

    const model_hparams & hparams() const { return hp_; }

    /// Tensor parallelism (issue #17): from now on this model is rank tp->rank()'s part of a tensor-parallel group of
    /// tp->size(): its hyper-parameters hold this rank's heads (n_head, n_head_kv: divided by the size) and FFN width
    /// (n_ff: its part by tp_range_of), every forward asks its weight_source for this rank's shards (tp_split_of; dist::tp_shard_source
    /// gives them) and communicates through `tp` (forward_context::tp). `tp` must outlive the model's forwards.
    /// For the dense architectures llama, qwen2 and qwen3. Throws voodoo::error naming the architecture, or the key
    /// whose count the size does not divide (what would: a size that divides it).
    void set_tensor_parallel(const tensor_parallel * tp);
    const tensor_parallel * tensor_parallel_group() const { return tp_; }

    /// Compute dtype of activations and weights inside the forward: torch::kFloat (default) or
    /// torch::kBFloat16 (norms, rope and softmax stay f32). Throws voodoo::error for other dtypes.
    void set_compute_dtype(torch::ScalarType dtype);
    torch::ScalarType compute_dtype() const { return dtype_; }

    /// Activation checkpointing (blocks.h run_layer) in every later forward that records autograd: each layer keeps only
    /// its input and runs again in the backward. Off by default. The training step sets it when the activations of
    /// every layer would not fit (train_options::recompute).
    void set_recompute_layers(bool on) { recompute_ = on; }
    bool recompute_layers() const { return recompute_; }

    /// Called before every weight matmul (see matmul_observer); an empty function removes it.
    void set_observer(matmul_observer observer) { observer_ = std::move(observer); }

    /// Mixture of experts: every later forward routes its MoE layers to these experts ([B·T, n_expert_used] int64
    /// per MoE layer, in order; see forward_context) instead of their own choice; empty = their own (the default).
    void set_forced_experts(std::vector<torch::Tensor> experts) { forced_experts_ = std::move(experts); }
    /// Mixture of experts: when not null, every later forward appends its routing to *log; null stops it.
    void set_routing_log(expert_routing * log) { routing_log_ = log; }

protected:
    explicit causal_lm(model_hparams hp) : hp_(std::move(hp)) {}

    forward_context context(weight_source & w) const {
        forward_context c{w, dtype_, observer_ ? &observer_ : nullptr, forced_experts_.empty() ? nullptr : &forced_experts_,
                          routing_log_};
        c.input = range_input_.defined() ? &range_input_ : nullptr;
        c.tp = tp_;
        c.n_vocab = hp_.n_vocab;
        c.first_layer = range_first_;
        c.end_layer = range_end_;
        c.moe_layer = hp_.n_expert > 0 ? range_first_ : 0;  // every layer of the MoE architectures is MoE
        c.recompute = recompute_;
        return c;
    }
    /// Throws voodoo::error unless tokens is [B, T] int64 with T ≥ 1.
    void check_tokens(const torch::Tensor & tokens) const;

    model_hparams hp_;

private:
    torch::ScalarType dtype_ = torch::kFloat;
    matmul_observer observer_;
    std::vector<torch::Tensor> forced_experts_;
    expert_routing * routing_log_ = nullptr;
    bool recompute_ = false;
    const tensor_parallel * tp_ = nullptr;
    torch::Tensor range_input_;   // hidden_layers' range, for the duration of one call
    int64_t range_first_ = 0;
    int64_t range_end_ = -1;
};

}  // namespace voodoo
