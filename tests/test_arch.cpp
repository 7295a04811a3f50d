// qwen2, qwen3, gemma3 and phi3 on synthetic fixtures (voodoo::write_fixture, real vocabularies): the LibTorch
// forward against libllama's logits (F32: max |Δlogit| ≤ 1e-3 · max |logit|, same top token everywhere), that
// the bound catches the architecture's own parts being left out, and one clear error per unsupported key.
#include "common/error.h"
#include "ggml/gguf.h"
#include "ggml/llama_logits.h"
#include "model/fixture.h"
#include "model/gguf_weights.h"
#include "model/parity.h"
#include "model/registry.h"
#include "model/replaced_weight.h"
#include "train/candidates.h"
#include "train/probe.h"
#include "fixture_cache.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>

using namespace voodoo;

namespace {

std::string vocab(const std::string & name) {
    return std::string(VOODOO_LLAMA_MODELS_DIR) + "/ggml-vocab-" + name + ".gguf";
}

/// n_embd 256 (so ne0 fits every block type), 2 layers, 4 heads of 64, 2 KV heads, FFN 512: the llama fixture's
/// shape, with each architecture's own parts and vocabulary.
fixture_spec spec_of(const std::string & arch) {
    fixture_spec s;
    s.arch = arch;
    s.seed = 11;
    if (arch == "qwen2") {
        s.vocab_path = vocab("qwen2");
        s.tied_output = true;
        s.rope_freq_base = 1000000.0f;
    } else if (arch == "qwen3") {
        s.vocab_path = vocab("qwen2");
        s.tied_output = true;
        s.head_dim = 96;  // ≠ n_embd / n_head, as in Qwen3 (128 vs 1024 / 16): attention.key_length decides
        s.rope_freq_base = 1000000.0f;
        s.rms_eps = 1e-6f;
    } else if (arch == "gemma3" || arch == "gemma3-softcap") {
        // Gemma 3's tokenizer is SentencePiece ("llama" in GGUF): llama-spm is the bundle's vocab of that kind
        // (ggml-vocab-gemma-4 has 262144 tokens: a 256-wide F32 embedding alone would be 268 MB).
        s.arch = "gemma3";
        s.vocab_path = vocab("llama-spm");
        s.tied_output = true;
        s.n_head_kv = 1;
        s.head_dim = 96;
        s.rms_eps = 1e-6f;
        s.rope_freq_base = 1000000.0f;
        if (arch == "gemma3") {
            // Layers 0 and 1 slide over the last 16 positions with rope base 10000, layer 2 is global
            // (rope base 1e6): the 128-token test sequence is 8 windows long.
            s.n_layer = 3;
            s.sliding_window = 16;
            s.sliding_window_pattern = 3;
            s.rope_freq_base_swa = 10000.0f;
        } else {
            s.final_logit_softcapping = 3.0f;  // below the logits' range, so the cap bends them
        }
    } else if (arch == "phi3") {
        // Phi-4-mini's traits: a partial rotary (48 of 64 dims) and long/short rope factors, here with an original
        // context of 256, so 128 tokens take the short factors and 300 the long ones.
        s.vocab_path = vocab("phi-3");
        s.n_rot = 48;
        s.rope_factors = true;
        s.n_ctx_orig = 256;
    }
    return s;
}

/// Each architecture's fixture, written once per ctest run (test::cached_fixture).
std::string fixture(const std::string & arch) { return test::cached_fixture(spec_of(arch)); }

parity_report parity_of(const std::string & path, int64_t n_tokens) {
    parity_options o;
    o.n_tokens = n_tokens;
    return check_parity(path, o);
}

/// The F32 bound of the llama issue, and the same top token at every position.
void expect_f32_parity(const parity_report & r) {
    EXPECT_EQ(r.weight_types, "F32");
    EXPECT_GT(r.max_abs_logit, 1.0);
    EXPECT_LE(r.max_abs_diff, 1e-3 * r.max_abs_logit) << parity_to_text(r);
    EXPECT_TRUE(r.within);
    EXPECT_EQ(r.same_top_pct, 100.0) << parity_to_text(r);
    testing::Test::RecordProperty("rel_diff", std::to_string(r.rel_diff));
    testing::Test::RecordProperty("same_top_pct", std::to_string(r.same_top_pct));
}

using tensor_edit = std::function<torch::Tensor(const std::string &, torch::Tensor)>;

torch::Tensor unchanged(const std::string &, torch::Tensor t) { return t; }

/// The file's weights with `edit` applied to what get() returns, `edit_rows` to what rows() returns (the
/// embedding lookup) and `hide` deciding which tensors has() denies: a forward with one of the architecture's
/// parts wrong or left out.
struct edited_weights : weight_source {
    gguf_weights base;
    tensor_edit edit, edit_rows;
    std::function<bool(const std::string &)> hide;
    explicit edited_weights(const gguf_file & f, tensor_edit e = unchanged, tensor_edit r = unchanged,
                            std::function<bool(const std::string &)> h = [](const std::string &) { return false; })
        : base(f), edit(std::move(e)), edit_rows(std::move(r)), hide(std::move(h)) {}
    torch::Tensor get(const std::string & n) override { return edit(n, base.get(n)); }
    torch::Tensor rows(const std::string & n, const torch::Tensor & ids) override { return edit_rows(n, base.rows(n, ids)); }
    bool has(const std::string & n) const override { return !hide(n) && base.has(n); }
};

/// n fixed token ids below n_vocab.
std::vector<int32_t> fixed_ids(int64_t n, int64_t n_vocab) {
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (size_t i = 0; i < ids.size(); ++i) {
        ids[i] = static_cast<int32_t>((i * 7919 + 13) % static_cast<size_t>(n_vocab));
    }
    return ids;
}

/// libllama's logits of n fixed ids on the model at `path`, [n, n_vocab].
torch::Tensor libllama_logits(const std::string & path, int64_t n) {
    const llama_reference reference(path);
    const std::vector<float> ref = reference.logits(fixed_ids(n, reference.n_vocab()));
    return torch::tensor(ref).view({n, -1});
}

/// max |Δlogit| / max |logit| of our forward with weights `w` against libllama on `path`, n fixed token ids.
double rel_diff_against_libllama(const std::string & path, weight_source & w, int64_t n) {
    const gguf_file file(path);
    auto model = build_model(file);
    const torch::Tensor theirs = libllama_logits(path, n);
    const std::vector<int32_t> ids = fixed_ids(n, model->hparams().n_vocab);
    const torch::Tensor tokens = torch::tensor(std::vector<int64_t>(ids.begin(), ids.end())).view({1, -1});
    torch::NoGradGuard no_grad;
    const torch::Tensor ours = model->forward(tokens, w)[0];
    return ((ours - theirs).abs().max() / theirs.abs().max()).item<double>();
}

/// The voodoo::error build_model throws on `arch`'s fixture rewritten by `edit` (minus `skip`), "" when none.
std::string arch_build_error(const std::string & arch, const std::function<void(gguf_context *)> & edit,
                        const std::string & skip = {}) {
    test::temp_dir dir;
    const std::string path = dir.file("bad.gguf");
    test::rewrite_gguf(fixture(arch), path, edit, skip);
    return test::error_of([&] {
        const gguf_file file(path);
        build_model(file);
    });
}

void expect_contains(const std::string & text, const std::string & part) {
    EXPECT_NE(text.find(part), std::string::npos) << "expected '" << part << "' in: " << text;
}

}  // namespace

