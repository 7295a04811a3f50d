#include "train/probe.h"

#include "common/error.h"
#include "common/file.h"
#include "common/progress.h"
#include "dist/dist.h"
#include "ggml/types.h"
#include "model/replaced_weight.h"
#include "train/candidates.h"
#include "train/loss.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <unordered_map>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace voodoo {

namespace {

// The model in `dtype` (f32: the probe measures differences far below bf16's rounding) for the lifetime of
// this object.
class dtype_scope {
public:
    dtype_scope(causal_lm & m, torch::ScalarType dtype) : model_(m), saved_(m.compute_dtype()) {
        model_.set_compute_dtype(dtype);
    }
    ~dtype_scope() { model_.set_compute_dtype(saved_); }
    dtype_scope(const dtype_scope &) = delete;
    dtype_scope & operator=(const dtype_scope &) = delete;

private:
    causal_lm & model_;
    torch::ScalarType saved_;
};

std::vector<int64_t> torch_shape(const gated_tensor & g) {
    std::vector<int64_t> shape;
    for (int d = g.tensor->n_dims - 1; d >= 0; --d) {
        shape.push_back(g.tensor->ne[static_cast<size_t>(d)]);
    }
    return shape;
}

// `base` with any number of tensors answered by given ones: a whole one-hot recipe.
class chosen_weights : public weight_source {
public:
    explicit chosen_weights(weight_source & base) : base_(base) {}
    void set(const std::string & name, torch::Tensor w) { w_[name] = std::move(w); }
    torch::Tensor get(const std::string & name) override {
        const auto it = w_.find(name);
        return it != w_.end() ? it->second : base_.get(name);
    }
    torch::Tensor rows(const std::string & name, const torch::Tensor & ids) override {
        const auto it = w_.find(name);
        return it != w_.end() ? it->second.index_select(0, ids.reshape({-1})) : base_.rows(name, ids);
    }
    bool has(const std::string & name) const override { return base_.has(name); }

private:
    weight_source & base_;
    std::unordered_map<std::string, torch::Tensor> w_;
};

// Mean KL(teacher ‖ student) per position of the student's hidden states h_s (of weights w) against the teacher's h_t.
double kl_of(causal_lm & model, const torch::Tensor & h_s, weight_source & w, const torch::Tensor & h_t,
             weight_source & teacher, const torch::Tensor & tokens, int64_t chunk) {
    return chunked_distill(model, h_s, w, h_t, teacher, tokens, 1.0, 0.0, chunk).kl;
}

// The teacher's log-probabilities on the probe tokens, computed once: every candidate's KL compares with the
// same ones, and the teacher's head is as large a matmul as the student's. Kept when they fit in `max_bytes`
// (f32 [positions, n_vocab]); else cached() is false and each KL recomputes them (kl_of).
class teacher_logp {
public:
    teacher_logp(causal_lm & model, const torch::Tensor & h_t, weight_source & teacher, int64_t chunk,
                 int64_t max_bytes = int64_t(2) << 30)
        : chunk_(chunk) {
        const int64_t n = h_t.size(0) * h_t.size(1);
        if (n * model.hparams().n_vocab * 4 > max_bytes) {
            return;
        }
        const torch::Tensor ht = h_t.reshape({n, h_t.size(2)});
        for (int64_t a = 0; a < n; a += chunk) {
            logp_.push_back(torch::log_softmax(model.head(ht.slice(0, a, std::min(n, a + chunk)), teacher).to(torch::kFloat), -1));
        }
    }
    bool cached() const { return !logp_.empty(); }
    // Mean KL(teacher ‖ student) per position, the same sum as chunked_distill's (f64 accumulation of f32 chunks).
    double kl(causal_lm & model, const torch::Tensor & h_s, weight_source & w) const {
        const int64_t n = h_s.size(0) * h_s.size(1);
        const torch::Tensor hs = h_s.reshape({n, h_s.size(2)});
        double sum = 0;
        for (size_t c = 0; c < logp_.size(); ++c) {
            const int64_t a = static_cast<int64_t>(c) * chunk_;
            const torch::Tensor s_logp =
                torch::log_softmax(model.head(hs.slice(0, a, std::min(n, a + chunk_)), w).to(torch::kFloat), -1);
            sum += (logp_[c].exp() * (logp_[c] - s_logp)).sum().to(torch::kDouble).item<double>();
        }
        return sum / static_cast<double>(n);
    }

private:
    int64_t chunk_;
    std::vector<torch::Tensor> logp_;
};

// Where a candidate's forward may start. A tensor of layer l ("blk.l.…") changes nothing before layer l, so the
// student's hidden states are the source model's residual stream entering layer l run through layers l … n_layer − 1
// (causal_lm::hidden_layers, the same arithmetic as hidden(), so the same bits); a head of its own changes only the
// logits. The stream is kept at every `stride`-th layer, the stride the least that keeps it within `max_bytes`.
class source_streams {
public:
    source_streams(causal_lm & model, const torch::Tensor & tokens, weight_source & dense, int64_t max_bytes)
        : n_layer_(model.hparams().n_layer) {
        const int64_t per_layer = tokens.numel() * model.hparams().n_embd * torch::elementSize(model.compute_dtype());
        stride_ = std::max<int64_t>(1, (per_layer * n_layer_ + max_bytes - 1) / std::max<int64_t>(1, max_bytes));
        torch::Tensor x;  // undefined: layer 0 starts from the token embeddings
        for (int64_t a = 0; a < n_layer_; a += stride_) {
            at_.push_back(x);
            x = model.hidden_layers(tokens, x, a, std::min(n_layer_, a + stride_), dense);
        }
        final_ = x;
    }

