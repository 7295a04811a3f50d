#include "ggml/quant.h"

#include "common/error.h"
#include "ggml/types.h"

#include <ggml-quants.h>  // iq2xs_init_impl, iq3xs_init_impl: the grids ggml_quantize_init builds

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include <sched.h>

namespace voodoo {

int resolve_threads(int n) {
    if (n > 0) {
        return n;
    }
    if (const char * env = std::getenv("VOODOO_THREADS"); env != nullptr && *env != '\0') {
        char * end = nullptr;
        errno = 0;
        const long v = std::strtol(env, &end, 10);
        if (end == env || *end != '\0' || errno != 0 || v < 1 || v > 4096) {
            throw error(fmt::format("VOODOO_THREADS='{}' is not a thread count: set it to a whole number from 1 to 4096, "
                                    "or unset it to use every core this process may run on",
                                    env));
        }
        return static_cast<int>(v);
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
        return CPU_COUNT(&set);
    }
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

namespace {

// Runs fn(row_begin, row_end) over [0, rows) on n_threads threads, each taking the next of about four slices per
// thread until none is left: a thread the kernel sets aside (more threads than cores, as the candidate build asks
// for: candidate_prefetch::run) leaves its slices to the others instead of holding the whole call back. Every row is
// quantized alone by ggml, so the slicing never changes a byte. Small work stays on the calling thread (thread
// start-up costs more than quantizing a few thousand weights).
template <typename Fn>
void parallel_rows(int64_t rows, int64_t ne0, int n_threads, Fn && fn) {
    constexpr int64_t k_min_weights_per_thread = 1 << 16;
    int64_t threads = std::min<int64_t>(resolve_threads(n_threads), rows);
    threads = std::min<int64_t>(threads, std::max<int64_t>(1, rows * ne0 / k_min_weights_per_thread));
    if (threads <= 1) {
        fn(int64_t{0}, rows);
        return;
    }
    const int64_t per = std::max<int64_t>(1, rows / (4 * threads));
    std::atomic<int64_t> next{0};
    const auto work = [&] {
        for (int64_t r0; (r0 = next.fetch_add(per)) < rows;) {
            fn(r0, std::min(rows, r0 + per));
        }
    };
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < threads; ++t) {
        pool.emplace_back(work);
    }
    work();
    for (auto & t : pool) {
        t.join();
    }
}

int64_t whole_rows(ggml_type type, size_t n_bytes, int64_t ne0, std::string_view tensor_name) {
    const size_t row = ggml_row_size(type, ne0);
    if (row == 0 || n_bytes % row != 0) {
        fail("tensor '{}': {} bytes of {} are not a whole number of rows of {} weights ({} bytes each)", tensor_name,
             n_bytes, type_name(type), ne0, row);
    }
    return static_cast<int64_t>(n_bytes / row);
}

// The lattice grids of ggml-quants.c (iq2_data[4], iq3_data[2]) and the types that use them: IQ1_S and IQ1_M share
// one. Longest to build first (one core of the development machine: IQ1 ≈ 19.5 s, IQ2_S 7.2, IQ2_XS 3.6, IQ2_XXS
// 1.7, IQ3_S 0.3, IQ3_XXS 0.2).
constexpr std::array<ggml_type, 6> k_grid_types = {GGML_TYPE_IQ1_S,  GGML_TYPE_IQ2_S,  GGML_TYPE_IQ2_XS,
                                                   GGML_TYPE_IQ2_XXS, GGML_TYPE_IQ3_S, GGML_TYPE_IQ3_XXS};

int grid_of(ggml_type type) {
    switch (type) {
        case GGML_TYPE_IQ1_S:
        case GGML_TYPE_IQ1_M: return 0;
        case GGML_TYPE_IQ2_S: return 1;
        case GGML_TYPE_IQ2_XS: return 2;
        case GGML_TYPE_IQ2_XXS: return 3;
        case GGML_TYPE_IQ3_S: return 4;
        case GGML_TYPE_IQ3_XXS: return 5;
        default: return -1;
    }
}

// Each grid's state: 0 not built, 1 being built (by one thread; the others wait), 2 built.
std::mutex g_grid_mutex;
std::condition_variable g_grid_cv;
std::array<int, k_grid_types.size()> g_grid_state{};
std::shared_mutex g_llama_may_build;  // shared: llama.cpp code that may build a grid; unique: a lattice_warmup

// Claims grid g for the caller to build: true when it was not built nor claimed; else waits while another thread
// builds it and returns false.
bool claim_grid(int g) {
    std::unique_lock<std::mutex> lock(g_grid_mutex);
    int & state = g_grid_state[static_cast<size_t>(g)];
    if (state == 0) {
        state = 1;
        return true;
    }
    g_grid_cv.wait(lock, [&] { return state == 2; });
    return false;
}

// Builds claimed grid g. With `direct`, by ggml-quants.c's own init function outside ggml's critical section (a
// lattice_warmup, which holds g_llama_may_build); else by ggml_quantize_init, inside it.
void build_grid(int g, bool direct) {
    const ggml_type type = k_grid_types[static_cast<size_t>(g)];
    if (!direct) {
        ggml_quantize_init(type);
    } else if (type == GGML_TYPE_IQ3_XXS) {
        iq3xs_init_impl(256);  // ggml_quantize_init's arguments for the two IQ3 grids (ggml.c)
    } else if (type == GGML_TYPE_IQ3_S) {
        iq3xs_init_impl(512);
    } else {
        iq2xs_init_impl(type);
    }
    {
        std::lock_guard<std::mutex> lock(g_grid_mutex);
        g_grid_state[static_cast<size_t>(g)] = 2;
    }
    g_grid_cv.notify_all();
}

}  // namespace

lattice_warmup::lattice_warmup(std::span<const ggml_type> types, int n_threads) {
    std::vector<int> grids;
    for (int g = 0; g < static_cast<int>(k_grid_types.size()); ++g) {
        if (std::any_of(types.begin(), types.end(), [g](ggml_type t) { return grid_of(t) == g; })) {
            grids.push_back(g);  // in k_grid_types' order: the longest first
        }
    }
    if (grids.empty()) {
        return;
    }
    // Claimed here, before the constructor returns, so that a quantize_into after it waits for these grids instead
    // of building one under ggml's critical section (where the other types' quantization would wait too).
    hold_ = std::unique_lock<std::shared_mutex>(g_llama_may_build);
    std::erase_if(grids, [](int g) { return !claim_grid(g); });
    if (grids.empty()) {
        hold_.unlock();
        return;
    }
    const int threads = std::min<int>(resolve_threads(n_threads), static_cast<int>(grids.size()));
    coordinator_ = std::thread([grids = std::move(grids), threads] {
        std::atomic<size_t> next{0};
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
            pool.emplace_back([&] {
                for (size_t j; (j = next++) < grids.size();) {
                    build_grid(grids[j], true);
                }
            });
        }
        for (std::thread & t : pool) {
            t.join();
        }
    });
}

