#include "model/parity.h"

#include "common/error.h"
#include "common/torch_info.h"
#include "ggml/gguf.h"
#include "ggml/llama_logits.h"
#include "model/gguf_weights.h"
#include "model/registry.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <random>
#include <sstream>

namespace voodoo {

namespace {

/// The widest rounding among the matmul weights (2-D tensors): quantized > BF16 > F16 > F32.
std::string weight_class(const gguf_file & file) {
    int rank = 0;
    for (const gguf_tensor & t : file.tensors()) {
        if (t.n_dims < 2) {
            continue;
        }
        const int r = t.type == GGML_TYPE_F32 ? 0 : t.type == GGML_TYPE_F16 ? 1 : t.type == GGML_TYPE_BF16 ? 2 : 3;
        rank = std::max(rank, r);
    }
    static const char * names[] = {"F32", "F16", "BF16", "quantized"};
    return names[rank];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

double parity_bound(const std::string & weight_types) {
    if (weight_types == "F32") {
        return 1e-3;
    }
    if (weight_types == "F16") {
        return 1e-2;
    }
    if (weight_types == "BF16") {
        return 3e-2;
    }
    return 1e-1;
}

parity_report check_parity(const std::string & path, const parity_options & options) {
    if (options.n_tokens < 1) {
        fail("--tokens must be at least 1, got {}", options.n_tokens);
    }
    set_torch_threads(options.n_threads);
    const gguf_file file(path);
    std::unique_ptr<causal_lm> model = build_model(file);
    const llama_reference reference(path, options.n_threads);

    parity_report r;
    r.path = path;
    r.arch = model->hparams().arch;
    r.weight_types = weight_class(file);
    r.n_tokens = options.n_tokens;
    r.n_vocab = model->hparams().n_vocab;
    if (reference.n_vocab() != r.n_vocab) {
        fail("'{}': libllama sees {} tokens, token_embd.weight has {} rows", path, reference.n_vocab(), r.n_vocab);
    }

    std::vector<int32_t> tokens;
    if (!options.text_path.empty()) {
        std::ifstream in(options.text_path, std::ios::binary);
        if (!in) {
            fail("--text: cannot read '{}'", options.text_path);
        }
        std::stringstream text;
        text << in.rdbuf();
        tokens = reference.tokenize(text.str());
        if (static_cast<int64_t>(tokens.size()) < options.n_tokens) {
            fail("--text '{}' gives {} tokens, fewer than --tokens {}; give a longer text or fewer tokens",
                 options.text_path, tokens.size(), options.n_tokens);
        }
        tokens.resize(static_cast<size_t>(options.n_tokens));
    } else {
        std::mt19937 rng(20240611);
        std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(r.n_vocab - 1));
        for (int64_t i = 0; i < options.n_tokens; ++i) {
            tokens.push_back(id(rng));
        }
    }

    auto t0 = std::chrono::steady_clock::now();
    const bool moe = model->hparams().n_expert > 0;
    std::vector<std::vector<int32_t>> their_experts;
    const std::vector<float> ref = moe ? reference.logits(tokens, their_experts) : reference.logits(tokens);
    r.seconds_llama = seconds_since(t0);

    // A mixture of experts runs libllama's routing: a decision near a tie flips under any rounding of the router's
    // input (llama.cpp's CPU kernels round the activations of F16/BF16/quantized matmuls), and one flipped token
    // moves its logits by far more than the bound, which is about the arithmetic. Whether our router agrees is
    // reported beside it.
    expert_routing ours_routing;
    if (moe) {
        std::vector<torch::Tensor> forced;
        for (const std::vector<int32_t> & e : their_experts) {
            forced.push_back(torch::tensor(e, torch::kInt).to(torch::kLong).view({options.n_tokens, -1}));
        }
        model->set_forced_experts(std::move(forced));
        model->set_routing_log(&ours_routing);
    }
    t0 = std::chrono::steady_clock::now();
    gguf_weights weights(file, torch::kCPU, options.n_threads);
    torch::Tensor ours;
    {
        torch::NoGradGuard no_grad;
        const torch::Tensor ids = torch::tensor(std::vector<int64_t>(tokens.begin(), tokens.end())).view({1, -1});
        ours = model->forward(ids, weights)[0];
    }
    r.seconds_torch = seconds_since(t0);
    if (moe) {
        model->set_routing_log(nullptr);
        if (ours_routing.probs.size() != their_experts.size()) {
            fail("'{}': libllama routed {} MoE layers, the LibTorch forward {}", path, their_experts.size(),
                 ours_routing.probs.size());
        }
        const int64_t k = model->hparams().n_expert_used;
        for (size_t l = 0; l < ours_routing.probs.size(); ++l) {
            // Our router's own choice on the same inputs, against libllama's.
            const torch::Tensor p = ours_routing.probs[l];
            const torch::Tensor mine = std::get<0>(std::get<1>(torch::topk(p, k, -1)).sort(-1));
            const torch::Tensor theirs = std::get<0>(ours_routing.experts[l].sort(-1));
            for (int64_t t = 0; t < options.n_tokens; ++t) {
                ++r.routing_decisions;
                if (mine[t].equal(theirs[t])) {
                    ++r.routing_agree;
                    continue;
                }
                // How far from a tie the disagreement is: the least p of our extra experts minus the most p of theirs.
                const torch::Tensor in_mine = torch::zeros({p.size(1)}, torch::kBool).index_fill_(0, mine[t], true);
                const torch::Tensor in_theirs = torch::zeros({p.size(1)}, torch::kBool).index_fill_(0, theirs[t], true);
                const torch::Tensor only_mine = in_mine & ~in_theirs, only_theirs = in_theirs & ~in_mine;
                const double margin = p[t].masked_select(only_mine).min().item<double>() -
                                      p[t].masked_select(only_theirs).max().item<double>();
                r.routing_max_flip_margin = std::max(r.routing_max_flip_margin, margin);
            }
        }
    }

    const torch::Tensor theirs =
        torch::from_blob(const_cast<float *>(ref.data()), {options.n_tokens, r.n_vocab}, torch::kFloat);
    r.max_abs_diff = (ours - theirs).abs().max().item<double>();
    r.max_abs_logit = theirs.abs().max().item<double>();
    r.rel_diff = r.max_abs_logit > 0 ? r.max_abs_diff / r.max_abs_logit : r.max_abs_diff;
    r.same_top_pct = 100.0 * ours.argmax(-1).eq(theirs.argmax(-1)).to(torch::kDouble).mean().item<double>();
    r.bound = parity_bound(r.weight_types);
    r.within = r.rel_diff <= r.bound;
    return r;
}

nlohmann::json parity_to_json(const parity_report & r) {
    return {
        {"path", r.path},
        {"arch", r.arch},
        {"weight_types", r.weight_types},
        {"n_tokens", r.n_tokens},
        {"n_vocab", r.n_vocab},
        {"max_abs_diff", r.max_abs_diff},
        {"max_abs_logit", r.max_abs_logit},
        {"rel_diff", r.rel_diff},
        {"same_top_pct", r.same_top_pct},
        {"bound", r.bound},
        {"within", r.within},
        {"routing_decisions", r.routing_decisions},
        {"routing_agree", r.routing_agree},
        {"routing_max_flip_margin", r.routing_max_flip_margin},
        {"seconds_torch", r.seconds_torch},
        {"seconds_llama", r.seconds_llama},
    };
}

std::string parity_to_text(const parity_report & r) {
    return fmt::format(
        "model:          {} ({}, {} weights, vocab {})\n"
        "tokens:         {} (teacher forcing, every position)\n"
        "max |Δlogit|:   {:.3g}  (max |logit| {:.3g})\n"
        "relative:       {:.3g}  (bound {:.0e} for {} weights)\n"
        "same top token: {:.2f}%\n"
        "time:           LibTorch {:.2f} s, libllama {:.2f} s\n"
        "{}{}\n",
        r.path, r.arch, r.weight_types, r.n_vocab, r.n_tokens, r.max_abs_diff, r.max_abs_logit, r.rel_diff, r.bound,
        r.weight_types, r.same_top_pct, r.seconds_torch, r.seconds_llama,
        r.routing_decisions == 0
            ? std::string()
            : fmt::format("experts:        libllama's routing in both; ours chose the same experts in {} of {} "
                          "decisions ({:.2f}%){}\n",
                          r.routing_agree, r.routing_decisions, 100.0 * r.routing_agree / r.routing_decisions,
                          r.routing_agree == r.routing_decisions
                              ? ""
                              : fmt::format(", the others within {:.2g} of a tie in router probability",
                                            r.routing_max_flip_margin)),
        r.within ? "parity: yes, within the bound" : "parity: NO, outside the bound");
}

}  // namespace voodoo