    /// The hidden states (after the output norm) of `w`, the source model but for tensor `name`, which is w's.
    torch::Tensor hidden(causal_lm & model, const torch::Tensor & tokens, const std::string & name, weight_source & w) const {
        if (name == "output.weight" && model.head_weight() == name) {
            return final_;
        }
        const int64_t l = layer_of(name);
        if (l < stride_ || l >= n_layer_) {
            return model.hidden(tokens, w);
        }
        const int64_t a = l / stride_ * stride_;
        return model.hidden_layers(tokens, at_[static_cast<size_t>(a / stride_)], a, n_layer_, w);
    }
    /// The source model's own hidden states (after the output norm).
    const torch::Tensor & final_hidden() const { return final_; }

    /// l of "blk.l.…", else −1.
    static int64_t layer_of(const std::string & name) {
        if (name.rfind("blk.", 0) != 0) {
            return -1;
        }
        int64_t l = 0;
        size_t i = 4;
        for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) {
            l = l * 10 + (name[i] - '0');
        }
        return i > 4 && i < name.size() && name[i] == '.' ? l : -1;
    }

private:
    int64_t n_layer_ = 0, stride_ = 1;
    std::vector<torch::Tensor> at_;
    torch::Tensor final_;
};

// Layer sharding (issue #17): a stream [B, T, n_embd] in the model's compute dtype on the tokens' device, the shape
// of what one rank passes to the next.
torch::Tensor empty_stream(causal_lm & model, const torch::Tensor & tokens) {
    return torch::empty({tokens.size(0), tokens.size(1), model.hparams().n_embd},
                        torch::TensorOptions().dtype(model.compute_dtype()).device(tokens.device()));
}

// Messages between neighbouring ranks of the probe's pipeline (Gloo tells them apart; NCCL keeps their order).
enum : int { teacher_stream_tag = 21, source_stream_tag = 22, candidate_stream_tag = 23 };

// One forward of `w` rank to rank: this rank's layers on the stream received from the rank before (the first rank from
// the tokens), passed on to the next. Returns this rank's result: on the last rank hidden(tokens, w) bit for bit.
torch::Tensor pipeline_hidden(causal_lm & model, const torch::Tensor & tokens, weight_source & w,
                              const dist::layer_pipeline & p, int tag) {
    const int rank = p.rank(), size = p.size();
    const auto [first, end] = p.mine();
    torch::Tensor in;
    if (rank > 0) {
        in = empty_stream(model, tokens);
        p.pg->recv(in, rank - 1, tag);
    }
    torch::Tensor out = model.hidden_layers(tokens, in, first, end, w);
    if (rank < size - 1) {
        p.pg->send(out, rank + 1, tag);
    }
    return out;
}

