#include "train/gated.h"

#include "common/error.h"
#include "ggml/quant.h"
#include "ggml/types.h"

#if defined(VOODOO_HAVE_CUDA)
#include "cuda/gpu.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

namespace voodoo {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

gated_tensor * from_handle(AutogradContext * ctx) {
    return reinterpret_cast<gated_tensor *>(ctx->saved_data["t"].toInt());
}

int64_t rows_of(const gated_tensor & t) { return t.tensor->n_rows(); }

// One candidate as f32 [rows, ne0], into `buf` (reused between candidates).
void dequantize_candidate(const gated_tensor & t, size_t k, std::vector<float> & buf) {
    if (t.bytes.size() <= k || t.bytes[k].size() != static_cast<size_t>(tensor_bytes(t.types[k], t.tensor->ne, t.tensor->name))) {
        fail("tensor '{}': candidate {} has no host bytes to dequantize (they were released after the upload)",
             t.tensor->name, k);
    }
    buf.resize(static_cast<size_t>(t.tensor->n_elements()));
    dequantize_into(t.types[k], t.bytes[k], t.tensor->ne[0], buf, t.n_threads, t.tensor->name);
}

// Rows ids of one candidate, into buf [n, ne0].
void dequantize_rows(const gated_tensor & t, size_t k, const int64_t * ids, int64_t n, std::vector<float> & buf) {
    const int64_t ne0 = t.tensor->ne[0];
    const size_t row = ggml_row_size(t.types[k], ne0);
    buf.resize(static_cast<size_t>(n * ne0));
    // Runs of consecutive rows (an expert's rows, a tensor's) in one call, threaded when long.
    for (int64_t i = 0, j; i < n; i = j) {
        for (j = i + 1; j < n && ids[j] == ids[j - 1] + 1; ++j) {
        }
        const int64_t len = j - i;
        dequantize_into(t.types[k], std::span<const uint8_t>(t.bytes[k]).subspan(ids[i] * row, len * row), ne0,
                        std::span<float>(buf).subspan(i * ne0, len * ne0), len >= 64 ? t.n_threads : 1, t.tensor->name);
    }
}

std::vector<double> probs_of(const torch::Tensor & p) {
    const torch::Tensor c = p.detach().to(torch::kDouble).contiguous().cpu();
    return {c.data_ptr<double>(), c.data_ptr<double>() + c.numel()};
}

#if defined(VOODOO_HAVE_CUDA)
// The fused path's candidates on the GPU: resident ones as they are, host-resident ones through their stream.
const gpu::candidate_set & device_set(const gated_tensor & t) {
    if (t.stream) {
        return std::static_pointer_cast<gpu::candidate_stream>(t.stream)->use(t.stream_id);
    }
    return *std::static_pointer_cast<gpu::candidate_set>(t.device_bytes);
}
#endif

// ⟨G, deq(Q_k)[ids]⟩ for every k on the device paths: [K] f64 on G's device. ids undefined = every row.
torch::Tensor device_gate_grad(const gated_tensor & t, const torch::Tensor & grad, const torch::Tensor & ids) {
    if (t.path == mixture_path::reference) {
        const int64_t K = t.dense.size(0);
        const torch::Tensor d = ids.defined() ? t.dense.index_select(1, ids) : t.dense;
        const torch::Tensor g = grad.to(d.dtype()).contiguous().view({-1, 1});
        return torch::matmul(d.reshape({K, -1}), g).view({K}).to(torch::kDouble);
    }
#if defined(VOODOO_HAVE_CUDA)
    return gpu::gate_grad(device_set(t), grad, ids);
#else
    fail("tensor '{}': the fused mixture needs a CUDA build of voodoo", t.tensor->name);
#endif
}

// Rows ids of the mixture on the device paths: [n, ne0] in t.dtype.
torch::Tensor device_rows(const gated_tensor & t, const torch::Tensor & p, const torch::Tensor & ids) {
    if (ids.numel() > 0) {
        const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
        if (lo < 0 || hi >= rows_of(t)) {
            fail("tensor '{}': row {} is out of range (the tensor has {} rows)", t.tensor->name, lo < 0 ? lo : hi, rows_of(t));
        }
    }
    if (t.path == mixture_path::reference) {
        const int64_t K = t.dense.size(0);
        const torch::Tensor d = t.dense.index_select(1, ids);
        return torch::matmul(p.to(d.dtype()).view({1, K}), d.reshape({K, -1})).view({ids.numel(), t.tensor->ne[0]}).to(t.dtype);
    }
#if defined(VOODOO_HAVE_CUDA)
    return gpu::mixture(device_set(t), p, ids, t.dtype);
#else
    (void)p;
    fail("tensor '{}': the fused mixture needs a CUDA build of voodoo", t.tensor->name);
#endif
}

// ∂L/∂p_k = ⟨G, deq(Q_k)[id]⟩ for rows id (on the path's device; the CPU path's on the CPU) and G [n, ne0];
// added to t.grad_p. Returns it as [K] f32 on G's device.
torch::Tensor rows_gate_grad(gated_tensor & t, const torch::Tensor & grad, const torch::Tensor & id) {
    if (t.path != mixture_path::cpu) {
        const torch::Tensor grad_p = device_gate_grad(t, grad, id);
        t.grad_p = t.grad_p.defined() ? t.grad_p + grad_p : grad_p;
        return grad_p.to(torch::kFloat);
    }
    const torch::Tensor g = grad.to(torch::kFloat).contiguous().view(-1);
    auto grad_p = torch::empty({static_cast<int64_t>(t.types.size())}, torch::kDouble);
    std::vector<float> buf;
    for (size_t k = 0; k < t.types.size(); ++k) {
        dequantize_rows(t, k, id.data_ptr<int64_t>(), id.numel(), buf);
        grad_p[static_cast<int64_t>(k)] = torch::dot(g, torch::from_blob(buf.data(), {g.numel()}, torch::kFloat)).item<double>();
    }
    t.grad_p = t.grad_p.defined() ? t.grad_p + grad_p : grad_p;
    return grad_p.to(torch::kFloat);
}

class mixture_fn : public torch::autograd::Function<mixture_fn> {
public:
    static torch::Tensor forward(AutogradContext * ctx, const torch::Tensor & p, int64_t handle) {
        auto & t = *reinterpret_cast<gated_tensor *>(handle);
        ctx->saved_data["t"] = handle;
        if (t.path == mixture_path::reference) {
            // Σ_k p_k · D_k as one product over the stacked dense candidates.
            const int64_t K = t.dense.size(0);
            return torch::matmul(p.to(t.dense.dtype()).view({1, K}), t.dense.view({K, -1})).view({t.dense.size(1), t.dense.size(2)}).to(t.dtype);
        }
#if defined(VOODOO_HAVE_CUDA)
        if (t.path == mixture_path::fused) {
            return gpu::mixture(device_set(t), p, torch::Tensor(), t.dtype);
        }
#endif
        const auto w = probs_of(p);
        torch::Tensor out = torch::zeros({rows_of(t), t.tensor->ne[0]}, torch::kFloat);
        std::vector<float> buf;
        for (size_t k = 0; k < t.types.size(); ++k) {
            if (w[k] == 0.0) {
                continue;  // hard one-hot: the other candidates add nothing
            }
            dequantize_candidate(t, k, buf);
            out.add_(torch::from_blob(buf.data(), out.sizes(), torch::kFloat), w[k]);
        }
        return out;
    }

