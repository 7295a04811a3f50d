#include "common/doctor.h"

#include "common/torch_info.h"
#include "ggml/runtime.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>

#include <sys/statvfs.h>

#ifndef VOODOO_VERSION
#define VOODOO_VERSION "0.0.0"
#endif

namespace voodoo {

namespace {

std::string join(const std::vector<std::string> & v, const char * sep) {
    std::string s;
    for (const auto & x : v) {
        s += (s.empty() ? "" : sep) + x;
    }
    return s;
}

bool on_path(const char * program) {
    const char * path = std::getenv("PATH");
    if (!path) {
        return false;
    }
    std::string p = path;
    size_t start = 0;
    while (start <= p.size()) {
        const size_t end = p.find(':', start);
        const std::string dir = p.substr(start, end == std::string::npos ? std::string::npos : end - start);
        if (!dir.empty() && std::filesystem::exists(std::filesystem::path(dir) / program)) {
            return true;
        }
        if (end == std::string::npos) {
            break;
        }
        start = end + 1;
    }
    return false;
}

}  // namespace

std::string version_line() {
    return fmt::format("voodoo {} (llama.cpp {}, LibTorch {})", VOODOO_VERSION, llama_release(), torch_version());
}

std::vector<doctor_check> run_doctor(const std::string & dir) {
    std::vector<doctor_check> checks;
    checks.push_back({"voodoo", true, VOODOO_VERSION, ""});

    const std::string lib_dir = llama_library_dir();
    checks.push_back({"llama.cpp", !lib_dir.empty(), llama_release() + ", libraries in " + lib_dir,
                      "libggml/libllama not found: run `make bootstrap` or set VOODOO_LLAMA_DIR and rebuild"});

    const auto devices = llama_backend_devices();
    const bool has_cpu = std::any_of(devices.begin(), devices.end(),
                                     [](const std::string & d) { return d.rfind("CPU", 0) == 0; });
    checks.push_back({"ggml backends", has_cpu, devices.empty() ? "none" : join(devices, "; "),
                      fmt::format("no CPU backend (libggml-cpu-*.so) loaded from {}: run `make bootstrap`", lib_dir)});

    // A GPU backend for libllama's eval (scripts/llama-cuda.sh), when GGML_BACKEND_PATH asks for one: ggml only logs a
    // library that did not load, and the eval would quietly run on the CPU.
    if (const char * extra = std::getenv("GGML_BACKEND_PATH"); extra != nullptr && *extra != '\0') {
        const auto gpus = llama_gpu_devices();
        std::error_code ec;
        checks.push_back({"libllama GPU", !gpus.empty(), gpus.empty() ? "none" : join(gpus, "; "),
                          fmt::format("GGML_BACKEND_PATH='{}' gave libllama no GPU ({}): build the backend with "
                                      "scripts/llama-cuda.sh and name the path it prints, or unset GGML_BACKEND_PATH to "
                                      "evaluate on the CPU",
                                      extra, std::filesystem::exists(extra, ec) ? "the library did not load or found no GPU"
                                                                                : "no such file")});
    }

    checks.push_back({"CPU features", true, llama_system_info(), ""});

    checks.push_back({"LibTorch", true, torch_version() + fmt::format(", {} threads", torch_threads()), ""});

    const auto cuda = torch_cuda_devices();
    checks.push_back({"CUDA", true, cuda.empty() ? "no CUDA device (CPU training only)" : join(cuda, ", "), ""});

    const auto blas = torch_blas_libraries();
    const bool fast_blas = std::any_of(blas.begin(), blas.end(), [](const std::string & b) {
        return b.find("openblas") != std::string::npos || b.find("mkl") != std::string::npos;
    });
    checks.push_back({"BLAS", fast_blas, blas.empty() ? "none found" : join(blas, ", "),
                      "LibTorch runs on the reference BLAS (about 10x slower): apt-get install libopenblas0-pthread"});

    checks.push_back({"gnuplot", on_path("gnuplot"), on_path("gnuplot") ? "found" : "missing",
                      "plots need gnuplot: apt-get install gnuplot-nox"});

    struct statvfs vfs {};
    if (statvfs(dir.c_str(), &vfs) == 0) {
        const double free_gib = static_cast<double>(vfs.f_bavail) * static_cast<double>(vfs.f_frsize) /
                                (1024.0 * 1024.0 * 1024.0);
        checks.push_back({"free disk", free_gib >= 1.0, fmt::format("{:.1f} GiB free in {}", free_gib, dir),
                          fmt::format("less than 1 GiB free in {}: free space or pass another --dir", dir)});
    } else {
        checks.push_back({"free disk", false, "unknown", fmt::format("cannot stat folder '{}': pass an existing --dir", dir)});
    }
    return checks;
}

std::string doctor_to_text(const std::vector<doctor_check> & checks) {
    std::string out;
    for (const auto & c : checks) {
        out += fmt::format("  {:<4} {:<14} {}\n", c.ok ? "ok" : "FAIL", c.name, c.value);
    }
    for (const auto & c : checks) {
        if (!c.ok) {
            out += fmt::format("missing: {}: {}\n", c.name, c.fix);
        }
    }
    return out;
}

nlohmann::json doctor_to_json(const std::vector<doctor_check> & checks) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto & c : checks) {
        out.push_back({{"name", c.name}, {"ok", c.ok}, {"value", c.value}, {"fix", c.ok ? "" : c.fix}});
    }
    return out;
}

}  // namespace voodoo
