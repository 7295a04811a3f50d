#include "train/candidates.h"

#include "common/error.h"
#include "common/file.h"
#include "common/units.h"
#include "ggml/quant.h"
#include "ggml/types.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <filesystem>
#include <mutex>
#include <thread>
#include <utility>
#include <cstring>
#include <fstream>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <unistd.h>

#ifndef VOODOO_LLAMA_COMMIT
#define VOODOO_LLAMA_COMMIT "unknown"
#endif

namespace voodoo {

std::vector<float> tensor_to_f32(const gguf_file & file, const gguf_tensor & t, int n_threads) {
    return dequantize(t.type, file.data(t), t.ne[0], n_threads, t.name);
}

std::span<const float> importance_for(const importance_map * importance, const gguf_tensor & t) {
    if (!importance) {
        return {};
    }
    const auto it = importance->find(t.name);
    if (it == importance->end()) {
        return {};
    }
    const size_t want = static_cast<size_t>(t.ne[0] * t.ne[2]);
    if (it->second.size() != want) {
        fail("imatrix entry for tensor '{}' has {} values, the tensor {} needs {}: the imatrix was made for another model",
             t.name, it->second.size(), shape_str(t.shape()), want);
    }
    return it->second;
}

std::vector<uint8_t> quantize_tensor(const gguf_file & file, const gguf_tensor & t, ggml_type type,
                                     std::span<const float> importance, std::span<const float> f32, int n_threads) {
    if (type == t.type) {
        const auto src = file.data(t);
        return {src.begin(), src.end()};
    }
    const size_t n_bytes = tensor_bytes(type, t.shape(), t.name);
    std::vector<float> own;
    if (f32.empty()) {
        own = tensor_to_f32(file, t, n_threads);
        f32 = own;
    }
    std::vector<uint8_t> out(n_bytes);
    // Experts (ne2 > 1) are quantized one by one, each with its own slice of the importance,
    // as llama_tensor_quantize_impl does.
    const int64_t n_experts = t.ne[2] * t.ne[3];
    const size_t weights_per_expert = static_cast<size_t>(t.ne[0] * t.ne[1]);
    const size_t bytes_per_expert = n_bytes / static_cast<size_t>(n_experts);
    for (int64_t e = 0; e < n_experts; ++e) {
        std::span<const float> im;
        if (!importance.empty()) {
            im = importance.subspan(static_cast<size_t>((e % t.ne[2]) * t.ne[0]), static_cast<size_t>(t.ne[0]));
        }
        quantize_into(type, f32.subspan(e * weights_per_expert, weights_per_expert), t.ne[0],
                      std::span<uint8_t>(out).subspan(e * bytes_per_expert, bytes_per_expert), im, n_threads, t.name);
    }
    return out;
}

candidate_cache::candidate_cache(std::string dir) : dir_(std::move(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec || !std::filesystem::is_directory(dir_)) {
        fail("cannot create the candidate cache folder '{}': {}", dir_, ec ? ec.message() : "not a folder");
    }
}

std::string candidate_cache::key(const gguf_file & file, const gguf_tensor & t, ggml_type type,
                                 std::span<const float> importance) {
    XXH3_state_t * state = XXH3_createState();
    XXH3_128bits_reset(state);
    const auto data = file.data(t);
    XXH3_128bits_update(state, data.data(), data.size());
    const int32_t types[2] = {static_cast<int32_t>(t.type), static_cast<int32_t>(type)};
    XXH3_128bits_update(state, types, sizeof types);
    XXH3_128bits_update(state, t.ne.data(), sizeof(int64_t) * t.ne.size());
    const uint64_t n_importance = importance.size();
    XXH3_128bits_update(state, &n_importance, sizeof n_importance);
    XXH3_128bits_update(state, importance.data(), importance.size_bytes());
    const char * commit = VOODOO_LLAMA_COMMIT;
    XXH3_128bits_update(state, commit, std::strlen(commit));
    const XXH128_hash_t h = XXH3_128bits_digest(state);
    XXH3_freeState(state);
    return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

std::string candidate_cache::path_of(const std::string & key) const {
    return (std::filesystem::path(dir_) / key.substr(0, 2) / (key + ".bin")).string();
}

bool candidate_cache::holds(const std::string & dir, const std::string & key, size_t expected_bytes) {
    std::error_code ec;
    const auto path = std::filesystem::path(dir) / key.substr(0, 2) / (key + ".bin");
    return std::filesystem::file_size(path, ec) == expected_bytes + sizeof(uint64_t) && !ec;
}

std::optional<std::vector<uint8_t>> candidate_cache::load(const std::string & key, size_t expected_bytes) const {
    const std::string path = path_of(key);
    std::error_code ec;
    if (std::filesystem::file_size(path, ec) != expected_bytes + sizeof(uint64_t) || ec) {
        return std::nullopt;
    }
    std::ifstream in(path, std::ios::binary);
    std::vector<uint8_t> bytes(expected_bytes);
    uint64_t sum = 0;
    if (!in.read(reinterpret_cast<char *>(bytes.data()), static_cast<std::streamsize>(expected_bytes)) ||
        !in.read(reinterpret_cast<char *>(&sum), sizeof sum) || sum != XXH3_64bits(bytes.data(), bytes.size())) {
        return std::nullopt;
    }
    return bytes;
}

namespace {

// The bytes of the entries being written now, by every cache of this process: what statvfs does not count yet.
std::mutex & writing_mutex() {
    static std::mutex m;
    return m;
}
int64_t writing_bytes = 0;

}  // namespace

bool candidate_cache::store(const std::string & key, std::span<const uint8_t> bytes) const {
    const int64_t need = static_cast<int64_t>(bytes.size() + sizeof(uint64_t));
    if (keep_free_ > 0) {
        std::lock_guard<std::mutex> lock(writing_mutex());
        const int64_t free = free_disk_bytes(dir_);
        if (free >= 0 && free - writing_bytes - need < keep_free_) {
            ++not_stored_;
            not_stored_bytes_ += need;
            return false;
        }
        writing_bytes += need;
    }
    struct done_writing {
        int64_t n;
        ~done_writing() {
            if (n > 0) {
                std::lock_guard<std::mutex> lock(writing_mutex());
                writing_bytes -= n;
            }
        }
    } const written{keep_free_ > 0 ? need : 0};
    const std::string path = path_of(key);
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    const uint64_t sum = XXH3_64bits(bytes.data(), bytes.size());
    atomic_file out(path);
    out.expect(bytes.size() + sizeof sum);
    out.write(bytes.data(), bytes.size());
    out.write(&sum, sizeof sum);
    out.commit();
    return true;
}

int64_t candidate_cache::remove(const std::string & key) const {
    const std::string path = path_of(key);
    const int64_t bytes = tree_disk_bytes(path);
    return ::unlink(path.c_str()) == 0 ? bytes : 0;
}

std::vector<uint8_t> candidate_bytes(const gguf_file & file, const gguf_tensor & t, ggml_type type,
                                     std::span<const float> importance, const candidate_cache * cache,
                                     std::span<const float> f32, int n_threads) {
    if (!cache || type == t.type) {
        return quantize_tensor(file, t, type, importance, f32, n_threads);
    }
    const std::string k = candidate_cache::key(file, t, type, importance);
    if (auto hit = cache->load(k, tensor_bytes(type, t.shape(), t.name))) {
        return std::move(*hit);
    }
    auto bytes = quantize_tensor(file, t, type, importance, f32, n_threads);
    cache->store(k, bytes);
    return bytes;
}

candidate_prefetch::candidate_prefetch(const gguf_file & file, std::vector<job> jobs, const importance_map * importance,
                                       const candidate_cache & cache, int n_threads, std::function<std::vector<job>()> then)
    : file_(file), jobs_(std::move(jobs)), then_(std::move(then)), importance_(importance), cache_(cache),
      n_threads_(n_threads) {
    thread_ = std::thread([this] {
        run();
        finished_ = true;
    });
}

candidate_prefetch::~candidate_prefetch() { stop(); }

std::vector<bool> candidates_held(const gguf_file & file, const std::vector<std::pair<const gguf_tensor *, ggml_type>> & jobs,
                                  const importance_map * importance, const std::string & dir, int n_threads) {
    std::vector<char> held(jobs.size(), 0);  // char, not bool: each thread writes its own element
    std::atomic<size_t> next{0};
    std::exception_ptr failure;
    std::mutex failure_mutex;
    auto work = [&] {
        for (size_t j; (j = next++) < jobs.size();) {
            const auto [t, type] = jobs[j];
            if (type == t->type) {
                continue;
            }
            try {
                held[j] = candidate_cache::holds(dir, candidate_cache::key(file, *t, type, importance_for(importance, *t)),
                                                 tensor_bytes(type, t->shape(), t->name));
            } catch (...) {
                std::lock_guard<std::mutex> lock(failure_mutex);
                failure = std::current_exception();
                next = jobs.size();
            }
        }
    };
    const int threads = std::max(1, std::min<int>(resolve_threads(n_threads),
                                                   static_cast<int>(jobs.size())));
    std::vector<std::thread> pool;
    for (int i = 1; i < threads; ++i) {
        pool.emplace_back(work);
    }
    work();
    for (auto & th : pool) {
        th.join();
    }
    if (failure) {
        std::rethrow_exception(failure);
    }
    return {held.begin(), held.end()};
}

int64_t candidate_bytes_to_build(const gguf_file & file, const std::vector<std::pair<const gguf_tensor *, ggml_type>> & jobs,
                                 const importance_map * importance, const std::string & dir, int n_threads) {
    const std::vector<bool> held = candidates_held(file, jobs, importance, dir, n_threads);
    int64_t need = 0;
    for (size_t j = 0; j < jobs.size(); ++j) {
        const auto [t, type] = jobs[j];
        if (type != t->type && !held[j]) {
            need += static_cast<int64_t>(tensor_bytes(type, t->shape(), t->name) + sizeof(uint64_t));
        }
    }
    return need;
}

void check_disk_room(const std::string & dir, int64_t need, const std::string & what, const std::string & would_fit) {
    const int64_t free = free_disk_bytes(dir);
    if (free < 0 || need + k_disk_reserve_bytes <= free) {
        return;
    }
    // Below the reserve nothing built here can help: only more room can.
    fail("not enough disk for {} in '{}': {} to write, {} free there, of which {} is kept free; {}", what, dir,
         bytes_text(static_cast<double>(need)), bytes_text(static_cast<double>(free)),
         bytes_text(static_cast<double>(k_disk_reserve_bytes)),
         free <= k_disk_reserve_bytes
             ? fmt::format("a work folder (quantize --work; train --cache) on a disk with at least {} free would fit",
                           bytes_text(static_cast<double>(need + k_disk_reserve_bytes)))
             : would_fit);
}

void candidate_prefetch::run() {
    // A few workers, each building whole jobs on its share of the threads: one chain of jobs each on every thread left
    // the threads idle through every job's serial parts (the source's f32 and its key's hash, the entry's write and
    // fsync), while jobs side by side overlap them; the jobs still start in order, so the first ones are done first.
    // With 8 threads or more one worker more than the shares: three workers of five threads left 16.7% of an H100
    // host's 16 cores idle through the probe phases (session 35's vmstat), each worker's serial parts; the extra
    // worker's threads take those cores, and parallel_rows' slices keep the oversubscribed threads' work even.
    const int shares = std::clamp(n_threads_ / 4, 1, 4);
    const int workers = shares + (n_threads_ >= 8 ? 1 : 0);
    std::vector<std::thread> pool;
    for (int w = 0; w < workers; ++w) {
        const int share = w % shares;
        pool.emplace_back([this, share, shares] { work(n_threads_ / shares + (share < n_threads_ % shares ? 1 : 0)); });
    }
    for (std::thread & t : pool) {
        t.join();
    }
}

void candidate_prefetch::work(int threads) {
    for (;;) {
        job j;
        size_t n = 0;
        {
            std::lock_guard<std::mutex> lock(take_mutex_);
            if (stop_ || ended_) {
                return;
            }
            if (next_ == jobs_.size()) {
                if (!then_) {
                    return;
                }
                try {
                    std::vector<job> more = std::exchange(then_, nullptr)();
                    jobs_.insert(jobs_.end(), more.begin(), more.end());
                } catch (...) {
                    ended_ = true;
                    return;
                }
                if (next_ == jobs_.size() || stop_) {
                    return;
                }
            }
            n = next_++;
            j = jobs_[n];
        }
        try {
            const int64_t free = free_disk_bytes(cache_.dir());
            if (free >= 0 && static_cast<int64_t>(tensor_bytes(j.type, j.tensor->shape(), j.tensor->name)) + k_disk_reserve_bytes > free) {
                ended_ = true;  // a guess never fills the disk: the build after the probe says what would fit
                return;
            }
            const auto bytes = candidate_bytes(file_, *j.tensor, j.type, importance_for(importance_, *j.tensor), &cache_, {},
                                               threads);
            std::lock_guard<std::mutex> lock(done_mutex_);
            if (done_.size() <= n) {
                done_.resize(n + 1, false);
            }
            done_[n] = true;
            int64_t prefix = built_;
            while (prefix < static_cast<int64_t>(done_.size()) && done_[static_cast<size_t>(prefix)]) {
                ++prefix;
            }
            built_ = prefix;
            bytes_ += bytes.size();
        } catch (...) {
            ended_ = true;
            return;
        }
    }
}

int64_t candidate_prefetch::stop() {
    stop_ = true;
    return wait();
}

int64_t candidate_prefetch::wait() {
    if (thread_.joinable()) {
        thread_.join();
    }
    return built_;
}

bool candidate_prefetch::wait_for(int64_t n, const std::function<bool()> & stop) {
    while (built_ < n && !finished_) {
        if (stop && stop()) {
            return false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
}

bool candidate_prefetch::wait(const std::function<bool()> & stop) {
    while (!finished_) {
        if (stop && stop()) {
            this->stop();
            return false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    wait();
    return true;
}

}  // namespace voodoo
