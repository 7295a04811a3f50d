// Mixture-of-experts models (issue #18) on a qwen3moe fixture whose calibration cannot reach every expert: 48 experts,
// 2 per token, and an imatrix of one chunk of 16 tokens, so at most 32 experts of each layer are routed to and at
// least 16 never are. The imatrix's per-expert counts (libllama's MUL_MAT_ID and our LibTorch forward agree), every
// expert's candidate bytes against ggml_quantize_chunk of its own slice with its own importance, and the export
// against llama_model_quantize with the same overrides and imatrix.
#include "data/dataset.h"
#include "export/export.h"
#include "export/recipe.h"
#include "ggml/gguf.h"
#include "ggml/quant.h"
#include "ggml/types.h"
#include "imatrix/collect.h"
#include "imatrix/imatrix.h"
#include "model/blocks.h"
#include "model/fixture.h"
#include "model/gguf_weights.h"
#include "model/registry.h"
#include "model/parity.h"
#include "train/candidates.h"
#include "train/gated.h"
#include "fixture_cache.h"
#include "test_util.h"
#include "tolerance.h"

#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <set>

using namespace voodoo;

namespace {

constexpr int64_t k_experts = 48;
constexpr int64_t k_used = 2;
constexpr int64_t k_tokens = 16;  // one imatrix chunk: k_tokens · k_used = 32 < 48 routed (token, expert) pairs

/// 256 wide (every block type fits the gate and up experts), FFN 128 per expert (down's rows of 128 take only
/// 32-block types: llama.cpp's fallbacks apply), one layer of 48 experts, llama's SentencePiece vocabulary.
fixture_spec moe_spec() {
    fixture_spec s;
    s.arch = "qwen3moe";
    s.n_embd = 256;
    s.n_layer = 1;
    s.n_head = 4;
    s.n_head_kv = 2;
    s.head_dim = 64;
    s.n_ff = 512;
    s.n_expert = k_experts;
    s.n_expert_used = k_used;
    s.n_ff_exp = 128;
    s.seed = 3;
    s.tied_output = true;
    s.weight_type = GGML_TYPE_F32;  // libllama's CPU matmuls then round nothing (BF16 weights round the activations)
    s.vocab_path = std::string(VOODOO_LLAMA_MODELS_DIR) + "/ggml-vocab-llama-spm.gguf";
    return s;
}

struct moe_case {
    test::temp_dir dir;
    std::string model = test::cached_fixture(moe_spec());
    std::string data = dir.file("data");
    imatrix im;          // libllama's
    imatrix im_torch;    // our LibTorch forward's
    moe_case() {
        std::ifstream in(test::shared_data() + "/text/tinystories/tinystories_val.txt", std::ios::binary);
        std::string text(4000, '\0');
        in.read(text.data(), static_cast<std::streamsize>(text.size()));
        test::write_file(dir.file("text.txt"), text);
        data_options d;
        d.model = model;
        d.texts = {dir.file("text.txt")};
        d.ctx = k_tokens;
        d.val_fraction = 0.0;
        d.out_dir = data;
        prepare_data(d);
        imatrix_options o;
        o.model = model;
        o.data_dir = data;
        o.max_chunks = 1;
        o.n_threads = 1;
        im = collect_imatrix(o);
        im_torch = collect_imatrix_torch(o, torch::kCPU);
    }
};

const moe_case & the_case() {
    static const moe_case c;
    return c;
}

}  // namespace

