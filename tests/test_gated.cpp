#include "dist/dist.h"
#include "gate_grad_bound.h"
#include "ggml/gguf.h"
#include "ggml/quant.h"
#include "ggml/types.h"
#include "model/fixture.h"
#include "test_util.h"
#include "tolerance.h"
#include "train/candidates.h"
#include "train/gated.h"
#include "train/trainer.h"

#include <gtest/gtest.h>

#include <deque>

using namespace voodoo;
using test::gamma_n;
using test::gate_grad_check;
using test::matmul_bound;
using test::quadratic_loss_gate_grad;
using test::within_bound;

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

// The K candidates as ggml's to_float gives them, [K, rows·ne0] in f64 (every f32 is exact in f64).
torch::Tensor candidates_f64(const gated_tensor & g) {
    const int64_t K = static_cast<int64_t>(g.types.size()), n = g.tensor->n_elements();
    torch::Tensor d = torch::empty({K, n}, torch::kDouble);
    for (int64_t k = 0; k < K; ++k) {
        auto v = dequantize(g.types[static_cast<size_t>(k)], g.bytes[static_cast<size_t>(k)], g.tensor->ne[0]);
        d[k].copy_(torch::from_blob(v.data(), {n}).to(torch::kDouble));
    }
    return d;
}

// The same mixture in double precision from ggml's to_float of each candidate, for finite differences
// free of f32 rounding.
torch::Tensor mixture_f64(const torch::Tensor & gate, const gated_tensor & g) {
    const auto p = torch::softmax(gate.to(torch::kDouble), 0);
    return p.matmul(candidates_f64(g)).view({g.tensor->n_rows(), g.tensor->ne[0]});
}

// L = ||W[ids]||² (rows of the mixture): G = 2·W[ids] carries W's K-term rounding; ⟨G, D_k[ids]⟩ has
// ids.numel()·ne0 terms (a full-tensor G is zero outside the rows used, and its zeros add exactly).
gate_grad_check squared_rows_gate_grad(const torch::Tensor & p, const torch::Tensor & d_rows) {
    const torch::Tensor pd = p.detach().to(torch::kDouble);
    const torch::Tensor g = 2 * pd.matmul(d_rows);
    const torch::Tensor bg = 2 * matmul_bound(pd, d_rows);
    return test::gate_grad_from(p, d_rows, g, bg);
}

// Rows ids of the candidates: [K, rows, ne0] → [K, n·ne0].
torch::Tensor candidate_rows(const torch::Tensor & d, const gated_tensor & g, const torch::Tensor & ids) {
    return d.view({d.size(0), g.tensor->n_rows(), g.tensor->ne[0]}).index_select(1, ids).reshape({d.size(0), -1});
}

// ∂L/∂p as a path would give it with the last row of the tensor (ne0 weights) left out of ⟨G, D_k⟩, an
// off-by-one bug: what the bound on ∂L/∂p must reject.
torch::Tensor last_row_left_out(const gate_grad_check & c, const torch::Tensor & d, int64_t ne0) {
    torch::Tensor g = c.g.clone();
    g.slice(0, g.numel() - ne0).zero_();
    return d.matmul(g);
}

// What a path would give with ∂L/∂p of candidates 0 and 1 swapped (a menu-order bug), from its own ∂L/∂p
// (grad_p, f64): an error the size of the gap between two candidates' gradients, which a bound must reject.
torch::Tensor swapped_gate_grad(const torch::Tensor & p, const torch::Tensor & grad_p) {
    const torch::Tensor pd = p.detach().to(torch::kDouble);
    torch::Tensor gp = grad_p.clone();
    gp[0] = grad_p[1];
    gp[1] = grad_p[0];
    return pd * (gp - (pd * gp).sum());
}

}  // namespace

