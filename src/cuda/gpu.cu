// The fused kernels of src/cuda/gpu.h.
//
// Tiled kernels (every tensor whose rows are a multiple of 8 weights, read in order): a tensor is a flat run of
// rows · ne0 weights, and since every row is a whole number of blocks, candidate k's bytes for weights
// [e, e + 2048) are one contiguous, 16-byte aligned run of 2048 / bs_k · bb_k bytes. A block of 256 threads
// takes one such tile at a time: it copies the tile's bytes of all K candidates into shared memory with
// cp.async (16 bytes a copy, all in flight at once, the next tile's copies issued before this tile is
// computed), then each thread dequantizes its eight weights of each candidate from shared memory. The
// per-candidate branch is uniform across the block, so the type switch costs no divergence.
//
// Row kernels (the token embedding's gathered rows, rows whose length is not a multiple of 8): one thread
// owns eight consecutive weights of one row and reads the candidates' bytes straight from global memory.
#include "cuda/gpu.h"

#include "common/error.h"
#include "cuda/deq_host.h"
#include "cuda/deq_rules.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>

namespace voodoo::gpu {

namespace {

constexpr int k_threads = 256;

std::atomic<bool> & tiled_enabled() {
    static std::atomic<bool> on{true};
    return on;
}

// Everything a launch reads besides the output and G, passed by value (the kernel parameter space; indexed
// with a warp-uniform k).
struct launch_args {
    const uint8_t * q[max_candidates];
    int64_t row_bytes[max_candidates];
    int type[max_candidates];
    int K;
    const float * p;          // [K] on the device, or nullptr (dequantize: one candidate, p = 1)
    const int64_t * ids;      // [n] rows to read, or nullptr: row r reads row r
    int64_t n_rows;           // rows of the output / of G
    int64_t ne0;
    deq::tables tb;
    // Tiled kernels: bytes of one full tile of each candidate, its offset in a shared-memory stage, the
    // stage's size (two stages: the tile computed and the next one loading), and the tensor's weights.
    int tile_bytes[max_candidates];
    int stage_off[max_candidates];
    int stage_bytes;
    int64_t n_weights;
    int copy_of[max_candidates];    // j < k when candidate k reads the same bytes as j (shared F16 and BF16): not staged twice
    int shared_by[max_candidates];  // the reverse: the one candidate whose copy_of is k, or -1
};

constexpr int k_tile = 8 * k_threads;  // weights per tile: eight per thread

void check(cudaError_t e, const char * what) {
    if (e != cudaSuccess) {
        fail("CUDA error in {}: {}", what, cudaGetErrorString(e));
    }
}

// ggml's i-quant tables, uploaded once per device.
const deq::tables & device_tables(int device) {
    static std::mutex mutex;
    static std::map<int, std::pair<torch::Tensor, deq::tables>> per_device;
    std::lock_guard<std::mutex> lock(mutex);
    auto it = per_device.find(device);
    if (it == per_device.end()) {
        const packed_deq_tables & h = packed_host_deq_tables();
        torch::Tensor host = torch::from_blob(const_cast<uint8_t *>(h.bytes.data()),
                                              {static_cast<int64_t>(h.bytes.size())}, torch::kUInt8);
        torch::Tensor dev = host.to(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(device)));
        const uint8_t * base = dev.data_ptr<uint8_t>();
        deq::tables t = {
            reinterpret_cast<const uint64_t *>(base + h.offsets[0]), reinterpret_cast<const uint64_t *>(base + h.offsets[1]),
            reinterpret_cast<const uint64_t *>(base + h.offsets[2]), reinterpret_cast<const uint32_t *>(base + h.offsets[3]),
            reinterpret_cast<const uint32_t *>(base + h.offsets[4]), reinterpret_cast<const uint64_t *>(base + h.offsets[5]),
            reinterpret_cast<const uint8_t *>(base + h.offsets[6]),  reinterpret_cast<const int8_t *>(base + h.offsets[7]),
        };
        it = per_device.emplace(device, std::make_pair(dev, t)).first;
    }
    return it->second.second;
}

launch_args make_args(const candidate_set & c, const torch::Tensor & ids, int64_t n_rows) {
    launch_args a{};
    a.K = static_cast<int>(c.types.size());
    for (int k = 0; k < a.K; ++k) {
        a.q[k] = c.bytes[static_cast<size_t>(k)].data_ptr<uint8_t>();
        a.row_bytes[k] = c.ne0 / deq::block_size(c.types[static_cast<size_t>(k)]) * deq::block_bytes(c.types[static_cast<size_t>(k)]);
        a.type[k] = c.types[static_cast<size_t>(k)];
    }
    a.ids = ids.defined() ? ids.data_ptr<int64_t>() : nullptr;
    a.n_rows = n_rows;
    a.ne0 = c.ne0;
    a.tb = device_tables(c.bytes.front().device().index());
    return a;
}

int blocks_for(int64_t work, int max_blocks) {
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + k_threads - 1) / k_threads, max_blocks)));
}

