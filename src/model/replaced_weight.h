// A weight_source that answers one tensor with a tensor of the caller's (header-only).
#pragma once

#include "model/weights.h"

#include <string>

namespace voodoo {

/// `base` with one tensor answered by a given tensor instead: the source model with one tensor quantized
/// (the sensitivity probe), or the student with its head weight detached (the chunked loss).
class replaced_weight : public weight_source {
public:
    explicit replaced_weight(weight_source & base) : base_(base) {}
    replaced_weight(weight_source & base, std::string name, torch::Tensor w) : base_(base) { set(std::move(name), std::move(w)); }

    /// From now on `name` is answered with w (same layout as get(name) would give).
    void set(std::string name, torch::Tensor w) {
        name_ = std::move(name);
        w_ = std::move(w);
    }

    torch::Tensor get(const std::string & name) override { return name == name_ ? w_ : base_.get(name); }
    torch::Tensor rows(const std::string & name, const torch::Tensor & ids) override {
        return name == name_ ? w_.index_select(0, ids.reshape({-1})) : base_.rows(name, ids);
    }
    bool has(const std::string & name) const override { return base_.has(name); }
    /// The base decides how to multiply (per-token routing of a gated student applies to the stand-in too).
    torch::Tensor product_with(const std::string & name, const torch::Tensor & x, const torch::Tensor & w) override {
        return base_.product_with(name, x, w);
    }
    /// The base's draws (a recomputed layer sets them back: blocks.h run_layer).
    std::vector<uint64_t> draw_state() const override { return base_.draw_state(); }
    void set_draw_state(const std::vector<uint64_t> & state) override { base_.set_draw_state(state); }

private:
    weight_source & base_;
    std::string name_;
    torch::Tensor w_;
};

}  // namespace voodoo