// ---- qwen2 ----

TEST(arch_parity, qwen2_f32_matches_libllama_within_1e_3_of_max_logit) {
    const parity_report r = parity_of(fixture("qwen2"), 128);
    EXPECT_EQ(r.arch, "qwen2");
    EXPECT_EQ(r.n_vocab, 151936);
    expect_f32_parity(r);
}

TEST(arch_parity, qwen2_without_its_qkv_biases_is_outside_the_bound) {
    const gguf_file file(fixture("qwen2"));
    gguf_weights exact(file);
    edited_weights no_bias(file, unchanged, unchanged, [](const std::string & n) { return n.ends_with(".bias"); });
    EXPECT_LE(rel_diff_against_libllama(fixture("qwen2"), exact, 64), 1e-3);
    EXPECT_GT(rel_diff_against_libllama(fixture("qwen2"), no_bias, 64), 1e-3);
}

TEST(arch_bad_input, qwen2_rope_over_part_of_the_head_is_refused_naming_the_key) {
    const std::string e = arch_build_error("qwen2", [](gguf_context * c) { gguf_set_val_u32(c, "qwen2.rope.dimension_count", 32); });
    expect_contains(e, "'qwen2.rope.dimension_count' = 32 must equal the head size 64");
}

TEST(arch_bad_input, qwen2_yarn_and_unknown_rope_scaling_are_refused_naming_the_key) {
    std::string e = arch_build_error("qwen2", [](gguf_context * c) { gguf_set_val_str(c, "qwen2.rope.scaling.type", "yarn"); });
    expect_contains(e, "'qwen2.rope.scaling.type' = 'yarn' is not supported yet");
    e = arch_build_error("qwen2", [](gguf_context * c) { gguf_set_val_str(c, "qwen2.rope.scaling.type", "spiral"); });
    expect_contains(e, "unknown rope scaling type 'spiral' in 'qwen2.rope.scaling.type'");
}

TEST(arch_bad_input, qwen2_head_count_kv_disagreeing_with_attn_k_names_the_tensor_and_the_key) {
    const std::string e = arch_build_error("qwen2", [](gguf_context * c) { gguf_set_val_u32(c, "qwen2.attention.head_count_kv", 4); });
    expect_contains(e, "blk.0.attn_k.weight");
    expect_contains(e, "head_count_kv 4");
}

// ---- qwen3 ----

TEST(arch_parity, qwen3_f32_head_dim_96_matches_libllama_within_1e_3_of_max_logit) {
    const parity_report r = parity_of(fixture("qwen3"), 128);
    EXPECT_EQ(r.arch, "qwen3");
    const gguf_file file(fixture("qwen3"));
    EXPECT_EQ(build_model(file)->hparams().n_embd_head_k, 96);
    expect_f32_parity(r);
}

TEST(arch_parity, qwen3_with_its_q_k_norm_weights_ignored_is_outside_the_bound) {
    const gguf_file file(fixture("qwen3"));
    edited_weights plain_norm(file, [](const std::string & n, torch::Tensor t) {
        return n.ends_with("attn_q_norm.weight") || n.ends_with("attn_k_norm.weight") ? torch::ones_like(t) : t;
    });
    EXPECT_GT(rel_diff_against_libllama(fixture("qwen3"), plain_norm, 64), 1e-3);
}

TEST(arch_bad_input, qwen3_missing_k_norm_is_named) {
    const std::string e = arch_build_error("qwen3", [](gguf_context *) {}, "blk.1.attn_k_norm.weight");
    expect_contains(e, "missing tensor 'blk.1.attn_k_norm.weight'");
}

TEST(arch_bad_input, qwen3_without_key_length_names_the_key_in_the_shape_error) {
    // Without it the head size falls back to n_embd / n_head = 64, which the 96-wide heads contradict.
    const std::string e = arch_build_error("qwen3", [](gguf_context * c) {
        gguf_remove_key(c, "qwen3.attention.key_length");
        gguf_remove_key(c, "qwen3.attention.value_length");
        gguf_remove_key(c, "qwen3.rope.dimension_count");
    });
    expect_contains(e, "blk.0.attn_q.weight");
    expect_contains(e, "key_length 64");
}

TEST(arch_bad_input, qwen3_mixture_of_experts_is_refused_naming_the_key) {
    const std::string e = arch_build_error("qwen3", [](gguf_context * c) { gguf_set_val_u32(c, "qwen3.expert_count", 8); });
    expect_contains(e, "'qwen3.expert_count' = 8");
}

// ---- gemma3 ----

TEST(arch_parity, gemma3_f32_sliding_and_global_layers_match_libllama_within_1e_3_of_max_logit) {
    const parity_report r = parity_of(fixture("gemma3"), 128);
    EXPECT_EQ(r.arch, "gemma3");
    EXPECT_EQ(r.n_vocab, 32000);
    const gguf_file file(fixture("gemma3"));
    const model_hparams hp = build_model(file)->hparams();
    EXPECT_EQ(hp.n_swa, 16);
    EXPECT_EQ(hp.swa_layers, (std::vector<bool>{true, true, false}));
    expect_f32_parity(r);
}