int sm_count() {
    return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// Rows whose length is not a multiple of 8 (float types only, e.g. 172) take the scalar tail and stores.
__device__ __forceinline__ int group_size(const launch_args & a, int64_t i0) {
    return a.ne0 - i0 < 8 ? static_cast<int>(a.ne0 - i0) : 8;
}

__global__ void dequantize_kernel(launch_args a, float * out) {
    const int64_t per_row = (a.ne0 + 7) / 8, total = a.n_rows * per_row;
    for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < total;
         g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = g / per_row, i0 = (g % per_row) * 8;
        const int n = group_size(a, i0);
        float v[8];
        deq::deq_upto8(a.type[0], a.q[0] + r * a.row_bytes[0], static_cast<int>(i0), n, v, a.tb);
        for (int j = 0; j < n; ++j) {
            out[r * a.ne0 + i0 + j] = v[j];
        }
    }
}

template <typename Out>
__device__ __forceinline__ void store8(Out * dst, const float * v);

template <>
__device__ __forceinline__ void store8<float>(float * dst, const float * v) {
    float4 * o = reinterpret_cast<float4 *>(dst);
    o[0] = make_float4(v[0], v[1], v[2], v[3]);
    o[1] = make_float4(v[4], v[5], v[6], v[7]);
}

template <>
__device__ __forceinline__ void store8<__nv_bfloat16>(__nv_bfloat16 * dst, const float * v) {
    __nv_bfloat162 h[4];
    for (int j = 0; j < 4; ++j) {
        h[j] = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
    }
    *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(h);
}

template <typename Out>
__global__ void mixture_kernel(launch_args a, Out * out) {
    const int64_t per_row = (a.ne0 + 7) / 8, total = a.n_rows * per_row;
    const bool vec = a.ne0 % 8 == 0;
    for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < total;
         g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = g / per_row, i0 = (g % per_row) * 8;
        const int n = group_size(a, i0);
        const int64_t src = a.ids ? a.ids[r] : r;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 0; k < a.K; ++k) {
            const float pk = a.p[k];
            if (pk == 0.0f) {
                continue;
            }
            float v[8];
            deq::deq_upto8(a.type[k], a.q[k] + src * a.row_bytes[k], static_cast<int>(i0), n, v, a.tb);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                acc[j] = fmaf(pk, v[j], acc[j]);
            }
        }
        if (vec) {
            store8(out + r * a.ne0 + i0, acc);
        } else {
            for (int j = 0; j < n; ++j) {
                out[r * a.ne0 + i0 + j] = static_cast<Out>(acc[j]);
            }
        }
    }
}

template <typename G>
__device__ __forceinline__ void load8(const G * src, float * v);

