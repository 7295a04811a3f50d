#include "dist/dist.h"

#include "common/error.h"
#include "ggml/types.h"

#include <fmt/format.h>

#if defined(VOODOO_HAVE_GLOO)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if defined(VOODOO_HAVE_NCCL)
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL  // ProcessGroupNCCL.hpp declares its class only under it; LibTorch was built with it (CMake checks)
#endif
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#if defined(VOODOO_HAVE_GLOO) || defined(VOODOO_HAVE_NCCL)
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <map>

namespace voodoo::dist {

namespace {

std::optional<std::string> env_string(const char * name) {
    const char * v = std::getenv(name);
    return v != nullptr && *v != '\0' ? std::optional<std::string>(v) : std::nullopt;
}

int env_int(const char * name, int fallback, bool required) {
    const std::optional<std::string> v = env_string(name);
    if (!v) {
        if (required) {
            fail("{} is not set: torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT together (or set them by "
                 "hand, one process per rank)", name);
        }
        return fallback;
    }
    try {
        size_t used = 0;
        const int x = std::stoi(*v, &used);
        if (used == v->size()) {
            return x;
        }
    } catch (const std::exception &) {
    }
    fail("{}='{}' is not an integer", name, *v);
}

}  // namespace

std::optional<launch_env> launch_env_from_environment() {
    if (!env_string("WORLD_SIZE")) {
        return std::nullopt;
    }
    launch_env e;
    e.world_size = env_int("WORLD_SIZE", 1, true);
    if (e.world_size < 1) {
        fail("WORLD_SIZE={}: at least 1 process is needed", e.world_size);
    }
    e.rank = env_int("RANK", 0, true);
    if (e.rank < 0 || e.rank >= e.world_size) {
        fail("RANK={} is outside [0, WORLD_SIZE={})", e.rank, e.world_size);
    }
    e.local_rank = env_int("LOCAL_RANK", e.rank, false);
    e.master_addr = env_string("MASTER_ADDR").value_or("127.0.0.1");
    e.master_port = env_int("MASTER_PORT", 29500, e.world_size > 1);
    if (e.master_port < 1 || e.master_port > 65535) {
        fail("MASTER_PORT={} is not a TCP port (1 to 65535)", e.master_port);
    }
    return e;
}

int free_tcp_port() {
    const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    const bool ok = s >= 0 && ::bind(s, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0 &&
                    ::getsockname(s, reinterpret_cast<sockaddr *>(&a), &len) == 0;
    const int err = errno;
    if (s >= 0) {
        ::close(s);
    }
    if (!ok) {
        fail("cannot find a free TCP port on 127.0.0.1 for MASTER_PORT: {}; set MASTER_PORT and start the ranks with "
             "torchrun instead", std::strerror(err));
    }
    return ntohs(a.sin_port);
}

bool have_gloo() {
#if defined(VOODOO_HAVE_GLOO)
    return true;
#else
    return false;
#endif
}

bool have_nccl() {
#if defined(VOODOO_HAVE_NCCL)
    return true;
#else
    return false;
#endif
}

#if defined(VOODOO_HAVE_GLOO) || defined(VOODOO_HAVE_NCCL)

struct process_group::impl {
#if defined(VOODOO_HAVE_GLOO)
    c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
#endif
#if defined(VOODOO_HAVE_NCCL)
    c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
#endif
    torch::Device wire = torch::kCPU;  // where the backend's tensors live: the host (Gloo) or the group's GPU (NCCL)

    /// f(backend) on whichever backend this group has; both take c10d's same vectors and options.
    template <class F>
    void with(F && f) {
#if defined(VOODOO_HAVE_NCCL)
        if (nccl) {
            f(nccl);
            return;
        }
#endif
#if defined(VOODOO_HAVE_GLOO)
        if (gloo) {
            f(gloo);
            return;
        }
#endif
        (void)f;
        fail("process_group: no backend");  // unreachable: the constructor throws first
    }

    /// What a collective sends of `t`: on the wire's device, f32 for 16-bit floats (summed or compared in f32,
    /// rounded once after), contiguous. `t` itself when it already is that.
    torch::Tensor on_the_wire(const torch::Tensor & t) const {
        const bool narrow = t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
        return t.to(wire, narrow ? torch::kFloat : t.scalar_type()).contiguous();
    }
};

process_group::process_group(const launch_env & env, std::chrono::seconds timeout, torch::Device device)
    : p_(std::make_unique<impl>()), rank_(env.rank), size_(env.world_size) {
    const bool nccl = device.is_cuda() && have_nccl();
    if (!nccl && !have_gloo()) {  // an NCCL-only build (PyTorch's wheels ship no gloo headers) and a CPU rank
        fail("rank {} of {}: this build's only c10d process group is NCCL, which needs a CUDA device, not {}: train "
             "with --device cuda, or build against a LibTorch with gloo's headers (Debian: libgloo-dev)", env.rank,
             env.world_size, device.str());
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
    // A rank that is never started leaves the others waiting here: say so, and for how long.
    fmt::print(stderr, "rank {} of {}: joining the process group at {}:{} (waiting up to {} s for all {} ranks)\n", env.rank,
               env.world_size, env.master_addr, env.master_port, timeout.count(), env.world_size);
    try {
        c10d::TCPStoreOptions so;
        so.port = static_cast<std::uint16_t>(env.master_port);
        so.isServer = env.rank == 0;
        so.numWorkers = static_cast<std::size_t>(env.world_size);
        so.waitWorkers = true;
        so.timeout = ms;
        auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
#if defined(VOODOO_HAVE_NCCL)
        if (nccl) {
            // One GPU a rank: this rank's device is the current one for NCCL's communicator and streams.
            p_->wire = device.has_index() ? device : torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
            c10::cuda::set_device(p_->wire.index());
            auto opts = c10d::ProcessGroupNCCL::Options::create();
            opts->timeout = ms;
            p_->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, env.rank, env.world_size, opts);
            return;
        }
#endif
#if defined(VOODOO_HAVE_GLOO)
        auto opts = c10d::ProcessGroupGloo::Options::create(ms);
        // The transport's interface: GLOO_SOCKET_IFNAME when set (as PyTorch reads it), the loopback when the master
        // is this host's loopback (one host), else the interface this host's name resolves to (several hosts).
        const std::optional<std::string> ifname = env_string("GLOO_SOCKET_IFNAME");
        const bool loopback = env.master_addr == "localhost" || env.master_addr.starts_with("127.");
        opts->devices.push_back(ifname     ? c10d::ProcessGroupGloo::createDeviceForInterface(*ifname)
                                : loopback ? c10d::ProcessGroupGloo::createDeviceForHostname(env.master_addr)
                                           : c10d::ProcessGroupGloo::createDefaultDevice());
        p_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, opts);
#endif
    } catch (const std::exception & e) {
        fail("rank {} of {}: the c10d rendezvous ({}) at MASTER_ADDR={} MASTER_PORT={} failed: {}", env.rank,
             env.world_size, nccl ? "nccl" : "gloo", env.master_addr, env.master_port, e.what());
    }
}

const char * process_group::backend() const {
#if defined(VOODOO_HAVE_NCCL)
    if (p_->nccl) {
        return "nccl";
    }
#endif
    return "gloo";
}

void process_group::send(const torch::Tensor & t, int dst, int tag) {
    std::vector<torch::Tensor> v{t.to(p_->wire).contiguous()};
    p_->with([&](auto & pg) { pg->send(v, dst, tag)->wait(); });
}

void process_group::recv(torch::Tensor & t, int src, int tag) {
    const bool direct = t.device() == p_->wire && t.is_contiguous();
    std::vector<torch::Tensor> v{direct ? t : torch::empty(t.sizes(), t.options().device(p_->wire))};
    p_->with([&](auto & pg) { pg->recv(v, src, tag)->wait(); });
    if (!v[0].is_same(t)) {
        t.copy_(v[0]);
    }
}

void process_group::all_reduce_sum(std::vector<torch::Tensor> & tensors) {
    if (tensors.empty()) {
        return;
    }
    // c10d's allreduce takes one tensor per device of this process (it would sum the list's tensors together), so
    // the tensors travel as one flat buffer per dtype.
    std::map<torch::ScalarType, std::vector<size_t>> by_dtype;
    for (size_t i = 0; i < tensors.size(); ++i) {
        by_dtype[tensors[i].scalar_type()].push_back(i);
    }
    for (const auto & [dtype, which] : by_dtype) {
        std::vector<torch::Tensor> parts;
        for (const size_t i : which) {
            parts.push_back(tensors[i].reshape({-1}).to(p_->wire));
        }
        std::vector<torch::Tensor> flat{p_->on_the_wire(torch::cat(parts))};
        p_->with([&](auto & pg) { pg->allreduce(flat)->wait(); });
        int64_t at = 0;
        for (const size_t i : which) {
            const int64_t n = tensors[i].numel();
            tensors[i].copy_(flat[0].narrow(0, at, n).view_as(tensors[i]));
            at += n;
        }
    }
}

void process_group::all_reduce_max(torch::Tensor & t) {
    std::vector<torch::Tensor> v{p_->on_the_wire(t)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    p_->with([&](auto & pg) { pg->allreduce(v, opts)->wait(); });
    if (!v[0].is_same(t)) {
        t.copy_(v[0]);
    }
}

void process_group::barrier() {
    c10d::BarrierOptions opts;
    if (p_->wire.is_cuda()) {
        opts.device_ids = {static_cast<int64_t>(p_->wire.index())};
    }
    p_->with([&](auto & pg) { pg->barrier(opts)->wait(); });
}

#else

struct process_group::impl {};

process_group::process_group(const launch_env & env, std::chrono::seconds, torch::Device device)
    : rank_(env.rank), size_(env.world_size) {
    fail("rank {} of {}: this build has no c10d process group for {} (install libgloo-dev, which scripts/bootstrap.sh "
         "does, and configure again{})", env.rank, env.world_size, device.str(),
         device.is_cuda() ? "; or build against a LibTorch with NCCL, e.g. PyTorch's CUDA wheel" : "");
}
const char * process_group::backend() const { return "none"; }
void process_group::send(const torch::Tensor &, int, int) {}
void process_group::recv(torch::Tensor &, int, int) {}
void process_group::all_reduce_sum(std::vector<torch::Tensor> &) {}
void process_group::all_reduce_max(torch::Tensor &) {}
void process_group::barrier() {}

#endif

process_group::~process_group() = default;

std::vector<std::pair<int64_t, int64_t>> balance_layers(const std::vector<int64_t> & layer_bytes, int ranks,
                                                        int64_t extra_first, int64_t extra_last) {
    const int64_t L = static_cast<int64_t>(layer_bytes.size());
    if (ranks < 1 || L < ranks) {
        fail("{} layers cannot be split over {} ranks: every rank needs at least one layer", L, ranks);
    }
    std::vector<int64_t> prefix(static_cast<size_t>(L + 1), 0);
    for (int64_t i = 0; i < L; ++i) {
        prefix[static_cast<size_t>(i + 1)] = prefix[static_cast<size_t>(i)] + layer_bytes[static_cast<size_t>(i)];
    }
    // best[r][j]: the least possible largest load when ranks 0..r-1 hold layers [0, j); cut[r][j] where rank r-1 starts.
    const int64_t inf = std::numeric_limits<int64_t>::max();
    std::vector<std::vector<int64_t>> best(static_cast<size_t>(ranks + 1), std::vector<int64_t>(static_cast<size_t>(L + 1), inf));
    std::vector<std::vector<int64_t>> cut(static_cast<size_t>(ranks + 1), std::vector<int64_t>(static_cast<size_t>(L + 1), 0));
    best[0][0] = 0;
    for (int r = 1; r <= ranks; ++r) {
        for (int64_t j = r; j <= L - (ranks - r); ++j) {
            for (int64_t i = r - 1; i < j; ++i) {
                const int64_t prev = best[static_cast<size_t>(r - 1)][static_cast<size_t>(i)];
                if (prev == inf) {
                    continue;
                }
                int64_t load = prefix[static_cast<size_t>(j)] - prefix[static_cast<size_t>(i)];
                load += (r == 1 ? extra_first : 0) + (r == ranks ? extra_last : 0);
                const int64_t worst = std::max(prev, load);
                if (worst < best[static_cast<size_t>(r)][static_cast<size_t>(j)]) {
                    best[static_cast<size_t>(r)][static_cast<size_t>(j)] = worst;
                    cut[static_cast<size_t>(r)][static_cast<size_t>(j)] = i;
                }
            }
        }
    }
    std::vector<std::pair<int64_t, int64_t>> out(static_cast<size_t>(ranks));
    for (int64_t r = ranks, j = L; r >= 1; --r) {
        const int64_t i = cut[static_cast<size_t>(r)][static_cast<size_t>(j)];
        out[static_cast<size_t>(r - 1)] = {i, j};
        j = i;
    }
    return out;
}

std::vector<std::pair<int64_t, int64_t>> balance_layers_of(const gguf_file & file, int ranks) {
    std::vector<int64_t> layer_bytes;
    int64_t first_extra = 0, last_extra = 0;
    for (const gguf_tensor & t : file.tensors()) {
        if (t.name.starts_with("blk.")) {
            const size_t il = static_cast<size_t>(std::stoll(t.name.substr(4)));
            layer_bytes.resize(std::max(layer_bytes.size(), il + 1), 0);
            layer_bytes[il] += t.n_elements();
        } else if (t.name.starts_with("token_embd")) {
            first_extra += t.n_elements();
        } else {
            last_extra += t.n_elements();
        }
    }
    return balance_layers(layer_bytes, ranks, first_extra, last_extra);
}

bool layer_shard_uses(const std::string & name, std::pair<int64_t, int64_t> layers, int64_t n_layer, bool tied_head) {
    const auto [first, end] = layers;
    if (name.starts_with("blk.")) {
        const size_t dot = name.find('.', 4);
        const std::string digits = name.substr(4, dot == std::string::npos ? std::string::npos : dot - 4);
        if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) {
            return false;
        }
        const int64_t il = std::stoll(digits);
        return il >= first && il < end;
    }
    if (name.starts_with("token_embd")) {
        return first == 0 || (tied_head && end == n_layer);
    }
    return end == n_layer;
}

namespace {

// l of "blk.l.…", else −1 (as layer_shard_uses reads it).
int64_t layer_of_name(const std::string & name) {
    if (!name.starts_with("blk.")) {
        return -1;
    }
    const size_t dot = name.find('.', 4);
    const std::string digits = name.substr(4, dot == std::string::npos ? std::string::npos : dot - 4);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) {
        return -1;
    }
    return std::stoll(digits);
}

}  // namespace

