// llama.cpp's LLM_ARCH_GEMMA3 (src/models/gemma3.cpp there): Gemma 3 text models. Token embeddings scaled by
// sqrt(n_embd); per layer RMSNorm → Q/K/V → RMSNorm of each Q and K head → NEOX rope → attention → RMSNorm
// (post_attention_norm) → residual, then RMSNorm → GELU(tanh)-gated MLP → RMSNorm (post_ffw_norm) → residual.
// Sliding-window and global layers interleave: with attention.sliding_window = n_swa > 0, layer il slides
// unless il % pattern == pattern − 1 (attention.sliding_window_pattern, default 6); sliding layers take
// their rope base from rope.freq_base_swa (default 10000) and are never rope-scaled. Q is scaled by
// 1/sqrt(key_length) (1/sqrt(n_embd / n_head) for the 62-layer 27B, as llama.cpp does). Optional final logit
// soft-capping c·tanh(logits / c). Refused with an error: a per-layer array sliding_window_pattern (llama.cpp
// silently ignores it), SWA-specific head sizes, EmbeddingGemma's dense_2/dense_3 projections, rope
// yarn/longrope, mixture of experts, a tensor the graph does not read.
#include "model/arch/arch.h"
#include "model/arch/llama_like.h"

#include "common/error.h"
#include "ggml/gguf.h"

#include <fmt/format.h>

#include <cmath>

namespace voodoo {

namespace {

class gemma3_model : public causal_lm {
public:
    explicit gemma3_model(model_hparams hp) : causal_lm(std::move(hp)) {}

    torch::Tensor hidden(const torch::Tensor & tokens, weight_source & w) override {
        check_tokens(tokens);
        forward_context ctx = context(w);
        const int64_t T = tokens.size(1);
        const model_hparams & hp = hp_;

        // x: [B, T, n_embd] in the compute dtype, scaled as ggml_scale(inpL, sqrtf(n_embd)).
        torch::Tensor x = ctx.input ? *ctx.input : token_embeddings(ctx, tokens, hp.n_embd) * std::sqrt(static_cast<float>(hp.n_embd));
        const rope_tables rope_global = make_rope_tables(ctx, hp, T, tokens.device());
        rope_config swa;
        swa.freq_base = hp.rope_freq_base_swa;
        swa.freq_scale = hp.rope_freq_scale_swa;
        swa.attn_factor = hp.rope_attn_factor;
        const rope_tables rope_swa = make_rope_tables(ctx, hp.n_rot, swa, T, tokens.device());

        for (int64_t il = ctx.first_layer; il < ctx.layer_end(hp); ++il) {
            const bool sliding = hp.is_swa(il);
            const rope_tables rope = sliding ? rope_swa : rope_global;
            x = run_layer(ctx, x, [this, il, rope, sliding](forward_context & ctx, const torch::Tensor & x_in) {
                const model_hparams & hp = hp_;
                const torch::Tensor h = rms_norm(ctx, layer_tensor(il, "attn_norm.weight"), x_in, hp.norm_rms_eps);
                qkv_heads a = attention_qkv(ctx, fmt::format("blk.{}", il), h, hp);
                a.q = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_q_norm.weight"), a.q, hp.norm_rms_eps), rope, hp);
                a.k = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_k_norm.weight"), a.k, hp.norm_rms_eps), rope, hp);
                const torch::Tensor att = causal_attention(a.q, a.k, a.v, hp.kq_scale, sliding ? hp.n_swa : 0);
                const torch::Tensor x = x_in + rms_norm(ctx, layer_tensor(il, "post_attention_norm.weight"),
                                                        linear(ctx, layer_tensor(il, "attn_output.weight"), att), hp.norm_rms_eps);
                const torch::Tensor f = geglu_mlp(ctx, fmt::format("blk.{}", il), rms_norm(ctx, layer_tensor(il, "ffn_norm.weight"), x, hp.norm_rms_eps));
                return x + rms_norm(ctx, layer_tensor(il, "post_ffw_norm.weight"), f, hp.norm_rms_eps);
            });
        }
        return ctx.last_stage(hp) ? rms_norm(ctx, "output_norm.weight", x, hp.norm_rms_eps) : x;
    }