    static tensor_list backward(AutogradContext * ctx, tensor_list grads) {
        auto & t = *from_handle(ctx);
        if (t.path != mixture_path::cpu) {
            const torch::Tensor grad_p = device_gate_grad(t, grads[0], torch::Tensor());
            t.grad_p = t.grad_p.defined() ? t.grad_p + grad_p : grad_p;
            return {grad_p.to(torch::kFloat), torch::Tensor()};
        }
        const torch::Tensor g = grads[0].to(torch::kFloat).contiguous().view(-1);
        auto grad_p = torch::empty({static_cast<int64_t>(t.types.size())}, torch::kDouble);
        std::vector<float> buf;
        for (size_t k = 0; k < t.types.size(); ++k) {
            dequantize_candidate(t, k, buf);
            grad_p[static_cast<int64_t>(k)] =
                torch::dot(g, torch::from_blob(buf.data(), {g.numel()}, torch::kFloat)).item<double>();
        }
        t.grad_p = t.grad_p.defined() ? t.grad_p + grad_p : grad_p;
        return {grad_p.to(torch::kFloat), torch::Tensor()};
    }
};

// Checks ids ([n] int64 on the CPU) against the rows of t.
void check_rows(const gated_tensor & t, const torch::Tensor & id) {
    const int64_t * v = id.data_ptr<int64_t>();
    for (int64_t i = 0; i < id.numel(); ++i) {
        if (v[i] < 0 || v[i] >= rows_of(t)) {
            fail("tensor '{}': row {} is out of range (the tensor has {} rows)", t.tensor->name, v[i], rows_of(t));
        }
    }
}

class mixture_rows_fn : public torch::autograd::Function<mixture_rows_fn> {
public:
    static torch::Tensor forward(AutogradContext * ctx, const torch::Tensor & p, const torch::Tensor & ids,
                                 int64_t handle) {
        auto & t = *reinterpret_cast<gated_tensor *>(handle);
        ctx->saved_data["t"] = handle;
        if (t.path != mixture_path::cpu) {
            const torch::Tensor id = ids.to(p.device(), torch::kLong).contiguous().view(-1);
            ctx->save_for_backward({id});
            return device_rows(t, p, id);
        }
        const torch::Tensor id = ids.to(torch::kLong).contiguous().cpu();
        ctx->save_for_backward({id});
        const int64_t n = id.numel();
        check_rows(t, id);
        const auto w = probs_of(p);
        torch::Tensor out = torch::zeros({n, t.tensor->ne[0]}, torch::kFloat);
        std::vector<float> buf;
        for (size_t k = 0; k < t.types.size(); ++k) {
            if (w[k] == 0.0) {
                continue;
            }
            dequantize_rows(t, k, id.data_ptr<int64_t>(), n, buf);
            out.add_(torch::from_blob(buf.data(), out.sizes(), torch::kFloat), w[k]);
        }
        return out;
    }