// source_streams for one rank of a pipeline: the source model's stream entering every `stride`-th of this rank's
// layers (counted from its first), and what its last layer gives (on the last rank, the output norm's result).
class rank_streams {
public:
    rank_streams(causal_lm & model, const torch::Tensor & tokens, weight_source & dense, const dist::layer_pipeline & p,
                 int64_t max_bytes)
        : range_(p.mine()) {
        const auto [first, end] = range_;
        const int64_t per_layer = tokens.numel() * model.hparams().n_embd * torch::elementSize(model.compute_dtype());
        stride_ = std::max<int64_t>(1, (per_layer * (end - first) + max_bytes - 1) / std::max<int64_t>(1, max_bytes));
        torch::Tensor x;
        if (p.rank() > 0) {
            x = empty_stream(model, tokens);
            p.pg->recv(x, p.rank() - 1, source_stream_tag);
        }
        for (int64_t a = first; a < end; a += stride_) {
            at_.push_back(x);
            x = model.hidden_layers(tokens, x, a, std::min(end, a + stride_), dense);
        }
        if (p.rank() < p.size() - 1) {
            p.pg->send(x, p.rank() + 1, source_stream_tag);
        }
        last_ = x;
    }
    // This rank's part of the forward of `w` that differs from the source's from layer l on (l in this rank's range),
    // from the kept stream at or below l.
    torch::Tensor from_layer(causal_lm & model, const torch::Tensor & tokens, int64_t l, weight_source & w) const {
        const int64_t j = (l - range_.first) / stride_;
        return model.hidden_layers(tokens, at_[static_cast<size_t>(j)], range_.first + j * stride_, range_.second, w);
    }
    const torch::Tensor & last() const { return last_; }
    void drop_last() { last_ = torch::Tensor(); }

private:
    std::pair<int64_t, int64_t> range_;
    int64_t stride_ = 1;
    std::vector<torch::Tensor> at_;
    torch::Tensor last_;
};

// "blk.l.…" → l, else −1.
int64_t layer_of_tensor(const std::string & name) { return source_streams::layer_of(name); }

// Every rank's values of `out` where `measured` is true, from the one rank that computed each (`mine`): one all-reduce
// adds only zeros to each value, so every rank ends with the computing rank's bits.
void gather_measured(dist::process_group & pg, std::vector<std::vector<double>> & out,
                     const std::function<bool(size_t, size_t)> & measured, const std::function<bool(size_t, size_t)> & mine) {
    std::vector<double> flat;
    for (size_t i = 0; i < out.size(); ++i) {
        for (size_t k = 0; k < out[i].size(); ++k) {
            flat.push_back(measured(i, k) && mine(i, k) ? out[i][k] : 0.0);
        }
    }
    std::vector<torch::Tensor> all{torch::tensor(flat, torch::kDouble)};
    pg.all_reduce_sum(all);
    const double * v = all[0].data_ptr<double>();
    for (size_t i = 0, at = 0; i < out.size(); ++i) {
        for (size_t k = 0; k < out[i].size(); ++k, ++at) {
            if (measured(i, k)) {
                out[i][k] = v[at];
            }
        }
    }
}

