#include "model/registry.h"

#include "common/error.h"
#include "ggml/gguf.h"
#include "model/arch/arch.h"

#include <fmt/ranges.h>

#include <map>

namespace voodoo {

namespace {

using model_builder = std::unique_ptr<causal_lm> (*)(const gguf_file &);

const std::map<std::string, model_builder> & builders() {
    static const std::map<std::string, model_builder> table = {
        {"gemma3", build_gemma3},
        {"lfm2", build_lfm2},
        {"llama", build_llama},
        {"phi3", build_phi3},
        {"qwen2", build_qwen2},
        {"qwen3", build_qwen3},
        {"qwen35", build_qwen35},
        {"qwen35moe", build_qwen35moe},
        {"qwen3moe", build_qwen3moe},
    };
    return table;
}

}  // namespace

std::vector<std::string> supported_architectures() {
    std::vector<std::string> names;
    for (const auto & [name, builder] : builders()) {
        names.push_back(name);
    }
    return names;
}

std::unique_ptr<causal_lm> build_model(const gguf_file & file) {
    const std::string arch = file.architecture();
    if (arch.empty()) {
        fail("'{}': missing metadata key 'general.architecture'; supported architectures: {}", file.path(),
             fmt::join(supported_architectures(), ", "));
    }
    const auto it = builders().find(arch);
    if (it == builders().end()) {
        fail("'{}': architecture '{}' is not supported yet; supported architectures: {}", file.path(), arch,
             fmt::join(supported_architectures(), ", "));
    }
    return it->second(file);
}

}  // namespace voodoo