TEST(arch_parity, gemma3_sliding_window_changes_the_logits_of_the_test_sequence) {
    // The same file with a window longer than the sequence (same layer kinds, same rope bases): libllama's own
    // logits move by far more than the bound after the first window, so the parity above would fail if we
    // ignored the window; within the first window nothing differs.
    test::temp_dir dir;
    const std::string wide = dir.file("wide.gguf");
    test::rewrite_gguf(fixture("gemma3"), wide, [](gguf_context * c) { gguf_set_val_u32(c, "gemma3.attention.sliding_window", 4096); });
    const torch::Tensor windowed = libllama_logits(fixture("gemma3"), 128);
    const torch::Tensor unbounded = libllama_logits(wide, 128);
    const double scale = windowed.abs().max().item<double>();
    EXPECT_GT((windowed - unbounded).abs().max().item<double>() / scale, 1e-2);
    // Within it both runs compute the same logits, but over KV caches of other sizes (other kernels may sum
    // them): held to the F32 parity bound, which the change after the window exceeds tenfold.
    EXPECT_LE((windowed.slice(0, 0, 16) - unbounded.slice(0, 0, 16)).abs().max().item<double>() / scale,
              parity_bound("F32"));
    EXPECT_LE(parity_of(wide, 128).rel_diff, 1e-3);
}

TEST(arch_parity, gemma3_without_the_embedding_scale_is_outside_the_bound) {
    const gguf_file file(fixture("gemma3"));
    edited_weights unscaled(file, unchanged, [](const std::string &, torch::Tensor t) { return t / 16.0f; });
    EXPECT_GT(rel_diff_against_libllama(fixture("gemma3"), unscaled, 64), 1e-3);
}

TEST(arch_parity, gemma3_final_logit_softcapping_matches_libllama) {
    const parity_report r = parity_of(fixture("gemma3-softcap"), 64);
    EXPECT_LE(r.max_abs_logit, 3.0);
    expect_f32_parity(r);
    // Without the cap our logits would exceed 3: the cap is applied, not just harmless.
    const gguf_file file(fixture("gemma3-softcap"));
    auto model = build_model(file);
    gguf_weights w(file);
    torch::NoGradGuard no_grad;
    const torch::Tensor h = model->hidden(torch::zeros({1, 4}, torch::kLong), w);
    EXPECT_GT(model->causal_lm::head(h, w).abs().max().item<double>(), 3.0);
}

TEST(arch_bad_input, gemma3_per_layer_sliding_window_pattern_array_is_refused_naming_the_key) {
    const std::string e = arch_build_error("gemma3", [](gguf_context * c) {
        const std::vector<uint8_t> pattern = {1, 1, 0};
        gguf_set_arr_data(c, "gemma3.attention.sliding_window_pattern", GGUF_TYPE_BOOL, pattern.data(), pattern.size());
    });
    expect_contains(e, "'gemma3.attention.sliding_window_pattern' is a per-layer array");
}

TEST(arch_bad_input, gemma3_sliding_layers_of_another_head_size_are_refused_naming_the_key) {
    const std::string e = arch_build_error("gemma3", [](gguf_context * c) { gguf_set_val_u32(c, "gemma3.attention.key_length_swa", 128); });
    expect_contains(e, "'gemma3.attention.key_length_swa' differs");
}

TEST(arch_bad_input, gemma3_missing_post_ffw_norm_is_named) {
    const std::string e = arch_build_error("gemma3", [](gguf_context *) {}, "blk.2.post_ffw_norm.weight");
    expect_contains(e, "missing tensor 'blk.2.post_ffw_norm.weight'");
}

// ---- phi3 ----

TEST(arch_parity, phi3_f32_fused_qkv_partial_rope_short_factors_match_libllama_within_1e_3_of_max_logit) {
    const parity_report r = parity_of(fixture("phi3"), 128);
    EXPECT_EQ(r.arch, "phi3");
    EXPECT_EQ(r.n_vocab, 32064);
    const gguf_file file(fixture("phi3"));
    EXPECT_EQ(build_model(file)->hparams().n_rot, 48);
    expect_f32_parity(r);
}

TEST(arch_parity, phi3_beyond_the_original_context_takes_the_long_factors_and_matches_libllama) {
    expect_f32_parity(parity_of(fixture("phi3"), 300));
}

TEST(arch_parity, phi3_with_the_long_factors_at_short_context_is_outside_the_bound) {
    const gguf_file file(fixture("phi3"));
    gguf_weights dense(file);
    edited_weights swapped(file, [&](const std::string & n, torch::Tensor t) {
        return n == "rope_factors_short.weight" ? dense.get("rope_factors_long.weight") : t;
    });
    EXPECT_GT(rel_diff_against_libllama(fixture("phi3"), swapped, 128), 1e-3);
}

TEST(arch_bad_input, phi3_longrope_scaling_type_is_refused_naming_the_key) {
    const std::string e = arch_build_error("phi3", [](gguf_context * c) { gguf_set_val_str(c, "phi3.rope.scaling.type", "longrope"); });
    expect_contains(e, "'phi3.rope.scaling.type' = 'longrope' is not supported yet");
}

TEST(arch_bad_input, phi3_fused_qkv_of_the_wrong_size_names_the_tensor_and_the_keys) {
    const std::string e = arch_build_error("phi3", [](gguf_context * c) { gguf_set_val_u32(c, "phi3.attention.head_count_kv", 1); });
    expect_contains(e, "blk.0.attn_qkv.weight");
    expect_contains(e, "head_count_kv 1");
}

TEST(arch_bad_input, phi3_rope_factors_of_the_wrong_length_name_the_tensor) {
    const std::string e = arch_build_error("phi3", [](gguf_context * c) { gguf_set_val_u32(c, "phi3.rope.dimension_count", 32); });
    expect_contains(e, "rope_factors_long.weight");
    expect_contains(e, "phi3.rope.dimension_count = 32");
}

// ---- lfm2 ----

