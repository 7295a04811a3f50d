#include "ggml/runtime.h"

#include "ggml/log.h"

#include <ggml-backend.h>
#include <llama.h>

#include <filesystem>
#include <mutex>

#include <dlfcn.h>

#ifndef VOODOO_LLAMA_RELEASE
#define VOODOO_LLAMA_RELEASE "unknown"
#endif
#ifndef VOODOO_LLAMA_COMMIT
#define VOODOO_LLAMA_COMMIT "unknown"
#endif

namespace voodoo {

std::string llama_library_dir() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void *>(&ggml_backend_load_all_from_path), &info) == 0 || !info.dli_fname) {
        return {};
    }
    return std::filesystem::path(info.dli_fname).parent_path().string();
}

void llama_runtime_init() {
    static std::once_flag once;
    std::call_once(once, [] {
        ggml_log_install();
        const std::string dir = llama_library_dir();
        ggml_backend_load_all_from_path(dir.empty() ? nullptr : dir.c_str());
        llama_backend_init();
    });
}

std::string llama_release() {
    return std::string(VOODOO_LLAMA_RELEASE) + " (" + std::string(VOODOO_LLAMA_COMMIT).substr(0, 12) + ")";
}

std::string llama_system_info() {
    llama_runtime_init();
    return llama_print_system_info();
}

namespace {

// "name: description" of every ggml backend device, or (gpus_only) of the GPU and integrated-GPU ones.
std::vector<std::string> devices_of(bool gpus_only) {
    llama_runtime_init();
    std::vector<std::string> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const enum ggml_backend_dev_type type = ggml_backend_dev_type(dev);
        if (!gpus_only || type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            out.push_back(std::string(ggml_backend_dev_name(dev)) + ": " + ggml_backend_dev_description(dev));
        }
    }
    return out;
}

}  // namespace

std::vector<std::string> llama_backend_devices() {
    return devices_of(false);
}

std::vector<std::string> llama_gpu_devices() {
    return devices_of(true);
}

}  // namespace voodoo
