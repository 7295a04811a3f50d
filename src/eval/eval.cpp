#include "eval/eval.h"
#include "eval/report.h"

#include "common/error.h"
#include "common/progress.h"
#include "data/vocab.h"
#include "ggml/gguf.h"
#include "ggml/log.h"
#include "ggml/quant.h"
#include "ggml/runtime.h"
#include "ggml/types.h"

#include <llama.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <tuple>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include <sys/resource.h>
#include <unistd.h>

namespace voodoo {

namespace {

constexpr int k_min_ctx = 16;

struct model_deleter {
    void operator()(llama_model * m) const { llama_model_free(m); }
};
struct context_deleter {
    void operator()(llama_context * c) const { llama_free(c); }
};
using model_ptr = std::unique_ptr<llama_model, model_deleter>;
using context_ptr = std::unique_ptr<llama_context, context_deleter>;

/// What must agree between two files of one model.
struct model_identity {
    std::string architecture;
    std::string tokenizer_model;        // tokenizer.ggml.model ("llama", "gpt2", …)
    int64_t n_vocab = 0;                // length of tokenizer.ggml.tokens
    uint64_t vocab_hash = 0;            // data/vocab.h vocab_hash: tokens, types, merges, BOS/EOS
};

model_identity identity_of(const gguf_file & f) {
    model_identity id;
    id.architecture = f.architecture();
    id.tokenizer_model = f.get_string("tokenizer.ggml.model").value_or("");
    const int64_t key = f.find_key("tokenizer.ggml.tokens");
    if (key < 0 || gguf_get_kv_type(f.ctx(), key) != GGUF_TYPE_ARRAY ||
        gguf_get_arr_type(f.ctx(), key) != GGUF_TYPE_STRING) {
        fail("'{}' has no vocabulary (tokenizer.ggml.tokens): eval needs a model GGUF with its tokenizer", f.path());
    }
    id.n_vocab = static_cast<int64_t>(gguf_get_arr_n(f.ctx(), key));
    id.vocab_hash = vocab_hash(f);
    return id;
}

/// Throws when `other` is not a file of the reference's model: same architecture, vocabulary (vocab_hash) and
/// tensor names and shapes (types may differ: that is the point).
void check_same_model(const gguf_file & ref, const model_identity & ref_id, const gguf_file & other) {
    const model_identity id = identity_of(other);
    const std::string hint = "pass only files made from the reference model";
    if (id.architecture != ref_id.architecture) {
        fail("'{}' is a '{}' model but the reference '{}' is '{}': {}", other.path(), id.architecture, ref.path(),
             ref_id.architecture, hint);
    }
    if (id.n_vocab != ref_id.n_vocab || id.tokenizer_model != ref_id.tokenizer_model ||
        id.vocab_hash != ref_id.vocab_hash) {
        fail("'{}' has another vocabulary than the reference '{}' ({} '{}' tokens vs {} '{}' tokens{}): {}",
             other.path(), ref.path(), id.n_vocab, id.tokenizer_model, ref_id.n_vocab, ref_id.tokenizer_model,
             id.n_vocab == ref_id.n_vocab ? ", other tokens, types or merges" : "", hint);
    }
    if (other.tensors().size() != ref.tensors().size()) {
        fail("'{}' has {} tensors but the reference '{}' has {}: {}", other.path(), other.tensors().size(),
             ref.path(), ref.tensors().size(), hint);
    }
    for (const gguf_tensor & t : ref.tensors()) {
        const gguf_tensor * o = other.find_tensor(t.name);
        if (!o) {
            fail("'{}' has no tensor '{}' that the reference '{}' has: {}", other.path(), t.name, ref.path(), hint);
        }
        if (o->ne != t.ne) {
            fail("tensor '{}' is {} in '{}' but {} in the reference '{}': {}", t.name, shape_str(o->shape()),
                 other.path(), shape_str(t.shape()), ref.path(), hint);
        }
    }
}

/// The text as llama-perplexity's -f reads it: the whole file, one trailing newline dropped.
std::string read_text(const std::string & path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        fail("cannot open the text '{}': {}", path, std::strerror(errno));
    }
    std::ostringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    if (!text.empty() && text.back() == '\n') {
        text.pop_back();
    }
    if (text.empty()) {
        fail("the text '{}' is empty: give a UTF-8 text file in the model's language", path);
    }
    return text;
}

std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text, const std::string & path) {
    if (text.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
        fail("the text '{}' is {} bytes; libllama tokenizes at most 2 GiB at once: cut it", path, text.size());
    }
    const int32_t len = static_cast<int32_t>(text.size());
    // add_special: BOS as the vocab wants it; parse_special false: "<s>" in the text is text.
    int32_t n = llama_tokenize(vocab, text.data(), len, nullptr, 0, true, false);
    if (n == std::numeric_limits<int32_t>::min()) {
        fail("the text '{}' tokenizes to more than 2^31 tokens: cut it", path);
    }
    std::vector<llama_token> tokens(static_cast<size_t>(n < 0 ? -n : n));
    n = llama_tokenize(vocab, text.data(), len, tokens.data(), static_cast<int32_t>(tokens.size()), true, false);
    if (n < 0 || static_cast<size_t>(n) != tokens.size()) {
        fail("libllama could not tokenize the text '{}'", path);
    }
    return tokens;
}

