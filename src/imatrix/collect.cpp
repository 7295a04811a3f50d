#include "imatrix/collect.h"

#include "common/error.h"
#include "common/progress.h"
#include "data/dataset.h"
#include "dist/dist.h"
#include "ggml/log.h"
#include "ggml/quant.h"
#include "ggml/runtime.h"
#include "ggml/gguf.h"
#include "model/gguf_weights.h"
#include "model/registry.h"

#include <ggml-backend.h>
#include <llama.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>

#include <xxhash.h>

namespace voodoo {

namespace {

// The weight's GGUF name from a graph node's src0 name ("CUDA0#blk.0.attn_k.weight#0" → "blk.0.attn_k.weight"),
// as llama-imatrix's filter_tensor_name.
std::string weight_name(const char * name) {
    const char * p = std::strchr(name, '#');
    if (!p) {
        return name;
    }
    ++p;
    const char * q = std::strchr(p, '#');
    return q ? std::string(p, static_cast<size_t>(q - p)) : std::string(p);
}

struct collector {
    imatrix im;
    std::string error;              // set on the first bad activation; the callback then stops the graph
    std::vector<uint8_t> src1;      // activations copied from the backend
    std::vector<uint8_t> ids;       // expert ids of a MUL_MAT_ID

    bool wanted(const ggml_tensor * t) const {
        if (t->op == GGML_OP_MUL_MAT_ID) {
            return true;
        }
        if (t->op != GGML_OP_MUL_MAT) {
            return false;
        }
        const ggml_tensor * src1 = t->src[1];
        if (src1->ne[1] < 16 || src1->type != GGML_TYPE_F32) {
            return false;
        }
        const std::string name = weight_name(t->src[0]->name);
        // A tied head reads token_embd.weight in a matmul (the lookup is a get_rows, never seen here): it gets
        // the head's entry, as output.weight does with llama-imatrix's --process-output.
        return name.starts_with("blk.") || name == "output.weight" || name == "token_embd.weight";
    }

    bool fail_with(std::string why) {
        if (error.empty()) {
            error = std::move(why);
        }
        return false;
    }

