#include "common/torch_info.h"
#include "ggml/quant.h"

#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

namespace voodoo {

std::string torch_version() { return TORCH_VERSION; }

std::vector<std::string> torch_cuda_devices() {
    std::vector<std::string> out;
    if (!torch::cuda::is_available()) {
        return out;
    }
    const auto n = torch::cuda::device_count();
    for (size_t i = 0; i < n; ++i) {
        out.push_back(fmt::format("cuda:{}", i));
    }
    return out;
}

std::vector<std::string> torch_blas_libraries() {
    const auto a = torch::ones({64, 64});
    (void) torch::mm(a, a).sum().item<float>();
    std::set<std::string> libs;
    std::ifstream maps("/proc/self/maps");
    for (std::string line; std::getline(maps, line);) {
        const auto slash = line.find('/');
        if (slash == std::string::npos) {
            continue;
        }
        const std::string path = line.substr(slash);
        const std::string file = std::filesystem::path(path).filename().string();
        if (file.find("blas") != std::string::npos || file.find("mkl") != std::string::npos) {
            std::error_code ec;
            const auto real = std::filesystem::canonical(path, ec);
            libs.insert(ec ? path : real.string());
        }
    }
    return {libs.begin(), libs.end()};
}

int torch_threads() { return torch::get_num_threads(); }

}  // namespace voodoo

namespace voodoo {

int torch_thread_count(int n) {
    if (n > 0) {
        return n;
    }
    if (const char * env = std::getenv("OMP_NUM_THREADS")) {
        char * end = nullptr;
        const long v = std::strtol(env, &end, 10);
        if (end != env && *end == '\0' && v > 0) {
            return static_cast<int>(std::min<long>(v, 4096));
        }
    }
    return resolve_threads(0);
}

int set_torch_threads(int n) {
    const int threads = torch_thread_count(n);
    torch::set_num_threads(threads);
    return threads;
}

}  // namespace voodoo
