#include "train/prune.h"

#include "common/error.h"
#include "common/file.h"
#include "common/progress.h"
#include "ggml/quant.h"
#include "ggml/types.h"
#include "train/candidates.h"
#include "train/gated.h"
#include "train/probe.h"

#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <limits>
#include <mutex>
#include <thread>

namespace voodoo {

namespace {

bool is_float(ggml_type t) { return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16; }

}  // namespace

bool lattice_quantizer(ggml_type type) { return lattice_grid_order(type) >= 0; }

namespace {

// The types eager_types prefers: block types whose quantizer searches no lattice.
bool fast_block_type(ggml_type t) { return !is_float(t) && !lattice_quantizer(t); }

}  // namespace

double quantize_cost_per_weight(ggml_type type) {
    switch (type) {  // 1 / (M weights per second on one core), bench_quant quantize_1core, 2026-12-03
        case GGML_TYPE_IQ1_S: return 1 / 7.19;
        case GGML_TYPE_IQ1_M: return 1 / 1.56;
        case GGML_TYPE_IQ2_XXS: return 1 / 3.63;
        case GGML_TYPE_IQ2_XS: return 1 / 1.91;
        case GGML_TYPE_IQ2_S: return 1 / 4.94;
        case GGML_TYPE_Q2_K: return 1 / 8.14;
        case GGML_TYPE_IQ3_XXS: return 1 / 2.66;
        case GGML_TYPE_IQ3_S: return 1 / 3.43;
        case GGML_TYPE_Q3_K: return 1 / 27.5;
        case GGML_TYPE_IQ4_XS: return 1 / 5.06;
        case GGML_TYPE_IQ4_NL: return 1 / 4.55;
        case GGML_TYPE_Q4_0: return 1 / 43.4;
        case GGML_TYPE_Q4_K: return 1 / 10.6;
        case GGML_TYPE_Q4_1: return 1 / 9.86;
        case GGML_TYPE_Q5_0: return 1 / 38.9;
        case GGML_TYPE_Q5_K: return 1 / 9.55;
        case GGML_TYPE_Q5_1: return 1 / 8.38;
        case GGML_TYPE_Q6_K: return 1 / 37.9;
        case GGML_TYPE_Q8_0: return 1 / 288.0;
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
        case GGML_TYPE_BF16: return 0.002;
        default: return 1 / 10.0;  // a type outside the default menu (TQ1_0, …): a K-quant's cost
    }
}

namespace {

// Where sampled_weighted_errors keeps one value (its doc comment): a key of 32 hex digits.
std::string error_path(const std::string & cache_dir, const std::string & key) {
    return (std::filesystem::path(cache_dir) / "errors" / key.substr(0, 2) / (key + ".err")).string();
}

// The value kept at `path`, when the file is there whole (8 bytes of double, 8 of XXH3-64 over them).
std::optional<double> read_kept_error(const std::string & path) {
    std::ifstream in(path, std::ios::binary);
    double v = 0;
    uint64_t sum = 0;
    if (!in.read(reinterpret_cast<char *>(&v), sizeof v) || !in.read(reinterpret_cast<char *>(&sum), sizeof sum) ||
        sum != XXH3_64bits(&v, sizeof v) || !std::isfinite(v)) {
        return std::nullopt;
    }
    return v;
}

void keep_error(const std::string & path, double v) {
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
    std::vector<uint8_t> bytes(16);
    const uint64_t sum = XXH3_64bits(&v, sizeof v);
    std::memcpy(bytes.data(), &v, sizeof v);
    std::memcpy(bytes.data() + 8, &sum, sizeof sum);
    try {
        write_file_atomic(path, bytes);
    } catch (const error &) {
        // A value not kept is measured again by a later run: a full disk must not stop this one.
    }
}

}  // namespace

std::vector<std::vector<double>> sampled_weighted_errors(const gguf_file & src, const std::vector<tensor_menu> & menus,
                                                         const importance_map * importance, const prune_options & o,
                                                         int n_threads, const std::vector<std::vector<bool>> * only,
                                                         const std::string & cache_dir) {
    std::vector<std::vector<double>> out(menus.size());
    std::vector<std::pair<size_t, size_t>> jobs;
    std::vector<bool> sampled(menus.size(), false);
    for (size_t i = 0; i < menus.size(); ++i) {
        out[i].assign(menus[i].types.size(), 0.0);
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            if (menus[i].types[k] != menus[i].tensor->type && (!only || (*only)[i][k])) {
                jobs.emplace_back(i, k);
                sampled[i] = true;
            }
        }
    }
    // The sampled rows of every tensor with work in f32, with their expert's importance: one pass over the source.
    struct sample {
        std::vector<int64_t> rows;      // row indices (over experts × rows per expert)
        std::vector<float> f32;         // [rows.size(), ne0]
        std::span<const float> imp;     // ne0 · experts, or empty
        double scale = 1;               // R / n
        XXH128_hash_t digest{};         // with cache_dir: the rows, their importance, the scale and llama.cpp's commit
    };
    std::vector<sample> samples(menus.size());
    for (size_t i = 0; i < menus.size(); ++i) {
        if (!sampled[i]) {
            continue;
        }
        const gguf_tensor & t = *menus[i].tensor;
        const int64_t R = t.n_rows(), ne0 = t.ne[0];
        const int64_t n = std::min(R, std::max(o.min_sample_rows, R / std::max<int64_t>(1, o.sample_divisor)));
        sample & s = samples[i];
        s.imp = importance_for(importance, t);
        s.scale = static_cast<double>(R) / static_cast<double>(n);
        const auto data = src.data(t);
        const size_t row_bytes = t.n_bytes / static_cast<size_t>(R);
        s.f32.resize(static_cast<size_t>(n * ne0));
        for (int64_t j = 0; j < n; ++j) {
            const int64_t r = (2 * j + 1) * R / (2 * n);  // the middle of the j-th of n equal spans
            s.rows.push_back(r);
            dequantize_into(t.type, data.subspan(static_cast<size_t>(r) * row_bytes, row_bytes), ne0,
                            std::span<float>(s.f32).subspan(static_cast<size_t>(j * ne0), static_cast<size_t>(ne0)), 1, t.name);
        }
        if (!cache_dir.empty()) {
            XXH3_state_t * st = XXH3_createState();
            XXH3_128bits_reset(st);
            const char tag[] = "voodoo sampled weighted error v1";
            XXH3_128bits_update(st, tag, sizeof tag);
            XXH3_128bits_update(st, s.f32.data(), s.f32.size() * sizeof(float));
            XXH3_128bits_update(st, s.rows.data(), s.rows.size() * sizeof(int64_t));
            const int64_t dims[3] = {ne0, t.ne[1], static_cast<int64_t>(s.imp.size())};
            XXH3_128bits_update(st, dims, sizeof dims);
            XXH3_128bits_update(st, s.imp.data(), s.imp.size_bytes());
            XXH3_128bits_update(st, &s.scale, sizeof s.scale);
            const char * commit = VOODOO_LLAMA_COMMIT;
            XXH3_128bits_update(st, commit, std::strlen(commit));
            s.digest = XXH3_128bits_digest(st);
            XXH3_freeState(st);
        }
    }
    // With cache_dir, each job's key (the tensor's digest and the type) and the values a run kept before.
    std::vector<std::string> keys(jobs.size());
    if (!cache_dir.empty()) {
        std::vector<std::pair<size_t, size_t>> left;
        std::vector<std::string> left_keys;
        for (size_t j = 0; j < jobs.size(); ++j) {
            const auto [i, k] = jobs[j];
            // The tensor's digest and the type: a value's key.
            const uint64_t parts[3] = {samples[i].digest.high64, samples[i].digest.low64,
                                       static_cast<uint64_t>(menus[i].types[k])};
            const XXH128_hash_t h = XXH3_128bits(parts, sizeof parts);
            const std::string key = fmt::format("{:016x}{:016x}", h.high64, h.low64);
            if (const auto kept = read_kept_error(error_path(cache_dir, key))) {
                out[i][k] = *kept;
            } else {
                left.push_back(jobs[j]);
                left_keys.push_back(key);
            }
        }
        jobs = std::move(left);
        keys = std::move(left_keys);
    }
    // The types with no lattice grid first, then the lattice types whose grids a lattice_warmup has ready first: a
    // job of a lattice type waits for its grid (ggml's IQ1 grid takes ≈ 19 s), and the others need not wait with it.
    constexpr int k_no_grid = 1 << 20;
    std::vector<size_t> order(jobs.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        const int ga = lattice_grid_order(menus[jobs[a].first].types[jobs[a].second]);
        const int gb = lattice_grid_order(menus[jobs[b].first].types[jobs[b].second]);
        return (ga < 0 ? k_no_grid : ga) > (gb < 0 ? k_no_grid : gb);
    });
    progress bar("sampled errors", static_cast<int64_t>(jobs.size()), "cand");
    std::atomic<size_t> next{0};
    std::exception_ptr failure;
    std::mutex failure_mutex;
    auto work = [&] {
        std::vector<float> back;
        for (size_t n; (n = next++) < jobs.size();) {
            const size_t j = order[n];
            const auto [i, k] = jobs[j];
            try {
                const gguf_tensor & t = *menus[i].tensor;
                const sample & s = samples[i];
                const int64_t ne0 = t.ne[0], per_expert = t.ne[1];
                const ggml_type type = menus[i].types[k];
                double sum = 0;
                back.resize(static_cast<size_t>(ne0));
                for (size_t r = 0; r < s.rows.size(); ++r) {
                    const std::span<const float> row = std::span<const float>(s.f32).subspan(r * static_cast<size_t>(ne0), static_cast<size_t>(ne0));
                    const std::span<const float> imp =
                        s.imp.empty() ? s.imp : s.imp.subspan(static_cast<size_t>(s.rows[r] / per_expert * ne0), static_cast<size_t>(ne0));
                    const std::vector<uint8_t> q = quantize(type, row, ne0, imp, 1, t.name);
                    dequantize_into(type, q, ne0, back, 1, t.name);
                    for (int64_t c = 0; c < ne0; ++c) {
                        const double d = static_cast<double>(back[static_cast<size_t>(c)]) - row[static_cast<size_t>(c)];
                        sum += (imp.empty() ? 1.0 : imp[static_cast<size_t>(c)]) * d * d;
                    }
                }
                out[i][k] = sum * s.scale;
                if (!cache_dir.empty()) {
                    keep_error(error_path(cache_dir, keys[j]), out[i][k]);
                }
            } catch (...) {
                std::lock_guard<std::mutex> lock(failure_mutex);
                failure = std::current_exception();
                next = jobs.size();
            }
            bar.add(1);
        }
    };
    std::vector<std::thread> pool;
    for (int t = 0; t < std::min<int>(resolve_threads(n_threads), static_cast<int>(std::max<size_t>(1, jobs.size()))); ++t) {
        pool.emplace_back(work);
    }
    for (std::thread & t : pool) {
        t.join();
    }
    bar.finish();
    if (failure) {
        std::rethrow_exception(failure);
    }
    return out;
}