    /// Final logit soft-capping when the file asks for it: c · tanh(logits / c), in f32.
    torch::Tensor head(const torch::Tensor & x, weight_source & w) override {
        torch::Tensor logits = causal_lm::head(x, w);
        const float c = hp_.final_logit_softcap;
        return c > 0.0f ? torch::tanh(logits * (1.0f / c)) * c : logits;
    }
};

/// An optional unsigned key that must not be an array; absent → nullopt.
std::optional<int64_t> scalar_key(const gguf_file & file, const std::string & key, std::string_view why) {
    const int64_t id = file.find_key(key);
    if (id < 0) {
        return std::nullopt;
    }
    if (gguf_get_kv_type(file.ctx(), id) == GGUF_TYPE_ARRAY) {
        fail("'{}': metadata key '{}' is a per-layer array; {}", file.path(), key, why);
    }
    const std::optional<int64_t> v = file.get_int(key);
    if (!v || *v < 0) {
        fail("'{}': metadata key '{}' must be a non-negative integer", file.path(), key);
    }
    return v;
}

}  // namespace

std::unique_ptr<causal_lm> build_gemma3(const gguf_file & file) {
    model_hparams hp = read_llama_like_hparams(file, rope_type_neox);
    const metadata_reader md(file, hp.arch);
    if (hp.n_embd_head_v != hp.n_embd_head_k) {
        fail("'{}': '{}.attention.value_length' = {} must equal '{}.attention.key_length' = {} for gemma3 (its graph "
             "views V with the key head size)", file.path(), hp.arch, hp.n_embd_head_v, hp.arch, hp.n_embd_head_k);
    }
    // Separate head sizes for the sliding layers: llama.cpp reads them but gemma3's graph does not use them.
    for (const char * suffix : {"attention.key_length_swa", "attention.value_length_swa", "rope.dimension_count_swa"}) {
        const std::optional<int64_t> v = file.get_int(md.key(suffix));
        const int64_t full = std::string_view(suffix).starts_with("rope") ? hp.n_rot : hp.n_embd_head_k;
        if (file.find_key(md.key(suffix)) >= 0 && v != full) {
            fail("'{}': metadata key '{}' differs from the global layers' {}; sliding layers of another head size are "
                 "not supported", file.path(), md.key(suffix), full);
        }
    }
    const int64_t n_swa = scalar_key(file, md.key("attention.sliding_window"), "expected one window size").value_or(0);
    if (n_swa > 0) {
        hp.n_swa = n_swa;
        const int64_t period = scalar_key(file, md.key("attention.sliding_window_pattern"),
                                          "llama.cpp ignores an array here (and uses 6), so the layers' kinds are not "
                                          "known; give one period").value_or(6);
        // llama_hparams::set_swa_pattern: layer il slides unless il % period == period − 1 (period 0: all slide).
        for (int64_t il = 0; il < hp.n_layer; ++il) {
            hp.swa_layers.push_back(period == 0 || il % period < period - 1);
        }
        hp.rope_freq_base_swa = md.optional_float("rope.freq_base_swa", 10000.0f);
        if (hp.rope_freq_base_swa <= 0.0f) {
            fail("'{}': metadata key '{}' is {}, expected a positive number", file.path(), md.key("rope.freq_base_swa"),
                 hp.rope_freq_base_swa);
        }
    }
    hp.final_logit_softcap = md.optional_float("final_logit_softcapping", 0.0f);
    if (hp.final_logit_softcap < 0.0f) {
        fail("'{}': metadata key '{}' is {}, expected ≥ 0", file.path(), md.key("final_logit_softcapping"),
             hp.final_logit_softcap);
    }
    // llama.cpp: Gemma 3 27B (62 layers) scales queries by 1/sqrt(n_embd / n_head), the others by 1/sqrt(key_length).
    hp.kq_scale = hp.n_layer == 62 ? 1.0f / std::sqrt(static_cast<float>(hp.n_embd / hp.n_head))
                                   : 1.0f / std::sqrt(static_cast<float>(hp.n_embd_head_k));
    for (const char * name : {"dense_2.weight", "dense_3.weight"}) {
        if (file.find_tensor(name)) {
            fail("'{}': tensor '{}': EmbeddingGemma's dense projections are not supported (a text-generation Gemma 3 "
                 "has none)", file.path(), name);
        }
    }
    tensor_checklist tensors(file);
    check_llama_like_tensors(tensors, hp, {.qk_norm = true, .post_norms = true});
    tensors.refuse_others(hp);
    return std::make_unique<gemma3_model>(std::move(hp));
}

}  // namespace voodoo
