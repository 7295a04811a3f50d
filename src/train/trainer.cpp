#include "train/trainer.h"

#include "eval/speed_table.h"

#include "common/error.h"
#include "model/replaced_weight.h"
#include "common/file.h"
#include "common/progress.h"
#include "common/torch_info.h"
#include "common/units.h"
#include "data/token_file.h"
#include "data/vocab.h"
#include "dist/dist.h"
#include "ggml/quant.h"
#include "ggml/types.h"
#include "model/gguf_weights.h"
#include "model/registry.h"
#include "train/gated.h"
#include "train/journal.h"
#include "train/loss.h"
#include "train/probe.h"
#include "train/prune.h"

#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <numeric>
#include <random>
#include <thread>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace voodoo {

namespace {

namespace fs = std::filesystem;

// Chunk order of one epoch: a permutation fixed by (seed, epoch), so a resumed run reads the same data.
std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch) {
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch));
    std::shuffle(order.begin(), order.end(), rng);
    return order;
}

// What decides the result of a run: a journal of another configuration is refused on --resume.
std::string fingerprint(const gguf_file & src, const std::vector<tensor_menu> & menus, const train_options & o,
                        uint64_t data_hash) {
    nlohmann::json j = {{"target", o.goal.str()}, {"steps", o.steps}, {"batch", o.batch}, {"accum", o.accum},
                        {"seq", o.seq}, {"lr", o.lr}, {"lr_final", o.lr_final}, {"wd", o.weight_decay},
                        {"tau0", o.tau0}, {"tau1", o.tau1}, {"lambda_kl", o.lambda_kl},
                        {"lambda_size", o.lambda_size}, {"tol", o.size_tol}, {"st", o.st_gumbel_fraction},
                        {"seed", o.seed}, {"data", data_hash}, {"gate_init", o.gate_init}, {"probe", o.probe_sequences}, {"model", src.tensors().size()},
                        {"lambda_ce", o.lambda_ce}, {"compute", o.compute}};
    if (o.probe_anchors > 0) {
        j["probe_anchors"] = o.probe_anchors;
    }
    if (o.routing != "mix") {
        j["routing"] = o.routing;
    }
    for (const tensor_menu & m : menus) {
        std::string types;
        for (ggml_type t : m.types) {
            types += type_name(t) + ",";
        }
        j["menus"][m.tensor->name] = types;
    }
    const std::string s = j.dump();
    return fmt::format("{:016x}", XXH3_64bits(s.data(), s.size()));
}

}  // namespace

std::vector<std::string> apply_cpu_defaults(train_options & o, const std::function<bool(const std::string &)> & given,
                                            int64_t ctx) {
    std::vector<std::string> set;
    auto def = [&](const char * flag, auto & field, auto value) {
        if (!given(flag)) {
            field = value;
            set.push_back(fmt::format("{} {}", flag, value));
        }
    };
    def("--probe-sequences", o.probe_sequences, 2);
    def("--probe-anchors", o.probe_anchors, 2);
    def("--steps", o.steps, 40);
    def("--batch", o.batch, 2);
    def("--seq", o.seq, static_cast<int>(std::min<int64_t>(128, ctx)));
    def("--select-sequences", o.select_sequences, 8);
    // The second stage of pruning costs probe forwards that on the CPU outweigh the building they save (auto's choice
    // there too, resolved_prune_stages): printed, so that the log says which.
    def("--prune-stages", o.prune_stages, std::string("1"));
    return set;
}

namespace {

/// Wall seconds since t (the log's stage times: the GPU runs have no progress bars; issue #16 measures them).
double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

bool keep_all_or(const std::function<bool(const std::string &)> & keep, const std::string & name) { return !keep || keep(name); }

}  // namespace