error_split split_for_lattice_grids(const std::vector<tensor_menu> & menus) {
    error_split s;
    for (const tensor_menu & m : menus) {
        // As eager_types chooses: among the non-lattice block types (other than the source's own), when there are any.
        const bool fast = std::any_of(m.types.begin(), m.types.end(),
                                      [&](ggml_type t) { return fast_block_type(t) && t != m.tensor->type; });
        std::vector<bool> first, later;
        for (ggml_type t : m.types) {
            first.push_back(!fast || !lattice_quantizer(t));
            later.push_back(!first.back());
        }
        s.first.push_back(std::move(first));
        s.later.push_back(std::move(later));
    }
    return s;
}

std::vector<std::vector<bool>> error_split::needed_now(const std::vector<tensor_menu> & menus,
                                                       const std::vector<std::vector<double>> & err_hat) {
    std::vector<std::vector<bool>> now(menus.size());
    for (size_t i = 0; i < menus.size(); ++i) {
        now[i].assign(menus[i].types.size(), false);
        bool fast = false;  // eager_types' test: a non-lattice block type with Ê > 0
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            fast = fast || (err_hat[i][k] > 0 && fast_block_type(menus[i].types[k]));
        }
        for (size_t k = 0; !fast && k < menus[i].types.size(); ++k) {
            now[i][k] = later[i][k];
            later[i][k] = false;
        }
    }
    return now;
}

