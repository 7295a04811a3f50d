// The llama.cpp runtime Voodoo links: where its libraries are, which release, which backends.
#pragma once

#include <string>
#include <vector>

namespace voodoo {

/// Initialises libllama once and loads ggml's backends (for the CPU: the libggml-cpu-* variant
/// best for this processor) from the folder libggml was loaded from. Safe to call repeatedly.
void llama_runtime_init();

/// The folder holding the libggml / libllama that this process loaded (found with dladdr).
std::string llama_library_dir();

/// The llama.cpp release and commit Voodoo was built against ("v0.4.0 (80fb11ac…)").
std::string llama_release();

/// libllama's llama_print_system_info(): CPU features of the loaded CPU backend.
std::string llama_system_info();

/// "name: description" of every ggml backend device, after llama_runtime_init().
std::vector<std::string> llama_backend_devices();

}  // namespace voodoo
