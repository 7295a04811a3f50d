#include "model/blocks.h"

#include "common/error.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/version.h>

#include <fmt/format.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace voodoo {

std::string layer_tensor(int64_t il, const char * name) { return fmt::format("blk.{}.{}", il, name); }

namespace {

/// What a checkpointed layer needs to run again in the backward: its body and a copy of its forward's context.
struct layer_replay : torch::CustomClassHolder {
    layer_replay(layer_body b, const forward_context & c, std::vector<uint64_t> draws)
        : body(std::move(b)), ctx(c), draws_before(std::move(draws)) {}
    layer_body body;
    forward_context ctx;
    std::vector<uint64_t> draws_before;
    int64_t moe_layer_after = 0;  // the context's MoE layer count after the forward
};

/// The checkpointed layer as one autograd node: forward(x, anchor) = body(x) without autograd; backward runs
/// body(x) again with autograd and backpropagates the output's gradient through it (into the gates' leaves and x).
/// `anchor`: an empty leaf that requires grad, so the node is in the graph even when x does not require grad.
class layer_checkpoint_fn : public torch::autograd::Function<layer_checkpoint_fn> {
public:
    static torch::Tensor forward(torch::autograd::AutogradContext * c, const torch::Tensor & x, const torch::Tensor & anchor,
                                 c10::intrusive_ptr<layer_replay> replay) {
        (void)anchor;
        c->save_for_backward({x});
        c->saved_data["x_requires_grad"] = x.requires_grad();
        forward_context ctx = replay->ctx;
        torch::Tensor y = replay->body(ctx, x);
        replay->moe_layer_after = ctx.moe_layer;
        c->saved_data["replay"] = c10::IValue::make_capsule(std::move(replay));
        return y;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext * c,
                                                   torch::autograd::variable_list grads) {
        // The recomputed layer's gradients reach the gates through their .grad (as torch.utils.checkpoint's reentrant
        // variant): a backward that asks for gradients of chosen inputs only (autograd::grad) would not see them.
        if (!torch::autograd::Engine::get_default_engine().is_checkpoint_valid()) {
            fail("activation checkpointing (--recompute) needs a plain backward (torch::autograd::backward); a backward "
                 "for chosen inputs (autograd::grad) would lose the recomputed layers' gradients: turn --recompute off");
        }
        const torch::Tensor x = c->get_saved_variables()[0];
        const auto replay = c10::static_intrusive_pointer_cast<layer_replay>(c->saved_data["replay"].toCapsule());
        const bool x_grad = c->saved_data["x_requires_grad"].toBool();
        torch::Tensor xd = x.detach().requires_grad_(x_grad);
        weight_source & w = replay->ctx.w;
        const std::vector<uint64_t> draws_now = w.draw_state();
        w.set_draw_state(replay->draws_before);
        torch::Tensor y;
        {
            torch::AutoGradMode grad_on(true);
            forward_context ctx = replay->ctx;
            y = replay->body(ctx, xd);
        }
        w.set_draw_state(draws_now);
        if (y.requires_grad()) {
            torch::autograd::backward({y}, {grads[0]});
        }
        return {x_grad ? xd.grad() : torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
};

}  // namespace

torch::Tensor run_layer(forward_context & ctx, const torch::Tensor & x, layer_body body) {
    if (!ctx.recompute || !torch::GradMode::is_enabled() || ctx.observer || ctx.forced_experts || ctx.routing) {
        return body(ctx, x);
    }
    forward_context copy = ctx;
    copy.f_in = torch::Tensor();
    copy.f_out = torch::Tensor();
    copy.input = nullptr;
    auto replay = c10::make_intrusive<layer_replay>(std::move(body), copy, ctx.w.draw_state());
    // The node must be in the graph even when x does not require grad (the first layer of a rank's range).
    static const torch::Tensor anchor = torch::empty({0}).requires_grad_(true);
    torch::Tensor y = layer_checkpoint_fn::apply(x, anchor, replay);
    // What the layer's forward did to the context (MoE's layer count) happens to the caller's too.
    ctx.moe_layer = replay->moe_layer_after;
    return y;
}

tp_split tp_split_of(const std::string & name) {
    if (name == "token_embd.weight" || name == "output.weight" || name == "output.bias") {
        return tp_split::vocab_parallel;
    }
    if (!name.starts_with("blk.")) {
        return tp_split::replicated;
    }
    const std::string_view rest = std::string_view(name).substr(name.find('.', 4) + 1);
    for (const char * col : {"attn_q.", "attn_k.", "attn_v.", "ffn_gate.", "ffn_up."}) {
        if (rest.starts_with(col)) {
            return tp_split::column_parallel;
        }
    }
    if (rest == "attn_output.weight" || rest == "ffn_down.weight") {
        return tp_split::row_parallel;
    }
    return tp_split::replicated;  // norms and the biases of row-parallel layers (added once, after g)
}

std::pair<int64_t, int64_t> tp_range(int64_t n, int rank, int size) {
    const int64_t q = n / size, r = n % size;
    const int64_t first = rank * q + std::min<int64_t>(rank, r);
    return {first, first + q + (rank < r ? 1 : 0)};
}

std::pair<int64_t, int64_t> tp_range_of(const std::string & name, int64_t n, int rank, int size) {
    const size_t dot = name.starts_with("blk.") ? name.find('.', 4) : std::string::npos;
    const bool ffn = dot != std::string::npos && std::string_view(name).substr(dot + 1).starts_with("ffn_");
    if (!ffn) {
        return tp_range(n, rank, size);
    }
    const int64_t unit = n % 256 == 0 && n / 256 >= size ? 256 : n % 32 == 0 && n / 32 >= size ? 32 : 1;
    const auto [a, b] = tp_range(n / unit, rank, size);
    return {a * unit, b * unit};
}

torch::Tensor token_embeddings(forward_context & ctx, const torch::Tensor & tokens, int64_t n_embd) {
    if (ctx.tp) {
        // Vocabulary-parallel (Megatron's VocabParallelEmbedding): each rank looks up the ids of its shard, zeros for
        // the others, and g sums: one non-zero term per position, so the sum is exact.
        const torch::Tensor ids = tokens.reshape({-1});
        const auto [lo, hi] = tp_range(ctx.n_vocab, ctx.tp->rank(), ctx.tp->size());
        const torch::Tensor mine = (ids >= lo).logical_and(ids < hi);
        const torch::Tensor local = torch::where(mine, ids - lo, torch::zeros_like(ids));
        torch::Tensor x = ctx.w.rows("token_embd.weight", local).to(tokens.device(), ctx.dtype);
        x = x * mine.unsqueeze(1).to(x.device(), x.scalar_type());
        return ctx.tp->reduce_from(x).view({tokens.size(0), tokens.size(1), n_embd});
    }
    const torch::Tensor x = ctx.w.rows("token_embd.weight", tokens.reshape({-1})).to(tokens.device(), ctx.dtype);
    return x.view({tokens.size(0), tokens.size(1), n_embd});
}

torch::Tensor linear(forward_context & ctx, const std::string & name, const torch::Tensor & x) {
    if (ctx.observer && *ctx.observer) {
        (*ctx.observer)(name, x, -1);
    }
    const tp_split split = ctx.tp ? tp_split_of(name) : tp_split::replicated;
    if (ctx.tp && name.find(".attn_qkv.") != std::string::npos) {
        fail("tensor '{}': tensor parallelism splits attn_q, attn_k and attn_v, not a fused attn_qkv; train this model "
             "on one GPU or with layer sharding", name);
    }
    torch::Tensor in = x;
    if (split == tp_split::column_parallel || split == tp_split::vocab_parallel) {
        if (!ctx.f_in.defined() || !ctx.f_in.is_same(x)) {
            ctx.f_in = x;
            ctx.f_out = ctx.tp->copy_to(x);
        }
        in = ctx.f_out;
    }
    torch::Tensor y = ctx.w.product(name, in, ctx.dtype);
    if (split == tp_split::row_parallel) {
        y = ctx.tp->reduce_from(y);  // the partial products of every rank's input features; the bias after, once
    }
    const std::string stem = name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
    if (ctx.w.has(stem + ".bias")) {
        y = y + ctx.w.get(stem + ".bias").to(x.device(), ctx.dtype);
    }
    return y;
}

torch::Tensor rms_norm(forward_context & ctx, const std::string & name, const torch::Tensor & x, float eps) {
    const torch::Tensor xf = x.to(torch::kFloat);
    const torch::Tensor w = ctx.w.get(name).to(x.device(), torch::kFloat);
    return (xf * torch::rsqrt(xf.square().mean(-1, true) + eps) * w).to(ctx.dtype);
}

rope_tables make_rope_tables(forward_context & ctx, const model_hparams & hp, int64_t n_pos, torch::Device device) {
    rope_config rope;
    rope.freq_base = hp.rope_freq_base;
    rope.freq_scale = hp.rope_freq_scale;
    rope.attn_factor = hp.rope_attn_factor;
    rope.freq_factors = hp.has_rope_freqs ? "rope_freqs.weight" : "";
    return make_rope_tables(ctx, hp.n_rot, rope, n_pos, device);
}

rope_tables make_rope_tables(forward_context & ctx, int64_t n_rot, const rope_config & rope, int64_t n_pos,
                             torch::Device device) {
    const int64_t n_pairs = n_rot / 2;
    std::vector<float> ff(static_cast<size_t>(n_pairs), 1.0f);
    if (!rope.freq_factors.empty()) {
        const torch::Tensor f = ctx.w.get(rope.freq_factors).to(torch::kCPU, torch::kFloat).contiguous();
        std::copy(f.data_ptr<float>(), f.data_ptr<float>() + n_pairs, ff.begin());
    }
    // Same f32 arithmetic as ggml_rope_cache_init / rope_yarn with ext_factor = 0.
    const float theta_scale = std::pow(rope.freq_base, -2.0f / static_cast<float>(n_rot));
    torch::Tensor cos = torch::empty({n_pos, n_pairs}, torch::kFloat);
    torch::Tensor sin = torch::empty({n_pos, n_pairs}, torch::kFloat);
    float * c = cos.data_ptr<float>();
    float * s = sin.data_ptr<float>();
    for (int64_t p = 0; p < n_pos; ++p) {
        float theta = static_cast<float>(p);
        for (int64_t i = 0; i < n_pairs; ++i) {
            const float angle = rope.freq_scale * (theta / ff[i]);
            c[p * n_pairs + i] = std::cos(angle) * rope.attn_factor;
            s[p * n_pairs + i] = std::sin(angle) * rope.attn_factor;
            theta *= theta_scale;
        }
    }
    return {cos.to(device), sin.to(device)};
}

torch::Tensor apply_rope(const torch::Tensor & x, const rope_tables & tables, const model_hparams & hp) {
    using torch::indexing::Slice;
    const int64_t n_rot = hp.n_rot;
    const int64_t T = x.size(1);
    const torch::Tensor xf = x.to(torch::kFloat);
    const torch::Tensor rot = xf.index({"...", Slice(0, n_rot)});
    // cos, sin: [T, n_rot/2] → [1, T, 1, n_rot/2] against [B, T, H, n_rot/2]
    const torch::Tensor cos = tables.cos.index({Slice(0, T)}).view({1, T, 1, n_rot / 2});
    const torch::Tensor sin = tables.sin.index({Slice(0, T)}).view({1, T, 1, n_rot / 2});
    torch::Tensor out;
    if (hp.rope == rope_type_norm) {
        const torch::Tensor pairs = rot.unflatten(-1, {n_rot / 2, 2});
        const torch::Tensor x0 = pairs.select(-1, 0);
        const torch::Tensor x1 = pairs.select(-1, 1);
        out = torch::stack({x0 * cos - x1 * sin, x0 * sin + x1 * cos}, -1).flatten(-2);
    } else {
        const torch::Tensor x0 = rot.index({"...", Slice(0, n_rot / 2)});
        const torch::Tensor x1 = rot.index({"...", Slice(n_rot / 2, n_rot)});
        out = torch::cat({x0 * cos - x1 * sin, x0 * sin + x1 * cos}, -1);
    }
    if (n_rot < x.size(-1)) {
        out = torch::cat({out, xf.index({"...", Slice(n_rot, torch::indexing::None)})}, -1);
    }
    return out.to(x.scalar_type());
}

namespace {

/// [T, T] bool, true where query position p1 (row) must not see key position p0 (column): the future, and with a
/// sliding window also p1 − p0 ≥ n_swa (the lower triangle below diagonal −n_swa + 1).
torch::Tensor masked_positions(int64_t T, int64_t n_swa, torch::Device device) {
    const torch::Tensor ones = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(device));
    const torch::Tensor future = ones.triu(1);
    return n_swa > 0 ? future | ones.tril(-n_swa) : future;
}

}  // namespace

torch::Tensor causal_attention(const torch::Tensor & q, const torch::Tensor & k, const torch::Tensor & v,
                               float kq_scale, int64_t n_swa) {
    const int64_t B = q.size(0), T = q.size(1), n_head = q.size(2), d_k = q.size(3);
    const int64_t n_head_kv = k.size(2), d_v = v.size(3);
    const int64_t group = n_head / n_head_kv;
#if TORCH_VERSION_MAJOR >= 2
    // On a GPU in bf16 (training): PyTorch's fused attention (flash / memory-efficient), f32 softmax inside,
    // no T×T score matrix kept for backward. The CPU and f32 path below stays the parity reference.
    if (q.is_cuda() && q.scalar_type() == torch::kBFloat16 && d_k == d_v) {
        const torch::Tensor kr = k.repeat_interleave(group, 2), vr = v.repeat_interleave(group, 2);
        // A sliding window needs an explicit mask (true = attend); plain causal uses the kernel's own.
        const std::optional<torch::Tensor> allowed =
            n_swa > 0 ? std::optional<torch::Tensor>(masked_positions(T, n_swa, q.device()).logical_not()) : std::nullopt;
        const torch::Tensor out = at::scaled_dot_product_attention(q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2),
                                                                   allowed, 0.0, !allowed.has_value(),
                                                                   static_cast<double>(kq_scale));
        return out.transpose(1, 2).reshape({B, T, n_head * d_v});
    }
#endif
    // [B, n_head_kv, group, T, d]: query head h = g · group + j reads KV head g.
    const torch::Tensor qh = q.permute({0, 2, 1, 3}).reshape({B, n_head_kv, group, T, d_k});
    const torch::Tensor kh = k.permute({0, 2, 1, 3}).unsqueeze(2);
    const torch::Tensor vh = v.permute({0, 2, 1, 3}).unsqueeze(2);
    torch::Tensor scores = torch::matmul(qh, kh.transpose(-1, -2)).to(torch::kFloat) * kq_scale;
    scores = scores.masked_fill(masked_positions(T, n_swa, q.device()), -std::numeric_limits<float>::infinity());
    const torch::Tensor probs = torch::softmax(scores, -1).to(v.scalar_type());
    const torch::Tensor out = torch::matmul(probs, vh);  // [B, n_head_kv, group, T, d_v]
    return out.reshape({B, n_head, T, d_v}).permute({0, 2, 1, 3}).reshape({B, T, n_head * d_v});
}

