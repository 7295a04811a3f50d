// The model runtime: GGUF → LibTorch forward, checked against libllama's logits on the same tokens.
#include "common/error.h"
#include "ggml/gguf.h"
#include "ggml/llama_logits.h"
#include "model/gguf_weights.h"
#include "model/parity.h"
#include "model/registry.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

using namespace voodoo;

TEST(model_parity, stories260k_f32_logits_match_libllama_within_1e_3_of_max_logit) {
    parity_options o;
    o.n_tokens = 128;
    const parity_report r = check_parity(test::stories260k(), o);
    EXPECT_EQ(r.arch, "llama");
    EXPECT_EQ(r.weight_types, "F32");
    EXPECT_EQ(r.n_vocab, 512);
    EXPECT_GT(r.max_abs_logit, 1.0);
    EXPECT_LE(r.max_abs_diff, 1e-3 * r.max_abs_logit) << parity_to_text(r);
    EXPECT_TRUE(r.within);
    EXPECT_EQ(r.same_top_pct, 100.0) << parity_to_text(r);
}

TEST(model_parity, stories260k_text_tokenized_by_libllama_matches) {
    parity_options o;
    o.n_tokens = 64;
    o.text_path = test::shared_data() + "/text/tinystories/tinystories_val.txt";
    const parity_report r = check_parity(test::stories260k(), o);
    EXPECT_LE(r.rel_diff, 1e-3) << parity_to_text(r);
}

TEST(model_forward, batched_sequences_equal_their_single_runs) {
    const gguf_file file(test::stories260k());
    auto model = build_model(file);
    gguf_weights w(file);
    torch::NoGradGuard no_grad;
    for (int seed = 0; seed < 20; ++seed) {
        torch::manual_seed(seed);
        const torch::Tensor a = torch::randint(0, 512, {1, 40}, torch::kLong);
        const torch::Tensor b = torch::randint(0, 512, {1, 40}, torch::kLong);
        const torch::Tensor other = torch::randint(0, 512, {1, 40}, torch::kLong);
        const torch::Tensor both = model->forward(torch::cat({a, b}, 0), w);
        ASSERT_EQ(both.sizes(), (std::vector<int64_t>{2, 40, 512}));
        // A row depends on its own tokens only: with the other row changed, the shapes, kernels and summation
        // orders are the same, so its logits are the same bit for bit.
        EXPECT_TRUE(torch::equal(both[0], model->forward(torch::cat({a, other}, 0), w)[0])) << "seed " << seed;
        EXPECT_TRUE(torch::equal(both[1], model->forward(torch::cat({other, b}, 0), w)[1])) << "seed " << seed;
        // A batch of one runs other BLAS block shapes, so its sums are ordered differently. A rounding bound
        // through the whole network needs an f64 forward, which the model lacks; the bound is check-parity's
        // F32 bound (parity_bound), which any two f32 evaluations of the model must meet, and which rejects a
        // 1% change of one attention matrix (model_parity.the_f32_bound_catches_…).
        for (int i = 0; i < 2; ++i) {
            const torch::Tensor one = model->forward(i == 0 ? a : b, w)[0];
            const double bound = parity_bound("F32") * one.abs().max().item<double>();
            EXPECT_LE((both[i] - one).abs().max().item<double>(), bound) << "seed " << seed << " sequence " << i;
        }
    }
}

TEST(model_forward, is_causal_a_later_token_does_not_change_earlier_logits) {
    const gguf_file file(test::stories260k());
    auto model = build_model(file);
    gguf_weights w(file);
    torch::NoGradGuard no_grad;
    torch::manual_seed(5);
    torch::Tensor t = torch::randint(0, 512, {1, 20}, torch::kLong);
    const torch::Tensor before = model->forward(t, w);
    t[0][19] = (t[0][19].item<int64_t>() + 1) % 512;
    const torch::Tensor after = model->forward(t, w);
    EXPECT_TRUE(torch::equal(before.slice(1, 0, 19), after.slice(1, 0, 19)));
    EXPECT_FALSE(torch::equal(before.slice(1, 19, 20), after.slice(1, 19, 20)));
}

