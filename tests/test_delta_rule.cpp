// The chunked (WY) gated delta rule of src/model/blocks.cpp against the per-token recurrence it must equal — the
// rule as ggml_gated_delta_net computes it, written here token by token in float64 as the oracle — in value and in
// gradient (finite differences of the oracle).
#include "model/blocks.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

using namespace voodoo;

namespace {

/// The oracle: per sequence and head, S ← exp(g_t)·S; δ = β_t (v_t − Sᵀk_t); S ← S + k_t δᵀ; o_t = Sᵀq_t / sqrt(d_k),
/// token by token from S = 0, in the inputs' dtype. Shapes as gated_delta_rule's.
torch::Tensor per_token_delta_rule(const torch::Tensor & q, const torch::Tensor & k, const torch::Tensor & v,
                                   const torch::Tensor & g, const torch::Tensor & beta) {
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), d_k = q.size(3), d_v = v.size(3);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d_k));
    torch::Tensor S = torch::zeros({B, H, d_k, d_v}, q.options());
    std::vector<torch::Tensor> out;
    for (int64_t t = 0; t < T; ++t) {
        const torch::Tensor kt = k.select(1, t), vt = v.select(1, t), qt = q.select(1, t);  // [B, H, d]
        S = S * g.select(1, t).exp().view({B, H, 1, 1});
        const torch::Tensor delta = beta.select(1, t).unsqueeze(-1) * (vt - (S * kt.unsqueeze(-1)).sum(-2));
        S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2);
        out.push_back((S * qt.unsqueeze(-1)).sum(-2) * scale);
    }
    return torch::stack(out, 1);  // [B, T, H, d_v]
}

struct delta_inputs {
    torch::Tensor q, k, v, g, beta;
};

/// Inputs shaped like a Qwen3.5 layer's: unit-norm q and k, decays g = −softplus(·)·a in (−1, 0), β in (0, 1).
delta_inputs random_inputs(int64_t B, int64_t T, int64_t H, int64_t d, torch::ScalarType dtype, uint64_t seed) {
    torch::manual_seed(seed);
    auto unit = [&](torch::Tensor x) { return x / x.norm(2, -1, true); };
    delta_inputs in;
    in.q = unit(torch::randn({B, T, H, d}, torch::kDouble)).to(dtype);
    in.k = unit(torch::randn({B, T, H, d}, torch::kDouble)).to(dtype);
    in.v = torch::randn({B, T, H, d}, torch::kDouble).to(dtype);
    in.g = (-torch::softplus(torch::randn({B, T, H}, torch::kDouble)) * 0.3).to(dtype);
    in.beta = torch::sigmoid(torch::randn({B, T, H}, torch::kDouble)).to(dtype);
    return in;
}

}  // namespace

TEST(delta_rule, chunked_equals_the_per_token_recurrence_within_f32_rounding) {
    // 150 tokens: two full chunks of 64 and a padded one; 2 sequences, 3 heads of 16.
    const delta_inputs in = random_inputs(2, 150, 3, 16, torch::kDouble, 1);
    const torch::Tensor oracle = per_token_delta_rule(in.q, in.k, in.v, in.g, in.beta);
    const torch::Tensor chunked = gated_delta_rule(in.q, in.k, in.v, in.g, in.beta);
    ASSERT_EQ(chunked.sizes(), oracle.sizes());
    EXPECT_EQ(chunked.scalar_type(), torch::kFloat);
    const double rel = ((chunked.to(torch::kDouble) - oracle).abs().max() / oracle.abs().max()).item<double>();
    testing::Test::RecordProperty("rel_diff", fmt::format("{:.2g}", rel));
    // f32 rounding (2^-24 ≈ 6e-8 per operation) accumulated over the ~100 sequential operations behind one output
    // (a 64-token chunk's triangular solve, a 16-long dot product, three chunk-to-chunk state updates): ≤ 1e-5.
    EXPECT_LE(rel, 1e-5);
    // The same with other chunk sizes: the chunking is an implementation detail, not the result.
    for (const int64_t chunk : {1, 7, 150, 256}) {
        const torch::Tensor other = gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, chunk);
        EXPECT_LE(((other.to(torch::kDouble) - oracle).abs().max() / oracle.abs().max()).item<double>(), 1e-5) << chunk;
    }
}

