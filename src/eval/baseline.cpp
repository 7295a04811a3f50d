#include "eval/baseline.h"

#include "common/error.h"
#include "common/file.h"
#include "common/progress.h"
#include "common/units.h"
#include "ggml/gguf.h"
#include "ggml/log.h"
#include "ggml/quant.h"
#include "ggml/runtime.h"
#include "ggml/types.h"
#include "imatrix/imatrix.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>

namespace voodoo {

const std::vector<stock_recipe> & recipe_table() {
    // Names and ftypes of llama-quantize's QUANT_OPTIONS; main types of llama_ftype_get_default_type.
    static const std::vector<stock_recipe> table = {
        {"Q4_0", LLAMA_FTYPE_MOSTLY_Q4_0, GGML_TYPE_Q4_0, true},
        {"Q4_1", LLAMA_FTYPE_MOSTLY_Q4_1, GGML_TYPE_Q4_1, true},
        {"Q5_0", LLAMA_FTYPE_MOSTLY_Q5_0, GGML_TYPE_Q5_0, true},
        {"Q5_1", LLAMA_FTYPE_MOSTLY_Q5_1, GGML_TYPE_Q5_1, true},
        {"Q8_0", LLAMA_FTYPE_MOSTLY_Q8_0, GGML_TYPE_Q8_0, true},
        {"Q2_K", LLAMA_FTYPE_MOSTLY_Q2_K, GGML_TYPE_Q2_K, true},
        {"Q2_K_S", LLAMA_FTYPE_MOSTLY_Q2_K_S, GGML_TYPE_Q2_K, true},
        {"Q3_K_S", LLAMA_FTYPE_MOSTLY_Q3_K_S, GGML_TYPE_Q3_K, true},
        {"Q3_K_M", LLAMA_FTYPE_MOSTLY_Q3_K_M, GGML_TYPE_Q3_K, true},
        {"Q3_K_L", LLAMA_FTYPE_MOSTLY_Q3_K_L, GGML_TYPE_Q3_K, true},
        {"Q4_K_S", LLAMA_FTYPE_MOSTLY_Q4_K_S, GGML_TYPE_Q4_K, true},
        {"Q4_K_M", LLAMA_FTYPE_MOSTLY_Q4_K_M, GGML_TYPE_Q4_K, true},
        {"Q5_K_S", LLAMA_FTYPE_MOSTLY_Q5_K_S, GGML_TYPE_Q5_K, true},
        {"Q5_K_M", LLAMA_FTYPE_MOSTLY_Q5_K_M, GGML_TYPE_Q5_K, true},
        {"Q6_K", LLAMA_FTYPE_MOSTLY_Q6_K, GGML_TYPE_Q6_K, true},
        {"IQ1_S", LLAMA_FTYPE_MOSTLY_IQ1_S, GGML_TYPE_IQ1_S, true},
        {"IQ1_M", LLAMA_FTYPE_MOSTLY_IQ1_M, GGML_TYPE_IQ1_M, true},
        {"IQ2_XXS", LLAMA_FTYPE_MOSTLY_IQ2_XXS, GGML_TYPE_IQ2_XXS, true},
        {"IQ2_XS", LLAMA_FTYPE_MOSTLY_IQ2_XS, GGML_TYPE_IQ2_XS, true},
        {"IQ2_S", LLAMA_FTYPE_MOSTLY_IQ2_S, GGML_TYPE_IQ2_XS, true},
        {"IQ2_M", LLAMA_FTYPE_MOSTLY_IQ2_M, GGML_TYPE_IQ2_S, true},
        {"IQ3_XXS", LLAMA_FTYPE_MOSTLY_IQ3_XXS, GGML_TYPE_IQ3_XXS, true},
        {"IQ3_XS", LLAMA_FTYPE_MOSTLY_IQ3_XS, GGML_TYPE_IQ3_S, true},
        {"IQ3_S", LLAMA_FTYPE_MOSTLY_IQ3_S, GGML_TYPE_IQ3_S, true},
        {"IQ3_M", LLAMA_FTYPE_MOSTLY_IQ3_M, GGML_TYPE_IQ3_S, true},
        {"IQ4_NL", LLAMA_FTYPE_MOSTLY_IQ4_NL, GGML_TYPE_IQ4_NL, true},
        {"IQ4_XS", LLAMA_FTYPE_MOSTLY_IQ4_XS, GGML_TYPE_IQ4_XS, true},
        {"F16", LLAMA_FTYPE_MOSTLY_F16, GGML_TYPE_F16, true},
        {"BF16", LLAMA_FTYPE_MOSTLY_BF16, GGML_TYPE_BF16, true},
        {"TQ1_0", LLAMA_FTYPE_MOSTLY_TQ1_0, GGML_TYPE_TQ1_0, false},
        {"TQ2_0", LLAMA_FTYPE_MOSTLY_TQ2_0, GGML_TYPE_TQ2_0, false},
        {"F32", LLAMA_FTYPE_ALL_F32, GGML_TYPE_F32, false},
        {"Q3_K", LLAMA_FTYPE_MOSTLY_Q3_K_M, GGML_TYPE_Q3_K, false},
        {"Q4_K", LLAMA_FTYPE_MOSTLY_Q4_K_M, GGML_TYPE_Q4_K, false},
        {"Q5_K", LLAMA_FTYPE_MOSTLY_Q5_K_M, GGML_TYPE_Q5_K, false},
    };
    return table;
}

const stock_recipe & recipe_by_name(std::string_view name) {
    for (const stock_recipe & r : recipe_table()) {
        if (r.name.size() == name.size() &&
            std::equal(name.begin(), name.end(), r.name.begin(),
                       [](char a, char b) { return std::toupper(static_cast<unsigned char>(a)) == b; })) {
            return r;
        }
    }
    std::string names;
    for (const stock_recipe & r : recipe_table()) {
        names += (names.empty() ? "" : ", ") + r.name;
    }
    fail("unknown recipe '{}': use one of {} (llama-quantize's names)", name, names);
}

bool recipe_needs_imatrix(const stock_recipe & r) {
    return r.ftype == LLAMA_FTYPE_MOSTLY_Q2_K_S || type_info_of(r.main_type).needs_imatrix;
}

namespace {

/// The imatrix in the form llama_model_quantize takes, kept alive with its strings.
struct imatrix_params {
    std::vector<std::string> names;
    std::vector<std::vector<float>> values;
    std::vector<llama_model_imatrix_data> entries;
    std::vector<llama_model_kv_override> kv;
};

void set_kv_str(llama_model_kv_override & o, const char * key, const std::string & value) {
    o.tag = LLAMA_KV_OVERRIDE_TYPE_STR;
    std::snprintf(o.key, sizeof o.key, "%s", key);
    std::snprintf(o.val_str, sizeof o.val_str, "%s", value.c_str());
}

void set_kv_int(llama_model_kv_override & o, const char * key, int64_t value) {
    o.tag = LLAMA_KV_OVERRIDE_TYPE_INT;
    std::snprintf(o.key, sizeof o.key, "%s", key);
    o.val_i64 = value;
}

/// As llama-quantize's main: per weight the column importance (load_imatrix's arithmetic), a null
/// terminator, and the quantize.imatrix.* metadata it records in the output.
std::unique_ptr<imatrix_params> load_imatrix_params(const std::string & path, const gguf_file & source) {
    const imatrix im = read_imatrix(path);
    require_imatrix_fits(im, source, "--imatrix " + path);
    auto p = std::make_unique<imatrix_params>();
    for (const auto & [name, entry] : im.entries) {
        p->names.push_back(name);
        p->values.push_back(imatrix_column_importance(im, name));
    }
    for (size_t i = 0; i < p->names.size(); ++i) {
        p->entries.push_back({p->names[i].c_str(), p->values[i].data(), p->values[i].size()});
    }
    p->entries.push_back({nullptr, nullptr, 0});
    llama_model_kv_override o{};
    set_kv_str(o, "quantize.imatrix.file", path);
    p->kv.push_back(o);
    if (!im.datasets.empty()) {
        set_kv_str(o, "quantize.imatrix.dataset", im.datasets[0]);
        p->kv.push_back(o);
    }
    set_kv_int(o, "quantize.imatrix.entries_count", static_cast<int64_t>(im.entries.size()));
    p->kv.push_back(o);
    if (im.chunk_count > 0) {
        set_kv_int(o, "quantize.imatrix.chunks_count", im.chunk_count);
        p->kv.push_back(o);
    }
    p->kv.emplace_back();
    p->kv.back().key[0] = 0;
    return p;
}

baseline_result quantize_one(const baseline_options & opt, const stock_recipe & r, const imatrix_params * im,
                             const std::string & out) {
    if (same_file(opt.source, out)) {
        fail("--out '{}' is the source file: write the baseline elsewhere", out);
    }
    llama_model_quantize_params qp = llama_model_quantize_default_params();
    qp.ftype = r.ftype;
    qp.nthread = resolve_threads(opt.n_threads);
    qp.allow_requantize = opt.allow_requantize;
    if (im) {
        qp.imatrix = im->entries.data();
        qp.kv_overrides = im->kv.data();
    }
    // llama_model_quantize opens the path it is given and truncates it: give it the temporary file of
    // an atomic_file, so the destination appears only complete (commit fsyncs and renames that inode).
    atomic_file file(out);
    {
        ggml_log_capture capture;
        const auto tables = hold_lattice_tables();  // it may build a lattice grid itself (ggml_quantize_init)
        if (llama_model_quantize(opt.source.c_str(), file.temp_path().c_str(), &qp) != 0) {
            std::string why = capture.text();
            // llama.cpp reports a full disk as an iostream error: say what the folder has left.
            const std::string dir = std::filesystem::absolute(out).parent_path().string();
            const int64_t free = free_disk_bytes(dir);
            const double need = estimate_stock_bytes(gguf_file(opt.source), r);
            const std::string disk = free >= 0 && static_cast<double>(free) < need
                ? fmt::format(" (the disk of '{}' has {} free, and a {} file of this model takes about {}: a full disk?)",
                              dir, bytes_text(static_cast<double>(free)), r.name, bytes_text(need))
                : "";
            fail("llama_model_quantize could not make {} from '{}'{}{}{}", r.name, opt.source, why.empty() ? "" : ": ",
                 why, disk);
        }
    }
    file.commit();
    return describe_baseline(r.name, out);
}

/// A bad source is our error, never an abort inside llama.cpp.
std::unique_ptr<gguf_file> open_source(const baseline_options & opt) {
    auto src = std::make_unique<gguf_file>(opt.source);
    if (src->tensors().empty()) {
        fail("'{}' has no tensors: give the full-precision model GGUF", opt.source);
    }
    if (!opt.allow_requantize) {
        for (const gguf_tensor & t : src->tensors()) {
            if (t.n_dims >= 2 && type_info_of(t.type).is_quantized) {
                fail("'{}' is already quantized ({} is {}): stock recipes are made from the full-precision model; give "
                     "that, or pass --allow-requantize (llama-quantize's flag) to requantize this file",
                     opt.source, t.name, type_name(t.type));
            }
        }
    }
    return src;
}

void check_imatrix_given(const stock_recipe & r, const baseline_options & opt) {
    if (recipe_needs_imatrix(r) && opt.imatrix.empty()) {
        fail("recipe {} needs an imatrix ({} tensors are quantized with one, as llama-quantize requires): pass "
             "--imatrix I.gguf",
             r.name, type_name(r.main_type));
    }
}

}  // namespace

baseline_result describe_baseline(const std::string & recipe_name, const std::string & out) {
    baseline_result res;
    res.recipe = recipe_name;
    res.path = out;
    const gguf_file made(out);
    res.file_bytes = made.file_size();
    for (const gguf_tensor & t : made.tensors()) {
        res.tensor_bytes += t.n_bytes;
        res.n_weights += t.n_elements();
        res.type_counts[type_name(t.type)] += 1;
        res.tensor_types.push_back(t.type);
    }
    res.bpw = res.n_weights > 0 ? 8.0 * static_cast<double>(res.tensor_bytes) / static_cast<double>(res.n_weights) : 0;
    res.ok = true;
    return res;
}

baseline_result make_baseline(const baseline_options & opt, const std::string & recipe_name, const std::string & out) {
    const stock_recipe & r = recipe_by_name(recipe_name);
    check_imatrix_given(r, opt);
    const auto src = open_source(opt);
    llama_runtime_init();
    const auto im = opt.imatrix.empty() ? nullptr : load_imatrix_params(opt.imatrix, *src);
    return quantize_one(opt, r, im.get(), out);
}

double estimate_stock_bytes(const gguf_file & src, const stock_recipe & r) {
    double total = static_cast<double>(src.file_size());
    const bool tied = std::none_of(src.tensors().begin(), src.tensors().end(),
                                   [](const gguf_tensor & t) { return t.name == "output.weight"; });
    for (const gguf_tensor & t : src.tensors()) {
        if (t.n_dims < 2) {
            continue;
        }
        // The output matrix (the embedding when the head is tied) is Q6_K in most recipes (llama-quant.cpp).
        const bool head = t.name == "output.weight" || (tied && t.name == "token_embd.weight");
        const ggml_type main = head && ggml_type_size(r.main_type) * 8.0 / ggml_blck_size(r.main_type) < 6.5625
                                   ? GGML_TYPE_Q6_K : r.main_type;
        for (ggml_type c : {main, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q8_0, GGML_TYPE_F16}) {
            if (t.ne[0] % ggml_blck_size(c) == 0) {
                total += static_cast<double>(tensor_bytes(c, t.shape(), t.name)) - static_cast<double>(t.n_bytes);
                break;
            }
        }
    }
    return total;
}

namespace {

/// llama_model_quantize's dry run of recipe r on opt.source, with im's imatrix and keys when given (llama.cpp's type
/// rules ask whether there is one): everything it logged at info level (its type per tensor, its "quant size" line),
/// and in `warnings` its warning and error lines (ggml_log_capture::text: "dry run completed successfully, but
/// actually completing this quantization will require an imatrix!" when a tensor's type needs one and im is null).
/// It opens no output file and quantizes nothing. Throws voodoo::error with llama.cpp's reason when it fails.
std::string dry_run_log(const baseline_options & opt, const stock_recipe & r, const imatrix_params * im,
                        std::string * warnings = nullptr) {
    llama_runtime_init();
    llama_model_quantize_params qp = llama_model_quantize_default_params();
    qp.ftype = r.ftype;
    qp.nthread = 1;
    qp.allow_requantize = opt.allow_requantize;
    qp.dry_run = true;
    if (im) {
        qp.imatrix = im->entries.data();
        qp.kv_overrides = im->kv.data();
    }
    ggml_log_capture capture;
    // The dry run opens no output file; the path is never made.
    const std::string never = opt.source + ".voodoo-dry-run-never-written.gguf";
    const auto tables = hold_lattice_tables();
    if (llama_model_quantize(opt.source.c_str(), never.c_str(), &qp) != 0) {
        fail("llama_model_quantize's dry run of {} on '{}' failed: {}", r.name, opt.source, capture.text());
    }
    if (warnings) {
        *warnings = capture.text();
    }
    return capture.info_text();
}

}  // namespace

double stock_tensor_bytes(const baseline_options & opt, const stock_recipe & r) {
    open_source(opt);  // its checks: a readable source, full precision unless allow_requantize
    const std::string text = dry_run_log(opt, r, nullptr);
    const size_t at = text.find("quant size");
    const size_t eq = at == std::string::npos ? std::string::npos : text.find('=', at);
    double mib = 0;
    if (eq == std::string::npos || std::sscanf(text.c_str() + eq + 1, "%lf", &mib) != 1) {
        fail("llama_model_quantize's dry run of {} on '{}' printed no size (\"quant size = … MiB\")", r.name, opt.source);
    }
    return mib * 1024.0 * 1024.0;
}

namespace {

/// Every tensor's type in llama_model_quantize's dry run of r (its info log, dry_run_log): GGML_TYPE_COUNT for a
/// tensor it keeps at the source's type. `warnings` as dry_run_log's. Throws voodoo::error when a line names no type.
std::map<std::string, ggml_type> dry_run_types(const baseline_options & opt, const stock_recipe & r,
                                               const imatrix_params * im, std::string * warnings = nullptr) {
    const std::string text = dry_run_log(opt, r, im, warnings);
    // Its line per tensor: "[  12/ 201]  blk.0.attn_q.weight  - [ 2048,  2048,  1,  1], type =   bf16, size =  8.000
    // MiB ->  2.250 MiB (q4_K)", or without " -> " for a tensor it keeps as it is.
    std::map<std::string, ggml_type> types;
    for (size_t a = 0; a < text.size();) {
        const size_t e = std::min(text.find('\n', a), text.size());
        const std::string_view line(text.data() + a, e - a);
        a = e + 1;
        const size_t open = line.find_first_not_of(' ');
        const size_t close = line.find("] ");
        if (open == std::string_view::npos || line[open] != '[' || close == std::string_view::npos) {
            continue;
        }
        const size_t name_at = line.find_first_not_of(' ', close + 2);
        const size_t name_end = line.find(" - [", name_at);
        if (name_at == std::string_view::npos || name_end == std::string_view::npos) {
            continue;
        }
        std::string name(line.substr(name_at, name_end - name_at));
        name.erase(name.find_last_not_of(' ') + 1);  // printed left-aligned in a 36-wide field
        const size_t arrow = line.find(" -> ", name_end);
        if (arrow == std::string_view::npos) {
            types[name] = GGML_TYPE_COUNT;  // kept at the source's type
            continue;
        }
        const size_t lp = line.rfind('('), rp = line.rfind(')');
        const auto type = lp != std::string_view::npos && rp != std::string_view::npos && rp > lp
                              ? type_from_name(line.substr(lp + 1, rp - lp - 1)) : std::nullopt;
        if (!type) {
            fail("llama_model_quantize's dry run of {} on '{}': no type in its line for {} (\"{}\")", r.name, opt.source,
                 name, line);
        }
        types[name] = *type;
    }
    return types;
}

}  // namespace

stock_plan plan_stock_file(const baseline_options & opt, const std::string & recipe_name) {
    const stock_recipe & r = recipe_by_name(recipe_name);
    check_imatrix_given(r, opt);
    const auto src = open_source(opt);
    llama_runtime_init();
    const auto im = opt.imatrix.empty() ? nullptr : load_imatrix_params(opt.imatrix, *src);
    stock_plan plan;
    plan.types = dry_run_types(opt, r, im.get());  // the real run's inputs, the imatrix included

    // The header as llama-quant.cpp makes it, laid out by ggml's gguf API.
    gguf_context * ctx = gguf_init_empty();
    gguf_set_kv(ctx, src->ctx());
    gguf_set_val_u32(ctx, "general.quantization_version", GGML_QNT_VERSION);
    gguf_set_val_u32(ctx, "general.file_type", static_cast<uint32_t>(r.ftype));
    for (const char * key : {"split.no", "split.count", "split.tensors.count"}) {
        gguf_remove_key(ctx, key);
    }
    for (const llama_model_kv_override * o = im ? im->kv.data() : nullptr; o && o->key[0] != 0; ++o) {
        switch (o->tag) {
            case LLAMA_KV_OVERRIDE_TYPE_FLOAT: gguf_set_val_f32(ctx, o->key, static_cast<float>(o->val_f64)); break;
            case LLAMA_KV_OVERRIDE_TYPE_INT: gguf_set_val_u32(ctx, o->key, static_cast<uint32_t>(std::abs(o->val_i64))); break;
            case LLAMA_KV_OVERRIDE_TYPE_BOOL: gguf_set_val_bool(ctx, o->key, o->val_bool); break;
            case LLAMA_KV_OVERRIDE_TYPE_STR: gguf_set_val_str(ctx, o->key, o->val_str); break;
        }
    }
    ggml_context * meta = ggml_init(ggml_init_params{ggml_tensor_overhead() * (src->tensors().size() + 1), nullptr, true});
    size_t data = 0;
    for (const gguf_tensor & t : src->tensors()) {
        const auto it = plan.types.find(t.name);
        if (it == plan.types.end()) {
            ggml_free(meta);
            gguf_free(ctx);
            fail("llama_model_quantize's dry run of {} on '{}' printed no type for tensor {}", r.name, opt.source, t.name);
        }
        if (it->second == GGML_TYPE_COUNT) {
            it->second = t.type;
        }
        const size_t bytes = it->second == t.type ? t.n_bytes : tensor_bytes(it->second, t.shape(), t.name);
        ggml_tensor * g = ggml_new_tensor(meta, it->second, t.n_dims, t.ne.data());
        ggml_set_name(g, t.name.c_str());
        gguf_add_tensor(ctx, g);
        plan.tensor_bytes += bytes;
        data += GGML_PAD(bytes, GGUF_DEFAULT_ALIGNMENT);  // llama-quant.cpp pads each tensor to this alignment
    }
    plan.file_bytes = gguf_get_meta_size(ctx) + data;  // the meta size includes its padding
    ggml_free(meta);
    gguf_free(ctx);
    for (auto it = plan.types.begin(); it != plan.types.end();) {  // only the source's tensors
        it = src->find_tensor(it->first) ? std::next(it) : plan.types.erase(it);
    }
    return plan;
}

std::vector<std::string> nearest_stock_recipes(const baseline_options & opt, const std::vector<std::string> & names,
                                               const std::vector<size_t> & our_sizes, size_t n) {
    if (names.size() <= n + 2) {
        return names;
    }
    const gguf_file src(opt.source);
    double outside = static_cast<double>(src.file_size());
    for (const gguf_tensor & t : src.tensors()) {
        outside -= static_cast<double>(t.n_bytes);
    }
    std::vector<double> est;
    for (const std::string & name : names) {
        est.push_back(stock_tensor_bytes(opt, recipe_by_name(name)) + outside);
    }
    std::vector<bool> keep(names.size(), false);
    for (size_t ours : our_sizes) {
        std::vector<size_t> by(names.size());
        std::iota(by.begin(), by.end(), size_t{0});
        std::stable_sort(by.begin(), by.end(), [&](size_t a, size_t b) {
            return std::abs(est[a] - static_cast<double>(ours)) < std::abs(est[b] - static_cast<double>(ours));
        });
        // The n + 2 nearest, and any as near as the last of them (recipes tie where llama.cpp falls back to one type).
        const double reach = std::abs(est[by[n + 1]] - static_cast<double>(ours));
        for (size_t i : by) {
            keep[i] = keep[i] || std::abs(est[i] - static_cast<double>(ours)) <= reach;
        }
    }
    std::vector<std::string> out;
    for (size_t i = 0; i < names.size(); ++i) {
        if (keep[i]) {
            out.push_back(names[i]);
        }
    }
    return out;
}

std::vector<std::string> distinct_stock_recipes(const baseline_options & opt, const std::vector<std::string> & names,
                                                bool imatrix_to_come) {
    const auto src = open_source(opt);
    llama_runtime_init();
    const auto im = opt.imatrix.empty() ? nullptr : load_imatrix_params(opt.imatrix, *src);
    std::vector<std::string> out;
    std::vector<std::map<std::string, ggml_type>> seen;
    for (const std::string & name : names) {
        std::string warnings;
        auto types = dry_run_types(opt, recipe_by_name(name), im.get(), &warnings);
        if (!im && !imatrix_to_come && warnings.find("will require an imatrix") != std::string::npos) {
            continue;  // llama_model_quantize refuses it without one (make_baselines: not made)
        }
        if (std::find(seen.begin(), seen.end(), types) == seen.end()) {
            seen.push_back(std::move(types));
            out.push_back(name);
        }
    }
    return out;
}

std::vector<std::string> recipes_all_that_fit(bool has_imatrix) {
    std::vector<std::string> out;
    for (const stock_recipe & r : recipe_table()) {
        if (r.standard && (has_imatrix || !recipe_needs_imatrix(r))) {
            out.push_back(r.name);
        }
    }
    return out;
}

std::vector<baseline_result> make_baselines(const baseline_options & opt, const std::vector<std::string> & recipes,
                                            const std::string & out_dir) {
    std::vector<const stock_recipe *> rs;
    for (const std::string & name : recipes) {
        rs.push_back(&recipe_by_name(name));
        check_imatrix_given(*rs.back(), opt);
    }
    const auto src = open_source(opt);
    std::filesystem::create_directories(out_dir);
    llama_runtime_init();
    const auto im = opt.imatrix.empty() ? nullptr : load_imatrix_params(opt.imatrix, *src);
    const std::string stem = std::filesystem::path(opt.source).stem().string();

    std::vector<baseline_result> results;
    progress bar("baseline", static_cast<int64_t>(rs.size()), "files");
    for (const stock_recipe * r : rs) {
        const std::string out = (std::filesystem::path(out_dir) / (stem + "-" + r->name + ".gguf")).string();
        baseline_result res;
        const bool reused = opt.reuse_existing && std::filesystem::exists(out);
        try {
            res = reused ? describe_baseline(r->name, out) : quantize_one(opt, *r, im.get(), out);
        } catch (const error & e) {
            res.recipe = r->name;
            res.path = out;
            res.error = e.what();
        }
        for (const baseline_result & earlier : results) {
            if (res.ok && earlier.ok && earlier.tensor_types == res.tensor_types) {
                res.same_types_as = earlier.recipe;
                break;
            }
        }
        results.push_back(std::move(res));
        bar.add(1, reused ? r->name + " (already made)" : r->name);
    }
    return results;
}

std::string baselines_to_markdown(const std::vector<baseline_result> & results) {
    std::string out = "| recipe | file | bytes | MiB | BPW | tensor types |\n|---|---|---:|---:|---:|---|\n";
    for (const baseline_result & r : results) {
        if (!r.ok) {
            out += fmt::format("| {} | not made | | | | {} |\n", r.recipe, r.error);
            continue;
        }
        std::string types;
        for (const auto & [name, n] : r.type_counts) {
            types += fmt::format("{}{} {}", types.empty() ? "" : ", ", name, n);
        }
        if (!r.same_types_as.empty()) {
            types += fmt::format(" (same types as {})", r.same_types_as);
        }
        out += fmt::format("| {} | {} | {} | {:.3f} | {:.3f} | {} |\n", r.recipe,
                           std::filesystem::path(r.path).filename().string(), r.file_bytes,
                           static_cast<double>(r.file_bytes) / (1024.0 * 1024.0), r.bpw, types);
    }
    return out;
}

}  // namespace voodoo