// probe_sensitivity over a pipeline of layer-sharded ranks (its doc comment says how).
std::vector<std::vector<double>> probe_pipelined(causal_lm & model, weight_source & dense, weight_source & teacher,
                                                 const std::vector<gated_tensor> & gated, const torch::Tensor & tokens,
                                                 torch::Device device, int64_t chunk,
                                                 const std::function<bool(size_t, size_t)> & wanted,
                                                 std::vector<std::vector<double>> out, int64_t stream_bytes,
                                                 const dist::layer_pipeline & p, const std::function<void()> & check_stop) {
    const int rank = p.rank(), last = p.size() - 1;
    int64_t n_mine = 0;  // the candidates whose forward passes through this rank
    for (size_t i = 0; i < gated.size(); ++i) {
        for (size_t k = 0; k < gated[i].types.size(); ++k) {
            n_mine += wanted(i, k) && p.start_of(gated[i].tensor->name) <= rank;
        }
    }
    torch::Tensor h_t = pipeline_hidden(model, tokens, teacher, p, teacher_stream_tag);
    rank_streams streams(model, tokens, dense, p, stream_bytes);
    if (rank != last) {  // only the last rank compares logits: the others' ends of the two streams were passed on
        h_t = torch::Tensor();
        streams.drop_last();
    }
    std::optional<teacher_logp> t_logp;
    double base = 0;
    auto kl = [&](const torch::Tensor & h_s, weight_source & w) {
        return t_logp->cached() ? t_logp->kl(model, h_s, w) : kl_of(model, h_s, w, h_t, teacher, tokens, chunk);
    };
    if (rank == last) {
        t_logp.emplace(model, h_t, teacher, chunk);
        base = kl(streams.last(), dense);
    }
    progress bar("probe", n_mine, "cand");
    replaced_weight swap(dense);
    for (size_t i = 0; i < gated.size(); ++i) {
        const gated_tensor & g = gated[i];
        const std::string & name = g.tensor->name;
        const int start = p.start_of(name);
        for (size_t k = 0; k < g.types.size(); ++k) {
            if (!wanted(i, k) || rank < start) {
                continue;
            }
            check_stop();
            swap.set(name, p.uses(name) ? candidate_weights(g, k, device).view(torch_shape(g)) : torch::Tensor());
            torch::Tensor h;
            if (rank > start) {
                torch::Tensor in = empty_stream(model, tokens);
                p.pg->recv(in, rank - 1, candidate_stream_tag);
                h = model.hidden_layers(tokens, in, p.mine().first, p.mine().second, swap);
            } else if (const int64_t l = layer_of_tensor(name); l >= 0) {
                h = streams.from_layer(model, tokens, l, swap);
            } else if (rank == last && start == last) {
                h = streams.last();  // an untied head: only the logits change
            } else {
                h = model.hidden_layers(tokens, torch::Tensor(), 0, p.mine().second, swap);  // the embedding
            }
            if (rank < last) {
                p.pg->send(h, rank + 1, candidate_stream_tag);
            } else {
                out[i][k] = kl(h, swap) - base;
            }
            bar.add(1);
        }
    }
    bar.finish();
    gather_measured(*p.pg, out, wanted, [&](size_t, size_t) { return rank == last; });
    return out;
}

}  // namespace

double probe_forward_share(const gguf_file & file, const std::string & tensor) {
    const bool tied = file.find_tensor("output.weight") == nullptr;
    const std::string head = tied ? "token_embd.weight" : "output.weight";
    std::map<int64_t, double> layer;  // matrix weights per layer
    double head_weights = 0;
    for (const gguf_tensor & t : file.tensors()) {
        if (t.n_dims < 2) {
            continue;
        }
        if (const int64_t l = layer_of_tensor(t.name); l >= 0) {
            layer[l] += static_cast<double>(t.n_elements());
        } else if (t.name == head) {
            head_weights = static_cast<double>(t.n_elements());
        }
    }
    double total = head_weights, from = head_weights;
    const int64_t own = layer_of_tensor(tensor);
    for (const auto & [l, w] : layer) {
        total += w;
        from += l >= own ? w : 0.0;
    }
    if (total <= 0) {
        return 1.0;
    }
    if (own < 0) {
        return tensor == "output.weight" && !tied ? head_weights / total : 1.0;
    }
    return from / total;
}

