#include "ggml/types.h"

#include "common/error.h"

#include <algorithm>
#include <cctype>

namespace voodoo {

namespace {

// The storage types: exactly the cases of ggml_quantize_chunk's switch (ggml/src/ggml.c).
constexpr ggml_type k_storage_types[] = {
    GGML_TYPE_F32,     GGML_TYPE_F16,    GGML_TYPE_Q4_0,   GGML_TYPE_Q4_1,   GGML_TYPE_Q5_0,   GGML_TYPE_Q5_1,
    GGML_TYPE_Q8_0,    GGML_TYPE_Q2_K,   GGML_TYPE_Q3_K,   GGML_TYPE_Q4_K,   GGML_TYPE_Q5_K,   GGML_TYPE_Q6_K,
    GGML_TYPE_IQ2_XXS, GGML_TYPE_IQ2_XS, GGML_TYPE_IQ3_XXS, GGML_TYPE_IQ1_S, GGML_TYPE_IQ4_NL, GGML_TYPE_IQ3_S,
    GGML_TYPE_IQ2_S,   GGML_TYPE_IQ4_XS, GGML_TYPE_IQ1_M,  GGML_TYPE_BF16,   GGML_TYPE_TQ1_0,  GGML_TYPE_TQ2_0,
    GGML_TYPE_MXFP4,   GGML_TYPE_NVFP4,  GGML_TYPE_Q1_0,   GGML_TYPE_Q2_0,
};

// llama-quant.cpp tensor_requires_imatrix: these types are refused without an imatrix
// (token_embd and output excepted there; Voodoo keeps the stricter rule for every tensor).
bool llama_needs_imatrix(ggml_type t) {
    switch (t) {
        case GGML_TYPE_IQ3_XXS:
        case GGML_TYPE_IQ2_XXS:
        case GGML_TYPE_IQ2_XS:
        case GGML_TYPE_IQ2_S:
        case GGML_TYPE_IQ1_M:
        case GGML_TYPE_IQ1_S: return true;
        default: return false;
    }
}

std::vector<type_info> build_table() {
    std::vector<type_info> table;
    for (ggml_type t : k_storage_types) {
        const ggml_type_traits * tr = ggml_get_type_traits(t);
        type_info info;
        info.type = t;
        info.name = tr->type_name;
        info.blck_size = tr->blck_size;
        info.type_size = tr->type_size;
        info.bpw = 8.0 * static_cast<double>(tr->type_size) / static_cast<double>(tr->blck_size);
        info.is_quantized = tr->is_quantized;
        info.requires_imatrix = ggml_quantize_requires_imatrix(t);
        info.needs_imatrix = info.requires_imatrix || llama_needs_imatrix(t);
        table.push_back(std::move(info));
    }
    std::sort(table.begin(), table.end(), [](const type_info & a, const type_info & b) { return a.type < b.type; });
    return table;
}

std::string lower(std::string_view s) {
    std::string out(s);
    std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
    return out;
}

}  // namespace

const std::vector<type_info> & type_table() {
    static const std::vector<type_info> table = build_table();
    return table;
}

const type_info & type_info_of(ggml_type type) {
    for (const type_info & info : type_table()) {
        if (info.type == type) {
            return info;
        }
    }
    fail("ggml type {} is not a storage type (ggml_quantize_chunk cannot produce it)", type_name(type));
}

std::string type_name(ggml_type type) {
    if (type >= 0 && type < GGML_TYPE_COUNT) {
        const ggml_type_traits * tr = ggml_get_type_traits(type);
        if (tr && tr->type_name && tr->blck_size > 0) {
            return tr->type_name;
        }
    }
    return fmt::format("type({})", static_cast<int>(type));
}

std::optional<ggml_type> type_from_name(std::string_view name) {
    const std::string want = lower(name);
    for (const type_info & info : type_table()) {
        if (lower(info.name) == want) {
            return info.type;
        }
    }
    return std::nullopt;
}

ggml_type parse_type(std::string_view name, std::string_view what) {
    if (auto t = type_from_name(name)) {
        return *t;
    }
    std::string names;
    for (const type_info & info : type_table()) {
        names += (names.empty() ? "" : ", ") + info.name;
    }
    fail("{}: unknown ggml type '{}'; storage types are: {}", what, name, names);
}

bool type_fits(ggml_type type, int64_t ne0) {
    const int64_t blck = ggml_get_type_traits(type)->blck_size;
    return blck > 0 && ne0 > 0 && ne0 % blck == 0;
}

int64_t n_rows(std::span<const int64_t> ne) {
    int64_t rows = 1;
    for (size_t i = 1; i < ne.size(); ++i) {
        rows *= ne[i];
    }
    return rows;
}

int64_t n_elements(std::span<const int64_t> ne) {
    return ne.empty() ? 0 : ne[0] * n_rows(ne);
}

size_t tensor_bytes(ggml_type type, std::span<const int64_t> ne, std::string_view tensor_name) {
    if (ne.empty()) {
        fail("tensor '{}' has no dimensions", tensor_name);
    }
    if (!type_fits(type, ne[0])) {
        fail("tensor '{}' {}: {} needs ne0 to be a multiple of {} (ne0 = {}); pick a type whose block size divides {}",
             tensor_name, shape_str(ne), type_name(type), ggml_get_type_traits(type)->blck_size, ne[0], ne[0]);
    }
    return static_cast<size_t>(n_rows(ne)) * ggml_row_size(type, ne[0]);
}

std::string shape_str(std::span<const int64_t> ne) {
    std::string s = "[";
    for (size_t i = 0; i < ne.size(); ++i) {
        s += (i ? ", " : "") + std::to_string(ne[i]);
    }
    return s + "]";
}

}  // namespace voodoo
