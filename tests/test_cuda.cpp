// The GPU path on the GPU machine (CUDA builds; the CPU build compiles none of this, and
// tests/test_cuda_rules.cpp checks the same dequantization rules on the CPU in CI).
#if defined(VOODOO_HAVE_CUDA)

#include "cuda/deq_rules.h"
#include "cuda/gpu.h"
#include "data/dataset.h"
#include "gate_grad_bound.h"
#include "ggml/quant.h"
#include "ggml/selection.h"
#include "ggml/types.h"
#include "test_util.h"
#include "tolerance.h"
#include "train/candidates.h"
#include "train/gated.h"
#include "train/trainer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

using namespace voodoo;
using test::matmul_bound;
using test::within_bound;

namespace {

const torch::Device k_gpu(torch::kCUDA, 0);

std::vector<float> importance(int64_t ne0) {
    auto v = test::gaussian(static_cast<size_t>(ne0), 9);
    for (float & x : v) {
        x = 0.1f + x * x;
    }
    return v;
}

std::vector<uint8_t> gaussian_quantized(ggml_type type, int64_t ne0, int64_t rows, uint32_t seed) {
    std::vector<float> w = test::gaussian(static_cast<size_t>(ne0 * rows), seed);
    for (size_t i = 0; i < w.size(); i += 97) {
        w[i] *= 20.0f;
    }
    const auto im = importance(ne0);
    return quantize(type, w, ne0, type_info_of(type).needs_imatrix ? std::span<const float>(im) : std::span<const float>());
}

// Tensor `name` of `file` with its candidates of `types` (quantized without an imatrix) placed for `path` on the GPU,
// gates {0.3, -0.2, 0.5, 0.1} (the first types.size()).
gated_tensor gpu_gated(const gguf_file & file, const std::string & name, const std::vector<ggml_type> & types,
                       mixture_path path) {
    gated_tensor g;
    g.tensor = &file.tensor(name);
    g.types = types;
    for (ggml_type t : types) {
        g.bytes.push_back(quantize_tensor(file, *g.tensor, t, {}));
    }
    g.gate = torch::tensor({0.3f, -0.2f, 0.5f, 0.1f}).slice(0, 0, static_cast<int64_t>(types.size())).to(k_gpu).requires_grad_(true);
    place_candidates(g, path, k_gpu, torch::kFloat, torch::kFloat);
    return g;
}

// Equal bit for bit, or both NaN. Index of the first difference, or -1.
int64_t first_difference(const std::vector<float> & want, const torch::Tensor & got_dev) {
    const torch::Tensor got = got_dev.to(torch::kCPU).contiguous();
    const float * g = got.data_ptr<float>();
    for (size_t i = 0; i < want.size(); ++i) {
        if (!(std::isnan(want[i]) && std::isnan(g[i])) && std::memcmp(&want[i], &g[i], 4) != 0) {
            return static_cast<int64_t>(i);
        }
    }
    return -1;
}

std::vector<ggml_type> cuda_menu_and_f32() {
    std::vector<ggml_type> t = default_menu_types();
    t.push_back(GGML_TYPE_F32);
    return t;
}

// K candidates of one random [rows, ne0] tensor, uploaded, with the dense f32 reference beside them.
struct fixture_set {
    gpu::candidate_set c;
    torch::Tensor dense;  // [K, rows, ne0] f32 on the GPU, from ggml's to_float
};

fixture_set make_set(const std::vector<ggml_type> & types, int64_t rows, int64_t ne0) {
    std::vector<std::vector<uint8_t>> bytes;
    std::vector<int> ids;
    fixture_set f;
    f.dense = torch::empty({static_cast<int64_t>(types.size()), rows, ne0});
    for (size_t k = 0; k < types.size(); ++k) {
        bytes.push_back(gaussian_quantized(types[k], ne0, rows, static_cast<uint32_t>(100 + k)));
        ids.push_back(types[k]);
        const auto d = dequantize(types[k], bytes.back(), ne0);
        f.dense[static_cast<int64_t>(k)].copy_(torch::from_blob(const_cast<float *>(d.data()), {rows, ne0}));
    }
    f.c = gpu::upload(bytes, ids, rows, ne0, k_gpu, "test");
    f.dense = f.dense.to(k_gpu);
    return f;
}

double rel_err(const torch::Tensor & got, const torch::Tensor & want) {
    return ((got.to(torch::kDouble) - want.to(torch::kDouble)).norm() / want.to(torch::kDouble).norm()).item<double>();
}

}  // namespace