namespace {

/// lfm2's parity fixture: the shape above, 3 layers (convolution, attention, convolution: a convolution after the
/// attention layer too), kernel length 3 as LFM2's. LFM2's own tokenizer (65536 tokens) is not in the bundle; its
/// pre-tokenizer "lfm2" is llama.cpp's LLAMA3 one on a byte-level BPE, which is what llama-bpe is (128256 tokens).
fixture_spec lfm2_spec(int64_t sliding_window = 0) {
    fixture_spec s;
    s.arch = "lfm2";
    s.seed = 11;
    s.vocab_path = vocab("llama-bpe");
    s.tied_output = true;
    s.n_layer = 3;
    s.full_attention_interval = 2;
    s.shortconv_l_cache = 3;
    s.rope_freq_base = 1000000.0f;
    s.sliding_window = sliding_window;
    return s;
}

std::string lfm2_fixture() { return test::cached_fixture(lfm2_spec()); }

/// n_seq different sequences of n fixed-pattern ids through our forward as one [n_seq, n] batch, each row compared
/// with libllama's logits of that sequence alone: the largest max |Δlogit| / max |logit| of the rows.
double batch_rel_diff_against_libllama(const std::string & path, int64_t n_seq, int64_t n) {
    const gguf_file file(path);
    auto model = build_model(file);
    gguf_weights w(file);
    const llama_reference reference(path);
    const int64_t n_vocab = model->hparams().n_vocab;
    std::vector<std::vector<int32_t>> seqs;
    std::vector<int64_t> flat;
    for (int64_t s = 0; s < n_seq; ++s) {
        std::vector<int32_t> ids(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
            ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + s * 104729 + 13) % n_vocab);
        }
        flat.insert(flat.end(), ids.begin(), ids.end());
        seqs.push_back(std::move(ids));
    }
    torch::NoGradGuard no_grad;
    const torch::Tensor hidden = model->hidden(torch::tensor(flat).view({n_seq, n}), w);
    double worst = 0;
    for (int64_t s = 0; s < n_seq; ++s) {
        const std::vector<float> ref = reference.logits(seqs[static_cast<size_t>(s)]);
        const torch::Tensor theirs = torch::from_blob(const_cast<float *>(ref.data()), {n, n_vocab}, torch::kFloat);
        const torch::Tensor ours = model->head(hidden[s], w);
        worst = std::max(worst, ((ours - theirs).abs().max() / theirs.abs().max()).item<double>());
    }
    return worst;
}

}  // namespace

TEST(arch_parity, lfm2_f32_convolution_and_attention_layers_match_libllama_within_1e_3_over_512_tokens) {
    // 512 tokens: the convolution's state must stay exact over a long sequence (the length).
    const parity_report r = parity_of(lfm2_fixture(), 512);
    EXPECT_EQ(r.arch, "lfm2");
    EXPECT_EQ(r.n_vocab, 128256);
    const gguf_file file(lfm2_fixture());
    const model_hparams hp = build_model(file)->hparams();
    EXPECT_EQ(hp.recurrent_layers, (std::vector<bool>{true, false, true}));
    EXPECT_EQ(hp.n_head_kv, 2);
    EXPECT_EQ(hp.n_shortconv_l_cache, 3);
    expect_f32_parity(r);
}

TEST(arch_parity, lfm2_batch_of_three_sequences_matches_libllama_sequence_by_sequence) {
    const double rel = batch_rel_diff_against_libllama(lfm2_fixture(), 3, 512);
    testing::Test::RecordProperty("rel_diff", fmt::format("{:.2g}", rel));
    EXPECT_LE(rel, 1e-3);
}

TEST(arch_parity, lfm2_with_the_convolution_taps_reversed_is_outside_the_bound) {
    // A kernel read in the wrong order (an anti-causal or mis-aligned convolution) must fail the bound.
    const gguf_file file(lfm2_fixture());
    edited_weights flipped(file, [](const std::string & n, torch::Tensor t) {
        return n.ends_with("shortconv.conv.weight") ? t.flip({1}) : t;
    });
    EXPECT_GT(rel_diff_against_libllama(lfm2_fixture(), flipped, 64), 1e-3);
}

TEST(arch_parity, lfm2_sliding_window_attention_matches_libllama_and_changes_its_logits) {
    test::temp_dir dir;
    const std::string windowed = dir.file("lfm2-swa.gguf");
    write_fixture(lfm2_spec(16), windowed);
    const parity_report r = parity_of(windowed, 128);
    expect_f32_parity(r);
    const gguf_file file(windowed);
    EXPECT_EQ(build_model(file)->hparams().n_swa, 16);
    // The same weights without the window: libllama's own logits move by far more than the bound after 16 tokens.
    const torch::Tensor a = libllama_logits(windowed, 128), b = libllama_logits(lfm2_fixture(), 128);
    EXPECT_GT((a - b).abs().max().item<double>() / a.abs().max().item<double>(), 1e-2);
}

namespace {

std::string lfm2_build_error(const std::function<void(gguf_context *)> & edit, const std::string & skip = {}) {
    test::temp_dir dir;
    const std::string path = dir.file("bad.gguf");
    test::rewrite_gguf(lfm2_fixture(), path, edit, skip);
    return test::error_of([&] {
        const gguf_file file(path);
        build_model(file);
    });
}

}  // namespace

TEST(arch_bad_input, lfm2_missing_shortconv_l_cache_is_named) {
    const std::string e = lfm2_build_error([](gguf_context * c) { gguf_remove_key(c, "lfm2.shortconv.l_cache"); });
    expect_contains(e, "missing metadata key 'lfm2.shortconv.l_cache'");
}

TEST(arch_bad_input, lfm2_kernel_length_disagreeing_with_the_conv_tensor_names_both) {
    const std::string e = lfm2_build_error([](gguf_context * c) { gguf_set_val_u32(c, "lfm2.shortconv.l_cache", 4); });
    expect_contains(e, "blk.0.shortconv.conv.weight");
    expect_contains(e, "lfm2.shortconv.l_cache = 4");
}

TEST(arch_bad_input, lfm2_head_count_kv_array_of_the_wrong_length_is_named) {
    const std::string e = lfm2_build_error([](gguf_context * c) {
        const std::vector<int32_t> kv = {0, 2};
        gguf_set_arr_data(c, "lfm2.attention.head_count_kv", GGUF_TYPE_INT32, kv.data(), kv.size());
    });
    expect_contains(e, "'lfm2.attention.head_count_kv' has 2 entries, expected 3");
}

