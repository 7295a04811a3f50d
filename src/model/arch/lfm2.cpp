// llama.cpp's LLM_ARCH_LFM2 (src/models/lfm2.cpp there): Liquid's LFM2 / LFM2.5 dense models, a hybrid of gated
// short convolutions and attention. `lfm2.attention.head_count_kv` is a per-layer array: 0 marks a convolution
// layer, the others attend. Per layer: RMSNorm (attn_norm) → the layer's mixer → residual, then RMSNorm (ffn_norm)
// → SwiGLU MLP → residual. The convolution layer is gated_short_conv (in_proj → b·x → causal depthwise conv of
// `lfm2.shortconv.l_cache` taps → ·c → out_proj); the attention layer is qwen3's (RMSNorm over each Q and K head,
// NEOX rope, GQA scaled by 1/sqrt(head size)), with an optional sliding window (`lfm2.attention.sliding_window`:
// every attention layer slides). The final norm is stored as `token_embd_norm.weight` (llama.cpp's
// LLM_TENSOR_OUTPUT_NORM_LFM2); the head is tied unless output.weight exists.
// Refused with an error: bidirectional files (`lfm2.attention.causal` false: LFM2 embedding models), ColBERT's
// dense_2 projection, attention layers with different KV head counts, a non-F32 convolution kernel (ggml_ssm_conv
// reads it as f32), rope yarn/longrope, mixture of experts (lfm2moe is another architecture), a tensor the graph
// does not read.
#include "model/arch/arch.h"
#include "model/arch/llama_like.h"

#include "common/error.h"
#include "ggml/gguf.h"
#include "ggml/types.h"

#include <fmt/format.h>

namespace voodoo {

namespace {

class lfm2_model : public causal_lm {
public:
    explicit lfm2_model(model_hparams hp) : causal_lm(std::move(hp)) {}

    torch::Tensor hidden(const torch::Tensor & tokens, weight_source & w) override {
        check_tokens(tokens);
        forward_context ctx = context(w);
        const int64_t T = tokens.size(1);
        const model_hparams & hp = hp_;

        // x: [B, T, n_embd] in the compute dtype
        torch::Tensor x = ctx.input ? *ctx.input : token_embeddings(ctx, tokens, hp.n_embd);
        const rope_tables rope = make_rope_tables(ctx, hp, T, tokens.device());

        for (int64_t il = ctx.first_layer; il < ctx.layer_end(hp); ++il) {
            x = run_layer(ctx, x, [this, il, rope](forward_context & ctx, const torch::Tensor & x_in) {
                const model_hparams & hp = hp_;
                const std::string prefix = fmt::format("blk.{}", il);
                const torch::Tensor h = rms_norm(ctx, layer_tensor(il, "attn_norm.weight"), x_in, hp.norm_rms_eps);
                const torch::Tensor x = x_in + (hp.is_recurrent(il) ? gated_short_conv(ctx, prefix, h) : attention(ctx, il, h, rope));
                return x + swiglu_mlp(ctx, prefix, rms_norm(ctx, layer_tensor(il, "ffn_norm.weight"), x, hp.norm_rms_eps));
            });
        }
        return ctx.last_stage(hp) ? rms_norm(ctx, "token_embd_norm.weight", x, hp.norm_rms_eps) : x;
    }

private:
    /// An attention layer: h [B, T, n_embd] → [B, T, n_embd].
    torch::Tensor attention(forward_context & ctx, int64_t il, const torch::Tensor & h, const rope_tables & rope) const {
        const model_hparams & hp = hp_;
        qkv_heads a = attention_qkv(ctx, fmt::format("blk.{}", il), h, hp);
        a.q = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_q_norm.weight"), a.q, hp.norm_rms_eps), rope, hp);
        a.k = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_k_norm.weight"), a.k, hp.norm_rms_eps), rope, hp);
        const torch::Tensor att = causal_attention(a.q, a.k, a.v, hp.kq_scale, hp.n_swa);
        return linear(ctx, layer_tensor(il, "attn_output.weight"), att);
    }
};

/// The tensors llama_model_lfm2::load_arch_tensors creates for a dense LFM2, with their shapes.
void check_lfm2_tensors(const gguf_file & file, const model_hparams & hp) {
    tensor_checklist tensors(file);
    auto blk = [](int64_t il, const char * name) { return fmt::format("blk.{}.{}", il, name); };
    const std::string embd = fmt::format("lfm2.embedding_length = {}", hp.n_embd);
    const std::string ff_why = fmt::format("n_embd {} and lfm2.feed_forward_length = {}", hp.n_embd, hp.n_ff);
    const std::string head_why = fmt::format("lfm2.attention.key_length = {}", hp.n_embd_head_k);
    const std::string conv_why = fmt::format("lfm2.shortconv.l_cache = {} and n_embd {}", hp.n_shortconv_l_cache, hp.n_embd);
    tensors.require("token_embd.weight", {hp.n_embd, hp.n_vocab}, embd + " and the vocabulary");
    tensors.require("token_embd_norm.weight", {hp.n_embd}, embd + " (LFM2's output norm)");
    tensors.optional("output.weight", {hp.n_embd, hp.n_vocab}, embd + " and the vocabulary");
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        tensors.require(blk(il, "attn_norm.weight"), {hp.n_embd}, embd);
        if (hp.is_recurrent(il)) {
            const std::string kernel = blk(il, "shortconv.conv.weight");
            tensors.require(kernel, {hp.n_shortconv_l_cache, hp.n_embd}, conv_why);
            if (file.tensor(kernel).type != GGML_TYPE_F32) {
                fail("'{}': tensor '{}' is {}; the convolution kernel must be F32 (llama.cpp's ggml_ssm_conv reads "
                     "f32, and convert_hf_to_gguf.py always writes it so)", file.path(), kernel,
                     type_name(file.tensor(kernel).type));
            }
            tensors.require(blk(il, "shortconv.in_proj.weight"), {hp.n_embd, 3 * hp.n_embd}, embd + " (b, c, x: 3·n_embd rows)");
            tensors.require(blk(il, "shortconv.out_proj.weight"), {hp.n_embd, hp.n_embd}, embd);
        } else {
            check_attention_tensors(tensors, hp, il);
            tensors.require(blk(il, "attn_q_norm.weight"), {hp.n_embd_head_k}, head_why);
            tensors.require(blk(il, "attn_k_norm.weight"), {hp.n_embd_head_k}, head_why);
        }
        tensors.require(blk(il, "ffn_norm.weight"), {hp.n_embd}, embd);
        tensors.require(blk(il, "ffn_gate.weight"), {hp.n_embd, hp.n_ff}, ff_why);
        tensors.require(blk(il, "ffn_up.weight"), {hp.n_embd, hp.n_ff}, ff_why);
        tensors.require(blk(il, "ffn_down.weight"), {hp.n_ff, hp.n_embd}, ff_why);
    }
    tensors.refuse_others(hp);
}

}  // namespace

