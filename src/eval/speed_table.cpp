#include "eval/speed_table.h"

#include "common/error.h"
#include "common/file.h"
#include "ggml/quant.h"
#include "ggml/runtime.h"

#include <ggml-alloc.h>
#include <ggml-backend.h>
#include <ggml.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

namespace voodoo {

namespace {

std::string machine_name() {
    std::ifstream in("/proc/cpuinfo");
    std::string line, model = "unknown CPU";
    while (std::getline(in, line)) {
        if (line.rfind("model name", 0) == 0) {
            model = line.substr(line.find(':') + 2);
            break;
        }
    }
    return fmt::format("{} ({} cores)", model, std::thread::hardware_concurrency());
}

/// Seconds per weight of one [ne0 × rows] `type` weight times an f32 vector in ggml's CPU backend.
double measure_one(ggml_type type, int threads) {
    constexpr int64_t ne0 = 4096, sample_rows = 64;
    const size_t row_bytes = tensor_bytes(type, std::array<int64_t, 2>{ne0, 1});
    const int64_t rows = std::max<int64_t>(sample_rows, static_cast<int64_t>((64u << 20) / row_bytes) / sample_rows * sample_rows);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> w(static_cast<size_t>(ne0 * sample_rows));
    for (float & x : w) {
        x = normal(rng);
    }
    const std::vector<float> ones(static_cast<size_t>(ne0), 1.0f);
    const std::vector<uint8_t> sample = quantize(type, w, ne0, ones, threads);

    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) {
        fail("ggml has no CPU backend: the speed table is measured there (run voodoo doctor)");
    }
    ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
    if (auto set = reinterpret_cast<ggml_backend_set_n_threads_t>(
            ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), "ggml_backend_set_n_threads"))) {
        set(backend, threads);
    }
    ggml_init_params ip{ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * W = ggml_new_tensor_2d(ctx, type, ne0, rows);
    ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, ne0, 1);
    ggml_tensor * y = ggml_mul_mat(ctx, W, x);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    for (int64_t r = 0; r < rows; r += sample_rows) {
        ggml_backend_tensor_set(W, sample.data(), static_cast<size_t>(r) * row_bytes, sample.size());
    }
    ggml_backend_tensor_set(x, w.data(), 0, static_cast<size_t>(ne0) * sizeof(float));
    double best = 1e30;
    for (int i = 0; i < 6; ++i) {  // the first is the warm-up
        const auto t0 = std::chrono::steady_clock::now();
        ggml_backend_graph_compute(backend, gf);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (i > 0) {
            best = std::min(best, s);
        }
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    ggml_backend_free(backend);
    return best / static_cast<double>(ne0 * rows);
}

}  // namespace

std::string default_speed_table_path(int threads) {
    const char * xdg = std::getenv("XDG_CACHE_HOME");
    const char * home = std::getenv("HOME");
    const std::filesystem::path base = xdg && *xdg ? std::filesystem::path(xdg)
                                                   : std::filesystem::path(home && *home ? home : "/tmp") / ".cache";
    return (base / "voodoo" / fmt::format("type-speed-t{}.json", resolve_threads(threads))).string();
}

type_speed_table load_or_measure_type_speeds(const std::vector<ggml_type> & types, int threads, const std::string & path) {
    type_speed_table table;
    table.threads = resolve_threads(threads);
    table.machine = machine_name();
    if (!path.empty() && std::filesystem::exists(path)) {
        try {
            const nlohmann::json j = nlohmann::json::parse(std::ifstream(path));
            if (j.at("machine") == table.machine && j.at("threads") == table.threads) {
                for (const auto & [name, v] : j.at("seconds_per_weight").items()) {
                    if (const auto t = type_from_name(name)) {
                        table.seconds_per_weight[*t] = v.get<double>();
                    }
                }
            }
        } catch (const std::exception &) {
            table.seconds_per_weight.clear();  // a damaged or older file is measured again
        }
    }
    bool measured = false;
    for (ggml_type t : types) {
        if (!table.seconds_per_weight.count(t)) {
            llama_runtime_init();
            table.seconds_per_weight[t] = measure_one(t, table.threads);
            measured = true;
        }
    }
    if (measured && !path.empty()) {
        nlohmann::json spw = nlohmann::json::object();
        for (const auto & [t, v] : table.seconds_per_weight) {
            spw[type_name(t)] = v;
        }
        std::filesystem::create_directories(std::filesystem::path(path).parent_path());
        write_file_atomic(path, nlohmann::json{{"machine", table.machine}, {"threads", table.threads},
                                               {"method", "ggml CPU backend, [4096 x R] weight (~64 MiB) times an f32 "
                                                          "vector, best of 5 after a warm-up, per weight"},
                                               {"seconds_per_weight", spw}}.dump(2) + "\n");
    }
    return table;
}

bool read_per_token(const gguf_file & src, const gguf_tensor & t) {
    if (t.n_dims < 2) {
        return false;
    }
    if (t.name.rfind("blk.", 0) == 0 || t.name == "output.weight") {
        return true;
    }
    if (t.name == "token_embd.weight") {
        return std::none_of(src.tensors().begin(), src.tensors().end(),
                            [](const gguf_tensor & o) { return o.name == "output.weight"; });
    }
    return false;
}

double predicted_token_seconds(const gguf_file & src, const std::map<std::string, ggml_type> & type_of,
                               const type_speed_table & table) {
    double s = 0;
    for (const gguf_tensor & t : src.tensors()) {
        if (!read_per_token(src, t)) {
            continue;
        }
        const auto it = type_of.find(t.name);
        const ggml_type type = it == type_of.end() ? t.type : it->second;
        const auto c = table.seconds_per_weight.find(type);
        if (c == table.seconds_per_weight.end()) {
            fail("the speed table has no entry for type {} (tensor {}): measure it with the types of the menus", type_name(type), t.name);
        }
        s += static_cast<double>(t.n_elements()) * c->second;
    }
    return s;
}

}  // namespace voodoo