TEST(cuda, every_menu_type_dequantizes_on_the_gpu_equal_to_ggml_bit_for_bit) {
    ASSERT_TRUE(torch::cuda::is_available());
    const int64_t ne0 = 1024, rows = 96;
    std::mt19937 rng(3);
    for (const ggml_type type : cuda_menu_and_f32()) {
        for (int variant = 0; variant < 2; ++variant) {
            // Quantized gaussians with outliers, then raw random bytes (every grid index, sign and scale).
            std::vector<uint8_t> bytes = gaussian_quantized(type, ne0, rows, 1);
            if (variant == 1) {
                for (auto & b : bytes) {
                    b = static_cast<uint8_t>(rng());
                }
            }
            const std::vector<float> want = dequantize(type, bytes, ne0);
            const auto c = gpu::upload({bytes}, {type}, rows, ne0, k_gpu, "t");
            const int64_t at = first_difference(want, gpu::dequantize(c, 0));
            EXPECT_EQ(at, -1) << type_name(type) << (variant ? " random bytes" : " quantized") << ": weight " << at;
        }
    }
}

TEST(cuda, the_fused_mixture_equals_the_reference_within_f32_and_bf16_rounding) {
    const std::vector<ggml_type> types = {GGML_TYPE_IQ2_XXS, GGML_TYPE_Q2_K, GGML_TYPE_IQ3_S, GGML_TYPE_Q4_K,
                                          GGML_TYPE_IQ4_XS, GGML_TYPE_Q5_0, GGML_TYPE_Q6_K, GGML_TYPE_Q8_0,
                                          GGML_TYPE_BF16};
    const int64_t rows = 512, ne0 = 2048;
    const fixture_set f = make_set(types, rows, ne0);
    for (int trial = 0; trial < 3; ++trial) {
        torch::manual_seed(trial);
        const torch::Tensor p = torch::softmax(torch::randn({static_cast<int64_t>(types.size())}) * 2, 0).to(k_gpu);
        const torch::Tensor want = torch::tensordot(p.to(torch::kDouble), f.dense.to(torch::kDouble), {0}, {0});
        const torch::Tensor w32 = gpu::mixture(f.c, p, torch::Tensor(), torch::kFloat);
        // K fmaf in f32 per weight: |Δ| ≤ γ_K·Σ_k p_k|D_k|, a few units of the last place, weight by weight.
        EXPECT_TRUE(within_bound(w32, want, matmul_bound(p, f.dense.view({f.dense.size(0), -1})).view({rows, ne0})));
        const torch::Tensor w16 = gpu::mixture(f.c, p, torch::Tensor(), torch::kBFloat16);
        EXPECT_EQ(w16.scalar_type(), torch::kBFloat16);
        // The bf16 output is the f32 accumulation rounded once, to nearest.
        EXPECT_TRUE(torch::equal(w16, w32.to(torch::kBFloat16)));
    }
    // A one-hot p gives one candidate's to_float exactly.
    torch::Tensor hot = torch::zeros({static_cast<int64_t>(types.size())}, torch::TensorOptions().device(k_gpu));
    hot[3] = 1.0f;
    EXPECT_TRUE(torch::equal(gpu::mixture(f.c, hot, torch::Tensor(), torch::kFloat), f.dense[3]));
}

