// Parity of the LibTorch forward with libllama: the same tokens through both, every position's logits
// compared. It tells a user whether Voodoo runs their model exactly as llama.cpp does.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>

namespace voodoo {

struct parity_options {
    int64_t n_tokens = 128;     // teacher-forced positions compared
    std::string text_path;      // tokenize this file's text (first n_tokens tokens); empty: fixed pseudo-random ids
    int n_threads = 0;          // 0 = all cores, for both runtimes
};

struct parity_report {
    std::string path;
    std::string arch;
    std::string weight_types;   // the matmul weights' storage class: "F32", "F16", "BF16" or "quantized"
    int64_t n_tokens = 0;
    int64_t n_vocab = 0;
    double max_abs_diff = 0;    // max over positions and vocab of |logit_torch − logit_llama|
    double max_abs_logit = 0;   // max |logit_llama|
    double rel_diff = 0;        // max_abs_diff / max_abs_logit
    double same_top_pct = 0;    // % of positions whose argmax agrees
    double bound = 0;           // rel_diff must be ≤ this (parity_bound of weight_types)
    bool within = false;
    // Mixture of experts: both forwards run libllama's routing (the experts its graph chose, captured); these say
    // whether our router, on the same inputs, chose the same experts. 0 decisions for a dense model.
    int64_t routing_decisions = 0;        // tokens × MoE layers
    int64_t routing_agree = 0;            // decisions whose set of experts is libllama's
    double routing_max_flip_margin = 0;   // over the others: our extra experts' least p − libllama's extra's most p

    double seconds_torch = 0;
    double seconds_llama = 0;
};

/// The bound on max|Δlogit| / max|logit| Voodoo promises for a file whose matmul weights are of class
/// `weight_types` (see docs/ARCHITECTURES.md for why each is what it is): F32 1e-3; F16 and BF16 looser
/// because llama.cpp's CPU kernels round the activations to F16 / BF16 before such a matmul; quantized
/// looser still because they quantize the activations to Q8.
double parity_bound(const std::string & weight_types);

/// Runs the model at `path` through build_model + gguf_weights (f32 compute) and through libllama on the
/// same tokens and compares the logits of every position. A mixture of experts runs libllama's routing in both
/// (routing_* says how often ours agrees). Throws voodoo::error when the model is not
/// supported or is malformed (naming the key or tensor), when libllama cannot run it, or when the text
/// gives fewer than n_tokens tokens.
parity_report check_parity(const std::string & path, const parity_options & options);

/// The report as JSON (every field) and as a few lines of text.
nlohmann::json parity_to_json(const parity_report & report);
std::string parity_to_text(const parity_report & report);

}  // namespace voodoo