TEST(gated, the_mixture_is_the_probability_weighted_sum_of_dequantized_candidates) {
    gguf_file f(test::stories260k());
    auto g = make_gated(f, "blk.0.ffn_gate.weight", {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, GGML_TYPE_F16});
    const auto p = torch::softmax(g.gate, 0);
    const auto w = gated_mixture(p, g);
    ASSERT_EQ(w.sizes(), (std::vector<int64_t>{172, 64}));
    const torch::Tensor d = candidates_f64(g);
    const torch::Tensor pd = p.detach().to(torch::kDouble);
    // Σ_k p_k·D_k of 3 terms in f32: |Δ| ≤ γ_3·Σ_k p_k|D_k|, 3 units of the last place of Σ p|D|, no more.
    EXPECT_TRUE(within_bound(w, pd.matmul(d).view({172, 64}), matmul_bound(pd, d).view({172, 64})));
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
    const auto p = torch::softmax(g.gate, 0);
    const auto w = gated_mixture(p, g);
    torch::mm(x, w.to(torch::kDouble).t()).pow(2).sum().backward();
    const auto analytic = g.gate.grad().to(torch::kDouble).clone();
    // The analytic gradient is the exact one at the f32 p̂ within its f32 rounding (W, ⟨G, D_k⟩, softmax
    // backward); the central difference is the exact one at the f64 p = softmax(g) within h²/6·max|f'''| plus
    // its f64 rounding over h. f(t) = L(softmax(g + t·e_k)) = pᵀAp with A_kl = ⟨X·D_kᵀ, X·D_lᵀ⟩, so
    // |f'''| ≤ 2·max|A|·(‖p'''‖₁ + 3‖p''‖₁‖p'‖₁) ≤ 1.08·max|A| (‖p⁽ᵐ⁾‖₁ = 2|σ⁽ᵐ⁾| ≤ 2·{1/4, 1/(6√3), 1/8} for
    // the logistic σ); each f64 loss is off by ≤ γ_n^f64·Σ(|X|·|W|ᵀ)², n = K + ne0 + 16·64 terms.
    const torch::Tensor d = candidates_f64(g);
    const gate_grad_check at_f32_p = quadratic_loss_gate_grad(p, d, 64, x);
    const gate_grad_check at_f64_p = quadratic_loss_gate_grad(torch::softmax(g.gate.detach().to(torch::kDouble), 0), d, 64, x);
    const torch::Tensor z = x.matmul(d.view({4, 64, 64}).transpose(1, 2)).reshape({4, -1});  // X·D_kᵀ
    const double max_a = z.matmul(z.t()).abs().max().item<double>();
    const double loss_abs = x.abs().matmul(d.abs().amax(0).view({64, 64}).t()).pow(2).sum().item<double>();
    const double h = 1e-4;
    const double fd_err = h * h / 6 * 1.08 * max_a + gamma_n(4 + 64 + 16 * 64, test::u_f64) * loss_abs / h;
    torch::Tensor fd = torch::empty({4}, torch::kDouble);
    for (int64_t k = 0; k < 4; ++k) {
        torch::NoGradGuard no_grad;
        auto plus = g.gate.detach().to(torch::kDouble).clone();
        auto minus = plus.clone();
        plus[k] += h;
        minus[k] -= h;
        fd[k] = (loss_of(mixture_f64(plus, g), x) - loss_of(mixture_f64(minus, g), x)) / (2 * h);
    }
    const torch::Tensor bound = at_f32_p.grad_bound + (at_f32_p.grad - at_f64_p.grad).abs() + fd_err;
    EXPECT_TRUE(within_bound(analytic, fd, bound));
    EXPECT_TRUE(within_bound(analytic, at_f32_p.grad, at_f32_p.grad_bound));
    // grad_p holds ⟨∂L/∂W, deq(Q_k)⟩ for every candidate.
    ASSERT_TRUE(g.grad_p.defined());
    EXPECT_EQ(g.grad_p.numel(), 4);
    EXPECT_TRUE(within_bound(g.grad_p, at_f32_p.grad_p, at_f32_p.grad_p_bound));
    // What the bounds reject: ⟨G, D_k⟩ without the last of 64 rows; two candidates' ∂L/∂p swapped.
    EXPECT_FALSE(within_bound(last_row_left_out(at_f32_p, d, 64), at_f32_p.grad_p, at_f32_p.grad_p_bound));
    EXPECT_FALSE(within_bound(swapped_gate_grad(p, g.grad_p), fd, bound));
}