TEST(cuda, the_gate_gradients_of_one_pass_equal_the_reference_for_every_candidate) {
    const std::vector<ggml_type> types = {GGML_TYPE_IQ1_S, GGML_TYPE_IQ2_S, GGML_TYPE_IQ3_XXS, GGML_TYPE_Q3_K,
                                          GGML_TYPE_IQ4_NL, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_1,
                                          GGML_TYPE_Q5_K, GGML_TYPE_F16};
    const int64_t rows = 384, ne0 = 4096;
    const fixture_set f = make_set(types, rows, ne0);
    torch::manual_seed(5);
    const torch::Tensor g = torch::randn({rows, ne0}, torch::TensorOptions().device(k_gpu));
    const torch::Tensor want = (f.dense.to(torch::kDouble) * g.to(torch::kDouble)).sum({1, 2});
    const torch::Tensor got = gpu::gate_grad(f.c, g, torch::Tensor());
    EXPECT_LT(rel_err(got, want), 1e-5) << got << want;
    // G in bf16, as the student's bf16 backward hands it over: the same up to G's own rounding.
    const torch::Tensor g16 = g.to(torch::kBFloat16);
    const torch::Tensor want16 = (f.dense.to(torch::kDouble) * g16.to(torch::kDouble)).sum({1, 2});
    EXPECT_LT(rel_err(gpu::gate_grad(f.c, g16, torch::Tensor()), want16), 1e-5);
    // Rows (the embedding of a batch), repeated ids included.
    const torch::Tensor ids = torch::tensor({5, 300, 5, 0, 383}, torch::TensorOptions().dtype(torch::kLong).device(k_gpu));
    const torch::Tensor gr = torch::randn({5, ne0}, torch::TensorOptions().device(k_gpu));
    const torch::Tensor want_r = (f.dense.index_select(1, ids).to(torch::kDouble) * gr.to(torch::kDouble)).sum({1, 2});
    EXPECT_LT(rel_err(gpu::gate_grad(f.c, gr, ids), want_r), 1e-5);
    const torch::Tensor p = torch::softmax(torch::randn({static_cast<int64_t>(types.size())}), 0).to(k_gpu);
    const torch::Tensor want_rows = torch::tensordot(p.to(torch::kDouble), f.dense.index_select(1, ids).to(torch::kDouble), {0}, {0});
    EXPECT_TRUE(within_bound(gpu::mixture(f.c, p, ids, torch::kFloat), want_rows,
                             matmul_bound(p, f.dense.index_select(1, ids).reshape({f.dense.size(0), -1})).view({5, ne0})));
    EXPECT_NE(test::error_of([&] { gpu::mixture(f.c, p, torch::tensor({384}, torch::kLong), torch::kFloat); }).find("out of range"),
              std::string::npos);
}

TEST(cuda, rows_of_any_length_work_for_float_types) {
    // stories260K's ffn_down has rows of 172 weights: only F16/BF16 fit, and 172 is not a multiple of 8.
    const int64_t rows = 64, ne0 = 172;
    const fixture_set f = make_set({GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_F32}, rows, ne0);
    for (int k = 0; k < 3; ++k) {
        EXPECT_TRUE(torch::equal(gpu::dequantize(f.c, k), f.dense[k])) << k;
    }
    const torch::Tensor p = torch::tensor({0.2f, 0.5f, 0.3f}).to(k_gpu);
    const torch::Tensor want = torch::tensordot(p.to(torch::kDouble), f.dense.to(torch::kDouble), {0}, {0});
    const torch::Tensor w32 = gpu::mixture(f.c, p, torch::Tensor(), torch::kFloat);
    EXPECT_TRUE(within_bound(w32, want, matmul_bound(p, f.dense.view({3, -1})).view({rows, ne0})));  // 3 terms
    EXPECT_TRUE(torch::equal(gpu::mixture(f.c, p, torch::Tensor(), torch::kBFloat16), w32.to(torch::kBFloat16)));
    const torch::Tensor g = torch::randn({rows, ne0}, torch::TensorOptions().device(k_gpu)).to(torch::kBFloat16);
    const torch::Tensor want_g = (f.dense.to(torch::kDouble) * g.to(torch::kDouble)).sum({1, 2});
    EXPECT_LT(rel_err(gpu::gate_grad(f.c, g, torch::Tensor()), want_g), 1e-5);
}

