// A model's hyper-parameters, read from its GGUF metadata with llama.cpp's key names and defaults
// (src/llama-model.cpp, llama_model_base::load_hparams), validated so that a bad file is a
// voodoo::error naming the key, never a wrong forward.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace voodoo {

class gguf_file;

/// How rotary embedding pairs the values of a head (ggml's GGML_ROPE_TYPE_*).
enum rope_type {
    rope_type_norm,  // adjacent pairs (x[2i], x[2i+1]): llama.cpp's LLAMA_ROPE_TYPE_NORM (llama, mistral)
    rope_type_neox,  // halves (x[i], x[i + n_rot/2]): LLAMA_ROPE_TYPE_NEOX (qwen2/3, phi3, gemma, …)
};

/// "norm" or "neox".
const char * rope_type_name(rope_type type);

/// What a forward needs to know of a decoder-only transformer. Plain data.
struct model_hparams {
    std::string arch;               // general.architecture, e.g. "llama"
    int64_t n_vocab = 0;            // rows of token_embd.weight
    int64_t n_ctx_train = 0;        // <arch>.context_length
    int64_t n_embd = 0;             // <arch>.embedding_length
    int64_t n_layer = 0;            // <arch>.block_count
    int64_t n_head = 0;             // <arch>.attention.head_count
    int64_t n_head_kv = 0;          // <arch>.attention.head_count_kv (default n_head)
    int64_t n_embd_head_k = 0;      // <arch>.attention.key_length (default n_embd / n_head)
    int64_t n_embd_head_v = 0;      // <arch>.attention.value_length (default n_embd / n_head)
    int64_t n_rot = 0;              // <arch>.rope.dimension_count (default n_embd_head_k)
    int64_t n_ff = 0;               // <arch>.feed_forward_length
    float norm_rms_eps = 0.0f;      // <arch>.attention.layer_norm_rms_epsilon
    rope_type rope = rope_type_norm;
    float rope_freq_base = 10000.0f;  // <arch>.rope.freq_base (llama.cpp's default 10000)
    float rope_freq_scale = 1.0f;     // 1 / <arch>.rope.scaling.factor for "linear" scaling, else 1
    float rope_attn_factor = 1.0f;    // <arch>.rope.scaling.attn_factor: multiplies cos and sin
    bool has_rope_freqs = false;      // rope_freqs.weight present (Llama 3.1 frequency factors)
    float kq_scale = 0.0f;            // attention logits scale: <arch>.attention.scale or 1/sqrt(n_embd_head_k)
    bool tied_output = false;         // no output.weight: the head reuses token_embd.weight

    // Sliding-window attention (gemma3): layer il attends only to the last n_swa positions when swa_layers[il].
    int64_t n_swa = 0;                 // <arch>.attention.sliding_window; 0 = every layer global
    std::vector<bool> swa_layers;      // per layer (empty = none): from <arch>.attention.sliding_window_pattern
    float rope_freq_base_swa = 10000.0f;  // <arch>.rope.freq_base_swa: the sliding layers' rope base
    float rope_freq_scale_swa = 1.0f;     // sliding layers are never rope-scaled (llama.cpp's rope_freq_scale_train_swa)
    float final_logit_softcap = 0.0f;     // <arch>.final_logit_softcapping: logits = c · tanh(logits / c); 0 = none
    int64_t n_ctx_orig = 0;               // <arch>.rope.scaling.original_context_length (default n_ctx_train)

    // Hybrid models (lfm2, qwen35): layers whose token mixer is recurrent (a short convolution, a gated delta net).
    std::vector<bool> recurrent_layers;   // per layer (empty = every layer attends): head_count_kv 0 in the array
    int64_t n_shortconv_l_cache = 0;      // lfm2: <arch>.shortconv.l_cache, the short convolution's kernel length

    // Gated delta net layers (qwen35): the <arch>.ssm.* keys llama_model_qwen35::load_arch_hparams reads.
    int64_t ssm_d_conv = 0;   // ssm.conv_kernel: taps of the causal convolution over Q, K and V
    int64_t ssm_d_state = 0;  // ssm.state_size: the key (and value) head size
    int64_t ssm_n_group = 0;  // ssm.group_count: key heads
    int64_t ssm_dt_rank = 0;  // ssm.time_step_rank: value heads
    int64_t ssm_d_inner = 0;  // ssm.inner_size: value heads × value head size
    std::vector<int64_t> rope_sections;  // rope.dimension_sections (qwen35's M-RoPE): 4 counts of rotated pairs

    // Mixture of experts (qwen3moe, qwen35moe): llama.cpp's build_moe_ffn with softmax gating, the top
    // n_expert_used experts of each token, their weights renormalised to sum 1 (norm_w, as both graphs pass it).
    int64_t n_expert = 0;        // <arch>.expert_count; 0 = a dense model
    int64_t n_expert_used = 0;   // <arch>.expert_used_count: experts per token
    int64_t n_ff_exp = 0;        // <arch>.expert_feed_forward_length (default n_ff / n_expert_used)
    int64_t n_ff_shexp = 0;      // <arch>.expert_shared_feed_forward_length (qwen35moe; default n_ff)