TEST(gated, rows_mix_only_the_rows_asked_for_with_the_same_gradient_rule) {
    gguf_file f(test::stories260k());
    auto g = make_gated(f, "token_embd.weight", {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0});
    const auto ids = torch::tensor({5, 17, 5, 300}, torch::kLong);
    const auto p = torch::softmax(g.gate, 0);
    const auto rows = gated_mixture_rows(p, ids, g);
    const auto full = gated_mixture(p.detach(), g);
    // Both sides are Σ_k p_k·D_k of 2 terms in f32, each within γ_2·Σ_k p_k|D_k| of the exact rows.
    const torch::Tensor d_rows = candidate_rows(candidates_f64(g), g, ids);
    const torch::Tensor pd = p.detach().to(torch::kDouble);
    const torch::Tensor want = pd.matmul(d_rows).view({4, 64});
    const torch::Tensor bound = matmul_bound(pd, d_rows).view({4, 64});
    EXPECT_TRUE(within_bound(rows, want, bound));
    EXPECT_TRUE(within_bound(full.index_select(0, ids), want, bound));
    // L = ||W[ids]||² through the rows, then through the full mixture: both the exact gradient within the f32
    // rounding of W and of ⟨G, D_k⟩ over the 4·64 weights used.
    const gate_grad_check check = squared_rows_gate_grad(p, d_rows);
    rows.pow(2).sum().backward();
    EXPECT_TRUE(within_bound(g.grad_p, check.grad_p, check.grad_p_bound));
    EXPECT_TRUE(within_bound(g.gate.grad(), check.grad, check.grad_bound));
    const auto swapped = swapped_gate_grad(p, g.grad_p);
    g.gate.grad().zero_();
    g.grad_p = torch::Tensor();
    auto p2 = torch::softmax(g.gate, 0);
    gated_mixture(p2, g).index_select(0, ids).pow(2).sum().backward();
    EXPECT_TRUE(within_bound(g.grad_p, check.grad_p, check.grad_p_bound));
    EXPECT_TRUE(within_bound(g.gate.grad(), check.grad, check.grad_bound));
    // What the bounds reject: ⟨G, D_k⟩ without the last row used; two candidates' ∂L/∂p swapped.
    EXPECT_FALSE(within_bound(last_row_left_out(check, d_rows, 64), check.grad_p, check.grad_p_bound));
    EXPECT_FALSE(within_bound(swapped, check.grad, check.grad_bound));
    EXPECT_THROW(gated_mixture_rows(p.detach(), torch::tensor({512}, torch::kLong), g), std::exception);
}