std::vector<std::vector<bool>> eager_types(const std::vector<tensor_menu> & menus,
                                           const std::vector<std::vector<double>> & err_hat, const prune_options & o) {
    std::vector<std::vector<bool>> eager;
    for (size_t i = 0; i < menus.size(); ++i) {
        const std::vector<ggml_type> & types = menus[i].types;
        const std::vector<double> & e = err_hat[i];
        std::vector<bool> row(types.size(), false);
        {
            std::vector<size_t> fast, block, any;
            for (size_t k = 0; k < types.size(); ++k) {
                if (e[k] > 0) {
                    any.push_back(k);
                    if (!is_float(types[k])) {
                        block.push_back(k);
                        if (!lattice_quantizer(types[k])) {
                            fast.push_back(k);
                        }
                    }
                }
            }
            std::vector<size_t> cheap;
            double e_fast = 0, e_cheap = 0;  // the largest Ê of each
            for (size_t k : fast) {
                e_fast = std::max(e_fast, e[k]);
                if (o.eager_max_cost <= 0 || quantize_cost_per_weight(types[k]) <= o.eager_max_cost) {
                    cheap.push_back(k);
                    e_cheap = std::max(e_cheap, e[k]);
                }
            }
            const bool cheap_spans = cheap.size() >= static_cast<size_t>(std::max(1, o.eager)) &&
                                     e_cheap * o.eager_reach >= e_fast;
            const std::vector<size_t> & live = cheap_spans                                                ? cheap
                                               : !fast.empty()                                            ? fast
                                               : !block.empty()                                           ? block
                                                                                                          : any;
            for (size_t k : spread_in_log_error(live, e, std::max(1, o.eager))) {
                row[k] = true;
            }
        }
        eager.push_back(std::move(row));
    }
    return eager;
}

