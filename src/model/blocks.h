// The blocks every llama-like architecture is built of, once: the weight matmul (with its observer),
// RMSNorm, rotary embedding in llama.cpp's NORM and NEOX pairings, causal grouped-query attention and
// the SwiGLU MLP. Each follows the ggml op llama.cpp's graph uses (named in its comment) so that the
// numbers agree with libllama's.
#pragma once

#include "model/hparams.h"
#include "model/weights.h"

#include <functional>
#include <string>
#include <utility>

namespace voodoo {

/// Called before every matmul with a weight, the output head included, with the weight's GGUF name, the
/// matmul's input [..., ne0] in the compute dtype (e.g. the imatrix cross-check sums x² per column) and the
/// expert: −1 for a 2-D weight; for a 3-D expert tensor (MoE) the expert whose matrix multiplies `input`, which
/// then holds only the rows (tokens) routed to that expert, one row per token, as llama.cpp's MUL_MAT_ID.
using matmul_observer =
    std::function<void(const std::string & weight_name, const torch::Tensor & input, int64_t expert)>;

/// The routing of a mixture-of-experts forward, per MoE layer in the order the forward runs them.
struct expert_routing {
    std::vector<torch::Tensor> experts;  // [N, n_expert_used] int64 per layer (N = B·T tokens), largest weight first
    std::vector<torch::Tensor> probs;    // [N, n_expert] f32 per layer: the router's softmax
};

/// Tensor parallelism (issue #17), Megatron-LM's scheme (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
/// Parameter Language Models Using Model Parallelism", section 3): how one rank of `size` holds a weight.
enum class tp_split {
    replicated,       // every rank holds all of it (norms, rope factors, the biases of row-parallel layers)
    column_parallel,  // the output features (PyTorch rows) split: attn_q/k/v, ffn_gate, ffn_up and their biases
    row_parallel,     // the input features (PyTorch columns, GGUF ne0) split: attn_output, ffn_down
    vocab_parallel,   // the vocabulary split: token_embd (embedding lookup and tied head) and output
};
/// The split of a GGUF tensor name under tensor parallelism, by its llama.cpp name (blk.N.attn_q.weight, …).
tp_split tp_split_of(const std::string & name);

/// [first, end) of `n` items that rank `rank` of `size` holds: contiguous, the first n mod size ranks one more.
std::pair<int64_t, int64_t> tp_range(int64_t n, int rank, int size);

/// The part of tensor `name` that rank `rank` of `size` holds along its split, `n` rows or columns in all: the FFN's
/// intermediate width (ffn_gate/ffn_up rows and biases, ffn_down columns; one split for all three) in whole units of
/// 256 weights when n is a multiple of 256 (every llama.cpp block size divides 256), else of 32, else of 1, so a type
/// that fits the whole tensor fits every rank's part whenever the units allow; everything else as tp_range (heads
/// split evenly).
std::pair<int64_t, int64_t> tp_range_of(const std::string & name, int64_t n, int rank, int size);

/// The communication of one tensor-parallel group, seen by the blocks (src/dist implements it over c10d). Megatron's
/// conjugate pair f and g make every gradient exact: f where a replicated tensor enters rank-local work (the input of
/// a column-parallel layer, the head, the log-sum-exp every rank's logits use), g where rank-local partial results
/// become one replicated tensor (after a row-parallel layer, the vocabulary-parallel embedding, the losses' sums).
class tensor_parallel {
public:
    virtual ~tensor_parallel() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    /// f: identity forward; backward sums the gradient over the ranks.
    virtual torch::Tensor copy_to(const torch::Tensor & x) const = 0;
    /// g: sum over the ranks forward; identity backward.
    virtual torch::Tensor reduce_from(const torch::Tensor & x) const = 0;
    /// Element-wise maximum over the ranks, without gradient (the log-sum-exp's shift).
    virtual torch::Tensor max_over(const torch::Tensor & x) const = 0;
};

/// What the blocks of one forward share.
struct forward_context {
    weight_source & w;
    torch::ScalarType dtype;            // compute dtype: kFloat or kBFloat16
    const matmul_observer * observer;   // nullptr: nobody watches
    /// MoE layers take these experts ([N, n_expert_used] int64 per MoE layer, in order) instead of their own top-k:
    /// the parity check runs libllama's routing. nullptr: each layer routes itself.
    const std::vector<torch::Tensor> * forced_experts = nullptr;
    expert_routing * routing = nullptr;  // when given, each MoE layer appends what it chose
    int64_t moe_layer = 0;               // MoE layers run so far in this forward
    /// Layer sharding (issue #17): the forward runs layers [first_layer, layer_end) only. With `input` it starts from
    /// those hidden states ([B, T, n_embd], the residual stream entering first_layer) instead of the token
    /// embeddings; unless it runs the last layer it returns the residual stream leaving layer_end − 1, before the
    /// output norm. Defaults: every layer, from the tokens.
    const torch::Tensor * input = nullptr;
    int64_t first_layer = 0;
    int64_t end_layer = -1;              // -1: hp.n_layer
    /// Tensor parallelism (issue #17): this rank's group, or nullptr (a single process). With it, `w` answers with
    /// this rank's shards (tp_split_of), the hyper-parameters hold this rank's heads and FFN width, `linear` applies
    /// f before column- and vocabulary-parallel layers and g after row-parallel ones, and the embedding lookup is
    /// vocabulary-parallel.
    const tensor_parallel * tp = nullptr;
    int64_t n_vocab = 0;                 // the whole vocabulary (the vocabulary-parallel lookup's split)
    /// f's last input and output: products sharing one input (Q, K and V; gate and up) share one f, so its backward
    /// all-reduces their summed gradient once.
    torch::Tensor f_in{}, f_out{};
    /// Activation checkpointing (run_layer): the layers keep only their input for the backward and run again there.
    bool recompute = false;
    int64_t layer_end(const model_hparams & hp) const { return end_layer < 0 ? hp.n_layer : end_layer; }
    bool last_stage(const model_hparams & hp) const { return layer_end(hp) == hp.n_layer; }
};

/// One decoder layer: the residual stream entering it → the stream leaving it ([B, T, n_embd], compute dtype), reading
/// its weights through the context it is given. It must not keep the context or the input beyond the call.
using layer_body = std::function<torch::Tensor(forward_context & ctx, const torch::Tensor & x)>;

/// body(ctx, x), with activation checkpointing when ctx.recompute is set, autograd is recording (the probes and the
/// selection run without it) and the forward has no observer, forced experts or routing log (the imatrix and the
/// parity check, which must see each product once):
/// the layer runs without autograd and only x is kept; the backward runs it again from x with autograd, at the same
/// random draws of the weight source (weight_source::draw_state), and backpropagates through it. The values and
/// gradients are those of the plain forward (the same operations on the same inputs); the memory the backward needs is
/// the layers' inputs plus one layer's activations instead of every layer's, for one more forward of each layer
/// (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"; torch.utils.checkpoint's reentrant variant).
/// `body` and what it captures must outlive the backward (capture by value), and so must ctx.w, whose settings
/// (temperature, seeds, routing mode) must not change before the backward: only its draw counters are set back.
/// The gradients reach leaves through their .grad, so the backward must be a plain one (torch::autograd::backward);
/// under autograd::grad the backward throws voodoo::error rather than lose them.
torch::Tensor run_layer(forward_context & ctx, const torch::Tensor & x, layer_body body);

/// "blk.<il>.<name>": the GGUF name of a layer's tensor.
std::string layer_tensor(int64_t il, const char * name);

/// The token embeddings of tokens [B, T] (rows of token_embd.weight) as [B, T, n_embd] in the compute dtype,
/// on tokens' device: every architecture's first step (ggml_get_rows).
torch::Tensor token_embeddings(forward_context & ctx, const torch::Tensor & tokens, int64_t n_embd);

/// y = x · Wᵀ (+ bias): x [..., ne0], weight `name` [ne1, ne0] → [..., ne1] in the compute dtype. The bias is
/// "<name without .weight>.bias" when the model has it. Every matmul with a weight goes through here.
torch::Tensor linear(forward_context & ctx, const std::string & name, const torch::Tensor & x);

/// RMSNorm as ggml_rms_norm then ggml_mul: x / sqrt(mean(x²) + eps) · w, computed in f32, returned in the
/// compute dtype. x [..., n], weight `name` [n].
torch::Tensor rms_norm(forward_context & ctx, const std::string & name, const torch::Tensor & x, float eps);

/// cos and sin of every position and rotated pair, [n_pos, n_rot/2] f32 each, as ggml_rope_ext computes them
/// without YaRN (ext_factor 0): θ = p · freq_scale · base^(−2i/n_rot) / ff_i (the power taken as ggml does, by
/// repeated f32 multiplication), both scaled by attn_factor. ff: `rope_freqs.weight` when hp.has_rope_freqs.
struct rope_tables {
    torch::Tensor cos;
    torch::Tensor sin;
};
rope_tables make_rope_tables(forward_context & ctx, const model_hparams & hp, int64_t n_pos, torch::Device device);

/// The rope of one kind of layer, where an architecture has several (gemma3's sliding layers use their own base;
/// phi3 picks long or short frequency factors by the context).
struct rope_config {
    float freq_base = 10000.0f;
    float freq_scale = 1.0f;
    float attn_factor = 1.0f;
    std::string freq_factors;  // GGUF name of a [n_rot/2] tensor dividing each pair's angle, "" = none
};
/// Same tables as above for an explicit rope_config and hp.n_rot.
rope_tables make_rope_tables(forward_context & ctx, int64_t n_rot, const rope_config & rope, int64_t n_pos,
                             torch::Device device);

/// Rotates the first hp.n_rot values of every head of x [B, T, n_heads, head_dim] (position t = index in T),
/// in llama.cpp's pairing hp.rope: NORM rotates (x[2i], x[2i+1]), NEOX rotates (x[i], x[i + n_rot/2]).
/// Computed in f32, returned in x's dtype.
torch::Tensor apply_rope(const torch::Tensor & x, const rope_tables & tables, const model_hparams & hp);

/// Causal softmax attention with grouped-query heads: q [B, T, n_head, d_k], k [B, T, n_head_kv, d_k],
/// v [B, T, n_head_kv, d_v] → [B, T, n_head · d_v]. Query head h reads KV head h / (n_head / n_head_kv),
/// as ggml_mul_mat broadcasts. Scores are scaled by kq_scale and soft-maxed in f32 (llama.cpp's KQ precision).
/// n_swa > 0: a sliding window as llama.cpp's LLAMA_SWA_TYPE_STANDARD (llama_hparams::is_masked_swa):
/// position p1 does not see p0 when p1 − p0 ≥ n_swa.
torch::Tensor causal_attention(const torch::Tensor & q, const torch::Tensor & k, const torch::Tensor & v,
                               float kq_scale, int64_t n_swa = 0);

/// Q, K and V of a layer as llama.cpp's build_qkv makes them: from the fused "<prefix>.attn_qkv.weight"
/// ([n_embd, n_embd_q + 2·n_embd_k_gqa] in ggml order; Q rows first, then K, then V) when the model has
/// it, else from attn_q / attn_k / attn_v; each with its bias when present. x [B, T, n_embd] →
/// q [B, T, n_head, d_k], k [B, T, n_head_kv, d_k], v [B, T, n_head_kv, d_v].
struct qkv_heads {
    torch::Tensor q, k, v;
};
qkv_heads attention_qkv(forward_context & ctx, const std::string & prefix, const torch::Tensor & x,
                        const model_hparams & hp);

/// SwiGLU MLP (llama.cpp's LLM_FFN_SILU + LLM_FFN_PAR): down(silu(gate(x)) · up(x)) with the tensors
/// "<prefix>.ffn_gate.weight", "<prefix>.ffn_up.weight", "<prefix>.ffn_down.weight".
torch::Tensor swiglu_mlp(forward_context & ctx, const std::string & prefix, const torch::Tensor & x);

/// The mixture-of-experts FFN of qwen3moe and qwen35moe: llama.cpp's build_moe_ffn (src/llama-graph.cpp) with
/// softmax gating, LLM_FFN_SILU, norm_w and separate gate/up experts. x [B, T, n_embd] →
///   logits = x · ffn_gate_inpᵀ (the router, [n_embd, n_expert], computed in f32 as on llama.cpp's CPU, where the
///   router is F32), p = softmax(logits), the top hp.n_expert_used experts of p per token (ggml_argsort_top_k),
///   their weights w = p / max(Σ p, 6.1e-5) (the F16 floor llama.cpp clamps the sum to), and
///   out = Σ_slots w · down_e(silu(gate_e(x)) · up_e(x)) with the 3-D tensors "<prefix>.ffn_{gate,up,down}_exps.weight"
///   ([E, n_ff_exp, n_embd], [E, n_embd, n_ff_exp] in PyTorch layout), or gate and up fused in
///   "<prefix>.ffn_gate_up_exps.weight" ([E, 2·n_ff_exp, n_embd], gate rows first) → [B, T, n_embd] in the compute
///   dtype.
/// Only routed tokens are multiplied, and only the experts some token routes to are asked of ctx.w (weight_source::
/// experts: the gated student forms only their mixture) when some expert gets no token. The routing is a
/// discrete choice: gradients flow through w and the experts' weights, not through which experts were chosen.
/// With ctx.forced_experts the layer takes the given experts (their weights renormalised from its own p) instead.
/// Throws voodoo::error when forced experts are given for fewer layers or of another shape.
torch::Tensor moe_ffn(forward_context & ctx, const std::string & prefix, const torch::Tensor & x,
                      const model_hparams & hp);

/// How moe_ffn multiplies the experts: grouped (every expert's tokens padded to the busiest expert's count, one
/// batched product per tensor), per expert (one product per expert and tensor), or automatic: grouped when the
/// padding at most doubles the rows, else per expert. The same numbers either way, up to the order of f32 sums.
enum class expert_products { automatic, grouped, per_expert };
/// Process-wide (tests and benchmarks compare the two); default automatic.
void set_expert_products(expert_products mode);
expert_products expert_products_mode();
/// Process-wide, default on: moe_ffn asks only for the experts its batch routes to (weight_source::experts) when some
/// expert gets no token; off, it takes every expert (get). The same numbers either way; tests compare the two.
void set_routed_experts_only(bool on);
bool routed_experts_only();

/// SwiGLU MLP with gate and up fused in one tensor (phi3; llama.cpp's LLM_FFN_SWIGLU + LLM_FFN_SEQ, ggml_swiglu):
/// "<prefix>.ffn_up.weight" [n_embd, 2·n_ff] gives [gate | up] (gate = the first n_ff outputs), then
/// down(silu(gate) · up).
torch::Tensor fused_swiglu_mlp(forward_context & ctx, const std::string & prefix, const torch::Tensor & x);

/// GELU-gated MLP (gemma; llama.cpp's LLM_FFN_GELU + LLM_FFN_PAR, ggml_geglu_split): down(gelu(gate(x)) · up(x))
/// with GELU's tanh approximation 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), computed in f32.
torch::Tensor geglu_mlp(forward_context & ctx, const std::string & prefix, const torch::Tensor & x);

/// Causal depthwise convolution as ggml_ssm_conv over a sequence whose state starts at zero (a fresh
/// sequence, position 0 first): y[b, t, c] = Σ_{k<L} w[c, k] · x[b, t − (L−1) + k, c], x = 0 before the start,
/// summed in f32 in the order of k. x [B, T, C]; w [C, L] (the GGUF's [L, C] in PyTorch layout) → [B, T, C] f32.
torch::Tensor causal_conv1d(const torch::Tensor & x, const torch::Tensor & w);

/// LFM2's gated short convolution (llama.cpp's src/models/lfm2.cpp, build_shortconv_block): "<prefix>.shortconv.
/// in_proj.weight" [n_embd, 3·n_embd] gives [b | c | x]; y = out_proj(c · causal_conv1d(b · x, conv)) with the
/// kernel "<prefix>.shortconv.conv.weight" [L, n_embd] (always F32: llama.cpp never quantizes it). x [B, T, n_embd]
/// → [B, T, n_embd] in the compute dtype; the convolution is computed in f32.
torch::Tensor gated_short_conv(forward_context & ctx, const std::string & prefix, const torch::Tensor & x);

/// The gated delta rule (Gated DeltaNet) from a zero state, as llama.cpp computes it (ggml_gated_delta_net and
/// build_delta_net_chunking in src/models/delta-net-base.cpp). Per sequence and head, with a state S [d_k, d_v]
/// starting at 0, for every token t in order:
///   S ← exp(g_t) · S;   δ = β_t · (v_t − Sᵀ k_t);   S ← S + k_t δᵀ;   o_t = Sᵀ q_t / sqrt(d_k).
/// Computed in chunks of `chunk` tokens in the WY form of fast linear-attention kernels: inside a chunk one unit
/// lower-triangular solve gives every δ at once, and only the state passes from chunk to chunk (T / chunk steps,
/// not T). q, k [B, T, H, d_k] (one key head per value head: repeat them before), v [B, T, H, d_v], g [B, T, H]
/// (log decay, ≤ 0), beta [B, T, H] → o [B, T, H, d_v] f32; everything computed in f32, differentiable.
torch::Tensor gated_delta_rule(const torch::Tensor & q, const torch::Tensor & k, const torch::Tensor & v,
                               const torch::Tensor & g, const torch::Tensor & beta, int64_t chunk = 64);

}  // namespace voodoo