TEST(arch_bad_input, lfm2_layer_kinds_disagreeing_with_the_tensors_name_the_tensor) {
    // head_count_kv says layer 0 attends, but the file holds a convolution there.
    const std::string e = lfm2_build_error([](gguf_context * c) {
        const std::vector<int32_t> kv = {2, 2, 0};
        gguf_set_arr_data(c, "lfm2.attention.head_count_kv", GGUF_TYPE_INT32, kv.data(), kv.size());
    });
    expect_contains(e, "missing tensor 'blk.0.attn_q.weight'");
}

TEST(arch_bad_input, lfm2_missing_conv_kernel_is_named) {
    const std::string e = lfm2_build_error([](gguf_context *) {}, "blk.2.shortconv.conv.weight");
    expect_contains(e, "missing tensor 'blk.2.shortconv.conv.weight'");
}

TEST(arch_bad_input, lfm2_bidirectional_file_is_refused_naming_the_key) {
    const std::string e = lfm2_build_error([](gguf_context * c) { gguf_set_val_bool(c, "lfm2.attention.causal", false); });
    expect_contains(e, "'lfm2.attention.causal' is false");
}

// ---- qwen35 ----

namespace {

/// qwen35's parity fixture: the shape above with Qwen3.5's traits: 3 layers (delta net, attention, delta net), a
/// quarter of each head rotated (16 of 64) with M-RoPE sections, gated delta nets of 2 key heads and 4 value heads
/// of 32 (value heads tiled over key heads, as in Qwen3.5-0.8B's 16 and 32), a 4-tap convolution; its own vocabulary.
fixture_spec qwen35_spec() {
    fixture_spec s;
    s.arch = "qwen35";
    s.seed = 11;
    s.vocab_path = vocab("qwen35");
    s.tied_output = true;
    s.n_layer = 3;
    s.full_attention_interval = 2;
    s.rope_freq_base = 10000000.0f;
    s.rms_eps = 1e-6f;
    return s;
}

std::string qwen35_fixture() { return test::cached_fixture(qwen35_spec()); }

std::string qwen35_build_error(const std::function<void(gguf_context *)> & edit, const std::string & skip = {}) {
    test::temp_dir dir;
    const std::string path = dir.file("bad.gguf");
    test::rewrite_gguf(qwen35_fixture(), path, edit, skip);
    return test::error_of([&] {
        const gguf_file file(path);
        build_model(file);
    });
}

}  // namespace

TEST(arch_parity, qwen35_f32_delta_net_and_gated_attention_match_libllama_within_1e_3_over_512_tokens) {
    // 512 tokens = 8 chunks of the delta rule: the recurrent state must stay exact from chunk to chunk.
    const parity_report r = parity_of(qwen35_fixture(), 512);
    EXPECT_EQ(r.arch, "qwen35");
    const gguf_file file(qwen35_fixture());
    const model_hparams hp = build_model(file)->hparams();
    EXPECT_EQ(hp.recurrent_layers, (std::vector<bool>{true, false, true}));
    EXPECT_EQ(hp.n_rot, 16);
    EXPECT_EQ(hp.ssm_dt_rank, 4);
    EXPECT_EQ(hp.ssm_n_group, 2);
    expect_f32_parity(r);
}

TEST(arch_parity, qwen35_batch_of_three_sequences_matches_libllama_sequence_by_sequence) {
    const double rel = batch_rel_diff_against_libllama(qwen35_fixture(), 3, 512);
    testing::Test::RecordProperty("rel_diff", fmt::format("{:.2g}", rel));
    EXPECT_LE(rel, 1e-3);
}

TEST(arch_parity, qwen35_with_slower_decay_is_outside_the_bound) {
    // The decay is what makes the state forget: halving ssm_a must fail the bound (the recurrence is really used).
    const gguf_file file(qwen35_fixture());
    edited_weights slower(file, [](const std::string & n, torch::Tensor t) { return n.ends_with("ssm_a") ? t * 0.5f : t; });
    EXPECT_GT(rel_diff_against_libllama(qwen35_fixture(), slower, 128), 1e-3);
}

TEST(arch_parity, qwen35_without_the_attention_output_gate_is_outside_the_bound) {
    // attn_q's gate half replaced by large values (sigmoid → 1): the gated attention must differ.
    const gguf_file file(qwen35_fixture());
    edited_weights ungated(file, [](const std::string & n, torch::Tensor t) {
        if (!n.ends_with("attn_q.weight")) {
            return t;
        }
        // rows per head: [query (64) | gate (64)]; the gate rows → 0 gives sigmoid 0.5 everywhere
        torch::Tensor e = t.clone().view({4, 2, 64, -1});
        e.select(1, 1).zero_();
        return e.view_as(t);
    });
    EXPECT_GT(rel_diff_against_libllama(qwen35_fixture(), ungated, 64), 1e-3);
}

TEST(arch_bad_input, qwen35_missing_ssm_conv_kernel_key_is_named) {
    const std::string e = qwen35_build_error([](gguf_context * c) { gguf_remove_key(c, "qwen35.ssm.conv_kernel"); });
    expect_contains(e, "missing metadata key 'qwen35.ssm.conv_kernel'");
}

TEST(arch_bad_input, qwen35_inner_size_disagreeing_with_the_heads_is_named) {
    const std::string e = qwen35_build_error([](gguf_context * c) { gguf_set_val_u32(c, "qwen35.ssm.inner_size", 100); });
    expect_contains(e, "'qwen35.ssm.inner_size' = 100");
}

TEST(arch_bad_input, qwen35_missing_rope_sections_are_named) {
    const std::string e = qwen35_build_error([](gguf_context * c) { gguf_remove_key(c, "qwen35.rope.dimension_sections"); });
    expect_contains(e, "missing metadata key 'qwen35.rope.dimension_sections'");
}

TEST(arch_bad_input, qwen35_multi_token_prediction_layers_are_refused_naming_the_key) {
    const std::string e = qwen35_build_error([](gguf_context * c) { gguf_set_val_u32(c, "qwen35.nextn_predict_layers", 1); });
    expect_contains(e, "'qwen35.nextn_predict_layers' = 1");
}

TEST(arch_bad_input, qwen35_missing_ssm_a_is_named) {
    const std::string e = qwen35_build_error([](gguf_context *) {}, "blk.2.ssm_a");
    expect_contains(e, "missing tensor 'blk.2.ssm_a'");
}