torch::Tensor swiglu_mlp(forward_context & ctx, const std::string & prefix, const torch::Tensor & x) {
    const torch::Tensor gate = linear(ctx, prefix + ".ffn_gate.weight", x);
    const torch::Tensor up = linear(ctx, prefix + ".ffn_up.weight", x);
    return linear(ctx, prefix + ".ffn_down.weight", torch::silu(gate) * up);
}

qkv_heads attention_qkv(forward_context & ctx, const std::string & prefix, const torch::Tensor & x,
                        const model_hparams & hp) {
    const int64_t B = x.size(0), T = x.size(1);
    const std::string fused = prefix + ".attn_qkv.weight";
    torch::Tensor q, k, v;
    if (ctx.w.has(fused)) {
        const std::vector<torch::Tensor> parts =
            linear(ctx, fused, x).split_with_sizes({hp.n_embd_q(), hp.n_embd_k_gqa(), hp.n_embd_v_gqa()}, -1);
        q = parts[0];
        k = parts[1];
        v = parts[2];
    } else {
        q = linear(ctx, prefix + ".attn_q.weight", x);
        k = linear(ctx, prefix + ".attn_k.weight", x);
        v = linear(ctx, prefix + ".attn_v.weight", x);
    }
    return {q.reshape({B, T, hp.n_head, hp.n_embd_head_k}), k.reshape({B, T, hp.n_head_kv, hp.n_embd_head_k}),
            v.reshape({B, T, hp.n_head_kv, hp.n_embd_head_v})};
}