std::vector<std::vector<double>> probe_sensitivity(causal_lm & model, weight_source & dense, weight_source & teacher,
                                                   const std::vector<gated_tensor> & gated,
                                                   const torch::Tensor & tokens, torch::Device device, int64_t chunk,
                                                   torch::ScalarType dtype,
                                                   const std::vector<std::vector<bool>> * measure, int64_t stream_bytes,
                                                   const dist::layer_pipeline * pipe, const std::function<bool()> & stop,
                                                   const std::function<void(size_t)> & ready, const char * name) {
    if (measure && measure->size() != gated.size()) {
        fail("probe_sensitivity: a plan of {} tensors for {} gated tensors", measure->size(), gated.size());
    }
    auto wanted = [&](size_t i, size_t k) { return !measure || ((*measure)[i].size() > k && (*measure)[i][k]); };
    int64_t n_candidates = 0;
    std::vector<std::vector<double>> out;
    for (size_t i = 0; i < gated.size(); ++i) {
        out.emplace_back(gated[i].types.size(), std::numeric_limits<double>::quiet_NaN());
        for (size_t k = 0; k < gated[i].types.size(); ++k) {
            n_candidates += wanted(i, k);
        }
    }
    if (n_candidates == 0) {
        return out;  // nothing to measure: no forward, no progress bar
    }
    torch::NoGradGuard no_grad;
    dtype_scope scope(model, dtype);
    int64_t measured = 0;
    const auto check_stop = [&] {
        if (stop && stop()) {
            throw stopped(fmt::format("stopped during {}, after {} of {} candidates' forwards; run the same command "
                                      "again: the candidates are kept, and the probe starts over", name, measured,
                                      n_candidates));
        }
        ++measured;
    };
    if (pipe && pipe->size() > 1) {
        if (ready) {
            fail("probe_sensitivity: candidates made ready during the probe need one process, not a pipeline of {} ranks",
                 pipe->size());
        }
        return probe_pipelined(model, dense, teacher, gated, tokens, device, chunk, wanted, std::move(out), stream_bytes,
                               *pipe, check_stop);
    }
    const torch::Tensor h_t = model.hidden(tokens, teacher);
    const teacher_logp t_logp(model, h_t, teacher, chunk);
    const source_streams streams(model, tokens, dense, stream_bytes);
    auto kl = [&](const torch::Tensor & h_s, weight_source & w) {
        return t_logp.cached() ? t_logp.kl(model, h_s, w) : kl_of(model, h_s, w, h_t, teacher, tokens, chunk);
    };
    const double base = kl(streams.final_hidden(), dense);
    progress bar("probe", n_candidates, "cand");
    replaced_weight swap(dense);  // the source model with one tensor as one candidate
    for (size_t i = 0; i < gated.size(); ++i) {
        const gated_tensor & g = gated[i];
        bool asked = false;
        for (size_t k = 0; k < g.types.size(); ++k) {
            if (wanted(i, k)) {
                check_stop();
                if (ready && !asked) {
                    ready(i);
                    asked = true;
                }
                swap.set(g.tensor->name, candidate_weights(g, k, device).view(torch_shape(g)));
                out[i][k] = kl(streams.hidden(model, tokens, g.tensor->name, swap), swap) - base;
                bar.add(1);
            }
        }
    }
    bar.finish();
    return out;
}

std::vector<std::vector<double>> weighted_errors(weight_source & dense, const std::vector<gated_tensor> & gated,
                                                 const importance_map * importance, torch::Device device,
                                                 const dist::layer_pipeline * pipe) {
    torch::NoGradGuard no_grad;
    std::vector<std::vector<double>> out;
    const bool split = pipe && pipe->size() > 1;
    const auto owned = [&](size_t i) { return !split || pipe->owner_of(gated[i].tensor->name) == pipe->rank(); };
    for (const gated_tensor & g : gated) {
        if (!owned(out.size())) {
            out.emplace_back(g.types.size(), 0.0);  // another rank's: its values come with the all-reduce below
            continue;
        }
        const int64_t ne0 = g.tensor->ne[0];
        const int64_t experts = g.tensor->n_dims >= 3 ? g.tensor->ne[2] : 1;
        const torch::Tensor w = dense.get(g.tensor->name).to(device, torch::kFloat).reshape({experts, -1, ne0});
        const std::span<const float> imp = importance_for(importance, *g.tensor);
        const torch::Tensor a = imp.empty()
                                    ? torch::ones({1, 1, ne0}, torch::TensorOptions().device(device))
                                    : torch::from_blob(const_cast<float *>(imp.data()), {experts, 1, ne0}, torch::kFloat)
                                          .to(device, torch::kFloat, false, true);
        std::vector<double> row;
        for (size_t k = 0; k < g.types.size(); ++k) {
            const torch::Tensor d = candidate_weights(g, k, device).reshape({experts, -1, ne0}) - w;
            row.push_back((d.square() * a).sum(torch::kDouble).item<double>());
        }
        out.push_back(std::move(row));
    }
    if (split) {
        gather_measured(*pipe->pg, out, [](size_t, size_t) { return true; }, [&](size_t i, size_t) { return owned(i); });
    }
    return out;
}