std::unique_ptr<causal_lm> build_lfm2(const gguf_file & file) {
    model_hparams hp = read_llama_like_hparams(file, rope_type_neox, /*hybrid_head_count_kv=*/true);
    const metadata_reader md(file, hp.arch);
    if (hp.n_embd_head_v != hp.n_embd_head_k) {
        fail("'{}': 'lfm2.attention.value_length' = {} must equal 'lfm2.attention.key_length' = {} (llama.cpp asserts "
             "n_embd_v_gqa == n_embd_k_gqa)", file.path(), hp.n_embd_head_v, hp.n_embd_head_k);
    }
    if (hp.n_head * hp.n_embd_head_k != hp.n_embd) {
        fail("'{}': 'lfm2.attention.head_count' {} × head size {} ≠ 'lfm2.embedding_length' {}: llama.cpp's lfm2 "
             "loader sizes attn_q and attn_output as [n_embd, n_embd]", file.path(), hp.n_head, hp.n_embd_head_k, hp.n_embd);
    }
    hp.n_shortconv_l_cache = md.required_positive("shortconv.l_cache", "the short convolution's kernel length");
    if (hp.n_shortconv_l_cache < 2) {
        fail("'{}': metadata key 'lfm2.shortconv.l_cache' = {}, expected at least 2 (llama.cpp asserts it)", file.path(),
             hp.n_shortconv_l_cache);
    }
    if (file.get_int(md.key("attention.causal")).value_or(1) == 0) {
        fail("'{}': metadata key 'lfm2.attention.causal' is false: bidirectional LFM2 (embedding) models are not "
             "causal language models", file.path());
    }
    if (const std::optional<int64_t> n_swa = file.get_int(md.key("attention.sliding_window")); n_swa && *n_swa > 0) {
        hp.n_swa = *n_swa;  // llama_model_lfm2::load_arch_hparams: every attention layer slides
    }
    for (const char * name : {"dense_2.weight", "dense_2.bias"}) {
        if (file.find_tensor(name)) {
            fail("'{}': tensor '{}': LFM2-ColBERT's dense projection is not supported (a text-generation LFM2 has none)",
                 file.path(), name);
        }
    }
    check_lfm2_tensors(file, hp);
    return std::make_unique<lfm2_model>(std::move(hp));
}

}  // namespace voodoo