namespace {

// The Lagrangian choice of every tensor at multiplier λ (argmin_k loss_k + λ · cost_k; ties to the cheaper) and its
// total bytes.
double lagrangian_total(const budget & b, const std::vector<std::vector<double>> & loss, double lambda) {
    double total = b.fixed;
    for (size_t i = 0; i < loss.size(); ++i) {
        size_t best = 0;
        for (size_t k = 1; k < loss[i].size(); ++k) {
            const double v = loss[i][k] + lambda * b.cost[i][k], w = loss[i][best] + lambda * b.cost[i][best];
            if (v < w || (v == w && b.cost[i][k] < b.cost[i][best])) {
                best = k;
            }
        }
        total += b.cost[i][best];
    }
    return total;
}

// The least λ (loss per byte) whose Lagrangian choice fits the budget: bisection in log λ (the total falls as λ grows).
double budget_multiplier(const budget & b, const std::vector<std::vector<double>> & loss) {
    double lo = -80, hi = 80;  // ln λ
    if (lagrangian_total(b, loss, std::exp(lo)) <= b.limit) {
        return std::exp(lo);
    }
    for (int it = 0; it < 200; ++it) {
        const double mid = 0.5 * (lo + hi);
        (lagrangian_total(b, loss, std::exp(mid)) <= b.limit ? hi : lo) = mid;
    }
    return std::exp(hi);
}

}  // namespace

namespace {

// p.kept, p.total and their bytes, from p.keep.
void count_kept(const std::vector<tensor_menu> & menus, prune_plan & p) {
    p.kept = p.total = 0;
    p.kept_bytes = p.total_bytes = 0;
    for (size_t i = 0; i < menus.size(); ++i) {
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            const double bytes = static_cast<double>(tensor_bytes(menus[i].types[k], menus[i].tensor->shape(), menus[i].tensor->name));
            p.total += 1;
            p.total_bytes += bytes;
            if (p.keep[i][k]) {
                p.kept += 1;
                p.kept_bytes += bytes;
            }
        }
    }
}

}  // namespace