    static tensor_list backward(AutogradContext * ctx, tensor_list grads) {
        const torch::Tensor grad_p = rows_gate_grad(*from_handle(ctx), grads[0], ctx->get_saved_variables()[0]);
        return {grad_p, torch::Tensor(), torch::Tensor()};
    }
};

// The positions i with routes[i] == k for every k, as [n_k] int64 CPU tensors (empty when none).
std::vector<torch::Tensor> group_by_route(const gated_tensor & t, const torch::Tensor & routes) {
    const int64_t K = static_cast<int64_t>(t.types.size());
    std::vector<std::vector<int64_t>> groups(static_cast<size_t>(K));
    const int64_t * r = routes.data_ptr<int64_t>();
    for (int64_t i = 0; i < routes.numel(); ++i) {
        if (r[i] < 0 || r[i] >= K) {
            fail("tensor '{}': route {} of position {} is out of range (the tensor has {} candidates)", t.tensor->name,
                 r[i], i, K);
        }
        groups[static_cast<size_t>(r[i])].push_back(i);
    }
    std::vector<torch::Tensor> out;
    for (auto & g : groups) {
        out.push_back(torch::tensor(g, torch::kLong));
    }
    return out;
}

torch::Tensor routes_on_cpu(const torch::Tensor & routes, int64_t n, const gated_tensor & t) {
    const torch::Tensor r = routes.to(torch::kCPU, torch::kLong).contiguous().view(-1);
    if (r.numel() != n) {
        fail("tensor '{}': {} routes for {} positions", t.tensor->name, r.numel(), n);
    }
    return r;
}

// PTQR: the routed forward, the mixing backward (gated.h, routed_product).
class routed_product_fn : public torch::autograd::Function<routed_product_fn> {
public:
    static torch::Tensor forward(AutogradContext * ctx, const torch::Tensor & x, const torch::Tensor & w,
                                 const torch::Tensor & routes, int64_t handle) {
        auto & t = *reinterpret_cast<gated_tensor *>(handle);
        const int64_t ne0 = t.tensor->ne[0], rows = rows_of(t);
        if (x.size(-1) != ne0 || w.dim() != 2 || w.size(0) != rows || w.size(1) != ne0) {
            fail("tensor '{}': the routed product needs x [..., {}] and w [{}, {}]", t.tensor->name, ne0, rows, ne0);
        }
        const torch::Tensor xf = x.reshape({-1, ne0});
        const std::vector<torch::Tensor> groups = group_by_route(t, routes_on_cpu(routes, xf.size(0), t));
        torch::Tensor y = torch::empty({xf.size(0), rows}, x.options());
        for (size_t k = 0; k < groups.size(); ++k) {
            if (groups[k].numel() == 0) {
                continue;
            }
            const torch::Tensor idx = groups[k].to(x.device());
            // The reference path's own dense candidate (what its mixture is made of); else formed from the bytes.
            const torch::Tensor wk = (t.path == mixture_path::reference ? t.dense[static_cast<int64_t>(k)]
                                                                        : candidate_weights(t, k, x.device()))
                                         .to(x.scalar_type());
            y.index_copy_(0, idx, torch::matmul(xf.index_select(0, idx), wk.t()));
        }
        ctx->save_for_backward({x, w});
        std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
        shape.back() = rows;
        return y.view(shape);
    }