int layer_pipeline::rank() const { return pg ? pg->rank() : 0; }
int layer_pipeline::size() const { return pg ? pg->size() : 1; }

bool layer_pipeline::uses(const std::string & name) const { return layer_shard_uses(name, mine(), n_layer, tied_head); }

int layer_pipeline::start_of(const std::string & name) const {
    const int64_t l = layer_of_name(name);
    if (l >= 0) {
        for (size_t r = 0; r < layers.size(); ++r) {
            if (l >= layers[r].first && l < layers[r].second) {
                return static_cast<int>(r);
            }
        }
        fail("tensor '{}': layer {} is outside the pipeline's {} layers", name, l, n_layer);
    }
    return name == "output.weight" && !tied_head ? size() - 1 : 0;
}

int layer_pipeline::owner_of(const std::string & name) const {
    if (layer_of_name(name) >= 0) {
        return start_of(name);
    }
    return name.starts_with("token_embd") ? 0 : size() - 1;
}

void require_same_on_every_rank(process_group & pg, uint64_t value, const std::string & what) {
    // max(v) and max(~v) = ~min(v), as int64 bit patterns: equal everywhere exactly when max == min.
    torch::Tensor hi = torch::tensor({static_cast<int64_t>(value)}, torch::kLong);
    torch::Tensor lo = torch::tensor({static_cast<int64_t>(~value)}, torch::kLong);
    pg.all_reduce_max(hi);
    pg.all_reduce_max(lo);
    if (hi.item<int64_t>() != ~lo.item<int64_t>()) {
        fail("rank {} of {}: {} differ between the ranks; start every rank with the same command line", pg.rank(),
             pg.size(), what);
    }
}