prune_plan plan_pruning(const std::vector<tensor_menu> & menus, const std::vector<std::vector<double>> & err_hat,
                        const std::vector<std::vector<double>> & measured, const std::vector<std::vector<bool>> & eager,
                        const std::vector<budget> & budgets, const std::vector<std::vector<bool>> & also,
                        const prune_options & o, const std::vector<std::vector<double>> * anchors) {
    if (!(o.margin > 0 && o.margin <= 1)) {
        fail("candidate pruning: the margin must be in (0, 1] (got {})", o.margin);
    }
    std::vector<gated_tensor> light(menus.size());
    for (size_t i = 0; i < menus.size(); ++i) {
        light[i].tensor = menus[i].tensor;
        light[i].types = menus[i].types;
    }
    prune_plan p;
    p.predicted = anchors != nullptr ? *anchors : measured;
    predict_from_anchors(light, err_hat, p.predicted);
    for (size_t i = 0; i < menus.size(); ++i) {
        for (size_t k = 0; k < measured[i].size(); ++k) {
            p.predicted[i][k] = std::isnan(measured[i][k]) ? p.predicted[i][k] : measured[i][k];
        }
    }
    // Each unbuilt type's ΔKL lies in [margin · prediction, prediction / margin]; a measured one's, and the source's
    // own type's (0: its bytes are copied), are known.
    std::vector<std::vector<double>> lower = p.predicted, upper = p.predicted;
    std::vector<std::vector<bool>> known(menus.size());
    for (size_t i = 0; i < menus.size(); ++i) {
        for (size_t k = 0; k < lower[i].size(); ++k) {
            known[i].push_back(!std::isnan(measured[i][k]) || menus[i].types[k] == menus[i].tensor->type);
            if (!known[i][k]) {
                lower[i][k] *= o.margin;
                upper[i][k] /= o.margin;
            }
        }
    }
    p.keep = eager;
    for (size_t i = 0; i < menus.size(); ++i) {
        if (menus[i].types.size() < o.min_menu) {
            p.keep[i].assign(menus[i].types.size(), true);
        }
    }
    for (size_t i = 0; i < also.size() && i < p.keep.size(); ++i) {
        for (size_t k = 0; k < also[i].size() && k < p.keep[i].size(); ++k) {
            p.keep[i][k] = p.keep[i][k] || also[i][k];
        }
    }
    for (const budget & b : budgets) {
        // The exact knapsack on the predictions, and its neighbours in the menu.
        const std::vector<int> choice = allocate_exact(b, p.predicted);
        for (size_t i = 0; i < menus.size(); ++i) {
            const int n = static_cast<int>(menus[i].types.size());
            for (int k = std::max(0, choice[i] - o.neighbours); k <= std::min(n - 1, choice[i] + o.neighbours); ++k) {
                p.keep[i][static_cast<size_t>(k)] = true;
            }
        }
        // Every type that is the Lagrangian choice of its tensor for some ΔKL within the bounds at some multiplier the
        // budget can have: λ from the budget's multipliers of the three tables (lower, predicted, upper), each way
        // widened by o.widen.
        double la = budget_multiplier(b, p.predicted), lb = la;
        for (const auto * t : {&lower, &upper}) {
            const double l = budget_multiplier(b, *t);
            la = std::min(la, l);
            lb = std::max(lb, l);
        }
        la /= o.widen;
        lb *= o.widen;
        for (size_t i = 0; i < menus.size(); ++i) {
            const std::vector<double> & c = b.cost[i];
            for (size_t k = 0; k < c.size(); ++k) {
                double L = la, U = lb;  // λ with lower_k + λ c_k ≤ upper_j + λ c_j for every j
                for (size_t j = 0; j < c.size() && L <= U; ++j) {
                    if (j == k) {
                        continue;
                    }
                    const double slack = upper[i][j] - lower[i][k];
                    if (c[k] == c[j]) {  // of two types of one size (F16, BF16), an equal known one wins
                        U = slack > 0 || (slack == 0 && known[i][k]) ? U : -1;
                    } else if (c[k] > c[j]) {
                        U = std::min(U, slack / (c[k] - c[j]));
                    } else {
                        L = std::max(L, -slack / (c[j] - c[k]));
                    }
                }
                if (L <= U) {
                    p.keep[i][k] = true;
                }
            }
        }
    }
    count_kept(menus, p);
    return p;
}