    static tensor_list backward(AutogradContext * ctx, tensor_list grads) {
        const auto saved = ctx->get_saved_variables();
        const torch::Tensor & x = saved[0], & w = saved[1];
        const torch::Tensor g = grads[0].to(x.scalar_type());
        torch::Tensor grad_x, grad_w;
        if (ctx->needs_input_grad(0)) {
            grad_x = torch::matmul(g, w);
        }
        if (ctx->needs_input_grad(1)) {
            grad_w = torch::matmul(g.reshape({-1, w.size(0)}).t(), x.reshape({-1, w.size(1)}));
        }
        return {grad_x, grad_w, torch::Tensor(), torch::Tensor()};
    }
};

// PTQR's embedding rows: row i from candidate routes[i]; backward as mixture_rows_fn.
class routed_rows_fn : public torch::autograd::Function<routed_rows_fn> {
public:
    static torch::Tensor forward(AutogradContext * ctx, const torch::Tensor & p, const torch::Tensor & ids,
                                 const torch::Tensor & routes, int64_t handle) {
        auto & t = *reinterpret_cast<gated_tensor *>(handle);
        ctx->saved_data["t"] = handle;
        const torch::Tensor id_cpu = ids.to(torch::kCPU, torch::kLong).contiguous().view(-1);
        check_rows(t, id_cpu);
        const int64_t n = id_cpu.numel(), K = static_cast<int64_t>(t.types.size());
        const std::vector<torch::Tensor> groups = group_by_route(t, routes_on_cpu(routes, n, t));
        const bool on_device = t.path != mixture_path::cpu;
        const torch::Device device = on_device ? p.device() : torch::Device(torch::kCPU);
        torch::Tensor out = torch::empty({n, t.tensor->ne[0]}, torch::TensorOptions().dtype(t.dtype).device(device));
        std::vector<float> buf;
        for (size_t k = 0; k < groups.size(); ++k) {
            if (groups[k].numel() == 0) {
                continue;
            }
            const torch::Tensor ids_k = id_cpu.index_select(0, groups[k]);
            torch::Tensor part;
            if (on_device) {
                // One-hot weights: 1 · deq(Q_k) + 0 · the others is deq(Q_k) exactly.
                torch::Tensor onehot = torch::zeros({K}, p.options().dtype(torch::kFloat));
                onehot[static_cast<int64_t>(k)] = 1.0f;
                part = device_rows(t, onehot, ids_k.to(device));
            } else {
                dequantize_rows(t, k, ids_k.data_ptr<int64_t>(), ids_k.numel(), buf);
                part = torch::from_blob(buf.data(), {ids_k.numel(), t.tensor->ne[0]}, torch::kFloat);
            }
            out.index_copy_(0, groups[k].to(device), part.to(t.dtype));
        }
        ctx->save_for_backward({on_device ? id_cpu.to(device) : id_cpu});
        return out;
    }