TEST(moe, the_imatrix_counts_each_experts_routed_tokens_and_reports_the_experts_never_reached) {
    const moe_case & c = the_case();
    const std::vector<expert_coverage> coverage = imatrix_expert_coverage(c.im);
    ASSERT_EQ(coverage.size(), 3u);  // gate, up and down experts of the one layer
    for (const expert_coverage & e : coverage) {
        SCOPED_TRACE(e.name);
        EXPECT_EQ(e.n_experts, k_experts);
        const imatrix_entry & entry = c.im.entries.at(e.name);
        int64_t routed = 0;
        for (const int64_t n : entry.counts) {
            routed += n;
        }
        EXPECT_EQ(routed, k_tokens * k_used);  // every token to exactly 2 experts, counted once per expert
        EXPECT_LE(e.n_reached, k_tokens * k_used);
        EXPECT_GE(static_cast<int64_t>(e.unreached.size()), k_experts - k_tokens * k_used);
        EXPECT_EQ(e.n_reached + static_cast<int64_t>(e.unreached.size()), k_experts);
        EXPECT_EQ(e.tokens, entry.counts);  // each expert's tokens, as experts.json and `voodoo imatrix --json` give them
        // An unreached expert's importance is 1 in every column, as llama-quantize's load_imatrix makes it.
        const std::vector<float> importance = imatrix_column_importance(c.im, e.name);
        for (const int64_t x : e.unreached) {
            for (int64_t j = 0; j < entry.ne0(); ++j) {
                ASSERT_EQ(importance[static_cast<size_t>(x * entry.ne0() + j)], 1.0f);
            }
        }
        // Our LibTorch forward routes every token to the same experts as libllama: the same counts, expert by expert.
        // Σx² agrees normwise per expert (the largest difference over the expert's columns, relative to its largest
        // column: a column where a few tokens' activations are near 0 has no relative precision of its own) within the
        // bound of tests/test_imatrix_torch.cpp: libllama sums ≤ 16 squares in f32 (γ_17), ours in f64 rounded once
        // (2⁻²⁴), of activations from two forwards within the F32 parity bound ε_p (squares: 2ε_p + ε_p²).
        const imatrix_entry & ours = c.im_torch.entries.at(e.name);
        EXPECT_EQ(ours.counts, entry.counts);
        ASSERT_EQ(ours.in_sum2.size(), entry.in_sum2.size());
        const double eps_p = parity_bound("F32");
        const double bound = test::gamma_n(k_tokens + 1) + std::ldexp(1.0, -24) + 2 * eps_p + eps_p * eps_p;
        const int64_t ne0 = entry.ne0();
        double worst = 0;
        for (int64_t x = 0; x < k_experts; ++x) {
            double largest = 0, diff = 0;
            for (int64_t j = 0; j < ne0; ++j) {
                const size_t i = static_cast<size_t>(x * ne0 + j);
                largest = std::max(largest, double(entry.in_sum2[i]));
                diff = std::max(diff, std::abs(double(ours.in_sum2[i]) - entry.in_sum2[i]));
            }
            if (largest > 0) {
                worst = std::max(worst, diff / largest);
            } else {
                EXPECT_EQ(diff, 0.0) << "expert " << x << ": never routed to, nothing summed in either";
            }
        }
        EXPECT_LE(worst, bound);
        testing::Test::RecordProperty("worst_rel_" + e.name, fmt::format("{:.3g}", worst));
        testing::Test::RecordProperty("worst_rel_" + e.name, fmt::format("{:.3g}", worst));
    }
    const std::string text = expert_coverage_text(coverage);
    EXPECT_EQ(text.rfind(fmt::format("blk.0: {} of {} experts reached", coverage[0].n_reached, k_experts), 0), 0u) << text;
    EXPECT_NE(text.find(fmt::format("never: {}", coverage[0].unreached[0])), std::string::npos) << text;
}

