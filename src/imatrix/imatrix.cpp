#include "imatrix/imatrix.h"

#include "common/error.h"
#include "ggml/types.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace voodoo {

namespace {

constexpr const char * k_datasets = "imatrix.datasets";
constexpr const char * k_chunk_count = "imatrix.chunk_count";
constexpr const char * k_chunk_size = "imatrix.chunk_size";

void require_consistent(const std::string & path, const std::string & name, const imatrix_entry & e) {
    if (e.counts.empty() || e.in_sum2.empty() || e.in_sum2.size() % e.counts.size() != 0) {
        fail("'{}': entry '{}' has {} sums for {} counts; they must be a whole number of columns per matrix", path, name,
             e.in_sum2.size(), e.counts.size());
    }
    for (size_t i = 0; i < e.in_sum2.size(); ++i) {
        if (!std::isfinite(e.in_sum2[i])) {
            fail("'{}': entry '{}' holds a non-finite sum ({}) at column {}; llama-quantize refuses it, collect the "
                 "imatrix again",
                 path, name, e.in_sum2[i], i);
        }
    }
}

std::vector<float> read_f32(const gguf_file & f, const gguf_tensor & t) {
    if (t.type != GGML_TYPE_F32) {
        fail("'{}': imatrix tensor '{}' is {}, it must be f32", f.path(), t.name, type_name(t.type));
    }
    std::vector<float> v(static_cast<size_t>(t.n_elements()));
    std::memcpy(v.data(), f.data(t).data(), v.size() * sizeof(float));
    return v;
}

imatrix read_gguf(const std::string & path) {
    const gguf_file f(path);
    imatrix im;
    if (f.find_key(k_datasets) < 0 || f.find_key(k_chunk_count) < 0 || f.find_key(k_chunk_size) < 0) {
        fail("'{}' lacks the imatrix metadata ({}, {}, {}); llama-quantize refuses it too: collect it with a current "
             "llama-imatrix or `voodoo imatrix`",
             path, k_datasets, k_chunk_count, k_chunk_size);
    }
    const nlohmann::json ds = f.kv_json(f.find_key(k_datasets));
    if (ds.is_array()) {
        for (const auto & d : ds) {
            if (d.is_string()) {
                im.datasets.push_back(d.get<std::string>());
            }
        }
    }
    im.chunk_count = f.get_int(k_chunk_count).value();
    im.chunk_size = f.get_int(k_chunk_size).value();
    std::map<std::string, std::pair<const gguf_tensor *, const gguf_tensor *>> pairs;
    for (const gguf_tensor & t : f.tensors()) {
        const std::string & n = t.name;
        if (n.ends_with(".in_sum2")) {
            pairs[n.substr(0, n.size() - 8)].first = &t;
        } else if (n.ends_with(".counts")) {
            pairs[n.substr(0, n.size() - 7)].second = &t;
        }
    }
    if (pairs.empty()) {
        fail("'{}' holds no imatrix entries (no '<tensor>.in_sum2' tensors)", path);
    }
    for (const auto & [name, p] : pairs) {
        if (!p.first || !p.second) {
            fail("'{}': '{}' has {} but not {}; the file is incomplete", path, name, p.first ? "in_sum2" : "counts",
                 p.first ? "counts" : "in_sum2");
        }
        imatrix_entry e;
        e.in_sum2 = read_f32(f, *p.first);
        for (float c : read_f32(f, *p.second)) {
            e.counts.push_back(std::lround(c));  // stored as f32, read back with lround as llama.cpp does
        }
        require_consistent(path, name, e);
        im.entries.emplace(name, std::move(e));
    }
    return im;
}

// Legacy layout (tools/imatrix/imatrix.cpp save_imatrix_legacy), little-endian:
//   i32 n_entries; n_entries × { i32 len; char name[len]; i32 ncall; i32 nval; f32 values[nval] };
//   optionally: i32 chunk_count; i32 len; char dataset[len].
imatrix read_dat(const std::string & path) {
    const mapped_file map(path);
    const auto bytes = map.bytes();
    size_t pos = 0;
    auto need = [&](size_t n, const char * what) {
        if (bytes.size() - pos < n) {
            fail("'{}' is neither a GGUF nor a complete legacy imatrix (.dat): it ends at byte {} while reading {}", path,
                 bytes.size(), what);
        }
    };
    auto i32 = [&](const char * what) {
        need(4, what);
        int32_t v;
        std::memcpy(&v, bytes.data() + pos, 4);
        pos += 4;
        return v;
    };
    imatrix im;
    im.legacy = true;
    const int32_t n_entries = i32("the entry count");
    if (n_entries < 1 || n_entries > 1 << 20) {
        fail("'{}' is neither a GGUF nor a legacy imatrix (.dat): it starts with {} as the entry count", path,
             n_entries);
    }
    for (int32_t i = 0; i < n_entries; ++i) {
        const int32_t len = i32("a name length");
        if (len < 1 || len > 4096) {
            fail("'{}': legacy entry {} has a name of {} bytes; the file is corrupt", path, i, len);
        }
        need(static_cast<size_t>(len), "a name");
        std::string name(reinterpret_cast<const char *>(bytes.data() + pos), static_cast<size_t>(len));
        pos += static_cast<size_t>(len);
        const int32_t ncall = i32("ncall");
        const int32_t nval = i32("nval");
        if (nval < 1) {
            fail("'{}': legacy entry '{}' has {} values; the file is corrupt", path, name, nval);
        }
        need(static_cast<size_t>(nval) * 4, "values");
        imatrix_entry e;
        e.in_sum2.resize(static_cast<size_t>(nval));
        std::memcpy(e.in_sum2.data(), bytes.data() + pos, e.in_sum2.size() * 4);
        pos += e.in_sum2.size() * 4;
        e.counts = {ncall};
        require_consistent(path, name, e);
        im.entries[name] = std::move(e);
    }
    if (bytes.size() - pos >= 4) {
        im.chunk_count = i32("the chunk count");
        if (bytes.size() - pos >= 4) {
            const int32_t len = i32("the dataset name length");
            if (len > 0 && bytes.size() - pos >= static_cast<size_t>(len)) {
                im.datasets.emplace_back(reinterpret_cast<const char *>(bytes.data() + pos), static_cast<size_t>(len));
            }
        }
    }
    return im;
}

}  // namespace