TEST(cuda, tiled_kernels_equal_ggml_and_the_row_kernels_for_every_type) {
    // 97 rows of 1024: 48.5 tiles of 2048 weights, so the last tile is partial (byte copies, not cp.async).
    const int64_t rows = 97, ne0 = 1024;
    const std::vector<ggml_type> types = cuda_menu_and_f32();
    const fixture_set f = make_set(types, rows, ne0);
    const int64_t K = static_cast<int64_t>(types.size());
    for (int64_t k = 0; k < K; ++k) {
        // One-hot p: the tiled mixture is candidate k's to_float, bit for bit.
        torch::Tensor hot = torch::zeros({K}, torch::TensorOptions().device(k_gpu));
        hot[k] = 1.0f;
        EXPECT_TRUE(torch::equal(gpu::mixture(f.c, hot, torch::Tensor(), torch::kFloat), f.dense[k]))
            << type_name(types[static_cast<size_t>(k)]);
    }
    torch::manual_seed(7);
    const torch::Tensor p = torch::softmax(torch::randn({K}), 0).to(k_gpu);
    const torch::Tensor g = torch::randn({rows, ne0}, torch::TensorOptions().device(k_gpu)).to(torch::kBFloat16);
    const torch::Tensor tiled_w = gpu::mixture(f.c, p, torch::Tensor(), torch::kBFloat16);
    const torch::Tensor tiled_g = gpu::gate_grad(f.c, g, torch::Tensor());
    gpu::set_tiled_kernels(false);
    const torch::Tensor rows_w = gpu::mixture(f.c, p, torch::Tensor(), torch::kBFloat16);
    const torch::Tensor rows_g = gpu::gate_grad(f.c, g, torch::Tensor());
    gpu::set_tiled_kernels(true);
    EXPECT_TRUE(torch::equal(tiled_w, rows_w)) << "same per-weight arithmetic, k ascending";
    EXPECT_LT(rel_err(tiled_g, rows_g), 1e-6);
    const torch::Tensor want_g = (f.dense.to(torch::kDouble) * g.to(torch::kDouble)).sum({1, 2});
    EXPECT_LT(rel_err(tiled_g, want_g), 1e-5);
    // A p with zeros: those candidates are neither read nor added.
    torch::Tensor sparse = p.clone();
    sparse.index_put_({torch::indexing::Slice(0, K, 2)}, 0.0f);
    const torch::Tensor want_s = torch::tensordot(sparse.to(torch::kDouble), f.dense.to(torch::kDouble), {0}, {0});
    EXPECT_TRUE(within_bound(gpu::mixture(f.c, sparse, torch::Tensor(), torch::kFloat), want_s,
                             matmul_bound(sparse, f.dense.view({K, -1})).view({rows, ne0})));
}

