// One rank of a layer-sharded gate-training run (issue #17), for tests/test_dist.cpp: started once without WORLD_SIZE
// (the single process) and once per rank with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
// Every 2-D weight whose rows take 32-blocks is gated over {Q4_0, Q8_0} with seeded gate logits; `steps` AdamW steps of
// the distillation loss against the source model on fixed tokens; the last rank-0 writes what the test compares: the
// loss of every step, the layers each rank held, and the bits of every gate's last gradient and final logits.
// Usage: voodoo-dist-worker MODEL OUT.json STEPS
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

}  // namespace

int main(int argc, char ** argv) try {
    if (argc != 4) {
        std::cerr << "usage: voodoo-dist-worker MODEL OUT.json STEPS\n";
        return 2;
    }
    torch::set_num_threads(1);
    const gguf_file file(argv[1]);
    const int steps = std::stoi(argv[3]);
    auto model = build_model(file);
    const model_hparams & hp = model->hparams();
    gguf_weights teacher(file);

    std::vector<gated_tensor> gated;
    for (const gguf_tensor & t : file.tensors()) {
        if (t.n_dims == 2 && t.ne[0] % 32 == 0) {
            gated_tensor g;
            g.tensor = &t;
            g.types = {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0};
            gated.push_back(std::move(g));
        }
    }
    torch::manual_seed(5);
    std::vector<torch::Tensor> gates;
    for (gated_tensor & g : gated) {
        for (const ggml_type type : g.types) {
            g.bytes.push_back(quantize_tensor(file, *g.tensor, type, {}, {}, 1));
        }
        g.n_threads = 1;
        place_candidates(g, mixture_path::cpu, torch::kCPU, torch::kFloat, torch::kFloat);
        g.gate = torch::randn({2}).requires_grad_(true);
        gates.push_back(g.gate);
    }
    gated_weights student(teacher, gated);

    // The layers by bytes: each layer's weights (the same for teacher and candidates up to a factor).
    std::vector<int64_t> layer_bytes(static_cast<size_t>(hp.n_layer), 0);
    for (const gguf_tensor & t : file.tensors()) {
        if (t.name.rfind("blk.", 0) == 0) {
            layer_bytes[static_cast<size_t>(std::stoll(t.name.substr(4)))] += t.n_elements();
        }
    }
    const std::optional<dist::launch_env> env = dist::launch_env_from_environment();
    std::unique_ptr<dist::process_group> pg;
    if (env && env->world_size > 1) {
        pg = std::make_unique<dist::process_group>(*env);
    }
    const int rank = pg ? pg->rank() : 0, size = pg ? pg->size() : 1;
    const auto plan = dist::balance_layers(layer_bytes, size);

    std::vector<int64_t> ids;
    for (int64_t i = 0; i < 2 * 48; ++i) {
        ids.push_back((i * 7919 + 13) % hp.n_vocab);
    }
    const torch::Tensor tokens = torch::tensor(ids, torch::kLong).view({2, 48});
    torch::optim::AdamW opt(gates, torch::optim::AdamWOptions(0.05));
    nlohmann::json out = {{"ranks", size}, {"losses", nlohmann::json::array()}, {"layers", nlohmann::json::array()}};
    for (const auto & [a, b] : plan) {
        out["layers"].push_back({a, b});
    }
    for (int s = 0; s < steps; ++s) {
        opt.zero_grad();
        const distill_values v =
            dist::sharded_distill_step(*model, tokens, teacher, student, pg.get(), plan[static_cast<size_t>(rank)], 1.0, 40, gates);
        out["losses"].push_back({v.ce, v.kl});
        if (s == steps - 1) {
            out["grads"] = nlohmann::json::array();
            for (const torch::Tensor & g : gates) {
                out["grads"].push_back(g.grad().defined() ? bits(g.grad()) : bits(torch::zeros({2})));
            }
        }
        opt.step();
    }
    out["gates"] = nlohmann::json::array();
    out["recipe"] = nlohmann::json::array();
    for (size_t i = 0; i < gated.size(); ++i) {
        out["gates"].push_back(bits(gates[i]));
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