void write_imatrix_gguf(const std::string & path, const imatrix & im) {
    if (im.legacy) {
        fail("'{}': a legacy (.dat) imatrix holds normalised sums, not the raw ones the GGUF format stores; use the "
             ".dat as it is",
             path);
    }
    for (const auto & [name, e] : im.entries) {
        require_consistent(path, name, e);
    }
    gguf_writer w(path);
    gguf_set_val_str(w.ctx(), "general.type", "imatrix");
    std::vector<const char *> ds;
    for (const std::string & d : im.datasets) {
        ds.push_back(d.c_str());
    }
    gguf_set_arr_str(w.ctx(), k_datasets, ds.data(), ds.size());
    gguf_set_val_u32(w.ctx(), k_chunk_count, static_cast<uint32_t>(im.chunk_count));
    gguf_set_val_u32(w.ctx(), k_chunk_size, static_cast<uint32_t>(im.chunk_size));
    for (const auto & [name, e] : im.entries) {  // std::map: name order, as llama-imatrix sorts
        const int64_t sums_ne[2] = {e.ne0(), e.n_mat()};
        const int64_t counts_ne[2] = {1, e.n_mat()};
        w.add_tensor(name + ".in_sum2", GGML_TYPE_F32, sums_ne);
        w.add_tensor(name + ".counts", GGML_TYPE_F32, counts_ne);
    }
    w.begin_data();
    for (const auto & [name, e] : im.entries) {
        w.write_tensor(name + ".in_sum2", {reinterpret_cast<const uint8_t *>(e.in_sum2.data()), e.in_sum2.size() * 4});
        std::vector<float> counts(e.counts.begin(), e.counts.end());
        w.write_tensor(name + ".counts", {reinterpret_cast<const uint8_t *>(counts.data()), counts.size() * 4});
    }
    w.commit();
}

imatrix read_imatrix(const std::string & path) {
    const mapped_file map(path);
    if (map.size() >= 4 && std::memcmp(map.bytes().data(), "GGUF", 4) == 0) {
        return read_gguf(path);
    }
    return read_dat(path);
}