    bool collect(ggml_tensor * t) {
        const ggml_tensor * src0 = t->src[0];
        const ggml_tensor * x = t->src[1];
        const std::string name = weight_name(src0->name);
        if (x->nb[0] != ggml_element_size(x)) {
            return fail_with(fmt::format("activations of '{}' are not contiguous in a row", name));
        }
        src1.resize(ggml_nbytes(x));
        ggml_backend_tensor_get(x, src1.data(), 0, src1.size());
        const auto * data = reinterpret_cast<const char *>(src1.data());
        const int64_t ne0 = x->ne[0];
        imatrix_entry & e = im.entries[name];
        if (t->op == GGML_OP_MUL_MAT_ID) {
            // ids: [n_expert_used, n_tokens] i32 (not contiguous); x: [ne0, n_expert_used or 1, n_tokens]
            const ggml_tensor * id_t = t->src[2];
            const int64_t n_as = src0->ne[2];
            ids.resize(ggml_nbytes(id_t));
            ggml_backend_tensor_get(id_t, ids.data(), 0, ids.size());
            if (e.in_sum2.empty()) {
                e.in_sum2.assign(static_cast<size_t>(ne0 * n_as), 0.0f);
                e.counts.assign(static_cast<size_t>(n_as), 0);
            } else if (e.in_sum2.size() != static_cast<size_t>(ne0 * n_as)) {
                return fail_with(fmt::format("'{}' changed size between calls ({} vs {})", name, e.in_sum2.size(),
                                             ne0 * n_as));
            }
            for (int64_t idx = 0; idx < id_t->ne[0]; ++idx) {
                for (int64_t row = 0; row < x->ne[2]; ++row) {
                    int32_t ex;
                    std::memcpy(&ex, ids.data() + row * id_t->nb[1] + idx * id_t->nb[0], sizeof ex);
                    if (ex < 0 || ex >= n_as) {
                        return fail_with(fmt::format("'{}': expert id {} outside [0, {})", name, ex, n_as));
                    }
                    const auto * xr = reinterpret_cast<const float *>(data + (idx % x->ne[1]) * x->nb[1] +
                                                                      row * x->nb[2]);
                    float * acc = e.in_sum2.data() + ex * ne0;
                    ++e.counts[static_cast<size_t>(ex)];
                    for (int64_t j = 0; j < ne0; ++j) {
                        acc[j] += xr[j] * xr[j];
                    }
                }
            }
        } else {
            const int64_t n_mat = src0->ne[2] * src0->ne[3];
            if (e.in_sum2.empty()) {
                e.in_sum2.assign(static_cast<size_t>(ne0 * n_mat), 0.0f);
                e.counts.assign(1, 0);
            } else if (e.in_sum2.size() != static_cast<size_t>(ne0 * n_mat)) {
                return fail_with(fmt::format("'{}' changed size between calls ({} vs {})", name, e.in_sum2.size(),
                                             ne0 * n_mat));
            }
            for (int64_t i3 = 0; i3 < x->ne[3]; ++i3) {
                for (int64_t i2 = 0; i2 < x->ne[2]; ++i2) {
                    // 3-D activations against a 2-D weight are flattened onto its one matrix.
                    const int64_t mat = (i3 % src0->ne[3]) * src0->ne[2] + (i2 % src0->ne[2]);
                    float * acc = e.in_sum2.data() + mat * ne0;
                    for (int64_t row = 0; row < x->ne[1]; ++row) {
                        const auto * xr =
                            reinterpret_cast<const float *>(data + row * x->nb[1] + i2 * x->nb[2] + i3 * x->nb[3]);
                        for (int64_t j = 0; j < ne0; ++j) {
                            acc[j] += xr[j] * xr[j];
                        }
                    }
                }
            }
            for (int64_t & c : e.counts) {
                c += ggml_nrows(x) / n_mat;
            }
        }
        for (float v : e.in_sum2) {
            if (!std::isfinite(v)) {
                return fail_with(fmt::format("non-finite activations reached '{}'; the model or its input is broken",
                                             name));
            }
        }
        return true;
    }
};

// ggml_backend_sched_eval_callback: asked first whether we want a node, then called with it computed.
bool eval_callback(ggml_tensor * t, bool ask, void * user_data) {
    auto * c = static_cast<collector *>(user_data);
    if (ask) {
        return c->wanted(t);
    }
    return c->collect(t);
}

struct model_deleter {
    void operator()(llama_model * m) const { llama_model_free(m); }
};
struct context_deleter {
    void operator()(llama_context * c) const { llama_free(c); }
};

// The number of train chunks the imatrix reads (max_chunks, or all), after the checks both collectors share.
int64_t chunks_to_read(const imatrix_options & o, const token_file & train) {
    if (train.ctx() < 16) {
        fail("'{}' has chunks of {} tokens; the imatrix needs at least 16 (llama-imatrix skips smaller batches): "
             "run `voodoo data` with a larger --ctx",
             o.data_dir, train.ctx());
    }
    const int64_t n_chunks = o.max_chunks > 0 ? std::min(o.max_chunks, train.n_chunks()) : train.n_chunks();
    if (n_chunks == 0) {
        fail("'{}' has no train chunks; run `voodoo data` on more text", o.data_dir);
    }
    return n_chunks;
}

}  // namespace

imatrix collect_imatrix(const imatrix_options & o) {
    const token_data data(o.data_dir);
    data.require_vocab_of(o.model);
    const token_file & train = data.train();
    const int64_t n_chunks = chunks_to_read(o, train);

    llama_runtime_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    std::unique_ptr<llama_model, model_deleter> model;
    {
        ggml_log_capture capture;
        model.reset(llama_model_load_from_file(o.model.c_str(), mp));
        if (!model) {
            fail("libllama could not load '{}' ({})", o.model, capture.text());
        }
    }
    collector c;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = static_cast<uint32_t>(train.ctx());
    cp.n_batch = static_cast<uint32_t>(train.ctx());
    cp.n_ubatch = static_cast<uint32_t>(train.ctx());
    cp.n_seq_max = 1;
    // K/V in f32 and no flash attention: the activations are the model's, not rounded through an f16 cache
    // (llama-imatrix's defaults round K/V to f16, which moves Σx² by about 1e-3 relative; docs/DATA.md).
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.n_threads = cp.n_threads_batch = resolve_threads(o.n_threads);
    cp.cb_eval = eval_callback;
    cp.cb_eval_user_data = &c;
    cp.no_perf = true;
    std::unique_ptr<llama_context, context_deleter> ctx;
    {
        ggml_log_capture capture;
        ctx.reset(llama_init_from_model(model.get(), cp));
        if (!ctx) {
            fail("libllama could not create a context of {} tokens for '{}' ({})", train.ctx(), o.model,
                 capture.text());
        }
    }

    llama_batch batch = llama_batch_init(static_cast<int32_t>(train.ctx()), 0, 1);
    const auto start = std::chrono::steady_clock::now();
    {
        progress bar("imatrix", n_chunks, "chunks");
        for (int64_t i = 0; i < n_chunks; ++i) {
            llama_memory_clear(llama_get_memory(ctx.get()), true);
            const auto tokens = train.chunk(i);
            batch.n_tokens = static_cast<int32_t>(tokens.size());
            for (int32_t k = 0; k < batch.n_tokens; ++k) {
                batch.token[k] = tokens[static_cast<size_t>(k)];
                batch.pos[k] = k;
                batch.n_seq_id[k] = 1;
                batch.seq_id[k][0] = 0;
                batch.logits[k] = true;  // every position: the output head sees every token, as in llama-imatrix
            }
            const int32_t rc = llama_decode(ctx.get(), batch);
            if (!c.error.empty() || rc != 0) {
                llama_batch_free(batch);
                fail("imatrix of '{}', chunk {}: {}", o.model, i,
                     c.error.empty() ? fmt::format("llama_decode returned {}", rc) : c.error);
            }
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            bar.add(1, fmt::format("{:.0f} tok/s", static_cast<double>((i + 1) * train.ctx()) / std::max(s, 1e-9)));
        }
    }
    llama_batch_free(batch);
    if (c.im.entries.empty()) {
        fail("no matmul of '{}' was seen; libllama computed no weight named blk.*, output.weight or a tied token_embd.weight", o.model);
    }
    c.im.chunk_size = train.ctx();
    c.im.chunk_count = n_chunks;
    c.im.datasets = data.sources();
    return std::move(c.im);
}

namespace {

// Every rank's column sums and counts summed over the ranks (collect_imatrix_torch with a group): first the names any
// rank saw (a rank may have run no forward, or routed no token to a tensor's experts), each made on every rank where
// missing (zeros: [n_mat, ne0] as the observer would make it), then one all-reduce of the f64 sums and one of the counts.
void reduce_over_ranks(dist::process_group & pg, const gguf_file & file, std::map<std::string, torch::Tensor> & sums,
                       std::map<std::string, std::vector<int64_t>> & rows_seen, torch::Device device) {
    const std::vector<gguf_tensor> & tensors = file.tensors();
    torch::Tensor seen = torch::zeros({static_cast<int64_t>(tensors.size())}, torch::kFloat);
    for (size_t i = 0; i < tensors.size(); ++i) {
        seen[static_cast<int64_t>(i)] = sums.count(tensors[i].name) ? 1.0f : 0.0f;
    }
    pg.all_reduce_max(seen);
    const float * any = seen.data_ptr<float>();
    std::vector<torch::Tensor> s, c;
    for (size_t i = 0; i < tensors.size(); ++i) {
        const gguf_tensor & t = tensors[i];
        if (any[i] == 0.0f) {
            continue;
        }
        if (!sums.count(t.name)) {
            const int64_t n_mat = t.n_dims >= 3 ? t.ne[2] : 1;
            sums.emplace(t.name, torch::zeros({n_mat, t.ne[0]}, torch::TensorOptions().dtype(torch::kDouble).device(device)));
            rows_seen[t.name].assign(static_cast<size_t>(n_mat), 0);
        }
        s.push_back(sums.at(t.name));
        c.push_back(torch::tensor(rows_seen.at(t.name), torch::kLong));
    }
    pg.all_reduce_sum(s);
    pg.all_reduce_sum(c);
    size_t j = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
        if (any[i] != 0.0f) {
            const torch::Tensor & counts = c[j++];
            rows_seen[tensors[i].name].assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + counts.numel());
        }
    }
}