TEST(gated, the_reference_path_equals_the_cpu_path_in_value_and_gate_gradient) {
    // The reference path (dense candidates, plain LibTorch) is the oracle of the GPU's fused kernels; here
    // it is checked against the streaming CPU path on the CPU, in f32. The two sum in different orders (∂L/∂p
    // over 4,096 products: BLAS's gemv against a dot), so each is held to the exact result from the same f32
    // inputs within the rounding bound of its own computation, not to the other bit for bit.
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
    const torch::Tensor d = candidates_f64(cpu);
    const torch::Tensor p = torch::softmax(cpu.gate.detach(), 0), pd = p.to(torch::kDouble);
    const torch::Tensor w_want = pd.matmul(d).view({64, 64});
    const torch::Tensor w_bound = matmul_bound(pd, d).view({64, 64});  // 3 terms in f32
    EXPECT_TRUE(within_bound(w_cpu, w_want, w_bound));
    EXPECT_TRUE(within_bound(w_ref, w_want, w_bound));
    // L = ||X·Wᵀ||²: W (3 terms), X·Wᵀ (64), 2·Yᵀ·X (8), ⟨G, D_k⟩ (4,096), softmax backward, all in f32.
    // ∂L/∂p_k is within ≈ 4,096·u·Σ|G||D_k| (≈ 1e-3 of it), but ∂L/∂g = p ⊙ (∂L/∂p − pᵀ∂L/∂p) is the small
    // difference of such sums: its bound is a large part of it, and the bound on ∂L/∂p is the sharp check.
    const gate_grad_check check = quadratic_loss_gate_grad(p, d, 64, x);
    EXPECT_TRUE(within_bound(cpu.grad_p, check.grad_p, check.grad_p_bound));
    EXPECT_TRUE(within_bound(ref.grad_p, check.grad_p, check.grad_p_bound));
    EXPECT_TRUE(within_bound(cpu.gate.grad(), check.grad, check.grad_bound)) << cpu.gate.grad() << ref.gate.grad();
    EXPECT_TRUE(within_bound(ref.gate.grad(), check.grad, check.grad_bound)) << cpu.gate.grad() << ref.gate.grad();
    // What the bounds reject: ⟨G, D_k⟩ without the last of 64 rows; two candidates' ∂L/∂p swapped.
    EXPECT_FALSE(within_bound(last_row_left_out(check, d, 64), check.grad_p, check.grad_p_bound));
    EXPECT_FALSE(within_bound(swapped_gate_grad(p, cpu.grad_p), check.grad, check.grad_bound));
    // Rows of the embedding: the same rule over the rows used.
    auto ecpu = make_gated(f, "token_embd.weight", {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0});
    auto eref = make_gated(f, "token_embd.weight", {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0});
    place_candidates(eref, mixture_path::reference, torch::kCPU, torch::kFloat, torch::kFloat);
    const auto ids = torch::tensor({3, 400, 3, 17}, torch::kLong);
    const auto r_cpu = gated_mixture_rows(torch::softmax(ecpu.gate, 0), ids, ecpu);
    const auto r_ref = gated_mixture_rows(torch::softmax(eref.gate, 0), ids, eref);
    const torch::Tensor d_rows = candidate_rows(candidates_f64(ecpu), ecpu, ids);
    const torch::Tensor ep = torch::softmax(ecpu.gate.detach(), 0), epd = ep.to(torch::kDouble);
    const torch::Tensor r_bound = matmul_bound(epd, d_rows).view({4, 64});  // 2 terms in f32
    EXPECT_TRUE(within_bound(r_cpu, epd.matmul(d_rows).view({4, 64}), r_bound));
    EXPECT_TRUE(within_bound(r_ref, epd.matmul(d_rows).view({4, 64}), r_bound));
    r_cpu.pow(2).sum().backward();
    r_ref.pow(2).sum().backward();
    const gate_grad_check echeck = squared_rows_gate_grad(ep, d_rows);
    EXPECT_TRUE(within_bound(ecpu.grad_p, echeck.grad_p, echeck.grad_p_bound));
    EXPECT_TRUE(within_bound(eref.grad_p, echeck.grad_p, echeck.grad_p_bound));
    EXPECT_TRUE(within_bound(ecpu.gate.grad(), echeck.grad, echeck.grad_bound));
    EXPECT_TRUE(within_bound(eref.gate.grad(), echeck.grad, echeck.grad_bound));
    EXPECT_FALSE(within_bound(last_row_left_out(echeck, d_rows, 64), echeck.grad_p, echeck.grad_p_bound));
    EXPECT_FALSE(within_bound(swapped_gate_grad(ep, ecpu.grad_p), echeck.grad, echeck.grad_bound));
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

TEST(gated, the_residency_plan_sends_the_largest_tensors_to_the_host_until_the_rest_fit) {
    // Candidate bytes of five tensors, 1,000 bytes on the GPU for them.
    const std::vector<int64_t> bytes = {300, 900, 200, 900, 100};
    EXPECT_EQ(host_resident_plan(bytes, candidate_residency::gpu, 0), std::vector<bool>(5, false));
    EXPECT_EQ(host_resident_plan(bytes, candidate_residency::host, 1 << 30), std::vector<bool>(5, true));
    // 2,400 in all: the two of 900 leave 600 ≤ 1,000 (ties in source order, the first of equal size first).
    EXPECT_EQ(host_resident_plan(bytes, candidate_residency::automatic, 1000),
              (std::vector<bool>{false, true, false, true, false}));
    EXPECT_EQ(host_resident_plan(bytes, candidate_residency::automatic, 2400), std::vector<bool>(5, false));
    EXPECT_EQ(host_resident_plan(bytes, candidate_residency::automatic, 1500), (std::vector<bool>{false, true, false, false, false}));
    EXPECT_EQ(host_resident_plan(bytes, candidate_residency::automatic, -5), std::vector<bool>(5, true));
    EXPECT_NE(test::error_of([] { parse_candidate_residency("disk"); }).find("--candidates-on 'disk'"), std::string::npos);
    EXPECT_EQ(parse_candidate_residency("auto"), candidate_residency::automatic);
    gguf_file f(test::stories260k());
    auto g = make_gated(f, "blk.1.attn_q.weight", {GGML_TYPE_Q4_0});
#if !defined(VOODOO_HAVE_CUDA)
    EXPECT_NE(test::error_of([] { make_candidate_stream(torch::kCPU, 2); }).find("no CUDA"), std::string::npos);
    EXPECT_NE(test::error_of([&] { place_candidates_on_host(g, torch::kCPU, torch::kFloat, nullptr); }).find("CUDA build"),
              std::string::npos);
#else
    EXPECT_NE(test::error_of([&] { place_candidates_on_host(g, torch::kCPU, torch::kFloat, nullptr); }).find("candidate stream"),
              std::string::npos);
#endif
    EXPECT_EQ(device_total_memory(torch::kCPU), 0);
}

TEST(gated, the_trainers_residency_plan_refuses_a_teacher_that_does_not_fit_and_streams_the_largest_tensors) {
    // stories260K's menus on a made-up GPU: what the trainer decides before any work (plan_residency).
    gguf_file f(test::stories260k());
    menu_options mo;
    mo.types = {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0};
    const std::vector<tensor_menu> menus = build_menus(f, mo);
    const int64_t gib = int64_t{1} << 30;
    residency_plan p = plan_residency(menus, "auto", 80 * gib, 40 * gib);
    EXPECT_TRUE(p.teacher_fits);                    // 40 + 16 (the reserve: max(16 GiB, 80/5)) ≤ 80
    EXPECT_EQ(p.reserve, 16 * gib);
    EXPECT_EQ(p.host_bytes, 0);                      // the candidates' few hundred KiB fit easily
    EXPECT_EQ(p.on_host, std::vector<bool>(menus.size(), false));
    p = plan_residency(menus, "auto", 80 * gib, 70 * gib);
    EXPECT_FALSE(p.teacher_fits);                   // 70 + 16 > 80: the trainer refuses before any work
    // A GPU with no room left for candidates: auto sends them all to the host, largest first.
    p = plan_residency(menus, "auto", 20 * gib, 4 * gib);
    EXPECT_TRUE(p.teacher_fits);
    EXPECT_EQ(p.host_bytes, p.all_bytes);
    p = plan_residency(menus, "gpu", 20 * gib, 4 * gib);
    EXPECT_EQ(p.host_bytes, 0);
    p = plan_residency(menus, "host", 80 * gib, 1);
    EXPECT_EQ(p.host_bytes, p.all_bytes);
    int64_t sum = 0;
    for (size_t i = 0; i < menus.size(); ++i) {
        sum += static_cast<int64_t>(tensor_bytes(GGML_TYPE_Q4_0, menus[i].tensor->ne, menus[i].tensor->name) +
                                    tensor_bytes(GGML_TYPE_Q8_0, menus[i].tensor->ne, menus[i].tensor->name));
    }
    EXPECT_EQ(p.all_bytes, sum);
    // The CPU: nothing planned.
    EXPECT_EQ(plan_residency(menus, "host", 0, 1).host_bytes, 0);
}

TEST(gated, a_tensor_parallel_ranks_residency_plan_counts_the_bytes_of_its_shards) {
    // Under tensor parallelism a rank places only its shards of the candidates on its device (dist::shard_gated_tensor),
    // so its plan counts those: on a llama fixture whose every split falls on the menu's blocks, the two ranks' bytes
    // of each tensor are its whole candidates' bytes (rows or whole blocks of each row split in two), and each rank's
    // total is half the single process's.
    test::temp_dir dir;
    fixture_spec spec;
    spec.vocab_path = std::string(VOODOO_SOURCE_DIR) + "/.deps/llama.cpp/models/ggml-vocab-llama-spm.gguf";
    spec.weight_type = GGML_TYPE_F16;
    write_fixture(spec, dir.file("m.gguf"));
    gguf_file f(dir.file("m.gguf"));
    menu_options mo;
    mo.types = {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0};
    const std::vector<tensor_menu> menus = build_menus(f, mo);
    const int64_t gib = int64_t{1} << 30;
    const residency_plan one = plan_residency(menus, "host", 80 * gib, gib);
    const residency_plan r0 = plan_residency(menus, "host", 80 * gib, gib, 0, 2);
    const residency_plan r1 = plan_residency(menus, "host", 80 * gib, gib, 1, 2);
    ASSERT_EQ(one.bytes.size(), menus.size());
    for (size_t i = 0; i < menus.size(); ++i) {
        SCOPED_TRACE(menus[i].tensor->name);
        EXPECT_EQ(r0.bytes[i] + r1.bytes[i], one.bytes[i]);
        EXPECT_EQ(r0.bytes[i], r1.bytes[i]);
        // What the rank's shards really hold.
        gated_tensor g;
        g.tensor = menus[i].tensor;
        g.types = menus[i].types;
        for (ggml_type t : g.types) {
            g.bytes.emplace_back(tensor_bytes(t, g.tensor->ne, g.tensor->name), uint8_t{0});
        }
        std::deque<gguf_tensor> shapes;
        const gated_tensor shard = dist::shard_gated_tensor(g, 1, 2, shapes);
        int64_t held = 0;
        for (const auto & b : shard.bytes) {
            held += static_cast<int64_t>(b.size());
        }
        EXPECT_EQ(r1.bytes[i], held);
    }
    EXPECT_EQ(r0.all_bytes * 2, one.all_bytes);
    EXPECT_EQ(r0.host_bytes, r0.all_bytes);
}

// Per-token quant routing (issue #22).

TEST(gated, ptqr_routes_follow_p_within_the_binomial_bound_and_replay_from_the_seed) {
    const torch::Tensor p = torch::tensor({0.5, 0.3, 0.0, 0.2}, torch::kDouble);
    const int64_t n = 200000;
    const torch::Tensor r = draw_routes(p, n, 7);
    ASSERT_EQ(r.numel(), n);
    const torch::Tensor counts = torch::bincount(r, {}, 4).to(torch::kDouble);
    // Each count is Binomial(n, p_k): within 6 standard deviations, √(n·p_k·(1 − p_k)), of n·p_k (a chance of
    // about 2·10⁻⁹ each to fall outside for a correct sampler; the routes are seeded, so a pass is reproducible).
    const torch::Tensor bound = 6 * (n * p * (1 - p)).sqrt();
    EXPECT_TRUE(within_bound(counts, n * p, bound));
    EXPECT_EQ(counts[2].item<double>(), 0.0);  // p = 0 is never drawn
    // What the bound rejects: the shares of another p (two entries swapped).
    EXPECT_FALSE(within_bound(counts, n * torch::tensor({0.3, 0.5, 0.0, 0.2}, torch::kDouble), bound));
    EXPECT_TRUE(torch::equal(r, draw_routes(p, n, 7)));
    EXPECT_FALSE(torch::equal(r, draw_routes(p, n, 8)));
    // One-hot p routes everything to its candidate; a p that is not a distribution is refused.
    EXPECT_TRUE(torch::equal(draw_routes(torch::tensor({0.0f, 0.0f, 1.0f}), 50, 1), torch::full({50}, 2, torch::kLong)));
    EXPECT_NE(test::error_of([] { draw_routes(torch::tensor({0.0f, 0.0f}), 4, 1); }).find("sum to 0"), std::string::npos);
}

TEST(gated, ptqr_gives_each_token_its_routed_candidates_product_exactly) {
    gguf_file f(test::stories260k());
    const std::vector<ggml_type> types = {GGML_TYPE_Q4_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0};
    for (mixture_path path : {mixture_path::cpu, mixture_path::reference}) {
        SCOPED_TRACE(mixture_path_name(path));
        auto g = make_gated(f, "blk.1.attn_q.weight", types);
        place_candidates(g, path, torch::kCPU, torch::kFloat, torch::kFloat);
        const torch::Tensor p = torch::softmax(g.gate, 0);
        const int64_t n = 192, ne0 = 64;
        const torch::Tensor routes = draw_routes(p, n, 3);
        // Token i is the basis vector e_(i mod 64): x_i · Dᵀ is column i mod 64 of D, with no rounding at all
        // (products with 0 and 1, sums with zeros), so the routed product must give it bit for bit.
        const torch::Tensor x = torch::eye(ne0).repeat({3, 1}).view({2, n / 2, ne0});
        const torch::Tensor y = routed_product(x, gated_mixture(p, g), routes, g).view({n, 64});
        std::vector<std::vector<float>> deq;
        for (ggml_type t : types) {
            deq.push_back(dequantize(t, g.bytes[deq.size()], ne0));
        }
        int64_t mismatches = 0;
        for (int64_t i = 0; i < n; ++i) {
            const auto & d = deq[static_cast<size_t>(routes[i].item<int64_t>())];
            for (int64_t row = 0; row < 64; ++row) {
                mismatches += y[i][row].item<float>() != d[static_cast<size_t>(row * ne0 + i % ne0)];
            }
        }
        EXPECT_EQ(mismatches, 0);
        EXPECT_GT(torch::bincount(routes, {}, 3).min().item<int64_t>(), 0);  // every candidate served some token

        // Embedding rows: row i is row ids[i] of candidate routes[i], bit for bit.
        auto e = make_gated(f, "token_embd.weight", types);
        place_candidates(e, path, torch::kCPU, torch::kFloat, torch::kFloat);
        const torch::Tensor ids = torch::randint(0, 512, {100}, torch::kLong);
        const torch::Tensor pe = torch::softmax(e.gate, 0);
        const torch::Tensor er = draw_routes(pe, 100, 4);
        const torch::Tensor rows = routed_rows(pe, ids, er, e);
        std::vector<std::vector<float>> edeq;
        for (ggml_type t : types) {
            edeq.push_back(dequantize(t, e.bytes[edeq.size()], 64));
        }
        mismatches = 0;
        for (int64_t i = 0; i < 100; ++i) {
            const auto & d = edeq[static_cast<size_t>(er[i].item<int64_t>())];
            for (int64_t c = 0; c < 64; ++c) {
                mismatches += rows[i][c].item<float>() != d[static_cast<size_t>(ids[i].item<int64_t>() * 64 + c)];
            }
        }
        EXPECT_EQ(mismatches, 0);
        EXPECT_THROW(routed_rows(pe, torch::tensor({512}, torch::kLong), torch::tensor({0}, torch::kLong), e), std::exception);
        EXPECT_THROW(routed_rows(pe, torch::tensor({1}, torch::kLong), torch::tensor({3}, torch::kLong), e), std::exception);
    }
}

TEST(gated, ptqr_backward_is_straight_through_as_if_mixed) {
    // L = ||Y||² with Y_i = x_i · D_(r_i)ᵀ (routed). Straight-through: ∂L/∂X = G·W_eff and ∂L/∂W_eff = Gᵀ·X with
    // G = 2Y, so ∂L/∂p_k = ⟨Gᵀ·X, D_k⟩ (issue #22). The exact values in f64 from the same f32 inputs, and the
    // bound on an f32 computation in any order: Y (64 terms), Gᵀ·X (B terms), W_eff (K terms), G·W_eff (64 terms),
    // then ⟨·, D_k⟩ and the softmax backward (gate_grad_from).
    gguf_file f(test::stories260k());
    for (mixture_path path : {mixture_path::cpu, mixture_path::reference}) {
        SCOPED_TRACE(mixture_path_name(path));
        auto g = make_gated(f, "blk.1.attn_q.weight", {GGML_TYPE_Q4_0, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0});
        place_candidates(g, path, torch::kCPU, torch::kFloat, torch::kFloat);
        torch::manual_seed(5);
        const int64_t B = 48;
        const torch::Tensor x = torch::randn({B, 64}).requires_grad_(true);
        const torch::Tensor p = torch::softmax(g.gate, 0);
        const torch::Tensor routes = draw_routes(p, B, 9);
        const torch::Tensor y = routed_product(x, gated_mixture(p, g), routes, g);
        y.pow(2).sum().backward();

        const torch::Tensor d = candidates_f64(g), pd = p.detach().to(torch::kDouble);
        const torch::Tensor xd = x.detach().to(torch::kDouble), xa = xd.abs();
        const torch::Tensor dk = d.view({4, 64, 64}).index_select(0, routes);        // [B, rows, ne0]: D_(r_i)
        const torch::Tensor yd = torch::bmm(dk, xd.unsqueeze(2)).squeeze(2);          // [B, rows]
        const torch::Tensor by = gamma_n(64) * torch::bmm(dk.abs(), xa.unsqueeze(2)).squeeze(2);
        EXPECT_TRUE(within_bound(y, yd, by));
        const torch::Tensor gw = 2 * yd.t().matmul(xd);                               // ∂L/∂W_eff [rows, ne0]
        const torch::Tensor bgw = 2 * by.t().matmul(xa) + matmul_bound((2 * (yd.abs() + by)).t(), xd);
        const gate_grad_check check = test::gate_grad_from(p, d, gw.view(-1), bgw.view(-1));
        EXPECT_TRUE(within_bound(g.grad_p, check.grad_p, check.grad_p_bound));
        EXPECT_TRUE(within_bound(g.gate.grad(), check.grad, check.grad_bound));
        const torch::Tensor w = pd.matmul(d).view({64, 64}), bw = matmul_bound(pd, d).view({64, 64});
        const torch::Tensor wa = w.abs() + bw, ga = 2 * (yd.abs() + by);
        const torch::Tensor bx = 2 * by.matmul(wa) + 2 * yd.abs().matmul(bw) + gamma_n(64) * ga.matmul(wa);
        EXPECT_TRUE(within_bound(x.grad(), 2 * yd.matmul(w), bx));
        // What the bounds reject: the gradient of the mixing forward (Y = X·W_effᵀ), and ⟨G, D_k⟩ without a row.
        const torch::Tensor gw_mix = 2 * xd.matmul(w.t()).t().matmul(xd);
        EXPECT_FALSE(within_bound(d.matmul(gw_mix.view(-1)), check.grad_p, check.grad_p_bound));
        EXPECT_FALSE(within_bound(last_row_left_out(check, d, 64), check.grad_p, check.grad_p_bound));

        // Embedding rows: L = ||R||², G_i = 2·D_(r_i)[ids_i] exactly (rows are exact, doubling too), and
        // ∂L/∂p_k = Σ_i ⟨G_i, D_k[ids_i]⟩, the rows rule of the mixture.
        auto e = make_gated(f, "token_embd.weight", {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0});
        place_candidates(e, path, torch::kCPU, torch::kFloat, torch::kFloat);
        const torch::Tensor ids = torch::tensor({5, 17, 5, 300, 9, 17}, torch::kLong);
        const torch::Tensor pe = torch::softmax(e.gate, 0);
        const torch::Tensor er = torch::tensor({0, 1, 1, 0, 1, 0}, torch::kLong);
        routed_rows(pe, ids, er, e).pow(2).sum().backward();
        const torch::Tensor d_rows = candidate_rows(candidates_f64(e), e, ids);        // [K, n·ne0]
        const torch::Tensor gr = 2 * d_rows.view({2, 6, 64}).gather(0, er.view({1, 6, 1}).expand({1, 6, 64})).view(-1);
        const gate_grad_check echeck = test::gate_grad_from(pe, d_rows, gr, torch::zeros_like(gr));
        EXPECT_TRUE(within_bound(e.grad_p, echeck.grad_p, echeck.grad_p_bound));
        EXPECT_TRUE(within_bound(e.gate.grad(), echeck.grad, echeck.grad_bound));
        const torch::Tensor gr_mix = 2 * pe.detach().to(torch::kDouble).matmul(d_rows);  // the mixture's G
        EXPECT_FALSE(within_bound(d_rows.matmul(gr_mix), echeck.grad_p, echeck.grad_p_bound));
    }
}

TEST(gated, ptqr_is_parsed_by_name) {
    EXPECT_EQ(parse_routing("ptqr"), routing_mode::ptqr);
    EXPECT_EQ(parse_routing("mix"), routing_mode::mix);
    EXPECT_NE(test::error_of([] { parse_routing("gumbel"); }).find("--routing 'gumbel'"), std::string::npos);
}