    static tensor_list backward(AutogradContext * ctx, tensor_list grads) {
        const torch::Tensor grad_p = rows_gate_grad(*from_handle(ctx), grads[0], ctx->get_saved_variables()[0]);
        return {grad_p, torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
};

}  // namespace

torch::Tensor routed_product(const torch::Tensor & x, const torch::Tensor & w, const torch::Tensor & routes,
                             gated_tensor & t) {
    return routed_product_fn::apply(x, w, routes, reinterpret_cast<int64_t>(&t));
}

torch::Tensor routed_rows(const torch::Tensor & p, const torch::Tensor & ids, const torch::Tensor & routes,
                          gated_tensor & t) {
    return routed_rows_fn::apply(p, ids, routes, reinterpret_cast<int64_t>(&t));
}

torch::Tensor draw_routes(const torch::Tensor & p, int64_t n, uint64_t seed) {
    const std::vector<double> w = probs_of(p);
    std::vector<double> cum(w.size());
    double total = 0;
    size_t last = 0;  // the last candidate with p > 0: where a uniform that rounding puts past the total lands
    for (size_t k = 0; k < w.size(); ++k) {
        if (!(w[k] >= 0) || !std::isfinite(w[k])) {
            fail("draw_routes: p[{}] = {} is not a probability", k, w[k]);
        }
        total += w[k];
        cum[k] = total;
        last = w[k] > 0 ? k : last;
    }
    if (!(total > 0)) {
        fail("draw_routes: the probabilities sum to {}, not 1", total);
    }
    std::mt19937_64 rng(seed);
    torch::Tensor out = torch::empty({n}, torch::kLong);
    int64_t * r = out.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
        const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * total;
        const size_t k = static_cast<size_t>(std::upper_bound(cum.begin(), cum.end(), u) - cum.begin());
        r[i] = static_cast<int64_t>(std::min(k, last));
    }
    return out;
}

routing_mode parse_routing(const std::string & s) {
    if (s == "mix") {
        return routing_mode::mix;
    }
    if (s == "ptqr") {
        return routing_mode::ptqr;
    }
    fail("--routing '{}': expected mix (every token sees the mixture of the candidates) or ptqr (per-token quant "
         "routing: each token sees one candidate drawn from the gate)", s);
}

torch::Tensor gated_mixture(const torch::Tensor & p, gated_tensor & t) {
    return mixture_fn::apply(p, reinterpret_cast<int64_t>(&t));
}

torch::Tensor gated_mixture_rows(const torch::Tensor & p, const torch::Tensor & ids, gated_tensor & t) {
    return mixture_rows_fn::apply(p, ids, reinterpret_cast<int64_t>(&t));
}

mixture_path parse_mixture_path(const std::string & s) {
    if (s == "cpu") {
        return mixture_path::cpu;
    }
    if (s == "fused") {
        return mixture_path::fused;
    }
    if (s == "reference") {
        return mixture_path::reference;
    }
    fail("--mixture '{}': expected fused (the GPU kernels), reference (dense candidates, plain LibTorch) or cpu", s);
}

std::string mixture_path_name(mixture_path p) {
    switch (p) {
        case mixture_path::cpu: return "cpu";
        case mixture_path::fused: return "fused";
        case mixture_path::reference: return "reference";
    }
    return "?";
}

int64_t place_candidates(gated_tensor & t, mixture_path path, torch::Device device, torch::ScalarType w_dtype,
                         torch::ScalarType dense_dtype, const torch::Tensor & source) {
    t.path = path;
    t.dtype = w_dtype;
    t.dense = torch::Tensor();
    t.device_bytes.reset();
    t.stream.reset();
    const int64_t rows = rows_of(t), ne0 = t.tensor->ne[0];
    switch (path) {
        case mixture_path::cpu:
            t.dtype = torch::kFloat;
            return 0;
        case mixture_path::reference: {
            const int64_t K = static_cast<int64_t>(t.types.size());
            t.dense = torch::empty({K, rows, ne0}, torch::TensorOptions().dtype(dense_dtype).device(device));
            std::vector<float> buf;
            for (size_t k = 0; k < t.types.size(); ++k) {
                dequantize_candidate(t, k, buf);
                t.dense[static_cast<int64_t>(k)].copy_(torch::from_blob(buf.data(), {rows, ne0}, torch::kFloat));
            }
            return t.dense.numel() * t.dense.element_size();
        }
        case mixture_path::fused: {
#if defined(VOODOO_HAVE_CUDA)
            if (!device.is_cuda()) {
                fail("tensor '{}': the fused mixture runs on a CUDA device, not {}", t.tensor->name, device.str());
            }
            std::vector<int> types(t.types.begin(), t.types.end());
            const torch::Tensor src = source.defined() ? source.reshape({rows, ne0}) : source;
            auto c = std::make_shared<gpu::candidate_set>(gpu::upload(t.bytes, types, rows, ne0, device, t.tensor->name, src));
            const int64_t n = gpu::resident_bytes(*c);
            t.device_bytes = c;
            return n;
#else
            (void)source;
            fail("tensor '{}': --mixture fused needs a CUDA build of voodoo (README: building for the GPU)", t.tensor->name);
#endif
        }
    }
    return 0;
}

candidate_residency parse_candidate_residency(const std::string & s) {
    if (s == "gpu") {
        return candidate_residency::gpu;
    }
    if (s == "host") {
        return candidate_residency::host;
    }
    if (s == "auto") {
        return candidate_residency::automatic;
    }
    fail("--candidates-on '{}': use gpu, host or auto", s);
}

std::shared_ptr<void> make_candidate_stream(torch::Device device, int lookahead) {
#if defined(VOODOO_HAVE_CUDA)
    return std::make_shared<gpu::candidate_stream>(device, lookahead);
#else
    (void)lookahead;
    fail("host-resident candidates move to a CUDA device ({}): this build of voodoo has no CUDA", device.str());
#endif
}

candidate_stream_stats candidate_stream_statistics(const std::shared_ptr<void> & stream) {
    candidate_stream_stats out;
#if defined(VOODOO_HAVE_CUDA)
    if (stream) {
        const gpu::candidate_stream::counters c = std::static_pointer_cast<gpu::candidate_stream>(stream)->stats();
        out = {c.uses, c.misses, c.copies, c.bytes_copied, c.peak_resident_bytes, c.host_bytes};
    }
#else
    (void)stream;
#endif
    return out;
}

int64_t device_total_memory(torch::Device device) {
#if defined(VOODOO_HAVE_CUDA)
    if (device.is_cuda()) {
        return gpu::memory_info(device).second;
    }
#endif
    (void)device;
    return 0;
}

std::vector<bool> host_resident_plan(const std::vector<int64_t> & candidate_bytes, candidate_residency mode,
                                     int64_t gpu_bytes_for_candidates) {
    std::vector<bool> host(candidate_bytes.size(), mode == candidate_residency::host);
    if (mode != candidate_residency::automatic) {
        return host;
    }
    int64_t total = std::accumulate(candidate_bytes.begin(), candidate_bytes.end(), int64_t{0});
    std::vector<size_t> order(candidate_bytes.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return candidate_bytes[a] > candidate_bytes[b]; });
    for (size_t j = 0; j < order.size() && total > gpu_bytes_for_candidates; ++j) {
        host[order[j]] = true;
        total -= candidate_bytes[order[j]];
    }
    return host;
}

