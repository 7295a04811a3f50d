#include "ggml/gguf.h"

#include "common/error.h"
#include "ggml/log.h"
#include "ggml/types.h"

#include <nlohmann/json.hpp>

#include <cstring>

namespace voodoo {

namespace {

constexpr size_t k_header_bytes = 4 + 4 + 8 + 8;  // magic, version, n_tensors, n_kv

nlohmann::json scalar_json(gguf_type type, const void * p) {
    switch (type) {
        case GGUF_TYPE_UINT8: return *static_cast<const uint8_t *>(p);
        case GGUF_TYPE_INT8: return *static_cast<const int8_t *>(p);
        case GGUF_TYPE_UINT16: return *static_cast<const uint16_t *>(p);
        case GGUF_TYPE_INT16: return *static_cast<const int16_t *>(p);
        case GGUF_TYPE_UINT32: return *static_cast<const uint32_t *>(p);
        case GGUF_TYPE_INT32: return *static_cast<const int32_t *>(p);
        case GGUF_TYPE_UINT64: return *static_cast<const uint64_t *>(p);
        case GGUF_TYPE_INT64: return *static_cast<const int64_t *>(p);
        case GGUF_TYPE_FLOAT32: return *static_cast<const float *>(p);
        case GGUF_TYPE_FLOAT64: return *static_cast<const double *>(p);
        case GGUF_TYPE_BOOL: return *static_cast<const int8_t *>(p) != 0;
        default: return nullptr;
    }
}

}  // namespace

size_t gguf_scalar_size(gguf_type type) {
    switch (type) {
        case GGUF_TYPE_UINT8:
        case GGUF_TYPE_INT8:
        case GGUF_TYPE_BOOL: return 1;
        case GGUF_TYPE_UINT16:
        case GGUF_TYPE_INT16: return 2;
        case GGUF_TYPE_UINT32:
        case GGUF_TYPE_INT32:
        case GGUF_TYPE_FLOAT32: return 4;
        case GGUF_TYPE_UINT64:
        case GGUF_TYPE_INT64:
        case GGUF_TYPE_FLOAT64: return 8;
        default: return 0;
    }
}

namespace {

std::string hex4(std::span<const uint8_t> b) {
    std::string s;
    for (size_t i = 0; i < b.size() && i < 4; ++i) {
        s += fmt::format("{}{:02x}", i ? " " : "", b[i]);
    }
    return s;
}

}  // namespace

gguf_file::gguf_file(const std::string & path) : path_(path), map_(path) {
    const auto bytes = map_.bytes();
    if (bytes.size() < k_header_bytes) {
        fail("'{}' is not a GGUF file: {} bytes, too short for a GGUF header", path, bytes.size());
    }
    if (std::memcmp(bytes.data(), "GGUF", 4) != 0) {
        fail("'{}' is not a GGUF file: it starts with bytes {}, a GGUF starts with 'GGUF'", path, hex4(bytes));
    }
    uint32_t version = 0;
    std::memcpy(&version, bytes.data() + 4, 4);
    if (version != 2 && version != 3) {
        fail("'{}': GGUF version {} is not supported (2 and 3 are); re-convert it with a current llama.cpp", path,
             version);
    }
    {
        ggml_log_capture capture;
        gguf_init_params params{/*no_alloc =*/true, /*ctx =*/nullptr};
        ctx_ = gguf_init_from_buffer(bytes.data(), bytes.size(), params);
        if (!ctx_) {
            const std::string why = capture.text();
            fail("'{}' is not a valid GGUF file ({}); it may be truncated or corrupt", path,
                 why.empty() ? "ggml could not parse its header" : why);
        }
    }
    const size_t data_start = gguf_get_data_offset(ctx_);
    const int64_t n = gguf_get_n_tensors(ctx_);
    tensors_.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
        gguf_tensor t;
        t.name = gguf_get_tensor_name(ctx_, i);
        t.type = gguf_get_tensor_type(ctx_, i);
        const int64_t * ne = gguf_get_tensor_ne(ctx_, i);
        t.n_dims = 1;
        for (int d = 0; d < 4; ++d) {
            t.ne[d] = ne[d];
            if (ne[d] != 1) {
                t.n_dims = d + 1;
            }
        }
        t.offset = data_start + gguf_get_tensor_offset(ctx_, i);
        t.n_bytes = gguf_get_tensor_size(ctx_, i);
        if (t.offset > bytes.size() || t.n_bytes > bytes.size() - t.offset) {
            const size_t end = t.offset + t.n_bytes;
            gguf_free(ctx_);
            ctx_ = nullptr;
            fail("'{}': tensor '{}' ({} {}) ends at byte {} but the file has {} bytes; the file is truncated or "
                 "corrupt (download or convert it again)",
                 path, t.name, type_name(t.type), shape_str(t.shape()), end, bytes.size());
        }
        tensors_.push_back(std::move(t));
    }
}