TEST(arch_bad_input, qwen35_conv_kernel_disagreeing_with_the_key_names_both) {
    const std::string e = qwen35_build_error([](gguf_context * c) { gguf_set_val_u32(c, "qwen35.ssm.conv_kernel", 3); });
    expect_contains(e, "blk.0.ssm_conv1d.weight");
    expect_contains(e, "qwen35.ssm.conv_kernel = 3");
}

// ---- qwen3moe ----

namespace {

/// qwen3moe's parity fixture: the qwen3 shape (heads of 64 here) with 8 experts of FFN 256 per layer, 2 per token,
/// as Qwen3-30B-A3B routes 8 of 128; its own vocabulary (qwen2's, as Qwen3's).
fixture_spec qwen3moe_spec() {
    fixture_spec s;
    s.arch = "qwen3moe";
    s.seed = 11;
    s.vocab_path = vocab("qwen2");
    s.tied_output = true;
    s.rope_freq_base = 1000000.0f;
    s.rms_eps = 1e-6f;
    s.n_expert = 8;
    s.n_expert_used = 2;
    s.n_ff_exp = 256;
    return s;
}

std::string qwen3moe_fixture() { return test::cached_fixture(qwen3moe_spec()); }

std::string qwen3moe_build_error(const std::function<void(gguf_context *)> & edit, const std::string & skip = {}) {
    test::temp_dir dir;
    const std::string path = dir.file("bad.gguf");
    test::rewrite_gguf(qwen3moe_fixture(), path, edit, skip);
    return test::error_of([&] {
        const gguf_file file(path);
        build_model(file);
    });
}

}  // namespace

TEST(arch_parity, qwen3moe_f32_routed_experts_match_libllama_within_1e_3_and_every_expert_is_used) {
    const parity_report r = parity_of(qwen3moe_fixture(), 128);
    EXPECT_EQ(r.arch, "qwen3moe");
    expect_f32_parity(r);
    // The same 128 tokens spread over the experts: every layer routes tokens to every one of its 8 experts, so the
    // bound covers each expert's matrices and the routing, not one expert's.
    const gguf_file file(qwen3moe_fixture());
    auto model = build_model(file);
    EXPECT_EQ(model->hparams().n_expert, 8);
    EXPECT_EQ(model->hparams().n_expert_used, 2);
    EXPECT_EQ(model->hparams().n_ff_exp, 256);
    std::map<std::string, std::map<int64_t, int64_t>> routed;  // tensor → expert → tokens
    model->set_observer([&](const std::string & name, const torch::Tensor & x, int64_t expert) {
        if (expert >= 0) {
            routed[name][expert] += x.size(0);
        }
    });
    gguf_weights w(file);
    const std::vector<int32_t> ids = fixed_ids(128, model->hparams().n_vocab);
    torch::NoGradGuard no_grad;
    model->hidden(torch::tensor(std::vector<int64_t>(ids.begin(), ids.end())).view({1, -1}), w);
    ASSERT_EQ(routed.size(), 6u);  // 2 layers × gate, up, down
    for (const auto & [name, per_expert] : routed) {
        EXPECT_EQ(per_expert.size(), 8u) << name;
        int64_t total = 0;
        for (const auto & [e, n] : per_expert) {
            total += n;
        }
        EXPECT_EQ(total, 128 * 2) << name;  // every token to exactly 2 experts
    }
}

TEST(arch_parity, qwen3moe_batch_of_three_sequences_matches_libllama_sequence_by_sequence) {
    const double rel = batch_rel_diff_against_libllama(qwen3moe_fixture(), 3, 128);
    testing::Test::RecordProperty("rel_diff", fmt::format("{:.2g}", rel));
    EXPECT_LE(rel, 1e-3);
}

TEST(arch_parity, qwen3moe_with_the_router_rows_swapped_is_outside_the_bound) {
    // Experts 0 and 1 of every router exchanged: tokens go to other experts, and the bound must see it.
    const gguf_file file(qwen3moe_fixture());
    edited_weights swapped(file, [](const std::string & n, torch::Tensor t) {
        if (!n.ends_with("ffn_gate_inp.weight")) {
            return t;
        }
        torch::Tensor e = t.clone();
        e[0].copy_(t[1]);
        e[1].copy_(t[0]);
        return e;
    });
    EXPECT_GT(rel_diff_against_libllama(qwen3moe_fixture(), swapped, 64), 1e-3);
}

TEST(arch_parity, qwen3moe_without_renormalised_expert_weights_is_outside_the_bound) {
    // Scaling the down experts by 1/2 has the effect of weights that sum to 1/2 instead of 1: outside the bound.
    const gguf_file file(qwen3moe_fixture());
    edited_weights halved(file, [](const std::string & n, torch::Tensor t) {
        return n.ends_with("ffn_down_exps.weight") ? t * 0.5f : t;
    });
    EXPECT_GT(rel_diff_against_libllama(qwen3moe_fixture(), halved, 64), 1e-3);
}

TEST(arch_bad_input, qwen3moe_missing_expert_used_count_is_named) {
    const std::string e = qwen3moe_build_error([](gguf_context * c) { gguf_remove_key(c, "qwen3moe.expert_used_count"); });
    expect_contains(e, "missing metadata key 'qwen3moe.expert_used_count'");
}

TEST(arch_bad_input, qwen3moe_more_experts_per_token_than_experts_is_named) {
    const std::string e = qwen3moe_build_error([](gguf_context * c) { gguf_set_val_u32(c, "qwen3moe.expert_used_count", 9); });
    expect_contains(e, "'qwen3moe.expert_used_count' = 9 must be in [1, 'qwen3moe.expert_count' = 8]");
}

TEST(arch_bad_input, qwen3moe_expert_count_disagreeing_with_the_router_names_the_tensor_and_the_key) {
    const std::string e = qwen3moe_build_error([](gguf_context * c) { gguf_set_val_u32(c, "qwen3moe.expert_count", 4); });
    expect_contains(e, "blk.0.ffn_gate_inp.weight");
    expect_contains(e, "qwen3moe.expert_count = 4");
}

TEST(arch_bad_input, qwen3moe_grouped_expert_routing_is_refused_naming_the_key) {
    const std::string e = qwen3moe_build_error([](gguf_context * c) { gguf_set_val_u32(c, "qwen3moe.expert_group_count", 2); });
    expect_contains(e, "'qwen3moe.expert_group_count' = 2");
}