// The stream one layer-sharded rank passes to the next.
constexpr int imatrix_stream_tag = 31;

}  // namespace

imatrix collect_imatrix_torch(const imatrix_options & o, torch::Device device, int64_t batch_tokens, dist::process_group * pg,
                              bool layers) {
    const int rank = pg ? pg->rank() : 0, ranks = pg ? pg->size() : 1;
    const bool pipelined = layers && pg && ranks > 1;
    const token_data data(o.data_dir);
    data.require_vocab_of(o.model);
    const token_file & train = data.train();
    const int64_t n_chunks = chunks_to_read(o, train);
    const int64_t ctx = train.ctx();
    const int64_t per_forward = std::max<int64_t>(1, batch_tokens / ctx);
    if (pg && ranks > 1) {  // ranks that would split other chunks would add up to no run's imatrix
        const std::string same = fmt::format("{} {} {} {:x}", n_chunks, per_forward, ctx,
                                             XXH3_64bits(train.tokens().data(), train.tokens().size_bytes()));
        dist::require_same_on_every_rank(*pg, XXH3_64bits(same.data(), same.size()),
                                         "--chunks, --batch-tokens or the calibration chunks");
        dist::require_same_on_every_rank(*pg, pipelined ? 1 : 0, "the --parallel options");
    }

    const gguf_file file(o.model);
    auto model = build_model(file);
    // Layer sharding: this rank's layers, and every forward passes through every rank.
    const std::pair<int64_t, int64_t> my_layers =
        pipelined ? dist::balance_layers_of(file, ranks)[static_cast<size_t>(rank)]
                  : std::pair<int64_t, int64_t>{0, model->hparams().n_layer};
    if (pipelined) {
        fmt::print(stderr, "rank {} of {}: imatrix of layers [{}, {}) (--parallel layers), every chunk's forward rank to rank\n", rank, ranks,
                   my_layers.first, my_layers.second);
    }
    gguf_weights w(file, device, o.n_threads);
    torch::NoGradGuard no_grad;

    // Σx² per input column (f64, on the device, [n_mat, ne0]) and activation rows per matrix, by weight name. A
    // 2-D weight has one matrix; an expert tensor one per expert, and only its routed tokens count (MUL_MAT_ID).
    std::map<std::string, torch::Tensor> sums;
    std::map<std::string, std::vector<int64_t>> rows_seen;
    model->set_observer([&](const std::string & name, const torch::Tensor & x, int64_t expert) {
        const torch::Tensor rows = x.reshape({-1, x.size(-1)});
        const torch::Tensor s = rows.to(torch::kDouble).square().sum(0);
        auto it = sums.find(name);
        if (it == sums.end()) {
            const int64_t n_mat = expert < 0 ? 1 : file.tensor(name).ne[2];
            it = sums.emplace(name, torch::zeros({n_mat, s.size(0)}, s.options())).first;
            rows_seen[name].assign(static_cast<size_t>(n_mat), 0);
        }
        const int64_t mat = std::max<int64_t>(expert, 0);
        it->second[mat].add_(s);
        rows_seen[name][static_cast<size_t>(mat)] += rows.size(0);
    });

    const auto start = std::chrono::steady_clock::now();
    {
        // This rank's forwards: the single process's j-th, for j ≡ rank (mod ranks), or with layer sharding every one
        // (its layers of each); their first chunks.
        std::vector<int64_t> firsts;
        int64_t mine = 0, done = 0;
        const int64_t split = pipelined ? 1 : ranks, my_share = pipelined ? 0 : rank;
        for (int64_t first = per_forward * my_share; first < n_chunks; first += per_forward * split) {
            firsts.push_back(first);
            mine += std::min(per_forward, n_chunks - first);
        }
        progress bar("imatrix", mine, "chunks");
        for (const int64_t first : firsts) {
            const int64_t n = std::min(per_forward, n_chunks - first);
            std::vector<int64_t> ids;
            ids.reserve(static_cast<size_t>(n * ctx));
            for (int64_t i = first; i < first + n; ++i) {
                for (int32_t t : train.chunk(i)) {
                    ids.push_back(t);
                }
            }
            const torch::Tensor tokens = torch::tensor(ids, torch::kLong).reshape({n, ctx}).to(device);
            torch::Tensor in;  // the first rank (or the one process) starts from the tokens
            if (pipelined && rank > 0) {
                in = torch::empty({n, ctx, model->hparams().n_embd},
                                  torch::TensorOptions().dtype(model->compute_dtype()).device(device));
                pg->recv(in, rank - 1, imatrix_stream_tag);
            }
            const torch::Tensor h = pipelined ? model->hidden_layers(tokens, in, my_layers.first, my_layers.second, w)
                                              : model->hidden(tokens, w);
            if (pipelined && rank < ranks - 1) {
                pg->send(h, rank + 1, imatrix_stream_tag);
            } else {
                // The head on every position, one chunk at a time (libllama computes every chunk's logits: the
                // head's entry counts every token), without keeping [n, ctx, n_vocab] logits at once.
                for (int64_t i = 0; i < n; ++i) {
                    model->head(h[i], w);
                }
            }
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            done += n;
            bar.add(n, fmt::format("{:.0f} tok/s", static_cast<double>(done * ctx) / std::max(s, 1e-9)));
        }
    }
    if (pipelined) {
        fmt::print(stderr, "rank {} of {}: read {} of the model's {} tensors\n", rank, ranks, w.tensors_read().size(),
                   file.tensors().size());
    }
    if (pg && ranks > 1) {
        reduce_over_ranks(*pg, file, sums, rows_seen, device);
    }
    if (sums.empty()) {
        fail("no matmul of '{}' was seen by the LibTorch forward", o.model);
    }
    imatrix im;
    for (const auto & [name, s] : sums) {
        const torch::Tensor f = s.to(torch::kCPU).to(torch::kFloat).contiguous();
        if (!torch::isfinite(f).all().item<bool>()) {
            fail("non-finite activations reached '{}'; the model or its input is broken", name);
        }
        imatrix_entry & e = im.entries[name];
        e.in_sum2.assign(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
        e.counts = rows_seen[name];
    }
    im.chunk_size = ctx;
    im.chunk_count = n_chunks;
    im.datasets = data.sources();
    return im;
}

}  // namespace voodoo