std::vector<gated_tensor> build_candidates(const gguf_file & src, const std::vector<tensor_menu> & menus,
                                           const importance_map * importance, const candidate_cache & cache,
                                           int threads, const std::function<bool(const std::string &)> & keep,
                                           const std::function<bool()> & stop) {
    std::vector<gated_tensor> out(menus.size());
    std::vector<std::pair<size_t, size_t>> jobs;
    for (size_t i = 0; i < menus.size(); ++i) {
        out[i].tensor = menus[i].tensor;
        out[i].types = menus[i].types;
        out[i].bytes.resize(menus[i].types.size());
        out[i].hashes.resize(menus[i].types.size(), 0);
        for (size_t k = 0; keep_all_or(keep, menus[i].tensor->name) && k < menus[i].types.size(); ++k) {
            jobs.emplace_back(i, k);
        }
    }
    // The schedule (issue #16): the longest jobs first (LPT), one thread each, except the jobs too long for that
    // (cost above the whole work's share of one thread), which run first, one at a time, on every thread (rows
    // split). With every job on one thread in menu order, the tied head of the Qwen3-1.7B shape (311 M weights, 18%
    // of the weights) quantized to a lattice type took minutes on one of the 16 threads at the end, and a 4-layer
    // slice of that shape built at 0.36× llama-quantize's rate (docs/BENCHMARKS.md). Only the order and the threads
    // change; every candidate's bytes are the same (rows quantize independently in every llama.cpp type).
    // A candidate the cache already holds (built ahead while the probe ran: most of them on a GPU) costs a read, not a
    // build, so it counts 0: with its build cost in the total, the share that earns every thread was inflated, and on
    // session 36's 1.7B job the tied head's last types (311 M weights each) were built on one thread each, 45 s with
    // the other 15 cores idle (vmstat).
    const int n_threads = resolve_threads(threads);
    std::vector<std::pair<const gguf_tensor *, ggml_type>> pairs;
    for (const auto & [i, k] : jobs) {
        pairs.emplace_back(menus[i].tensor, menus[i].types[k]);
    }
    const std::vector<bool> held = candidates_held(src, pairs, importance, cache.dir(), n_threads);
    std::vector<double> cost(jobs.size());
    for (size_t j = 0; j < jobs.size(); ++j) {
        const auto [t, type] = pairs[j];
        const bool copied = type == t->type;  // the source's bytes, copied
        cost[j] = copied || held[j] ? 0.0 : static_cast<double>(t->n_elements()) * quantize_cost_per_weight(type);
    }
    const double total = std::accumulate(cost.begin(), cost.end(), 0.0);
    std::vector<size_t> order(jobs.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
    progress bar("candidates", static_cast<int64_t>(jobs.size()), "cand");
    std::exception_ptr failure;
    std::mutex failure_mutex;
    std::atomic<bool> stopping{false};
    std::atomic<int64_t> done{0};
    // Asked before each candidate; once true it stays true for every thread (one Ctrl-C).
    auto should_stop = [&] {
        if (!stopping && stop && stop()) {
            stopping = true;
        }
        return stopping.load();
    };
    auto build = [&](size_t j, int job_threads) {
        const auto [i, k] = jobs[j];
        try {
            const gguf_tensor & t = *menus[i].tensor;
            std::vector<uint8_t> & b = out[i].bytes[k];
            b = candidate_bytes(src, t, menus[i].types[k], importance_for(importance, t), &cache, {}, job_threads);
            out[i].hashes[k] = XXH3_64bits(b.data(), b.size());
            ++done;
        } catch (...) {
            std::lock_guard<std::mutex> lock(failure_mutex);
            failure = failure ? failure : std::current_exception();
        }
        bar.add(1);
    };
    size_t first_small = 0;
    while (first_small < order.size() && n_threads > 1 && cost[order[first_small]] > total / n_threads && !failure &&
           !should_stop()) {
        build(order[first_small++], n_threads);
    }
    std::atomic<size_t> next{first_small};
    auto work = [&] {
        for (size_t j; (j = next++) < order.size();) {
            if (failure || should_stop()) {
                break;
            }
            build(order[j], 1);
        }
    };
    std::vector<std::thread> pool;
    for (int t = 0; t < n_threads && !failure; ++t) {
        pool.emplace_back(work);
    }
    for (auto & t : pool) {
        t.join();
    }
    bar.finish();
    if (failure) {
        std::rethrow_exception(failure);
    }
    if (stopping) {
        throw stopped(fmt::format("stopped while building candidates: {} of {} built, kept in '{}'; run the same command "
                                  "again to resume (they are read back, not built again)", done.load(), jobs.size(),
                                  cache.dir()));
    }
    return out;
}

namespace {

double cosine_lr(const train_options & o, int step) {
    const double x = o.steps > 1 ? static_cast<double>(step) / (o.steps - 1) : 1.0;
    const double lo = o.lr * o.lr_final;
    return lo + 0.5 * (o.lr - lo) * (1.0 + std::cos(M_PI * x));
}

double temperature(const train_options & o, int step) {
    const double x = o.steps > 1 ? static_cast<double>(step) / (o.steps - 1) : 1.0;
    return o.tau0 * std::pow(o.tau1 / o.tau0, x);
}

std::string family_of(const std::string & name) {
    if (name.rfind("blk.", 0) == 0) {
        const size_t dot = name.find('.', 4);
        return name.substr(dot + 1);
    }
    return name;
}

std::string summary_table(const recipe & r, const budget & b, double total) {
    struct family {
        int64_t weights = 0;
        size_t bytes = 0, source_bytes = 0;
        std::map<std::string, int> types;
    };
    std::map<std::string, family> fam;
    for (const recipe_tensor & t : r.tensors) {
        family & f = fam[family_of(t.name)];
        f.weights += n_elements(t.shape);
        f.bytes += t.bytes;
        f.source_bytes += tensor_bytes(t.source_type, t.shape, t.name);
        ++f.types[type_name(t.type)];
    }
    std::string out = fmt::format("  {:<22} {:>10} {:>12} {:>7}  {}\n", "tensor family", "weights", "bytes", "bpw",
                                  "types (tensors)");
    for (const auto & [name, f] : fam) {
        std::string types;
        for (const auto & [t, n] : f.types) {
            types += fmt::format("{}{}×{}", types.empty() ? "" : ", ", n, t);
        }
        out += fmt::format("  {:<22} {:>10} {:>12} {:>7.3f}  {}\n", name, f.weights, f.bytes,
                           8.0 * static_cast<double>(f.bytes) / static_cast<double>(f.weights), types);
    }
    const char * unit = b.goal.kind == target_kind::bpw ? "tensor bytes" : "file bytes";
    // Bytes as whole numbers (a new user's trial read "3.0426e+05 vs target 3.0432e+05"), the others to 5 digits.
    const auto in_unit = [&](double v) {
        return b.goal.kind == target_kind::size ? fmt::format("{:.0f}", v) : fmt::format("{:.5g}", v);
    };
    out += fmt::format("  total {:.0f} {} of a budget of {:.0f} ({}: {} vs target {})\n", total, unit, b.limit,
                       b.goal.kind == target_kind::bpw ? "BPW" : b.goal.kind == target_kind::size ? "bytes" : "Q8_0 ratio",
                       in_unit(b.in_target_unit(total)), in_unit(b.goal.value));
    return out;
}


void save_sensitivity(const std::string & path, const std::vector<gated_tensor> & gated,
                      const std::vector<std::vector<double>> & sens, const std::vector<int> & start) {
    nlohmann::json j = nlohmann::json::array();
    for (size_t i = 0; i < gated.size(); ++i) {
        nlohmann::json kl = nlohmann::json::object();
        for (size_t k = 0; k < gated[i].types.size(); ++k) {
            kl[type_name(gated[i].types[k])] = sens[i][k];
        }
        j.push_back({{"name", gated[i].tensor->name}, {"delta_kl", kl},
                     {"start", type_name(gated[i].types[static_cast<size_t>(start[i])])}});
    }
    write_file_atomic(path, j.dump(2) + "\n");
}

// The measured-sensitivity greedy knapsack (the peer of bench/greedy_peer): from every tensor's dearest type,
// the downgrade with the least probe ΔKL per byte saved until the budget holds, then the upgrades with the
// most ΔKL saved per byte that still fit.
/// The budgets pruning keeps candidates for: this run's target and a ladder's every size (so that its sizes build and
/// probe the same candidates), those the menus can reach.
std::vector<budget> pruning_budgets(const gguf_file & src, const std::vector<tensor_menu> & menus, const train_options & o,
                                    const export_options & eopts) {
    std::vector<budget> budgets;
    std::vector<target> goals = o.prune_goals;
    goals.push_back(o.goal);
    std::sort(goals.begin(), goals.end(), [](const target & x, const target & y) { return x.str() < y.str(); });
    goals.erase(std::unique(goals.begin(), goals.end(), [](const target & x, const target & y) { return x.str() == y.str(); }),
                goals.end());
    for (const target & g : goals) {
        export_options eg_opts = eopts;
        eg_opts.target = g.str();
        budget bg = make_budget(src, menus, g, eg_opts, /*check_range =*/false);
        if (bg.limit >= bg.min_total) {
            budgets.push_back(std::move(bg));
        }
    }
    return budgets;
}

/// [tensor][menu type]: the types of the smaller sizes' recipes (a ladder's), which stay candidates of the selection.
std::vector<std::vector<bool>> prior_recipe_types(const std::vector<tensor_menu> & menus,
                                                  const std::vector<std::string> & prior_recipes) {
    std::vector<std::vector<bool>> also(menus.size());
    for (size_t i = 0; i < menus.size(); ++i) {
        also[i].assign(menus[i].types.size(), false);
    }
    for (const std::string & path : prior_recipes) {
        if (!fs::exists(path)) {
            continue;
        }
        std::map<std::string, ggml_type> type_of;
        for (const recipe_tensor & t : recipe_load(path).tensors) {
            type_of[t.name] = t.type;
        }
        for (size_t i = 0; i < menus.size(); ++i) {
            const auto it = type_of.find(menus[i].tensor->name);
            for (size_t k = 0; it != type_of.end() && k < menus[i].types.size(); ++k) {
                also[i][k] = also[i][k] || menus[i].types[k] == it->second;
            }
        }
    }
    return also;
}

std::vector<int> greedy_choice(const budget & b, const std::vector<std::vector<double>> & sens) {
    std::vector<std::vector<double>> dearest;
    for (const auto & c : b.cost) {
        std::vector<double> p(c.size(), 0.0);
        p[static_cast<size_t>(std::max_element(c.begin(), c.end()) - c.begin())] = 1.0;
        dearest.push_back(std::move(p));
    }
    return finalize_choice(b, dearest, sens);
}

// --max-slowdown: drops the candidate recipes whose predicted generation time per token exceeds
// o.max_token_seconds, and adds "probe-exact-speed", the exact knapsack on sens + μ · (seconds per token) for the
// least μ ≥ 0 whose recipe is within the limit (a Lagrangian relaxation of the second constraint; bisection on
// log μ; a larger μ only trades estimated loss for speed). Throws voodoo::error when even the fastest recipe the
// budget allows is over the limit.
void apply_speed_limit(std::vector<std::pair<std::string, std::vector<int>>> & cands, const gguf_file & src,
                       const std::vector<tensor_menu> & menus, const budget & b,
                       const std::vector<std::vector<double>> & sens, const train_options & o) {
    std::vector<ggml_type> types;
    for (const tensor_menu & m : menus) {
        types.insert(types.end(), m.types.begin(), m.types.end());
    }
    for (const gguf_tensor & t : src.tensors()) {
        types.push_back(t.type);
    }
    std::sort(types.begin(), types.end());
    types.erase(std::unique(types.begin(), types.end()), types.end());
    const type_speed_table table = load_or_measure_type_speeds(types, o.threads, o.speed_table);
    std::map<std::string, ggml_type> base;  // every tensor at its source type: the fixed part
    double fixed = predicted_token_seconds(src, base, table);
    std::vector<std::vector<double>> cost(menus.size());
    for (size_t t = 0; t < menus.size(); ++t) {
        const gguf_tensor & g = *menus[t].tensor;
        const bool read = read_per_token(src, g);
        if (read) {
            fixed -= static_cast<double>(g.n_elements()) * table.seconds_per_weight.at(g.type);
        }
        for (ggml_type type : menus[t].types) {
            cost[t].push_back(read ? static_cast<double>(g.n_elements()) * table.seconds_per_weight.at(type) : 0.0);
        }
    }
    auto seconds = [&](const std::vector<int> & choice) {
        double s = fixed;
        for (size_t t = 0; t < choice.size(); ++t) {
            s += cost[t][static_cast<size_t>(choice[t])];
        }
        return s;
    };
    const size_t before = cands.size();
    std::string dropped;
    std::erase_if(cands, [&](const auto & c) {
        if (seconds(c.second) > o.max_token_seconds) {
            dropped += fmt::format("{}{} ({:.1f} µs)", dropped.empty() ? "" : ", ", c.first, 1e6 * seconds(c.second));
            return true;
        }
        return false;
    });
    auto knapsack = [&](double mu) {
        std::vector<std::vector<double>> loss = sens;
        for (size_t t = 0; t < loss.size(); ++t) {
            for (size_t k = 0; k < loss[t].size(); ++k) {
                loss[t][k] += mu * cost[t][k];
            }
        }
        return allocate_exact(b, loss);
    };
    // μ's scale: estimated loss per second of the whole model.
    double loss_span = 0, time_span = 0;
    for (size_t t = 0; t < sens.size(); ++t) {
        loss_span += *std::max_element(sens[t].begin(), sens[t].end()) - *std::min_element(sens[t].begin(), sens[t].end());
        time_span += *std::max_element(cost[t].begin(), cost[t].end()) - *std::min_element(cost[t].begin(), cost[t].end());
    }
    const double scale = time_span > 0 ? std::max(loss_span, 1e-12) / time_span : 1.0;
    std::vector<int> fastest = knapsack(scale * 1e9);
    if (seconds(fastest) > o.max_token_seconds) {
        fail("--max-slowdown: no recipe within the size budget is fast enough: the fastest one the menus allow is predicted "
             "at {:.1f} µs per generated token against the limit of {:.1f} µs (the speed table: {}); allow more slowdown, "
             "or give a menu of faster types", 1e6 * seconds(fastest), 1e6 * o.max_token_seconds, o.speed_table);
    }
    std::vector<int> best = knapsack(0.0);
    if (seconds(best) > o.max_token_seconds) {
        double lo = std::log(scale * 1e-9), hi = std::log(scale * 1e9);
        best = fastest;
        for (int i = 0; i < 40; ++i) {
            const double mid = 0.5 * (lo + hi);
            std::vector<int> c = knapsack(std::exp(mid));
            if (seconds(c) <= o.max_token_seconds) {
                hi = mid;
                best = std::move(c);
            } else {
                lo = mid;
            }
        }
    }
    cands.emplace_back("probe-exact-speed", std::move(best));
    std::string kept;
    for (const auto & c : cands) {
        kept += fmt::format("{}{} ({:.1f} µs)", kept.empty() ? "" : ", ", c.first, 1e6 * seconds(c.second));
    }
    fmt::print(stderr, "select: --max-slowdown: at most {:.1f} µs per generated token (predicted from {}); {} of {} "
                       "recipes over it left out{}{}; measured next: {}\n", 1e6 * o.max_token_seconds, o.speed_table,
               before - cands.size() + 1, before, dropped.empty() ? "" : ": ", dropped, kept);
}

// The final choice: candidate recipes measured in f32 on chunks held apart from training; the least KL wins.
//   trained      the gates' argmax, repaired to the exact budget by the probe (finalize_choice)
//   probe-exact  the least total probe ΔKL under the budget (allocate_exact)
//   probe-greedy the greedy knapsack on the same ΔKL (greedy_choice)
//   prior recipes of smaller budgets (a ladder) that fit this one: a larger budget never measures worse
std::vector<int> select_recipe(train_result & res, const gguf_file & src, causal_lm & model, weight_source & dense,
                               weight_source & teacher,
                               const std::vector<gated_tensor> & gated, const std::vector<tensor_menu> & menus,
                               const budget & b, const std::vector<std::vector<double>> & probs,
                               const std::vector<std::vector<double>> & sens, const torch::Tensor & tokens,
                               torch::Device device, int64_t chunk, const train_options & o,
                               const dist::layer_pipeline * pipe) {
    std::vector<std::pair<std::string, std::vector<int>>> cands = {{"trained", finalize_choice(b, probs, sens)},
                                                                   {"probe-exact", allocate_exact(b, sens)},
                                                                   {"probe-greedy", greedy_choice(b, sens)}};
    for (const std::string & path : o.prior_recipes) {
        const recipe r = recipe_load(path);
        std::map<std::string, ggml_type> type_of;
        for (const recipe_tensor & t : r.tensors) {
            type_of[t.name] = t.type;
        }
        std::vector<int> choice;
        for (const tensor_menu & m : menus) {
            const auto it = type_of.find(m.tensor->name);
            const auto k = it == type_of.end() ? m.types.end() : std::find(m.types.begin(), m.types.end(), it->second);
            if (k == m.types.end()) {
                break;
            }
            choice.push_back(static_cast<int>(k - m.types.begin()));
        }
        if (choice.size() != menus.size() || b.total(choice) > b.limit) {
            fmt::print(stderr, "select: prior recipe '{}' skipped ({})\n", path,
                       choice.size() != menus.size() ? "other tensors or menus" : "over this budget");
            continue;
        }
        cands.emplace_back(path, std::move(choice));
    }
    if (o.max_token_seconds > 0) {
        apply_speed_limit(cands, src, menus, b, sens, o);
    }
    // Each distinct recipe measured once, the j-th by rank j mod N (issue #17); one all-reduce gives every rank every
    // value, adding only zeros to each: the single process's values bit for bit. Layer-sharded ranks (`pipe`) measure
    // every recipe together instead, each forward running rank to rank (recipe_kl), so no rank holds another's layers.
    std::vector<std::vector<int>> distinct;
    for (const auto & [name, choice] : cands) {
        if (std::find(distinct.begin(), distinct.end(), choice) == distinct.end()) {
            distinct.push_back(choice);
        }
    }
    const bool pipelined = pipe && pipe->size() > 1;
    const int ranks = o.group && !pipelined ? o.group->size() : 1, rank = o.group && !pipelined ? o.group->rank() : 0;
    const int64_t n_distinct = static_cast<int64_t>(distinct.size());
    const int64_t n_mine = n_distinct / ranks + (n_distinct % ranks > rank ? 1 : 0);
    if (ranks > 1) {
        fmt::print(stderr, "select: rank {} of {} measures {} of the {} recipes\n", rank, ranks, n_mine, n_distinct);
    } else if (pipelined) {
        fmt::print(stderr, "select: rank {} of {} runs layers [{}, {}) of the forwards of the {} recipes\n", pipe->rank(),
                   pipe->size(), pipe->mine().first, pipe->mine().second, n_distinct);
    }
    std::vector<double> kl(distinct.size(), 0.0);
    {
        progress bar("select", n_mine, "recipes");
        for (size_t j = 0; j < distinct.size(); ++j) {
            if (static_cast<int>(j % static_cast<size_t>(ranks)) == rank) {
                kl[j] = recipe_kl(model, dense, teacher, gated, distinct[j], tokens, device, chunk, pipe);
                bar.add(1);
            }
        }
    }
    if (ranks > 1) {
        std::vector<torch::Tensor> all{torch::tensor(kl, torch::kDouble)};
        o.group->all_reduce_sum(all);
        kl.assign(all[0].data_ptr<double>(), all[0].data_ptr<double>() + all[0].numel());
    }
    std::vector<train_result::selection_entry> entries;
    size_t best = 0;
    for (size_t c = 0; c < cands.size(); ++c) {
        const auto & [name, choice] = cands[c];
        const double val_kl = kl[static_cast<size_t>(std::find(distinct.begin(), distinct.end(), choice) - distinct.begin())];
        entries.push_back({name, val_kl, estimated_loss(sens, choice), b.total(choice)});
        // The least KL; among equals, the first (the trained recipe before the probe's, a new one before a prior).
        if (entries.back().val_kl < entries[best].val_kl) {
            best = c;
        }
    }
    std::rotate(entries.begin(), entries.begin() + static_cast<std::ptrdiff_t>(best),
                entries.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    res.selection = entries;
    return cands[best].second;
}

}  // namespace

nlohmann::json selection_to_json(const train_result & r) {
    nlohmann::json sel = nlohmann::json::array();
    for (const auto & e : r.selection) {
        sel.push_back({{"recipe", e.name}, {"val_kl", e.val_kl}, {"probe_estimate", e.estimated}, {"bytes", e.bytes}});
    }
    return sel;
}

train_result train_gates(const gguf_file & src, const gguf_file & teacher, const token_file & train,
                         const importance_map * importance, const train_options & o, const token_file * val) {
    const auto t_start = std::chrono::steady_clock::now();
    if (o.probe_sequences < 1) {
        fail("--probe-sequences must be at least 1 (got {}): the probe measures every candidate on them", o.probe_sequences);
    }
    if (!(o.lambda_ce >= 0) || !(o.lambda_kl >= 0) || !(o.lambda_size >= 0)) {
        fail("--lambda-ce, --lambda-kl and --lambda-size must be finite and ≥ 0 (got {}, {}, {})", o.lambda_ce, o.lambda_kl,
             o.lambda_size);
    }
    if (o.steps < 1 || o.batch < 1 || o.accum < 1) {
        fail("--steps, --batch and --accum must be at least 1 (got {}, {}, {})", o.steps, o.batch, o.accum);
    }
    if (!(o.tau0 > 0 && o.tau1 > 0)) {
        fail("--tau0 and --tau1 must be positive (got {}, {})", o.tau0, o.tau1);
    }
    if (o.st_gumbel_fraction < 0 || o.st_gumbel_fraction > 1) {
        fail("--st-gumbel-fraction must be in [0, 1] (got {})", o.st_gumbel_fraction);
    }
    const routing_mode routing = parse_routing(o.routing);
    const int ranks = o.group ? o.group->size() : 1;
    const int rank = o.group ? o.group->rank() : 0;
    const bool writer = rank == 0;  // several ranks: rank 0 alone writes the run directory
    if (o.parallel != "tp" && o.parallel != "layers") {
        fail("--parallel '{}': expected tp (tensor parallelism) or layers (layer sharding)", o.parallel);
    }
    const bool tensor_parallel = ranks > 1 && o.parallel == "tp";
    const bool layer_sharding = ranks > 1 && o.parallel == "layers";
    if (ranks > 1 && routing == routing_mode::ptqr) {
        fail("--routing ptqr is not split over several ranks yet (WORLD_SIZE={}); use --routing mix, or one process",
             ranks);
    }
    if (routing == routing_mode::ptqr && o.st_gumbel_fraction > 0) {
        fail("--routing ptqr and --st-gumbel-fraction {} are exclusive: per-token routing already gives the forward "
             "one candidate per token; drop one of them", o.st_gumbel_fraction);
    }
    train.require_vocab(vocab_hash(src), src.path());
    if (val) {
        val->require_vocab(vocab_hash(src), src.path());
    }
    if (!o.compute.empty() && o.compute != "f32" && o.compute != "bf16") {
        fail("--compute '{}': expected f32 or bf16", o.compute);
    }
    if (o.probe_compute != "auto" && o.probe_compute != "f32" && o.probe_compute != "tf32" && o.probe_compute != "bf16") {
        fail("--probe-compute '{}': expected auto, f32, tf32 (a CUDA device only) or bf16", o.probe_compute);
    }
    if (o.select_sequences < 1) {
        fail("--select-sequences must be at least 1 (got {})", o.select_sequences);
    }
    if (o.loss_chunk < 0) {
        fail("--loss-chunk {}: expected positions per chunk, or 0 to choose by device", o.loss_chunk);
    }
    const int64_t seq = o.seq > 0 ? o.seq : train.ctx();
    if (seq < 2 || seq > train.ctx()) {
        fail("--seq {} must be between 2 and the token file's chunk length {} ('{}')", seq, train.ctx(), train.path());
    }
    for (const gguf_tensor & t : src.tensors()) {
        const gguf_tensor * tt = teacher.find_tensor(t.name);
        if (!tt || tt->ne != t.ne) {
            fail("teacher '{}' does not match '{}' at tensor '{}': the teacher must be the same model", teacher.path(),
                 src.path(), t.name);
        }
    }

    // Everything that can be refused is refused before any work.
    const torch::Device device = parse_train_device(o.device);
    if (o.probe_compute == "tf32" && !device.is_cuda()) {
        fail("--probe-compute tf32 is the CUDA tensor cores' f32 mode and the device is {}: use --probe-compute auto "
             "(the default: f32 here) or f32, or --device cuda", device.str());
    }
    const mixture_path path = o.mixture.empty() ? (device.is_cuda() ? mixture_path::fused : mixture_path::cpu)
                                                : parse_mixture_path(o.mixture);
    if (path == mixture_path::cpu && !device.is_cpu()) {
        fail("--mixture cpu runs on the CPU; with --device {} use fused or reference", o.device);
    }
    if (path == mixture_path::fused && !device.is_cuda()) {
        fail("--mixture fused runs on a CUDA device; pass --device cuda (a CUDA build), or --mixture cpu");
    }
    menu_options menu = o.menu;
    if (importance) {
        menu.importance = importance;
    }
    if (o.candidates != "targets" && o.candidates != "all") {
        fail("--candidates '{}': expected targets (build what the targets can use) or all (every type of every menu)",
             o.candidates);
    }
    const std::vector<tensor_menu> all_menus = build_menus(src, menu);
    const uint64_t data_hash = XXH3_64bits(train.tokens().data(), train.tokens().size_bytes());
    if (ranks > 1) {  // ranks started with other options would pair their collectives wrongly, or wait forever
        const std::string same = fingerprint(src, all_menus, o, data_hash) +
                                 o.parallel + o.goal.str() + std::to_string(o.select_sequences) + o.candidates;
        dist::require_same_on_every_rank(*o.group, XXH3_64bits(same.data(), same.size()),
                                         "the training options, menus or calibration tokens");
    }
    // Several ranks: whether the model splits as asked, before any work. Tensor parallelism: a model of this rank's
    // heads and FFN width (set_tensor_parallel refuses what it cannot split), every menu's types fitting every rank's
    // part. Layer sharding: this rank's contiguous layers, balanced by the bytes of their weights.
    std::unique_ptr<dist::group_tensor_parallel> tp_group;
    std::unique_ptr<causal_lm> tp_model;
    if (tensor_parallel) {
        tp_group = std::make_unique<dist::group_tensor_parallel>(*o.group);
        tp_model = build_model(src);
        tp_model->set_tensor_parallel(tp_group.get());
        for (const tensor_menu & m : all_menus) {
            if (const std::string problem = dist::tp_split_problem(*m.tensor, m.types, ranks); !problem.empty()) {
                fail("--parallel tp over {} ranks: {}", ranks, problem);
            }
        }
    }
    std::pair<int64_t, int64_t> my_layers{0, 0};
    // Layer sharding's pipeline for the probe and the selection (train/probe.h): every forward runs rank to rank.
    dist::layer_pipeline pipe;
    pipe.pg = o.group;
    pipe.tied_head = src.find_tensor("output.weight") == nullptr;
    if (layer_sharding) {
        if (o.st_gumbel_fraction > 0) {
            fail("--st-gumbel-fraction {} with --parallel layers: the Gumbel noise is drawn per process in the order of "
                 "use, so layer-sharded ranks would not draw the single process's noise; use --parallel tp, or 0",
                 o.st_gumbel_fraction);
        }
        try {
            pipe.layers = dist::balance_layers_of(src, ranks);
            my_layers = pipe.layers[static_cast<size_t>(rank)];
        } catch (const error & e) {
            fail("--parallel layers over {} ranks (WORLD_SIZE, or quantize --gpus): {}; use fewer ranks, or --parallel tp",
                 ranks, e.what());
        }
        fmt::print(stderr, "rank {} of {}: layers [{}, {})\n", rank, ranks, my_layers.first, my_layers.second);
    }
    // The budget counts the header export will write: the same metadata, imatrix keys included.
    export_options eopts = o.export_opts;
    eopts.importance = importance;
    eopts.target = o.goal.str();
    const budget b_all = make_budget(src, all_menus, o.goal, eopts);  // a target out of reach is refused before any work
    for (const target & g : o.prune_goals) {
        export_options eg_opts = eopts;
        eg_opts.target = g.str();
        try {
            make_budget(src, all_menus, g, eg_opts);
        } catch (const error & e) {
            fail("--prune-for {}: {}", g.str(), e.what());
        }
    }

    fs::create_directories(o.run_dir);
    const std::string journal_path = (fs::path(o.run_dir) / "journal.pt").string();
    const std::string log_path = (fs::path(o.run_dir) / "log.jsonl").string();
    if (!o.resume && fs::exists(journal_path)) {
        fail("run directory '{}' already holds a journal: pass --resume to continue it, or choose another --out",
             o.run_dir);
    }
    if (o.resume && !fs::exists(journal_path)) {
        fail("--resume: no journal in '{}' (journal.pt); start without --resume", o.run_dir);
    }

    // Whether the teacher fits the GPU at all: decided before any work.
    // A file's weights as the GPU holds them: matrices in bf16, vectors in f32.
    // A layer-sharded rank holds only the tensors of its layers (and the embedding or the head): the probe and the
    // selection run rank to rank too (train/probe.h).
    const bool tied = src.find_tensor("output.weight") == nullptr;
    const auto device_copy_bytes = [&](const gguf_file & f) {
        int64_t n = 0;
        for (const gguf_tensor & t : f.tensors()) {
            if (!layer_sharding || dist::layer_shard_uses(t.name, my_layers, pipe.layers.empty() ? 0 : pipe.layers.back().second, tied)) {
                n += t.n_elements() * (t.n_dims >= 2 ? 2 : 4);
            }
        }
        return n;
    };
    const int64_t teacher_bytes = device_copy_bytes(teacher);
    const auto gib = [](int64_t n) { return static_cast<double>(n) / 1073741824.0; };
    if (path == mixture_path::fused) {
        const residency_plan plan = plan_residency(all_menus, o.candidates_on, device_total_memory(device), teacher_bytes);
        if (!plan.teacher_fits) {
            fail("the teacher's weights in bf16 ({:.1f} GiB) and the activations' reserve ({:.1f} GiB) do not fit {} "
                 "({:.1f} GiB): a larger GPU, or several with their layers sharded (voodoo quantize --gpus N --parallel "
                 "layers, or torchrun), is what would work",
                 gib(teacher_bytes), gib(plan.reserve), device.str(), gib(plan.device_bytes));
        }
    }

    const int n_threads = resolve_threads(o.threads);
    set_torch_threads(o.threads);
    candidate_cache cache(o.cache_dir.empty() ? (fs::path(o.run_dir) / "candidates").string() : o.cache_dir);
    // On a GPU: bf16 compute, the teacher's matrices resident in bf16, the candidates resident as the path
    // wants them (quantized bytes for fused, dense bf16 for reference).
    const torch::ScalarType compute = o.compute == "f32"    ? torch::kFloat
                                      : o.compute == "bf16" ? torch::kBFloat16
                                      : device.is_cuda()    ? torch::kBFloat16
                                                            : torch::kFloat;
    std::unique_ptr<causal_lm> model = build_model(src);
    model->set_compute_dtype(compute);
    pipe.n_layer = model->hparams().n_layer;
    const dist::layer_pipeline * const pipeline = layer_sharding ? &pipe : nullptr;
    // Whether this rank uses a tensor: every one, but under layer sharding those of its layers (and the embedding or
    // the head). A layer-sharded rank reads no other tensor's weights or candidates, and holds no other's candidate
    // bytes in host memory (build_candidates' keep).
    const auto on_this_rank = [&](const std::string & name) { return !layer_sharding || pipe.uses(name); };
    const std::function<bool(const std::string &)> keep_bytes =
        layer_sharding ? std::function<bool(const std::string &)>(on_this_rank) : nullptr;
    // On a GPU the matrices stay in bf16 (converted where an f32 forward uses them: exact for a BF16 source).
    const std::optional<torch::ScalarType> keep = device.is_cuda() ? std::optional(torch::kBFloat16) : std::nullopt;
    gguf_weights dense(src, device, 0, keep);
    // The teacher is the source itself unless --teacher names another file: then one set of device copies serves
    // both (the probe and the student read every matrix of the source, the teacher every one of its own: two sets
    // would hold the model's bf16 matrices on the GPU twice). Bit for bit the same tensors either way.
    std::optional<gguf_weights> teacher_own;
    if (!same_file(src.path(), teacher.path())) {
        teacher_own.emplace(teacher, device, 0, keep);
    }
    gguf_weights & teacher_weights = teacher_own ? *teacher_own : dense;
    const int64_t loss_chunk = o.loss_chunk > 0 ? o.loss_chunk : default_loss_chunk(model->hparams().n_vocab, device.is_cuda());
    const int64_t n_chunks = train.n_chunks();
    // The first `len` tokens of the given chunks of `file`, [chunks, len] int64 on the device.
    auto tokens_of = [&](const token_file & file, const std::vector<int64_t> & chunks, int64_t len) {
        auto tokens = torch::empty({static_cast<int64_t>(chunks.size()), len}, torch::kLong);
        auto acc = tokens.accessor<int64_t, 2>();
        for (size_t j = 0; j < chunks.size(); ++j) {
            const auto c = file.chunk(chunks[j]);
            for (int64_t p = 0; p < len; ++p) {
                acc[static_cast<int64_t>(j)][p] = c[static_cast<size_t>(p)];
            }
        }
        return tokens.to(device);
    };
    auto chunk_tokens = [&](const std::vector<int64_t> & chunks) { return tokens_of(train, chunks, seq); };
    const std::vector<int64_t> order0 = epoch_order(n_chunks, o.seed, 0);
    const std::vector<int64_t> probe_chunks(order0.begin(), order0.begin() + std::min<int64_t>(o.probe_sequences, n_chunks));
    // Whole chunks, whatever --seq the training uses: the probe and the selection judge the context the
    // model will serve, not the training's shorter windows.
    const torch::Tensor probe_tokens = tokens_of(train, probe_chunks, train.ctx());
    const std::string probe_path = o.probe_file.empty() ? (fs::path(o.run_dir) / "probe.json").string() : o.probe_file;
    const std::string probe_compute = resolved_probe_compute(o.probe_compute, o.device);
    const torch::ScalarType probe_dtype = probe_compute == "bf16" ? torch::kBFloat16 : torch::kFloat;
    const bool probe_tf32 = probe_compute == "tf32";
    // Ctrl-C before the first step: the candidates and the probes ask it (minutes each at 8B), not only the steps.
    const std::function<bool()> stop_now = [&] { return o.should_stop && o.should_stop(-1); };
    auto check_finite = [&](const std::vector<gated_tensor> & g, const std::vector<std::vector<double>> & s,
                            const std::vector<std::vector<bool>> & plan) {
        for (size_t i = 0; i < g.size(); ++i) {
            for (size_t k = 0; k < g[i].types.size(); ++k) {
                if (plan[i][k] && !std::isfinite(s[i][k])) {
                    fail("the loss is not finite: the KL probe of tensor '{}' as {} gives {} (every tensor does when the "
                         "teacher's or the source's own logits are not finite); nothing was trained and {}",
                         g[i].tensor->name, type_name(g[i].types[k]), s[i][k],
                         o.resume ? fmt::format("the last good journal is kept in '{}'", o.run_dir)
                                  : fmt::format("'{}' holds no journal", o.run_dir));
                }
            }
        }
    };

    // Whether `mine` holds on every rank (one all-reduce; true with one rank).
    auto every_rank_has = [&](bool mine) {
        if (ranks == 1) {
            return mine;
        }
        torch::Tensor missing = torch::tensor({mine ? 0.0f : 1.0f});
        o.group->all_reduce_max(missing);
        return missing.item<float>() == 0.0f;
    };

    // The candidates, their building split over the ranks (issue #17): rank r quantizes candidates r, r + N, … (in
    // tensor order; with layer sharding, those of the tensors it owns: layer_pipeline::owner_of) into the cache, all
    // ranks wait for each other, and then every rank reads from the cache (the run directory's, which ranks share: the
    // same host, or a shared folder across hosts) those it uses: all of them, or with layer sharding its own layers'
    // (whose other candidates' hashes come from their owners), building whatever it does not find there (another
    // host's own cache) as one process would. The bytes are llama.cpp's either way.
    auto build_over_ranks = [&](const std::vector<tensor_menu> & m) {
        if (ranks > 1) {
            std::vector<candidate_prefetch::job> mine;
            int64_t all = 0;
            for (const tensor_menu & t : m) {
                for (ggml_type type : t.types) {
                    if (type == t.tensor->type) {
                        continue;
                    }
                    if (layer_sharding ? pipe.owner_of(t.tensor->name) == rank : all % ranks == rank) {
                        mine.push_back({t.tensor, type});
                    }
                    ++all;
                }
            }
            const auto t0 = std::chrono::steady_clock::now();
            const size_t n_mine = mine.size();
            {
                candidate_prefetch part(src, std::move(mine), importance, cache, n_threads);
                if (!part.wait(stop_now)) {
                    throw stopped(fmt::format("stopped while building candidates: rank {} of {} built {} of its {}, kept in "
                                              "'{}'; run the same command again to resume", rank, ranks, part.built(),
                                              n_mine, cache.dir()));
                }
            }
            fmt::print(stderr, "candidates: rank {} of {} built {} of {} in {:.1f} s\n", rank, ranks, n_mine, all,
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            o.group->barrier();
        }
        std::vector<gated_tensor> built = build_candidates(src, m, importance, cache, n_threads, keep_bytes, stop_now);
        if (layer_sharding) {
            // The other ranks' candidates' xxh3-64 (the probe's identity), from their owners: one all-reduce to which
            // every other rank adds zeros.
            std::vector<int64_t> h;
            for (const gated_tensor & g : built) {
                const bool owned = pipe.owner_of(g.tensor->name) == rank;
                for (const uint64_t x : g.hashes) {
                    h.push_back(owned ? static_cast<int64_t>(x) : 0);
                }
            }
            std::vector<torch::Tensor> hv{torch::tensor(h, torch::kLong)};
            o.group->all_reduce_sum(hv);
            const int64_t * v = hv[0].data_ptr<int64_t>();
            for (gated_tensor & g : built) {
                for (uint64_t & x : g.hashes) {
                    x = static_cast<uint64_t>(*v++);
                }
            }
            int64_t held = 0, all = 0;
            for (const gated_tensor & g : built) {
                for (size_t k = 0; k < g.types.size(); ++k) {
                    held += static_cast<int64_t>(g.bytes[k].size());
                    all += static_cast<int64_t>(tensor_bytes(g.types[k], g.tensor->ne, g.tensor->name));
                }
            }
            fmt::print(stderr, "rank {} of {}: candidates in host memory: {:.1f} of {:.1f} MiB ({} of {} bytes), those of "
                               "its layers\n", rank, ranks, held / 1048576.0, all / 1048576.0, held, all);
        }
        return built;
    };

    // The probe, its measurements split over the ranks (issue #17). Tensor parallelism: rank r measures the planned
    // candidates r, r + N, r + 2N, … (in tensor order, so every rank gets some of every layer) with the whole model, and
    // one all-reduce gives every rank every value. Layer sharding: every candidate's forward runs rank to rank, each
    // rank holding only its own layers' weights (probe_sensitivity's pipeline). Either way each value is computed with
    // one process's arithmetic, so the result is the single process's.
    auto probe_over_ranks = [&](std::vector<gated_tensor> & g, const std::vector<std::vector<bool>> & plan) {
        const tf32_matmul_scope tf32(probe_tf32);
        if (ranks == 1 || layer_sharding) {
            std::vector<std::vector<bool>> p = plan;
            if (layer_sharding) {
                int64_t n = 0;
                for (const auto & row : plan) {
                    n += std::count(row.begin(), row.end(), true);
                }
                fmt::print(stderr, "probe: rank {} of {} runs layers [{}, {}) of the forwards of the {} candidates planned\n",
                           rank, ranks, my_layers.first, my_layers.second, n);
            }
            return probe_sensitivity(*model, dense, teacher_weights, g, probe_tokens, device, loss_chunk, probe_dtype, &p,
                                     int64_t(2) << 30, pipeline, stop_now);
        }
        std::vector<std::vector<bool>> mine = plan;
        int64_t n = 0;
        for (auto & row : mine) {
            for (size_t k = 0; k < row.size(); ++k) {
                if (row[k]) {
                    row[k] = n++ % ranks == rank;
                }
            }
        }
        fmt::print(stderr, "probe: rank {} of {} measures {} of the {} candidates planned\n", rank, ranks,
                   n / ranks + (n % ranks > rank ? 1 : 0), n);
        std::vector<std::vector<double>> out =
            probe_sensitivity(*model, dense, teacher_weights, g, probe_tokens, device, loss_chunk, probe_dtype, &mine,
                              int64_t(2) << 30, nullptr, stop_now);
        std::vector<double> flat;
        for (size_t i = 0; i < out.size(); ++i) {
            for (size_t k = 0; k < out[i].size(); ++k) {
                flat.push_back(mine[i][k] ? out[i][k] : 0.0);
            }
        }
        std::vector<torch::Tensor> all{torch::tensor(flat, torch::kDouble)};
        o.group->all_reduce_sum(all);
        const double * v = all[0].data_ptr<double>();
        for (size_t i = 0, at = 0; i < out.size(); ++i) {
            for (size_t k = 0; k < out[i].size(); ++k, ++at) {
                out[i][k] = plan[i][k] ? v[at] : out[i][k];
            }
        }
        return out;
    };

    // The probe of the candidates `plan` marks ([tensor][type of m]; m: one menu per tensor of all_menus) while the
    // cores build them (issue #16: the GPU measured nothing while the eager and the second stage's candidates were
    // built, 36 s and 68 s at the Qwen3-1.7B shape): one prefetch builds them in tensor order, then the jobs `then`
    // returns (called on the prefetch's thread once they are built), and the probe takes tensor i once its candidates
    // are in the cache (probe_sensitivity's `ready`). The same bytes from the same cache, so the same ΔKL as building
    // first. One process (the ranks split the build and the probe otherwise). Returns every candidate of m (built or
    // read from the cache, as build_over_ranks would), the probe, how many of then's jobs were built when the probe
    // ended, and the seconds the probe waited for the builds.
    // [tensor, menu type] pairs of all_menus as prefetch jobs, and the threads a prefetch takes: all but one beside a
    // GPU's probe, whose thread drives it.
    const auto prefetch_jobs = [&](const std::vector<std::pair<size_t, size_t>> & pairs) {
        std::vector<candidate_prefetch::job> jobs;
        for (const auto & [i, k] : pairs) {
            jobs.push_back({all_menus[i].tensor, all_menus[i].types[k]});
        }
        return jobs;
    };
    const int prefetch_threads = device.is_cuda() ? std::max(1, n_threads - 1) : n_threads;
    struct as_built_probe {
        std::vector<gated_tensor> gated;
        std::vector<std::vector<double>> sens;
        int64_t then_built = 0;
        double waited_seconds = 0;
    };
    // `what` names the probe in the message of a stop ("the eager probe", "the second stage's probe").
    auto probe_as_built = [&](const std::vector<tensor_menu> & m, const std::vector<std::vector<bool>> & plan,
                              const std::function<std::vector<std::pair<size_t, size_t>>()> & then, const char * what) {
        std::vector<candidate_prefetch::job> jobs;
        std::vector<int64_t> through;  // the jobs of tensors 0 … i
        as_built_probe r;
        for (size_t i = 0; i < m.size(); ++i) {
            for (size_t k = 0; k < m[i].types.size(); ++k) {
                if (plan[i][k]) {
                    jobs.push_back({m[i].tensor, m[i].types[k]});
                }
            }
            through.push_back(static_cast<int64_t>(jobs.size()));
            gated_tensor g;
            g.tensor = m[i].tensor;
            g.types = m[i].types;
            r.gated.push_back(std::move(g));
        }
        const int64_t n_first = static_cast<int64_t>(jobs.size());
        const auto fill = [&](size_t i) {  // from the cache (what is not there, built here)
            progress::quiet_scope quiet;
            r.gated[i] = std::move(build_candidates(src, {m[i]}, importance, cache, n_threads, keep_bytes, stop_now).front());
        };
        candidate_prefetch ahead(src, std::move(jobs), importance, cache, prefetch_threads,
                                 [&] { return prefetch_jobs(then()); });
        {
            const tf32_matmul_scope tf32(probe_tf32);
            r.sens = probe_sensitivity(*model, dense, teacher_weights, r.gated, probe_tokens, device, loss_chunk, probe_dtype,
                                       &plan, int64_t(2) << 30, nullptr, stop_now, [&](size_t i) {
                                           const auto t = std::chrono::steady_clock::now();
                                           if (!ahead.wait_for(through[i], stop_now)) {
                                               throw stopped(fmt::format("stopped during {}, while its candidates were "
                                                                         "built ({} of {}, kept in '{}'); run the same command "
                                                                         "again to resume", what, ahead.built(), n_first,
                                                                         cache.dir()));
                                           }
                                           fill(i);
                                           r.waited_seconds += seconds_since(t);
                                       }, what);
        }
        r.then_built = std::max<int64_t>(0, ahead.stop() - n_first);
        for (size_t i = 0; i < m.size(); ++i) {
            if (r.gated[i].bytes.empty()) {
                fill(i);  // nothing of it measured (its types are the source's, or built before)
            }
        }
        return r;
    };

    // The candidates: every type of every menu (--candidates all), or only those some recipe under the targets could
    // use (train/prune.h): the eager types built and probed first, the others predicted, the exact knapsack solved
    // at every target with the unbuilt types optimistic.
    std::vector<tensor_menu> menus = all_menus;
    std::map<std::pair<std::string, ggml_type>, double> eager_kl;  // the eager probe's ΔKL, by (tensor, type)
    prune_options po;
    po.eager = o.probe_anchors > 0 ? o.probe_anchors : po.eager;  // with an anchored probe, its anchors
    po.eager_max_cost = o.eager_types == "fast" ? 0.0 : po.eager_max_cost;
    // --probe-anchors auto (-1): every type, unless the eager probe's measured rate says that the kept others would
    // take longer than o.probe_auto_seconds; then the eager types are the anchors (resolve_probe_anchors).
    int anchors = o.probe_anchors < 0 ? 0 : o.probe_anchors;
    double eager_seconds = -1;  // the eager probe's wall time, when it ran in this process
    int64_t eager_forwards = 0;
    const bool prune = o.candidates == "targets" &&
                       std::any_of(all_menus.begin(), all_menus.end(), [&](const tensor_menu & m) { return m.types.size() >= po.min_menu; });
    if (prune) {
        const auto t0 = std::chrono::steady_clock::now();
        // Each step's wall time in the log (the GPU runs have no progress bars): issue #16 measures them.
        fmt::print(stderr, "pruning: {:.1f} s into the train stage\n", seconds_since(t_start));
        // The lattice types' grids, built at once on their own threads while the other types' errors are measured
        // (ggml_quantize_init builds them one after the other, with every other quantization waiting: ≈ 32 s of one
        // core, 19 s of it IQ1's).
        std::vector<ggml_type> menu_types;
        for (const tensor_menu & m : all_menus) {
            menu_types.insert(menu_types.end(), m.types.begin(), m.types.end());
        }
        lattice_warmup grids(menu_types, n_threads);
        // Ê of the types without a grid first (and of those eager_types needs), so that the eager types are chosen
        // and built while the grids build; the lattice types' Ê beside the eager candidates, below.
        error_split split = split_for_lattice_grids(all_menus);
        std::vector<std::vector<double>> err_hat = sampled_weighted_errors(src, all_menus, importance, po, n_threads, &split.first, cache.dir());
        const auto add_errors = [&](const std::vector<std::vector<double>> & more, const std::vector<std::vector<bool>> & which) {
            for (size_t i = 0; i < err_hat.size(); ++i) {
                for (size_t k = 0; k < err_hat[i].size(); ++k) {
                    err_hat[i][k] = which[i][k] ? more[i][k] : err_hat[i][k];
                }
            }
        };
        if (const auto now = split.needed_now(all_menus, err_hat);
            std::any_of(now.begin(), now.end(), [](const auto & row) { return std::find(row.begin(), row.end(), true) != row.end(); })) {
            add_errors(sampled_weighted_errors(src, all_menus, importance, po, n_threads, &now, cache.dir()), now);
        }
        fmt::print(stderr, "pruning: sampled errors of the types without a lattice grid in {:.1f} s\n", seconds_since(t0));
        const auto t1 = std::chrono::steady_clock::now();
        const std::vector<std::vector<bool>> eager = eager_types(all_menus, err_hat, po);
        const std::vector<budget> budgets = pruning_budgets(src, all_menus, o, eopts);
        const std::vector<std::vector<bool>> also = prior_recipe_types(all_menus, o.prior_recipes);
        std::vector<tensor_menu> eager_menus = pruned_menus(all_menus, eager);
        {  // which types are eager, and for how many tensors each (a user's first question about the pruning's work)
            std::map<std::string, int> count;
            for (size_t i = 0; i < all_menus.size(); ++i) {
                for (size_t k = 0; k < all_menus[i].types.size(); ++k) {
                    count[type_name(all_menus[i].types[k])] += eager[i][k] ? 1 : 0;
                }
            }
            std::string names;
            for (const auto & [name, n] : count) {
                if (n > 0) {
                    names += fmt::format("{}{} ({} tensor{})", names.empty() ? "" : ", ", name, n, n == 1 ? "" : "s");
                }
            }
            fmt::print(stderr, "pruning: eager types {} (--eager-types {}) and budgets in {:.1f} s\n",
                       names.empty() ? std::string("none") : names, o.eager_types, seconds_since(t1));
        }
        const auto t2 = std::chrono::steady_clock::now();
        // The lattice types' Ê beside the eager candidates (each job waits for its grid; no bar of its own), in two
        // parts: the types of the grid that takes longest to build (IQ1's, ≈ 19 s on one core; lattice_grid_order 0)
        // apart from the others (seconds), so that the build-ahead plan need not wait for IQ1's grid (session 37: the
        // cores idled ≈ 5 s of the 1.7B job for it).
        std::vector<std::vector<bool>> later_slow = split.later, later_rest = split.later;
        for (size_t i = 0; i < all_menus.size(); ++i) {
            for (size_t k = 0; k < all_menus[i].types.size(); ++k) {
                const bool slow = lattice_grid_order(all_menus[i].types[k]) == 0;
                later_slow[i][k] = split.later[i][k] && slow;
                later_rest[i][k] = split.later[i][k] && !slow;
            }
        }
        using timed_errors = std::pair<std::vector<std::vector<double>>, double>;  // Ê, and its seconds since t2
        const auto errors_of = [&](const std::vector<std::vector<bool>> & which) {
            return std::async(std::launch::async, [&, t2] {
                progress::quiet_scope quiet;
                auto e = sampled_weighted_errors(src, all_menus, importance, po, n_threads, &which, cache.dir());
                return timed_errors(std::move(e), seconds_since(t2));
            });
        };
        std::future<timed_errors> rest_errors = errors_of(later_rest), slow_errors = errors_of(later_slow);
        bool rest_added = false, lattice_added = false;
        double rest_seconds = 0;
        const auto add_rest_errors = [&] {
            if (!rest_added) {
                const timed_errors rest = rest_errors.get();
                add_errors(rest.first, later_rest);
                rest_seconds = rest.second;
                rest_added = true;
            }
        };
        const auto add_lattice_errors = [&] {  // every lattice type's Ê (once)
            if (lattice_added) {
                return;
            }
            add_rest_errors();
            const timed_errors slow = slow_errors.get();
            add_errors(slow.first, later_slow);
            lattice_added = true;
            if (std::any_of(split.later.begin(), split.later.end(),
                            [](const auto & row) { return std::find(row.begin(), row.end(), true) != row.end(); })) {
                fmt::print(stderr, "pruning: sampled errors of the lattice types (beside the eager candidates) in {:.1f} s\n",
                           std::max(slow.second, rest_seconds));
            }
        };
        const std::string eager_path = (fs::path(probe_path).parent_path() /
                                        (fs::path(probe_path).stem().string() + ".eager.json")).string();
        // A rank's share of jobs built ahead, as build_over_ranks splits the rest (every job with one process).
        const auto my_share = [&](std::vector<std::pair<size_t, size_t>> jobs) {
            if (ranks <= 1) {
                return jobs;
            }
            std::vector<std::pair<size_t, size_t>> mine;
            for (size_t j = 0; j < jobs.size(); ++j) {
                if (layer_sharding ? pipe.owner_of(all_menus[jobs[j].first].tensor->name) == rank
                                   : static_cast<int>(j % static_cast<size_t>(ranks)) == rank) {
                    mine.push_back(jobs[j]);
                }
            }
            return mine;
        };
        // Builds `pairs` ([tensor, menu type]) in order on the cores a probe leaves.
        const auto start_prefetch = [&](const std::vector<std::pair<size_t, size_t>> & pairs) {
            return std::make_unique<candidate_prefetch>(src, prefetch_jobs(pairs), importance, cache, prefetch_threads);
        };
        const bool ahead_on = o.build_ahead == "on" || (o.build_ahead == "auto" && device.is_cuda());
        // Whether a probe whose file is `path` runs as its candidates are built (probe_as_built): when building ahead,
        // with one process, and not reusing that file.
        const auto as_built = [&](const std::string & path) { return ranks == 1 && ahead_on && !fs::exists(path); };
        std::vector<std::pair<size_t, size_t>> ahead_jobs;  // built ahead while the probe ran (the first ahead_built)
        int64_t ahead_built = 0;
        // The likely keeps (once the lattice types' Ê is in, but for the `unknown` types'): built ahead when asked, and
        // sized for the disk warning.
        const auto plan_ahead = [&](const std::vector<std::vector<bool>> * unknown) {
            const auto t3 = std::chrono::steady_clock::now();
            const std::vector<std::pair<size_t, size_t>> guess = build_ahead_jobs(all_menus, err_hat, eager, budgets, also,
                                                                                  po, unknown);
            if (ahead_on) {
                ahead_jobs = my_share(guess);
                fmt::print(stderr, "pruning: the build-ahead plan in {:.1f} s{}\n", seconds_since(t3),
                           unknown ? " (IQ1's types left out: their grid was still building)" : "");
            }
            // The disk, before the probe ends (issue #16: at 8B the probe alone is many minutes): when the candidates it
            // will likely keep (build-ahead's guess) cannot fit beside the reserve, say so now; the check before the
            // build (check_disk_room) then decides on what the probe keeps.
            std::vector<std::pair<const gguf_tensor *, ggml_type>> pairs;
            int64_t raw = 0;
            for (const auto & [i, k] : guess) {
                const gguf_tensor & t = *all_menus[i].tensor;
                raw += static_cast<int64_t>(tensor_bytes(all_menus[i].types[k], t.shape(), t.name) + sizeof(uint64_t));
                pairs.emplace_back(&t, all_menus[i].types[k]);
            }
            const int64_t free = free_disk_bytes(cache.dir());
            if (free >= 0 && raw + k_disk_reserve_bytes > free) {  // only then are the keys worth hashing
                const int64_t need = candidate_bytes_to_build(src, pairs, importance, cache.dir(), n_threads);
                if (need + k_disk_reserve_bytes > free) {
                    fmt::print(stderr, "voodoo: warning: the {} candidates the probe will likely keep need {} more in '{}', "
                                       "which has {} free, of which {} is kept free: those that do not fit will be built in "
                                       "memory only, and a later run builds them again. A work folder (quantize --work; "
                                       "train --cache) on a disk with {} free keeps them all\n",
                               guess.size(), bytes_text(static_cast<double>(need)), cache.dir(),
                               bytes_text(static_cast<double>(free)), bytes_text(static_cast<double>(k_disk_reserve_bytes)),
                               bytes_text(static_cast<double>(need + k_disk_reserve_bytes)));
                }
            }
        };
        std::vector<std::vector<bool>> plan(eager_menus.size());  // every eager type but the source's own bytes
        for (size_t i = 0; i < eager_menus.size(); ++i) {
            for (size_t k = 0; k < eager_menus[i].types.size(); ++k) {
                plan[i].push_back(eager_menus[i].types[k] != eager_menus[i].tensor->type);
            }
        }
        std::vector<gated_tensor> eg;
        std::string eager_id;
        std::vector<std::vector<double>> es;
        const auto finish_eager_probe = [&] {
            for (const auto & row : plan) {
                eager_forwards += std::count(row.begin(), row.end(), true);
            }
            check_finite(eg, es, plan);
            for (size_t i = 0; i < eg.size(); ++i) {
                for (size_t k = 0; k < eg[i].types.size(); ++k) {
                    es[i][k] = plan[i][k] ? es[i][k] : 0.0;  // the source's own bytes: ΔKL 0
                }
            }
            if (writer) {
                save_probe(eager_path, eager_id, eg, es);
            }
        };
        if (as_built(eager_path)) {
            // The GPU measures each tensor's eager candidates once they are built (probe_as_built); once all are, the
            // cores build the types the probe will most likely keep.
            std::exception_ptr plan_failed;
            as_built_probe r = probe_as_built(eager_menus, plan, [&] {
                try {
                    // The plan with every lattice type's Ê when IQ1's is in; else with the others' alone, IQ1's types
                    // left out of the guess (build_ahead_jobs' `unknown`) and built after the probe when it keeps them,
                    // as any type the guess misses.
                    add_rest_errors();
                    if (slow_errors.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
                        add_lattice_errors();
                        plan_ahead(nullptr);
                    } else {
                        plan_ahead(&later_slow);
                    }
                } catch (...) {
                    plan_failed = std::current_exception();
                    ahead_jobs.clear();
                }
                return ahead_jobs;
            }, "the eager probe");
            if (plan_failed) {
                std::rethrow_exception(plan_failed);
            }
            add_lattice_errors();  // IQ1's too, when the plan ahead went without it (or the prefetch ended early)
            eg = std::move(r.gated);
            es = std::move(r.sens);
            ahead_built = r.then_built;
            eager_seconds = seconds_since(t2) - r.waited_seconds;  // the forwards' own time: --probe-anchors auto's rate
            eager_id = probe_identity(eg, probe_tokens, probe_dtype, po.eager, probe_tf32);
            fmt::print(stderr, "pruning: the eager candidates probed as they were built, in {:.1f} s (the probe waited {:.1f} s "
                               "for them); then {} of {} likely candidates built ahead while the probe ended\n",
                       seconds_since(t2), r.waited_seconds, ahead_built, ahead_jobs.size());
            finish_eager_probe();
        } else {
            eg = build_over_ranks(eager_menus);
            fmt::print(stderr, "pruning: eager candidates in {:.1f} s\n", seconds_since(t2));
            add_lattice_errors();
            eager_id = probe_identity(eg, probe_tokens, probe_dtype, po.eager, probe_tf32);
            es = load_probe(eager_path, eager_id, eg);
            if (!every_rank_has(!es.empty())) {
                es.clear();  // a rank without the file (another host's folder): every rank measures, or the probe's
                             // all-reduce would wait for ranks that skipped it
            }
            if (es.empty()) {
                // While the GPU measures the eager types, the idle cores build the types the probe will most likely keep.
                std::unique_ptr<candidate_prefetch> ahead;
                const auto t_ahead = std::chrono::steady_clock::now();
                plan_ahead(nullptr);
                if (ahead_on) {
                    ahead = start_prefetch(ahead_jobs);
                }
                const auto t_probe = std::chrono::steady_clock::now();
                es = probe_over_ranks(eg, plan);
                eager_seconds = seconds_since(t_probe);
                fmt::print(stderr, "pruning: the eager probe in {:.1f} s\n", eager_seconds);
                if (ahead) {
                    ahead_built = ahead->stop();
                    fmt::print(stderr, "built ahead while the probe ran: {} of {} likely candidates ({:.1f} MiB) in {:.1f} s\n",
                               ahead_built, ahead_jobs.size(), ahead->bytes() / k_mib, seconds_since(t_ahead));
                }
                finish_eager_probe();
            } else {
                fmt::print(stderr, "probe of the eager candidates: {} (reused)\n", eager_path);
            }
        }
        std::vector<std::vector<double>> measured(all_menus.size());
        for (size_t i = 0; i < all_menus.size(); ++i) {
            measured[i].assign(all_menus[i].types.size(), std::numeric_limits<double>::quiet_NaN());
            for (size_t k = 0, e = 0; k < all_menus[i].types.size(); ++k) {
                if (eager[i][k]) {
                    measured[i][k] = es[i][e++];
                    eager_kl[{all_menus[i].tensor->name, all_menus[i].types[k]}] = measured[i][k];
                }
            }
        }
        const auto t4 = std::chrono::steady_clock::now();
        prune_plan pp = plan_pruning(all_menus, err_hat, measured, eager, budgets, also, po);
        fmt::print(stderr, "pruning: the plan in {:.1f} s\n", seconds_since(t4));
        // Built ahead and not necessarily kept: [tensor, menu type] pairs, removed from the cache below when the
        // final plan does not keep them.
        std::vector<std::pair<size_t, size_t>> built_ahead(ahead_jobs.begin(), ahead_jobs.begin() + ahead_built);
        int64_t stage_forwards = 0;  // the second stage's probe, counted in --probe-auto-seconds' budget below
        double band = po.margin;  // the last plan's band: the first's, or the second's (stage_band_margin)
        if (resolved_prune_stages(o.prune_stages, o.device) == 2) {
            // The second stage (prune.h stage_types): the knapsack's choices and their neighbours built and measured,
            // then planned again with them known. While the GPU measures them, the idle cores build the rest of the
            // first plan's keeps, likeliest first.
            const auto t_stage = std::chrono::steady_clock::now();
            const std::vector<std::vector<bool>> staged = stage_types(all_menus, pp, measured, budgets, po.stage_width);
            int64_t n_staged = 0;
            std::vector<std::vector<bool>> stage_menu(all_menus.size()), stage_plan;
            for (size_t i = 0; i < all_menus.size(); ++i) {
                std::vector<bool> row;
                for (size_t k = 0; k < all_menus[i].types.size(); ++k) {
                    n_staged += staged[i][k];
                    stage_menu[i].push_back(staged[i][k] || eager[i][k]);
                    if (stage_menu[i].back()) {
                        row.push_back(staged[i][k]);
                    }
                }
                if (row.empty()) {  // no eager type (a menu of the source's type alone): its first type, not measured
                    stage_menu[i][0] = true;
                    row.push_back(false);
                }
                stage_plan.push_back(std::move(row));
            }
            if (n_staged > 0) {
                stage_forwards = n_staged;
                const int64_t kept_before = pp.kept;
                const std::vector<tensor_menu> stage_menus = pruned_menus(all_menus, stage_menu);
                const std::string stage_path = (fs::path(probe_path).parent_path() /
                                                (fs::path(probe_path).stem().string() + ".stage.json")).string();
                // While the GPU measures them, the cores build the rest of the first plan's keeps, likeliest first.
                std::vector<std::pair<size_t, size_t>> stage_jobs;
                if (ahead_on) {
                    for (size_t i = 0; i < all_menus.size(); ++i) {
                        for (size_t k = 0; k < all_menus[i].types.size(); ++k) {
                            if (pp.keep[i][k] && !stage_menu[i][k] && all_menus[i].types[k] != all_menus[i].tensor->type &&
                                std::find(built_ahead.begin(), built_ahead.end(), std::make_pair(i, k)) == built_ahead.end()) {
                                stage_jobs.emplace_back(i, k);
                            }
                        }
                    }
                    order_likeliest_first(all_menus, pp.predicted, budgets, stage_jobs);
                    stage_jobs = my_share(std::move(stage_jobs));
                }
                std::vector<gated_tensor> sg;
                std::vector<std::vector<double>> ss;
                std::string stage_id;
                int64_t stage_ahead_built = 0;
                double stage_build_seconds = 0, stage_probe_seconds = 0, stage_waited_seconds = -1;
                const auto finish_stage_probe = [&] {
                    check_finite(sg, ss, stage_plan);
                    for (size_t i = 0; i < sg.size(); ++i) {
                        for (size_t k = 0; k < sg[i].types.size(); ++k) {
                            ss[i][k] = stage_plan[i][k] ? ss[i][k] : 0.0;  // eager ones: not measured again here
                        }
                    }
                    if (writer) {
                        save_probe(stage_path, stage_id, sg, ss, &stage_plan);  // the eager types: not measured here
                    }
                };
                if (as_built(stage_path)) {
                    as_built_probe r = probe_as_built(stage_menus, stage_plan, [&] { return stage_jobs; },
                                                      "the second stage's probe");
                    sg = std::move(r.gated);
                    ss = std::move(r.sens);
                    stage_ahead_built = r.then_built;
                    stage_waited_seconds = r.waited_seconds;
                    stage_probe_seconds = seconds_since(t_stage);
                    stage_id = probe_identity(sg, probe_tokens, probe_dtype, po.eager, probe_tf32);
                    finish_stage_probe();
                } else {
                    sg = build_over_ranks(stage_menus);
                    stage_build_seconds = seconds_since(t_stage);
                    stage_id = probe_identity(sg, probe_tokens, probe_dtype, po.eager, probe_tf32);
                    ss = load_probe(stage_path, stage_id, sg);
                    if (!every_rank_has(!ss.empty())) {
                        ss.clear();
                    }
                    if (ss.empty()) {
                        std::unique_ptr<candidate_prefetch> ahead;
                        if (ahead_on) {
                            ahead = start_prefetch(stage_jobs);
                        }
                        const auto t_probe = std::chrono::steady_clock::now();
                        ss = probe_over_ranks(sg, stage_plan);
                        stage_probe_seconds = seconds_since(t_probe);
                        if (ahead) {
                            stage_ahead_built = ahead->stop();
                        }
                        finish_stage_probe();
                    } else {
                        fmt::print(stderr, "probe of the second stage's candidates: {} (reused)\n", stage_path);
                    }
                }
                built_ahead.insert(built_ahead.end(), stage_jobs.begin(), stage_jobs.begin() + stage_ahead_built);
                const std::vector<std::vector<double>> eager_measured = measured;  // the predictions' anchors, as before
                for (size_t i = 0; i < all_menus.size(); ++i) {
                    for (size_t k = 0, e = 0; k < all_menus[i].types.size(); ++k) {
                        if (!stage_menu[i][k]) {
                            continue;
                        }
                        if (stage_plan[i][e]) {
                            measured[i][k] = ss[i][e];
                            eager_kl[{all_menus[i].tensor->name, all_menus[i].types[k]}] = measured[i][k];
                        }
                        ++e;
                    }
                }
                sg.clear();
                const auto t5 = std::chrono::steady_clock::now();
                prune_options po2 = po;
                stage_band_miss miss;
                po2.margin = band = stage_band_margin(all_menus, pp, measured, staged, eager, po, &miss);  // pp: the first plan
                pp = plan_pruning(all_menus, err_hat, measured, eager, budgets, also, po2, &eager_measured);
                keep_also(all_menus, pp, staged);  // built and measured: they stay
                const std::string how = stage_waited_seconds >= 0
                    ? fmt::format("measured as they were built, in {:.1f} s (the probe waited {:.1f} s for them; then {} more "
                                  "built ahead)", stage_probe_seconds, stage_waited_seconds, stage_ahead_built)
                    : fmt::format("built in {:.1f} s and measured in {:.1f} s ({} more built ahead meanwhile)",
                                  stage_build_seconds, stage_probe_seconds, stage_ahead_built);
                fmt::print(stderr, "pruning, second stage: {} candidates (the knapsack's choices and their neighbours) {}; "
                                   "the plan again in {:.1f} s, the band {:.2f} to {:.2f} times each prediction (from "
                                   "the staged types' errors{}): {} of the first plan's {} kept\n",
                           n_staged, how, seconds_since(t5), po2.margin, 1.0 / po2.margin,
                           miss.types == 0 ? std::string()
                                           : fmt::format(": |ln(measured / predicted)| median {:.2f} of {}, largest {:.2f} "
                                                         "at {} {}, {:.3g} measured against {:.3g} predicted",
                                                         miss.median, miss.types, miss.largest, miss.tensor,
                                                         type_name(miss.type), miss.measured, miss.predicted),
                           pp.kept, kept_before);
            }
        }
        menus = pruned_menus(all_menus, pp.keep);
        if (o.probe_anchors < 0) {
            // The kept types the full probe would still measure: not eager, not the source's own bytes; with the
            // second stage's forwards, which came out of the same budget of seconds (--probe-auto-seconds).
            int64_t rest = stage_forwards;
            for (size_t i = 0; i < all_menus.size(); ++i) {
                for (size_t k = 0; k < all_menus[i].types.size(); ++k) {
                    rest += pp.keep[i][k] && !eager[i][k] && std::isnan(measured[i][k]) && all_menus[i].types[k] != all_menus[i].tensor->type;
                }
            }
            const std::string auto_path = (fs::path(probe_path).parent_path() /
                                           (fs::path(probe_path).stem().string() + ".auto.json")).string();
            const probe_anchor_choice c = resolve_probe_anchors(auto_path, eager_id, eager_seconds, eager_forwards, rest,
                                                                po.eager, o.probe_auto_seconds, writer);
            // Every rank takes the same decision: the full probe only where every rank would.
            anchors = every_rank_has(c.anchors == 0) ? 0 : po.eager;
            const std::string why = std::isfinite(c.seconds_per_forward)
                ? fmt::format("the other {} kept candidates{} would take ≈ {:.0f} s at the eager probe's {:.3f} s a forward, "
                              "{} --probe-auto-seconds {:g}", rest,
                              stage_forwards > 0 ? fmt::format(" (with the {} of the second stage)", stage_forwards) : "",
                              c.seconds_per_forward * static_cast<double>(rest),
                              c.seconds_per_forward, c.seconds_per_forward * static_cast<double>(rest) <= o.probe_auto_seconds
                                  ? "within" : "over", o.probe_auto_seconds)
                : fmt::format("the eager probe was reused without its rate ({})", auto_path);
            fmt::print(stderr, "probe (--probe-anchors auto): {}; {}\n",
                       anchors == 0 ? "every kept type measured"
                                    : fmt::format("the {} eager types of each tensor are its anchors, the others predicted", po.eager),
                       why);
        }
        if (!built_ahead.empty()) {
            const int64_t used = std::count_if(built_ahead.begin(), built_ahead.end(),
                                               [&](const auto & j) { return pp.keep[j.first][j.second]; });
            // The others are a guess the probe did not keep: no recipe under these targets can use them, so their
            // disk goes back before the kept ones are built (issue #16: at 8B the cache is what fills the disk).
            int64_t freed = 0;
            for (auto j = built_ahead.begin(); j != built_ahead.end(); ++j) {
                if (!pp.keep[j->first][j->second]) {
                    const gguf_tensor & t = *all_menus[j->first].tensor;
                    freed += cache.remove(candidate_cache::key(src, t, all_menus[j->first].types[j->second],
                                                               importance_for(importance, t)));
                }
            }
            fmt::print(stderr, "of the {} candidates built ahead, {} are kept; the other {} removed from the cache ({})\n",
                       built_ahead.size(), used, static_cast<int64_t>(built_ahead.size()) - used, bytes_text(static_cast<double>(freed)));
        }
        fmt::print(stderr, "candidates for {} target{}: {} of {} ({:.1f} of {:.1f} MiB; the others cannot be chosen unless "
                           "their ΔKL is outside {:.3g} to {:.3g} times its prediction) in {:.1f} s\n",
                   budgets.size(), budgets.size() == 1 ? "" : "s", pp.kept, pp.total, pp.kept_bytes / k_mib,
                   pp.total_bytes / k_mib, band, 1.0 / band,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    budget b = make_budget(src, menus, o.goal, eopts);
    if (prune) {
        share_grid(b, b_all);  // the exact knapsack of the kept types is the full menus' restricted to them
    }

    // Layer sharding (issue #17): a rank keeps on its device (and in host memory) only the candidates of the tensors
    // its layers use; the probe and the selection run rank to rank, so no rank reads another's.
    std::vector<bool> local(menus.size(), true);
    std::vector<tensor_menu> local_menus;
    for (size_t i = 0; i < menus.size(); ++i) {
        local[i] = on_this_rank(menus[i].tensor->name);
        if (local[i]) {
            local_menus.push_back(menus[i]);
        }
    }

    // Where the fused path's candidates live, and whether they fit: decided before they are built.
    std::vector<bool> on_host(menus.size(), false);
    if (path == mixture_path::fused) {
        // Whole candidates: a tensor-parallel rank places them whole for the probe (its shards replace them only for
        // training), so the whole ones are what must fit beside the teacher.
        const residency_plan plan = plan_residency(local_menus, o.candidates_on, device_total_memory(device), teacher_bytes);
        // Every candidate's bytes stay in host memory too (the probe and the selection read them): the pinned copies
        // come on top of them. A layer-sharded rank holds its own layers' only (build_candidates' keep).
        const int64_t host_total = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
        const int64_t whole = plan.all_bytes;
        if (plan.host_bytes > 0 && whole + plan.host_bytes > host_total * 7 / 10) {
            fail("the candidates ({:.1f} GiB) and the pinned copies of those left to host memory ({:.1f} GiB) exceed 70% "
                 "of this machine's {:.1f} GiB: a smaller menu (--menu with fewer types), a GPU with more memory, or "
                 "several GPUs with their layers sharded (--gpus N --parallel layers) would fit",
                 gib(whole), gib(plan.host_bytes), gib(host_total));
        }
        if (plan.host_bytes > 0) {
            fmt::print(stderr, "candidates: {:.2f} GiB of {} tensors in pinned host memory, moved to {} ahead of use "
                               "(--candidates-on {})\n",
                       gib(plan.host_bytes), std::count(plan.on_host.begin(), plan.on_host.end(), true), device.str(),
                       o.candidates_on);
        }
        for (size_t i = 0, j = 0; i < menus.size(); ++i) {
            on_host[i] = local[i] && plan.on_host[j++];
        }
    }

    // The disk: what the build will still write into the cache must fit there (issue #16: the default menu's kept
    // candidates of an 8B model are tens of GB), checked before it starts rather than met as a full disk part way.
    {
        std::vector<std::pair<const gguf_tensor *, ggml_type>> jobs;
        for (const tensor_menu & m : menus) {
            for (ggml_type type : m.types) {
                jobs.emplace_back(m.tensor, type);
            }
        }
        const int64_t need = candidate_bytes_to_build(src, jobs, importance, cache.dir(), n_threads);
        const int64_t free = free_disk_bytes(cache.dir());
        const bool short_of_disk = free >= 0 && need + k_disk_reserve_bytes > free;
        if (short_of_disk && ranks > 1) {
            // Several ranks read each other's candidates from the cache: there it must hold them all.
            check_disk_room(cache.dir(), need, fmt::format("the candidates still to build ({} tensors)", menus.size()),
                            fmt::format("a work folder (quantize --work; train --cache) on a disk with {} free would "
                                        "fit, or a smaller menu (--menu with fewer types){}",
                                        bytes_text(static_cast<double>(need + k_disk_reserve_bytes)),
                                        prune ? "" : ", or --candidates targets (builds only what the targets can use)"));
        } else if (short_of_disk) {
            // One process holds every candidate's bytes in memory for the probe, training and selection whether or not
            // the cache keeps them (session 29): so those that do not fit are built in memory only, and the disk keeps
            // the reserve and room for the file the export writes (its budget), instead of the job stopping here.
            cache.set_keep_free(k_disk_reserve_bytes + static_cast<int64_t>(b.limit));
            fmt::print(stderr, "voodoo: warning: not enough disk in '{}' for the candidates still to build: {} to write, {} "
                               "free there; the cache keeps what fits beside {} (the reserve and the exported file's "
                               "budget), and the rest are built in memory only: this run holds every candidate in memory "
                               "anyway, but a later run builds those again. A work folder (quantize --work; train --cache) "
                               "on a disk with {} free keeps them all\n",
                       cache.dir(), bytes_text(static_cast<double>(need)), bytes_text(static_cast<double>(free)),
                       bytes_text(static_cast<double>(cache.keep_free())),
                       bytes_text(static_cast<double>(need + k_disk_reserve_bytes)));
        }
    }
    const auto t_build = std::chrono::steady_clock::now();
    std::vector<gated_tensor> gated = build_over_ranks(menus);
    fmt::print(stderr, "candidates of {} tensors ready in {:.1f} s ({:.1f} s into the train stage)\n", menus.size(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_build).count(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count());
    if (cache.not_stored() > 0) {
        fmt::print(stderr, "candidates: {} ({}) built in memory only, not kept in '{}' (no room on its disk)\n",
                   cache.not_stored(), bytes_text(static_cast<double>(cache.not_stored_bytes())), cache.dir());
    }
    if (writer && !o.run_dir.empty()) {  // for voodoo quantize's eval ahead (k_candidates_built_file)
        write_file_atomic((fs::path(o.run_dir) / k_candidates_built_file).string(),
                          nlohmann::json{{"tensors", menus.size()}, {"seconds", seconds_since(t_build)},
                                         {"not_stored", cache.not_stored()}, {"not_stored_bytes", cache.not_stored_bytes()}}
                                  .dump() + "\n");
    }
    // When the teacher is the source file, its resident bf16 matrices stand in for the BF16/F16 candidates
    // that equal them (fused path): those candidates then cost no GPU memory of their own.
    const bool share = path == mixture_path::fused && compute == torch::kBFloat16 && same_file(src.path(), teacher.path());
    int64_t candidate_device_bytes = 0, candidate_host_bytes = 0;
    std::shared_ptr<void> stream;
    const auto t_place = std::chrono::steady_clock::now();  // the stages after the candidates, timed (issue #16)
    if (std::find(on_host.begin(), on_host.end(), true) != on_host.end()) {
        // Prefetch one layer ahead: as many tensors as the first streamed tensor's layer holds.
        std::string layer;
        int lookahead = 0;
        for (size_t i = 0; i < gated.size(); ++i) {
            if (on_host[i]) {
                const std::string & name = gated[i].tensor->name;
                const std::string prefix = name.substr(0, name.find('.', name.find('.') + 1) + 1);  // "blk.N."
                layer = layer.empty() ? prefix : layer;
                lookahead += prefix == layer;
            }
        }
        stream = make_candidate_stream(device, std::max(2, lookahead));
    }
    for (size_t i = 0; i < gated.size(); ++i) {
        gated_tensor & g = gated[i];
        if (!local[i]) {
            continue;  // another rank's layers: host bytes only
        }
        if (on_host[i]) {
            candidate_host_bytes += place_candidates_on_host(g, device, compute, stream);
            continue;
        }
        const bool sixteen = std::any_of(g.types.begin(), g.types.end(),
                                         [](ggml_type t) { return t == GGML_TYPE_BF16 || t == GGML_TYPE_F16; });
        const torch::Tensor source = share && sixteen ? teacher_weights.get(g.tensor->name) : torch::Tensor();
        candidate_device_bytes += place_candidates(g, path, device, compute, torch::kBFloat16 == compute ? compute : torch::kFloat, source);
    }

    const double place_seconds = seconds_since(t_place);
    const auto t_sens = std::chrono::steady_clock::now();
    // Sensitivities (kept in the probe file, shared by the sizes of a ladder), and the allocation they
    // suggest: the least total ΔKL under the budget (allocate_exact). The gates start there.
    const std::string probe_id = probe_identity(gated, probe_tokens, probe_dtype, anchors, probe_tf32);
    std::vector<std::vector<double>> sens = load_probe(probe_path, probe_id, gated);
    if (!every_rank_has(!sens.empty())) {
        sens.clear();
    }
    if (sens.empty()) {
        // Every candidate equal to the source (E = 0) has ΔKL 0 without a forward; with --probe-anchors N only N
        // types per tensor are measured and the rest predicted from their importance-weighted error. What the
        // eager probe measured is not measured again; with anchors, the eager types are the anchors.
        const std::vector<std::vector<double>> err = weighted_errors(dense, gated, importance, device, pipeline);
        std::vector<std::vector<bool>> plan = anchor_plan(gated, err, anchors);
        std::vector<std::vector<bool>> measured_mask = plan;
        std::vector<std::vector<double>> known(gated.size());
        for (size_t i = 0; i < gated.size(); ++i) {
            known[i].assign(gated[i].types.size(), std::numeric_limits<double>::quiet_NaN());
            bool any = false;
            for (size_t k = 0; k < gated[i].types.size(); ++k) {
                const auto it = eager_kl.find({gated[i].tensor->name, gated[i].types[k]});
                if (it != eager_kl.end() && err[i][k] > 0) {
                    known[i][k] = it->second;
                    any = true;
                }
            }
            for (size_t k = 0; any && k < gated[i].types.size(); ++k) {
                if (!std::isnan(known[i][k]) || anchors > 0) {
                    measured_mask[i][k] = !std::isnan(known[i][k]);
                    plan[i][k] = false;
                }
            }
        }
        // When the eager probe measured every anchor, the plan is empty and this runs no forward.
        sens = probe_over_ranks(gated, plan);
        check_finite(gated, sens, plan);
        for (size_t i = 0; i < gated.size(); ++i) {
            for (size_t k = 0; k < gated[i].types.size(); ++k) {
                if (!std::isnan(known[i][k])) {
                    sens[i][k] = known[i][k];
                }
                measured_mask[i][k] = measured_mask[i][k] || plan[i][k];
            }
        }
        predict_from_anchors(gated, err, sens);
        if (writer) {
            save_probe(probe_path, probe_id, gated, sens, &measured_mask);
        }
    } else {
        fmt::print(stderr, "probe: {} (reused)\n", probe_path);
    }
    const double sens_seconds = seconds_since(t_sens);
    const auto t_setup = std::chrono::steady_clock::now();
    const std::vector<int> start = allocate_exact(b, sens);
    if (writer) {
        save_sensitivity((fs::path(o.run_dir) / "sensitivity.json").string(), gated, sens, start);
    }

    // Every gate is a slice of one leaf: one AdamW update per step instead of one per tensor (on a GPU each
    // update is a dozen kernel launches; elementwise, the result is the same).
    int64_t n_gates = 0;
    for (const gated_tensor & g : gated) {
        n_gates += static_cast<int64_t>(g.types.size());
    }
    torch::Tensor all_gates = torch::zeros({n_gates}, torch::kFloat);
    std::vector<double> flat_costs;
    for (size_t i = 0, at = 0; i < gated.size(); ++i) {
        all_gates[static_cast<int64_t>(at) + start[i]] = static_cast<float>(o.gate_init);
        at += gated[i].types.size();
        flat_costs.insert(flat_costs.end(), b.cost[i].begin(), b.cost[i].end());
    }
    all_gates = all_gates.to(device).requires_grad_(true);
    const torch::Tensor costs = torch::tensor(flat_costs, torch::kDouble).to(device);
    for (size_t i = 0, at = 0; i < gated.size(); ++i) {
        const int64_t k = static_cast<int64_t>(gated[i].types.size());
        gated[i].gate = all_gates.narrow(0, static_cast<int64_t>(at), k);
        gated[i].n_threads = 1;
        at += static_cast<size_t>(k);
    }
    std::vector<torch::Tensor> params = {all_gates};
    gated_weights student(dense, gated);
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));

    const std::string fp = fingerprint(src, menus, o, data_hash);
    int step = 0;
    if (o.resume) {
        step = load_journal(journal_path, fp, gated, opt, o.steps);
        // Keep the log of the steps the journal holds; later lines are redone, and so is a line cut short by a
        // stop in the middle of its write (it does not parse).
        std::ifstream in(log_path);
        std::string kept;
        for (std::string line; std::getline(in, line);) {
            const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions =*/false);
            const bool before = j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
                                j["step"].get<int64_t>() < step;
            if (before) {
                kept += line + "\n";
            }
        }
        if (writer) {
            write_file_atomic(log_path, kept);
        }
    } else if (writer) {
        write_file_atomic(log_path, std::string());
    }
    std::ofstream log;
    if (writer) {
        log.open(log_path, std::ios::app);
    }

    // Tensor parallelism (issue #17): the teacher's and the dense weights' shards, and each gated tensor's candidates
    // cut to this rank's shard, sharing the gates, for the model of this rank's heads and FFN width.
    std::unique_ptr<dist::tp_shard_source> tp_teacher, tp_dense;
    std::deque<gguf_tensor> shard_shapes;
    std::vector<gated_tensor> shards;
    std::unique_ptr<gated_weights> tp_student;
    if (tensor_parallel) {
        tp_model->set_compute_dtype(compute);
        const int64_t n_vocab = model->hparams().n_vocab;
        tp_teacher = std::make_unique<dist::tp_shard_source>(teacher_weights, n_vocab, rank, ranks);
        tp_dense = std::make_unique<dist::tp_shard_source>(dense, n_vocab, rank, ranks);
        // The whole candidates served the probe; training reads only this rank's shards, so the whole ones leave the
        // device first (the selection reads them from host memory, the same values) and the device holds 1/N of them.
        candidate_device_bytes = 0;
        for (gated_tensor & g : gated) {
            if (!g.stream) {
                place_candidates(g, mixture_path::cpu, device, compute, torch::kFloat);
            }
        }
        for (gated_tensor & g : gated) {
            shards.push_back(dist::shard_gated_tensor(g, rank, ranks, shard_shapes));
            candidate_device_bytes +=
                place_candidates(shards.back(), path, device, compute, torch::kBFloat16 == compute ? compute : torch::kFloat);
            shards.back().gate = g.gate;
            shards.back().n_threads = 1;
        }
        tp_student = std::make_unique<gated_weights>(*tp_dense, shards);
    }
    if (ranks > 1) {
        fmt::print(stderr, "rank {} of {}: candidates for training on {}: {} of {} tensors{}, {:.1f} MiB ({} bytes)\n", rank,
                   ranks, device.str(), std::count(local.begin(), local.end(), true), local.size(),
                   tensor_parallel ? " (this rank's shards)" : "", candidate_device_bytes / 1048576.0, candidate_device_bytes);
    }
    // Activation checkpointing: every layer's activations of a micro-batch, or only their inputs and one layer's.
    {
        int64_t io_per_token = 0;
        for (size_t i = 0; i < gated.size(); ++i) {
            if (local[i]) {
                io_per_token += gated[i].tensor->ne[0] + gated[i].tensor->n_rows();
            }
        }
        if (tensor_parallel) {
            io_per_token /= ranks;
        }
        const int64_t act = activation_bytes_estimate(static_cast<int64_t>(o.batch) * seq, io_per_token);
        const int64_t logits = 3 * loss_chunk * model->hparams().n_vocab * 4;
        const int64_t total = device.is_cuda() ? device_total_memory(device) : 0;
        // The source's own device copies, when the teacher is another file (else one set serves both).
        const int64_t source_bytes = teacher_own ? device_copy_bytes(src) : 0;
        const int64_t free_bytes =
            total > 0 ? std::max<int64_t>(1, total - teacher_bytes - source_bytes - candidate_device_bytes - logits) : 0;
        // Tensor-parallel ranks communicate inside their layers, so they must all recompute or none: on when any would.
        // Layer-sharded ranks each decide for their own layers.
        const bool mine = resolve_recompute(o.recompute, act, free_bytes);
        const bool recompute = tensor_parallel ? !every_rank_has(!mine) : mine;
        (tensor_parallel ? *tp_model : *model).set_recompute_layers(recompute);
        if (recompute || o.recompute != "auto") {
            fmt::print(stderr, "voodoo: activation checkpointing {} ({}: the activations of {} × {} tokens ≈ {:.1f} GiB{})\n",
                       recompute ? "on" : "off", o.recompute == "auto" ? "auto" : "--recompute " + o.recompute, o.batch, seq,
                       gib(act), total > 0 ? fmt::format(", {:.1f} GiB free beside the teacher and the candidates", gib(free_bytes)) : "");
        }
    }

    const int64_t per_step = static_cast<int64_t>(o.batch) * o.accum;
    // The order of the epoch being read, shuffled once per epoch rather than once per sequence.
    int64_t order_epoch = 0;
    std::vector<int64_t> order = order0;
    auto batch_tokens = [&](int s, int micro) {
        std::vector<int64_t> chunks;
        for (int j = 0; j < o.batch; ++j) {
            const int64_t idx = static_cast<int64_t>(s) * per_step + static_cast<int64_t>(micro) * o.batch + j;
            if (idx / n_chunks != order_epoch) {
                order_epoch = idx / n_chunks;
                order = epoch_order(n_chunks, o.seed, order_epoch);
            }
            chunks.push_back(order[static_cast<size_t>(idx % n_chunks)]);
        }
        return chunk_tokens(chunks);
    };

    const int st_from = o.steps - static_cast<int>(std::lround(o.st_gumbel_fraction * o.steps));
    const double setup_seconds = seconds_since(t_setup);
    const auto t_steps = std::chrono::steady_clock::now();
    const int first_step = step;
    progress bar("train", o.steps, "steps");
    bar.resume_from(step);
    bool stopped = false;
    for (; step < o.steps; ++step) {
        const auto t0 = std::chrono::steady_clock::now();
        const double tau = temperature(o, step);
        const double lr = cosine_lr(o, step);
        for (auto & group : opt.param_groups()) {
            static_cast<torch::optim::AdamWOptions &>(group.options()).lr(lr);
        }
        student.set_temperature(tau);
        student.set_straight_through(step >= st_from, o.seed * 1000003ull + static_cast<uint64_t>(step));
        student.set_routing(routing, o.seed * 2000003ull + static_cast<uint64_t>(step));
        if (tp_student) {  // the same temperature and noise seeds: the same p on every rank
            tp_student->set_temperature(tau);
            tp_student->set_straight_through(step >= st_from, o.seed * 1000003ull + static_cast<uint64_t>(step));
        }
        opt.zero_grad();
        for (auto & g : gated) {
            g.grad_p = torch::Tensor();
        }
        double ce_sum = 0, kl_sum = 0, size_term = 0, bytes = 0;
        for (int micro = 0; micro < o.accum; ++micro) {
            const torch::Tensor tokens = batch_tokens(step, micro);
            // The size penalty from the gates (made after the student's forward, as the single process always has:
            // the autograd engine sums a tied gate's gradients in the order its nodes were made).
            torch::Tensor expected, pen;
            auto size_penalty = [&] {
                std::vector<torch::Tensor> probs;
                for (size_t i = 0; i < gated.size(); ++i) {
                    probs.push_back(student.probs(i));
                }
                expected = torch::dot(torch::cat(probs).to(torch::kDouble), costs) + b.fixed;
                const torch::Tensor rel = expected / b.limit - 1.0;
                pen = torch::relu(rel.abs() - o.size_tol).pow(2);
                // (CE + λ_KL·KL + λ_size·penalty) / accum, the vocabulary a chunk at a time, in one backward. The
                // penalty depends on the gates alone: one rank backpropagates it (the gradients are summed over ranks).
                return rank == (layer_sharding ? ranks - 1 : 0) ? pen * (o.lambda_size / o.accum) : torch::Tensor();
            };
            distill_values v;
            if (layer_sharding) {
                const torch::Tensor extra = size_penalty();
                v = dist::sharded_distill_step(*model, tokens, teacher_weights, student, o.group, my_layers, o.lambda_kl,
                                               loss_chunk, params, 1.0 / o.accum, extra, o.lambda_ce, false);
            } else {
                causal_lm & m = tensor_parallel ? *tp_model : *model;
                weight_source & tw = tensor_parallel ? static_cast<weight_source &>(*tp_teacher) : teacher_weights;
                weight_source & sw = tensor_parallel ? static_cast<weight_source &>(*tp_student) : student;
                torch::Tensor h_t;
                {
                    torch::NoGradGuard no_grad;  // the teacher: no autograd, compute dtype (bf16 on a GPU)
                    h_t = m.hidden(tokens, tw);
                }
                const torch::Tensor h_s = m.hidden(tokens, sw);
                const torch::Tensor extra = size_penalty();
                v = chunked_distill(m, h_s, sw, h_t, tw, tokens, o.lambda_kl, 1.0 / o.accum, loss_chunk, extra, o.lambda_ce);
            }
            ce_sum += v.ce / o.accum;
            kl_sum += v.kl / o.accum;
            size_term = pen.item<double>();
            bytes = expected.item<double>();
        }
        if (ranks > 1) {  // every rank's part of every gate's gradient, summed: the same gates on every rank
            dist::sum_gate_gradients(*o.group, params);
        }
        if (!std::isfinite(ce_sum) || !std::isfinite(kl_sum)) {
            std::string culprit = "none found";
            for (const auto & g : gated) {
                if (!torch::isfinite(g.gate).all().item<bool>() ||
                    (g.grad_p.defined() && !torch::isfinite(g.grad_p).all().item<bool>())) {
                    culprit = g.tensor->name;
                    break;
                }
            }
            fail("step {}: the loss is not finite (CE {}, KL {}); first tensor with a non-finite gate or gradient: {}; "
                 "the last good journal is kept in '{}'",
                 step, ce_sum, kl_sum, culprit, o.run_dir);
        }
        opt.step();
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const nlohmann::json line = {{"step", step},        {"loss", o.lambda_ce * ce_sum + o.lambda_kl * kl_sum + o.lambda_size * size_term},
                                     {"ce", ce_sum},        {"kl", kl_sum},
                                     {"size_term", size_term}, {"tau", tau},
                                     {"bytes", bytes},      {"budget", b.limit},
                                     {"lr", lr},            {"tokens_per_s", static_cast<double>(per_step * seq) / dt}};
        if (writer) {
            log << line.dump() << "\n" << std::flush;
        }
        bar.add(1, fmt::format("KL {:.4f} size {:.4f}", kl_sum, bytes / b.limit));
        // Every rank stops after the same step (any rank asked to), or none.
        const bool stop = !every_rank_has(!(o.should_stop && o.should_stop(step)));
        if (writer && ((step + 1) % o.journal_every == 0 || step + 1 == o.steps || stop)) {
            save_journal(journal_path, fp, step + 1, gated, opt);
        }
        if (stop) {
            ++step;
            stopped = true;
            break;
        }
    }
    bar.finish();
    const double steps_seconds = seconds_since(t_steps);
    student.set_routing(routing_mode::mix, 0);  // what follows measures whole recipes, never routed tokens

    train_result res;
    res.finished = !stopped;
    res.steps_done = step;
    res.limit_bytes = b.limit;
    if (stopped) {
        return res;   // the journal is saved; the selection would be thrown away (the resumed run makes it)
    }
    std::vector<std::vector<double>> probs;
    student.set_temperature(temperature(o, o.steps - 1));
    for (size_t i = 0; i < gated.size(); ++i) {
        const torch::Tensor p = student.probs(i).detach().to(torch::kCPU, torch::kDouble).contiguous();
        probs.emplace_back(p.data_ptr<double>(), p.data_ptr<double>() + p.numel());
    }
    // The selection's chunks: the first --select-sequences of the validation split (never trained on), else the
    // probe's.
    res.select_held_apart = val && val->n_chunks() > 0 && val->ctx() >= train.ctx();
    std::vector<int64_t> sel_chunks;
    for (int64_t j = 0; res.select_held_apart && j < std::min<int64_t>(o.select_sequences, val->n_chunks()); ++j) {
        sel_chunks.push_back(j);
    }
    const torch::Tensor sel_tokens = res.select_held_apart ? tokens_of(*val, sel_chunks, train.ctx()) : probe_tokens;
    res.select_tokens_shape = {sel_tokens.size(0), sel_tokens.size(1)};
    const auto t_select = std::chrono::steady_clock::now();
    const std::vector<int> choice = select_recipe(res, src, *model, dense, teacher_weights, gated, menus, b, probs, sens,
                                                  sel_tokens, device, loss_chunk, o, pipeline);
    fmt::print(stderr, "after the candidates: placement {:.1f} s, probe and errors {:.1f} s, set-up {:.1f} s, {} steps {:.1f} s, "
                       "selection {:.1f} s\n", place_seconds, sens_seconds, setup_seconds, step - first_step, steps_seconds,
               seconds_since(t_select));
    if (layer_sharding) {
        // What this rank's device held of the source (and of a teacher of its own): the tensors its layers use, and no
        // other (the probe, the training and the selection all ran rank to rank).
        const auto report = [&](const char * what, const gguf_file & f, const gguf_weights & w) {
            std::vector<std::string> others;
            const std::vector<std::string> read = w.tensors_read();
            std::copy_if(read.begin(), read.end(), std::back_inserter(others),
                         [&](const std::string & name) { return !on_this_rank(name); });
            fmt::print(stderr, "rank {} of {}: read {} of the {}'s {} tensors{}{}\n", rank, ranks, read.size(), what,
                       f.tensors().size(), others.empty() ? ", each of its own layers, embedding or head" : "; of other ranks': ",
                       fmt::join(others, ", "));
        };
        report("source", src, dense);
        if (teacher_own) {
            report("teacher", teacher, *teacher_own);
        }
    }
    res.final_recipe = recipe_from_choice(src, menus, choice, probs, o.goal);
    res.final_recipe.imatrix = o.imatrix_path;
    res.total_bytes = b.total(choice);
    res.summary = summary_table(res.final_recipe, b, res.total_bytes);
    res.summary += fmt::format("  selection on {} sequences of {} tokens{} (KL nats/token, f32): ", res.select_tokens_shape.first,
                               res.select_tokens_shape.second, res.select_held_apart ? ", held apart" : " (the probe's: no validation split)");
    for (size_t i = 0; i < res.selection.size(); ++i) {
        const auto & e = res.selection[i];
        res.summary += fmt::format("{}{} {:.6g}{}", i ? ", " : "", e.name, e.val_kl, i ? "" : " (chosen)");
    }
    res.summary += "\n";
    if (res.finished && writer) {
        recipe_save(res.final_recipe, (fs::path(o.run_dir) / "recipe.json").string());
        write_file_atomic((fs::path(o.run_dir) / "recipe.tensor-types.txt").string(),
                          recipe_tensor_types(res.final_recipe));
        recipe greedy = recipe_from_choice(src, menus, greedy_choice(b, sens), {}, o.goal);
        greedy.imatrix = o.imatrix_path;
        recipe_save(greedy, (fs::path(o.run_dir) / "greedy.recipe.json").string());
        write_file_atomic((fs::path(o.run_dir) / "selection.json").string(), selection_to_json(res).dump(2) + "\n");
    }
    res.summary += fmt::format("  trained on {} ({} mixture, {} routing{})\n", device.str(), mixture_path_name(path), o.routing,
                               candidate_device_bytes > 0 ? fmt::format(", candidates {:.1f} MiB on the device",
                                                                        candidate_device_bytes / 1048576.0)
                                                          : std::string());
    res.device = device.str();
    res.mixture = mixture_path_name(path);
    res.candidate_device_bytes = candidate_device_bytes;
    for (size_t i = 0; i < all_menus.size(); ++i) {
        for (const ggml_type type : all_menus[i].types) {
            const double n = static_cast<double>(tensor_bytes(type, all_menus[i].tensor->shape(), all_menus[i].tensor->name));
            const bool built = std::find(menus[i].types.begin(), menus[i].types.end(), type) != menus[i].types.end();
            res.candidates_in_menus += 1;
            res.candidate_bytes_in_menus += n;
            res.candidates_built += built;
            res.candidate_bytes_built += built ? n : 0.0;
        }
    }
    if (res.candidates_built < res.candidates_in_menus) {
        res.summary += fmt::format("  candidates built for the targets: {} of {} ({:.1f} of {:.1f} MiB; --candidates all builds every one)\n",
                                   res.candidates_built, res.candidates_in_menus, res.candidate_bytes_built / 1048576.0,
                                   res.candidate_bytes_in_menus / 1048576.0);
    }
    res.candidate_host_bytes = candidate_host_bytes;
    res.stream_stats = candidate_stream_statistics(stream);
    if (stream) {
        res.summary += fmt::format("  host-resident candidates: {:.1f} MiB pinned, {} copies to the GPU ({:.1f} GiB), {} of {} "
                                   "uses not prefetched, at most {:.1f} MiB resident at once\n",
                                   candidate_host_bytes / 1048576.0, res.stream_stats.copies,
                                   res.stream_stats.bytes_copied / 1073741824.0, res.stream_stats.misses,
                                   res.stream_stats.uses, res.stream_stats.peak_resident_bytes / 1048576.0);
    }
    res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    return res;
}

int64_t activation_bytes_estimate(int64_t tokens, int64_t io_per_token) { return 6 * tokens * io_per_token; }

int64_t activation_bytes_recomputed(int64_t tokens, int64_t n_embd, int64_t n_layer, int64_t all_layers_bytes) {
    return 2 * tokens * n_embd * n_layer + all_layers_bytes / std::max<int64_t>(1, n_layer);
}

bool resolve_recompute(const std::string & mode, int64_t activation_bytes, int64_t free_bytes) {
    if (mode == "on" || mode == "off") {
        return mode == "on";
    }
    if (mode != "auto") {
        fail("--recompute {}: expected on, off or auto", mode);
    }
    return free_bytes > 0 && activation_bytes > free_bytes;
}

residency_plan plan_residency(const std::vector<tensor_menu> & menus, const std::string & candidates_on,
                              int64_t device_bytes, int64_t teacher_bytes, int tp_rank, int tp_size) {
    residency_plan p;
    const candidate_residency mode = parse_candidate_residency(candidates_on);
    for (const tensor_menu & m : menus) {
        int64_t n = 0;
        const std::array<int64_t, 4> ne = tp_size > 1 ? dist::tp_shard_ne(*m.tensor, tp_rank, tp_size) : m.tensor->ne;
        for (const ggml_type type : m.types) {
            n += static_cast<int64_t>(tensor_bytes(type, ne, m.tensor->name));
        }
        p.bytes.push_back(n);
        p.all_bytes += n;
    }
    p.device_bytes = device_bytes;
    if (p.device_bytes == 0) {
        p.on_host.assign(menus.size(), false);
        return p;
    }
    p.reserve = std::max<int64_t>(int64_t{16} << 30, p.device_bytes / 5);
    p.teacher_fits = teacher_bytes + p.reserve <= p.device_bytes;
    p.on_host = host_resident_plan(p.bytes, mode, p.device_bytes - teacher_bytes - p.reserve);
    for (size_t i = 0; i < menus.size(); ++i) {
        p.host_bytes += p.on_host[i] ? p.bytes[i] : 0;
    }
    return p;
}

void check_device_name(const std::string & s) {
    if (s == "cpu") {
        return;
    }
    if (s == "cuda" || s.rfind("cuda:", 0) == 0) {
#if !defined(VOODOO_HAVE_CUDA)
        fail("--device {}: this voodoo was built without CUDA; build it against a CUDA LibTorch with -DVOODOO_CUDA=ON "
             "(README: building for the GPU), or use --device cpu", s);
#else
        const std::string n = s.size() > 5 ? s.substr(5) : "0";
        if (n.empty() || n.size() > 3 || !std::all_of(n.begin(), n.end(), [](unsigned char c) { return std::isdigit(c); })) {
            fail("--device '{}': expected cpu, cuda or cuda:N with N a device number", s);
        }
        return;
#endif
    }
    fail("--device '{}': expected cpu, cuda or cuda:N", s);
}

std::string resolved_probe_compute(const std::string & probe_compute, const std::string & device) {
    if (probe_compute != "auto") {
        return probe_compute;
    }
    return device == "cuda" || device.rfind("cuda:", 0) == 0 ? "tf32" : "f32";
}

int resolved_prune_stages(const std::string & mode, const std::string & device) {
    if (mode == "1" || mode == "2") {
        return mode == "1" ? 1 : 2;
    }
    if (mode != "auto") {
        fail("--prune-stages: '{}' is not 1, 2 or auto", mode);
    }
    return device == "cuda" || device.rfind("cuda:", 0) == 0 ? 2 : 1;
}

torch::Device parse_train_device(const std::string & s) {
    if (s == "cpu") {
        return torch::kCPU;
    }
    if (s == "cuda" || s.rfind("cuda:", 0) == 0) {
#if !defined(VOODOO_HAVE_CUDA)
        fail("--device {}: this voodoo was built without CUDA; build it against a CUDA LibTorch with -DVOODOO_CUDA=ON "
             "(README: building for the GPU), or use --device cpu", s);
#else
        int index = 0;
        if (s.size() > 5) {
            try {
                size_t used = 0;
                index = std::stoi(s.substr(5), &used);
                if (used != s.size() - 5 || index < 0) {
                    throw std::invalid_argument(s);
                }
            } catch (const std::exception &) {
                fail("--device '{}': expected cpu, cuda or cuda:N with N a device number", s);
            }
        }
        if (!torch::cuda::is_available() || index >= static_cast<int>(torch::cuda::device_count())) {
            fail("--device {}: no such CUDA device here ({} visible); use --device cpu", s,
                 torch::cuda::is_available() ? torch::cuda::device_count() : 0);
        }
        return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
#endif
    }
    fail("--device '{}': expected cpu, cuda or cuda:N", s);
}

}  // namespace voodoo
