// Export and budget on a synthetic llama model whose rows are 256 wide, so the K-quants and the
// 256-block IQ types fit (stories260K's 64-wide rows take only 32-block types).
#include "export/export.h"
#include "ggml/runtime.h"
#include "ggml/llama_logits.h"
#include "ggml/types.h"
#include "model/fixture.h"
#include "model/gguf_weights.h"
#include "model/registry.h"
#include "fixture_cache.h"
#include "test_util.h"
#include "train/budget.h"

#include <fmt/format.h>
#include "train/candidates.h"
#include "train/gated.h"

#include <gtest/gtest.h>
#include <llama.h>

#include <cstring>
#include <random>
#include <set>

using namespace voodoo;

namespace {

std::string synthetic_model() {
    fixture_spec spec;
    spec.n_embd = 256;
    spec.n_layer = 2;
    spec.n_head = 4;
    spec.n_head_kv = 2;
    spec.head_dim = 64;
    spec.n_ff = 512;
    spec.vocab_path = fmt::format("{}/ggml-vocab-llama-spm.gguf", VOODOO_LLAMA_MODELS_DIR);
    return test::cached_fixture(spec);
}

const std::vector<ggml_type> k_kquant_cycle = {GGML_TYPE_Q2_K, GGML_TYPE_Q3_K,  GGML_TYPE_Q4_K,   GGML_TYPE_Q5_K,
                                        GGML_TYPE_Q6_K, GGML_TYPE_IQ4_XS, GGML_TYPE_IQ3_S, GGML_TYPE_Q8_0,
                                        GGML_TYPE_Q4_0, GGML_TYPE_F16};

recipe cycled(const gguf_file & src) {
    recipe r = recipe_from_model(src);
    for (size_t i = 0; i < r.tensors.size(); ++i) {
        r.tensors[i].type = k_kquant_cycle[i % k_kquant_cycle.size()];
        r.tensors[i].bytes = tensor_bytes(r.tensors[i].type, r.tensors[i].shape, r.tensors[i].name);
    }
    return r;
}

}  // namespace

TEST(export_synthetic, equals_llama_model_quantize_with_k_quant_overrides) {
    test::temp_dir dir;
    gguf_file src(synthetic_model());
    const recipe r = cycled(src);
    std::set<ggml_type> used;
    for (const auto & t : r.tensors) {
        used.insert(t.type);
    }
    EXPECT_GE(used.size(), 6u);
    const std::string ours = dir.file("ours.gguf"), theirs = dir.file("theirs.gguf");
    export_gguf(src, r, ours, {});

    ASSERT_TRUE(test::llama_quantize_with_recipe(src.path(), theirs, r, nullptr));
    test::expect_same_tensor_data(ours, theirs);
}

TEST(export_synthetic, libllama_logits_of_the_export_equal_the_one_hot_student) {
    test::temp_dir dir;
    gguf_file src(synthetic_model());
    const recipe r = cycled(src);
    const std::string out = dir.file("out.gguf");
    export_gguf(src, r, out, {});

    // The student with one-hot gates on the recipe, from the source model's candidates.
    std::vector<gated_tensor> gated;
    gated.reserve(r.tensors.size());
    for (const auto & t : r.tensors) {
        gated_tensor g;
        g.tensor = &src.tensor(t.name);
        g.types = {t.type};
        g.bytes = {quantize_tensor(src, *g.tensor, t.type, {})};
        g.gate = torch::zeros({1});
        gated.push_back(std::move(g));
    }
    gguf_weights dense(src);
    gated_weights student(dense, gated);
    auto model = build_model(src);
    std::vector<int32_t> ids;
    std::mt19937 rng(3);
    for (int i = 0; i < 64; ++i) {
        ids.push_back(static_cast<int32_t>(rng() % 32000));
    }
    auto tokens = torch::empty({1, 64}, torch::kLong);
    for (int i = 0; i < 64; ++i) {
        tokens[0][i] = ids[static_cast<size_t>(i)];
    }
    torch::Tensor ours;
    {
        torch::NoGradGuard no_grad;
        ours = model->forward(tokens, student).reshape({64, -1});
    }
    llama_reference ref(out, 1);
    auto theirs_v = ref.logits(ids);
    const auto theirs = torch::from_blob(theirs_v.data(), {64, ref.n_vocab()}, torch::kFloat);
    const double rel = (ours - theirs).abs().max().item<double>() / theirs.abs().max().item<double>();
    // libllama rounds the activations of quantized matmuls to Q8_K/Q8_0 blocks; the student keeps them in
    // f32, so the export matches within check-parity's bound for quantized weights (docs/ARCHITECTURES.md).
    EXPECT_LT(rel, 0.1);
    EXPECT_GE((ours.argmax(-1) == theirs.argmax(-1)).to(torch::kFloat).mean().item<double>(), 0.9);
}

TEST(export_synthetic, finalized_recipes_fit_the_target_across_the_range) {
    test::temp_dir dir;
    gguf_file src(synthetic_model());
    const auto menus = build_menus(src, {});
    const budget range = make_budget(src, menus, {target_kind::size, 2e7}, {});  // any feasible target
    std::mt19937 rng(9);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (int i = 0; i <= 4; ++i) {
        const target goal{target_kind::size, std::floor(range.min_total + (range.max_total - range.min_total) * i / 4.0)};
        const budget b = make_budget(src, menus, goal, {});
        std::vector<std::vector<double>> probs, loss;
        for (const auto & c : b.cost) {
            std::vector<double> p, l;
            for (double bytes : c) {
                p.push_back(u(rng));
                l.push_back(1e5 / bytes);
            }
            probs.push_back(p);
            loss.push_back(l);
        }
        const auto choice = finalize_choice(b, probs, loss);
        const recipe r = recipe_from_choice(src, menus, choice, probs, goal);
        const auto res = export_gguf(src, r, dir.file(fmt::format("f{}.gguf", i)), {});
        EXPECT_EQ(static_cast<double>(res.file_bytes), b.total(choice)) << goal.str();
        EXPECT_LE(static_cast<double>(res.file_bytes), goal.value) << goal.str();
    }
}
