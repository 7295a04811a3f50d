#include "train/budget.h"

#include "common/error.h"
#include "ggml/selection.h"
#include "ggml/types.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <regex>
#include <set>

namespace voodoo {

bool is_all_menu(const std::string & spec) {
    std::string s;
    for (unsigned char c : spec) {
        if (!std::isspace(c)) {
            s.push_back(static_cast<char>(std::tolower(c)));
        }
    }
    return s == "all";
}

std::vector<ggml_type> parse_menu(const std::string & list, const std::string & flag) {
    std::vector<ggml_type> types;
    size_t start = 0;
    while (start <= list.size()) {
        const size_t end = std::min(list.find(',', start), list.size());
        std::string name = list.substr(start, end - start);
        name.erase(std::remove_if(name.begin(), name.end(), [](unsigned char c) { return std::isspace(c); }),
                   name.end());
        if (!name.empty()) {
            if (is_all_menu(name)) {
                fail("{}: 'all' stands alone (the default menu with llama.cpp's fallback types on every tensor); give "
                     "--menu all, or a list of types such as Q4_K,Q5_K,Q6_K", flag);
            }
            const ggml_type t = parse_type(name, flag);
            if (std::find(types.begin(), types.end(), t) == types.end()) {
                types.push_back(t);
            }
        }
        start = end + 1;
    }
    if (types.empty()) {
        fail("{}: empty menu; give comma-separated ggml types, e.g. Q4_K,Q5_K,Q6_K", flag);
    }
    std::stable_sort(types.begin(), types.end(),
                     [](ggml_type a, ggml_type b) { return type_info_of(a).bpw < type_info_of(b).bpw; });
    return types;
}

std::pair<std::string, std::vector<ggml_type>> parse_menu_for(const std::string & spec) {
    const size_t eq = spec.rfind('=');
    if (eq == std::string::npos || eq == 0) {
        fail("--menu-for '{}': expected PATTERN=TYPES, e.g. 'attn_.*=Q4_K,Q5_K,Q6_K'", spec);
    }
    const std::string pattern = spec.substr(0, eq);
    try {
        std::regex check(pattern);
    } catch (const std::regex_error & e) {
        fail("--menu-for '{}': '{}' is not a valid regular expression ({})", spec, pattern, e.what());
    }
    return {pattern, parse_menu(spec.substr(eq + 1), "--menu-for '" + spec + "'")};
}

void apply_menu_flags(menu_options & m, const std::string & menu, const std::vector<std::string> & menu_for,
                      bool speed_limited) {
    if (is_all_menu(menu)) {
        m.with_fallbacks = true;
    } else if (!menu.empty()) {
        m.types = parse_menu(menu, "--menu");
    }
    if (speed_limited) {
        m.with_fallbacks = true;
    }
    for (const auto & spec : menu_for) {
        m.per_role.push_back(parse_menu_for(spec));
    }
}

std::vector<tensor_menu> build_menus(const gguf_file & file, const menu_options & opts) {
    std::vector<std::pair<std::regex, const std::vector<ggml_type> *>> roles;
    for (const auto & [pattern, types] : opts.per_role) {
        roles.emplace_back(std::regex(pattern), &types);
    }
    // Only types the user named must fit somewhere; the default menu covers every shape.
    std::set<ggml_type> asked(opts.types.begin(), opts.types.end()), used;
    for (const auto & [pattern, types] : opts.per_role) {
        asked.insert(types.begin(), types.end());
    }
    std::vector<tensor_menu> menus;
    std::vector<bool> role_used(roles.size(), false);
    for (const gguf_tensor & t : file.tensors()) {
        if (!tensor_is_selectable(t.name, t.n_dims)) {
            continue;
        }
        const std::vector<ggml_type> * types = opts.types.empty() ? nullptr : &opts.types;
        for (size_t r = 0; r < roles.size(); ++r) {
            if (std::regex_search(t.name, roles[r].first)) {
                types = roles[r].second;
                role_used[r] = true;
                break;
            }
        }
        const bool covered = opts.has_imatrix && (!opts.importance || opts.importance->count(t.name));
        tensor_menu m{&t,
                      types ? menu_for(*types, t.ne[0], covered) : default_menu_for(t.ne[0], covered, opts.with_fallbacks),
                      false};
        if (m.types.empty()) {
            continue;
        }
        std::stable_sort(m.types.begin(), m.types.end(),
                         [](ggml_type a, ggml_type b) { return type_info_of(a).bpw < type_info_of(b).bpw; });
        m.float_only = std::none_of(m.types.begin(), m.types.end(),
                                    [](ggml_type ty) { return type_info_of(ty).is_quantized; });
        used.insert(m.types.begin(), m.types.end());
        menus.push_back(std::move(m));
    }
    for (size_t r = 0; r < roles.size(); ++r) {
        if (!role_used[r]) {
            fail("--menu-for '{}': the pattern matches no quantizable tensor of '{}' (or only tensors an earlier "
                 "--menu-for took); `voodoo inspect {}` lists the names", opts.per_role[r].first, file.path(), file.path());
        }
    }
    for (ggml_type t : asked) {
        if (!used.count(t)) {
            const bool imatrix = type_info_of(t).needs_imatrix && !opts.has_imatrix;
            fail("menu type {} fits no tensor of '{}'{}; remove it from --menu/--menu-for", type_name(t), file.path(),
                 imatrix ? " (it needs an imatrix: pass --imatrix)"
                         : fmt::format(" (its block of {} divides no tensor's row length)",
                                       ggml_get_type_traits(t)->blck_size));
        }
    }
    return menus;
}

std::string target::str() const {
    switch (kind) {
        case target_kind::bpw: return fmt::format("bpw={}", value);
        case target_kind::size: return fmt::format("size={}", static_cast<int64_t>(value));
        case target_kind::ratio: return fmt::format("ratio={}", value);
    }
    return "";
}

double parse_size(const std::string & s, const std::string & flag) {
    static const std::regex re(R"(^\s*([0-9]+(\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$)", std::regex::icase);
    std::smatch m;
    if (!std::regex_match(s, m, re)) {
        fail("{} '{}': expected a size such as 304352, 300KB, 512MiB, 4.5GiB or 4G (K, M, G: powers of 1024, as ls -h "
             "prints; KB, MB, GB: powers of 1000)", flag, s);
    }
    double v = std::stod(m[1].str());
    std::string unit = m[3].str();
    std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::toupper(c); });
    if (!unit.empty() && unit != "B") {
        // "KIB" and a bare "K" (as ls -h and df -h print sizes) are powers of 1024; "KB" of 1000.
        const double base = unit.size() != 2 ? 1024.0 : 1000.0;
        const int power = std::string("KMGT").find(unit[0]) + 1;
        v *= std::pow(base, power);
    }
    return std::floor(v);
}