int64_t place_candidates_on_host(gated_tensor & t, torch::Device device, torch::ScalarType w_dtype,
                                 const std::shared_ptr<void> & stream) {
    t.path = mixture_path::fused;
    t.dtype = w_dtype;
    t.dense = torch::Tensor();
    t.device_bytes.reset();
    t.stream.reset();
#if defined(VOODOO_HAVE_CUDA)
    if (!stream) {
        fail("tensor '{}': host-resident candidates need a candidate stream (make_candidate_stream)", t.tensor->name);
    }
    std::vector<int> types(t.types.begin(), t.types.end());
    auto c = std::make_shared<gpu::candidate_set>(gpu::upload_host(t.bytes, types, rows_of(t), t.tensor->ne[0], device,
                                                                   t.tensor->name));
    auto s = std::static_pointer_cast<gpu::candidate_stream>(stream);
    t.stream_id = s->add(c);
    t.device_bytes = c;
    t.stream = stream;
    int64_t n = 0;
    for (const torch::Tensor & h : c->host) {
        n += h.numel();
    }
    return n;
#else
    (void)device;
    (void)stream;
    fail("tensor '{}': host-resident candidates need a CUDA build of voodoo (README: building for the GPU)", t.tensor->name);
#endif
}

torch::Tensor candidate_weights(const gated_tensor & t, size_t k, torch::Device device) {
#if defined(VOODOO_HAVE_CUDA)
    if (t.path == mixture_path::fused) {
        return gpu::dequantize(device_set(t), static_cast<int>(k));
    }
#endif
    if (t.path == mixture_path::reference && t.dense.scalar_type() == torch::kFloat) {
        return t.dense[static_cast<int64_t>(k)];
    }
    std::vector<float> buf;
    dequantize_candidate(t, k, buf);
    return torch::from_blob(buf.data(), {rows_of(t), t.tensor->ne[0]}, torch::kFloat).to(device, torch::kFloat, false, true);
}