TEST(moe, every_experts_candidate_is_ggml_quantize_chunk_of_its_own_slice_with_its_own_importance) {
    const moe_case & c = the_case();
    const gguf_file file(c.model);
    const importance_map importance = imatrix_importance(c.im);
    for (const char * name : {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"}) {
        const gguf_tensor & t = file.tensor(name);
        ASSERT_EQ(t.ne[2], k_experts);
        const std::vector<float> w = tensor_to_f32(file, t);
        const std::span<const float> imp = importance_for(&importance, t);
        ASSERT_EQ(imp.size(), static_cast<size_t>(t.ne[0] * k_experts));
        for (const ggml_type type : {GGML_TYPE_IQ2_XS, GGML_TYPE_Q4_K, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0}) {
            if (!type_fits(type, t.ne[0])) {
                continue;
            }
            SCOPED_TRACE(fmt::format("{} as {}", name, type_name(type)));
            const std::vector<uint8_t> bytes = quantize_tensor(file, t, type, imp, {}, 1);
            const size_t row = ggml_row_size(type, t.ne[0]);
            const size_t per_expert = row * static_cast<size_t>(t.ne[1]);
            ASSERT_EQ(bytes.size(), per_expert * k_experts);
            int n_importance_mattered = 0;
            for (int64_t e = 0; e < k_experts; ++e) {
                // The call llama_tensor_quantize_impl makes for expert e: its rows, its ne0 importance values.
                std::vector<uint8_t> theirs(per_expert);
                const float * src = w.data() + e * t.ne[0] * t.ne[1];
                ggml_quantize_chunk(type, src, theirs.data(), 0, t.ne[1], t.ne[0], imp.data() + e * t.ne[0]);
                ASSERT_EQ(std::memcmp(theirs.data(), bytes.data() + e * per_expert, per_expert), 0) << "expert " << e;
                if (!type_info_of(type).requires_imatrix) {
                    std::vector<uint8_t> plain(per_expert);
                    ggml_quantize_chunk(type, src, plain.data(), 0, t.ne[1], t.ne[0], nullptr);
                    n_importance_mattered += plain != theirs;
                }
            }
            if (!type_info_of(type).requires_imatrix && type != GGML_TYPE_Q5_0) {
                // The importance really is per expert: it changed the bytes of the reached experts.
                EXPECT_GT(n_importance_mattered, 0);
            }
        }
    }
}

TEST(moe, export_equals_llama_model_quantize_with_the_overrides_and_an_imatrix_that_missed_experts) {
    const moe_case & c = the_case();
    const gguf_file src(c.model);
    const importance_map importance = imatrix_importance(c.im);
    recipe r = recipe_from_model(src);
    const std::vector<ggml_type> cycle = {GGML_TYPE_IQ2_XS, GGML_TYPE_Q4_K, GGML_TYPE_IQ3_S, GGML_TYPE_Q5_1,
                                          GGML_TYPE_IQ4_NL, GGML_TYPE_Q6_K, GGML_TYPE_Q8_0};
    std::set<std::string> expert_types;
    size_t i = 0;
    for (recipe_tensor & t : r.tensors) {
        for (size_t k = 0; k < cycle.size(); ++k) {
            const ggml_type type = cycle[(i + k) % cycle.size()];
            if (type_fits(type, t.shape[0])) {
                t.type = type;
                break;
            }
        }
        t.bytes = tensor_bytes(t.type, t.shape, t.name);
        if (t.name.find("_exps.") != std::string::npos) {
            expert_types.insert(type_name(t.type));
        }
        ++i;
    }
    EXPECT_EQ(expert_types.size(), 3u);
    export_options opts;
    opts.importance = &importance;
    opts.imatrix_file = "imatrix.gguf";
    export_gguf(src, r, c.dir.file("ours.gguf"), opts);
    ASSERT_TRUE(test::llama_quantize_with_recipe(c.model, c.dir.file("theirs.gguf"), r, &importance));
    test::expect_same_tensor_data(c.dir.file("ours.gguf"), c.dir.file("theirs.gguf"));
    // The router is never quantized: F32 in both files, the source's bytes.
    const gguf_file ours(c.dir.file("ours.gguf"));
    EXPECT_EQ(ours.tensor("blk.0.ffn_gate_inp.weight").type, GGML_TYPE_F32);
    EXPECT_EQ(ours.tensor("blk.0.ffn_up_exps.weight").n_dims, 3);
}

namespace {

/// The gated student of the fixture's three expert tensors: a 2-type menu each, random gate logits, the CPU path.
std::vector<gated_tensor> gated_experts(const gguf_file & file) {
    std::vector<gated_tensor> out;
    torch::manual_seed(7);
    for (const char * name : {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"}) {
        gated_tensor g;
        g.tensor = &file.tensor(name);
        g.types = {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0};  // 32-block types: down's rows of 128 take them
        for (const ggml_type type : g.types) {
            g.bytes.push_back(quantize_tensor(file, *g.tensor, type, {}, {}, 1));
        }
        g.gate = torch::randn({2}).requires_grad_(true);
        g.n_threads = 1;
        place_candidates(g, mixture_path::cpu, torch::kCPU, torch::kFloat, torch::kFloat);
        out.push_back(std::move(g));
    }
    return out;
}

/// The student, counting the experts moe_ffn asks it to form and keeping each expert tensor's weights as the forward
/// used them (every expert, or only `ids`), so that the test can read ∂L/∂W after the backward.
class counting_student : public gated_weights {
public:
    using gated_weights::gated_weights;
    torch::Tensor experts(const std::string & name, const torch::Tensor & ids) override {
        formed += ids.numel();
        torch::Tensor w = gated_weights::experts(name, ids);
        if (w.requires_grad()) {
            w.retain_grad();
        }
        used[name] = {w, ids.to(torch::kLong).reshape({-1})};
        return w;
    }
    torch::Tensor get(const std::string & name) override {
        torch::Tensor w = gated_weights::get(name);
        if (w.dim() == 3 && w.requires_grad()) {
            w.retain_grad();
            used[name] = {w, torch::arange(w.size(0), torch::kLong)};
        }
        return w;
    }
    int64_t formed = 0;
    std::map<std::string, std::pair<torch::Tensor, torch::Tensor>> used;  // name → (weights, their experts)
};

}  // namespace

TEST(moe, the_student_forms_only_the_routed_experts_with_the_same_logits_and_gate_gradients) {
    // 16 tokens × 2 experts reach at most 32 of the 48 experts, so moe_ffn asks the student for those experts only
    // (weight_source::experts) and the mixture of the others is never formed.
    const moe_case & c = the_case();
    const gguf_file file(c.model);
    auto model = build_model(file);
    gguf_weights base(file);
    std::vector<gated_tensor> gated = gated_experts(file);
    counting_student student(base, gated);

    // The experts' mixture equals the whole mixture's rows bit for bit (the same f32 sums in the same order), and its
    // gate gradient for an upstream gradient G on those experts equals the whole tensor's with G zero elsewhere up to
    // the order of the f32 dot products: |Δ| ≤ 2·γ_n·Σ|G|·|deq_k| for n terms (Higham, Accuracy and Stability, 3.1).
    gated_tensor & down = gated[2];
    const std::string name = down.tensor->name;
    const torch::Tensor used = torch::tensor(std::vector<int64_t>{1, 5, 6, 40}, torch::kLong);
    const torch::Tensor part = student.experts(name, used);
    const torch::Tensor whole = student.get(name);
    ASSERT_EQ(part.sizes(), (std::vector<int64_t>{4, down.tensor->ne[1], down.tensor->ne[0]}));
    EXPECT_TRUE(torch::equal(part.detach(), whole.detach().index_select(0, used)));
    const torch::Tensor G = torch::randn(part.sizes());
    down.grad_p = torch::Tensor();
    (part * G).sum().backward();
    const torch::Tensor grad_part = down.grad_p.clone();
    down.grad_p = torch::Tensor();
    (whole * torch::zeros(whole.sizes()).index_copy(0, used, G)).sum().backward();
    const torch::Tensor grad_whole = down.grad_p.clone();
    for (int64_t k = 0; k < 2; ++k) {
        const torch::Tensor deq = candidate_weights(down, static_cast<size_t>(k), torch::kCPU)
                                      .view({down.tensor->ne[2], down.tensor->ne[1], down.tensor->ne[0]})
                                      .index_select(0, used);
        const double scale = (G.to(torch::kDouble).abs() * deq.to(torch::kDouble).abs()).sum().item<double>();
        const double bound = 2 * test::gamma_n(down.tensor->n_elements()) * scale;
        EXPECT_LE(std::abs(grad_part[k].item<double>() - grad_whole[k].item<double>()), bound) << "candidate " << k;
        EXPECT_NE(grad_part[k].item<double>(), 0.0);
    }
    EXPECT_THROW(student.experts(name, torch::tensor(std::vector<int64_t>{48}, torch::kLong)), voodoo::error);

    // Through the whole model: the routed-only forward and the every-expert forward give the same logits (up to the
    // order of f32 sums in the batched products: 1e-5 of the largest, as the grouped/loop test), and each gate's
    // ∂L/∂p_k = ⟨G, deq(Q_k)⟩ agrees within what its inputs allow: the dot products' f32 rounding in either order,
    // 2·γ_n·Σ|G|·|deq_k| (n the whole tensor's weights), plus what the two runs' G differ by, Σ|G_routed − G_all|·|deq_k|
    // (both G read after the backward: the difference comes from the products' summation order).
    const std::vector<int64_t> ids = {1, 450, 2106, 367, 263, 2217, 29892, 727, 471, 263, 2217, 7826, 4257, 365, 2354, 29889};
    const torch::Tensor tokens = torch::tensor(ids, torch::kLong).view({1, -1});
    struct run_out {
        torch::Tensor logits;
        std::vector<torch::Tensor> grad_p, G;  // per gated tensor: ∂L/∂p [K] f64, ∂L/∂W over every expert [E, r, c]
    };
    auto run = [&](bool routed_only) {
        set_routed_experts_only(routed_only);
        student.used.clear();
        for (gated_tensor & g : gated) {
            g.gate.mutable_grad() = torch::Tensor();
            g.grad_p = torch::Tensor();
        }
        run_out r;
        r.logits = model->forward(tokens, student);
        r.logits.square().mean().backward();
        set_routed_experts_only(true);
        r.logits = r.logits.detach();
        for (gated_tensor & g : gated) {
            const auto & [w, experts] = student.used.at(g.tensor->name);
            torch::Tensor full = torch::zeros({g.tensor->ne[2], g.tensor->ne[1], g.tensor->ne[0]});
            r.G.push_back(full.index_copy(0, experts, w.grad().to(torch::kFloat)));
            r.grad_p.push_back(g.grad_p.clone());
        }
        return r;
    };
    student.formed = 0;
    const run_out routed = run(true);
    // Three tensors, each formed for the experts the 32 (token, expert) pairs reach: at most 32 of 48.
    EXPECT_GT(student.formed, 0);
    EXPECT_LE(student.formed, 3 * k_tokens * k_used);
    student.formed = 0;
    const run_out all = run(false);
    EXPECT_EQ(student.formed, 0);
    EXPECT_LE((routed.logits - all.logits).abs().max().item<double>(), 1e-5 * all.logits.abs().max().item<double>());
    for (size_t i = 0; i < gated.size(); ++i) {
        SCOPED_TRACE(gated[i].tensor->name);
        const torch::Tensor G = all.G[i].to(torch::kDouble), dG = (routed.G[i].to(torch::kDouble) - G).abs();
        for (int64_t k = 0; k < 2; ++k) {
            const torch::Tensor deq = candidate_weights(gated[i], static_cast<size_t>(k), torch::kCPU).to(torch::kDouble).view(G.sizes()).abs();
            const double bound = 2 * test::gamma_n(gated[i].tensor->n_elements()) * (G.abs() * deq).sum().item<double>() +
                                 (dG * deq).sum().item<double>();
            const double a = all.grad_p[i][k].item<double>(), b = routed.grad_p[i][k].item<double>();
            EXPECT_NE(a, 0.0);
            EXPECT_LE(std::abs(a - b), bound) << "candidate " << k;
        }
    }
}

TEST(moe, the_dry_run_says_how_many_expert_tensors_and_experts_there_are) {
    const moe_case & c = the_case();
    // A target inside the range (Q4_0 everywhere is about 0.53 of the all-Q8_0 file): outside it the dry run exits 1.
    const std::string args = fmt::format("quantize {} --text {} --ratio 0.8 --ctx 16 --eval-chunks 0 --baselines none "
                                         "--menu Q4_0,Q8_0 --work {} --dry-run", c.model, c.dir.file("text.txt"), c.dir.file("work"));
    test::run_result r = test::run_voodoo_stdout(args + " --json -");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const nlohmann::json plan = nlohmann::json::parse(r.output);
    ASSERT_TRUE(plan.contains("experts")) << r.output;
    EXPECT_EQ(plan["experts"]["tensors"], 3);  // gate, up and down of the one layer
    EXPECT_EQ(plan["experts"]["experts_per_tensor"], k_experts);
    EXPECT_EQ(plan["experts"]["used_per_token"], k_used);
    const gguf_file file(c.model);
    int64_t expert_weights = 0;
    for (const char * n : {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"}) {
        expert_weights += file.tensor(n).n_elements();
    }
    EXPECT_EQ(plan["experts"]["weights"], expert_weights);
    r = test::run_voodoo_stdout(args);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("experts: 3 expert tensors of {} experts ({} used per token)", k_experts, k_used)),
              std::string::npos)
        << r.output;
}
