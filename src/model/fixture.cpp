#include "model/fixture.h"

#include "common/error.h"
#include "common/file.h"
#include "common/progress.h"
#include "ggml/gguf.h"
#include "ggml/quant.h"
#include "ggml/types.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <llama.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

namespace voodoo {

namespace {

uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/// mean + std · N(0, 1) for every element, by Box–Muller on a counter-based hash: element i depends only
/// on (key, i), so the tensor is the same whatever the thread split.
std::vector<float> gaussian(int64_t n, uint64_t key, float mean, float std) {
    std::vector<float> out(static_cast<size_t>(n));
    const int n_threads = resolve_threads(0);
    const int64_t chunk = (n + n_threads - 1) / n_threads;
    std::vector<std::thread> threads;
    for (int t = 0; t < n_threads; ++t) {
        const int64_t i0 = t * chunk, i1 = std::min(n, i0 + chunk);
        if (i0 >= i1) {
            break;
        }
        threads.emplace_back([&, i0, i1] {
            for (int64_t i = i0; i < i1; ++i) {
                const uint64_t h = splitmix64(key ^ splitmix64(static_cast<uint64_t>(i)));
                const double u1 = (static_cast<double>(h >> 40) + 0.5) / 16777216.0;          // (0, 1)
                const double u2 = static_cast<double>(h & 0xffffff) / 16777216.0;             // [0, 1)
                const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
                out[static_cast<size_t>(i)] = mean + std * static_cast<float>(z);
            }
        });
    }
    for (std::thread & th : threads) {
        th.join();
    }
    return out;
}

/// FNV-1a of a name: the same on every platform, unlike std::hash.
uint64_t fnv1a(const std::string & s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char c : s) {
        h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
    }
    return h;
}

/// How a fixture tensor's values are drawn.
enum tensor_kind {
    tensor_kind_weight,  // N(0, 1/sqrt(ne0)): fan-in scale
    tensor_kind_norm,    // 1 + N(0, 0.1)
    tensor_kind_bias,    // N(0, 0.5): large enough that a forward without it is far off
    tensor_kind_factor,  // 1 + |N(0, 1)|: rope frequency factors (positive, like Phi-3's)
    tensor_kind_decay,   // −0.02 · (1 + |N(0, 1)|): qwen35's ssm_a (= −exp(A_log)), slow decays
};

struct planned_tensor {
    std::string name;
    std::vector<int64_t> ne;
    ggml_type type;
    tensor_kind kind;
};

std::vector<float> tensor_values(const planned_tensor & t, uint64_t key) {
    const int64_t n = n_elements(t.ne);
    switch (t.kind) {
        case tensor_kind_norm: return gaussian(n, key, 1.0f, 0.1f);
        case tensor_kind_bias: return gaussian(n, key, 0.0f, 0.5f);
        case tensor_kind_factor: {
            std::vector<float> v = gaussian(n, key, 0.0f, 1.0f);
            for (float & x : v) {
                x = 1.0f + std::fabs(x);
            }
            return v;
        }
        case tensor_kind_decay: {
            std::vector<float> v = gaussian(n, key, 0.0f, 1.0f);
            for (float & x : v) {
                x = -0.02f * (1.0f + std::fabs(x));
            }
            return v;
        }
        case tensor_kind_weight: break;
    }
    return gaussian(n, key, 0.0f, 1.0f / std::sqrt(float(t.ne[0])));
}

}  // namespace

std::vector<std::string> fixture_architectures() { return {"gemma3", "lfm2", "llama", "phi3", "qwen2", "qwen3", "qwen35", "qwen35moe", "qwen3moe"}; }