TEST(cuda, sixteen_bit_candidates_read_the_teachers_bf16_weights_when_bit_identical) {
    const int64_t rows = 64, ne0 = 2048;
    // A BF16 source (the usual released checkpoint): weights that are bf16 values, with fp16's edge cases
    // (above 65504, so F16 gives inf; below 2^-14, so F16 is subnormal or zero).
    std::vector<float> w = test::gaussian(static_cast<size_t>(rows * ne0), 21);
    for (size_t i = 0; i < w.size(); i += 101) {
        w[i] *= (i % 2) ? 1e5f : 1e-6f;
    }
    const torch::Tensor bf16 = torch::from_blob(w.data(), {rows, ne0}).to(torch::kBFloat16);
    const torch::Tensor as_f32 = bf16.to(torch::kFloat).contiguous();
    const std::vector<float> src(as_f32.data_ptr<float>(), as_f32.data_ptr<float>() + as_f32.numel());
    const std::vector<ggml_type> types = {GGML_TYPE_Q4_K, GGML_TYPE_F16, GGML_TYPE_BF16};
    std::vector<std::vector<uint8_t>> bytes;
    for (ggml_type t : types) {
        bytes.push_back(quantize(t, src, ne0));
    }
    const std::vector<int> ids(types.begin(), types.end());
    const torch::Tensor source = bf16.to(k_gpu);
    const gpu::candidate_set own = gpu::upload(bytes, ids, rows, ne0, k_gpu, "t");
    const gpu::candidate_set shared = gpu::upload(bytes, ids, rows, ne0, k_gpu, "t", source);
    EXPECT_EQ(shared.shared, (std::vector<bool>{false, true, true}));
    EXPECT_EQ(shared.types[1], deq::F16_OF_BF16);
    EXPECT_EQ(gpu::resident_bytes(shared), static_cast<int64_t>(bytes[0].size()));
    EXPECT_EQ(gpu::resident_bytes(own), static_cast<int64_t>(bytes[0].size() + bytes[1].size() + bytes[2].size()));
    for (int k = 0; k < 3; ++k) {
        EXPECT_TRUE(torch::equal(gpu::dequantize(shared, k).view(torch::kInt), gpu::dequantize(own, k).view(torch::kInt))) << k;
    }
    // An F32 source: its BF16 candidate is the bf16 rounding, shared; its F16 candidate is not fp16 of that
    // rounding, so it keeps its own bytes.
    const std::vector<float> f32 = test::gaussian(static_cast<size_t>(rows * ne0), 22);
    std::vector<std::vector<uint8_t>> b32;
    for (ggml_type t : types) {
        b32.push_back(quantize(t, f32, ne0));
    }
    const torch::Tensor source32 = torch::from_blob(const_cast<float *>(f32.data()), {rows, ne0}).to(k_gpu, torch::kBFloat16);
    const gpu::candidate_set s32 = gpu::upload(b32, ids, rows, ne0, k_gpu, "t", source32);
    EXPECT_EQ(s32.shared, (std::vector<bool>{false, false, true}));
    EXPECT_EQ(s32.types[1], GGML_TYPE_F16);
    // Training reads the same numbers either way: mixture and gate gradients of the shared set are the own
    // set's, bit for bit (finite weights: the F32 source).
    const gpu::candidate_set o32 = gpu::upload(b32, ids, rows, ne0, k_gpu, "t");
    const torch::Tensor p = torch::tensor({0.2f, 0.3f, 0.5f}).to(k_gpu);
    EXPECT_TRUE(torch::equal(gpu::mixture(s32, p, torch::Tensor(), torch::kBFloat16),
                             gpu::mixture(o32, p, torch::Tensor(), torch::kBFloat16)));
    const torch::Tensor g = torch::randn({rows, ne0}, torch::TensorOptions().device(k_gpu)).to(torch::kBFloat16);
    EXPECT_LT(rel_err(gpu::gate_grad(s32, g, torch::Tensor()), gpu::gate_grad(o32, g, torch::Tensor())), 1e-12);
    // Shared F16 and BF16 are staged once: with p = 0 on the first of them, the second must still be read.
    const gpu::candidate_set both = shared;  // the BF16 source: F16 and BF16 both read the source's bytes
    const gpu::candidate_set both_own = own;
    const torch::Tensor p_hole = torch::tensor({0.5f, 0.0f, 0.5f}).to(k_gpu);
    EXPECT_TRUE(torch::equal(gpu::mixture(both, p_hole, torch::Tensor(), torch::kFloat).view(torch::kInt),
                             gpu::mixture(both_own, p_hole, torch::Tensor(), torch::kFloat).view(torch::kInt)));
    // A source of the wrong shape or dtype is not used (every candidate uploaded).
    const gpu::candidate_set wrong = gpu::upload(bytes, ids, rows, ne0, k_gpu, "t", source.to(torch::kFloat));
    EXPECT_EQ(wrong.shared, (std::vector<bool>{false, false, false}));
}