void keep_also(const std::vector<tensor_menu> & menus, prune_plan & p, const std::vector<std::vector<bool>> & also) {
    for (size_t i = 0; i < menus.size(); ++i) {
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            p.keep[i][k] = p.keep[i][k] || also[i][k];
        }
    }
    count_kept(menus, p);
}

void order_likeliest_first(const std::vector<tensor_menu> & menus, const std::vector<std::vector<double>> & predicted,
                           const std::vector<budget> & budgets, std::vector<std::pair<size_t, size_t>> & jobs) {
    // The likeliest keeps first: a kept candidate built ahead saves its whole cost whatever its type, so the order
    // that saves most is by the chance of being kept, and the nearer a type is in its menu (ordered by size) to the
    // exact knapsack's choice on the guess at some budget, the likelier the probe keeps it. Among equals, the lattice
    // types (the slow ones), then the larger tensors. (Session 16 ordered lattice types first: on the Qwen3-1.7B
    // shape, 66 of the 135 built ahead were kept; docs/BENCHMARKS.md.)
    std::vector<std::vector<int>> distance(menus.size());
    for (size_t i = 0; i < menus.size(); ++i) {
        distance[i].assign(menus[i].types.size(), std::numeric_limits<int>::max());
    }
    for (const budget & b : budgets) {
        const std::vector<int> choice = allocate_exact(b, predicted);
        for (size_t i = 0; i < menus.size(); ++i) {
            for (size_t k = 0; k < menus[i].types.size(); ++k) {
                distance[i][k] = std::min(distance[i][k], std::abs(static_cast<int>(k) - choice[i]));
            }
        }
    }
    std::stable_sort(jobs.begin(), jobs.end(), [&](const auto & a, const auto & b) {
        const int da = distance[a.first][a.second], db = distance[b.first][b.second];
        if (da != db) {
            return da < db;
        }
        const bool la = lattice_quantizer(menus[a.first].types[a.second]);
        const bool lb = lattice_quantizer(menus[b.first].types[b.second]);
        if (la != lb) {
            return la;
        }
        return menus[a.first].tensor->n_elements() > menus[b.first].tensor->n_elements();
    });
}

std::vector<std::pair<size_t, size_t>> build_ahead_jobs(const std::vector<tensor_menu> & menus,
                                                        const std::vector<std::vector<double>> & err_hat,
                                                        const std::vector<std::vector<bool>> & eager,
                                                        const std::vector<budget> & budgets,
                                                        const std::vector<std::vector<bool>> & also,
                                                        const prune_options & o,
                                                        const std::vector<std::vector<bool>> * unknown) {
    // An unknown type's Ê as one no multiplier makes worth its bytes: predicted from it, its ΔKL lies beyond the
    // measured ones by ~1e200 (finite: sums over every tensor stay finite).
    std::vector<std::vector<double>> hat = err_hat;
    for (size_t i = 0; unknown && i < menus.size(); ++i) {
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            hat[i][k] = (*unknown)[i][k] && !eager[i][k] ? 1e200 : hat[i][k];
        }
    }
    std::vector<std::vector<double>> guess(menus.size());
    for (size_t i = 0; i < menus.size(); ++i) {
        guess[i].assign(menus[i].types.size(), std::numeric_limits<double>::quiet_NaN());
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            if (eager[i][k]) {
                guess[i][k] = hat[i][k];
            }
        }
    }
    const prune_plan p = plan_pruning(menus, hat, guess, eager, budgets, also, o);
    std::vector<std::pair<size_t, size_t>> jobs;
    for (size_t i = 0; i < menus.size(); ++i) {
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            if (p.keep[i][k] && !eager[i][k] && !(unknown && (*unknown)[i][k]) && menus[i].types[k] != menus[i].tensor->type) {
                jobs.emplace_back(i, k);
            }
        }
    }
    order_likeliest_first(menus, p.predicted, budgets, jobs);
    return jobs;
}

