// Synthetic models for tests and benchmarks (not a user feature): a GGUF of a given architecture and
// shape with random weights and a real tokenizer, that libllama loads and runs.
#pragma once

#include <ggml.h>

#include <cstdint>
#include <string>
#include <vector>

namespace voodoo {

struct fixture_spec {
    std::string arch = "llama";     // general.architecture; fixture_architectures() lists what is written
    int64_t n_embd = 256;
    int64_t n_layer = 2;
    int64_t n_head = 4;
    int64_t n_head_kv = 2;
    int64_t head_dim = 64;          // may differ from n_embd / n_head (written as attention.key/value_length)
    int64_t n_ff = 512;
    int64_t n_ctx_train = 4096;
    std::string vocab_path;         // a vocab GGUF, e.g. .deps/llama.cpp/models/ggml-vocab-llama-spm.gguf
    ggml_type weight_type = GGML_TYPE_F32;  // of the 2-D weights: F32, F16 or BF16; norms stay F32
    uint64_t seed = 1;
    bool tied_output = false;       // no output.weight: the head reuses token_embd.weight
    float rope_freq_base = 10000.0f;
    float rms_eps = 1e-5f;
    int64_t n_rot = 0;              // rotated dims per head, 0 = head_dim (phi3 may rotate part of the head)
    int64_t sliding_window = 0;     // gemma3: attention.sliding_window (0 = not written: every layer global)
    int64_t sliding_window_pattern = 0;  // gemma3: every n-th layer is global (0 = not written: llama.cpp's 6)
    float rope_freq_base_swa = 10000.0f; // gemma3: rope base of the sliding layers
    float final_logit_softcapping = 0;   // gemma3: written when > 0
    bool rope_factors = false;      // phi3: rope_factors_long/short, original_context_length = n_ctx_orig and the
                                    // matching rope.scaling.attn_factor
    int64_t n_ctx_orig = 256;       // phi3 with rope_factors: the context beyond which the long factors apply
    int64_t full_attention_interval = 2;  // lfm2, qwen35: layer il attends when (il + 1) % this == 0, else it is
                                          // recurrent (lfm2: head_count_kv 0 in the per-layer array; qwen35: the
                                          // full_attention_interval key)
    int64_t shortconv_l_cache = 3;  // lfm2: shortconv.l_cache, the convolution's kernel length (LFM2's is 3)
    // qwen35's gated delta net layers (ssm.*): key heads × state size, value heads × state size, conv taps
    int64_t ssm_d_state = 32;       // ssm.state_size: key and value head size
    int64_t ssm_n_group = 2;        // ssm.group_count: key heads
    int64_t ssm_dt_rank = 4;        // ssm.time_step_rank: value heads (a multiple of the key heads)
    int64_t ssm_d_conv = 4;         // ssm.conv_kernel (Qwen3.5's is 4)
    // qwen3moe, qwen35moe: the mixture of experts of every layer (expert_count, expert_used_count,
    // expert_feed_forward_length; qwen35moe also expert_shared_feed_forward_length)
    int64_t n_expert = 8;
    int64_t n_expert_used = 2;
    int64_t n_ff_exp = 0;           // 0 = n_ff
    int64_t n_ff_shexp = 0;         // qwen35moe's shared expert, 0 = n_ff
};

/// The architectures write_fixture can write.
std::vector<std::string> fixture_architectures();

/// Writes the fixture to out_path (atomically). Weights: every 2-D tensor N(0, 1/sqrt(ne0)) (fan-in scale:
/// unit-size activations, attention far from uniform, logits of order 1), every norm 1 + N(0, 0.1), every
/// bias N(0, 0.5), rope factors 1 + |N(0, 1)|. Per architecture, the tensors its llama.cpp loader reads:
/// qwen2 adds attn_q/k/v.bias; qwen3 attn_q_norm / attn_k_norm; gemma3 those norms and
/// post_attention_norm / post_ffw_norm; phi3 has a fused attn_qkv and ffn_up of 2·n_ff rows (gate, up), no ffn_gate;
/// lfm2 has short-convolution layers (shortconv.in_proj [n_embd, 3·n_embd], shortconv.conv [l_cache, n_embd] in F32
/// whatever the weight type, as convert_hf_to_gguf.py writes it, shortconv.out_proj) between attention layers with
/// attn_q_norm / attn_k_norm, and its final norm named token_embd_norm; qwen35 has gated delta net layers (attn_qkv,
/// attn_gate, ssm_conv1d in F32, ssm_dt.bias, ssm_a = −0.02·(1 + |N(0, 1)|) (slow decays: the state matters over
/// many tokens), ssm_beta, ssm_alpha, ssm_norm, ssm_out) between gated attention layers (attn_q of 2·n_head·head_dim
/// rows: query and gate per head), post_attention_norm, a partial rotary (n_rot, default head_dim / 4) and M-RoPE
/// sections in Qwen3.5's proportions; qwen3moe is qwen3 with, in every layer, an F32 router ffn_gate_inp
/// [n_embd, n_expert] and the experts ffn_gate_exps / ffn_up_exps [n_embd, n_ff_exp, n_expert] and ffn_down_exps
/// [n_ff_exp, n_embd, n_expert] instead of the dense FFN; qwen35moe is qwen35 with those experts and a shared expert
/// (ffn_{gate,up,down}_shexp of n_ff_shexp, and its gate ffn_gate_inp_shexp [n_embd] in F32).
/// Values depend only on (seed, tensor name, index), so a spec always gives the same bytes. Metadata:
/// every `<arch>.*` key libllama reads, general.file_type, and every `tokenizer.*` key of the vocab file
/// (n_vocab = its token count). Throws voodoo::error naming the field when the spec is invalid (unknown
/// arch, type not F32/F16/BF16, n_head not a multiple of n_head_kv, odd head_dim or n_rot, a field another
/// architecture's, qwen2/phi3/lfm2 with n_head × head_dim ≠ n_embd, lfm2 without an attention layer or with
/// l_cache < 2, vocab without tokens)
/// or when out_path is the vocab file.
void write_fixture(const fixture_spec & spec, const std::string & out_path);

}  // namespace voodoo
