// The model runtime on synthetic models (voodoo::write_fixture) and on broken files: parity with libllama
// for F32/F16/BF16 weights, and one clear error naming the key or tensor for each kind of bad input.
#include "common/error.h"
#include "ggml/gguf.h"
#include "ggml/quant.h"
#include "ggml/types.h"
#include "model/fixture.h"
#include "model/gguf_weights.h"
#include "model/parity.h"
#include "model/registry.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <set>

using namespace voodoo;

namespace {

/// n_embd 256 (ne0 ≥ 256), 2 layers, 4 heads of 64, 2 KV heads, FFN 512, llama-spm vocab (32000 tokens).
fixture_spec small_llama(ggml_type type, bool tied) {
    fixture_spec s;
    s.vocab_path = voodoo::test::llama_spm_vocab();
    s.weight_type = type;
    s.tied_output = tied;
    s.seed = 7;
    return s;
}

parity_report fixture_parity(ggml_type type, bool tied) {
    test::temp_dir dir;
    const std::string path = dir.file("fixture.gguf");
    write_fixture(small_llama(type, tied), path);
    parity_options o;
    o.n_tokens = 128;
    return check_parity(path, o);
}

/// Copies src to dst, letting `edit` change the metadata and skipping the tensor named `skip`.
void rewrite(const std::string & src, const std::string & dst, const std::function<void(gguf_context *)> & edit,
             const std::string & skip = {}) {
    test::rewrite_gguf(src, dst, edit, skip);
}

/// The message of the voodoo::error build_model throws on stories260K rewritten by `edit` (minus `skip`).
std::string build_error(const std::function<void(gguf_context *)> & edit, const std::string & skip = {}) {
    test::temp_dir dir;
    const std::string path = dir.file("bad.gguf");
    rewrite(test::stories260k(), path, edit, skip);
    try {
        const gguf_file file(path);
        build_model(file);
    } catch (const error & e) {
        return e.what();
    }
    return "no error";
}

}  // namespace

TEST(model_parity, synthetic_llama_f32_ne0_256_matches_libllama_within_1e_3_of_max_logit) {
    const parity_report r = fixture_parity(GGML_TYPE_F32, false);
    EXPECT_EQ(r.weight_types, "F32");
    EXPECT_EQ(r.n_vocab, 32000);
    EXPECT_GT(r.max_abs_logit, 1.0);
    EXPECT_LE(r.max_abs_diff, 1e-3 * r.max_abs_logit) << parity_to_text(r);
    EXPECT_EQ(r.same_top_pct, 100.0) << parity_to_text(r);
}

TEST(model_parity, synthetic_llama_f16_tied_matches_libllama_within_1e_2_of_max_logit) {
    // llama.cpp's CPU F16 matmul rounds the activations to F16 first (vec_dot_type F16); we keep them f32.
    const parity_report r = fixture_parity(GGML_TYPE_F16, true);
    EXPECT_EQ(r.weight_types, "F16");
    EXPECT_LE(r.rel_diff, 1e-2) << parity_to_text(r);
    EXPECT_TRUE(r.within);
    EXPECT_GE(r.same_top_pct, 95.0) << parity_to_text(r);
}

TEST(model_parity, synthetic_llama_bf16_matches_libllama_within_3e_2_of_max_logit) {
    // Same reason with BF16's 8-bit mantissa: llama.cpp rounds the activations to BF16.
    const parity_report r = fixture_parity(GGML_TYPE_BF16, false);
    EXPECT_EQ(r.weight_types, "BF16");
    EXPECT_LE(r.rel_diff, 3e-2) << parity_to_text(r);
    EXPECT_TRUE(r.within);
    EXPECT_GE(r.same_top_pct, 90.0) << parity_to_text(r);
}

TEST(model_fixture, is_deterministic_and_has_the_requested_shapes_and_types) {
    test::temp_dir dir;
    fixture_spec s = small_llama(GGML_TYPE_BF16, false);
    s.n_embd = 128;
    s.n_head = 4;
    s.head_dim = 48;  // ≠ n_embd / n_head: written as key_length / value_length
    s.n_ff = 320;
    write_fixture(s, dir.file("a.gguf"));
    write_fixture(s, dir.file("b.gguf"));
    const gguf_file a(dir.file("a.gguf"));
    const gguf_file b(dir.file("b.gguf"));
    ASSERT_EQ(a.file_size(), b.file_size());
    for (const gguf_tensor & t : a.tensors()) {
        const auto x = a.data(t);
        const auto y = b.data(b.tensor(t.name));
        EXPECT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << t.name;
    }
    EXPECT_EQ(a.tensor("blk.1.attn_q.weight").type, GGML_TYPE_BF16);
    EXPECT_EQ(a.tensor("blk.1.attn_q.weight").ne[1], 4 * 48);
    EXPECT_EQ(a.tensor("blk.1.ffn_norm.weight").type, GGML_TYPE_F32);
    EXPECT_EQ(a.get_int("llama.attention.key_length"), 48);
    EXPECT_EQ(a.get_string("tokenizer.ggml.model"), "llama");
    EXPECT_EQ(a.find_key("llama.rope.scaling.type"), -1);
    auto model = build_model(a);
    EXPECT_EQ(model->hparams().n_embd_head_k, 48);
    EXPECT_EQ(model->hparams().n_vocab, 32000);
    EXPECT_FALSE(model->hparams().tied_output);
    // Weights of fan-in scale: std ≈ 1/sqrt(ne0); norms ≈ 1.
    gguf_weights w(a);
    EXPECT_NEAR(w.get("blk.0.ffn_down.weight").to(torch::kFloat).std().item<double>(), 1.0 / std::sqrt(320.0), 2e-3);
    EXPECT_NEAR(w.get("blk.0.attn_norm.weight").mean().item<double>(), 1.0, 0.05);
}