double budget::total(const std::vector<int> & choice) const {
    double sum = fixed;
    for (size_t t = 0; t < cost.size(); ++t) {
        sum += cost[t][static_cast<size_t>(choice[t])];
    }
    return sum;
}

double budget::in_target_unit(double bytes) const {
    switch (goal.kind) {
        case target_kind::bpw: return 8.0 * bytes / static_cast<double>(n_weights);
        case target_kind::size: return bytes;
        case target_kind::ratio: return bytes / q8_0_bytes;
    }
    return bytes;
}

budget make_budget(const gguf_file & file, const std::vector<tensor_menu> & menus, const target & goal,
                   const export_options & opts, bool check_range) {
    budget b;
    b.goal = goal;
    b.n_weights = 0;
    for (const gguf_tensor & t : file.tensors()) {
        b.n_weights += t.n_elements();
    }
    const bool file_mode = goal.kind != target_kind::bpw;
    const size_t align = file.alignment();
    auto cost_of = [&](ggml_type type, const gguf_tensor & t) {
        const size_t n = tensor_bytes(type, t.shape(), t.name);
        return static_cast<double>(file_mode ? GGML_PAD(n, align) : n);
    };

    // The fixed part: for the file, the exact size of the file with every tensor at its cheapest type
    // minus the chosen tensors' costs (the header does not depend on the types).
    recipe cheapest = recipe_from_model(file);
    std::map<std::string, ggml_type> first_type;
    for (const tensor_menu & m : menus) {
        first_type[m.tensor->name] = m.types.front();
    }
    for (recipe_tensor & rt : cheapest.tensors) {
        if (auto it = first_type.find(rt.name); it != first_type.end()) {
            rt.type = it->second;
            rt.bytes = tensor_bytes(rt.type, rt.shape, rt.name);
        }
    }
    double chosen_cheapest = 0;
    b.cost.reserve(menus.size());
    for (const tensor_menu & m : menus) {
        std::vector<double> c;
        for (ggml_type type : m.types) {
            c.push_back(cost_of(type, *m.tensor));
        }
        chosen_cheapest += c.front();
        b.cost.push_back(std::move(c));
    }
    if (file_mode) {
        b.fixed = static_cast<double>(planned_file_bytes(file, cheapest, opts)) - chosen_cheapest;
    } else {
        b.fixed = 0;
        for (const gguf_tensor & t : file.tensors()) {
            if (!first_type.count(t.name)) {
                b.fixed += static_cast<double>(t.n_bytes);
            }
        }
    }
    b.min_total = b.fixed;
    b.max_total = b.fixed;
    for (const auto & c : b.cost) {
        b.min_total += *std::min_element(c.begin(), c.end());
        b.max_total += *std::max_element(c.begin(), c.end());
    }
    switch (goal.kind) {
        case target_kind::bpw: b.limit = std::floor(goal.value * static_cast<double>(b.n_weights) / 8.0); break;
        case target_kind::size: b.limit = goal.value; break;
        case target_kind::ratio:
            b.q8_0_bytes = static_cast<double>(q8_0_file_bytes(file, opts));
            b.limit = std::floor(goal.value * b.q8_0_bytes);
            break;
    }
    if (check_range && (b.limit < b.min_total || b.limit > b.max_total)) {
        const double w = static_cast<double>(b.n_weights);
        const std::string ratio = goal.kind == target_kind::ratio
                                      ? fmt::format(", {:.4g} to {:.4g} of the all-Q8_0 file", b.min_total / b.q8_0_bytes,
                                                    b.max_total / b.q8_0_bytes)
                                      : "";
        fail("target {} is outside what the menus can reach for '{}': from {:.0f} to {:.0f} bytes{} ({:.2f} to {:.2f} "
             "MiB, {:.3f} to {:.3f} BPW{}; every tensor at its cheapest type, every tensor at its dearest)",
             goal.str(), file.path(), b.min_total, b.max_total, file_mode ? " of file" : " of tensor data",
             b.min_total / 1048576.0, b.max_total / 1048576.0, 8 * b.min_total / w, 8 * b.max_total / w, ratio);
    }
    return b;
}