gguf_file::~gguf_file() {
    if (ctx_) {
        gguf_free(ctx_);
    }
}

uint32_t gguf_file::version() const { return gguf_get_version(ctx_); }
size_t gguf_file::alignment() const { return gguf_get_alignment(ctx_); }
size_t gguf_file::data_offset() const { return gguf_get_data_offset(ctx_); }

const gguf_tensor * gguf_file::find_tensor(std::string_view name) const {
    for (const gguf_tensor & t : tensors_) {
        if (t.name == name) {
            return &t;
        }
    }
    return nullptr;
}

const gguf_tensor & gguf_file::tensor(std::string_view name) const {
    if (const gguf_tensor * t = find_tensor(name)) {
        return *t;
    }
    fail("'{}' has no tensor '{}'", path_, name);
}

std::span<const uint8_t> gguf_file::data(const gguf_tensor & t) const {
    return map_.bytes().subspan(t.offset, t.n_bytes);
}

int64_t gguf_file::find_key(std::string_view key) const { return gguf_find_key(ctx_, std::string(key).c_str()); }
int64_t gguf_file::n_kv() const { return gguf_get_n_kv(ctx_); }

std::optional<std::string> gguf_file::get_string(std::string_view key) const {
    const int64_t id = find_key(key);
    if (id < 0) {
        return std::nullopt;
    }
    if (gguf_get_kv_type(ctx_, id) != GGUF_TYPE_STRING) {
        fail("'{}': metadata key '{}' is {}, expected a string", path_, key, gguf_type_name(gguf_get_kv_type(ctx_, id)));
    }
    return std::string(gguf_get_val_str(ctx_, id));
}

std::optional<int64_t> gguf_file::get_int(std::string_view key) const {
    const int64_t id = find_key(key);
    if (id < 0) {
        return std::nullopt;
    }
    const gguf_type type = gguf_get_kv_type(ctx_, id);
    const nlohmann::json v = scalar_json(type, type == GGUF_TYPE_STRING || type == GGUF_TYPE_ARRAY
                                                   ? nullptr
                                                   : gguf_get_val_data(ctx_, id));
    if (type == GGUF_TYPE_FLOAT32 || type == GGUF_TYPE_FLOAT64 || !(v.is_number() || v.is_boolean())) {
        fail("'{}': metadata key '{}' is {}, expected an integer", path_, key, gguf_type_name(type));
    }
    if (v.is_boolean()) {
        return v.get<bool>() ? 1 : 0;
    }
    if (v.is_number_unsigned()) {
        return static_cast<int64_t>(v.get<uint64_t>());
    }
    return v.get<int64_t>();
}

std::optional<double> gguf_file::get_float(std::string_view key) const {
    const int64_t id = find_key(key);
    if (id < 0) {
        return std::nullopt;
    }
    const gguf_type type = gguf_get_kv_type(ctx_, id);
    if (type == GGUF_TYPE_STRING || type == GGUF_TYPE_ARRAY || type == GGUF_TYPE_BOOL) {
        fail("'{}': metadata key '{}' is {}, expected a number", path_, key, gguf_type_name(type));
    }
    return scalar_json(type, gguf_get_val_data(ctx_, id)).get<double>();
}

std::string gguf_file::architecture() const {
    return get_string("general.architecture").value_or("");
}

nlohmann::json gguf_file::kv_json(int64_t id, size_t max_array) const {
    const gguf_type type = gguf_get_kv_type(ctx_, id);
    if (type == GGUF_TYPE_STRING) {
        return gguf_get_val_str(ctx_, id);
    }
    if (type != GGUF_TYPE_ARRAY) {
        return scalar_json(type, gguf_get_val_data(ctx_, id));
    }
    const gguf_type arr_type = gguf_get_arr_type(ctx_, id);
    const size_t n = gguf_get_arr_n(ctx_, id);
    nlohmann::json out = nlohmann::json::array();
    const size_t shown = std::min(n, max_array);
    if (arr_type == GGUF_TYPE_STRING) {
        for (size_t i = 0; i < shown; ++i) {
            out.push_back(gguf_get_arr_str(ctx_, id, i));
        }
    } else if (arr_type != GGUF_TYPE_ARRAY) {
        const auto * p = static_cast<const uint8_t *>(gguf_get_arr_data(ctx_, id));
        const size_t step = gguf_scalar_size(arr_type);
        for (size_t i = 0; i < shown; ++i) {
            out.push_back(scalar_json(arr_type, p + i * step));
        }
    }
    return out;
}

