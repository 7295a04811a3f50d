// What the llama-like architectures (llama.cpp's qwen2, qwen3, gemma3, phi3) share in their files: the tensor
// list of a pre-norm decoder and the head-size checks of their graph builders.
#pragma once

#include "model/hparams.h"

namespace voodoo {

class gguf_file;

/// The per-layer tensors an architecture's load_arch_tensors creates beyond llama's.
struct llama_like_layout {
    bool qk_norm = false;        // attn_q_norm / attn_k_norm [head_dim], required (qwen3, gemma3)
    bool post_norms = false;     // post_attention_norm / post_ffw_norm [n_embd], required (gemma3)
    bool fused_gate_up = false;  // ffn_up [n_embd, 2·n_ff] holds gate and up, no ffn_gate (phi3)
    bool experts = false;        // the FFN is a mixture of experts (check_expert_tensors), not ffn_gate/up/down (qwen3moe)
};

/// Requires token_embd, output_norm, per layer attn_norm, Q/K/V (fused attn_qkv [n_embd, n_embd_q + 2·n_embd_kv],
/// or attn_q/attn_k/attn_v), attn_output, ffn_norm and the FFN, with the shapes hp implies; allows output.weight
/// (else the head is tied) and the Q/K/V biases, as llama.cpp's create_tensor_qkv does. Throws voodoo::error
/// naming the tensor and the keys its shape follows from.
void check_llama_like_tensors(tensor_checklist & tensors, const model_hparams & hp, const llama_like_layout & layout);

/// One layer's Q/K/V and attn_output as llama.cpp's create_tensor_qkv and its loaders create them: a fused
/// attn_qkv [n_embd, n_embd_q + 2·n_embd_kv] (optional attn_qkv.bias) or attn_q / attn_k / attn_v (optional
/// biases), and attn_output [n_head · value_length, n_embd]. Throws voodoo::error naming the tensor and the keys.
void check_attention_tensors(tensor_checklist & tensors, const model_hparams & hp, int64_t il);

/// One layer's mixture-of-experts FFN tensors as llama.cpp's qwen3moe/qwen35moe loaders create them: the router
/// ffn_gate_inp [n_embd, n_expert] and the experts ffn_gate_exps / ffn_up_exps [n_embd, n_ff_exp, n_expert] and
/// ffn_down_exps [n_ff_exp, n_embd, n_expert]; with `fused_gate_up` (llama.cpp's create_tensor_gate_up_exps), gate and
/// up may come fused as ffn_gate_up_exps [n_embd, 2·n_ff_exp, n_expert] instead. Throws voodoo::error naming the tensor
/// and the keys.
void check_expert_tensors(tensor_checklist & tensors, const model_hparams & hp, int64_t il, bool fused_gate_up = false);

/// The graph builders of qwen2/qwen3 assert n_embd_head_k == n_embd_head_v == n_rot: throws voodoo::error naming
/// the key that breaks it (`<arch>.rope.dimension_count` or `<arch>.attention.value_length`).
void require_rope_over_whole_head(const gguf_file & file, const model_hparams & hp);

}  // namespace voodoo