torch::Tensor moe_ffn(forward_context & ctx, const std::string & prefix, const torch::Tensor & x,
                      const model_hparams & hp) {
    const int64_t n_embd = x.size(-1);
    const torch::Tensor xf = x.reshape({-1, n_embd});  // [N, n_embd], compute dtype
    const std::string router = prefix + ".ffn_gate_inp.weight";
    if (ctx.observer && *ctx.observer) {
        (*ctx.observer)(router, xf, -1);
    }
    const torch::Tensor logits = ctx.w.product(router, xf.to(torch::kFloat), torch::kFloat);  // [N, E]
    const torch::Tensor probs = torch::softmax(logits, -1);
    auto [top_p, top_e] = torch::topk(probs, hp.n_expert_used, -1);  // [N, k] each, largest first
    const int64_t layer = ctx.moe_layer++;
    if (ctx.forced_experts) {
        if (layer >= static_cast<int64_t>(ctx.forced_experts->size()) ||
            (*ctx.forced_experts)[static_cast<size_t>(layer)].sizes() != top_e.sizes()) {
            fail("{}: the forced experts hold {} layers; MoE layer {} needs [{}, {}]", prefix,
                 ctx.forced_experts->size(), layer, top_e.size(0), top_e.size(1));
        }
        top_e = (*ctx.forced_experts)[static_cast<size_t>(layer)].to(probs.device(), torch::kLong);
        top_p = probs.gather(1, top_e);
    }
    if (ctx.routing) {
        ctx.routing->experts.push_back(top_e.detach().to(torch::kCPU));
        ctx.routing->probs.push_back(probs.detach().to(torch::kCPU));
    }
    const torch::Tensor weights = top_p / top_p.sum(-1, true).clamp_min(6.103515625e-5f);  // f32

    // Tokens of each expert: sort the (token, slot) pairs by expert once.
    const int64_t N = xf.size(0), E = hp.n_expert, n_pairs = top_e.numel();
    const torch::Tensor flat_e = top_e.reshape({-1}).to(torch::kCPU);
    const torch::Tensor order = flat_e.argsort();
    const torch::Tensor counts = torch::bincount(flat_e, {}, E);
    // The experts this batch routes to, ascending; only their weights are formed (the student mixes only them).
    std::vector<int64_t> used;
    for (int64_t e = 0; e < E; ++e) {
        if (counts.data_ptr<int64_t>()[e] > 0) {
            used.push_back(e);
        }
    }
    const int64_t U = static_cast<int64_t>(used.size());
    const bool compact = U < E && routed_experts_only();
    const torch::Tensor used_ids = torch::tensor(used, torch::kLong);
    const auto expert_weights = [&](const std::string & name) {
        return (compact ? ctx.w.experts(name, used_ids) : ctx.w.get(name)).to(x.device(), ctx.dtype);
    };
    // Gate and up as two 3-D tensors, or fused in one (ffn_gate_up_exps: per expert the n_ff_exp gate rows first, as
    // build_moe_ffn's views of gate_up take them). Indexed by j, the j-th used expert, when compact; else by expert.
    const std::string fused = prefix + ".ffn_gate_up_exps.weight";
    const bool is_fused = ctx.w.has(fused);
    torch::Tensor w_gate, w_up;
    if (is_fused) {
        const std::vector<torch::Tensor> parts = expert_weights(fused).chunk(2, 1);
        w_gate = parts[0];
        w_up = parts[1];
    } else {
        w_gate = expert_weights(prefix + ".ffn_gate_exps.weight");
        w_up = expert_weights(prefix + ".ffn_up_exps.weight");
    }
    const torch::Tensor w_down = expert_weights(prefix + ".ffn_down_exps.weight");
    // What the observer sees of expert e, as MUL_MAT_ID feeds it: xe, its tokens' inputs to gate and up, and h, their
    // input to down.
    const bool observed = ctx.observer && *ctx.observer;
    const auto observe_expert = [&](int64_t e, const torch::Tensor & xe, const torch::Tensor & h) {
        if (is_fused) {
            (*ctx.observer)(fused, xe, e);
        } else {
            (*ctx.observer)(prefix + ".ffn_gate_exps.weight", xe, e);
            (*ctx.observer)(prefix + ".ffn_up_exps.weight", xe, e);
        }
        (*ctx.observer)(prefix + ".ffn_down_exps.weight", h, e);
    };
    const int64_t * cnt = counts.data_ptr<int64_t>();
    const torch::Tensor order_dev = order.to(x.device());
    const torch::Tensor tokens = torch::div(order_dev, hp.n_expert_used, "floor");  // [N·k] token of each pair
    const torch::Tensor pair_w = weights.reshape({-1}).index_select(0, order_dev);  // [N·k]
    const int64_t most = counts.max().item<int64_t>();
    // Rows of the batched products: every used expert (compact) or every expert, each padded to `most`.
    const int64_t G = compact ? U : E;
    const expert_products mode = expert_products_mode();
    if (mode == expert_products::grouped || (mode == expert_products::automatic && G * most <= 2 * n_pairs)) {
        // Grouped: every expert's tokens padded to the busiest expert's count, [G, most, n_embd], and each of the three
        // tensors is one batched product (three launches instead of 3·E). Padding rows read a zero row and carry
        // weight 0. Taken when the padding at most doubles the rows; a skewed routing takes the loop below.
        std::vector<int64_t> slot(static_cast<size_t>(n_pairs));
        for (int64_t j = 0, i = 0; j < U; ++j) {
            const int64_t e = used[static_cast<size_t>(j)], g = compact ? j : e;
            for (int64_t r = 0; r < cnt[e]; ++r, ++i) {
                slot[static_cast<size_t>(i)] = g * most + r;
            }
        }
        const torch::Tensor where = torch::tensor(slot, torch::kLong).to(x.device());
        const torch::Tensor idx = torch::full({G * most}, N, where.options()).index_put_({where}, tokens);
        const torch::Tensor w_pad =
            torch::zeros({G * most}, pair_w.options()).index_put_({where}, pair_w).unsqueeze(1);
        const torch::Tensor x_pad =
            torch::cat({xf, torch::zeros({1, n_embd}, xf.options())}).index_select(0, idx).view({G, most, n_embd});
        const torch::Tensor h =
            torch::silu(torch::bmm(x_pad, w_gate.transpose(1, 2))) * torch::bmm(x_pad, w_up.transpose(1, 2));
        for (int64_t j = 0; observed && j < U; ++j) {
            const int64_t e = used[static_cast<size_t>(j)], g = compact ? j : e;
            observe_expert(e, x_pad[g].narrow(0, 0, cnt[e]), h[g].narrow(0, 0, cnt[e]));
        }
        const torch::Tensor y = torch::bmm(h, w_down.transpose(1, 2)).reshape({G * most, n_embd}).to(torch::kFloat) * w_pad;
        const torch::Tensor out = torch::zeros({N + 1, n_embd}, xf.options().dtype(torch::kFloat)).index_add(0, idx, y);
        return out.narrow(0, 0, N).to(ctx.dtype).view_as(x);
    }
    // Per expert: one product per expert and tensor, over its tokens only.
    torch::Tensor out = torch::zeros(xf.sizes(), xf.options().dtype(torch::kFloat));  // summed in f32, as ggml_add
    int64_t start = 0;
    for (int64_t j = 0; j < U; ++j) {
        const int64_t e = used[static_cast<size_t>(j)], g = compact ? j : e, n = cnt[e];
        const torch::Tensor rows = tokens.narrow(0, start, n);
        const torch::Tensor xe = xf.index_select(0, rows);
        const torch::Tensor h = torch::silu(torch::matmul(xe, w_gate[g].t())) * torch::matmul(xe, w_up[g].t());
        if (observed) {
            observe_expert(e, xe, h);
        }
        const torch::Tensor y =
            torch::matmul(h, w_down[g].t()).to(torch::kFloat) * pair_w.narrow(0, start, n).unsqueeze(1);
        out = out.index_add(0, rows, y);
        start += n;
    }
    return out.to(ctx.dtype).view_as(x);
}