std::vector<float> imatrix_column_importance(const imatrix & im, const std::string & name) {
    const auto it = im.entries.find(name);
    if (it == im.entries.end()) {
        fail("the imatrix has no entry for '{}'", name);
    }
    const imatrix_entry & e = it->second;
    std::vector<float> out(e.in_sum2.size());
    if (im.legacy) {
        const int64_t ncall = e.counts.empty() ? 0 : e.counts[0];
        for (size_t i = 0; i < out.size(); ++i) {
            out[i] = ncall > 0 ? e.in_sum2[i] / ncall : e.in_sum2[i];
        }
        return out;
    }
    const int64_t ne0 = e.ne0();
    for (int64_t j = 0; j < e.n_mat(); ++j) {
        const auto count = static_cast<float>(e.counts[static_cast<size_t>(j)]);
        for (int64_t i = 0; i < ne0; ++i) {
            out[static_cast<size_t>(j * ne0 + i)] = count > 0.0f ? e.in_sum2[static_cast<size_t>(j * ne0 + i)] / count
                                                                 : 1.0f;
        }
    }
    return out;
}

void require_imatrix_fits(const imatrix & im, const gguf_file & model, const std::string & what) {
    for (const auto & [name, e] : im.entries) {
        const gguf_tensor * t = model.find_tensor(name);
        if (!t) {
            fail("imatrix '{}' has an entry for '{}', which '{}' does not have; the imatrix was made for another model",
                 what, name, model.path());
        }
        const int64_t n_mat = t->ne[2] * t->ne[3];
        // A legacy entry has one ncall for all its matrices, so only its total size can be checked.
        const bool fits = static_cast<int64_t>(e.in_sum2.size()) == t->ne[0] * n_mat &&
                          (im.legacy || (e.ne0() == t->ne[0] && e.n_mat() == n_mat));
        if (!fits) {
            fail("imatrix '{}': entry '{}' holds {} values ({} per matrix) but '{}' has it as {}, which needs {} "
                 "({} columns × {} matrices); the imatrix was made for another model",
                 what, name, e.in_sum2.size(), e.ne0(), model.path(), shape_str(t->shape()), t->ne[0] * n_mat,
                 t->ne[0], n_mat);
        }
    }
}

importance_map imatrix_importance(const imatrix & im) {
    importance_map out;
    for (const auto & [name, entry] : im.entries) {
        out[name] = imatrix_column_importance(im, name);
    }
    return out;
}

std::vector<expert_coverage> imatrix_expert_coverage(const imatrix & im) {
    std::vector<expert_coverage> out;
    if (im.legacy) {
        return out;
    }
    for (const auto & [name, e] : im.entries) {
        if (e.n_mat() <= 1) {
            continue;
        }
        expert_coverage c;
        c.name = name;
        c.n_experts = e.n_mat();
        c.tokens = e.counts;
        for (int64_t x = 0; x < e.n_mat(); ++x) {
            const int64_t n = e.counts[static_cast<size_t>(x)];
            if (n > 0) {
                c.min_tokens = c.n_reached == 0 ? n : std::min(c.min_tokens, n);
                c.max_tokens = std::max(c.max_tokens, n);
                ++c.n_reached;
            } else {
                c.unreached.push_back(x);
            }
        }
        out.push_back(std::move(c));
    }
    return out;
}

nlohmann::json expert_coverage_json(const std::vector<expert_coverage> & coverage) {
    nlohmann::json out = nlohmann::json::array();
    for (const expert_coverage & c : coverage) {
        out.push_back({{"name", c.name}, {"n_experts", c.n_experts}, {"n_reached", c.n_reached},
                       {"min_tokens", c.min_tokens}, {"max_tokens", c.max_tokens}, {"unreached", c.unreached},
                       {"tokens", c.tokens}});
    }
    return out;
}

std::string expert_coverage_text(const std::vector<expert_coverage> & coverage) {
    // One line per layer, from the first expert tensor of that layer ("blk.<il>." prefix), in layer order.
    std::map<int64_t, const expert_coverage *> by_layer;
    for (const expert_coverage & c : coverage) {
        int64_t il = -1;
        if (std::sscanf(c.name.c_str(), "blk.%" SCNd64 ".", &il) == 1 && !by_layer.count(il)) {
            by_layer[il] = &c;
        }
    }
    std::string text;
    for (const auto & [il, c] : by_layer) {
        text += fmt::format("blk.{}: {} of {} experts reached", il, c->n_reached, c->n_experts);
        if (c->n_reached > 0) {
            text += fmt::format(" ({}–{} tokens each)", c->min_tokens, c->max_tokens);
        }
        if (!c->unreached.empty()) {
            text += fmt::format("; never: {}", fmt::join(c->unreached, ", "));
        }
        text += "\n";
    }
    return text;
}

}  // namespace voodoo