void lattice_warmup::wait() {
    if (coordinator_.joinable()) {
        coordinator_.join();
    }
    if (hold_.owns_lock()) {
        hold_.unlock();  // on the thread that locked it (std::shared_mutex's rule)
    }
}

lattice_warmup::~lattice_warmup() { wait(); }

int lattice_grid_order(ggml_type type) { return grid_of(type); }

std::shared_lock<std::shared_mutex> hold_lattice_tables() { return std::shared_lock<std::shared_mutex>(g_llama_may_build); }

void quantize_into(ggml_type type, std::span<const float> src, int64_t ne0, std::span<uint8_t> dst,
                   std::span<const float> imatrix, int n_threads, std::string_view tensor_name) {
    const type_info & info = type_info_of(type);
    if (ne0 <= 0 || src.size() % static_cast<size_t>(ne0) != 0) {
        fail("tensor '{}': {} weights are not a whole number of rows of ne0 = {}", tensor_name, src.size(), ne0);
    }
    const int64_t rows = static_cast<int64_t>(src.size()) / ne0;
    const int64_t ne[2] = {ne0, rows};
    const size_t want = tensor_bytes(type, ne, tensor_name);
    if (dst.size() != want) {
        fail("tensor '{}' {} as {}: destination holds {} bytes, needs {}", tensor_name, shape_str(ne), info.name,
             dst.size(), want);
    }
    if (!imatrix.empty() && imatrix.size() != static_cast<size_t>(ne0)) {
        fail("tensor '{}' {}: the imatrix has {} values, expected ne0 = {}", tensor_name, shape_str(ne),
             imatrix.size(), ne0);
    }
    if (info.requires_imatrix && imatrix.empty()) {
        fail("tensor '{}': {} needs an importance matrix; pass --imatrix or choose another type", tensor_name,
             info.name);
    }
    // A lattice type's grid, built once before the threads share it (or waited for, when a lattice_warmup builds
    // it); the other types need none (ggml_quantize_init does nothing for them).
    if (const int g = grid_of(type); g >= 0 && claim_grid(g)) {
        build_grid(g, false);
    }
    const float * imat = imatrix.empty() ? nullptr : imatrix.data();
    parallel_rows(rows, ne0, n_threads, [&](int64_t r0, int64_t r1) {
        // ggml_quantize_chunk places row r at dst + r · row_size itself, so every slice gets the same base.
        ggml_quantize_chunk(type, src.data(), dst.data(), r0 * ne0, r1 - r0, ne0, imat);
    });
}