template <>
__device__ __forceinline__ void load8<float>(const float * src, float * v) {
    const float4 a = reinterpret_cast<const float4 *>(src)[0], b = reinterpret_cast<const float4 *>(src)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

template <>
__device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16 * src, float * v) {
    const uint4 raw = *reinterpret_cast<const uint4 *>(src);
    const __nv_bfloat162 * h = reinterpret_cast<const __nv_bfloat162 *>(&raw);
    for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        v[2 * j] = f.x;
        v[2 * j + 1] = f.y;
    }
}

template <typename G>
__global__ void gate_grad_kernel(launch_args a, const G * grad, double * out) {
    __shared__ double block_sum[max_candidates];
    if (threadIdx.x < max_candidates) {
        block_sum[threadIdx.x] = 0.0;
    }
    __syncthreads();
    float part[max_candidates];
    for (int k = 0; k < a.K; ++k) {
        part[k] = 0.0f;
    }
    const int64_t per_row = (a.ne0 + 7) / 8, total = a.n_rows * per_row;
    const bool vec = a.ne0 % 8 == 0;
    for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < total;
         g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = g / per_row, i0 = (g % per_row) * 8;
        const int n = group_size(a, i0);
        const int64_t src = a.ids ? a.ids[r] : r;
        float gv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (vec) {
            load8(grad + r * a.ne0 + i0, gv);  // G is read once, for all K candidates
        } else {
            for (int j = 0; j < n; ++j) {
                gv[j] = static_cast<float>(grad[r * a.ne0 + i0 + j]);
            }
        }
        for (int k = 0; k < a.K; ++k) {
            float v[8];
            deq::deq_upto8(a.type[k], a.q[k] + src * a.row_bytes[k], static_cast<int>(i0), n, v, a.tb);
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                dot = fmaf(gv[j], v[j], dot);
            }
            part[k] += dot;
        }
    }
    const unsigned lane = threadIdx.x % 32;
    for (int k = 0; k < a.K; ++k) {
        double s = part[k];
        for (int off = 16; off > 0; off /= 2) {
            s += __shfl_down_sync(0xffffffffu, s, off);
        }
        if (lane == 0) {
            atomicAdd(&block_sum[k], s);
        }
    }
    __syncthreads();
    if (threadIdx.x < a.K) {
        atomicAdd(&out[threadIdx.x], block_sum[threadIdx.x]);
    }
}

// Tile t's bytes of every candidate into stage `stage` of shared memory. Full tiles: 16-byte cp.async copies
// (issued, not waited for). The last, partial tile (at most once per tensor): plain byte copies.
__device__ __forceinline__ void load_tile(const launch_args & a, uint8_t * smem, int stage, int64_t t) {
    const int64_t e0 = t * k_tile;
    const bool full = e0 + k_tile <= a.n_weights;
    uint8_t * base = smem + stage * a.stage_bytes;
    for (int k = 0; k < a.K; ++k) {
        if (a.copy_of[k] >= 0) {
            continue;  // staged once, by the candidate it shares its bytes with
        }
        if (a.p != nullptr && a.p[k] == 0.0f && (a.shared_by[k] < 0 || a.p[a.shared_by[k]] == 0.0f)) {
            continue;  // mixture: bytes whose candidates all have p = 0 are not read at all
        }
        const uint8_t * src = a.q[k] + t * a.tile_bytes[k];
        uint8_t * dst = base + a.stage_off[k];
        if (full) {
            for (int i = threadIdx.x; i < a.tile_bytes[k] / 16; i += blockDim.x) {
                __pipeline_memcpy_async(dst + 16 * i, src + 16 * i, 16);
            }
        } else {
            const int bs = deq::block_size(a.type[k]), bb = deq::block_bytes(a.type[k]);
            const int n = static_cast<int>((a.n_weights - e0) / bs * bb);
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                dst[i] = src[i];
            }
        }
    }
    __pipeline_commit();
}