/// Runs fn(i) for i in [0, n) on up to n_threads threads, each thread a contiguous range.
template <typename F>
void parallel_for(int64_t n, int n_threads, F fn) {
    const int64_t n_workers = std::max<int64_t>(1, std::min<int64_t>(n_threads, n));
    if (n_workers == 1) {
        for (int64_t i = 0; i < n; ++i) {
            fn(i);
        }
        return;
    }
    std::vector<std::thread> workers;
    workers.reserve(static_cast<size_t>(n_workers));
    for (int64_t w = 0; w < n_workers; ++w) {
        workers.emplace_back([=, &fn] {
            for (int64_t i = n * w / n_workers; i < n * (w + 1) / n_workers; ++i) {
                fn(i);
            }
        });
    }
    for (auto & t : workers) {
        t.join();
    }
}

/// log Σ exp(logits) in double, and the argmax (first of equals, as llama-perplexity).
struct row_softmax {
    double log_sum_exp;
    int32_t argmax;
};

row_softmax softmax_of(const float * logits, int32_t n_vocab) {
    int32_t imax = 0;
    for (int32_t i = 1; i < n_vocab; ++i) {
        if (logits[i] > logits[imax]) {
            imax = i;
        }
    }
    const double max = logits[imax];
    double sum = 0;
    for (int32_t i = 0; i < n_vocab; ++i) {
        sum += std::exp(static_cast<double>(logits[i]) - max);
    }
    return {max + std::log(sum), imax};
}

/// The per-token numbers of one file, and the sums llama-perplexity keeps.
struct file_accumulator {
    double sum_nll = 0, sum_nll2 = 0;
    double sum_nll_ref = 0, sum_nll_ref2 = 0, sum_nll_nll_ref = 0;
    double sum_kld = 0, sum_kld2 = 0;
    int64_t n_same_top = 0;
    int64_t count = 0;
    std::vector<double> kld;        // every scored token's KLD, for the percentiles
};

/// llama-perplexity's mean_and_uncertainty: the mean and the standard error of the mean (0 for ≤ 10 values).
std::pair<double, double> mean_and_stderr(double sum, double sum2, int64_t count) {
    if (count < 1) {
        return {0.0, 0.0};
    }
    const double f = sum / static_cast<double>(count);
    const double var = sum2 / static_cast<double>(count) - f * f;
    return {f, var > 0 && count > 10 ? std::sqrt(var / static_cast<double>(count - 1)) : 0.0};
}

/// llama-perplexity's percentile of sorted values: linear interpolation between neighbours.
double percentile(const std::vector<double> & sorted, double fraction) {
    if (fraction <= 0) {
        return sorted.front();
    }
    if (fraction >= 1) {
        return sorted.back();
    }
    double p = fraction * static_cast<double>(sorted.size() - 1);
    const size_t ip = static_cast<size_t>(p);
    p -= static_cast<double>(ip);
    return (1 - p) * sorted[ip] + p * sorted[std::min(ip + 1, sorted.size() - 1)];
}

void describe_file(eval_file_result & r, const gguf_file & f) {
    r.path = f.path();
    r.name = std::filesystem::path(f.path()).filename().string();
    r.file_bytes = f.file_size();
    for (const gguf_tensor & t : f.tensors()) {
        r.tensor_bytes += t.n_bytes;
        r.n_weights += t.n_elements();
    }
    r.bpw = r.n_weights > 0 ? 8.0 * static_cast<double>(r.tensor_bytes) / static_cast<double>(r.n_weights) : 0.0;
}