std::vector<uint8_t> quantize(ggml_type type, std::span<const float> src, int64_t ne0, std::span<const float> imatrix,
                              int n_threads, std::string_view tensor_name) {
    if (ne0 <= 0 || src.size() % static_cast<size_t>(ne0) != 0) {
        fail("tensor '{}': {} weights are not a whole number of rows of ne0 = {}", tensor_name, src.size(), ne0);
    }
    const int64_t ne[2] = {ne0, static_cast<int64_t>(src.size()) / ne0};
    std::vector<uint8_t> out(tensor_bytes(type, ne, tensor_name));
    quantize_into(type, src, ne0, out, imatrix, n_threads, tensor_name);
    return out;
}

void dequantize_into(ggml_type type, std::span<const uint8_t> src, int64_t ne0, std::span<float> dst, int n_threads,
                     std::string_view tensor_name) {
    if (!type_fits(type, ne0)) {
        const int64_t ne[1] = {ne0};
        tensor_bytes(type, ne, tensor_name);  // throws the standard "does not fit" error
    }
    const int64_t rows = whole_rows(type, src.size(), ne0, tensor_name);
    if (dst.size() != static_cast<size_t>(rows * ne0)) {
        fail("tensor '{}': destination holds {} floats, needs {}", tensor_name, dst.size(), rows * ne0);
    }
    const size_t row_size = ggml_row_size(type, ne0);
    if (type == GGML_TYPE_F32) {
        std::memcpy(dst.data(), src.data(), src.size());
        return;
    }
    const ggml_to_float_t to_float = ggml_get_type_traits(type)->to_float;
    if (!to_float) {
        fail("tensor '{}': ggml has no to_float for {}", tensor_name, type_name(type));
    }
    parallel_rows(rows, ne0, n_threads, [&](int64_t r0, int64_t r1) {
        to_float(src.data() + r0 * row_size, dst.data() + r0 * ne0, (r1 - r0) * ne0);
    });
}

std::vector<float> dequantize(ggml_type type, std::span<const uint8_t> src, int64_t ne0, int n_threads,
                              std::string_view tensor_name) {
    const int64_t rows = whole_rows(type, src.size(), ne0, tensor_name);
    std::vector<float> out(static_cast<size_t>(rows * ne0));
    dequantize_into(type, src, ne0, out, n_threads, tensor_name);
    return out;
}

void validate_rows(ggml_type type, std::span<const uint8_t> src, int64_t ne0, std::string_view tensor_name) {
    // ggml reports the bad block on stderr itself; we name the tensor and the row.
    const int64_t rows = whole_rows(type, src.size(), ne0, tensor_name);
    const size_t row_size = ggml_row_size(type, ne0);
    for (int64_t r = 0; r < rows; ++r) {
        if (!ggml_validate_row_data(type, src.data() + r * row_size, row_size)) {
            fail("tensor '{}' ({}): row {} holds invalid data (NaN/inf scale or bad code)", tensor_name,
                 type_name(type), r);
        }
    }
}

}  // namespace voodoo