std::vector<size_t> spread_in_log_error(std::vector<size_t> live, const std::vector<double> & e, int n) {
    std::stable_sort(live.begin(), live.end(), [&](size_t x, size_t y) { return e[x] > e[y]; });
    if (n <= 0 || static_cast<size_t>(n) >= live.size()) {
        return live;
    }
    // Targets evenly spaced in log e from the largest to the least (one: the largest); each takes the nearest unused.
    const double hi = std::log(e[live.front()]), lo = std::log(e[live.back()]);
    std::vector<bool> used(live.size(), false);
    std::vector<size_t> out;
    for (int a = 0; a < n; ++a) {
        const double want = n == 1 ? hi : hi + (lo - hi) * a / (n - 1);
        size_t best = live.size();
        for (size_t j = 0; j < live.size(); ++j) {
            if (!used[j] && (best == live.size() ||
                             std::abs(std::log(e[live[j]]) - want) < std::abs(std::log(e[live[best]]) - want))) {
                best = j;
            }
        }
        used[best] = true;
        out.push_back(live[best]);
    }
    return out;
}

std::vector<std::vector<bool>> anchor_plan(const std::vector<gated_tensor> & gated,
                                           const std::vector<std::vector<double>> & err, int n_anchors) {
    std::vector<std::vector<bool>> plan;
    for (size_t i = 0; i < err.size(); ++i) {
        const std::vector<double> & e = err[i];
        const auto is_float = [&](size_t k) {
            const ggml_type t = gated[i].types[k];
            return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
        };
        if (n_anchors <= 0) {
            std::vector<bool> row(e.size());
            for (size_t k = 0; k < e.size(); ++k) {
                row[k] = e[k] > 0;
            }
            plan.push_back(std::move(row));
            continue;
        }
        bool has_block = false;
        for (size_t k = 0; k < e.size(); ++k) {
            has_block = has_block || (e[k] > 0 && !is_float(k));
        }
        // Anchors among the block types with E > 0, largest E first. A float type of a float source (F16 of a
        // BF16 file) differs from it in a few rounded values: its ΔKL is below what the probe resolves, so it
        // is predicted, not measured, unless the menu has no block type.
        std::vector<size_t> live;
        for (size_t k = 0; k < e.size(); ++k) {
            if (e[k] > 0 && (!has_block || !is_float(k))) {
                live.push_back(k);
            }
        }
        std::vector<bool> row(e.size(), false);
        for (size_t k : spread_in_log_error(live, e, n_anchors)) {
            row[k] = true;
        }
        plan.push_back(std::move(row));
    }
    return plan;
}

void predict_from_anchors(const std::vector<gated_tensor> & gated, const std::vector<std::vector<double>> & err,
                          std::vector<std::vector<double>> & sens) {
    for (size_t i = 0; i < sens.size(); ++i) {
        const std::vector<double> & e = err[i];
        std::vector<std::pair<double, double>> known;  // (log E, ΔKL/E) of the measured types with E > 0
        for (size_t k = 0; k < e.size(); ++k) {
            if (e[k] > 0 && !std::isnan(sens[i][k])) {
                known.emplace_back(std::log(e[k]), sens[i][k] / e[k]);
            }
        }
        std::sort(known.begin(), known.end());
        for (size_t k = 0; k < e.size(); ++k) {
            if (!std::isnan(sens[i][k])) {
                continue;
            }
            if (e[k] <= 0) {
                sens[i][k] = 0.0;
                continue;
            }
            if (known.empty()) {
                fail("tensor '{}': the anchored probe measured none of its types, so {} cannot be predicted",
                     gated[i].tensor->name, type_name(gated[i].types[k]));
            }
            const double x = std::log(e[k]);
            double r;
            if (x <= known.front().first) {
                r = known.front().second;
            } else if (x >= known.back().first) {
                r = known.back().second;
            } else {
                size_t j = 1;
                while (known[j].first < x) {
                    ++j;
                }
                const auto [x0, r0] = known[j - 1];
                const auto [x1, r1] = known[j];
                const double f = (x - x0) / (x1 - x0);
                r = r0 > 0 && r1 > 0 ? std::exp(std::log(r0) + f * (std::log(r1) - std::log(r0))) : r0 + f * (r1 - r0);
            }
            sens[i][k] = r * e[k];
        }
    }
}