void sum_gate_gradients(process_group & pg, std::vector<torch::Tensor> & gates) {
    std::vector<torch::Tensor> grads;
    for (torch::Tensor & g : gates) {
        if (!g.grad().defined()) {
            g.mutable_grad() = torch::zeros_like(g);
        }
        grads.push_back(g.grad());
    }
    pg.all_reduce_sum(grads);
}

distill_values sharded_distill_step(causal_lm & model, const torch::Tensor & tokens, weight_source & teacher,
                                    weight_source & student, process_group * pg, std::pair<int64_t, int64_t> layers,
                                    double lambda_kl, int64_t chunk, std::vector<torch::Tensor> & gates,
                                    double scale, const torch::Tensor & extra, double lambda_ce, bool reduce_gates) {
    const int rank = pg ? pg->rank() : 0, size = pg ? pg->size() : 1;
    const model_hparams & hp = model.hparams();
    const auto [first, end] = layers;
    if ((rank == 0) != (first == 0) || (rank == size - 1) != (end == hp.n_layer)) {
        fail("rank {} of {} holds layers [{}, {}): the first rank must start at layer 0 and the last end at {}", rank, size,
             first, end, hp.n_layer);
    }
    const torch::IntArrayRef bt = tokens.sizes();
    const auto stream = [&] {
        return torch::empty({bt[0], bt[1], hp.n_embd}, torch::TensorOptions().dtype(model.compute_dtype()).device(tokens.device()));
    };
    enum : int { teacher_tag = 1, student_tag = 2, grad_tag = 3 };
    // The teacher's stream, without autograd.
    torch::Tensor h_t;
    {
        torch::NoGradGuard no_grad;
        torch::Tensor in;
        if (rank > 0) {
            in = stream();
            pg->recv(in, rank - 1, teacher_tag);
        }
        h_t = model.hidden_layers(tokens, in, first, end, teacher);
        if (rank < size - 1) {
            pg->send(h_t, rank + 1, teacher_tag);
        }
    }
    // The student's stream forward, its gradient back.
    torch::Tensor in;
    if (rank > 0) {
        in = stream();
        pg->recv(in, rank - 1, student_tag);
        in.requires_grad_(true);
    }
    const torch::Tensor h_s = model.hidden_layers(tokens, in, first, end, student);
    distill_values v;
    if (rank < size - 1) {
        pg->send(h_s.detach(), rank + 1, student_tag);
        torch::Tensor g = stream();
        pg->recv(g, rank + 1, grad_tag);
        if (h_s.requires_grad()) {  // else nothing on this rank learns (no gated tensor in its layers)
            h_s.backward(g);
        }
    } else {
        v = chunked_distill(model, h_s, student, h_t, teacher, tokens, lambda_kl, scale, chunk, extra, lambda_ce);
    }
    if (rank > 0) {
        pg->send(in.grad(), rank - 1, grad_tag);
    }
    if (size > 1) {
        if (reduce_gates) {
            sum_gate_gradients(*pg, gates);
        }
        torch::Tensor values = torch::tensor({v.ce, v.kl}, torch::kDouble);
        std::vector<torch::Tensor> vv{values};
        pg->all_reduce_sum(vv);
        v.ce = values[0].item<double>();
        v.kl = values[1].item<double>();
    }
    return v;
}