TEST(model_forward, bfloat16_compute_stays_close_to_float32) {
    const gguf_file file(test::stories260k());
    auto model = build_model(file);
    gguf_weights w(file);
    torch::NoGradGuard no_grad;
    torch::manual_seed(7);
    const torch::Tensor t = torch::randint(0, 512, {2, 64}, torch::kLong);
    const torch::Tensor f32 = model->forward(t, w);
    model->set_compute_dtype(torch::kBFloat16);
    const torch::Tensor bf16 = model->forward(t, w);
    EXPECT_EQ(bf16.scalar_type(), torch::kFloat);
    const double rel = ((bf16 - f32).abs().max() / f32.abs().max()).item<double>();
    const double same_top = f32.argmax(-1).eq(bf16.argmax(-1)).to(torch::kDouble).mean().item<double>();
    // A quality level of bf16 compute, not an f32 rounding tolerance: every weight and activation is rounded to
    // bf16 (u = 2^-8), so 0.05 ≈ 13·u_bf16 of max|logit|; the f32 summation order moves rel by 2^-16 of that.
    EXPECT_LT(rel, 0.05);
    EXPECT_GT(same_top, 0.9);
}

TEST(model_forward, gradients_flow_into_the_weights_it_is_given) {
    // A weight_source whose output head is a leaf the test owns: the student's situation.
    struct trainable : weight_source {
        gguf_weights base;
        torch::Tensor head;
        explicit trainable(const gguf_file & f) : base(f) {
            head = base.get("output.weight").clone().requires_grad_(true);
        }
        torch::Tensor get(const std::string & n) override { return n == "output.weight" ? head : base.get(n); }
        torch::Tensor rows(const std::string & n, const torch::Tensor & ids) override { return base.rows(n, ids); }
        bool has(const std::string & n) const override { return base.has(n); }
    };
    const gguf_file file(test::stories260k());
    auto model = build_model(file);
    trainable w(file);
    const torch::Tensor t = torch::randint(0, 512, {1, 16}, torch::kLong);
    model->forward(t, w).logsumexp(-1).sum().backward();
    ASSERT_TRUE(w.head.grad().defined());
    EXPECT_GT(w.head.grad().abs().sum().item<double>(), 0.0);
}

TEST(model_forward, observer_sees_every_weight_matmul_and_the_head) {
    const gguf_file file(test::stories260k());
    auto model = build_model(file);
    gguf_weights w(file);
    std::map<std::string, int64_t> seen;
    model->set_observer([&](const std::string & name, const torch::Tensor & x, int64_t) { seen[name] = x.size(-1); });
    torch::NoGradGuard no_grad;
    model->forward(torch::zeros({1, 4}, torch::kLong), w);
    EXPECT_EQ(seen.size(), 5u * 7u + 1u);  // q k v o gate up down per layer, and the head
    EXPECT_EQ(seen.at("blk.0.ffn_down.weight"), 172);
    EXPECT_EQ(seen.at("blk.4.attn_q.weight"), 64);
    EXPECT_EQ(seen.at("output.weight"), 64);
}

TEST(model_parity, the_f32_bound_catches_a_one_percent_change_in_one_attention_matrix) {
    // What the bound is worth: scaling blk.2.attn_k by 1.01 (a subtle attention bug) breaks it.
    struct scaled_k : weight_source {
        gguf_weights base;
        explicit scaled_k(const gguf_file & f) : base(f) {}
        torch::Tensor get(const std::string & n) override {
            return n == "blk.2.attn_k.weight" ? base.get(n) * 1.01f : base.get(n);
        }
        torch::Tensor rows(const std::string & n, const torch::Tensor & ids) override { return base.rows(n, ids); }
        bool has(const std::string & n) const override { return base.has(n); }
    };
    const gguf_file file(test::stories260k());
    auto model = build_model(file);
    const llama_reference reference(test::stories260k());
    std::vector<int32_t> ids(128);
    for (size_t i = 0; i < ids.size(); ++i) {
        ids[i] = static_cast<int32_t>((i * 37 + 11) % 512);
    }
    std::vector<float> ref = reference.logits(ids);
    const torch::Tensor theirs = torch::from_blob(ref.data(), {128, 512});
    const torch::Tensor tokens = torch::tensor(std::vector<int64_t>(ids.begin(), ids.end())).view({1, -1});
    torch::NoGradGuard no_grad;
    gguf_weights exact(file);
    scaled_k wrong(file);
    const double bound = 1e-3 * theirs.abs().max().item<double>();
    EXPECT_LE((model->forward(tokens, exact)[0] - theirs).abs().max().item<double>(), bound);
    EXPECT_GT((model->forward(tokens, wrong)[0] - theirs).abs().max().item<double>(), bound);
}