namespace {
std::atomic<expert_products> g_expert_products{expert_products::automatic};
std::atomic<bool> g_routed_experts_only{true};
}  // namespace

void set_expert_products(expert_products mode) { g_expert_products = mode; }
void set_routed_experts_only(bool on) { g_routed_experts_only = on; }
bool routed_experts_only() { return g_routed_experts_only; }
expert_products expert_products_mode() { return g_expert_products; }

torch::Tensor fused_swiglu_mlp(forward_context & ctx, const std::string & prefix, const torch::Tensor & x) {
    const std::vector<torch::Tensor> gate_up = linear(ctx, prefix + ".ffn_up.weight", x).chunk(2, -1);
    return linear(ctx, prefix + ".ffn_down.weight", torch::silu(gate_up[0]) * gate_up[1]);
}

torch::Tensor geglu_mlp(forward_context & ctx, const std::string & prefix, const torch::Tensor & x) {
    const torch::Tensor gate = linear(ctx, prefix + ".ffn_gate.weight", x);
    const torch::Tensor up = linear(ctx, prefix + ".ffn_up.weight", x);
    const torch::Tensor act = torch::gelu(gate.to(torch::kFloat), "tanh").to(up.scalar_type());
    return linear(ctx, prefix + ".ffn_down.weight", act * up);
}