tf32_matmul_scope::tf32_matmul_scope(bool on) : on_(on) {
    if (on_) {
        saved_ = at::globalContext().allowTF32CuBLAS();
        at::globalContext().setAllowTF32CuBLAS(true);
    }
}

tf32_matmul_scope::~tf32_matmul_scope() {
    if (on_) {
        at::globalContext().setAllowTF32CuBLAS(saved_);
    }
}

std::string probe_identity(const std::vector<gated_tensor> & gated, const torch::Tensor & tokens,
                           torch::ScalarType dtype, int anchors, bool tf32) {
    XXH3_state_t * st = XXH3_createState();
    XXH3_64bits_reset(st);
    const int32_t dt = static_cast<int32_t>(dtype);
    XXH3_64bits_update(st, &dt, sizeof dt);
    if (tf32) {  // only then, so f32 probes keep the identity they had before TF32 existed
        const int32_t t = 32;
        XXH3_64bits_update(st, &t, sizeof t);
    }
    if (anchors > 0) {  // 0 hashes nothing here, so a full probe and an anchored one of the same candidates differ
        const int32_t a = anchors;
        XXH3_64bits_update(st, &a, sizeof a);
    }
    for (const gated_tensor & g : gated) {
        XXH3_64bits_update(st, g.tensor->name.data(), g.tensor->name.size());
        for (size_t k = 0; k < g.types.size(); ++k) {
            const int32_t type = g.types[k];
            XXH3_64bits_update(st, &type, sizeof type);
            // Each candidate by the xxh3-64 of its bytes (build_candidates keeps it where a layer-sharded rank drops
            // the bytes), so every rank and one process name the same candidates alike.
            const uint64_t h = k < g.hashes.size() ? g.hashes[k] : XXH3_64bits(g.bytes[k].data(), g.bytes[k].size());
            XXH3_64bits_update(st, &h, sizeof h);
        }
    }
    const torch::Tensor t = tokens.to(torch::kCPU, torch::kLong).contiguous();
    XXH3_64bits_update(st, t.data_ptr<int64_t>(), static_cast<size_t>(t.numel()) * sizeof(int64_t));
    const int64_t shape[2] = {t.size(0), t.size(1)};
    XXH3_64bits_update(st, shape, sizeof shape);
    const uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return fmt::format("{:016x}", h);
}

void save_probe(const std::string & path, const std::string & identity, const std::vector<gated_tensor> & gated,
                const std::vector<std::vector<double>> & sens, const std::vector<std::vector<bool>> * measured) {
    nlohmann::json tensors = nlohmann::json::array();
    for (size_t i = 0; i < gated.size(); ++i) {
        nlohmann::json kl = nlohmann::json::object();
        nlohmann::json which = nlohmann::json::array();
        for (size_t k = 0; k < gated[i].types.size(); ++k) {
            kl[type_name(gated[i].types[k])] = sens[i][k];
            if (!measured || (*measured)[i][k]) {
                which.push_back(type_name(gated[i].types[k]));
            }
        }
        tensors.push_back({{"name", gated[i].tensor->name}, {"delta_kl", kl}, {"measured", which}});
    }
    const nlohmann::json j = {{"identity", identity}, {"unit", "nats per token, f32"}, {"tensors", tensors}};
    write_file_atomic(path, j.dump(1) + "\n");
}