// Drives the two-stage pipeline over the tiles this block owns (t = blockIdx.x, + gridDim.x, …): body(t, stage)
// runs with tile t's bytes in shared memory.
template <typename Body>
__device__ __forceinline__ void for_each_tile(const launch_args & a, uint8_t * smem, Body body) {
    const int64_t n_tiles = (a.n_weights + k_tile - 1) / k_tile;
    int stage = 0;
    int64_t t = blockIdx.x;
    if (t < n_tiles) {
        load_tile(a, smem, stage, t);
    }
    for (; t < n_tiles; t += gridDim.x) {
        if (t + gridDim.x < n_tiles) {
            load_tile(a, smem, stage ^ 1, t + gridDim.x);
        } else {
            __pipeline_commit();  // an empty group keeps the count: the wait below is for tile t
        }
        __pipeline_wait_prior(1);
        __syncthreads();
        body(t, smem + stage * a.stage_bytes);
        __syncthreads();  // the next iteration's copies overwrite this stage
        stage ^= 1;
    }
}

template <typename Out, int MinBlocks>
__global__ void __launch_bounds__(k_threads, MinBlocks) mixture_tiled_kernel(launch_args a, Out * out) {
    extern __shared__ __align__(16) uint8_t smem[];
    for_each_tile(a, smem, [&](int64_t t, const uint8_t * stage) {
        const int64_t e = t * k_tile + threadIdx.x * 8;
        if (e >= a.n_weights) {
            return;
        }
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 0; k < a.K; ++k) {
            const float pk = a.p[k];
            if (pk == 0.0f) {
                continue;
            }
            float v[8];
            deq::deq8(a.type[k], stage + a.stage_off[k], static_cast<int>(threadIdx.x) * 8, v, a.tb);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                acc[j] = fmaf(pk, v[j], acc[j]);
            }
        }
        store8(out + e, acc);
    });
}

template <typename G, int MinBlocks>
__global__ void __launch_bounds__(k_threads, MinBlocks) gate_grad_tiled_kernel(launch_args a, const G * grad, double * out) {
    extern __shared__ __align__(16) uint8_t smem[];
    // Per-thread partial sums, one column per candidate, after the two stages.
    float * part = reinterpret_cast<float *>(smem + 2 * a.stage_bytes);
    for (int k = 0; k < a.K; ++k) {
        part[k * k_threads + threadIdx.x] = 0.0f;
    }
    for_each_tile(a, smem, [&](int64_t t, const uint8_t * stage) {
        const int64_t e = t * k_tile + threadIdx.x * 8;
        if (e >= a.n_weights) {
            return;
        }
        float gv[8];
        load8(grad + e, gv);  // G is read once, for all K candidates
        for (int k = 0; k < a.K; ++k) {
            float v[8];
            deq::deq8(a.type[k], stage + a.stage_off[k], static_cast<int>(threadIdx.x) * 8, v, a.tb);
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                dot = fmaf(gv[j], v[j], dot);
            }
            part[k * k_threads + threadIdx.x] += dot;
        }
    });
    __syncthreads();
    // Warp w sums the columns k = w, w + 8, …: eight partials per lane, then the warp, in f64.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int k = warp; k < a.K; k += k_threads / 32) {
        double s = 0.0;
        for (int i = lane; i < k_threads; i += 32) {
            s += part[k * k_threads + i];
        }
        for (int off = 16; off > 0; off /= 2) {
            s += __shfl_down_sync(0xffffffffu, s, off);
        }
        if (lane == 0) {
            atomicAdd(&out[k], s);
        }
    }
}