namespace {

process_group & group_of(const torch::autograd::AutogradContext * ctx) {
    return *reinterpret_cast<process_group *>(static_cast<intptr_t>(ctx->saved_data.at("group").toInt()));
}

torch::Tensor summed(process_group & pg, const torch::Tensor & x) {
    std::vector<torch::Tensor> v{x.contiguous().clone()};
    pg.all_reduce_sum(v);
    return v[0];
}

/// Megatron's f: identity forward, all-reduce of the gradient backward.
struct copy_to_fn : torch::autograd::Function<copy_to_fn> {
    static torch::Tensor forward(torch::autograd::AutogradContext * ctx, const torch::Tensor & x, int64_t group) {
        ctx->saved_data["group"] = group;
        return x.clone();
    }
    static torch::autograd::tensor_list backward(torch::autograd::AutogradContext * ctx, torch::autograd::tensor_list g) {
        return {summed(group_of(ctx), g[0]), torch::Tensor()};
    }
};

/// Megatron's g: all-reduce forward, identity backward.
struct reduce_from_fn : torch::autograd::Function<reduce_from_fn> {
    static torch::Tensor forward(torch::autograd::AutogradContext * ctx, const torch::Tensor & x, int64_t group) {
        ctx->saved_data["group"] = group;
        return summed(*reinterpret_cast<process_group *>(static_cast<intptr_t>(group)), x);
    }
    static torch::autograd::tensor_list backward(torch::autograd::AutogradContext *, torch::autograd::tensor_list g) {
        return {g[0], torch::Tensor()};
    }
};

}  // namespace