TEST(cuda, fused_and_reference_paths_train_the_same_gates_through_autograd) {
    gguf_file file(test::stories260k());
    const std::vector<ggml_type> types = {GGML_TYPE_Q4_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0, GGML_TYPE_F16};
    gated_tensor fused = gpu_gated(file, "blk.2.ffn_up.weight", types, mixture_path::fused);
    gated_tensor ref = gpu_gated(file, "blk.2.ffn_up.weight", types, mixture_path::reference);
    torch::manual_seed(2);
    const torch::Tensor x = torch::randn({16, 64}, torch::TensorOptions().device(k_gpu));
    torch::Tensor wf = gated_mixture(torch::softmax(fused.gate, 0), fused);
    torch::Tensor wr = gated_mixture(torch::softmax(ref.gate, 0), ref);
    // Both paths against the exact values from the same f32 inputs, each within the bound of its own f32
    // arithmetic in any order (gate_grad_bound.h): the fused kernels and cuBLAS sum differently.
    const torch::Tensor p = torch::softmax(ref.gate.detach(), 0), pd = p.to(torch::kDouble);
    const torch::Tensor d = ref.dense.to(torch::kDouble).view({4, -1});
    const torch::Tensor w_bound = matmul_bound(pd, d).view({172, 64});
    EXPECT_TRUE(within_bound(wf, pd.matmul(d).view({172, 64}), w_bound));
    EXPECT_TRUE(within_bound(wr, pd.matmul(d).view({172, 64}), w_bound));
    torch::mm(x, wf.t()).pow(2).sum().backward();
    torch::mm(x, wr.t()).pow(2).sum().backward();
    const test::gate_grad_check check = test::quadratic_loss_gate_grad(p, d, 172, x);
    EXPECT_TRUE(within_bound(fused.grad_p, check.grad_p, check.grad_p_bound));
    EXPECT_TRUE(within_bound(ref.grad_p, check.grad_p, check.grad_p_bound));
    EXPECT_TRUE(within_bound(fused.gate.grad(), check.grad, check.grad_bound)) << fused.gate.grad() << ref.gate.grad();
    EXPECT_TRUE(within_bound(ref.gate.grad(), check.grad, check.grad_bound)) << fused.gate.grad() << ref.gate.grad();
}

TEST(cuda, ptqr_gives_each_token_its_candidate_exactly_and_the_straight_through_gradient_on_both_paths) {
    gguf_file file(test::stories260k());
    const std::vector<ggml_type> types = {GGML_TYPE_Q4_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0, GGML_TYPE_F16};
    std::vector<std::vector<float>> deq;
    for (const char * path : {"fused", "reference"}) {
        SCOPED_TRACE(path);
        gated_tensor g = gpu_gated(file, "blk.2.ffn_up.weight", types, parse_mixture_path(path));  // [172, 64]
        deq.clear();
        for (size_t k = 0; k < types.size(); ++k) {
            deq.push_back(dequantize(types[k], g.bytes[k], 64));
        }
        const torch::Tensor p = torch::softmax(g.gate, 0);
        // Basis-vector tokens: x_i · Dᵀ is a column of D with no rounding, so it must be ggml's value bit for bit.
        const int64_t n = 128;
        const torch::Tensor routes = draw_routes(p, n, 21);
        const torch::Tensor y = routed_product(torch::eye(64, k_gpu).repeat({2, 1}), gated_mixture(p, g), routes, g).cpu();
        int64_t mismatches = 0;
        for (int64_t i = 0; i < n; ++i) {
            const auto & d = deq[static_cast<size_t>(routes[i].item<int64_t>())];
            for (int64_t r = 0; r < 172; ++r) {
                mismatches += y[i][r].item<float>() != d[static_cast<size_t>(r * 64 + i % 64)];
            }
        }
        EXPECT_EQ(mismatches, 0);
        // The gradients: straight-through, within the bound of f32 arithmetic in any order (as tests/test_gated.cpp).
        torch::manual_seed(6);
        const int64_t B = 32;
        const torch::Tensor x = torch::randn({B, 64}, torch::TensorOptions().device(k_gpu)).requires_grad_(true);
        const torch::Tensor r2 = draw_routes(p, B, 22);
        routed_product(x, gated_mixture(p, g), r2, g).pow(2).sum().backward();
        torch::Tensor d = torch::empty({4, 172 * 64}, torch::kDouble);
        for (int64_t k = 0; k < 4; ++k) {
            d[k].copy_(torch::from_blob(deq[static_cast<size_t>(k)].data(), {172 * 64}).to(torch::kDouble));
        }
        const torch::Tensor xd = x.detach().cpu().to(torch::kDouble), xa = xd.abs();
        const torch::Tensor dk = d.view({4, 172, 64}).index_select(0, r2);
        const torch::Tensor yd = torch::bmm(dk, xd.unsqueeze(2)).squeeze(2);
        const torch::Tensor by = test::gamma_n(64) * torch::bmm(dk.abs(), xa.unsqueeze(2)).squeeze(2);
        const torch::Tensor gw = 2 * yd.t().matmul(xd);
        const torch::Tensor bgw = 2 * by.t().matmul(xa) + matmul_bound((2 * (yd.abs() + by)).t(), xd);
        const test::gate_grad_check check = test::gate_grad_from(p.detach().cpu(), d, gw.view(-1), bgw.view(-1));
        EXPECT_TRUE(within_bound(g.grad_p, check.grad_p, check.grad_p_bound));
        EXPECT_TRUE(within_bound(g.gate.grad(), check.grad, check.grad_bound));
        // Embedding rows: exactly the routed candidate's rows.
        gated_tensor e = gpu_gated(file, "token_embd.weight", types, parse_mixture_path(path));
        const torch::Tensor ids = torch::randint(0, 512, {64}, torch::kLong);
        const torch::Tensor pe = torch::softmax(e.gate, 0);
        const torch::Tensor er = draw_routes(pe, 64, 23);
        const torch::Tensor rows = routed_rows(pe, ids.to(k_gpu), er, e).cpu();
        mismatches = 0;
        for (int64_t i = 0; i < 64; ++i) {
            const std::vector<float> want = dequantize(types[static_cast<size_t>(er[i].item<int64_t>())],
                                                       e.bytes[static_cast<size_t>(er[i].item<int64_t>())], 64);
            for (int64_t c = 0; c < 64; ++c) {
                mismatches += rows[i][c].item<float>() != want[static_cast<size_t>(ids[i].item<int64_t>() * 64 + c)];
            }
        }
        EXPECT_EQ(mismatches, 0);
    }
}