// Fills the tiled fields of a; false when the tiled kernels cannot take this set (a row not a multiple of 8,
// a gather by ids, a pointer not 16-byte aligned, or stages larger than shared memory allows).
bool plan_tiles(launch_args & a, const candidate_set & c, bool ids, size_t extra_smem, size_t & smem) {
    if (!tiled_enabled().load() || ids || c.ne0 % 8 != 0) {
        return false;
    }
    int off = 0;
    for (int k = 0; k < a.K; ++k) {
        a.shared_by[k] = -1;
    }
    for (int k = 0; k < a.K; ++k) {
        const int bs = deq::block_size(a.type[k]), bb = deq::block_bytes(a.type[k]);
        a.tile_bytes[k] = k_tile / bs * bb;  // 2048 weights = 8 superblocks or 64 blocks: a multiple of 16 bytes
        if (a.tile_bytes[k] % 16 != 0 || reinterpret_cast<uintptr_t>(a.q[k]) % 16 != 0) {
            return false;
        }
        a.copy_of[k] = -1;
        for (int j = 0; j < k; ++j) {
            if (a.q[j] == a.q[k] && a.tile_bytes[j] == a.tile_bytes[k] && a.copy_of[j] < 0) {
                a.copy_of[k] = j;
            }
        }
        if (a.copy_of[k] >= 0) {
            if (a.shared_by[a.copy_of[k]] >= 0) {
                return false;  // a third reader of the same bytes: upload never makes one; the row kernels take it
            }
            a.shared_by[a.copy_of[k]] = k;
            a.stage_off[k] = a.stage_off[a.copy_of[k]];
            continue;
        }
        a.stage_off[k] = off;
        off += a.tile_bytes[k];
    }
    a.stage_bytes = off;
    a.n_weights = c.rows * c.ne0;
    smem = 2 * static_cast<size_t>(off) + extra_smem;
    return smem <= static_cast<size_t>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t smem) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
          "cudaFuncSetAttribute");
}

// Blocks for a tiled launch: enough resident blocks to fill every multiprocessor, never more than tiles.
template <typename Kernel>
int tiled_blocks(Kernel kernel, size_t smem, int64_t n_weights) {
    int per_sm = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, k_threads, smem),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    const int64_t n_tiles = (n_weights + k_tile - 1) / k_tile;
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n_tiles, static_cast<int64_t>(std::max(per_sm, 1)) * sm_count())));
}

// Resident blocks per multiprocessor the tiled kernels are compiled for (__launch_bounds__' second
// argument: registers are capped so that this many fit): bench/fused_kernels measures 1 to 4.
constexpr int k_default_min_blocks = 4;  // fastest in bench/fused_kernels on the H200 (docs/BENCHMARKS.md)

std::atomic<int> & tiled_min_blocks() {
    static std::atomic<int> n{k_default_min_blocks};
    return n;
}

template <typename Kernel, typename... Args>
void run_tiled(Kernel kernel, size_t smem, int64_t n_weights, cudaStream_t stream, Args... args) {
    allow_smem(kernel, smem);
    kernel<<<tiled_blocks(kernel, smem, n_weights), k_threads, smem, stream>>>(args...);
}

template <typename Out>
void launch_mixture_tiled(const launch_args & a, Out * out, size_t smem, cudaStream_t stream) {
    switch (tiled_min_blocks().load()) {
        case 1: run_tiled(mixture_tiled_kernel<Out, 1>, smem, a.n_weights, stream, a, out); break;
        case 3: run_tiled(mixture_tiled_kernel<Out, 3>, smem, a.n_weights, stream, a, out); break;
        case 4: run_tiled(mixture_tiled_kernel<Out, 4>, smem, a.n_weights, stream, a, out); break;
        default: run_tiled(mixture_tiled_kernel<Out, 2>, smem, a.n_weights, stream, a, out); break;
    }
    check(cudaGetLastError(), "mixture_tiled_kernel");
}

template <typename G>
void launch_gate_grad_tiled(const launch_args & a, const G * grad, double * out, size_t smem, cudaStream_t stream) {
    switch (tiled_min_blocks().load()) {
        case 1: run_tiled(gate_grad_tiled_kernel<G, 1>, smem, a.n_weights, stream, a, grad, out); break;
        case 3: run_tiled(gate_grad_tiled_kernel<G, 3>, smem, a.n_weights, stream, a, grad, out); break;
        case 4: run_tiled(gate_grad_tiled_kernel<G, 4>, smem, a.n_weights, stream, a, grad, out); break;
        default: run_tiled(gate_grad_tiled_kernel<G, 2>, smem, a.n_weights, stream, a, grad, out); break;
    }
    check(cudaGetLastError(), "gate_grad_tiled_kernel");
}

