// One rank of a layer-sharded or tensor-parallel gate-training run (issue #17), for tests/test_dist.cpp: started once
// without WORLD_SIZE (the single process) and once per rank with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT). Every 2-D weight whose rows take 32-blocks is gated over {Q4_0, Q8_0} with seeded gate logits; `steps`
// AdamW steps of the distillation loss against the source model on fixed tokens; rank 0 writes what the test
// compares: the loss of every step, the layers each rank held, every gate's last gradient and final logits (bits and
// values) and the recipe. The single process also writes what the rounding bounds of the tensor-parallel comparison scale with.
// MODE: layers (layer sharding, the default), tp (tensor parallelism), tp-without-f (tensor parallelism with Megatron's
// f left out: the input gradient of column-parallel layers not summed over ranks, the omission the issue suspects in
// the method's public implementation; the test shows its bound catches it).
// Usage: voodoo-dist-worker MODEL OUT.json STEPS [MODE]
#include "common/heap.h"
#include "dist/dist.h"
#include "ggml/gguf.h"
#include "ggml/types.h"
#include "model/gguf_weights.h"
#include "model/registry.h"
#include "train/candidates.h"
#include "train/gated.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <map>
#include <set>
#include <fstream>
#include <iostream>

using namespace voodoo;

namespace {

std::vector<uint32_t> bits(const torch::Tensor & t) {
    const torch::Tensor c = t.detach().to(torch::kFloat).contiguous();
    std::vector<uint32_t> out(static_cast<size_t>(c.numel()));
    std::memcpy(out.data(), c.data_ptr<float>(), out.size() * 4);
    return out;
}

std::vector<double> values(const torch::Tensor & t) {
    const torch::Tensor c = t.detach().to(torch::kDouble).contiguous();
    return {c.data_ptr<double>(), c.data_ptr<double>() + c.numel()};
}

/// f left out: what a tensor-parallel backward without the all-reduce of the input gradient computes.
class tp_without_f : public dist::group_tensor_parallel {
public:
    using group_tensor_parallel::group_tensor_parallel;
    torch::Tensor copy_to(const torch::Tensor & x) const override { return x; }
};

/// The student with every gated tensor's mixture W answered as a leaf, for the bound pass: after a backward, for each
/// gated tensor, |G| with G = ∂L/∂W as the sum of its terms' magnitudes: Σ_t |∂L/∂y_t|ᵀ|x_t| over the tokens t of
/// every product y = x·Wᵀ, and |∂L/∂row| of every embedding row looked up.
class tapped_weights : public weight_source {
public:
    tapped_weights(gated_weights & w, const std::vector<gated_tensor> & gated) : w_(w) {
        for (const gated_tensor & g : gated) {
            abs_grad_[g.tensor->name] = torch::zeros({g.tensor->ne[1], g.tensor->ne[0]}, torch::kDouble);
        }
    }
    torch::Tensor get(const std::string & name) override {
        return abs_grad_.count(name) ? w_.get(name).detach().requires_grad_(true) : w_.get(name);
    }
    torch::Tensor rows(const std::string & name, const torch::Tensor & ids) override {
        if (!abs_grad_.count(name)) {
            return w_.rows(name, ids);
        }
        torch::Tensor leaf = w_.rows(name, ids).detach().requires_grad_(true);
        torch::Tensor & a = abs_grad_.at(name);
        const torch::Tensor flat = ids.reshape({-1});
        leaf.register_hook([&a, flat](const torch::Tensor & g) { a.index_add_(0, flat, g.abs().to(torch::kDouble)); });
        return leaf;
    }
    bool has(const std::string & name) const override { return w_.has(name); }
    torch::Tensor product_with(const std::string & name, const torch::Tensor & x, const torch::Tensor & w) override {
        torch::Tensor y = torch::matmul(x, w.t());
        if (abs_grad_.count(name) && y.requires_grad()) {
            torch::Tensor & a = abs_grad_.at(name);
            const torch::Tensor xa = x.detach().abs().reshape({-1, x.size(-1)}).to(torch::kDouble);
            y.register_hook([&a, xa](const torch::Tensor & g) {
                a += g.abs().reshape({-1, g.size(-1)}).to(torch::kDouble).t().matmul(xa);
            });
        }
        return y;
    }
    /// Σ of the magnitudes of the terms of ∂L/∂W of tensor `name`, [ne1, ne0] f64.
    const torch::Tensor & abs_grad(const std::string & name) const { return abs_grad_.at(name); }

private:
    gated_weights & w_;
    std::map<std::string, torch::Tensor> abs_grad_;
};

}  // namespace