TEST(cuda, host_resident_candidates_give_the_resident_numbers_bit_for_bit_and_a_repeated_order_is_prefetched) {
    // Five tensors' candidates twice: resident on the GPU, and in pinned host memory behind one candidate_stream that
    // prefetches 2 tensors ahead. The same bytes reach the same kernels, so W_eff and the gate gradients are equal bit
    // for bit. Three identical steps (forward over the five, then the backward): the stream learns the order in the
    // first and prefetches all of the third.
    gguf_file file(test::stories260k());
    const std::vector<ggml_type> types = {GGML_TYPE_Q4_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0, GGML_TYPE_F16};
    std::vector<gated_tensor> resident, streamed;
    const std::shared_ptr<void> stream = make_candidate_stream(k_gpu, 2);
    for (int layer = 0; layer < 5; ++layer) {
        const std::string name = fmt::format("blk.{}.ffn_up.weight", layer);
        resident.push_back(gpu_gated(file, name, types, mixture_path::fused));
        gated_tensor h = gpu_gated(file, name, types, mixture_path::cpu);
        h.gate = h.gate.detach().to(k_gpu).requires_grad_(true);
        EXPECT_EQ(place_candidates_on_host(h, k_gpu, torch::kFloat, stream),
                  static_cast<int64_t>(h.bytes[0].size() + h.bytes[1].size() + h.bytes[2].size() + h.bytes[3].size()));
        EXPECT_EQ(h.path, mixture_path::fused);
        streamed.push_back(std::move(h));
    }
    torch::manual_seed(3);
    const torch::Tensor x = torch::randn({16, 64}, torch::TensorOptions().device(k_gpu));
    auto step = [&](std::vector<gated_tensor> & ts) {
        torch::Tensor loss = torch::zeros({}, x.options());
        std::vector<torch::Tensor> w;
        for (gated_tensor & t : ts) {
            t.gate.mutable_grad() = torch::Tensor();
            w.push_back(gated_mixture(torch::softmax(t.gate, 0), t));
            loss = loss + torch::mm(x, w.back().t()).pow(2).sum();
        }
        loss.backward();
        std::vector<torch::Tensor> out;
        for (size_t i = 0; i < ts.size(); ++i) {
            out.push_back(w[i].detach().cpu());
            out.push_back(ts[i].gate.grad().cpu());
        }
        return out;
    };
    std::vector<int64_t> misses;
    for (int s = 0; s < 3; ++s) {
        const std::vector<torch::Tensor> a = step(resident), b = step(streamed);
        for (size_t i = 0; i < a.size(); ++i) {
            EXPECT_TRUE(torch::equal(a[i], b[i])) << "step " << s << ", output " << i;
        }
        misses.push_back(candidate_stream_statistics(stream).misses);
    }
    const candidate_stream_stats st = candidate_stream_statistics(stream);
    EXPECT_EQ(st.uses, 3 * 10);  // each tensor: its mixture in the forward, its gate gradient in the backward
    // Step 1: every forward use is its tensor's first (5 misses), and the backward's may miss too (nothing learned).
    EXPECT_GE(misses[0], 5);
    EXPECT_LE(misses[0], 10);
    // Step 2: at most its first two uses (their contexts begin in step 1, where nothing followed them yet); step 3: none.
    EXPECT_LE(misses[1] - misses[0], 2);
    EXPECT_EQ(misses[2], misses[1]);
    EXPECT_LE(st.peak_resident_bytes, 3 * (st.host_bytes / 5));  // the one in use and two ahead
    EXPECT_GT(st.copies, 10);
}