torch::Tensor group_tensor_parallel::copy_to(const torch::Tensor & x) const {
    return copy_to_fn::apply(x, static_cast<int64_t>(reinterpret_cast<intptr_t>(&pg_)));
}

torch::Tensor group_tensor_parallel::reduce_from(const torch::Tensor & x) const {
    return reduce_from_fn::apply(x, static_cast<int64_t>(reinterpret_cast<intptr_t>(&pg_)));
}

torch::Tensor group_tensor_parallel::max_over(const torch::Tensor & x) const {
    torch::Tensor y = x.detach().contiguous().clone();
    pg_.all_reduce_max(y);
    return y;
}

torch::Tensor tp_shard(const std::string & name, const torch::Tensor & t, int rank, int size) {
    switch (tp_split_of(name)) {
    case tp_split::column_parallel:
    case tp_split::vocab_parallel: {
        const auto [lo, hi] = tp_range_of(name, t.size(0), rank, size);
        return t.narrow(0, lo, hi - lo);
    }
    case tp_split::row_parallel: {
        const auto [lo, hi] = tp_range_of(name, t.size(-1), rank, size);
        return t.narrow(-1, lo, hi - lo);
    }
    case tp_split::replicated:
        break;
    }
    return t;
}

torch::Tensor tp_shard_source::get(const std::string & name) { return tp_shard(name, full_.get(name), rank_, size_); }