TEST(delta_rule, the_state_carries_across_chunks) {
    // Without decay and with β = 1 the first token's value is still read 200 tokens later: a chunked form that lost
    // the state between chunks would differ from the oracle by O(1), far beyond the bound above.
    delta_inputs in = random_inputs(1, 200, 1, 8, torch::kDouble, 2);
    in.g.zero_();
    const torch::Tensor oracle = per_token_delta_rule(in.q, in.k, in.v, in.g, in.beta);
    const torch::Tensor chunked = gated_delta_rule(in.q, in.k, in.v, in.g, in.beta).to(torch::kDouble);
    EXPECT_LE(((chunked - oracle).abs().max() / oracle.abs().max()).item<double>(), 1e-5);
    const torch::Tensor no_carry = torch::cat({gated_delta_rule(in.q.slice(1, 0, 64), in.k.slice(1, 0, 64), in.v.slice(1, 0, 64),
                                                                in.g.slice(1, 0, 64), in.beta.slice(1, 0, 64)),
                                               gated_delta_rule(in.q.slice(1, 64), in.k.slice(1, 64), in.v.slice(1, 64),
                                                                in.g.slice(1, 64), in.beta.slice(1, 64))},
                                              1).to(torch::kDouble);
    EXPECT_GT(((no_carry - oracle).abs().max() / oracle.abs().max()).item<double>(), 1e-2);
}

TEST(delta_rule, chunked_gradient_equals_finite_differences_of_the_per_token_recurrence) {
    // A small case over three chunks of 4 tokens (2 sequences, 2 heads of 4): the loss Σ o · R for a fixed R.
    const delta_inputs in = random_inputs(2, 10, 2, 4, torch::kDouble, 3);
    const torch::Tensor R = torch::randn({2, 10, 2, 4}, torch::kDouble);
    std::vector<torch::Tensor> xs = {in.q.clone(), in.k.clone(), in.v.clone(), in.g.clone(), in.beta.clone()};
    for (torch::Tensor & x : xs) {
        x.requires_grad_(true);
    }
    (gated_delta_rule(xs[0], xs[1], xs[2], xs[3], xs[4], 4).to(torch::kDouble) * R).sum().backward();

    // Central differences of the float64 oracle: error O(h²) ≈ 1e-12, far below the f32 gradient's own rounding.
    const double h = 1e-6;
    auto loss = [&](const std::vector<torch::Tensor> & p) { return (per_token_delta_rule(p[0], p[1], p[2], p[3], p[4]) * R).sum().item<double>(); };
    const char * names[] = {"q", "k", "v", "g", "beta"};
    for (size_t i = 0; i < xs.size(); ++i) {
        const torch::Tensor base = xs[i].detach();
        torch::Tensor fd = torch::zeros_like(base);
        for (int64_t j = 0; j < base.numel(); ++j) {
            std::vector<torch::Tensor> plus = {in.q, in.k, in.v, in.g, in.beta}, minus = plus;
            plus[i] = base.clone();
            minus[i] = base.clone();
            plus[i].view({-1})[j] += h;
            minus[i].view({-1})[j] -= h;
            fd.view({-1})[j] = (loss(plus) - loss(minus)) / (2 * h);
        }
        const double rel = ((xs[i].grad() - fd).abs().max() / fd.abs().max()).item<double>();
        testing::Test::RecordProperty(std::string("rel_diff_") + names[i], fmt::format("{:.2g}", rel));
        // The f32 backward pass: rounding 6e-8 per operation over a few hundred operations (forward and back through
        // three chunks): ≤ 1e-4.
        EXPECT_LE(rel, 1e-4) << names[i];
        EXPECT_GT(fd.abs().max().item<double>(), 1e-3) << names[i] << ": the loss must depend on it";
    }
}