void require_device_tensor(const torch::Tensor & t, const candidate_set & c, const char * what) {
    if (!t.is_cuda() || t.device() != c.bytes.front().device()) {
        fail("gpu::{}: tensor on {} but the candidates are on {}", what, t.device().str(), c.bytes.front().device().str());
    }
}

torch::Tensor checked_ids(const candidate_set & c, const torch::Tensor & ids) {
    if (!ids.defined()) {
        return ids;
    }
    torch::Tensor i = ids.to(c.bytes.front().device(), torch::kLong).contiguous().view(-1);
    if (i.numel() > 0) {
        const auto lo = i.min().item<int64_t>(), hi = i.max().item<int64_t>();
        if (lo < 0 || hi >= c.rows) {
            fail("gpu: row {} is out of range (the tensor has {} rows)", lo < 0 ? lo : hi, c.rows);
        }
    }
    return i;
}

}  // namespace

void set_tiled_kernels(bool on) { tiled_enabled().store(on); }

void set_tiled_min_blocks(int n) { tiled_min_blocks().store(n >= 1 && n <= 4 ? n : k_default_min_blocks); }

namespace {

// upload's checks: the count, a GPU rule for every type, whole blocks, the byte sizes. Returns the set's shape and
// types, without bytes.
candidate_set checked_set(const std::vector<std::vector<uint8_t>> & bytes, const std::vector<int> & types, int64_t rows,
                          int64_t ne0, const std::string & name) {
    if (types.empty() || types.size() != bytes.size() || types.size() > static_cast<size_t>(max_candidates)) {
        fail("tensor '{}': {} candidates for the GPU (1 to {} are supported)", name, types.size(), max_candidates);
    }
    candidate_set c;
    c.rows = rows;
    c.ne0 = ne0;
    c.types = types;
    for (size_t k = 0; k < types.size(); ++k) {
        const int t = types[k];
        if (!deq::has_rule(t)) {
            fail("tensor '{}': candidate type {} has no GPU dequantizer; use --device cpu or a menu without it", name, t);
        }
        if (ne0 < 1 || ne0 % deq::block_size(t) != 0) {
            fail("tensor '{}': rows of {} weights do not fit the GPU dequantizer of type {}", name, ne0, t);
        }
        const int64_t expect = rows * (ne0 / deq::block_size(t)) * deq::block_bytes(t);
        if (static_cast<int64_t>(bytes[k].size()) != expect) {
            fail("tensor '{}': candidate {} has {} bytes, expected {}", name, k, bytes[k].size(), expect);
        }
        c.shared.push_back(false);
    }
    return c;
}

}  // namespace

candidate_set upload_host(const std::vector<std::vector<uint8_t>> & bytes, const std::vector<int> & types, int64_t rows,
                          int64_t ne0, torch::Device device, const std::string & name) {
    if (!device.is_cuda()) {
        fail("tensor '{}': host-resident candidates are for a CUDA device, not {}", name, device.str());
    }
    candidate_set c = checked_set(bytes, types, rows, ne0, name);
    for (const std::vector<uint8_t> & b : bytes) {
        torch::Tensor pinned =
            torch::empty({static_cast<int64_t>(b.size())}, torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(true));
        std::memcpy(pinned.data_ptr<uint8_t>(), b.data(), b.size());
        c.host.push_back(pinned);
    }
    return c;
}

