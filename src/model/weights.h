// How a model's forward pass gets its weights. The teacher reads the source GGUF's tensors as they
// are; the gated student (src/train) answers the selectable ones with its mixture of candidates.
// The forward never knows which: it asks by GGUF tensor name.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace voodoo {

class weight_source {
public:
    virtual ~weight_source() = default;

    /// The whole tensor in PyTorch layout: a GGUF tensor of ne = [ne0, ne1] is returned as
    /// [ne1, ne0] (rows = output features), f32 or the compute dtype. 1-D tensors as [ne0].
    /// Throws voodoo::error naming the tensor when the model has no such tensor.
    virtual torch::Tensor get(const std::string & name) = 0;

    /// Rows `ids` ([n] int64) of a 2-D tensor, [n, ne0]: embeddings, so that only the rows a batch
    /// uses are materialised (the student mixes only those rows).
    virtual torch::Tensor rows(const std::string & name, const torch::Tensor & ids) = 0;

    /// Experts `ids` ([U] int64, each in [0, ne2)) of a 3-D expert tensor (GGUF ne = [ne0, ne1, ne2], ne2 experts):
    /// [U, ne1, ne0], in get(name)'s dtype and device. A mixture-of-experts layer asks only for the experts its
    /// tokens were routed to (blocks.h moe_ffn). The default selects them from get(name); the gated student forms
    /// only those experts' mixture (issue #18). Throws voodoo::error naming the tensor for an id out of range.
    virtual torch::Tensor experts(const std::string & name, const torch::Tensor & ids) {
        const torch::Tensor all = get(name);
        return all.index_select(0, ids.to(all.device(), torch::kLong));
    }

    /// True when the model has the tensor (optional tensors: biases, output.weight when tied).
    virtual bool has(const std::string & name) const = 0;

    /// y = x · Wᵀ with W the 2-D tensor `name` ([ne1, ne0]): x [..., ne0] → y [..., ne1], W taken in `dtype` on x's
    /// device. Every matmul with a weight goes through here (blocks.cpp `linear`). The default multiplies by
    /// get(name); the gated student under per-token routing (train/gated.h, `routing_mode::ptqr`) overrides
    /// product_with instead.
    virtual torch::Tensor product(const std::string & name, const torch::Tensor & x, torch::ScalarType dtype) {
        return product_with(name, x, get(name).to(x.device(), dtype));
    }

    /// The same product with the weight given by the caller: `w` ([ne1, ne0], x's dtype and device) is get(name)
    /// or a stand-in for it that the backward flows into (the chunked loss's detached head). The default is
    /// x · wᵀ. Under per-token routing the gated student answers each token with the candidate it was routed to
    /// and lets w (the mixture) carry the backward: the straight-through estimator.
    virtual torch::Tensor product_with(const std::string & name, const torch::Tensor & x, const torch::Tensor & w) {
        (void)name;
        return torch::matmul(x, w.t());
    }

    /// The position of the random draws that get/rows/experts/product_with make (the gated student's Gumbel noise
    /// and per-token routes; empty for sources that draw nothing). Recomputing a layer in the backward
    /// (blocks.h run_layer) sets it back to where the layer's forward began, so the recomputed layer sees the same
    /// draws as the forward it replaces, then restores it. Only the counters: the seeds and modes the draws depend on
    /// must stay as they were until the backward (the trainer sets them once per step).
    virtual std::vector<uint64_t> draw_state() const { return {}; }
    virtual void set_draw_state(const std::vector<uint64_t> & state) { (void)state; }
};

}  // namespace voodoo