void finish_file(eval_file_result & r, file_accumulator & a) {
    const auto log_ppl = mean_and_stderr(a.sum_nll, a.sum_nll2, a.count);
    r.ppl = std::exp(log_ppl.first);
    r.ppl_err = r.ppl * log_ppl.second;
    const auto log_ppl_ref = mean_and_stderr(a.sum_nll_ref, a.sum_nll_ref2, a.count);
    const double n = static_cast<double>(a.count);
    const double cov = a.count < 10 ? 0.0
                                    : (a.sum_nll_nll_ref / n - (a.sum_nll / n) * (a.sum_nll_ref / n)) / (n - 1);
    r.ln_ppl_ratio = log_ppl.first - log_ppl_ref.first;
    r.ln_ppl_ratio_err = std::sqrt(std::max(0.0, log_ppl.second * log_ppl.second +
                                                     log_ppl_ref.second * log_ppl_ref.second - 2.0 * cov));
    r.ppl_ratio = std::exp(r.ln_ppl_ratio);
    r.ppl_ratio_err = r.ppl_ratio * r.ln_ppl_ratio_err;
    const auto kld = mean_and_stderr(a.sum_kld, a.sum_kld2, a.count);
    r.kld_mean = kld.first;
    r.kld_err = kld.second;
    std::sort(a.kld.begin(), a.kld.end());
    const size_t m = a.kld.size();
    r.kld_median = m % 2 == 0 ? 0.5 * (a.kld[m / 2] + a.kld[m / 2 - 1]) : a.kld[m / 2];
    r.kld_p99 = percentile(a.kld, 0.99);
    r.kld_p999 = percentile(a.kld, 0.999);
    r.kld_max = a.kld.back();
    r.same_top = static_cast<double>(a.n_same_top) / n;
    r.same_top_err = a.count > 1 ? std::sqrt(r.same_top * (1 - r.same_top) / (n - 1)) : 0.0;
}

/// The model at `path` in libllama, its weights too or (vocab_only) its header and vocabulary alone.
model_ptr load_model(const std::string & path, bool vocab_only = false) {
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = vocab_only;
    ggml_log_capture capture;
    model_ptr m(llama_model_load_from_file(path.c_str(), mp));
    if (!m) {
        const std::string why = capture.text();
        // With a GPU backend every model of the eval is loaded there at once (llama_model_default_params).
        const std::vector<std::string> gpus = vocab_only ? std::vector<std::string>{} : llama_gpu_devices();
        fail("libllama cannot load {}'{}'{}{}{}", vocab_only ? "the vocabulary of " : "", path, why.empty() ? "" : ": ", why,
             gpus.empty() ? "" : fmt::format(" (libllama offloads every model of the eval to {} at once, from "
                                             "GGML_BACKEND_PATH; without it the eval runs on the CPU)", gpus.front()));
    }
    return m;
}

/// A context of n_ctx tokens; one llama_decode takes up to n_batch tokens (default n_ctx: a whole chunk), computed
/// n_ubatch at a time (default min(n_ctx, 512), llama.cpp's default).
context_ptr new_context(llama_model * model, const std::string & path, int n_ctx, int n_threads, int n_batch = 0,
                        int n_ubatch = 0) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = static_cast<uint32_t>(n_ctx);
    cp.n_batch = static_cast<uint32_t>(n_batch > 0 ? n_batch : n_ctx);
    cp.n_ubatch = static_cast<uint32_t>(n_ubatch > 0 ? n_ubatch : std::min(n_ctx, 512));
    cp.n_seq_max = 1;
    cp.n_threads = n_threads;
    cp.n_threads_batch = n_threads;
    cp.no_perf = true;
    ggml_log_capture capture;
    context_ptr c(llama_init_from_model(model, cp));
    if (!c) {
        const std::string why = capture.text();
        fail("libllama cannot create a context of {} tokens for '{}'{}{}", n_ctx, path, why.empty() ? "" : ": ", why);
    }
    return c;
}

/// Decodes one chunk (batch already filled) in a fresh KV cache; returns the first scored row's logits.
const float * decode_chunk(llama_context * ctx, const llama_batch & batch, const std::string & path, int chunk) {
    llama_memory_clear(llama_get_memory(ctx), true);
    ggml_log_capture capture;
    if (llama_decode(ctx, batch) != 0) {
        const std::string why = capture.text();
        fail("libllama failed to decode chunk {} of '{}'{}{}", chunk, path, why.empty() ? "" : ": ", why);
    }
    // Rows of the tokens with batch.logits set, in batch order (llama.h, llama_get_logits).
    return llama_get_logits(ctx);
}

