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

/// "name: description" of the GPU devices (ggml's GPU and integrated-GPU device types) among them: the devices
/// libllama offloads a model's every layer to with its default parameters (llama_model_default_params, n_gpu_layers
/// −1; llama.cpp's src/llama-model.cpp), which the eval uses. Empty when libllama computes on the CPU: the pinned
/// linux-x64 package has CPU backends only, and a GPU backend comes from GGML_BACKEND_PATH (ggml-backend-reg.cpp,
/// ggml_backend_load_all_from_path), e.g. llama.cpp's CUDA backend (docs/BENCHMARKS.md, issue #16).
std::vector<std::string> llama_gpu_devices();

}  // namespace voodoo
