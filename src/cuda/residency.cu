// gpu::candidate_stream: host-resident candidate sets moved to the GPU ahead of use (gpu.h says what and why).
#include "cuda/gpu.h"

#include "common/error.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <utility>

namespace voodoo::gpu {

struct candidate_stream::state {
    torch::Device device;
    int lookahead;
    c10::cuda::CUDAStream copy;
    std::vector<std::shared_ptr<candidate_set>> sets;
    std::vector<std::unique_ptr<at::cuda::CUDAEvent>> ready;  // recorded on `copy` after a set's copy was queued
    std::vector<bool> resident;                               // bytes on the GPU, or being copied there
    std::deque<size_t> history;                               // the last lookahead + 2 uses
    std::map<std::pair<size_t, size_t>, std::vector<size_t>> next;  // (previous, current) → the uses that followed
    static constexpr size_t none = std::numeric_limits<size_t>::max();
    counters c;
    std::mutex mu;

    state(torch::Device d, int l)
        : device(d), lookahead(l), copy(c10::cuda::getStreamFromPool(false, d.index())) {}

    int64_t host_bytes_of(size_t id) const {
        int64_t n = 0;
        for (const torch::Tensor & h : sets[id]->host) {
            n += h.numel();
        }
        return n;
    }

    // Queues the copy of set id on the copy stream. Its buffers are allocated on that stream, so the caching
    // allocator hands out only memory whose recorded uses (record_stream in use) are done.
    void fetch(size_t id) {
        candidate_set & s = *sets[id];
        {
            const c10::cuda::CUDAStreamGuard guard(copy);
            s.bytes.clear();
            for (const torch::Tensor & h : s.host) {
                torch::Tensor d = torch::empty({h.numel()}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
                d.copy_(h, /*non_blocking=*/true);
                s.bytes.push_back(d);
            }
            ready[id]->record(copy);
        }
        resident[id] = true;
        const int64_t n = host_bytes_of(id);
        ++c.copies;
        c.bytes_copied += n;
        c.resident_bytes += n;
        c.peak_resident_bytes = std::max(c.peak_resident_bytes, c.resident_bytes);
    }

    void release(size_t id) {
        sets[id]->bytes.clear();
        resident[id] = false;
        c.resident_bytes -= host_bytes_of(id);
    }
};

candidate_stream::candidate_stream(torch::Device device, int lookahead) {
    if (!device.is_cuda()) {
        fail("candidate_stream: host-resident candidates move to a CUDA device, not {}", device.str());
    }
    const c10::cuda::CUDAGuard guard(device);
    s_ = std::make_unique<state>(torch::Device(torch::kCUDA, c10::cuda::current_device()), std::max(1, lookahead));
}

candidate_stream::~candidate_stream() = default;

size_t candidate_stream::add(std::shared_ptr<candidate_set> c) {
    const std::lock_guard<std::mutex> lock(s_->mu);
    if (c == nullptr || c->host.size() != c->types.size()) {
        fail("candidate_stream: a set without its host bytes (upload_host makes them)");
    }
    s_->sets.push_back(std::move(c));
    s_->ready.push_back(std::make_unique<at::cuda::CUDAEvent>());
    s_->resident.push_back(false);
    s_->c.host_bytes += s_->host_bytes_of(s_->sets.size() - 1);
    return s_->sets.size() - 1;
}

candidate_set & candidate_stream::use(size_t id) {
    state & s = *s_;
    const std::lock_guard<std::mutex> lock(s.mu);
    if (id >= s.sets.size()) {
        fail("candidate_stream: no set {} ({} are registered)", id, s.sets.size());
    }
    const c10::cuda::CUDAGuard guard(s.device);
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(s.device.index());
    ++s.c.uses;
    if (!s.resident[id]) {
        ++s.c.misses;
        s.fetch(id);
    }
    s.ready[id]->block(compute);
    for (const torch::Tensor & b : s.sets[id]->bytes) {
        b.record_stream(compute);
    }

    // Learn: this use follows, d uses later, the use at history[n − 1 − d] (in the context of the one before it).
    s.history.push_back(id);
    const size_t L = static_cast<size_t>(s.lookahead);
    while (s.history.size() > L + 2) {
        s.history.pop_front();
    }
    const size_t n = s.history.size();
    for (size_t d = 1; d <= L && d + 2 <= n; ++d) {
        std::vector<size_t> & follow = s.next[{s.history[n - 2 - d], s.history[n - 1 - d]}];
        follow.resize(L, state::none);
        follow[d - 1] = id;
    }

    // Keep this set and what followed this context last time; release the rest first (so at most lookahead + 1 sets
    // are ever resident), then start copying the successors not yet resident.
    std::vector<size_t> ahead;
    if (n >= 2) {
        const auto it = s.next.find({s.history[n - 2], id});
        if (it != s.next.end()) {
            for (const size_t x : it->second) {
                if (x != state::none) {
                    ahead.push_back(x);
                }
            }
        }
    }
    for (size_t x = 0; x < s.sets.size(); ++x) {
        if (s.resident[x] && x != id && std::find(ahead.begin(), ahead.end(), x) == ahead.end()) {
            s.release(x);
        }
    }
    for (const size_t x : ahead) {
        if (!s.resident[x]) {
            s.fetch(x);
        }
    }
    return *s.sets[id];
}

candidate_stream::counters candidate_stream::stats() const {
    const std::lock_guard<std::mutex> lock(s_->mu);
    return s_->c;
}

std::pair<int64_t, int64_t> memory_info(torch::Device device) {
    const c10::cuda::CUDAGuard guard(device);
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
        fail("cudaMemGetInfo failed on {}", device.str());
    }
    return {static_cast<int64_t>(free), static_cast<int64_t>(total)};
}

}  // namespace voodoo::gpu