int main(int argc, char ** argv) try {
    if (argc != 4 && argc != 5) {
        std::cerr << "usage: voodoo-dist-worker MODEL OUT.json STEPS [layers|tp|tp-without-f][-recompute]\n";
        return 2;
    }
    voodoo::keep_freed_memory_in_heap();
    torch::set_num_threads(1);
    const gguf_file file(argv[1]);
    const int steps = std::stoi(argv[3]);
    std::string mode = argc == 5 ? argv[4] : "layers";
    // "-recompute": every forward of the student recomputes its layers in the backward (blocks.h run_layer).
    const bool recompute = mode.ends_with("-recompute");
    if (recompute) {
        mode.resize(mode.size() - std::string("-recompute").size());
    }
    if (mode != "layers" && mode != "tp" && mode != "tp-without-f") {
        std::cerr << "voodoo-dist-worker: MODE must be layers, tp or tp-without-f, not '" << mode << "'\n";
        return 2;
    }
    const bool tensor_parallel = mode != "layers";
    auto model = build_model(file);
    model->set_recompute_layers(recompute);
    const model_hparams hp = model->hparams();  // the whole model's, before any split
    gguf_weights teacher_full(file);

    const std::optional<dist::launch_env> env = dist::launch_env_from_environment();
    std::unique_ptr<dist::process_group> pg;
    if (env && env->world_size > 1) {
        pg = std::make_unique<dist::process_group>(*env);
    }
    const int rank = pg ? pg->rank() : 0, size = pg ? pg->size() : 1;
    std::unique_ptr<dist::group_tensor_parallel> tp;
    if (tensor_parallel && pg) {
        tp = mode == "tp" ? std::make_unique<dist::group_tensor_parallel>(*pg) : std::make_unique<tp_without_f>(*pg);
        model->set_tensor_parallel(tp.get());
    }
    std::unique_ptr<dist::tp_shard_source> teacher_shard;
    if (tp) {
        teacher_shard = std::make_unique<dist::tp_shard_source>(teacher_full, hp.n_vocab, rank, size);
    }
    weight_source & teacher = teacher_shard ? static_cast<weight_source &>(*teacher_shard) : teacher_full;

    std::vector<gated_tensor> gated;
    std::deque<gguf_tensor> shard_shapes;
    for (const gguf_tensor & t : file.tensors()) {
        if (t.n_dims == 2 && t.ne[0] % 32 == 0) {
            gated_tensor g;
            g.tensor = &t;
            g.types = {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0};
            for (const ggml_type type : g.types) {
                g.bytes.push_back(quantize_tensor(file, t, type, {}, {}, 1));
            }
            gated.push_back(tp ? dist::shard_gated_tensor(g, rank, size, shard_shapes) : std::move(g));
        }
    }
    torch::manual_seed(5);
    std::vector<torch::Tensor> gates;
    for (gated_tensor & g : gated) {
        g.n_threads = 1;
        place_candidates(g, mixture_path::cpu, torch::kCPU, torch::kFloat, torch::kFloat);
        g.gate = torch::randn({2}).requires_grad_(true);
        gates.push_back(g.gate);
    }
    gated_weights student(teacher, gated);

    // Layer sharding: the layers balanced by the elements of their weights (the same for teacher and candidates up to a
    // factor).
    const auto plan = dist::balance_layers_of(file, tensor_parallel ? 1 : size);

    std::vector<int64_t> ids;
    for (int64_t i = 0; i < 2 * 48; ++i) {
        ids.push_back((i * 7919 + 13) % hp.n_vocab);
    }
    const torch::Tensor tokens = torch::tensor(ids, torch::kLong).view({2, 48});
    const int64_t chunk = 40;
    torch::optim::AdamW opt(gates, torch::optim::AdamWOptions(0.05));
    nlohmann::json out = {{"ranks", size}, {"mode", mode}, {"losses", nlohmann::json::array()}, {"layers", nlohmann::json::array()}};
    for (const auto & [a, b] : plan) {
        out["layers"].push_back({a, b});
    }
    for (int s = 0; s < steps; ++s) {
        opt.zero_grad();
        const distill_values v =
            tensor_parallel ? dist::tp_distill_step(*model, tokens, teacher, student, tp.get(), 1.0, chunk, gates)
                            : dist::sharded_distill_step(*model, tokens, teacher, student, pg.get(),
                                                         plan[static_cast<size_t>(tensor_parallel ? 0 : rank)], 1.0, chunk, gates);
        out["losses"].push_back({v.ce, v.kl});
        if (s == steps - 1) {
            out["grads"] = nlohmann::json::array();
            out["grad_values"] = nlohmann::json::array();
            for (const torch::Tensor & g : gates) {
                const torch::Tensor gg = g.grad().defined() ? g.grad() : torch::zeros({2});
                out["grads"].push_back(bits(gg));
                out["grad_values"].push_back(values(gg));
            }
            if (size == 1) {
                // What the bounds of a tensor-parallel run against this one scale with (tests/test_dist.cpp derives
                // them): the length of the longest chain of dependent sums of the forward, and the magnitudes of the
                // terms of each loss and of each gate gradient.
                const int64_t T = tokens.size(1);
                const int64_t per_layer = hp.n_embd * 4 + hp.n_embd_head_k + 2 * T + hp.n_embd_q() + hp.n_ff;
                const int64_t chain_forward = hp.n_layer * per_layer + hp.n_embd + hp.n_vocab;
                out["chain_forward"] = chain_forward;
                tapped_weights tap(student, gated);
                torch::Tensor h_t;
                torch::Tensor z_t, z_s;
                {
                    torch::NoGradGuard no_grad;
                    h_t = model->hidden(tokens, teacher);
                    z_t = model->forward(tokens, teacher).to(torch::kDouble).view({-1, hp.n_vocab});
                    z_s = model->forward(tokens, student).to(torch::kDouble).view({-1, hp.n_vocab});
                }
                chunked_distill(*model, model->hidden(tokens, tap), tap, h_t, teacher, tokens, 1.0, 1.0, chunk);
                // Loss terms: CE's are the log-sum-exp and the target's logit, KL's p_t·(|log p_t| + |log p_s|).
                const torch::Tensor lp_t = torch::log_softmax(z_t, -1), lp_s = torch::log_softmax(z_s, -1);
                const torch::Tensor lse = torch::logsumexp(z_s, -1).view({tokens.size(0), T});
                const torch::Tensor zt = z_s.view({tokens.size(0), T, -1}).slice(1, 0, T - 1)
                                             .gather(2, tokens.slice(1, 1, T).unsqueeze(2)).squeeze(2);
                const double ce_scale = (lse.slice(1, 0, T - 1).abs() + zt.abs()).mean().item<double>();
                const double kl_scale = (lp_t.exp() * (lp_t.abs() + lp_s.abs())).sum(-1).mean().item<double>();
                out["loss_scales"] = {ce_scale, kl_scale};
                out["grad_scales"] = nlohmann::json::array();
                out["grad_local_scales"] = nlohmann::json::array();
                for (size_t i = 0; i < gated.size(); ++i) {
                    const gated_tensor & g = gated[i];
                    const torch::Tensor & A = tap.abs_grad(g.tensor->name);
                    const torch::Tensor p = torch::softmax(gates[i].detach().to(torch::kDouble), 0);
                    const int64_t K = static_cast<int64_t>(g.types.size());
                    std::vector<torch::Tensor> D;
                    for (int64_t k = 0; k < K; ++k) {
                        D.push_back(candidate_weights(g, static_cast<size_t>(k), torch::kCPU).to(torch::kDouble));
                    }
                    // ∂L/∂g_k = p_k Σ_j p_j ⟨G, D_k − D_j⟩: an error δG of G moves it by p_k Σ_j p_j ⟨|δG|, |D_k − D_j|⟩;
                    // and its f32 softmax backward from ∂L/∂p_k = ⟨G, D_k⟩ rounds p_k(|∂L/∂p_k| + Σ_j p_j |∂L/∂p_j|).
                    std::vector<double> through_g, local;
                    torch::Tensor gp = torch::empty({K}, torch::kDouble);
                    for (int64_t k = 0; k < K; ++k) {
                        gp[k] = (A * D[static_cast<size_t>(k)].abs()).sum();
                    }
                    for (int64_t k = 0; k < K; ++k) {
                        double sum = 0;
                        for (int64_t j = 0; j < K; ++j) {
                            sum += p[j].item<double>() * (A * (D[static_cast<size_t>(k)] - D[static_cast<size_t>(j)]).abs()).sum().item<double>();
                        }
                        through_g.push_back(p[k].item<double>() * sum);
                        local.push_back(p[k].item<double>() * (gp[k].item<double>() + (p * gp).sum().item<double>()));
                    }
                    out["grad_scales"].push_back(through_g);
                    out["grad_local_scales"].push_back(local);
                }
            }
        }
        opt.step();
    }
    out["gates"] = nlohmann::json::array();
    out["gate_values"] = nlohmann::json::array();
    out["recipe"] = nlohmann::json::array();
    for (size_t i = 0; i < gated.size(); ++i) {
        out["gates"].push_back(bits(gates[i]));
        out["gate_values"].push_back(values(gates[i]));
        out["recipe"].push_back({gated[i].tensor->name, type_name(gated[i].types[static_cast<size_t>(gates[i].argmax().item<int64_t>())])});
    }
    if (rank == 0) {
        std::ofstream(argv[2]) << out.dump() << "\n";
    }
    if (pg) {
        pg->barrier();
    }
    return 0;
} catch (const std::exception & e) {
    std::cerr << "voodoo-dist-worker: " << e.what() << "\n";
    return 1;
}