candidate_set upload(const std::vector<std::vector<uint8_t>> & bytes, const std::vector<int> & types, int64_t rows,
                     int64_t ne0, torch::Device device, const std::string & name, const torch::Tensor & source) {
    candidate_set c = checked_set(bytes, types, rows, ne0, name);
    for (size_t k = 0; k < types.size(); ++k) {
        torch::Tensor host =
            torch::from_blob(const_cast<uint8_t *>(bytes[k].data()), {static_cast<int64_t>(bytes[k].size())}, torch::kUInt8);
        c.bytes.push_back(host.to(device));
    }
    const bool usable_source = source.defined() && source.device() == device && source.scalar_type() == torch::kBFloat16 &&
                               source.is_contiguous() && source.numel() == rows * ne0 &&
                               reinterpret_cast<uintptr_t>(source.data_ptr()) % 16 == 0;
    if (!usable_source) {
        return c;
    }
    const c10::cuda::CUDAGuard guard(device);
    const torch::Tensor src_bytes = source.view(torch::kUInt8).view({-1});
    for (size_t k = 0; k < types.size(); ++k) {
        if (types[k] == deq::BF16) {
            if (torch::equal(c.bytes[k], src_bytes)) {
                c.bytes[k] = src_bytes;
                c.shared[k] = true;
            }
        } else if (types[k] == deq::F16) {
            candidate_set one, derived;
            one.bytes = {c.bytes[k]};
            one.types = {deq::F16};
            derived.bytes = {src_bytes};
            derived.types = {deq::F16_OF_BF16};
            one.rows = derived.rows = rows;
            one.ne0 = derived.ne0 = ne0;
            // Bit for bit (as int32: -0 and +0 differ, and a NaN never equals itself, so a NaN keeps the copy).
            if (torch::equal(dequantize(one, 0).view(torch::kInt), dequantize(derived, 0).view(torch::kInt))) {
                c.bytes[k] = src_bytes;
                c.types[k] = deq::F16_OF_BF16;
                c.shared[k] = true;
            }
        }
    }
    return c;
}

torch::Tensor dequantize(const candidate_set & c, int k) {
    const c10::cuda::CUDAGuard guard(c.bytes.front().device());
    candidate_set one;
    one.bytes = {c.bytes[static_cast<size_t>(k)]};
    one.types = {c.types[static_cast<size_t>(k)]};
    one.rows = c.rows;
    one.ne0 = c.ne0;
    launch_args a = make_args(one, torch::Tensor(), c.rows);
    torch::Tensor out = torch::empty({c.rows, c.ne0}, c.bytes.front().options().dtype(torch::kFloat));
    auto stream = at::cuda::getCurrentCUDAStream();
    dequantize_kernel<<<blocks_for(c.rows * ((c.ne0 + 7) / 8), sm_count() * 16), k_threads, 0, stream>>>(a, out.data_ptr<float>());
    check(cudaGetLastError(), "dequantize_kernel");
    return out;
}

torch::Tensor mixture(const candidate_set & c, const torch::Tensor & p, const torch::Tensor & ids, torch::ScalarType dtype) {
    const c10::cuda::CUDAGuard guard(c.bytes.front().device());
    const torch::Tensor pf = p.to(c.bytes.front().device(), torch::kFloat).contiguous();
    if (pf.numel() != static_cast<int64_t>(c.types.size())) {
        fail("gpu::mixture: {} probabilities for {} candidates", pf.numel(), c.types.size());
    }
    const torch::Tensor i = checked_ids(c, ids);
    const int64_t n = i.defined() ? i.numel() : c.rows;
    launch_args a = make_args(c, i, n);
    a.p = pf.data_ptr<float>();
    auto stream = at::cuda::getCurrentCUDAStream();
    const int blocks = blocks_for(n * ((c.ne0 + 7) / 8), sm_count() * 16);
    torch::Tensor out = torch::empty({n, c.ne0}, c.bytes.front().options().dtype(dtype));
    if (n == 0) {
        return out;
    }
    size_t smem = 0;
    if (plan_tiles(a, c, i.defined(), 0, smem) && (dtype == torch::kFloat || dtype == torch::kBFloat16)) {
        if (dtype == torch::kFloat) {
            launch_mixture_tiled(a, out.data_ptr<float>(), smem, stream);
        } else {
            launch_mixture_tiled(a, reinterpret_cast<__nv_bfloat16 *>(out.data_ptr<at::BFloat16>()), smem, stream);
        }
        return out;
    }
    if (dtype == torch::kFloat) {
        mixture_kernel<float><<<blocks, k_threads, 0, stream>>>(a, out.data_ptr<float>());
    } else if (dtype == torch::kBFloat16) {
        mixture_kernel<__nv_bfloat16><<<blocks, k_threads, 0, stream>>>(
            a, reinterpret_cast<__nv_bfloat16 *>(out.data_ptr<at::BFloat16>()));
    } else {
        fail("gpu::mixture: output dtype {} (float32 or bfloat16 are supported)", c10::toString(dtype));
    }
    check(cudaGetLastError(), "mixture_kernel");
    return out;
}

