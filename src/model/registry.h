// Architecture name (general.architecture) → the builder of its model. One file per architecture
// under src/model/arch/; the table is in registry.cpp.
#pragma once

#include "model/model.h"

#include <memory>
#include <string>
#include <vector>

namespace voodoo {

class gguf_file;

/// Builds the model of a GGUF from its metadata, after checking every tensor the forward reads has the
/// shape the metadata implies. Throws voodoo::error naming the architecture and listing the supported
/// ones when general.architecture is not supported, or naming the key or tensor that is wrong.
std::unique_ptr<causal_lm> build_model(const gguf_file & file);

/// The supported architecture names, sorted.
std::vector<std::string> supported_architectures();

}  // namespace voodoo