gated_weights::gated_weights(weight_source & dense, std::vector<gated_tensor> & tensors)
    : dense_(dense), tensors_(tensors) {
    for (size_t i = 0; i < tensors_.size(); ++i) {
        index_[tensors_[i].tensor->name] = i;
    }
}

void gated_weights::set_routing(routing_mode mode, uint64_t seed) {
    routing_ = mode;
    route_seed_ = seed;
    route_calls_ = 0;
}

void gated_weights::set_straight_through(bool on, uint64_t seed) {
    straight_through_ = on;
    noise_seed_ = seed;
    noise_calls_ = 0;
}

torch::Tensor gated_weights::probs(size_t i) const {
    return torch::softmax(tensors_[i].gate / tau_, 0);
}

torch::Tensor gated_weights::forward_probs(size_t i) {
    torch::Tensor soft = probs(i);
    if (!straight_through_) {
        return soft;
    }
    // Gumbel(0, 1) noise from a generator seeded per call: reproducible, so a resumed run sees the same noise.
    std::mt19937_64 rng(noise_seed_ * 0x9E3779B97F4A7C15ull + noise_calls_++);
    std::uniform_real_distribution<double> u(1e-12, 1.0);
    const int64_t k = soft.numel();
    auto noise = torch::empty({k}, torch::kFloat);
    for (int64_t j = 0; j < k; ++j) {
        noise[j] = static_cast<float>(-std::log(-std::log(u(rng))));
    }
    const auto pick = (tensors_[i].gate.detach() / tau_ + noise.to(soft.device())).argmax();
    auto hard = torch::zeros_like(soft);
    hard[pick] = 1.0f;
    return hard - soft.detach() + soft;
}

