// Candidates: the exact bytes of every (tensor, type) pair of the menus, made by ggml_quantize_chunk
// as llama-quantize makes them (exactness contract, items 1 and 3), kept in a content-addressed cache.
#pragma once

#include "ggml/gguf.h"
#include "imatrix/imatrix.h"

#include <ggml.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace voodoo {


/// The tensor's weights as f32 (F32 copied; F16, BF16 and quantized types through ggml's to_float,
/// as llama-quantize's llama_tensor_dequantize_impl does). [n_rows, ne0] row-major.
std::vector<float> tensor_to_f32(const gguf_file & file, const gguf_tensor & t, int n_threads = 0);

/// The importance of tensor t in `importance`, or empty when none is given or the map has no entry.
/// Throws voodoo::error naming the tensor when the entry's length is not ne0 · ne2 (an imatrix made for
/// another model), as llama-quantize does.
std::span<const float> importance_for(const importance_map * importance, const gguf_tensor & t);

/// The exact bytes tensor t takes as `type`: the source bytes when type is the source type (llama-quantize
/// copies them), else ggml_quantize_chunk of its f32 weights with the tensor's importance, expert by expert
/// for 3-D tensors. `f32` may pass tensor_to_f32(file, t) when the caller already has it.
/// Throws voodoo::error naming the tensor when the type does not fit ne0 or needs an importance matrix.
std::vector<uint8_t> quantize_tensor(const gguf_file & file, const gguf_tensor & t, ggml_type type,
                                     std::span<const float> importance, std::span<const float> f32 = {},
                                     int n_threads = 0);

/// A content-addressed store of candidate bytes on disk: one file per key, where the key is the
/// xxh3-128 hash of (source tensor bytes, source type, shape, target type, the tensor's importance
/// values, llama.cpp commit). A changed model, imatrix or llama.cpp never reads a stale entry.
/// An entry is the bytes followed by their xxh3-64 (8 bytes, little-endian), so a damaged entry is rebuilt
/// rather than trained on or exported.
class candidate_cache {
public:
    /// Creates the folder when missing. Throws voodoo::error when it cannot.
    explicit candidate_cache(std::string dir);

    /// The hex key of one candidate.
    static std::string key(const gguf_file & file, const gguf_tensor & t, ggml_type type,
                           std::span<const float> importance);

    /// The cached bytes, or nullopt. An entry of the wrong size or whose checksum does not match its bytes (a
    /// damaged disk, a cache of an older Voodoo without checksums) is ignored, and rebuilt by the caller.
    std::optional<std::vector<uint8_t>> load(const std::string & key, size_t expected_bytes) const;
    /// True when the cache in `dir` holds an entry for `key` of `expected_bytes` (its size checked, not its
    /// checksum): what a dry run counts as built. Reads nothing else and makes no folder.
    static bool holds(const std::string & dir, const std::string & key, size_t expected_bytes);
    /// Stores bytes atomically and returns true; returns false without writing when keep_free() is above 0 and the
    /// entry would leave less than that free on the cache's disk (statvfs, less the entries other threads are writing).
    bool store(const std::string & key, std::span<const uint8_t> bytes) const;
    /// Bytes the cache leaves free on its disk (issue #16: an 8B model's kept candidates can outgrow the disk, and the
    /// job holds every candidate's bytes in memory anyway): 0, the default, stores every entry and a full disk is an
    /// error; above 0, entries that would leave less are not stored (store returns false) and the job builds them in
    /// memory only, so a later run builds them again.
    void set_keep_free(int64_t bytes) { keep_free_ = bytes; }
    int64_t keep_free() const { return keep_free_; }
    /// The entries store() did not write (keep_free) so far, and their bytes.
    int64_t not_stored() const { return not_stored_; }
    int64_t not_stored_bytes() const { return not_stored_bytes_; }
    /// Removes the entry of `key` and returns the bytes it took on disk (0 when there was none).
    int64_t remove(const std::string & key) const;

    const std::string & dir() const { return dir_; }

private:
    std::string path_of(const std::string & key) const;
    std::string dir_;
    int64_t keep_free_ = 0;
    mutable std::atomic<int64_t> not_stored_{0}, not_stored_bytes_{0};
};

/// quantize_tensor through the cache: load when present, else quantize and store. cache may be null.
std::vector<uint8_t> candidate_bytes(const gguf_file & file, const gguf_tensor & t, ggml_type type,
                                     std::span<const float> importance, const candidate_cache * cache,
                                     std::span<const float> f32 = {}, int n_threads = 0);

/// For each of `jobs` ((tensor, type) pairs), whether the cache in `dir` holds its candidate (candidate_cache::holds on
/// its key); false for a pair of the tensor's source type (its bytes are copied, never cached). The keys hash each
/// source tensor once per type, on `n_threads` (0 = every core). Throws voodoo::error as importance_for does.
std::vector<bool> candidates_held(const gguf_file & file, const std::vector<std::pair<const gguf_tensor *, ggml_type>> & jobs,
                                  const importance_map * importance, const std::string & dir, int n_threads);

