#include "ggml/quant.h"
#include "ggml/types.h"
#include "test_util.h"
#include "train/candidates.h"
#include "train/gated.h"

#include <gtest/gtest.h>

using namespace voodoo;

namespace {

gated_tensor make_gated(const gguf_file & f, const std::string & name, const std::vector<ggml_type> & types) {
    gated_tensor g;
    g.tensor = &f.tensor(name);
    g.types = types;
    for (ggml_type t : types) {
        g.bytes.push_back(quantize_tensor(f, *g.tensor, t, {}));
    }
    g.gate = torch::tensor({0.3f, -0.2f, 0.5f, 0.1f}).slice(0, 0, static_cast<int64_t>(types.size())).clone();
    g.gate.set_requires_grad(true);
    return g;
}

// A loss that is not linear in W: ||X·Wᵀ||² in double.
double loss_of(const torch::Tensor & w, const torch::Tensor & x) {
    return torch::mm(x, w.to(torch::kDouble).t()).pow(2).sum().item<double>();
}

// The same mixture in double precision from ggml's to_float of each candidate, for finite differences
// free of f32 rounding.
torch::Tensor mixture_f64(const torch::Tensor & gate, const gated_tensor & g) {
    const auto p = torch::softmax(gate.to(torch::kDouble), 0);
    const int64_t rows = g.tensor->n_rows(), ne0 = g.tensor->ne[0];
    torch::Tensor w = torch::zeros({rows, ne0}, torch::kDouble);
    for (size_t k = 0; k < g.types.size(); ++k) {
        auto d = dequantize(g.types[k], g.bytes[k], ne0);
        w += p[static_cast<int64_t>(k)] * torch::from_blob(d.data(), {rows, ne0}).to(torch::kDouble);
    }
    return w;
}

}  // namespace

TEST(gated, the_mixture_is_the_probability_weighted_sum_of_dequantized_candidates) {
    gguf_file f(test::stories260k());
    auto g = make_gated(f, "blk.0.ffn_gate.weight", {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, GGML_TYPE_F16});
    const auto p = torch::softmax(g.gate, 0);
    const auto w = gated_mixture(p, g);
    ASSERT_EQ(w.sizes(), (std::vector<int64_t>{172, 64}));
    torch::Tensor want = torch::zeros({172, 64});
    for (size_t k = 0; k < 3; ++k) {
        auto d = dequantize(g.types[k], g.bytes[k], 64);
        want += p[static_cast<int64_t>(k)].item<float>() * torch::from_blob(d.data(), {172, 64}).clone();
    }
    EXPECT_TRUE(torch::allclose(w, want, 1e-6, 1e-6));
    // One-hot gates give exactly ggml's to_float of the candidate.
    const auto one_hot = gated_mixture(torch::tensor({0.0f, 1.0f, 0.0f}), g);
    auto q8 = dequantize(GGML_TYPE_Q8_0, g.bytes[1], 64);
    EXPECT_TRUE(torch::equal(one_hot, torch::from_blob(q8.data(), {172, 64})));
}

TEST(gated, the_gate_gradient_matches_finite_differences) {
    gguf_file f(test::stories260k());
    auto g = make_gated(f, "blk.1.attn_q.weight", {GGML_TYPE_Q4_0, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0});
    torch::manual_seed(3);
    const auto x = torch::randn({16, 64}, torch::kDouble);
    const auto w = gated_mixture(torch::softmax(g.gate, 0), g);
    torch::mm(x, w.to(torch::kDouble).t()).pow(2).sum().backward();
    const auto analytic = g.gate.grad().to(torch::kDouble).clone();
    const double eps = 1e-4;
    for (int64_t k = 0; k < 4; ++k) {
        torch::NoGradGuard no_grad;
        auto plus = g.gate.detach().to(torch::kDouble).clone();
        auto minus = plus.clone();
        plus[k] += eps;
        minus[k] -= eps;
        const double fd = (loss_of(mixture_f64(plus, g), x) - loss_of(mixture_f64(minus, g), x)) / (2 * eps);
        const double a = analytic[k].item<double>();
        EXPECT_LE(std::abs(a - fd), 1e-3 * std::abs(fd)) << "k=" << k << " analytic " << a << " fd " << fd;
    }
    // grad_p holds ⟨∂L/∂W, deq(Q_k)⟩ for every candidate.
    ASSERT_TRUE(g.grad_p.defined());
    EXPECT_EQ(g.grad_p.numel(), 4);
}