torch::Tensor tp_shard_source::rows(const std::string & name, const torch::Tensor & ids) {
    if (tp_split_of(name) == tp_split::vocab_parallel) {
        return full_.rows(name, ids + tp_range(n_vocab_, rank_, size_).first);
    }
    return full_.rows(name, ids);
}

std::string tp_split_problem(const gguf_tensor & t, const std::vector<ggml_type> & types, int size) {
    const tp_split split = tp_split_of(t.name);
    if (t.n_dims != 2 || split == tp_split::replicated) {
        return fmt::format("tensor '{}' {} is not split by tensor parallelism (it splits the 2-D attn_q/k/v, "
                           "attn_output, ffn_gate/up/down, token_embd and output); use --parallel layers",
                           t.name, shape_str(t.shape()));
    }
    if (split != tp_split::row_parallel) {
        return {};
    }
    for (int rank = 0; rank < size; ++rank) {
        const auto [lo, hi] = tp_range_of(t.name, t.ne[0], rank, size);
        for (const ggml_type type : types) {
            const int64_t blck = type_info_of(type).blck_size;
            if (lo % blck != 0 || hi % blck != 0) {
                return fmt::format("tensor '{}' {}: rank {} of {} holds columns [{}, {}), which {} ({}-weight blocks) "
                                   "cannot split; use a menu whose blocks divide the columns each rank holds, fewer "
                                   "ranks, or --parallel layers",
                                   t.name, shape_str(t.shape()), rank, size, lo, hi, type_name(type), blck);
            }
        }
    }
    return {};
}