std::vector<int> finalize_choice(const budget & b, const std::vector<std::vector<double>> & probs,
                                 const std::vector<std::vector<double>> & est_loss) {
    const size_t n = b.cost.size();
    if (b.limit < b.min_total) {
        fail("no choice fits the budget of {:.0f} bytes (the smallest is {:.0f})", b.limit, b.min_total);
    }
    std::vector<int> choice(n);
    for (size_t t = 0; t < n; ++t) {
        choice[t] = static_cast<int>(std::max_element(probs[t].begin(), probs[t].end()) - probs[t].begin());
    }
    double total = b.total(choice);
    // Repair: cheapest loss per byte saved, until the total fits.
    while (total > b.limit) {
        double best = std::numeric_limits<double>::infinity();
        size_t bt = 0;
        int bk = -1;
        for (size_t t = 0; t < n; ++t) {
            const int cur = choice[t];
            for (size_t k = 0; k < b.cost[t].size(); ++k) {
                const double saved = b.cost[t][static_cast<size_t>(cur)] - b.cost[t][k];
                if (saved <= 0) {
                    continue;
                }
                const double score = (est_loss[t][k] - est_loss[t][static_cast<size_t>(cur)]) / saved;
                if (score < best) {
                    best = score;
                    bt = t;
                    bk = static_cast<int>(k);
                }
            }
        }
        if (bk < 0) {
            fail("no downgrade is left but the total of {:.0f} bytes exceeds the budget of {:.0f}", total, b.limit);
        }
        total += b.cost[bt][static_cast<size_t>(bk)] - b.cost[bt][static_cast<size_t>(choice[bt])];
        choice[bt] = bk;
    }
    // Spend what is left: most estimated gain per byte, never crossing the limit.
    for (;;) {
        double best = 0;
        size_t bt = 0;
        int bk = -1;
        for (size_t t = 0; t < n; ++t) {
            const int cur = choice[t];
            for (size_t k = 0; k < b.cost[t].size(); ++k) {
                const double extra = b.cost[t][k] - b.cost[t][static_cast<size_t>(cur)];
                if (extra < 0 || total + extra > b.limit) {
                    continue;
                }
                // A move at the same cost (F16 ↔ BF16) with a gain is free: it ranks first.
                const double gain = est_loss[t][static_cast<size_t>(cur)] - est_loss[t][k];
                const double score = extra == 0 ? std::numeric_limits<double>::infinity() : gain / extra;
                if (gain > 0 && score > best) {
                    best = score;
                    bt = t;
                    bk = static_cast<int>(k);
                }
            }
        }
        if (bk < 0) {
            break;
        }
        total += b.cost[bt][static_cast<size_t>(bk)] - b.cost[bt][static_cast<size_t>(choice[bt])];
        choice[bt] = bk;
    }
    return choice;
}