TEST(cuda, training_on_the_gpu_finishes_within_the_budget_on_both_paths) {
    // The data comes from a child `voodoo data`, as `voodoo quantize --device cuda` keeps libllama's work and
    // GPU training in separate processes (pipeline/quantize.h).
    test::temp_dir dir;
    const auto made = test::run_voodoo(fmt::format("data --model {} --text {} --ctx 64 --val-fraction 0.05 --out {}",
                                                   test::stories260k(),
                                                   test::shared_data() + "/text/tinystories/tinystories_val.txt",
                                                   dir.file("data")));
    ASSERT_EQ(made.exit_code, 0) << made.output;
    gguf_file src(test::stories260k());
    token_data data(dir.file("data"));
    for (const char * path : {"fused", "reference"}) {
        train_options o;
        o.goal = {target_kind::size, 304352};
        o.run_dir = dir.file(std::string("run-") + path);
        o.steps = 6;
        o.batch = 2;
        o.seq = 64;
        o.device = "cuda";
        o.mixture = path;
        const train_result r = train_gates(src, src, data.train(), nullptr, o);
        EXPECT_TRUE(r.finished);
        auto routed = o;  // per-token routing on the same path
        routed.run_dir += "-ptqr";
        routed.routing = "ptqr";
        const train_result rr = train_gates(src, src, data.train(), nullptr, routed);
        EXPECT_TRUE(rr.finished);
        EXPECT_LE(rr.total_bytes, 304352);
        EXPECT_EQ(r.mixture, path);
        EXPECT_EQ(r.device, "cuda:0");
        EXPECT_LE(r.total_bytes, 304352);
        EXPECT_GT(r.candidate_device_bytes, 0);
        if (std::string(path) == "fused") {
            // The same run with every candidate in pinned host memory, streamed to the GPU: the same recipe.
            auto host = o;
            host.run_dir += "-host";
            host.candidates_on = "host";
            const train_result rh = train_gates(src, src, data.train(), nullptr, host);
            EXPECT_TRUE(rh.finished);
            EXPECT_EQ(rh.candidate_device_bytes, 0);
            EXPECT_GT(rh.candidate_host_bytes, 0);
            EXPECT_GT(rh.stream_stats.copies, 0);
            EXPECT_LT(rh.stream_stats.misses, rh.stream_stats.uses);
            ASSERT_EQ(rh.final_recipe.tensors.size(), r.final_recipe.tensors.size());
            for (size_t i = 0; i < r.final_recipe.tensors.size(); ++i) {
                EXPECT_EQ(rh.final_recipe.tensors[i].type, r.final_recipe.tensors[i].type) << r.final_recipe.tensors[i].name;
            }
        }
    }
}

#endif  // VOODOO_HAVE_CUDA