// The machine's busy CPU seconds so far (/proc/stat's first line: user nice system idle iowait irq softirq steal …,
// in USER_HZ ticks; proc(5)), or -1 when it cannot be read.
double machine_busy_seconds() {
    std::ifstream in("/proc/stat");
    std::string cpu;
    double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    if (!(in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq) || cpu != "cpu") {
        return -1;
    }
    in >> steal;  // absent before Linux 2.6.11
    return (user + nice + system + irq + softirq + steal) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double self_cpu_seconds() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    const auto sec = [](const timeval & t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
    return sec(u.ru_utime) + sec(u.ru_stime);
}

double wall_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

other_cpu_load::other_cpu_load() : busy0_(machine_busy_seconds()), self0_(self_cpu_seconds()), wall0_(wall_seconds()) {}

double other_cpu_load::other_seconds() const {
    const double busy = machine_busy_seconds();
    if (busy0_ < 0 || busy < 0) {
        return -1;
    }
    return std::max(0.0, (busy - busy0_) - (self_cpu_seconds() - self0_));
}

double other_cpu_load::other_cores() const {
    const double other = other_seconds();
    const double wall = wall_seconds() - wall0_;
    return other < 0 || wall <= 0 ? -1 : other / wall;
}

namespace {

/// llama-bench's pp512 and tg128 of one model (run_eval's comment says how). Fills r's speed fields, and the load
/// other processes put on the machine meanwhile (other_cpu_load).
void measure_speed(llama_model * model, const std::string & path, int n_threads, int reps, eval_file_result & r) {
    constexpr int n_prompt = 512, n_gen = 128;
    const context_ptr ctx = new_context(model, path, n_prompt + n_gen, n_threads, 2048, 512);  // llama-bench's -b, -ub
    ggml_log_capture capture;
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    const bool add_bos = llama_vocab_get_add_bos(vocab);
    std::mt19937 rng(1234);
    auto token = [&] { return static_cast<llama_token>(rng() % static_cast<uint32_t>(n_vocab)); };
    auto decode = [&](llama_token * t, int n) {
        if (llama_decode(ctx.get(), llama_batch_get_one(t, n)) != 0) {
            fail("libllama failed to decode the speed test of '{}': {}", path, capture.text());
        }
    };
    std::vector<llama_token> prompt(n_prompt);
    auto run_prompt = [&] {
        for (int i = 0; i < n_prompt; ++i) {
            prompt[static_cast<size_t>(i)] = i == 0 && add_bos ? llama_vocab_bos(vocab) : token();
        }
        decode(prompt.data(), n_prompt);
        llama_synchronize(ctx.get());
    };
    auto run_gen = [&](int n) {
        llama_token t = add_bos ? llama_vocab_bos(vocab) : token();
        for (int i = 0; i < n; ++i) {
            decode(&t, 1);
            llama_synchronize(ctx.get());
            t = token();
        }
    };
    using clock = std::chrono::steady_clock;
    auto seconds = [](clock::time_point a) { return std::chrono::duration<double>(clock::now() - a).count(); };
    run_prompt();  // warm-up, as llama-bench
    llama_memory_clear(llama_get_memory(ctx.get()), false);
    run_gen(1);
    const other_cpu_load load;
    std::vector<double> pp, tg;
    for (int i = 0; i < reps; ++i) {
        llama_memory_clear(llama_get_memory(ctx.get()), false);
        auto t0 = clock::now();
        run_prompt();
        pp.push_back(n_prompt / seconds(t0));
        llama_memory_clear(llama_get_memory(ctx.get()), false);
        t0 = clock::now();
        run_gen(n_gen);
        tg.push_back(n_gen / seconds(t0));
    }
    auto mean_sd = [](const std::vector<double> & v) {
        const double n = static_cast<double>(v.size());
        double m = 0, s2 = 0;
        for (double x : v) {
            m += x / n;
        }
        for (double x : v) {
            s2 += (x - m) * (x - m);
        }
        return std::pair<double, double>{m, v.size() > 1 ? std::sqrt(s2 / (n - 1)) : 0.0};
    };
    std::tie(r.pp512, r.pp512_sd) = mean_sd(pp);
    std::tie(r.tg128, r.tg128_sd) = mean_sd(tg);
    r.speed_other_cores = load.other_cores();
}

}  // namespace

// eval_session::impl holds the types above, of this file's anonymous namespace; it is defined and used only here, so
// GCC's -Wsubobject-linkage (which fires once the unity build includes this file in another) warns of nothing real.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsubobject-linkage"
struct eval_session::impl {
    eval_options opt;
    int n_threads = 1;
    std::unique_ptr<gguf_file> ref_file;
    model_identity ref_id;
    model_ptr ref_model;
    context_ptr ref_ctx;
    std::vector<llama_token> tokens;
    int64_t n_ctx = 0, n_chunks = 0, first = 0, n_score = 0;
    int32_t n_vocab = 0;
    bool add_bos = false;
    llama_token bos = 0;
    llama_batch batch{};
    bool keep = false;                          // keep every decoded chunk's reference logits
    bool storing = false;                       // still storing newly decoded chunks (stop_keeping ends it)
    eval_result base;                           // the fields common to every result
    // The reference: its logits of the chunk in hand (or of every chunk, kept), their softmax, its own sums.
    std::vector<std::vector<float>> kept;       // per chunk; empty until decoded (always empty unless keep)
    std::vector<std::vector<row_softmax>> kept_rows;
    std::vector<float> ref_logits;              // the chunk in hand when not kept
    std::vector<row_softmax> ref_rows;
    int64_t ref_chunk = -1;                     // the chunk whose logits ref_logits holds
    file_accumulator ref_acc;
    int64_t ref_done = 0;                       // chunks in ref_acc
    struct scored_file {
        std::unique_ptr<gguf_file> file;
        model_ptr model;
        context_ptr ctx;
        file_accumulator acc;
        int64_t done = 0;                       // chunks in acc
    };
    std::map<std::string, scored_file> files;
    bool finished = false;

    ~impl() {
        if (batch.token) {
            llama_batch_free(batch);
        }
    }

    void fill_batch(int64_t c) {
        const llama_token * chunk = tokens.data() + c * n_ctx;
        batch.n_tokens = static_cast<int32_t>(n_ctx);
        for (int64_t k = 0; k < n_ctx; ++k) {
            batch.token[k] = k == 0 && add_bos ? bos : chunk[k];
            batch.pos[k] = static_cast<llama_pos>(k);
            batch.n_seq_id[k] = 1;
            batch.seq_id[k][0] = 0;
            batch.logits[k] = k >= first;
        }
    }

    /// The reference's logits and softmax of chunk c: kept, in hand, or decoded now (the batch holds chunk c).
    std::pair<const float *, const row_softmax *> reference_chunk(int64_t c) {
        if (keep && !kept[c].empty()) {
            return {kept[c].data(), kept_rows[c].data()};
        }
        if (ref_chunk == c) {
            return {ref_logits.data(), ref_rows.data()};
        }
        const auto row = static_cast<size_t>(n_vocab);
        const bool store = keep && storing;
        std::vector<float> & logits_out = store ? kept[c] : ref_logits;
        std::vector<row_softmax> & rows_out = store ? kept_rows[c] : ref_rows;
        logits_out.resize(static_cast<size_t>(n_score) * row);
        rows_out.resize(static_cast<size_t>(n_score));
        const float * logits = decode_chunk(ref_ctx.get(), batch, opt.reference, static_cast<int>(c));
        std::copy(logits, logits + static_cast<size_t>(n_score) * row, logits_out.begin());
        parallel_for(n_score, n_threads, [&](int64_t j) { rows_out[j] = softmax_of(logits_out.data() + j * row, n_vocab); });
        ref_chunk = store ? -1 : c;
        if (ref_done == c) {  // the reference's own sums, once per chunk and in chunk order
            const llama_token * chunk = tokens.data() + c * n_ctx;
            for (int64_t j = 0; j < n_score; ++j) {
                const double nll = rows_out[j].log_sum_exp - logits_out[j * row + chunk[first + j + 1]];
                ref_acc.sum_nll += nll;
                ref_acc.sum_nll2 += nll * nll;
                ref_acc.sum_nll_ref += nll;
                ref_acc.sum_nll_ref2 += nll * nll;
                ref_acc.sum_nll_nll_ref += nll * nll;
                ref_acc.kld.push_back(0.0);
                ++ref_acc.n_same_top;
                ++ref_acc.count;
            }
            ++ref_done;
        }
        return {logits_out.data(), rows_out.data()};
    }

    /// Decodes chunk c of one file and adds its numbers against the reference's p, ps.
    void score_chunk(const std::string & path, scored_file & sf, int64_t c, const float * p_all, const row_softmax * ps_all) {
        struct token_numbers {
            double nll;
            double kld;
            bool same_top;
        };
        std::vector<token_numbers> numbers(static_cast<size_t>(n_score));
        const auto row = static_cast<size_t>(n_vocab);
        const llama_token * chunk = tokens.data() + c * n_ctx;
        const float * logits = decode_chunk(sf.ctx.get(), batch, path, static_cast<int>(c));
        parallel_for(n_score, n_threads, [&](int64_t j) {
            const float * q = logits + j * row;
            const float * p = p_all + j * row;
            const row_softmax qs = softmax_of(q, n_vocab);
            const row_softmax & ps = ps_all[j];
            // KL(p ‖ q) = Σ p_i (log p_i − log q_i), with log p_i = l_i − lse_p.
            double kld = 0;
            for (int32_t i = 0; i < n_vocab; ++i) {
                const double log_p = static_cast<double>(p[i]) - ps.log_sum_exp;
                const double log_q = static_cast<double>(q[i]) - qs.log_sum_exp;
                kld += std::exp(log_p) * (log_p - log_q);
            }
            numbers[j] = {qs.log_sum_exp - q[chunk[first + j + 1]], kld, qs.argmax == ps.argmax};
        });
        file_accumulator & a = sf.acc;
        for (int64_t j = 0; j < n_score; ++j) {
            const double nll_ref = ps_all[j].log_sum_exp - p_all[j * row + chunk[first + j + 1]];
            const token_numbers & t = numbers[j];
            a.sum_nll += t.nll;
            a.sum_nll2 += t.nll * t.nll;
            a.sum_nll_ref += nll_ref;
            a.sum_nll_ref2 += nll_ref * nll_ref;
            a.sum_nll_nll_ref += t.nll * nll_ref;
            a.sum_kld += t.kld;
            a.sum_kld2 += t.kld * t.kld;
            a.kld.push_back(t.kld);
            a.n_same_top += t.same_top;
            ++a.count;
        }
        ++sf.done;
    }
};

#pragma GCC diagnostic pop

namespace {

/// opt.n_ctx against `<arch>.context_length` in the reference's header `ref`; false when the header has none.
bool check_header_ctx(const eval_options & opt, const gguf_file & ref) {
    const std::string ctx_key = identity_of(ref).architecture + ".context_length";
    const auto n_ctx_train = ref.get_int(ctx_key);
    if (n_ctx_train && opt.n_ctx > *n_ctx_train) {
        fail("{} {} is larger than the context '{}' was trained on ({} = {}): use {} {} or less", opt.ctx_flag,
             opt.n_ctx, opt.reference, ctx_key, *n_ctx_train, opt.ctx_flag, *n_ctx_train);
    }
    return n_ctx_train.has_value();
}

/// The checks of the flags, the reference's context and the text (check_eval_text's list) with the reference's
/// header `ref`, a libllama model of it (its weights or its vocabulary alone) and the text as read_text reads it;
/// returns the text's tokens.
std::vector<llama_token> checked_tokens(const eval_options & opt, const gguf_file & ref, const llama_model * model,
                                        const std::string & text) {
    const std::string & ctx_flag = opt.ctx_flag;
    const bool n_ctx_gguf = check_header_ctx(opt, ref);
    if (const int32_t n_ctx_train = llama_model_n_ctx_train(model); !n_ctx_gguf && n_ctx_train > 0 && opt.n_ctx > n_ctx_train) {
        fail("{} {} is larger than the context '{}' was trained on ({} in libllama): use {} {} or less", ctx_flag,
             opt.n_ctx, opt.reference, n_ctx_train, ctx_flag, n_ctx_train);
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    if (llama_vocab_get_add_eos(vocab)) {
        fail("the vocabulary of '{}' appends EOS to every text; llama-perplexity refuses such models and so do we",
             opt.reference);
    }
    std::vector<llama_token> tokens = tokenize(vocab, text, opt.text);
    const double frac = uncovered_share(vocab, tokens);
    if (frac > k_max_uncovered_share) {
        fail("the text '{}' is not in a script the vocabulary of '{}' covers: {:.0f}% of its {} tokens are <unk> "
             "or byte-fallback tokens (at most {:.0f}% allowed); evaluate on text in the model's language",
             opt.text, opt.reference, 100.0 * frac, tokens.size(), 100.0 * k_max_uncovered_share);
    }
    if (static_cast<int64_t>(tokens.size()) < 2 * static_cast<int64_t>(opt.n_ctx)) {
        fail("the text '{}' is {} tokens; {} {} needs at least {} (as llama-perplexity): give a longer text or a "
             "smaller {}",
             opt.text, tokens.size(), ctx_flag, opt.n_ctx, 2 * static_cast<int64_t>(opt.n_ctx), ctx_flag);
    }
    return tokens;
}

void check_flags(const eval_options & opt) {
    if (opt.n_ctx < k_min_ctx) {
        fail("{} {} is too small: use at least {} (llama-perplexity's default is 512)", opt.ctx_flag, opt.n_ctx, k_min_ctx);
    }
    if (opt.n_chunks == 0 || opt.n_chunks < -1) {
        fail("{} {}: expected a positive number of chunks, or -1 for every chunk of the text", opt.chunks_flag,
             opt.n_chunks);
    }
}

}  // namespace

void check_eval_text(const eval_options & opt) {
    eval_options o = opt;
    o.n_chunks = -1;
    check_flags(o);
    const gguf_file ref(opt.reference);
    const std::string text = read_text(opt.text);
    llama_runtime_init();
    checked_tokens(opt, ref, load_model(opt.reference, true).get(), text);
}

eval_session::eval_session(const eval_options & opt, int64_t keep_reference_max_bytes) : p_(std::make_unique<impl>()) {
    impl & s = *p_;
    s.opt = opt;
    check_flags(opt);
    s.n_threads = resolve_threads(opt.n_threads);
    s.ref_file = std::make_unique<gguf_file>(opt.reference);
    s.ref_id = identity_of(*s.ref_file);
    check_header_ctx(opt, *s.ref_file);    // the header's context and the text before the weights are loaded
    std::string text = read_text(opt.text);

    llama_runtime_init();
    s.ref_model = load_model(opt.reference);
    const llama_vocab * vocab = llama_model_get_vocab(s.ref_model.get());
    s.tokens = checked_tokens(opt, *s.ref_file, s.ref_model.get(), text);
    text = std::string();
    s.n_ctx = opt.n_ctx;
    const int64_t n_chunk_max = static_cast<int64_t>(s.tokens.size()) / s.n_ctx;
    s.n_chunks = opt.n_chunks < 0 ? n_chunk_max : std::min<int64_t>(opt.n_chunks, n_chunk_max);
    s.n_vocab = llama_vocab_n_tokens(vocab);
    s.first = s.n_ctx / 2;
    s.n_score = s.n_ctx - 1 - s.first;      // rows first … n_ctx−2 predict tokens first+1 … n_ctx−1

    eval_result & result = s.base;
    result.reference = opt.reference;
    result.text = opt.text;
    result.n_ctx = opt.n_ctx;
    result.n_chunks = static_cast<int>(s.n_chunks);
    result.n_text_tokens = static_cast<int64_t>(s.tokens.size());
    result.n_scored = s.n_chunks * s.n_score;
    describe_file(result.ref, *s.ref_file);

    s.keep = reference_bytes() <= keep_reference_max_bytes;
    s.storing = s.keep;
    s.kept.resize(static_cast<size_t>(s.n_chunks));
    s.kept_rows.resize(static_cast<size_t>(s.n_chunks));
    s.ref_ctx = new_context(s.ref_model.get(), opt.reference, opt.n_ctx, s.n_threads);
    s.batch = llama_batch_init(static_cast<int32_t>(s.n_ctx), 0, 1);
    s.add_bos = llama_vocab_get_add_bos(vocab);
    s.bos = llama_vocab_bos(vocab);
}

eval_session::~eval_session() = default;

int64_t eval_session::reference_bytes() const {
    return p_->n_chunks * p_->n_score * static_cast<int64_t>(p_->n_vocab) * static_cast<int64_t>(sizeof(float));
}

bool eval_session::keeps_reference() const { return p_->keep; }

void eval_session::stop_keeping() { p_->storing = false; }

bool eval_session::score(const std::vector<std::string> & files, const std::function<bool()> & stop, bool show_progress) {
    impl & s = *p_;
    if (s.finished) {
        fail("eval_session::score after finish: a session's numbers are final once read");
    }
    // Validate every new file before loading anything: a bad file is an error naming it, never an abort.
    std::vector<std::unique_ptr<gguf_file>> new_files(files.size());
    for (size_t f = 0; f < files.size(); ++f) {
        if (!s.files.count(files[f])) {
            new_files[f] = std::make_unique<gguf_file>(files[f]);
            check_same_model(*s.ref_file, s.ref_id, *new_files[f]);
        }
    }
    for (size_t f = 0; f < files.size(); ++f) {
        if (!new_files[f] || s.files.count(files[f])) {
            continue;
        }
        impl::scored_file sf;
        sf.file = std::move(new_files[f]);
        sf.model = load_model(files[f]);
        sf.ctx = new_context(sf.model.get(), files[f], s.opt.n_ctx, s.n_threads);
        if (llama_vocab_n_tokens(llama_model_get_vocab(sf.model.get())) != s.n_vocab) {
            fail("'{}' has {} tokens in libllama but the reference '{}' has {}", files[f],
                 llama_vocab_n_tokens(llama_model_get_vocab(sf.model.get())), s.opt.reference, s.n_vocab);
        }
        s.files.emplace(files[f], std::move(sf));
    }
    // The decodes still to do, for the progress bar: each file's chunks, and the reference's not at hand.
    // With no file, the reference's logits alone, when they are kept (for files scored later).
    int64_t from = s.n_chunks;
    int64_t todo = 0;
    if (files.empty() && s.storing) {
        from = s.ref_done;
    }
    for (const std::string & path : files) {
        from = std::min(from, s.files.at(path).done);
        todo += s.n_chunks - s.files.at(path).done;
    }
    for (int64_t c = from; c < s.n_chunks; ++c) {
        todo += s.keep && !s.kept[c].empty() ? 0 : 1;
    }
    std::optional<progress> bar;
    if (show_progress && todo > 0) {
        bar.emplace("eval", todo * s.n_ctx, "tok");
    }
    for (int64_t c = from; c < s.n_chunks; ++c) {
        s.fill_batch(c);
        if (stop && !(s.keep && !s.kept[c].empty()) && stop()) {
            return false;
        }
        const bool decoding = !(s.keep && !s.kept[c].empty()) && s.ref_chunk != c;
        const auto [p, ps] = s.reference_chunk(c);
        if (bar && decoding) {
            bar->add(s.n_ctx, s.base.ref.name);
        }
        for (const std::string & path : files) {
            impl::scored_file & sf = s.files.at(path);
            if (sf.done != c) {
                continue;
            }
            if (stop && stop()) {
                return false;
            }
            s.score_chunk(path, sf, c, p, ps);
            if (bar) {
                bar->add(s.n_ctx, std::filesystem::path(path).filename().string());
            }
        }
    }
    if (bar) {
        bar->finish();
    }
    return true;
}

eval_result eval_session::finish(const std::vector<std::string> & files) {
    impl & s = *p_;
    if (s.finished) {
        fail("eval_session::finish called twice");
    }
    for (const std::string & path : files) {
        if (!s.files.count(path) || s.files.at(path).done != s.n_chunks) {
            fail("eval_session::finish: '{}' is not scored on every chunk yet (score it first)", path);
        }
    }
    s.finished = true;
    eval_result result = s.base;
    result.devices = llama_gpu_devices();
    finish_file(result.ref, s.ref_acc);
    for (const std::string & path : files) {
        eval_file_result r;
        describe_file(r, *s.files.at(path).file);
        finish_file(r, s.files.at(path).acc);
        result.files.push_back(std::move(r));
    }
    // The kept logits are not needed any more.
    s.kept.clear();
    s.kept_rows.clear();
    if (s.opt.speed_reps > 0) {
        // One model at a time, the scoring contexts freed first.
        s.ref_ctx.reset();
        for (auto & [path, sf] : s.files) {
            sf.ctx.reset();
        }
        result.speed_reps = s.opt.speed_reps;
        result.speed_threads = s.n_threads;
        progress speed_bar("speed", static_cast<int64_t>(1 + files.size()), "file");
        if (s.opt.reference_speed) {
            measure_speed(s.ref_model.get(), s.opt.reference, s.n_threads, s.opt.speed_reps, result.ref);
        }
        speed_bar.add(1, result.ref.name);
        for (size_t f = 0; f < files.size(); ++f) {
            measure_speed(s.files.at(files[f]).model.get(), files[f], s.n_threads, s.opt.speed_reps, result.files[f]);
            speed_bar.add(1, result.files[f].name);
        }
        speed_bar.finish();
        if (const std::string w = speed_load_warning(result); !w.empty()) {
            fmt::print(stderr, "voodoo: warning: {}\n", w);
        }
    }
    return result;
}

eval_result run_eval(const eval_options & opt, const std::vector<std::string> & files) {
    if (files.empty()) {
        fail("give at least one GGUF to evaluate against the reference (the reference itself gives KLD 0)");
    }
    eval_session session(opt, 0);
    session.score(files);
    return session.finish(files);
}

}  // namespace voodoo