TEST(gated, rows_mix_only_the_rows_asked_for_with_the_same_gradient_rule) {
    gguf_file f(test::stories260k());
    auto g = make_gated(f, "token_embd.weight", {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0});
    const auto ids = torch::tensor({5, 17, 5, 300}, torch::kLong);
    const auto p = torch::softmax(g.gate, 0);
    const auto rows = gated_mixture_rows(p, ids, g);
    const auto full = gated_mixture(p.detach(), g);
    EXPECT_TRUE(torch::allclose(rows, full.index_select(0, ids), 1e-6, 1e-6));
    rows.pow(2).sum().backward();
    const auto grad_rows = g.gate.grad().clone();
    g.gate.grad().zero_();
    auto p2 = torch::softmax(g.gate, 0);
    gated_mixture(p2, g).index_select(0, ids).pow(2).sum().backward();
    EXPECT_TRUE(torch::allclose(grad_rows, g.gate.grad(), 1e-4, 1e-5));
    EXPECT_THROW(gated_mixture_rows(p.detach(), torch::tensor({512}, torch::kLong), g), std::exception);
}

TEST(gated, the_reference_path_equals_the_cpu_path_in_value_and_gate_gradient) {
    // The reference path (dense candidates, plain LibTorch) is the oracle of the GPU's fused kernels; here
    // it is checked against the streaming CPU path on the CPU, in f32.
    gguf_file f(test::stories260k());
    auto cpu = make_gated(f, "blk.1.attn_q.weight", {GGML_TYPE_Q4_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0});
    auto ref = make_gated(f, "blk.1.attn_q.weight", {GGML_TYPE_Q4_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0});
    const int64_t dense_bytes = place_candidates(ref, mixture_path::reference, torch::kCPU, torch::kFloat, torch::kFloat);
    EXPECT_EQ(dense_bytes, 3 * 64 * 64 * 4);
    torch::manual_seed(11);
    const auto x = torch::randn({8, 64});
    auto loss = [&](gated_tensor & g) {
        const auto w = gated_mixture(torch::softmax(g.gate, 0), g);
        torch::mm(x, w.t()).pow(2).sum().backward();
        return w.detach();
    };
    const auto w_cpu = loss(cpu), w_ref = loss(ref);
    EXPECT_TRUE(torch::allclose(w_cpu, w_ref, 1e-6, 1e-6));
    EXPECT_TRUE(torch::allclose(cpu.gate.grad(), ref.gate.grad(), 1e-4, 1e-5)) << cpu.gate.grad() << ref.gate.grad();
    // Rows of the embedding: the same rule over the rows used.
    auto ecpu = make_gated(f, "token_embd.weight", {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0});
    auto eref = make_gated(f, "token_embd.weight", {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0});
    place_candidates(eref, mixture_path::reference, torch::kCPU, torch::kFloat, torch::kFloat);
    const auto ids = torch::tensor({3, 400, 3, 17}, torch::kLong);
    const auto r_cpu = gated_mixture_rows(torch::softmax(ecpu.gate, 0), ids, ecpu);
    const auto r_ref = gated_mixture_rows(torch::softmax(eref.gate, 0), ids, eref);
    EXPECT_TRUE(torch::allclose(r_cpu, r_ref, 1e-6, 1e-6));
    r_cpu.pow(2).sum().backward();
    r_ref.pow(2).sum().backward();
    EXPECT_TRUE(torch::allclose(ecpu.gate.grad(), eref.gate.grad(), 1e-4, 1e-5));
}

TEST(gated, paths_a_build_or_device_cannot_run_are_refused_by_name) {
    gguf_file f(test::stories260k());
    auto g = make_gated(f, "blk.1.attn_q.weight", {GGML_TYPE_Q4_0});
    EXPECT_NE(test::error_of([] { parse_mixture_path("dense"); }).find("--mixture 'dense'"), std::string::npos);
#if !defined(VOODOO_HAVE_CUDA)
    EXPECT_NE(test::error_of([&] { place_candidates(g, mixture_path::fused, torch::kCPU, torch::kFloat, torch::kFloat); })
                  .find("CUDA build"),
              std::string::npos);
#else
    EXPECT_NE(test::error_of([&] { place_candidates(g, mixture_path::fused, torch::kCPU, torch::kFloat, torch::kFloat); })
                  .find("CUDA device"),
              std::string::npos);
#endif
}