/// The bytes building `jobs` ((tensor, type) pairs) would add to the cache in `dir`: each pair that is not the
/// tensor's source type (its bytes are copied, never cached) and not already held there (candidate_cache::holds), at
/// its exact size plus the entry's 8-byte checksum. The keys hash each source tensor once per type, on `n_threads`
/// (0 = every core). Throws voodoo::error as importance_for does.
int64_t candidate_bytes_to_build(const gguf_file & file, const std::vector<std::pair<const gguf_tensor *, ggml_type>> & jobs,
                                 const importance_map * importance, const std::string & dir, int n_threads = 0);

/// Room a job keeps free on the cache's disk beyond what it will write (journals, the probe and recipe files, the
/// file system's own needs): 256 MiB.
inline constexpr int64_t k_disk_reserve_bytes = int64_t{256} << 20;

/// Checks before writing `need` bytes into `dir` (created or not yet): throws voodoo::error when need +
/// k_disk_reserve_bytes exceeds free_disk_bytes(dir), naming the folder, what would be written (`what`), both sizes
/// and what would fit (`would_fit`). Does nothing when the free space cannot be read.
void check_disk_room(const std::string & dir, int64_t need, const std::string & what, const std::string & would_fit);

/// Builds candidates into a cache on a thread of its own while the caller does other work (issue #16: the GPU's
/// eager probe leaves the CPU idle, and the candidates kept after it are the longest stage). Up to 4 workers (one per
/// 4 of `n_threads`) take the jobs in order, each job one whole candidate quantized on its worker's share of the
/// threads (rows split, as quantize_into splits them), so that the jobs' serial parts (the source's conversion, the
/// key's hash, the entry's write and fsync) overlap and stop() waits for at most one job per worker. built() counts
/// the jobs done from the first on without a gap. The bytes go to the cache and are dropped; a later candidate_bytes of the same
/// (tensor, type, importance) loads them, so what is built ahead is exactly what would have been built after.
/// A job that throws ends the prefetch quietly: the later build meets the same error and reports it. So does a job
/// that would leave the cache's disk with less than k_disk_reserve_bytes free: what is built ahead is a guess, and
/// the build after the probe checks the room for what is kept and builds what does not fit in memory only.
class candidate_prefetch {
public:
    struct job {
        const gguf_tensor * tensor;
        ggml_type type;
    };
    /// Starts building `jobs` in order. `file`, `importance` and `cache` must outlive the prefetch. `then`
    /// (optional): once every job is built, called on the prefetch's thread, and the jobs it returns are built next
    /// (work whose list is not known yet when the first jobs start: the guesses of what the probe will keep, made once
    /// the lattice types' errors exist); not called after stop() or a job that ended the prefetch, nor when it throws
    /// (the prefetch then ends quietly: the caller meets the same error).
    candidate_prefetch(const gguf_file & file, std::vector<job> jobs, const importance_map * importance,
                       const candidate_cache & cache, int n_threads, std::function<std::vector<job>()> then = {});
    /// Stops after the job in progress (stop()).
    ~candidate_prefetch();
    candidate_prefetch(const candidate_prefetch &) = delete;
    candidate_prefetch & operator=(const candidate_prefetch &) = delete;

    /// Stops taking jobs, waits for those in progress, returns how many jobs were built (or found in the cache).
    int64_t stop();
    /// Waits until every job is built (or the prefetch ended on an error); returns how many were built.
    int64_t wait();
    /// wait(), asking `stop` every 100 ms (Ctrl-C): once it is true, stop() and false; true when every job ran.
    bool wait(const std::function<bool()> & stop);
    /// Waits until the first `n` jobs are built or the prefetch has ended (its jobs done, stop(), or a job that threw
    /// or would fill the disk: the caller then builds what is missing itself), asking `stop` every 5 ms (Ctrl-C);
    /// false when `stop` said true (the prefetch goes on until stop() or its destructor), else true. What lets the
    /// probe measure each tensor's candidates as soon as they exist (trainer.cpp, issue #16).
    bool wait_for(int64_t n, const std::function<bool()> & stop = {});
    /// How many jobs were built (or found in the cache) so far.
    int64_t built() const { return built_; }
    /// Bytes of the candidates built so far.
    size_t bytes() const { return bytes_; }

private:
    void run();
    void work(int threads);
    const gguf_file & file_;
    std::vector<job> jobs_;
    std::function<std::vector<job>()> then_;
    const importance_map * importance_;
    const candidate_cache & cache_;
    int n_threads_;
    std::atomic<bool> stop_{false};
    std::atomic<bool> finished_{false};
    std::atomic<bool> ended_{false};    // a job threw or would have filled the disk: no more are taken
    std::atomic<int64_t> built_{0};     // the jobs 0 … built_ − 1 are all built
    std::atomic<size_t> bytes_{0};
    std::mutex take_mutex_;             // next_, jobs_ (then_'s jobs are appended), then_
    size_t next_ = 0;
    std::mutex done_mutex_;
    std::vector<bool> done_;
    std::thread thread_;
};

}  // namespace voodoo