TEST(model_fixture, refuses_an_unknown_architecture_and_a_quantized_type) {
    test::temp_dir dir;
    fixture_spec s = small_llama(GGML_TYPE_F32, true);
    s.arch = "mamba";
    EXPECT_THROW(write_fixture(s, dir.file("x.gguf")), error);
    s = small_llama(GGML_TYPE_Q8_0, true);
    EXPECT_THROW(write_fixture(s, dir.file("x.gguf")), error);
}

TEST(model_weights, quantized_teacher_is_dequantized_by_ggml) {
    // A Q8_0 copy of stories260K (every 2-D tensor whose ne0 fits a 32-block; ffn_down, 172 wide, stays F32):
    // gguf_weights gives ggml's to_float of the bytes, and the file still runs like libllama runs it.
    test::temp_dir dir;
    const std::string path = dir.file("q8.gguf");
    auto to_q8 = [](const gguf_tensor & t) { return t.n_dims == 2 && t.ne[0] % 32 == 0; };
    {
        const gguf_file in(test::stories260k());
        gguf_writer out(path, in.alignment());
        out.copy_kv(in);
        for (const gguf_tensor & t : in.tensors()) {
            out.add_tensor(t.name, to_q8(t) ? GGML_TYPE_Q8_0 : t.type, t.shape());
        }
        out.begin_data();
        for (const gguf_tensor & t : in.tensors()) {
            if (to_q8(t)) {
                const auto f = in.data(t);
                out.write_tensor(t.name, voodoo::quantize(GGML_TYPE_Q8_0, {reinterpret_cast<const float *>(f.data()), f.size() / 4}, t.ne[0]));
            } else {
                out.write_tensor(t.name, in.data(t));
            }
        }
        out.commit();
    }
    const gguf_file q8(path);
    gguf_weights w(q8);
    const torch::Tensor head = w.get("output.weight");
    ASSERT_EQ(head.sizes(), (std::vector<int64_t>{512, 64}));
    const auto bytes = q8.data(q8.tensor("output.weight"));
    const std::vector<float> expect = voodoo::dequantize(GGML_TYPE_Q8_0, bytes, 64);
    EXPECT_TRUE(torch::equal(head, torch::from_blob(const_cast<float *>(expect.data()), {512, 64})));
    const torch::Tensor some = w.rows("output.weight", torch::tensor({3, 500}, torch::kLong));
    EXPECT_TRUE(torch::equal(some, head.index_select(0, torch::tensor({3, 500}, torch::kLong))));
    parity_options o;
    o.n_tokens = 64;
    const parity_report r = check_parity(path, o);
    EXPECT_EQ(r.weight_types, "quantized");
    EXPECT_TRUE(r.within) << parity_to_text(r);
    RecordProperty("rel_diff", std::to_string(r.rel_diff));
    RecordProperty("same_top_pct", std::to_string(r.same_top_pct));
}

TEST(model_bad_input, metadata_disagreeing_with_a_tensor_shape_names_the_tensor_and_the_key) {
    const std::string e = build_error([](gguf_context * c) { gguf_set_val_u32(c, "llama.feed_forward_length", 128); });
    EXPECT_NE(e.find("blk.0.ffn_gate.weight"), std::string::npos) << e;
    EXPECT_NE(e.find("feed_forward_length"), std::string::npos) << e;
}

TEST(model_bad_input, a_missing_key_is_named) {
    const std::string e = build_error([](gguf_context * c) { gguf_remove_key(c, "llama.attention.layer_norm_rms_epsilon"); });
    EXPECT_NE(e.find("missing metadata key 'llama.attention.layer_norm_rms_epsilon'"), std::string::npos) << e;
}

