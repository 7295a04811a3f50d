// `voodoo eval`: perplexity and KL divergence of GGUF files against a reference, computed in libllama
// with llama-perplexity's conventions, so every number is what stock llama.cpp serves.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <functional>
#include <vector>

namespace voodoo {

struct eval_options {
    std::string reference;          // GGUF whose logits are the truth (the source model)
    std::string text;               // UTF-8 text file
    int n_ctx = 512;                // tokens per chunk (llama-perplexity's -c)
    int n_chunks = -1;              // chunks to score; -1 = every whole chunk of the text (its --chunks)
    int n_threads = 0;              // decode and statistics threads; 0 = every core
    int speed_reps = 5;             // repetitions of llama-bench's pp512 and tg128 per file (0 = no speed columns)
    bool reference_speed = true;    // the reference's speed too (its BF16 tg128 on the CPU is the slowest run: ≈ 25 s
                                    // a run at 1.7 G weights on 16 cores)
    std::string ctx_flag = "--ctx";         // the flags that set n_ctx and n_chunks, as errors name them
    std::string chunks_flag = "--chunks";   // (quantize: --eval-ctx and --eval-chunks)
};

/// One file's numbers. PPL and KLD are over the same scored tokens: the second half of every chunk.
struct eval_file_result {
    std::string path;
    std::string name;               // file name without folders (labels the plot)
    size_t file_bytes = 0;          // size on disk
    size_t tensor_bytes = 0;        // Σ tensor data bytes
    int64_t n_weights = 0;          // Σ elements over every tensor
    double bpw = 0;                 // 8 · tensor_bytes / n_weights (llama-quantize's BPW)
    double ppl = 0;                 // exp(mean NLL)
    double ppl_err = 0;             // ppl · stderr of the mean NLL (llama-perplexity's ±)
    // Against the reference (all zero for the reference's own row):
    double ln_ppl_ratio = 0;        // mean ln(PPL(file) / PPL(ref)), with the covariance-aware ± below
    double ln_ppl_ratio_err = 0;
    double ppl_ratio = 1;           // PPL(file) / PPL(ref)
    double ppl_ratio_err = 0;
    double kld_mean = 0;            // nats per token, KL(ref ‖ file)
    double kld_err = 0;             // stderr of the mean
    double kld_median = 0;
    double kld_p99 = 0;             // 99th percentile (linear interpolation, as llama-perplexity)
    double kld_p999 = 0;            // 99.9th percentile
    double kld_max = 0;
    double same_top = 1;            // fraction of scored tokens whose argmax agrees with the reference's
    double same_top_err = 0;        // binomial stderr
    // Speed in libllama on this machine (measure_speed; 0 when not measured): tokens per second, mean ± sd.
    double pp512 = 0, pp512_sd = 0; // prompt processing: 512 tokens in one batch
    double tg128 = 0, tg128_sd = 0; // generation: 128 tokens one at a time
    // Cores that other processes kept busy on average while this file's speed was measured (other_cpu_load): the
    // machine's busy CPU time (/proc/stat) less this process's (getrusage), over the wall time. -1: not measured.
    double speed_other_cores = -1;
};

/// Speed figures measured while other processes kept at least this many cores busy on average are marked as
/// measured under load (eval.md's ⚠ and its warning; eval.json's speed_under_load and speed_other_load_cores): half
/// a core, a judgement (llama-bench's own runs use every core, and ggml's threads spin at each step's barrier, so one
/// core taken by other work can slow them by far more than its share: a new user's trial on the 2-core machine read
/// Q4_K_M's tg128 of stories260K at 9.3 t/s on 2 threads beside a busy loop, 5,423 t/s on 1; a quiet machine idles at
/// a few hundredths of a core).
inline constexpr double k_speed_load_warn_cores = 0.5;

/// True when f's speed was measured under load: other processes kept at least k_speed_load_warn_cores busy.
inline bool speed_under_load(const eval_file_result & f) {
    return f.speed_other_cores >= k_speed_load_warn_cores;
}

/// Measures the load other processes put on the machine between its construction and other_cores(): the busy
/// jiffies of /proc/stat's "cpu" line (user, nice, system, irq, softirq, steal; proc(5)) over sysconf(_SC_CLK_TCK),
/// less this process's user and system time (getrusage RUSAGE_SELF, every thread), over the wall time between.
class other_cpu_load {
public:
    other_cpu_load();
    /// CPU seconds other processes used so far (≥ 0), or -1 when /proc/stat cannot be read.
    double other_seconds() const;
    /// other_seconds() over the wall seconds so far: the cores they kept busy on average; -1 as other_seconds.
    double other_cores() const;

private:
    double busy0_ = -1, self0_ = 0, wall0_ = 0;
};

struct eval_result {
    std::string reference;
    std::string text;
    int n_ctx = 0;
    int n_chunks = 0;
    int64_t n_text_tokens = 0;      // tokens of the whole text (BOS included when the vocab adds one)
    int64_t n_scored = 0;           // tokens scored per file: n_chunks · (n_ctx − 1 − n_ctx/2)
    int speed_reps = 0;             // repetitions behind each speed figure (0: none measured)
    int speed_threads = 0;          // libllama threads of the speed runs
    std::vector<std::string> devices;   // the GPUs libllama computed on ("CUDA0: NVIDIA H100 …"; llama_gpu_devices);
                                        // empty: its CPU backend
    eval_file_result ref;           // the reference's own PPL; its KLD columns are zero
    std::vector<eval_file_result> files;    // in the order given
};

/// Scores `files` against `opt.reference` on `opt.text`, following llama-perplexity
/// (tools/perplexity/perplexity.cpp): the whole text is tokenized once with the reference's vocab
/// (BOS added when the vocab adds one, one trailing newline dropped as its -f does); chunk i is tokens
/// [i·n_ctx, (i+1)·n_ctx) with its first token replaced by BOS; the logits at positions n_ctx/2 …
/// n_ctx−2 predict the next token and are scored. Every model is loaded at once; per chunk the
/// reference decodes once and each file decodes the same tokens, and the comparison happens in memory
/// (log-softmax and KLD in double). Statistics follow its --kl-divergence report: mean ± stderr
/// (stderr 0 for ≤ 10 tokens), median, linear-interpolated percentiles, same-top-token fraction,
/// ln(PPL ratio) with the covariance of the two NLLs.
///
/// Then, with opt.speed_reps > 0, each file's speed and the reference's as llama-bench measures pp512 and tg128
/// (tools/llama-bench/llama-bench.cpp, its defaults): a context of 512 + 128 tokens, n_batch 2048, n_ubatch 512,
/// the same threads; random tokens (BOS first when the vocab adds one; fixed seed); one warm-up of the prompt and
/// one generated token; then opt.speed_reps times, each from an empty KV cache, 512 tokens in one llama_decode
/// (pp512) and 128 single-token decodes (tg128); tokens/s per repetition, mean and sample sd.
///
/// Errors (voodoo::error, naming the file or flag): a file is not a readable GGUF; a file's
/// architecture, vocabulary (token count, tokenizer model, data/vocab.h vocab_hash) or tensor names/shapes
/// differ from the reference's; --ctx exceeds `<arch>.context_length` or is below 8; the text is
/// shorter than 2 · n_ctx tokens; more than half of the text's tokens are <unk> or byte-fallback tokens
/// (text the vocabulary does not cover); libllama cannot load a model or decode.
eval_result run_eval(const eval_options & opt, const std::vector<std::string> & files);

/// run_eval's checks of opt.n_ctx, the reference's context length and the text (readable, not empty, covered by
/// the reference's vocabulary, at least 2 · n_ctx tokens), made with the reference's header and vocabulary alone
/// (libllama's vocab_only load: no weights read), so that quantize finds a bad --eval-text or --eval-ctx before it
/// trains rather than after. opt.n_chunks is not checked. Errors: run_eval's for these, naming opt.ctx_flag.
void check_eval_text(const eval_options & opt);

/// run_eval in steps, so that some files are scored while other work runs and the rest later (quantize scores the
/// stock files while its train stage runs: issue #16). The numbers are run_eval's, bit for bit: every file's sums
/// are added chunk by chunk in chunk order, against the same reference logits, whichever call scored which chunk
/// (tests/test_eval.cpp checks this against run_eval, a session stopped part way included).
class eval_session {
public:
    /// Checks the reference and the text and loads the reference (run_eval's errors for them). When the reference's
    /// logits of every chunk take at most `keep_reference_max_bytes` (reference_bytes(): chunks × (n_ctx − 1 − n_ctx/2)
    /// × n_vocab floats), each chunk's are kept once decoded, so that a file scored later decodes only itself;
    /// otherwise a later call decodes the reference again (its own sums are still added once).
    eval_session(const eval_options & opt, int64_t keep_reference_max_bytes);
    ~eval_session();
    eval_session(const eval_session &) = delete;
    eval_session & operator=(const eval_session &) = delete;

    /// Scores `files` (each checked against the reference and loaded on first sight: run_eval's errors) on every
    /// chunk not yet scored for it, chunk by chunk. Returns true when all of them are scored on every chunk; false,
    /// keeping everything done so far, when `stop` (called from this thread) returned true before a decode (asked before
    /// each one). With `show_progress`, a progress bar of the decodes still to do.
    bool score(const std::vector<std::string> & files, const std::function<bool()> & stop = {}, bool show_progress = true);

    /// The result for `files` in that order (each scored on every chunk, else an error), then, with opt.speed_reps > 0,
    /// the speed of the reference (opt.reference_speed) and of each file as run_eval measures it. Once per session.
    eval_result finish(const std::vector<std::string> & files);

    /// From now on, a chunk's reference logits are not kept once decoded (those kept stay): for the last call of
    /// score, which needs each chunk once.
    void stop_keeping();

    /// Bytes of the reference's logits over every chunk (what keeping them costs), and whether they are kept.
    int64_t reference_bytes() const;
    bool keeps_reference() const;

private:
    struct impl;
    std::unique_ptr<impl> p_;
};

}  // namespace voodoo