// ---- qwen35moe ----

namespace {

/// qwen35moe's parity fixture: qwen35's (delta net, attention, delta net) with 8 experts of FFN 256 per layer, 2 per
/// token, and a shared expert of FFN 384 gated per token, as Qwen3.5's MoE models have.
std::string qwen35moe_fixture() {
    fixture_spec s = qwen35_spec();
    s.arch = "qwen35moe";
    s.n_expert = 8;
    s.n_expert_used = 2;
    s.n_ff_exp = 256;
    s.n_ff_shexp = 384;
    return test::cached_fixture(s);
}

}  // namespace

TEST(arch_parity, qwen35moe_f32_delta_nets_experts_and_shared_expert_match_libllama_within_1e_3) {
    const parity_report r = parity_of(qwen35moe_fixture(), 256);
    EXPECT_EQ(r.arch, "qwen35moe");
    const gguf_file file(qwen35moe_fixture());
    const model_hparams hp = build_model(file)->hparams();
    EXPECT_EQ(hp.recurrent_layers, (std::vector<bool>{true, false, true}));
    EXPECT_EQ(hp.n_expert, 8);
    EXPECT_EQ(hp.n_ff_shexp, 384);
    expect_f32_parity(r);
}

TEST(arch_parity, qwen35moe_without_the_shared_experts_gate_is_outside_the_bound) {
    // The shared expert's sigmoid gate zeroed (sigmoid → 1/2 for every token): the bound must see it.
    const gguf_file file(qwen35moe_fixture());
    edited_weights ungated(file, [](const std::string & n, torch::Tensor t) {
        return n.ends_with("ffn_gate_inp_shexp.weight") ? torch::zeros_like(t) : t;
    });
    EXPECT_GT(rel_diff_against_libllama(qwen35moe_fixture(), ungated, 64), 1e-3);
}

TEST(arch_bad_input, qwen35moe_missing_shared_expert_is_named) {
    test::temp_dir dir;
    const std::string path = dir.file("bad.gguf");
    test::rewrite_gguf(qwen35moe_fixture(), path, [](gguf_context *) {}, "blk.1.ffn_up_shexp.weight");
    const std::string e = test::error_of([&] {
        const gguf_file f(path);
        build_model(f);
    });
    expect_contains(e, "blk.1.ffn_up_shexp.weight");
}

TEST(arch_parity, qwen3moe_grouped_expert_products_equal_the_per_expert_loop_in_value_and_gradient) {
    // The same forward and backward two ways: one batched product per expert tensor (tokens padded per expert) and one
    // product per expert. Only the order of f32 sums differs, so the logits and the gradient of an expert tensor agree
    // to f32 rounding (bound: 1e-5 of the largest value, ~100 ulps of accumulated reordering).
    const gguf_file file(qwen3moe_fixture());
    auto model = build_model(file);
    gguf_weights base(file);
    const std::string name = "blk.1.ffn_down_exps.weight";
    const std::vector<int32_t> ids = fixed_ids(96, model->hparams().n_vocab);
    const torch::Tensor tokens = torch::tensor(std::vector<int64_t>(ids.begin(), ids.end())).view({1, -1});
    auto run = [&](expert_products mode) {
        set_expert_products(mode);
        torch::Tensor w = base.get(name).to(torch::kFloat).clone().requires_grad_(true);
        replaced_weight src(base, name, w);
        const torch::Tensor logits = model->forward(tokens, src);
        logits.square().mean().backward();
        set_expert_products(expert_products::automatic);
        return std::pair{logits.detach(), w.grad()};
    };
    const auto [lg, gg] = run(expert_products::grouped);
    const auto [ll, gl] = run(expert_products::per_expert);
    EXPECT_LE((lg - ll).abs().max().item<double>(), 1e-5 * ll.abs().max().item<double>());
    EXPECT_GT(gl.abs().max().item<double>(), 0.0);
    EXPECT_LE((gg - gl).abs().max().item<double>(), 1e-5 * gl.abs().max().item<double>());
}

namespace {

/// What the probe measures for some of `path`'s tensors (the embedding, a head of its own, and two tensors each of
/// layer 1 and of the last layer, as Q4_0), with the layers' streams kept at every layer and at every other one,
/// against the KL of the same one-tensor recipes measured by whole forwards (recipe_kl). Returns how many were compared.
int expect_the_probe_from_kept_streams_equals_whole_forwards(const std::string & path) {
    SCOPED_TRACE(path);
    const gguf_file f(path);
    auto model = build_model(f);
    gguf_weights dense(f), teacher(f);
    const int64_t L = model->hparams().n_layer;
    std::vector<gated_tensor> gated;
    std::map<std::string, int> per_layer;
    for (const gguf_tensor & t : f.tensors()) {
        const bool layer = t.name.rfind("blk.1.", 0) == 0 || t.name.rfind(fmt::format("blk.{}.", L - 1), 0) == 0;
        const bool ends = t.name == "token_embd.weight" || t.name == "output.weight";
        const std::string prefix = t.name.substr(0, t.name.find('.', 4));
        if (t.type != GGML_TYPE_F32 || t.n_dims < 2 || t.ne[0] % 32 != 0 || !(ends || (layer && per_layer[prefix]++ < 2))) {
            continue;
        }
        gated_tensor g;
        g.tensor = &t;
        g.types = {GGML_TYPE_Q4_0, GGML_TYPE_F32};
        for (ggml_type type : g.types) {
            g.bytes.push_back(quantize_tensor(f, t, type, {}));
        }
        gated.push_back(std::move(g));
    }
    const std::vector<int32_t> ids = fixed_ids(96, model->hparams().n_vocab);
    const torch::Tensor tokens = torch::tensor(std::vector<int64_t>(ids.begin(), ids.end())).view({2, 48});
    const int64_t chunk = 40;
    const int64_t stream = tokens.numel() * model->hparams().n_embd * 4;  // one layer's f32 stream
    const auto every_layer = probe_sensitivity(*model, dense, teacher, gated, tokens, torch::kCPU, chunk);
    const auto every_other = probe_sensitivity(*model, dense, teacher, gated, tokens, torch::kCPU, chunk, torch::kFloat,
                                               nullptr, stream * ((L + 1) / 2));
    for (size_t i = 0; i < gated.size(); ++i) {
        std::vector<int> choice(gated.size(), 1);  // every tensor its own F32 bytes …
        choice[i] = 0;                             // … but this one Q4_0
        const double whole = recipe_kl(*model, dense, teacher, gated, choice, tokens, torch::kCPU, chunk);
        EXPECT_GT(whole, 0.0) << gated[i].tensor->name;
        EXPECT_EQ(every_layer[i][0], whole) << gated[i].tensor->name;
        EXPECT_EQ(every_other[i][0], whole) << gated[i].tensor->name;
        EXPECT_EQ(every_layer[i][1], 0.0) << gated[i].tensor->name;
    }
    return static_cast<int>(gated.size());
}

}  // namespace

