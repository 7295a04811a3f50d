#include "eval/imatrix_file.h"

#include "common/error.h"
#include "ggml/gguf.h"
#include "ggml/types.h"

#include <cmath>
#include <cstring>
#include <fstream>

namespace voodoo {

namespace {

bool remove_suffix(std::string & s, const std::string & suffix) {
    if (s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) {
        s.resize(s.size() - suffix.size());
        return true;
    }
    return false;
}

std::vector<float> f32_values(const gguf_file & f, const gguf_tensor & t) {
    if (t.type != GGML_TYPE_F32) {
        fail("imatrix '{}': tensor '{}' is {}, expected f32", f.path(), t.name, type_name(t.type));
    }
    const auto bytes = f.data(t);
    std::vector<float> v(static_cast<size_t>(t.n_elements()));
    std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
    return v;
}

}  // namespace

quantize_imatrix read_quantize_imatrix(const std::string & path) {
    {
        std::ifstream in(path, std::ios::binary);
        char magic[4] = {};
        if (in && in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) != 0) {
            fail("imatrix '{}' is not a GGUF imatrix; a legacy .dat is not read here: convert it with "
                 "`llama-imatrix --in-file {} -o imatrix.gguf`", path, path);
        }
    }
    const gguf_file f(path);
    quantize_imatrix out;
    out.path = path;
    if (const int64_t key = f.find_key("imatrix.datasets");
        key >= 0 && gguf_get_kv_type(f.ctx(), key) == GGUF_TYPE_ARRAY &&
        gguf_get_arr_type(f.ctx(), key) == GGUF_TYPE_STRING) {
        for (size_t i = 0; i < gguf_get_arr_n(f.ctx(), key); ++i) {
            out.datasets.emplace_back(gguf_get_arr_str(f.ctx(), key, i));
        }
    }
    out.chunk_count = f.get_int("imatrix.chunk_count").value_or(0);

    std::map<std::string, std::pair<const gguf_tensor *, const gguf_tensor *>> entries;
    for (const gguf_tensor & t : f.tensors()) {
        std::string name = t.name;
        if (remove_suffix(name, ".in_sum2")) {
            entries[name].first = &t;
        } else if (remove_suffix(name, ".counts")) {
            entries[name].second = &t;
        }
    }
    for (const auto & [name, sc] : entries) {
        if (!sc.first || !sc.second) {
            fail("imatrix '{}': '{}' has {} but not {}", path, name, sc.first ? "in_sum2" : "counts",
                 sc.first ? "counts" : "in_sum2");
        }
        const std::vector<float> sums = f32_values(f, *sc.first);
        const std::vector<float> counts = f32_values(f, *sc.second);
        if (counts.empty() || sums.size() % counts.size() != 0) {
            fail("imatrix '{}': '{}' has {} sums and {} counts; the counts must divide the sums", path, name,
                 sums.size(), counts.size());
        }
        const size_t ne0 = sums.size() / counts.size();
        std::vector<float> e(sums.size());
        for (size_t j = 0; j < counts.size(); ++j) {
            const float count = static_cast<float>(std::lround(counts[j]));
            for (size_t i = 0; i < ne0; ++i) {
                e[j * ne0 + i] = count > 0.0f ? sums[j * ne0 + i] / count : 1.0f;
                if (!std::isfinite(e[j * ne0 + i])) {
                    fail("imatrix '{}': '{}' has a non-finite value at {}", path, name, j * ne0 + i);
                }
            }
        }
        out.data.emplace(name, std::move(e));
    }
    if (out.data.empty()) {
        fail("imatrix '{}' has no <tensor>.in_sum2 / <tensor>.counts entries", path);
    }
    return out;
}

}  // namespace voodoo
