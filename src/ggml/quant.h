// Quantize and dequantize through ggml itself: the exact bytes llama-quantize writes and the exact
// floats llama.cpp's kernels see (exactness contract, DESIGN.md items 1 and 2).
#pragma once

#include <ggml.h>

#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

namespace voodoo {

/// Quantizes a row-major f32 tensor (src: [n_rows, ne0], ne0 innermost) to `type` with
/// ggml_quantize_chunk, the call llama-quantize makes, split over rows on `n_threads` threads
/// (0 = all cores). `imatrix`, when not empty, holds ne0 importance weights (Σx² per input column).
/// dst must hold exactly tensor_bytes(type, {ne0, n_rows}) bytes.
/// Throws voodoo::error naming `tensor_name` when ne0 does not fit the type's block, when the type
/// needs an imatrix and none is given, or when the sizes disagree.
void quantize_into(ggml_type type, std::span<const float> src, int64_t ne0, std::span<uint8_t> dst,
                   std::span<const float> imatrix = {}, int n_threads = 0, std::string_view tensor_name = "tensor");

/// quantize_into into a new buffer of exactly tensor_bytes(type, {ne0, n_rows}) bytes.
std::vector<uint8_t> quantize(ggml_type type, std::span<const float> src, int64_t ne0,
                              std::span<const float> imatrix = {}, int n_threads = 0,
                              std::string_view tensor_name = "tensor");

/// Dequantizes bytes of `type` (src: n_rows rows of ggml_row_size(type, ne0) bytes) to f32 with the
/// type's own to_float (F32 is copied). dst holds n_rows · ne0 floats.
/// Throws voodoo::error when the byte count is not a whole number of rows.
void dequantize_into(ggml_type type, std::span<const uint8_t> src, int64_t ne0, std::span<float> dst,
                     int n_threads = 0, std::string_view tensor_name = "tensor");

/// dequantize_into into a new buffer.
std::vector<float> dequantize(ggml_type type, std::span<const uint8_t> src, int64_t ne0, int n_threads = 0,
                              std::string_view tensor_name = "tensor");

/// Checks quantized bytes with ggml_validate_row_data (finite scales, valid codes), after checking the
/// byte count is whole rows. Throws voodoo::error naming the tensor when they are not valid.
void validate_rows(ggml_type type, std::span<const uint8_t> src, int64_t ne0, std::string_view tensor_name = "tensor");

/// Threads to use: n when positive; otherwise (0, every flag's default) the environment variable VOODOO_THREADS when
/// set (a whole number from 1 to 4096; anything else throws voodoo::error naming the variable: the default for
/// processes that share cores, e.g. the tests under `ctest -j`, where ggml's compute threads, which spin at each
/// barrier, slow several-fold when two processes' threads take turns on one core), else the cores this process may
/// run on (sched_getaffinity: what `taskset`, a container's cpuset or a SLURM allocation grants, as nproc counts),
/// else std::thread::hardware_concurrency (every core of the machine). LibTorch's own count: torch_thread_count.
int resolve_threads(int n);

/// The lattice types' tables built ahead, in parallel (issue #16). llama.cpp's lattice quantizers (IQ1_S and IQ1_M,
/// IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) search grids whose tables ggml_quantize_init builds once per process
/// (ggml.c; iq2xs_init_impl and iq3xs_init_impl of ggml-quants.c), one at a time under ggml's global critical
/// section, which every ggml_quantize_chunk of every type also takes: ≈ 32 s on one core of the development machine
/// (IQ1's grid alone ≈ 19 s), during which no other quantization ran. This builds each grid the lattice types of
/// `types` need on its own thread (at most `n_threads` at once, 0 = every core; the longest first), outside that
/// section, in the background from construction: quantize_into of a lattice type waits only for its own grid, and
/// quantization of the other types goes on meanwhile. The tables are llama.cpp's own (built by its functions), so
/// the bytes are those of ggml_quantize_init's. A grid that is half built must be seen by no llama.cpp code: while
/// one is built here, llama_model_quantize (hold_lattice_tables) waits, from the constructor to wait() (or the
/// destructor), which return when every grid is built and must run on the constructor's thread. Grids built or
/// claimed already (another warmup, a quantize_into) are not built again.
class lattice_warmup {
public:
    explicit lattice_warmup(std::span<const ggml_type> types, int n_threads = 0);
    lattice_warmup(const lattice_warmup &) = delete;
    lattice_warmup & operator=(const lattice_warmup &) = delete;
    ~lattice_warmup();
    /// Returns when every grid of the constructor's types is built.
    void wait();

private:
    std::unique_lock<std::shared_mutex> hold_;
    std::thread coordinator_;
};

/// The order in which a lattice_warmup starts building the grid of `type` (0: the first, the longest to build: IQ1's),
/// or -1 for a type with no grid. Work that needs several lattice types, started with a warmup, is best ordered from
/// the highest (ready first) down.
int lattice_grid_order(ggml_type type);

/// Held (shared) around any llama.cpp call that may build a lattice grid itself (llama_model_quantize): it waits
/// while a lattice_warmup builds grids outside ggml's critical section, and a lattice_warmup waits for it.
std::shared_lock<std::shared_mutex> hold_lattice_tables();

}  // namespace voodoo