    bool is_swa(int64_t il) const { return n_swa > 0 && il < static_cast<int64_t>(swa_layers.size()) && swa_layers[il]; }
    bool is_recurrent(int64_t il) const { return il < static_cast<int64_t>(recurrent_layers.size()) && recurrent_layers[il]; }

    int64_t n_embd_q() const { return n_embd_head_k * n_head; }
    int64_t n_embd_k_gqa() const { return n_embd_head_k * n_head_kv; }
    int64_t n_embd_v_gqa() const { return n_embd_head_v * n_head_kv; }
};

/// Reads `<arch>.*` keys of a GGUF with the checks llama.cpp makes (and the asserts it would abort on),
/// naming the file and key in every error.
class metadata_reader {
public:
    metadata_reader(const gguf_file & file, std::string arch);

    const gguf_file & file() const { return file_; }
    /// "<arch>.<suffix>".
    std::string key(std::string_view suffix) const;
    /// A positive integer; throws voodoo::error naming the key (and `what` it means) when absent,
    /// not an integer (a per-layer array included) or not positive.
    int64_t required_positive(std::string_view suffix, std::string_view what) const;
    /// Like required_positive, `fallback` when absent.
    int64_t optional_positive(std::string_view suffix, int64_t fallback) const;
    /// A finite float; `fallback` when absent. Throws when present but not a number or not finite.
    float optional_float(std::string_view suffix, float fallback) const;
    /// A finite float > 0; throws naming the key when absent.
    float required_positive_float(std::string_view suffix, std::string_view what) const;
    /// A per-layer (or per-section) integer key as llama.cpp's get_key_or_arr reads it: a scalar repeated n_layer
    /// times, or an array of exactly n_layer integers ≥ 0 (booleans count as 0/1); nullopt when absent. Throws
    /// naming the key on another type, a negative entry or an array of another length.
    std::optional<std::vector<int64_t>> per_layer(std::string_view suffix, int64_t n_layer) const;

private:
    const gguf_file & file_;
    std::string arch_;
};

/// The hyper-parameters every llama-like architecture shares (llama, mistral, qwen2/3, …): sizes,
/// heads, head dims, rms eps, rope base and scaling, attention scale, vocab and tied output, for
/// the rope pairing `rope` (llama.cpp's llama_model_rope_type of the architecture).
/// Rope scaling types other than "none" and "linear" (yarn, longrope) are refused with an error naming
/// `<arch>.rope.scaling.type`; unknown ones too. Throws voodoo::error naming the key on anything missing
/// or inconsistent (n_embd not divisible by n_head without explicit key_length, n_head not a multiple of
/// n_head_kv, n_rot odd or larger than the head, vocab size disagreeing with the tokenizer).
/// With `hybrid_head_count_kv` (lfm2), `<arch>.attention.head_count_kv` may be a per-layer array as
/// llama_model_lfm2::load_arch_hparams reads it: 0 marks a recurrent layer (hp.recurrent_layers), every other
/// entry must be the same KV head count (n_head_kv); an error names the key when they differ or none attends.
/// With `experts` (a mixture-of-experts architecture), expert_count is allowed (read_expert_hparams reads it) and
/// feed_forward_length may be absent (n_ff = 0); otherwise a file with expert_count > 0 is refused naming the key.
model_hparams read_llama_like_hparams(const gguf_file & file, rope_type rope, bool hybrid_head_count_kv = false,
                                     bool experts = false);

/// The expert keys of a mixture-of-experts architecture (llama.cpp's llama_model_base::load_hparams and the
/// architecture's load_arch_hparams): expert_count (1 to 1024, LLAMA_MAX_EXPERTS), expert_used_count (1 to
/// expert_count; one value for every layer), expert_feed_forward_length (default feed_forward_length /
/// expert_used_count), expert_shared_feed_forward_length (default feed_forward_length). Expert groups
/// (expert_group_count > 1, DeepSeek's group routing) are refused. Throws voodoo::error naming the key.
void read_expert_hparams(const gguf_file & file, model_hparams & hp);

/// The tensors a model reads, checked one by one against the shapes its metadata implies, then the whole
/// file against that list: llama.cpp refuses a file with a tensor its architecture does not load, and so
/// do we (a wrong block_count, a bias the graph would ignore).
class tensor_checklist {
public:
    explicit tensor_checklist(const gguf_file & file) : file_(file) {}
    /// The tensor must exist with ggml shape `ne` and a weight type (F32/F16/BF16/quantized).
    void require(const std::string & name, std::initializer_list<int64_t> ne, std::string_view why);
    /// Like require when the file has it; returns whether it does.
    bool optional(const std::string & name, std::initializer_list<int64_t> ne, std::string_view why);
    /// Throws voodoo::error naming the first tensor of the file that was neither required nor optional.
    void refuse_others(const model_hparams & hp) const;

private:
    const gguf_file & file_;
    std::set<std::string> known_;
};

/// Checks that tensor `name` exists with exactly the ggml shape `ne` (ne0 first). Throws voodoo::error
/// naming the file, the tensor, its shape, the expected shape and `why` (the keys it follows from).
void expect_tensor_shape(const gguf_file & file, const std::string & name, std::initializer_list<int64_t> ne,
                         std::string_view why);

}  // namespace voodoo