gguf_writer::gguf_writer(const std::string & path, size_t alignment) : out_(path), alignment_(alignment) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
        fail("'{}': GGUF alignment {} is not a power of two", path, alignment);
    }
    ctx_ = gguf_init_empty();
    if (alignment != GGUF_DEFAULT_ALIGNMENT) {
        // The gguf API takes a file's alignment only from its header, so make the empty context
        // by parsing a header that carries it.
        gguf_set_val_u32(ctx_, GGUF_KEY_GENERAL_ALIGNMENT, static_cast<uint32_t>(alignment));
        std::vector<uint8_t> header(gguf_get_meta_size(ctx_));
        gguf_get_meta_data(ctx_, header.data());
        gguf_free(ctx_);
        ctx_ = gguf_init_from_buffer(header.data(), header.size(), gguf_init_params{true, nullptr});
        if (!ctx_) {
            fail("'{}': ggml could not create a GGUF context with alignment {}", path, alignment);
        }
    }
    meta_ = ggml_init(ggml_init_params{/*mem_size =*/ggml_tensor_overhead(), /*mem_buffer =*/nullptr,
                                       /*no_alloc =*/true});
}

gguf_writer::~gguf_writer() {
    if (meta_) {
        ggml_free(meta_);
    }
    if (ctx_) {
        gguf_free(ctx_);
    }
}

void gguf_writer::copy_kv(const gguf_file & src) {
    if (data_started_) {
        fail("'{}': metadata must be set before tensor data is written", out_.path());
    }
    if (src.alignment() != alignment_) {
        fail("'{}': source '{}' has alignment {}, this writer uses {}", out_.path(), src.path(), src.alignment(),
             alignment_);
    }
    gguf_set_kv(ctx_, src.ctx());
}

void gguf_writer::add_tensor(std::string_view name, ggml_type type, std::span<const int64_t> ne) {
    if (data_started_) {
        fail("'{}': tensor '{}' added after tensor data started", out_.path(), name);
    }
    if (name.empty() || name.size() >= GGML_MAX_NAME) {
        fail("'{}': tensor name '{}' must have 1 to {} characters", out_.path(), name, GGML_MAX_NAME - 1);
    }
    if (ne.empty() || ne.size() > GGML_MAX_DIMS) {
        fail("'{}': tensor '{}' has {} dimensions; GGUF holds 1 to {}", out_.path(), name, ne.size(), GGML_MAX_DIMS);
    }
    const std::string name_str(name);
    if (gguf_find_tensor(ctx_, name_str.c_str()) >= 0) {
        fail("'{}': tensor '{}' added twice", out_.path(), name);
    }
    tensor_bytes(type, ne, name);  // throws when ne0 does not fit the type's block
    ggml_tensor * t = ggml_new_tensor(meta_, type, static_cast<int>(ne.size()), ne.data());
    ggml_set_name(t, name_str.c_str());
    gguf_add_tensor(ctx_, t);  // copies the tensor's description
    ggml_reset(meta_);
}

void gguf_writer::begin_data() {
    if (data_started_) {
        return;
    }
    std::vector<uint8_t> meta(gguf_get_meta_size(ctx_));
    gguf_get_meta_data(ctx_, meta.data());
    size_t total = meta.size();
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx_); ++i) {
        total += GGML_PAD(gguf_get_tensor_size(ctx_, i), alignment_);
    }
    out_.expect(total);  // a full disk then says how many bytes the file needs
    out_.write(meta);
    data_started_ = true;
}

void gguf_writer::write_tensor(std::string_view name, std::span<const uint8_t> bytes) {
    begin_data();
    const int64_t n = gguf_get_n_tensors(ctx_);
    if (static_cast<int64_t>(next_tensor_) >= n) {
        fail("'{}': tensor '{}' written but all {} declared tensors are already written", out_.path(), name, n);
    }
    const int64_t i = static_cast<int64_t>(next_tensor_);
    if (name != gguf_get_tensor_name(ctx_, i)) {
        fail("'{}': tensor '{}' written where '{}' comes next", out_.path(), name, gguf_get_tensor_name(ctx_, i));
    }
    const size_t want = gguf_get_tensor_size(ctx_, i);
    if (bytes.size() != want) {
        fail("'{}': tensor '{}' is {} bytes, its declaration needs {}", out_.path(), name, bytes.size(), want);
    }
    out_.write(bytes);
    out_.write_zeros(GGML_PAD(bytes.size(), alignment_) - bytes.size());
    ++next_tensor_;
}

void gguf_writer::commit() {
    begin_data();
    const int64_t n = gguf_get_n_tensors(ctx_);
    if (static_cast<int64_t>(next_tensor_) != n) {
        fail("'{}': only {} of {} tensors were written; the file was not created", out_.path(), next_tensor_, n);
    }
    out_.commit();
}

}  // namespace voodoo