void write_fixture(const fixture_spec & s, const std::string & out_path) {
    const bool q35 = s.arch == "qwen35" || s.arch == "qwen35moe";  // qwen35's layers, dense or with experts
    const std::vector<std::string> archs = fixture_architectures();
    if (std::find(archs.begin(), archs.end(), s.arch) == archs.end()) {
        fail("fixture: architecture '{}' cannot be written; supported: {}", s.arch, fmt::join(archs, ", "));
    }
    if (s.weight_type != GGML_TYPE_F32 && s.weight_type != GGML_TYPE_F16 && s.weight_type != GGML_TYPE_BF16) {
        fail("fixture: weight type {} is not F32, F16 or BF16", type_name(s.weight_type));
    }
    for (const auto & [value, field] : {std::pair{s.n_embd, "n_embd"}, {s.n_layer, "n_layer"}, {s.n_head, "n_head"},
                                        {s.n_head_kv, "n_head_kv"}, {s.head_dim, "head_dim"}, {s.n_ff, "n_ff"},
                                        {s.n_ctx_train, "n_ctx_train"}}) {
        if (value <= 0) {
            fail("fixture: {} must be positive, got {}", field, value);
        }
    }
    const bool moe = s.arch == "qwen3moe" || s.arch == "qwen35moe";
    const int64_t n_ff_shexp = s.n_ff_shexp > 0 ? s.n_ff_shexp : s.n_ff;
    const int64_t n_ff_exp = s.n_ff_exp > 0 ? s.n_ff_exp : s.n_ff;
    if (moe && (s.n_expert < 1 || s.n_expert_used < 1 || s.n_expert_used > s.n_expert)) {
        fail("fixture: {} needs 1 <= n_expert_used <= n_expert, got {} and {}", s.arch, s.n_expert_used, s.n_expert);
    }
    if (s.n_head % s.n_head_kv != 0) {
        fail("fixture: n_head {} is not a multiple of n_head_kv {}", s.n_head, s.n_head_kv);
    }
    if (s.head_dim % 2 != 0) {
        fail("fixture: head_dim {} must be even (rope rotates pairs)", s.head_dim);
    }
    // qwen35: a quarter of the head rotates, as Qwen3.5's partial_rotary_factor 0.25
    const int64_t n_rot = s.n_rot > 0 ? s.n_rot : q35 ? s.head_dim / 4 : s.head_dim;
    if (n_rot % 2 != 0 || n_rot > s.head_dim) {
        fail("fixture: n_rot {} must be even and at most head_dim {}", n_rot, s.head_dim);
    }
    if (n_rot != s.head_dim && s.arch != "phi3" && !q35) {
        fail("fixture: n_rot {} ≠ head_dim {}: only phi3 and qwen35 rotate part of the head", n_rot, s.head_dim);
    }
    if ((s.arch == "qwen2" || s.arch == "phi3" || s.arch == "lfm2") && s.n_head * s.head_dim != s.n_embd) {
        fail("fixture: {} needs n_head × head_dim = n_embd, got {} × {} ≠ {}", s.arch, s.n_head, s.head_dim, s.n_embd);
    }
    if (s.sliding_window > 0 && s.arch != "gemma3" && s.arch != "lfm2") {
        fail("fixture: sliding_window is written for gemma3 and lfm2 only, not {}", s.arch);
    }
    if (s.sliding_window_pattern > 0 && s.arch != "gemma3") {
        fail("fixture: sliding_window_pattern is written for gemma3 only, not {}", s.arch);
    }
    // lfm2, qwen35: which layers attend (the others are short convolutions / gated delta nets)
    std::vector<bool> recurrent;
    if (q35 && (s.ssm_d_state <= 0 || s.ssm_n_group <= 0 || s.ssm_dt_rank % s.ssm_n_group != 0 ||
                               s.ssm_dt_rank <= 0 || s.ssm_d_conv < 2)) {
        fail("fixture: qwen35 needs ssm_d_state, ssm_n_group > 0, ssm_dt_rank a multiple of ssm_n_group and ssm_d_conv "
             ">= 2, got {}, {}, {}, {}", s.ssm_d_state, s.ssm_n_group, s.ssm_dt_rank, s.ssm_d_conv);
    }
    if (s.arch == "lfm2" || q35) {
        if (s.full_attention_interval < 1 || s.full_attention_interval > s.n_layer) {
            fail("fixture: full_attention_interval {} must be in [1, n_layer {}] so that some layer attends",
                 s.full_attention_interval, s.n_layer);
        }
        if (s.shortconv_l_cache < 2) {
            fail("fixture: shortconv_l_cache {} must be at least 2", s.shortconv_l_cache);
        }
        for (int64_t il = 0; il < s.n_layer; ++il) {
            recurrent.push_back((il + 1) % s.full_attention_interval != 0);
        }
    }
    auto is_recurrent = [&](int64_t il) { return !recurrent.empty() && recurrent[static_cast<size_t>(il)]; };
    if (s.final_logit_softcapping > 0 && s.arch != "gemma3") {
        fail("fixture: final_logit_softcapping is written for gemma3 only, not {}", s.arch);
    }
    if (s.rope_factors && s.arch != "phi3") {
        fail("fixture: rope_factors (long/short) are written for phi3 only, not {}", s.arch);
    }
    if (same_file(out_path, s.vocab_path)) {
        fail("fixture: the output '{}' is the vocab file; choose another path", out_path);
    }
    const gguf_file vocab(s.vocab_path);
    const int64_t tokens_id = vocab.find_key("tokenizer.ggml.tokens");
    if (tokens_id < 0 || gguf_get_kv_type(vocab.ctx(), tokens_id) != GGUF_TYPE_ARRAY) {
        fail("fixture: '{}' has no 'tokenizer.ggml.tokens' array; use a ggml-vocab-*.gguf", s.vocab_path);
    }
    const int64_t n_vocab = static_cast<int64_t>(gguf_get_arr_n(vocab.ctx(), tokens_id));

    gguf_writer out(out_path, vocab.alignment());
    gguf_context * ctx = out.ctx();
    const std::string a = s.arch;
    auto key = [&](const char * suffix) { return a + "." + suffix; };
    gguf_set_val_str(ctx, "general.architecture", a.c_str());
    gguf_set_val_str(ctx, "general.name", fmt::format("voodoo-fixture-{}-{}x{}", a, s.n_layer, s.n_embd).c_str());
    const uint32_t ftype = s.weight_type == GGML_TYPE_F32   ? LLAMA_FTYPE_ALL_F32
                           : s.weight_type == GGML_TYPE_F16 ? LLAMA_FTYPE_MOSTLY_F16
                                                            : LLAMA_FTYPE_MOSTLY_BF16;
    gguf_set_val_u32(ctx, "general.file_type", ftype);
    gguf_set_val_u32(ctx, key("context_length").c_str(), static_cast<uint32_t>(s.n_ctx_train));
    gguf_set_val_u32(ctx, key("embedding_length").c_str(), static_cast<uint32_t>(s.n_embd));
    gguf_set_val_u32(ctx, key("block_count").c_str(), static_cast<uint32_t>(s.n_layer));
    gguf_set_val_u32(ctx, key("feed_forward_length").c_str(), static_cast<uint32_t>(s.n_ff));
    gguf_set_val_u32(ctx, key("attention.head_count").c_str(), static_cast<uint32_t>(s.n_head));
    if (s.arch != "lfm2") {
        gguf_set_val_u32(ctx, key("attention.head_count_kv").c_str(), static_cast<uint32_t>(s.n_head_kv));
    } else {
        // As convert_hf_to_gguf.py writes LFM2: an INT32 per layer, 0 for a convolution layer.
        std::vector<int32_t> kv;
        for (const bool r : recurrent) {
            kv.push_back(r ? 0 : static_cast<int32_t>(s.n_head_kv));
        }
        gguf_set_arr_data(ctx, key("attention.head_count_kv").c_str(), GGUF_TYPE_INT32, kv.data(), kv.size());
        gguf_set_val_u32(ctx, key("shortconv.l_cache").c_str(), static_cast<uint32_t>(s.shortconv_l_cache));
    }
    gguf_set_val_u32(ctx, key("attention.key_length").c_str(), static_cast<uint32_t>(s.head_dim));
    gguf_set_val_u32(ctx, key("attention.value_length").c_str(), static_cast<uint32_t>(s.head_dim));
    gguf_set_val_u32(ctx, key("rope.dimension_count").c_str(), static_cast<uint32_t>(n_rot));
    gguf_set_val_f32(ctx, key("rope.freq_base").c_str(), s.rope_freq_base);
    gguf_set_val_f32(ctx, key("attention.layer_norm_rms_epsilon").c_str(), s.rms_eps);
    gguf_set_val_u32(ctx, key("vocab_size").c_str(), static_cast<uint32_t>(n_vocab));
    if (q35) {
        // As convert_hf_to_gguf.py writes Qwen3.5 (Qwen3NextModel, _Qwen35MRopeMixin).
        gguf_set_val_u32(ctx, key("ssm.conv_kernel").c_str(), static_cast<uint32_t>(s.ssm_d_conv));
        gguf_set_val_u32(ctx, key("ssm.state_size").c_str(), static_cast<uint32_t>(s.ssm_d_state));
        gguf_set_val_u32(ctx, key("ssm.group_count").c_str(), static_cast<uint32_t>(s.ssm_n_group));
        gguf_set_val_u32(ctx, key("ssm.time_step_rank").c_str(), static_cast<uint32_t>(s.ssm_dt_rank));
        gguf_set_val_u32(ctx, key("ssm.inner_size").c_str(), static_cast<uint32_t>(s.ssm_dt_rank * s.ssm_d_state));
        gguf_set_val_u32(ctx, key("full_attention_interval").c_str(), static_cast<uint32_t>(s.full_attention_interval));
        // Qwen3.5's sections [11, 11, 10, 0] of its 32 rotated pairs, scaled to n_rot / 2 pairs.
        const int32_t pairs = static_cast<int32_t>(n_rot / 2), t = (pairs * 11 + 31) / 32;
        const std::vector<int32_t> sections = {t, t, pairs - 2 * t, 0};
        gguf_set_arr_data(ctx, key("rope.dimension_sections").c_str(), GGUF_TYPE_INT32, sections.data(), sections.size());
    }
    if (moe) {
        gguf_set_val_u32(ctx, key("expert_count").c_str(), static_cast<uint32_t>(s.n_expert));
        gguf_set_val_u32(ctx, key("expert_used_count").c_str(), static_cast<uint32_t>(s.n_expert_used));
        gguf_set_val_u32(ctx, key("expert_feed_forward_length").c_str(), static_cast<uint32_t>(n_ff_exp));
        if (q35) {
            gguf_set_val_u32(ctx, key("expert_shared_feed_forward_length").c_str(), static_cast<uint32_t>(n_ff_shexp));
        }
    }
    if (s.sliding_window > 0) {
        gguf_set_val_u32(ctx, key("attention.sliding_window").c_str(), static_cast<uint32_t>(s.sliding_window));
        if (s.sliding_window_pattern > 0) {
            gguf_set_val_u32(ctx, key("attention.sliding_window_pattern").c_str(),
                             static_cast<uint32_t>(s.sliding_window_pattern));
        }
        if (s.arch == "gemma3") {
            gguf_set_val_f32(ctx, key("rope.freq_base_swa").c_str(), s.rope_freq_base_swa);
        }
    }
    if (s.final_logit_softcapping > 0) {
        gguf_set_val_f32(ctx, key("final_logit_softcapping").c_str(), s.final_logit_softcapping);
    }
    if (s.rope_factors) {
        // As convert_hf_to_gguf.py writes a long-context Phi-3: the original context, the attention factor
        // sqrt(1 + ln(scale) / ln(original)) and the two factor tensors; no rope.scaling.type.
        const int64_t n_ctx_orig = s.n_ctx_orig;
        if (n_ctx_orig <= 0 || n_ctx_orig > s.n_ctx_train) {
            fail("fixture: n_ctx_orig {} must be in [1, n_ctx_train {}]", n_ctx_orig, s.n_ctx_train);
        }
        gguf_set_val_u32(ctx, key("rope.scaling.original_context_length").c_str(), static_cast<uint32_t>(n_ctx_orig));
        const double scale = double(s.n_ctx_train) / double(n_ctx_orig);
        const double attn_factor = scale > 1.0 ? std::sqrt(1.0 + std::log(scale) / std::log(double(n_ctx_orig))) : 1.0;
        gguf_set_val_f32(ctx, key("rope.scaling.attn_factor").c_str(), static_cast<float>(attn_factor));
    }
    {
        // Only the tokenizer of the vocab file: its other keys describe the model it came from.
        gguf_context * tok = gguf_init_empty();
        gguf_set_kv(tok, vocab.ctx());
        for (int64_t i = 0; i < vocab.n_kv(); ++i) {
            const std::string k = gguf_get_key(vocab.ctx(), i);
            if (!k.starts_with("tokenizer.")) {
                gguf_remove_key(tok, k.c_str());
            }
        }
        gguf_set_kv(ctx, tok);
        gguf_free(tok);
    }

    std::vector<planned_tensor> plan;
    const ggml_type wt = s.weight_type;
    const ggml_type f32 = GGML_TYPE_F32;
    const int64_t n_q = s.n_head * s.head_dim, n_kv = s.n_head_kv * s.head_dim;
    const bool fused = s.arch == "phi3";                        // phi3: attn_qkv, and gate+up in ffn_up
    const bool qkv_bias = s.arch == "qwen2";
    const bool qk_norm = s.arch == "qwen3" || s.arch == "gemma3" || s.arch == "lfm2" || q35 || moe;
    const bool post_norms = s.arch == "gemma3";
    plan.push_back({"token_embd.weight", {s.n_embd, n_vocab}, wt, tensor_kind_weight});
    // lfm2's final norm is stored under the name llama.cpp gives LLM_TENSOR_OUTPUT_NORM_LFM2.
    plan.push_back({s.arch == "lfm2" ? "token_embd_norm.weight" : "output_norm.weight", {s.n_embd}, f32, tensor_kind_norm});
    if (!s.tied_output) {
        plan.push_back({"output.weight", {s.n_embd, n_vocab}, wt, tensor_kind_weight});
    }
    if (s.rope_factors) {
        plan.push_back({"rope_factors_long.weight", {n_rot / 2}, f32, tensor_kind_factor});
        plan.push_back({"rope_factors_short.weight", {n_rot / 2}, f32, tensor_kind_factor});
    }
    for (int64_t il = 0; il < s.n_layer; ++il) {
        auto blk = [il](const char * n) { return fmt::format("blk.{}.{}", il, n); };
        plan.push_back({blk("attn_norm.weight"), {s.n_embd}, f32, tensor_kind_norm});
        if (q35) {
            plan.push_back({blk("post_attention_norm.weight"), {s.n_embd}, f32, tensor_kind_norm});
        }
        const int64_t key_dim = s.ssm_d_state * s.ssm_n_group, value_dim = s.ssm_d_state * s.ssm_dt_rank;
        if (is_recurrent(il) && q35) {
            plan.push_back({blk("attn_qkv.weight"), {s.n_embd, 2 * key_dim + value_dim}, wt, tensor_kind_weight});
            plan.push_back({blk("attn_gate.weight"), {s.n_embd, value_dim}, wt, tensor_kind_weight});
            plan.push_back({blk("ssm_conv1d.weight"), {s.ssm_d_conv, 2 * key_dim + value_dim}, f32, tensor_kind_weight});
            plan.push_back({blk("ssm_dt.bias"), {s.ssm_dt_rank}, f32, tensor_kind_bias});
            plan.push_back({blk("ssm_a"), {s.ssm_dt_rank}, f32, tensor_kind_decay});
            plan.push_back({blk("ssm_beta.weight"), {s.n_embd, s.ssm_dt_rank}, wt, tensor_kind_weight});
            plan.push_back({blk("ssm_alpha.weight"), {s.n_embd, s.ssm_dt_rank}, wt, tensor_kind_weight});
            plan.push_back({blk("ssm_norm.weight"), {s.ssm_d_state}, f32, tensor_kind_norm});
            plan.push_back({blk("ssm_out.weight"), {value_dim, s.n_embd}, wt, tensor_kind_weight});
        } else if (q35) {
            // attn_q: query and output gate per head
            plan.push_back({blk("attn_q.weight"), {s.n_embd, 2 * n_q}, wt, tensor_kind_weight});
            plan.push_back({blk("attn_k.weight"), {s.n_embd, n_kv}, wt, tensor_kind_weight});
            plan.push_back({blk("attn_v.weight"), {s.n_embd, n_kv}, wt, tensor_kind_weight});
        } else if (is_recurrent(il)) {
            plan.push_back({blk("shortconv.conv.weight"), {s.shortconv_l_cache, s.n_embd}, f32, tensor_kind_weight});
            plan.push_back({blk("shortconv.in_proj.weight"), {s.n_embd, 3 * s.n_embd}, wt, tensor_kind_weight});
            plan.push_back({blk("shortconv.out_proj.weight"), {s.n_embd, s.n_embd}, wt, tensor_kind_weight});
        } else if (fused) {
            plan.push_back({blk("attn_qkv.weight"), {s.n_embd, n_q + 2 * n_kv}, wt, tensor_kind_weight});
        } else {
            plan.push_back({blk("attn_q.weight"), {s.n_embd, n_q}, wt, tensor_kind_weight});
            plan.push_back({blk("attn_k.weight"), {s.n_embd, n_kv}, wt, tensor_kind_weight});
            plan.push_back({blk("attn_v.weight"), {s.n_embd, n_kv}, wt, tensor_kind_weight});
        }
        if (qkv_bias) {
            plan.push_back({blk("attn_q.bias"), {n_q}, f32, tensor_kind_bias});
            plan.push_back({blk("attn_k.bias"), {n_kv}, f32, tensor_kind_bias});
            plan.push_back({blk("attn_v.bias"), {n_kv}, f32, tensor_kind_bias});
        }
        if (qk_norm && !is_recurrent(il)) {
            plan.push_back({blk("attn_q_norm.weight"), {s.head_dim}, f32, tensor_kind_norm});
            plan.push_back({blk("attn_k_norm.weight"), {s.head_dim}, f32, tensor_kind_norm});
        }
        if (!is_recurrent(il)) {
            plan.push_back({blk("attn_output.weight"), {n_q, s.n_embd}, wt, tensor_kind_weight});
        }
        if (post_norms) {
            plan.push_back({blk("post_attention_norm.weight"), {s.n_embd}, f32, tensor_kind_norm});
        }
        if (!q35) {  // qwen35's FFN reads post_attention_norm
            plan.push_back({blk("ffn_norm.weight"), {s.n_embd}, f32, tensor_kind_norm});
        }
        if (moe) {
            // The router stays F32 (convert_hf_to_gguf.py keeps ffn_gate_inp in F32 whatever --outtype).
            plan.push_back({blk("ffn_gate_inp.weight"), {s.n_embd, s.n_expert}, f32, tensor_kind_weight});
            plan.push_back({blk("ffn_gate_exps.weight"), {s.n_embd, n_ff_exp, s.n_expert}, wt, tensor_kind_weight});
            plan.push_back({blk("ffn_up_exps.weight"), {s.n_embd, n_ff_exp, s.n_expert}, wt, tensor_kind_weight});
            plan.push_back({blk("ffn_down_exps.weight"), {n_ff_exp, s.n_embd, s.n_expert}, wt, tensor_kind_weight});
            if (q35) {
                // qwen35moe's shared expert and its per-token gate (one F32 vector, as convert_hf_to_gguf.py writes it)
                plan.push_back({blk("ffn_gate_inp_shexp.weight"), {s.n_embd}, f32, tensor_kind_weight});
                plan.push_back({blk("ffn_gate_shexp.weight"), {s.n_embd, n_ff_shexp}, wt, tensor_kind_weight});
                plan.push_back({blk("ffn_up_shexp.weight"), {s.n_embd, n_ff_shexp}, wt, tensor_kind_weight});
                plan.push_back({blk("ffn_down_shexp.weight"), {n_ff_shexp, s.n_embd}, wt, tensor_kind_weight});
            }
        } else if (fused) {
            plan.push_back({blk("ffn_up.weight"), {s.n_embd, 2 * s.n_ff}, wt, tensor_kind_weight});
        } else {
            plan.push_back({blk("ffn_gate.weight"), {s.n_embd, s.n_ff}, wt, tensor_kind_weight});
            plan.push_back({blk("ffn_up.weight"), {s.n_embd, s.n_ff}, wt, tensor_kind_weight});
        }
        if (!moe) {
            plan.push_back({blk("ffn_down.weight"), {s.n_ff, s.n_embd}, wt, tensor_kind_weight});
        }
        if (post_norms) {
            plan.push_back({blk("post_ffw_norm.weight"), {s.n_embd}, f32, tensor_kind_norm});
        }
    }
    for (const planned_tensor & t : plan) {
        out.add_tensor(t.name, t.type, t.ne);
    }
    out.begin_data();
    progress bar("fixture", static_cast<int64_t>(plan.size()), "tensors");
    for (const planned_tensor & t : plan) {
        const std::vector<float> values = tensor_values(t, splitmix64(s.seed ^ fnv1a(t.name)));
        if (t.type == GGML_TYPE_F32) {
            out.write_tensor(t.name, {reinterpret_cast<const uint8_t *>(values.data()), values.size() * sizeof(float)});
        } else {
            out.write_tensor(t.name, quantize(t.type, values, t.ne[0], {}, 0, t.name));
        }
        bar.add(1, t.name);
    }
    out.commit();
}

}  // namespace voodoo
