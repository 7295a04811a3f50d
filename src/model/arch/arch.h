// The builder of every supported architecture, one source file each (registered in registry.cpp).
#pragma once

#include "model/model.h"

#include <memory>

namespace voodoo {

class gguf_file;

/// llama.cpp's LLM_ARCH_LLAMA: Llama 1/2/3, Mistral, SmolLM, TinyLlama, the TinyStories models.
std::unique_ptr<causal_lm> build_llama(const gguf_file & file);

}  // namespace voodoo
