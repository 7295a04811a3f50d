// The GPU path of gate training (CUDA builds only: VOODOO_HAVE_CUDA): candidates stay on the GPU in their
// quantized bytes, and two fused kernels read them there.
//
//   mixture:    W_eff = Σ_k p_k · deq(Q_k)            one pass over the K candidates' bytes, W written once
//   gate_grad:  ∂L/∂p_k = ⟨G, deq(Q_k)⟩, k = 1..K      one pass over G = ∂L/∂W_eff for all K at once
//
// deq is ggml's to_float, eight weights per thread, by the rules of src/cuda/deq_rules.h (bit for bit:
// tests/test_cuda.cpp). Candidate memory is Σ_k bpw_k / 8 bytes per weight instead of K dense copies, and
// nothing for F16/BF16 candidates that read the teacher's bf16 weights (upload's `source`). Whole tensors go
// through tiled kernels (2,048-weight tiles of all K candidates staged in shared memory); gathered rows and
// rows not a multiple of 8 through row kernels (gpu.cu says how each works; docs/BENCHMARKS.md how fast).
#pragma once

#if defined(VOODOO_HAVE_CUDA)

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace voodoo::gpu {

/// The most candidates one tensor may have on the GPU path (the kernels' argument block holds this many).
constexpr int max_candidates = 32;

/// The K quantized candidates of one [rows, ne0] tensor, resident on one CUDA device.
struct candidate_set {
    std::vector<torch::Tensor> bytes;   // K uint8 tensors on the device, rows · ggml_row_size(type_k, ne0) each
    std::vector<int> types;             // K rule types: ggml types with a rule (deq::has_rule), or
                                        // deq::F16_OF_BF16 for an F16 candidate read from shared bf16 bytes
    std::vector<bool> shared;           // K: true when bytes[k] is the source's bf16 tensor, not a copy
    int64_t rows = 0;
    int64_t ne0 = 0;
    /// Host-resident sets (upload_host): K uint8 tensors in pinned host memory. `bytes` is then empty except while a
    /// candidate_stream holds the set resident.
    std::vector<torch::Tensor> host;
};

/// Uploads host bytes of K candidates to `device`. Throws voodoo::error naming `name` when a type has no
/// GPU rule, K exceeds max_candidates, ne0 is not a multiple of a type's block, or a size disagrees.
/// (Rows of any length work for F32/F16/BF16, e.g. 172; block types need whole blocks.)
///
/// `source` (optional): the tensor's weights as a contiguous bf16 [rows, ne0] tensor already on `device`
/// (the GPU teacher's own copy). A BF16 candidate whose bytes equal it, and an F16 candidate whose every
/// weight equals fp16 of the bf16 weight (ggml's F16 of a BF16 source), are not stored again: they read the
/// source's bytes (deq::F16_OF_BF16 for the F16 one), so they cost no GPU memory. Equality is checked
/// here, bit for bit, on the GPU; a candidate that differs in any weight is uploaded as usual. The source
/// must outlive the set.
candidate_set upload(const std::vector<std::vector<uint8_t>> & bytes, const std::vector<int> & types, int64_t rows,
                     int64_t ne0, torch::Device device, const std::string & name,
                     const torch::Tensor & source = torch::Tensor());

/// The host-resident form of upload (issue #18: a model whose candidates do not fit the GPU beside its teacher): the
/// same checks, the bytes copied into pinned host memory (`host`), nothing on the GPU until a candidate_stream makes
/// the set resident. No candidate reads the teacher's bytes. Throws voodoo::error as upload does.
candidate_set upload_host(const std::vector<std::vector<uint8_t>> & bytes, const std::vector<int> & types, int64_t rows,
                          int64_t ne0, torch::Device device, const std::string & name);

/// Moves host-resident candidate sets to the GPU ahead of their use, on a copy stream of its own, overlapped with the
/// compute stream's work (the prefetch of layer-wise offloading, as DeepSpeed's ZeRO-Offload and FSDP's CPU offload
/// do for weights).
///
/// The order of use is learned, not declared: a training step uses the gated tensors in the same order every step
/// (the forward layer by layer, then the backward in reverse), so after each use of set b that followed set a, the
/// stream remembers the `lookahead` sets used next, and the next time a follows b it starts copying those at once.
/// The context (a, b) tells a forward use from a backward one. Sets outside the current one and its predicted
/// successors are released (record_stream keeps their memory from reuse until the compute stream is done with it),
/// so at most lookahead + 1 sets are resident. A use the prediction missed copies synchronously with respect to the
/// compute stream (counted in `misses`): correct whatever the order, only slower.
class candidate_stream {
public:
    /// lookahead ≥ 1: the sets copied ahead (a layer's gated tensors hides one layer's copy behind the one before).
    candidate_stream(torch::Device device, int lookahead);
    ~candidate_stream();
    candidate_stream(const candidate_stream &) = delete;
    candidate_stream & operator=(const candidate_stream &) = delete;

    /// Registers a host-resident set (upload_host) on this stream's device (the stream keeps it alive). Returns its id.
    size_t add(std::shared_ptr<candidate_set> c);

    /// Makes set `id` resident for the kernels the caller launches next on the current CUDA stream (which waits for
    /// the copy), prefetches its predicted successors and releases what is not needed. Returns the set. Throws
    /// voodoo::error for an unknown id. Thread-safe (the autograd engine's thread runs the backward's uses).
    candidate_set & use(size_t id);

    struct counters {
        int64_t uses = 0;             // calls of use
        int64_t misses = 0;           // uses that found the set neither resident nor being copied
        int64_t copies = 0;           // sets copied host → GPU
        int64_t bytes_copied = 0;
        int64_t resident_bytes = 0;   // now
        int64_t peak_resident_bytes = 0;
        int64_t host_bytes = 0;       // pinned host bytes of every registered set
    };
    counters stats() const;

private:
    struct state;
    std::unique_ptr<state> s_;
};

/// The device's memory in bytes: {free now, total} (cudaMemGetInfo).
std::pair<int64_t, int64_t> memory_info(torch::Device device);

/// Tests and benchmarks: when off, mixture and gate_grad use the row kernels even where the tiled ones
/// apply (the two give the same W_eff bit for bit; gate gradients differ only in summation order).
void set_tiled_kernels(bool on);

/// Benchmarks: the tiled kernels' variant, compiled for n = 1 to 4 resident blocks per multiprocessor
/// (fewer registers per thread as n grows); anything else restores the default.
void set_tiled_min_blocks(int n);

/// to_float of one candidate on the GPU: [rows, ne0] f32, equal to ggml's bit for bit.
torch::Tensor dequantize(const candidate_set & c, int k);

/// Σ_k p_k · deq(Q_k) over rows `ids` ([n] int64 on the device; undefined = every row, in order):
/// [n, ne0] in `dtype` (kFloat or kBFloat16), accumulated in f32 (fmaf, k ascending), rounded once.
/// p: [K] f32 on the device; candidates with p_k = 0 are skipped (a hard one-hot reads one candidate).
torch::Tensor mixture(const candidate_set & c, const torch::Tensor & p, const torch::Tensor & ids,
                      torch::ScalarType dtype);

/// ⟨G, deq(Q_k)[ids]⟩ for every k in one pass over G ([n, ne0], f32 or bf16, on the device): [K] f64 on the
/// device. Per-thread partial sums in f32 over at most a few thousand products, reduced in f64.
torch::Tensor gate_grad(const candidate_set & c, const torch::Tensor & grad, const torch::Tensor & ids);

/// Device bytes of the candidates (what they cost in GPU memory); shared candidates count nothing.
int64_t resident_bytes(const candidate_set & c);

}  // namespace voodoo::gpu

#endif