torch::Tensor gated_weights::get(const std::string & name) {
    const auto it = index_.find(name);
    if (it == index_.end()) {
        return dense_.get(name);
    }
    gated_tensor & t = tensors_[it->second];
    torch::Tensor w = gated_mixture(forward_probs(it->second), t);
    std::vector<int64_t> shape;
    for (int d = t.tensor->n_dims - 1; d >= 0; --d) {
        shape.push_back(t.tensor->ne[static_cast<size_t>(d)]);
    }
    return w.view(shape);
}

torch::Tensor gated_weights::rows(const std::string & name, const torch::Tensor & ids) {
    const auto it = index_.find(name);
    if (it == index_.end()) {
        return dense_.rows(name, ids);
    }
    const torch::Tensor id = ids.reshape({-1});
    if (routing_ == routing_mode::ptqr) {
        const torch::Tensor p = probs(it->second);
        return routed_rows(p, id, draw_routes(p, id.numel(), next_route_seed()), tensors_[it->second]);
    }
    return gated_mixture_rows(forward_probs(it->second), id, tensors_[it->second]);
}

torch::Tensor gated_weights::experts(const std::string & name, const torch::Tensor & ids) {
    const auto it = index_.find(name);
    if (it == index_.end() || tensors_[it->second].tensor->n_dims != 3) {
        return weight_source::experts(name, ids);
    }
    gated_tensor & t = tensors_[it->second];
    const int64_t ne0 = t.tensor->ne[0], ne1 = t.tensor->ne[1], ne2 = t.tensor->ne[2];
    const torch::Tensor e = ids.to(torch::kCPU, torch::kLong).reshape({-1});
    if (e.numel() > 0 && (e.min().item<int64_t>() < 0 || e.max().item<int64_t>() >= ne2)) {
        fail("tensor '{}': expert {} is out of range (the tensor has {} experts)", name,
             e.min().item<int64_t>() < 0 ? e.min().item<int64_t>() : e.max().item<int64_t>(), ne2);
    }
    // Expert j's rows are j·ne1 … j·ne1 + ne1 − 1 of the flattened [ne2·ne1, ne0] tensor.
    const torch::Tensor rows = (e.unsqueeze(1) * ne1 + torch::arange(ne1, torch::kLong).unsqueeze(0)).reshape({-1});
    return gated_mixture_rows(forward_probs(it->second), rows, t).view({e.numel(), ne1, ne0});
}

torch::Tensor gated_weights::product_with(const std::string & name, const torch::Tensor & x, const torch::Tensor & w) {
    const auto it = index_.find(name);
    if (routing_ != routing_mode::ptqr || it == index_.end()) {
        return weight_source::product_with(name, x, w);
    }
    const int64_t n = x.numel() / std::max<int64_t>(1, x.size(-1));
    return routed_product(x, w, draw_routes(probs(it->second), n, next_route_seed()), tensors_[it->second]);
}

void gated_weights::set_draw_state(const std::vector<uint64_t> & state) {
    if (state.size() != 2) {
        fail("gated_weights::set_draw_state: {} values given, 2 expected (draw_state's)", state.size());
    }
    noise_calls_ = state[0];
    route_calls_ = state[1];
}

bool gated_weights::has(const std::string & name) const { return index_.count(name) > 0 || dense_.has(name); }

}  // namespace voodoo