torch::Tensor gate_grad(const candidate_set & c, const torch::Tensor & grad, const torch::Tensor & ids) {
    const c10::cuda::CUDAGuard guard(c.bytes.front().device());
    require_device_tensor(grad, c, "gate_grad");
    const torch::Tensor i = checked_ids(c, ids);
    const int64_t n = i.defined() ? i.numel() : c.rows;
    const torch::Tensor g = grad.contiguous().view({-1});
    if (g.numel() != n * c.ne0) {
        fail("gpu::gate_grad: gradient of {} values for {} rows of {}", g.numel(), n, c.ne0);
    }
    launch_args a = make_args(c, i, n);
    torch::Tensor out = torch::zeros({static_cast<int64_t>(c.types.size())}, g.options().dtype(torch::kDouble));
    if (n == 0) {
        return out;
    }
    auto stream = at::cuda::getCurrentCUDAStream();
    size_t smem = 0;
    const bool g16 = g.scalar_type() == torch::kBFloat16;
    if (plan_tiles(a, c, i.defined(), a.K * k_threads * sizeof(float), smem) &&
        (g16 || g.scalar_type() == torch::kFloat) && reinterpret_cast<uintptr_t>(g.data_ptr()) % 16 == 0) {
        a.p = nullptr;  // every candidate is read
        if (g16) {
            launch_gate_grad_tiled(a, reinterpret_cast<const __nv_bfloat16 *>(g.data_ptr<at::BFloat16>()),
                                   out.data_ptr<double>(), smem, stream);
        } else {
            launch_gate_grad_tiled(a, g.data_ptr<float>(), out.data_ptr<double>(), smem, stream);
        }
        return out;
    }
    // A few blocks per multiprocessor: each thread walks many groups, so the f64 atomics stay rare.
    const int blocks = blocks_for(n * ((c.ne0 + 7) / 8), sm_count() * 4);
    if (g.scalar_type() == torch::kFloat) {
        gate_grad_kernel<float><<<blocks, k_threads, 0, stream>>>(a, g.data_ptr<float>(), out.data_ptr<double>());
    } else if (g.scalar_type() == torch::kBFloat16) {
        gate_grad_kernel<__nv_bfloat16><<<blocks, k_threads, 0, stream>>>(
            a, reinterpret_cast<const __nv_bfloat16 *>(g.data_ptr<at::BFloat16>()), out.data_ptr<double>());
    } else {
        const torch::Tensor gf = g.to(torch::kFloat);
        gate_grad_kernel<float><<<blocks, k_threads, 0, stream>>>(a, gf.data_ptr<float>(), out.data_ptr<double>());
    }
    check(cudaGetLastError(), "gate_grad_kernel");
    return out;
}

int64_t resident_bytes(const candidate_set & c) {
    int64_t n = 0;
    for (size_t k = 0; k < c.bytes.size(); ++k) {
        n += k < c.shared.size() && c.shared[k] ? 0 : c.bytes[k].numel();
    }
    return n;
}

}  // namespace voodoo::gpu
