#include "train/loss.h"

#include "common/error.h"
#include "model/replaced_weight.h"

#include <algorithm>

namespace voodoo {

int64_t distill_chunk(int64_t n_vocab, int64_t budget_bytes) {
    return std::max<int64_t>(1, budget_bytes / (4 * std::max<int64_t>(1, n_vocab)));
}

int64_t default_loss_chunk(int64_t n_vocab, bool on_gpu) {
    return distill_chunk(n_vocab, on_gpu ? int64_t(512) << 20 : int64_t(31) << 20);
}

distill_values chunked_distill(causal_lm & model, const torch::Tensor & h_s, weight_source & student,
                               const torch::Tensor & h_t, weight_source & teacher, const torch::Tensor & tokens,
                               double lambda_kl, double scale, int64_t chunk, const torch::Tensor & extra,
                               double lambda_ce) {
    if (h_s.dim() != 3 || h_s.sizes() != h_t.sizes() || tokens.dim() != 2 || tokens.size(0) != h_s.size(0) ||
        tokens.size(1) != h_s.size(1)) {
        fail("chunked_distill: hidden states [B, T, n_embd] of student and teacher and tokens [B, T] must agree");
    }
    if (chunk < 1) {
        fail("chunked_distill: chunk must be at least 1 position (got {})", chunk);
    }
    const int64_t B = h_s.size(0), T = h_s.size(1), D = h_s.size(2), N = B * T;
    const bool backward = scale != 0.0 && h_s.requires_grad();
    const torch::Tensor hs = h_s.reshape({N, D});
    const torch::Tensor ht = h_t.reshape({N, D}).detach();
    // Next-token targets; the last position of each sequence has none (−100 is ignored by nll_loss).
    const torch::Tensor tok = tokens.to(h_s.device(), torch::kLong);
    const torch::Tensor target =
        torch::cat({tok.slice(1, 1, T), torch::full({B, 1}, -100, tok.options())}, 1).reshape({N});
    const double n_ce = static_cast<double>(B * (T - 1)), n_kl = static_cast<double>(N);

    const std::string head = model.head_weight();
    torch::Tensor w_head, w_leaf, hs_leaf;
    if (backward) {
        w_head = student.get(head);
        w_leaf = w_head.detach().requires_grad_(true);
        hs_leaf = hs.detach().requires_grad_(true);
    } else {
        torch::NoGradGuard no_grad;
        w_leaf = student.get(head).detach();
        hs_leaf = hs.detach();
    }
    replaced_weight s_head(student, head, w_leaf);  // the head: a leaf the chunks backpropagate into

    // Tensor parallelism (issue #17): each rank's head gives the logits of its part of the vocabulary; the log-softmax
    // over the whole vocabulary takes a cross-rank log-sum-exp (a max over ranks, then g of the local sums of exp, then
    // f so that the gradient reaching it from every rank's terms is summed), and CE and KL are g of each rank's terms:
    // the same values and gradients as the single process up to the order of the sums (Megatron's vocabulary-parallel
    // cross-entropy, extended to the KL term).
    const tensor_parallel * tp = model.tensor_parallel_group();
    const auto [v_lo, v_hi] = tp ? tp_range(model.hparams().n_vocab, tp->rank(), tp->size()) : std::pair<int64_t, int64_t>{0, 0};
    const auto log_softmax = [&](const torch::Tensor & z) {
        if (!tp) {
            return torch::log_softmax(z, -1);
        }
        const torch::Tensor m = tp->max_over(std::get<0>(z.detach().max(-1, true)));
        const torch::Tensor lse = tp->copy_to(torch::log(tp->reduce_from((z - m).exp().sum(-1, true))) + m);
        return z - lse;
    };
    const auto nll_sum = [&](const torch::Tensor & logp, const torch::Tensor & tgt) {
        if (!tp) {
            return torch::nll_loss(logp, tgt, {}, at::Reduction::Sum, -100);
        }
        const torch::Tensor mine = (tgt >= v_lo).logical_and(tgt < v_hi);
        const torch::Tensor local = torch::where(mine, tgt - v_lo, torch::full_like(tgt, -100));
        return tp->reduce_from(torch::nll_loss(logp, local, {}, at::Reduction::Sum, -100));
    };
    const auto total = [&](const torch::Tensor & x) { return tp ? tp->reduce_from(x) : x; };

    torch::Tensor ce_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(h_s.device()));
    torch::Tensor kl_sum = ce_sum.clone();
    for (int64_t a = 0; a < N; a += chunk) {
        const int64_t b = std::min(N, a + chunk);
        torch::Tensor t_logp;
        {
            torch::NoGradGuard no_grad;
            t_logp = log_softmax(model.head(ht.slice(0, a, b), teacher).to(torch::kFloat));
        }
        torch::AutoGradMode grad_mode(backward);
        const torch::Tensor s_logp = log_softmax(model.head(hs_leaf.slice(0, a, b), s_head).to(torch::kFloat));
        const torch::Tensor ce = nll_sum(s_logp, target.slice(0, a, b));
        const torch::Tensor kl = total((t_logp.exp() * (t_logp - s_logp)).sum());
        if (backward) {
            ((lambda_ce * ce / n_ce + lambda_kl * kl / n_kl) * scale).backward();
        }
        ce_sum += ce.detach().to(torch::kDouble);
        kl_sum += kl.detach().to(torch::kDouble);
    }
    if (backward) {
        std::vector<torch::Tensor> outs = {hs};
        std::vector<torch::Tensor> grads = {hs_leaf.grad()};
        if (w_head.requires_grad()) {  // a gated head; a dense one has nothing to learn
            outs.push_back(w_head);
            grads.push_back(w_leaf.grad());
        }
        if (extra.defined() && extra.requires_grad()) {
            outs.push_back(extra);
            grads.push_back(torch::ones_like(extra));
        }
        torch::autograd::backward(outs, grads);
    } else if (extra.defined() && extra.requires_grad()) {
        extra.backward();
    }
    distill_values v;
    v.ce = ce_sum.item<double>() / n_ce;
    v.kl = kl_sum.item<double>() / n_kl;
    return v;
}

}  // namespace voodoo