TEST(arch_probe, every_architecture_probes_from_the_kept_layer_streams_what_whole_forwards_measure_bit_for_bit) {
    // The probe starts a candidate of layer l at the source's stream entering layer l (or a kept layer below it) and
    // a separate head at the final hidden states; the arithmetic is the whole forward's, so the KL is the same double.
    const std::vector<std::string> paths = {test::stories260k(), fixture("qwen2"), fixture("qwen3"), fixture("gemma3"),
                                            fixture("phi3"),      lfm2_fixture(),   qwen35_fixture(),  qwen3moe_fixture()};
    for (const std::string & path : paths) {
        EXPECT_GE(expect_the_probe_from_kept_streams_equals_whole_forwards(path), 3);
    }
}

// ---- activation checkpointing (blocks.h run_layer) ----

namespace {

/// Every weight as a leaf that requires grad (so every tensor, norms included, gets a gradient), counting the calls:
/// a recomputed layer asks for its weights again in the backward.
class leaf_weights : public weight_source {
public:
    explicit leaf_weights(weight_source & base) : base_(base) {}
    torch::Tensor get(const std::string & name) override {
        ++gets;
        torch::Tensor & l = leaves[name];
        if (!l.defined()) {
            l = base_.get(name).detach().clone().requires_grad_(true);
        }
        return l;
    }
    torch::Tensor rows(const std::string & name, const torch::Tensor & ids) override {
        return get(name).index_select(0, ids.reshape({-1}));
    }
    bool has(const std::string & name) const override { return base_.has(name); }
    std::map<std::string, torch::Tensor> leaves;
    int64_t gets = 0;

private:
    weight_source & base_;
};

struct step_result {
    double loss = 0;
    std::map<std::string, torch::Tensor> grads;
    int64_t gets = 0;
};

/// One forward and backward of Σ log_softmax(logits)[next token] over 2 × 24 tokens, with or without recomputation.
step_result grad_step(const std::string & path, bool recompute) {
    const gguf_file file(path);
    auto model = build_model(file);
    model->set_recompute_layers(recompute);
    gguf_weights base(file);
    leaf_weights w(base);
    torch::manual_seed(5);
    const torch::Tensor tokens = torch::randint(model->hparams().n_vocab, {2, 24}, torch::kLong);
    const torch::Tensor logp = torch::log_softmax(model->forward(tokens, w), -1);
    const torch::Tensor next = tokens.slice(1, 1).unsqueeze(-1);
    const torch::Tensor loss = -logp.slice(1, 0, 23).gather(-1, next).sum();
    loss.backward();
    step_result r;
    r.loss = loss.item<double>();
    r.gets = w.gets;
    for (const auto & [name, leaf] : w.leaves) {
        r.grads[name] = leaf.grad();
    }
    return r;
}

}  // namespace

TEST(arch_recompute, every_architecture_gives_the_same_loss_and_every_weights_gradient_bit_for_bit_when_layers_recompute) {
    // Recomputing a layer runs the same operations on the same input, so on the CPU the values, and therefore the
    // gradients, are the plain forward's exactly (each weight is used once; the residual stream's gradient is a sum of
    // two terms, which does not depend on their order). The backward must ask for the layers' weights again: that is
    // what shows the layers really ran twice rather than keeping their activations.
    const std::vector<std::string> paths = {test::stories260k(), fixture("qwen2"), fixture("qwen3"), fixture("gemma3"),
                                            fixture("phi3"),      lfm2_fixture(),   qwen35_fixture(),  qwen3moe_fixture()};
    for (const std::string & path : paths) {
        SCOPED_TRACE(path);
        const step_result plain = grad_step(path, false);
        const step_result again = grad_step(path, true);
        EXPECT_EQ(plain.loss, again.loss);
        ASSERT_EQ(plain.grads.size(), again.grads.size());
        int with_grad = 0;
        for (const auto & [name, g] : plain.grads) {
            const torch::Tensor & h = again.grads.at(name);
            ASSERT_EQ(g.defined(), h.defined()) << name;
            if (g.defined()) {
                ++with_grad;
                EXPECT_TRUE(torch::equal(g, h)) << name << ": max |Δ| " << (g - h).abs().max().item<double>();
            }
        }
        EXPECT_GE(with_grad, 10);
        const int64_t n_layer = build_model(gguf_file(path))->hparams().n_layer;
        // Each layer asks for at least its two norms and its FFN again.
        EXPECT_GE(again.gets - plain.gets, 5 * n_layer) << "plain " << plain.gets << ", recomputed " << again.gets;
    }
}

TEST(arch_recompute, a_backward_for_chosen_inputs_is_refused_rather_than_losing_the_recomputed_layers_gradients) {
    // The recomputed layers' gradients reach the leaves through .grad (a plain backward). autograd::grad asks for the
    // gradients of chosen inputs only (here the embedding, below every layer) and would lose what the recomputed layers
    // give the leaves: refused.
    const gguf_file file(test::stories260k());
    auto model = build_model(file);
    model->set_recompute_layers(true);
    gguf_weights base(file);
    leaf_weights w(base);
    const torch::Tensor tokens = torch::randint(model->hparams().n_vocab, {1, 8}, torch::kLong);
    const torch::Tensor loss = model->forward(tokens, w).square().mean();
    const std::string e = test::error_of([&] { torch::autograd::grad({loss}, {w.leaves.at("token_embd.weight")}); });
    EXPECT_NE(e.find("--recompute"), std::string::npos) << e;
}