double stage_band_margin(const std::vector<tensor_menu> & menus, const prune_plan & first,
                         const std::vector<std::vector<double>> & measured, const std::vector<std::vector<bool>> & staged,
                         const std::vector<std::vector<bool>> & eager, const prune_options & o,
                         stage_band_miss * why) {
    if (o.stage_error_scale <= 0) {
        return o.stage_margin;
    }
    double worst = -1;
    std::vector<double> misses;
    for (size_t i = 0; i < menus.size(); ++i) {
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            const double m = measured[i][k], p = first.predicted[i][k];
            if (staged[i][k] && !eager[i][k] && std::isfinite(m) && std::isfinite(p) && m > 0 && p > 0) {
                const double miss = std::abs(std::log(m / p));
                if (why != nullptr) {
                    misses.push_back(miss);
                }
                if (miss > worst) {
                    worst = miss;
                    if (why != nullptr) {
                        why->tensor = menus[i].tensor->name;
                        why->type = menus[i].types[k];
                        why->measured = m;
                        why->predicted = p;
                    }
                }
            }
        }
    }
    if (why != nullptr && !misses.empty()) {
        why->types = static_cast<int64_t>(misses.size());
        why->largest = worst;
        const auto mid = misses.begin() + static_cast<std::ptrdiff_t>(misses.size() / 2);
        std::nth_element(misses.begin(), mid, misses.end());
        why->median = *mid;
    }
    if (worst < 0) {
        return o.stage_margin;
    }
    const double widest = std::log(1.0 / o.stage_margin);
    const double narrowest = std::min(widest, std::log(1.0 / o.stage_margin_narrowest));
    return std::exp(-std::clamp(o.stage_error_scale * worst, narrowest, widest));
}

std::vector<std::vector<bool>> stage_types(const std::vector<tensor_menu> & menus, const prune_plan & p,
                                           const std::vector<std::vector<double>> & measured,
                                           const std::vector<budget> & budgets, int width) {
    std::vector<std::vector<bool>> out(menus.size());
    for (size_t i = 0; i < menus.size(); ++i) {
        out[i].assign(menus[i].types.size(), false);
    }
    for (const budget & b : budgets) {
        const std::vector<int> choice = allocate_exact(b, p.predicted);
        for (size_t i = 0; i < menus.size(); ++i) {
            const int n = static_cast<int>(menus[i].types.size());
            for (int k = std::max(0, choice[i] - width); k <= std::min(n - 1, choice[i] + width); ++k) {
                const auto u = static_cast<size_t>(k);
                out[i][u] = out[i][u] || (p.keep[i][u] && std::isnan(measured[i][u]) && menus[i].types[u] != menus[i].tensor->type);
            }
        }
    }
    return out;
}

std::vector<tensor_menu> pruned_menus(const std::vector<tensor_menu> & menus, const std::vector<std::vector<bool>> & keep) {
    std::vector<tensor_menu> out = menus;
    for (size_t i = 0; i < out.size(); ++i) {
        std::vector<ggml_type> types;
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            if (keep[i][k]) {
                types.push_back(menus[i].types[k]);
            }
        }
        if (types.empty()) {
            fail("candidate pruning kept no type of tensor '{}'", menus[i].tensor->name);
        }
        out[i].types = std::move(types);
    }
    return out;
}

target parse_target_spec(const std::string & s, const std::string & flag) {
    const size_t eq = s.find('=');
    const std::string kind = eq == std::string::npos ? "" : s.substr(0, eq);
    double value = 0;
    try {
        size_t used = 0;
        value = std::stod(s.substr(eq + 1), &used);
        if (used != s.size() - eq - 1) {
            value = -1;
        }
    } catch (const std::exception &) {
        value = -1;
    }
    if ((kind != "bpw" && kind != "size" && kind != "ratio") || !(value > 0) || !std::isfinite(value)) {
        fail("{} '{}': expected bpw=X, size=BYTES or ratio=X with a positive number", flag, s);
    }
    return {kind == "bpw" ? target_kind::bpw : kind == "size" ? target_kind::size : target_kind::ratio, value};
}

}  // namespace voodoo