std::array<int64_t, 4> tp_shard_ne(const gguf_tensor & t, int rank, int size) {
    std::array<int64_t, 4> ne = t.ne;
    const tp_split split = tp_split_of(t.name);
    if (split == tp_split::column_parallel || split == tp_split::vocab_parallel) {
        const auto [lo, hi] = tp_range_of(t.name, t.ne[1], rank, size);
        ne[1] = hi - lo;
    } else if (split == tp_split::row_parallel) {
        const auto [lo, hi] = tp_range_of(t.name, t.ne[0], rank, size);
        ne[0] = hi - lo;
    }
    return ne;
}

gated_tensor shard_gated_tensor(const gated_tensor & full, int rank, int size, std::deque<gguf_tensor> & shapes) {
    const gguf_tensor & t = *full.tensor;
    gguf_tensor shard = t;
    gated_tensor out;
    out.types = full.types;
    out.n_threads = full.n_threads;
    const tp_split split = tp_split_of(t.name);
    if (const std::string problem = tp_split_problem(t, full.types, size); !problem.empty()) {
        fail("{}", problem);
    }
    for (size_t k = 0; k < full.types.size(); ++k) {
        const ggml_type type = full.types[k];
        const std::vector<uint8_t> & b = full.bytes[k];
        const size_t row_bytes = tensor_bytes(type, std::array<int64_t, 1>{t.ne[0]}, t.name);
        std::vector<uint8_t> part;
        if (split == tp_split::column_parallel || split == tp_split::vocab_parallel) {
            const auto [lo, hi] = tp_range_of(t.name, t.ne[1], rank, size);
            shard.ne[1] = hi - lo;
            part.assign(b.begin() + static_cast<std::ptrdiff_t>(lo * static_cast<int64_t>(row_bytes)),
                        b.begin() + static_cast<std::ptrdiff_t>(hi * static_cast<int64_t>(row_bytes)));
        } else if (split == tp_split::row_parallel) {
            const auto [lo, hi] = tp_range_of(t.name, t.ne[0], rank, size);
            const type_info & info = type_info_of(type);
            shard.ne[0] = hi - lo;
            const size_t from = static_cast<size_t>(lo / info.blck_size) * info.type_size;
            const size_t n = static_cast<size_t>((hi - lo) / info.blck_size) * info.type_size;
            part.reserve(n * static_cast<size_t>(t.ne[1]));
            for (int64_t r = 0; r < t.ne[1]; ++r) {
                const auto row = b.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(r) * row_bytes + from);
                part.insert(part.end(), row, row + static_cast<std::ptrdiff_t>(n));
            }
        }
        out.bytes.push_back(std::move(part));
    }
    shard.n_bytes = out.bytes.empty() ? 0 : out.bytes[0].size();
    shapes.push_back(shard);
    out.tensor = &shapes.back();
    return out;
}

distill_values tp_distill_step(causal_lm & model, const torch::Tensor & tokens, weight_source & teacher,
                               weight_source & student, const group_tensor_parallel * tp, double lambda_kl,
                               int64_t chunk, std::vector<torch::Tensor> & gates) {
    torch::Tensor h_t;
    {
        torch::NoGradGuard no_grad;
        h_t = model.hidden(tokens, teacher);
    }
    const torch::Tensor h_s = model.hidden(tokens, student);
    const distill_values v = chunked_distill(model, h_s, student, h_t, teacher, tokens, lambda_kl, 1.0, chunk);
    if (tp && tp->size() > 1) {
        sum_gate_gradients(tp->group(), gates);
    }
    return v;
}

}  // namespace voodoo::dist
