// The builder of every supported architecture, one source file each (registered in registry.cpp).
#pragma once

#include "model/model.h"

#include <memory>

namespace voodoo {

class gguf_file;

/// llama.cpp's LLM_ARCH_LLAMA: Llama 1/2/3, Mistral, SmolLM, TinyLlama, the TinyStories models.
std::unique_ptr<causal_lm> build_llama(const gguf_file & file);

/// llama.cpp's LLM_ARCH_QWEN2: Qwen2, Qwen2.5 (biases on Q/K/V).
std::unique_ptr<causal_lm> build_qwen2(const gguf_file & file);

/// llama.cpp's LLM_ARCH_QWEN3: Qwen3 dense (RMSNorm on each head of Q and K).
std::unique_ptr<causal_lm> build_qwen3(const gguf_file & file);

/// llama.cpp's LLM_ARCH_QWEN3MOE: Qwen3 mixture-of-experts models (Qwen3-30B-A3B, Qwen3-235B-A22B).
std::unique_ptr<causal_lm> build_qwen3moe(const gguf_file & file);

/// llama.cpp's LLM_ARCH_GEMMA3: Gemma 3 text models (interleaved sliding-window and global attention).
std::unique_ptr<causal_lm> build_gemma3(const gguf_file & file);

/// llama.cpp's LLM_ARCH_PHI3: Phi-3, Phi-3.5, Phi-4 (fused QKV and gate/up, long-rope factors).
std::unique_ptr<causal_lm> build_phi3(const gguf_file & file);

/// llama.cpp's LLM_ARCH_LFM2: LFM2 / LFM2.5 dense models (gated short convolutions and attention).
std::unique_ptr<causal_lm> build_lfm2(const gguf_file & file);

/// llama.cpp's LLM_ARCH_QWEN35: Qwen3.5 dense models (gated delta nets and gated attention).
std::unique_ptr<causal_lm> build_qwen35(const gguf_file & file);

/// llama.cpp's LLM_ARCH_QWEN35MOE: Qwen3.5 mixtures of experts (qwen35's layers, routed and shared experts).
std::unique_ptr<causal_lm> build_qwen35moe(const gguf_file & file);

}  // namespace voodoo