probe_anchor_choice resolve_probe_anchors(const std::string & path, const std::string & identity, double eager_seconds,
                                          int64_t eager_forwards, int64_t rest, int eager, double limit_seconds, bool write) {
    probe_anchor_choice c;
    c.seconds_per_forward = std::numeric_limits<double>::quiet_NaN();
    if (eager_seconds >= 0 && eager_forwards > 0) {
        c.seconds_per_forward = eager_seconds / static_cast<double>(eager_forwards);
        if (write) {
            const nlohmann::json j = {{"identity", identity}, {"seconds_per_forward", c.seconds_per_forward},
                                      {"eager_forwards", eager_forwards}, {"eager_seconds", eager_seconds}};
            write_file_atomic(path, j.dump(1) + "\n");
        }
    } else if (std::ifstream in(path); in) {
        nlohmann::json j;
        try {
            j = nlohmann::json::parse(in);
        } catch (const nlohmann::json::exception & e) {
            fail("probe rate file '{}' is not JSON ({}); delete it and the eager probe beside it to measure again", path, e.what());
        }
        if (!j.is_object() || !j.contains("identity") || !j.contains("seconds_per_forward") ||
            !j["seconds_per_forward"].is_number()) {
            fail("probe rate file '{}' has no identity and seconds_per_forward; delete it and the eager probe beside it "
                 "to measure again", path);
        }
        if (j["identity"] == identity) {
            c.seconds_per_forward = j["seconds_per_forward"].get<double>();
        }
    }
    const bool full = rest == 0 || (std::isfinite(c.seconds_per_forward) &&
                                    c.seconds_per_forward * static_cast<double>(rest) <= limit_seconds);
    c.anchors = full ? 0 : eager;
    return c;
}

std::vector<std::vector<double>> load_probe(const std::string & path, const std::string & identity,
                                            const std::vector<gated_tensor> & gated) {
    std::ifstream in(path);
    if (!in) {
        return {};
    }
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception & e) {
        fail("probe file '{}' is not JSON ({}); delete it to measure again", path, e.what());
    }
    if (!j.is_object() || !j.contains("identity") || !j.contains("tensors") || !j["tensors"].is_array()) {
        fail("'{}' is not a probe file (no identity/tensors); delete it to measure again", path);
    }
    if (j["identity"] != identity || j["tensors"].size() != gated.size()) {
        return {};
    }
    std::vector<std::vector<double>> sens;
    for (size_t i = 0; i < gated.size(); ++i) {
        const nlohmann::json & t = j["tensors"][i];
        if (t.value("name", "") != gated[i].tensor->name) {
            return {};
        }
        std::vector<double> row;
        for (ggml_type type : gated[i].types) {
            const auto it = t["delta_kl"].find(type_name(type));
            if (it == t["delta_kl"].end() || !it->is_number()) {
                return {};
            }
            row.push_back(it->get<double>());
        }
        sens.push_back(std::move(row));
    }
    return sens;
}

double recipe_kl(causal_lm & model, weight_source & dense, weight_source & teacher,
                 const std::vector<gated_tensor> & gated, const std::vector<int> & choice,
                 const torch::Tensor & tokens, torch::Device device, int64_t chunk, const dist::layer_pipeline * pipe) {
    if (choice.size() != gated.size()) {
        fail("recipe_kl: {} choices for {} gated tensors", choice.size(), gated.size());
    }
    torch::NoGradGuard no_grad;
    dtype_scope f32(model, torch::kFloat);
    const bool split = pipe && pipe->size() > 1;
    chosen_weights w(dense);
    for (size_t i = 0; i < gated.size(); ++i) {
        if (!split || pipe->uses(gated[i].tensor->name)) {  // a layer-sharded rank: its own layers' candidates only
            w.set(gated[i].tensor->name,
                  candidate_weights(gated[i], static_cast<size_t>(choice[i]), device).view(torch_shape(gated[i])));
        }
    }
    if (!split) {
        const torch::Tensor h_t = model.hidden(tokens, teacher);
        return kl_of(model, model.hidden(tokens, w), w, h_t, teacher, tokens, chunk);
    }
    const torch::Tensor h_t = pipeline_hidden(model, tokens, teacher, *pipe, teacher_stream_tag);
    const torch::Tensor h_s = pipeline_hidden(model, tokens, w, *pipe, candidate_stream_tag);
    std::vector<std::vector<double>> kl{{pipe->rank() == pipe->size() - 1 ? kl_of(model, h_s, w, h_t, teacher, tokens, chunk) : 0.0}};
    gather_measured(*pipe->pg, kl, [](size_t, size_t) { return true; }, [&](size_t, size_t) { return pipe->rank() == pipe->size() - 1; });
    return kl[0][0];
}

}  // namespace voodoo