TEST(model_bad_input, an_unknown_rope_scaling_type_is_named_with_its_key) {
    std::string e = build_error([](gguf_context * c) { gguf_set_val_str(c, "llama.rope.scaling.type", "spiral"); });
    EXPECT_NE(e.find("unknown rope scaling type 'spiral'"), std::string::npos) << e;
    EXPECT_NE(e.find("llama.rope.scaling.type"), std::string::npos) << e;
    e = build_error([](gguf_context * c) { gguf_set_val_str(c, "llama.rope.scaling.type", "yarn"); });
    EXPECT_NE(e.find("'yarn' is not supported yet"), std::string::npos) << e;
}

TEST(model_bad_input, a_missing_tensor_is_named) {
    const std::string e = build_error([](gguf_context *) {}, "blk.3.ffn_up.weight");
    EXPECT_NE(e.find("missing tensor 'blk.3.ffn_up.weight'"), std::string::npos) << e;
}

TEST(model_bad_input, a_vocab_size_disagreeing_with_token_embd_is_named) {
    const std::string e = build_error([](gguf_context * c) { gguf_set_val_u32(c, "llama.vocab_size", 500); });
    EXPECT_NE(e.find("llama.vocab_size"), std::string::npos) << e;
}

TEST(model_bad_input, a_wrong_block_count_is_caught) {
    const std::string e = build_error([](gguf_context * c) { gguf_set_val_u32(c, "llama.block_count", 4); });
    EXPECT_NE(e.find("blk.4."), std::string::npos) << e;
    EXPECT_NE(e.find("block_count"), std::string::npos) << e;
}

TEST(model_bad_input, an_unsupported_architecture_lists_the_supported_ones) {
    const std::string e = build_error([](gguf_context * c) { gguf_set_val_str(c, "general.architecture", "mamba"); });
    EXPECT_NE(e.find("architecture 'mamba' is not supported"), std::string::npos) << e;
    EXPECT_NE(e.find("supported architectures: gemma3, lfm2, llama, phi3, qwen2, qwen3, qwen35, qwen35moe, qwen3moe"),
              std::string::npos) << e;
    EXPECT_EQ(supported_architectures(), (std::vector<std::string>{"gemma3", "lfm2", "llama", "phi3", "qwen2", "qwen3",
                                                                   "qwen35", "qwen35moe", "qwen3moe"}));
}

TEST(cli, check_parity_prints_the_difference_and_exits_0_within_the_bound) {
    const test::run_result r = test::run_voodoo("check-parity " + test::stories260k() + " --tokens 32");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("max |Δlogit|"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("same top token: 100.00%"), std::string::npos) << r.output;
    const test::run_result j = test::run_voodoo("check-parity " + test::stories260k() + " --tokens 16 --json -");
    EXPECT_EQ(j.exit_code, 0) << j.output;
    EXPECT_NE(j.output.find("\"within\": true"), std::string::npos) << j.output;
}

TEST(cli, check_parity_of_an_unsupported_model_is_one_error_line_and_exit_1) {
    test::temp_dir dir;
    rewrite(test::stories260k(), dir.file("m.gguf"), [](gguf_context * c) { gguf_set_val_str(c, "general.architecture", "mamba"); });
    const test::run_result r = test::run_voodoo("check-parity " + dir.file("m.gguf"));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("voodoo: error:"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("'mamba' is not supported"), std::string::npos) << r.output;
}

TEST(cli, voodoo_fixture_writes_a_model_libllama_and_check_parity_accept) {
    test::temp_dir dir;
    const std::string out = dir.file("tiny.gguf");
    const std::string cmd = std::string(VOODOO_FIXTURE_BIN) + " --vocab " + voodoo::test::llama_spm_vocab() +
                            " --n-embd 64 --n-layer 1 --n-head 2 --n-head-kv 1 --head-dim 32 --n-ff 128 --type f16 --tied -o " +
                            out + " > /dev/null 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0);
    const test::run_result r = test::run_voodoo("check-parity " + out + " --tokens 16");
    EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(model_weights, the_tensors_read_are_those_get_and_rows_served_and_no_other) {
    // What a layer-sharded rank reports having read (trainer, tests/test_dist.cpp): every name get() or rows() served,
    // once, sorted; a name that is not in the file is refused and not counted.
    const gguf_file src(test::stories260k());
    gguf_weights w(src, torch::kCPU, 1, torch::kBFloat16);
    EXPECT_TRUE(w.tensors_read().empty());
    w.get("blk.1.attn_q.weight");
    w.get("blk.1.attn_q.weight");  // kept: served from the copy
    w.rows("token_embd.weight", torch::tensor({3, 1}, torch::kLong));
    EXPECT_THROW(w.get("blk.9.attn_q.weight"), error);
    EXPECT_EQ(w.tensors_read(), (std::vector<std::string>{"blk.1.attn_q.weight", "token_embd.weight"}));
}