torch::Tensor causal_conv1d(const torch::Tensor & x, const torch::Tensor & w) {
    using torch::indexing::Slice;
    const int64_t T = x.size(1), L = w.size(1);
    // Left-pad with the zero state (d_conv = L − 1 positions), then one shifted product per tap, in ggml's order.
    const torch::Tensor padded = torch::constant_pad_nd(x.to(torch::kFloat), {0, 0, L - 1, 0});
    const torch::Tensor wf = w.to(x.device(), torch::kFloat);
    torch::Tensor y = padded.index({Slice(), Slice(0, T)}) * wf.select(1, 0);
    for (int64_t k = 1; k < L; ++k) {
        y = y + padded.index({Slice(), Slice(k, k + T)}) * wf.select(1, k);
    }
    return y;
}

torch::Tensor gated_short_conv(forward_context & ctx, const std::string & prefix, const torch::Tensor & x) {
    // b, c, h: [B, T, n_embd] each, in in_proj's row order
    const std::vector<torch::Tensor> bch = linear(ctx, prefix + ".shortconv.in_proj.weight", x).chunk(3, -1);
    const torch::Tensor conv = causal_conv1d(bch[0] * bch[2], ctx.w.get(prefix + ".shortconv.conv.weight"));
    const torch::Tensor y = (bch[1].to(torch::kFloat) * conv).to(ctx.dtype);
    return linear(ctx, prefix + ".shortconv.out_proj.weight", y);
}