std::vector<int> allocate_exact(const budget & b, const std::vector<std::vector<double>> & est_loss, int64_t grid) {
    const size_t n = b.cost.size();
    if (b.limit < b.min_total) {
        fail("no choice fits the budget of {:.0f} bytes (the smallest is {:.0f})", b.limit, b.min_total);
    }
    if (est_loss.size() != n || grid < 1) {
        fail("allocate_exact: {} loss rows for {} tensors (grid {})", est_loss.size(), n, grid);
    }
    // Costs in grid units above each tensor's cheapest type (or the shared grid's base), rounded up; the capacity
    // rounded down.
    const bool shared = b.grid_unit > 0 && b.grid_base.size() == n;
    const double span = b.max_total - b.min_total;
    const double unit = shared ? b.grid_unit : span > 0 ? span / static_cast<double>(grid) : 1.0;
    double base_total = b.min_total;
    if (shared) {
        base_total = b.fixed;
        for (double x : b.grid_base) {
            base_total += x;
        }
    }
    const int64_t cap = std::min<int64_t>(grid, static_cast<int64_t>(std::floor((b.limit - base_total) / unit)));
    if (cap < 0) {
        fail("no choice fits the budget of {:.0f} bytes on the shared grid", b.limit);
    }
    std::vector<std::vector<int64_t>> units(n);
    for (size_t t = 0; t < n; ++t) {
        if (b.cost[t].size() > 255 || est_loss[t].size() != b.cost[t].size()) {
            fail("allocate_exact: tensor {} has {} types and {} losses (at most 255)", t, b.cost[t].size(), est_loss[t].size());
        }
        const double lo = shared ? b.grid_base[t] : *std::min_element(b.cost[t].begin(), b.cost[t].end());
        for (double c : b.cost[t]) {
            units[t].push_back(static_cast<int64_t>(std::ceil((c - lo) / unit - 1e-9)));
        }
    }
    // best[u]: the least loss of the tensors so far within u units; pick[t][u]: tensor t's type there.
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<double> best(static_cast<size_t>(cap + 1), 0.0), next(best.size());
    std::vector<std::vector<uint8_t>> pick(n, std::vector<uint8_t>(best.size()));
    for (size_t t = 0; t < n; ++t) {
        std::fill(next.begin(), next.end(), inf);
        for (size_t k = 0; k < units[t].size(); ++k) {
            const int64_t c = units[t][k];
            const double loss = est_loss[t][k];
            for (int64_t u = c; u <= cap; ++u) {
                const double v = best[static_cast<size_t>(u - c)] + loss;
                // Strictly better, or as good and cheaper in bytes.
                const size_t cur = pick[t][static_cast<size_t>(u)];
                if (v < next[static_cast<size_t>(u)] ||
                    (v == next[static_cast<size_t>(u)] && b.cost[t][k] < b.cost[t][cur])) {
                    next[static_cast<size_t>(u)] = v;
                    pick[t][static_cast<size_t>(u)] = static_cast<uint8_t>(k);
                }
            }
        }
        best.swap(next);
    }
    std::vector<int> choice(n);
    int64_t u = cap;
    for (size_t t = n; t-- > 0;) {
        const int k = pick[t][static_cast<size_t>(u)];
        choice[t] = k;
        u -= units[t][static_cast<size_t>(k)];
    }
    return choice;
}

void share_grid(budget & pruned, const budget & full, int64_t grid) {
    const double span = full.max_total - full.min_total;
    pruned.grid_unit = span > 0 ? span / static_cast<double>(grid) : 1.0;
    pruned.grid_base.clear();
    for (const std::vector<double> & c : full.cost) {
        pruned.grid_base.push_back(*std::min_element(c.begin(), c.end()));
    }
}

double estimated_loss(const std::vector<std::vector<double>> & est_loss, const std::vector<int> & choice) {
    double sum = 0;
    for (size_t t = 0; t < choice.size(); ++t) {
        sum += est_loss[t][static_cast<size_t>(choice[t])];
    }
    return sum;
}

recipe recipe_from_choice(const gguf_file & file, const std::vector<tensor_menu> & menus,
                          const std::vector<int> & choice, const std::vector<std::vector<double>> & probs,
                          const target & goal) {
    recipe r = recipe_from_model(file);
    r.target = goal.str();
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < menus.size(); ++i) {
        index[menus[i].tensor->name] = i;
    }
    for (recipe_tensor & rt : r.tensors) {
        const auto it = index.find(rt.name);
        if (it == index.end()) {
            continue;
        }
        const tensor_menu & m = menus[it->second];
        rt.type = m.types[static_cast<size_t>(choice[it->second])];
        rt.bytes = tensor_bytes(rt.type, rt.shape, rt.name);
        if (!probs.empty()) {
            for (size_t k = 0; k < m.types.size(); ++k) {
                rt.probs[type_name(m.types[k])] = probs[it->second][k];
            }
        }
    }
    return r;
}

}  // namespace voodoo
