#include "model/hparams.h"

#include "common/error.h"
#include "ggml/gguf.h"
#include "model/gguf_weights.h"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <vector>

namespace voodoo {

const char * rope_type_name(rope_type type) {
    switch (type) {
        case rope_type_norm: return "norm";
        case rope_type_neox: return "neox";
    }
    return "?";
}

metadata_reader::metadata_reader(const gguf_file & file, std::string arch) : file_(file), arch_(std::move(arch)) {}

std::string metadata_reader::key(std::string_view suffix) const { return arch_ + "." + std::string(suffix); }

int64_t metadata_reader::required_positive(std::string_view suffix, std::string_view what) const {
    const std::string k = key(suffix);
    const std::optional<int64_t> v = file_.get_int(k);
    if (!v) {
        fail("'{}': missing metadata key '{}' ({}); a {} GGUF from convert_hf_to_gguf.py has it", file_.path(), k,
             what, arch_);
    }
    if (*v <= 0) {
        fail("'{}': metadata key '{}' ({}) is {}, expected a positive integer", file_.path(), k, what, *v);
    }
    return *v;
}

int64_t metadata_reader::optional_positive(std::string_view suffix, int64_t fallback) const {
    const std::string k = key(suffix);
    const std::optional<int64_t> v = file_.get_int(k);
    if (!v) {
        return fallback;
    }
    if (*v <= 0) {
        fail("'{}': metadata key '{}' is {}, expected a positive integer", file_.path(), k, *v);
    }
    return *v;
}

float metadata_reader::optional_float(std::string_view suffix, float fallback) const {
    const std::string k = key(suffix);
    const std::optional<double> v = file_.get_float(k);
    if (!v) {
        return fallback;
    }
    if (!std::isfinite(*v)) {
        fail("'{}': metadata key '{}' is {}, expected a finite number", file_.path(), k, *v);
    }
    return static_cast<float>(*v);
}

float metadata_reader::required_positive_float(std::string_view suffix, std::string_view what) const {
    const std::string k = key(suffix);
    const std::optional<double> v = file_.get_float(k);
    if (!v) {
        fail("'{}': missing metadata key '{}' ({}); a {} GGUF from convert_hf_to_gguf.py has it", file_.path(), k,
             what, arch_);
    }
    if (!std::isfinite(*v) || *v <= 0) {
        fail("'{}': metadata key '{}' ({}) is {}, expected a positive number", file_.path(), k, what, *v);
    }
    return static_cast<float>(*v);
}

std::optional<std::vector<int64_t>> metadata_reader::per_layer(std::string_view suffix, int64_t n_layer) const {
    const std::string k = key(suffix);
    const int64_t id = file_.find_key(k);
    if (id < 0) {
        return std::nullopt;
    }
    std::vector<int64_t> values;
    if (gguf_get_kv_type(file_.ctx(), id) != GGUF_TYPE_ARRAY) {
        values.assign(static_cast<size_t>(n_layer), *file_.get_int(k));
    } else {
        const nlohmann::json a = file_.kv_json(id);
        if (static_cast<int64_t>(a.size()) != n_layer) {
            fail("'{}': metadata key '{}' has {} entries, expected {}", file_.path(), k, a.size(), n_layer);
        }
        for (const nlohmann::json & v : a) {
            if (!v.is_number_integer() && !v.is_boolean()) {
                fail("'{}': metadata key '{}' must be an array of integers", file_.path(), k);
            }
            values.push_back(v.is_boolean() ? int64_t(v.get<bool>()) : v.get<int64_t>());
        }
    }
    for (const int64_t v : values) {
        if (v < 0) {
            fail("'{}': metadata key '{}' has the entry {}, expected integers >= 0", file_.path(), k, v);
        }
    }
    return values;
}

void expect_tensor_shape(const gguf_file & file, const std::string & name, std::initializer_list<int64_t> ne,
                         std::string_view why) {
    const std::vector<int64_t> want(ne);
    const gguf_tensor * t = file.find_tensor(name);
    if (!t) {
        fail("'{}': missing tensor '{}' (expected shape [{}] from {})", file.path(), name, fmt::join(want, ", "), why);
    }
    const std::vector<int64_t> have(t->shape().begin(), t->shape().end());
    if (have != want) {
        fail("'{}': tensor '{}' has shape [{}] but the metadata says [{}] ({}); the file is inconsistent", file.path(),
             name, fmt::join(have, ", "), fmt::join(want, ", "), why);
    }
}

void tensor_checklist::require(const std::string & name, std::initializer_list<int64_t> ne, std::string_view why) {
    expect_tensor_shape(file_, name, ne, why);
    torch_dtype_of(file_.tensor(name).type, name);
    known_.insert(name);
}

bool tensor_checklist::optional(const std::string & name, std::initializer_list<int64_t> ne, std::string_view why) {
    if (!file_.find_tensor(name)) {
        return false;
    }
    require(name, ne, why);
    return true;
}

void tensor_checklist::refuse_others(const model_hparams & hp) const {
    for (const gguf_tensor & t : file_.tensors()) {
        if (!known_.count(t.name)) {
            fail("'{}': tensor '{}' is not part of a {}-layer {} model (is {}.block_count right?)", file_.path(), t.name,
                 hp.n_layer, hp.arch, hp.arch);
        }
    }
}

namespace {

/// lfm2's head_count_kv array: 0 = a recurrent layer; the attention layers' common KV head count.
int64_t read_hybrid_head_count_kv(const metadata_reader & md, model_hparams & hp) {
    const std::string k = md.key("attention.head_count_kv");
    const std::optional<std::vector<int64_t>> per_layer = md.per_layer("attention.head_count_kv", hp.n_layer);
    if (!per_layer) {
        fail("'{}': missing metadata key '{}' (per layer: 0 for a recurrent layer, else the KV heads); a {} GGUF "
             "from convert_hf_to_gguf.py has it", md.file().path(), k, hp.arch);
    }
    int64_t n_head_kv = 0;
    for (const int64_t v : *per_layer) {
        hp.recurrent_layers.push_back(v == 0);
        if (v != 0 && n_head_kv != 0 && v != n_head_kv) {
            fail("'{}': metadata key '{}' gives attention layers {} and {} KV heads; attention layers with different "
                 "KV head counts are not supported", md.file().path(), k, n_head_kv, v);
        }
        n_head_kv = v != 0 ? v : n_head_kv;
    }
    if (n_head_kv == 0) {
        fail("'{}': metadata key '{}' is 0 for every layer: a model without an attention layer is not a {}",
             md.file().path(), k, hp.arch);
    }
    return n_head_kv;
}

}  // namespace

model_hparams read_llama_like_hparams(const gguf_file & file, rope_type rope, bool hybrid_head_count_kv, bool experts) {
    model_hparams hp;
    hp.arch = file.architecture();
    const metadata_reader md(file, hp.arch);
    hp.rope = rope;

    hp.n_ctx_train = md.required_positive("context_length", "the training context");
    hp.n_ctx_orig = md.optional_positive("rope.scaling.original_context_length", hp.n_ctx_train);
    hp.n_embd = md.required_positive("embedding_length", "the model width n_embd");
    hp.n_layer = md.required_positive("block_count", "the number of layers");
    hp.n_ff = experts ? md.optional_positive("feed_forward_length", 0)
                      : md.required_positive("feed_forward_length", "the FFN width n_ff");
    hp.n_head = md.required_positive("attention.head_count", "the number of attention heads");
    hp.n_head_kv = hybrid_head_count_kv ? read_hybrid_head_count_kv(md, hp) : md.optional_positive("attention.head_count_kv", hp.n_head);
    if (hp.n_head % hp.n_head_kv != 0) {
        fail("'{}': '{}' = {} is not a multiple of '{}' = {}: grouped-query attention needs whole groups",
             file.path(), md.key("attention.head_count"), hp.n_head, md.key("attention.head_count_kv"), hp.n_head_kv);
    }
    const bool explicit_k = file.find_key(md.key("attention.key_length")) >= 0;
    const bool explicit_v = file.find_key(md.key("attention.value_length")) >= 0;
    if ((!explicit_k || !explicit_v) && hp.n_embd % hp.n_head != 0) {
        fail("'{}': '{}' = {} is not divisible by '{}' = {}, and '{}' does not give the head size", file.path(),
             md.key("embedding_length"), hp.n_embd, md.key("attention.head_count"), hp.n_head,
             md.key(explicit_k ? "attention.value_length" : "attention.key_length"));
    }
    hp.n_embd_head_k = md.optional_positive("attention.key_length", hp.n_embd / hp.n_head);
    hp.n_embd_head_v = md.optional_positive("attention.value_length", hp.n_embd / hp.n_head);
    hp.n_rot = md.optional_positive("rope.dimension_count", hp.n_embd_head_k);
    if (hp.n_rot % 2 != 0 || hp.n_rot > hp.n_embd_head_k) {
        fail("'{}': '{}' = {} must be even and at most the head size {}", file.path(), md.key("rope.dimension_count"),
             hp.n_rot, hp.n_embd_head_k);
    }
    hp.norm_rms_eps = md.required_positive_float("attention.layer_norm_rms_epsilon", "the RMSNorm epsilon");

    if (const std::optional<int64_t> n_expert = file.get_int(md.key("expert_count")); !experts && n_expert && *n_expert > 0) {
        fail("'{}': '{}' = {}: a mixture of experts is not a {} model; Voodoo runs the qwen3moe and qwen35moe "
             "mixtures (their own architectures)", file.path(), md.key("expert_count"), *n_expert, hp.arch);
    }

    // Rope: llama.cpp's defaults (freq_base 10000, scaling "linear" with factor 1).
    hp.rope_freq_base = md.optional_float("rope.freq_base", 10000.0f);
    if (hp.rope_freq_base <= 0.0f) {
        fail("'{}': metadata key '{}' is {}, expected a positive number", file.path(), md.key("rope.freq_base"),
             hp.rope_freq_base);
    }
    const std::string scaling = file.get_string(md.key("rope.scaling.type")).value_or("linear");
    if (scaling == "yarn" || scaling == "longrope") {
        fail("'{}': '{}' = '{}' is not supported yet; supported rope scaling types: none, linear", file.path(),
             md.key("rope.scaling.type"), scaling);
    }
    if (scaling != "none" && scaling != "linear") {
        fail("'{}': unknown rope scaling type '{}' in '{}'; llama.cpp knows none, linear, yarn, longrope", file.path(),
             scaling, md.key("rope.scaling.type"));
    }
    float factor = md.optional_float("rope.scaling.factor", 0.0f);
    if (factor == 0.0f) {
        factor = md.optional_float("rope.scale_linear", 0.0f);
    }
    if (factor < 0.0f) {
        fail("'{}': metadata key '{}' is {}, expected a positive number", file.path(), md.key("rope.scaling.factor"),
             factor);
    }
    hp.rope_freq_scale = (scaling == "none" || factor == 0.0f) ? 1.0f : 1.0f / factor;
    hp.rope_attn_factor = md.optional_float("rope.scaling.attn_factor", 1.0f);
    hp.has_rope_freqs = file.find_tensor("rope_freqs.weight") != nullptr;

    hp.kq_scale = 1.0f / std::sqrt(static_cast<float>(hp.n_embd_head_k));

    // The vocabulary: token_embd's rows, which must agree with the tokenizer (llama.cpp sizes token_embd
    // by the tokenizer's token count).
    const gguf_tensor & embd = file.tensor("token_embd.weight");
    if (embd.n_dims != 2 || embd.ne[0] != hp.n_embd) {
        fail("'{}': tensor 'token_embd.weight' has shape [{}] but '{}' = {} says it is [{}, n_vocab]", file.path(),
             fmt::join(embd.shape(), ", "), md.key("embedding_length"), hp.n_embd, hp.n_embd);
    }
    hp.n_vocab = embd.ne[1];
    if (const int64_t id = file.find_key("tokenizer.ggml.tokens"); id >= 0 && gguf_get_kv_type(file.ctx(), id) == GGUF_TYPE_ARRAY) {
        const int64_t n_tokens = static_cast<int64_t>(gguf_get_arr_n(file.ctx(), id));
        if (n_tokens != hp.n_vocab) {
            fail("'{}': 'tokenizer.ggml.tokens' has {} tokens but tensor 'token_embd.weight' has {} rows", file.path(),
                 n_tokens, hp.n_vocab);
        }
    }
    if (const std::optional<int64_t> v = file.get_int(md.key("vocab_size")); v && *v != hp.n_vocab) {
        fail("'{}': metadata key '{}' = {} but tensor 'token_embd.weight' has {} rows", file.path(),
             md.key("vocab_size"), *v, hp.n_vocab);
    }
    hp.tied_output = file.find_tensor("output.weight") == nullptr;
    return hp;
}

void read_expert_hparams(const gguf_file & file, model_hparams & hp) {
    const metadata_reader md(file, hp.arch);
    hp.n_expert = md.required_positive("expert_count", "the number of experts");
    constexpr int64_t k_max_experts = 1024;  // llama.cpp's LLAMA_MAX_EXPERTS
    if (hp.n_expert > k_max_experts) {
        fail("'{}': '{}' = {} is more than llama.cpp's {} experts", file.path(), md.key("expert_count"), hp.n_expert,
             k_max_experts);
    }
    const std::optional<std::vector<int64_t>> used = md.per_layer("expert_used_count", hp.n_layer);
    if (!used) {
        fail("'{}': missing metadata key '{}' (experts per token); a {} GGUF from convert_hf_to_gguf.py has it",
             file.path(), md.key("expert_used_count"), hp.arch);
    }
    hp.n_expert_used = used->front();
    for (const int64_t v : *used) {
        if (v != hp.n_expert_used) {
            fail("'{}': metadata key '{}' gives layers {} and {} experts per token; a per-layer count is not "
                 "supported", file.path(), md.key("expert_used_count"), hp.n_expert_used, v);
        }
    }
    if (hp.n_expert_used < 1 || hp.n_expert_used > hp.n_expert) {
        fail("'{}': metadata key '{}' = {} must be in [1, '{}' = {}]", file.path(), md.key("expert_used_count"),
             hp.n_expert_used, md.key("expert_count"), hp.n_expert);
    }
    if (const std::optional<int64_t> groups = file.get_int(md.key("expert_group_count")); groups && *groups > 1) {
        fail("'{}': '{}' = {}: grouped expert routing is not supported", file.path(), md.key("expert_group_count"),
             *groups);
    }
    const int64_t fallback = hp.n_ff / hp.n_expert_used;
    hp.n_ff_exp = md.optional_positive("expert_feed_forward_length", fallback);
    if (hp.n_ff_exp <= 0) {
        fail("'{}': missing metadata key '{}' (and no '{}' to derive it from)", file.path(),
             md.key("expert_feed_forward_length"), md.key("feed_forward_length"));
    }
    hp.n_ff_shexp = md.optional_positive("expert_shared_feed_forward_length", hp.n_ff);
}

}  // namespace voodoo