torch::Tensor gated_delta_rule(const torch::Tensor & q, const torch::Tensor & k, const torch::Tensor & v,
                               const torch::Tensor & g, const torch::Tensor & beta, int64_t chunk) {
    using torch::indexing::Slice;
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), d_k = q.size(3), d_v = v.size(3);
    const int64_t pad = (chunk - T % chunk) % chunk, N = (T + pad) / chunk, C = chunk;
    // [B, T, H, d] → [B, H, N, C, d] f32; padding goes after the last token, so it changes no output.
    auto chunks = [&](const torch::Tensor & x) {
        const torch::Tensor xf = x.to(torch::kFloat).transpose(1, 2);
        return torch::constant_pad_nd(xf, {0, 0, 0, pad}).reshape({B, H, N, C, xf.size(-1)});
    };
    const torch::Tensor qc = chunks(q) * (1.0f / std::sqrt(static_cast<float>(d_k)));
    const torch::Tensor kc = chunks(k), vc = chunks(v);
    const torch::Tensor bc = chunks(beta.unsqueeze(-1));          // [B, H, N, C, 1]
    const torch::Tensor gc = chunks(g.unsqueeze(-1)).squeeze(-1).cumsum(-1);  // [B, H, N, C]: Σ g up to each token

    // decay[i, j] = exp(gc_i − gc_j) for j ≤ i, 0 above the diagonal (masked before exp: no inf · 0).
    const auto opts = torch::TensorOptions().dtype(torch::kBool).device(q.device());
    const torch::Tensor above = torch::ones({C, C}, opts).triu(1), on_or_above = torch::ones({C, C}, opts).triu(0);
    const torch::Tensor decay =
        (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(above, -std::numeric_limits<float>::infinity()).exp();
    // The chunk's tokens through one triangular system: (I + A) [u | w] = [β v | β k exp(gc)], A strictly lower.
    const torch::Tensor kb = kc * bc;
    const torch::Tensor A = (torch::matmul(kb, kc.transpose(-1, -2)) * decay).masked_fill(on_or_above, 0.0);
    const torch::Tensor eye = torch::eye(C, torch::TensorOptions().dtype(torch::kFloat).device(q.device()));
    const torch::Tensor uw = torch::linalg_solve_triangular(eye + A, torch::cat({vc * bc, kb * gc.unsqueeze(-1).exp()}, -1),
                                                            /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
    const torch::Tensor u = uw.index({"...", Slice(0, d_v)}), w = uw.index({"...", Slice(d_v, torch::indexing::None)});
    const torch::Tensor qk = torch::matmul(qc, kc.transpose(-1, -2)) * decay;          // causal, diagonal included
    const torch::Tensor q_decayed = qc * gc.unsqueeze(-1).exp();                        // q_i exp(gc_i)
    const torch::Tensor g_last = gc.index({"...", -1});                                 // [B, H, N]
    const torch::Tensor k_to_end = kc * (g_last.unsqueeze(-1) - gc).exp().unsqueeze(-1);  // k_j exp(gc_last − gc_j)

    // From chunk to chunk the state is affine: with δ_n = u_n − w_n S_n, S_{n+1} = exp(g_last) S_n + k̃_nᵀ δ_n
    // = M_n S_n + b_n, M_n = exp(g_last) I − k̃_nᵀ w_n [d_k, d_k], b_n = k̃_nᵀ u_n [d_k, d_v]. M and b come from two
    // batched products over every chunk, so the sequential part is one batched product-and-add per chunk (N launches
    // forward, not 7·N; and no per-chunk slicing whose backward writes a zero-filled whole tensor per chunk).
    const torch::Tensor k_to_end_t = k_to_end.transpose(-1, -2);                        // [B, H, N, d_k, C]
    const torch::Tensor eye_k = torch::eye(d_k, torch::TensorOptions().dtype(torch::kFloat).device(q.device()));
    const torch::Tensor M = g_last.exp().unsqueeze(-1).unsqueeze(-1) * eye_k - torch::matmul(k_to_end_t, w);
    const torch::Tensor b = torch::matmul(k_to_end_t, u);
    // [N, B·H, d, d'] so that each chunk's slice is one contiguous batch for baddbmm.
    const std::vector<torch::Tensor> M_n = M.permute({2, 0, 1, 3, 4}).reshape({N, B * H, d_k, d_k}).unbind(0);
    const std::vector<torch::Tensor> b_n = b.permute({2, 0, 1, 3, 4}).reshape({N, B * H, d_k, d_v}).unbind(0);
    std::vector<torch::Tensor> states;  // the state before each chunk
    states.reserve(static_cast<size_t>(N));
    states.push_back(torch::zeros({B * H, d_k, d_v}, torch::TensorOptions().dtype(torch::kFloat).device(q.device())));
    for (int64_t n = 0; n + 1 < N; ++n) {
        states.push_back(torch::baddbmm(b_n[static_cast<size_t>(n)], M_n[static_cast<size_t>(n)], states.back()));
    }
    const torch::Tensor S = torch::stack(states, 0).view({N, B, H, d_k, d_v}).permute({1, 2, 0, 3, 4});  // [B, H, N, d_k, d_v]
    // Every chunk's output at once: o = q_decayed S + qk δ, δ = u − w S.
    const torch::Tensor delta = u - torch::matmul(w, S);
    const torch::Tensor o = torch::matmul(q_decayed, S) + torch::matmul(qk, delta);     // [B, H, N, C, d_v]
    // [B, H, N·C, d_v] → [B, T, H, d_v]
    return o.reshape({B, H, N * C, d_v}).index({Slice(), Slice(), Slice(0, T)}).transpose(1, 2);
}

}  // namespace voodoo
