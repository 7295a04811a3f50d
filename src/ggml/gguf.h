// GGUF files through ggml's gguf API: a validating, memory-mapped reader and a streaming writer.
#pragma once

#include "common/file.h"

#include <ggml.h>
#include <gguf.h>
#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace voodoo {

/// Bytes of one GGUF scalar value of `type` (u8 … f64, bool); 0 for strings and arrays.
size_t gguf_scalar_size(gguf_type type);

/// One tensor of a GGUF file.
struct gguf_tensor {
    std::string name;
    ggml_type type;
    int n_dims;                     // 1 to 4
    std::array<int64_t, 4> ne;      // ggml order, ne[0] innermost; 1 beyond n_dims
    size_t offset;                  // bytes from the start of the file
    size_t n_bytes;                 // exact bytes of the data (ggml_nbytes), without alignment padding

    std::span<const int64_t> shape() const { return {ne.data(), static_cast<size_t>(n_dims)}; }
    int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
    int64_t n_rows() const { return ne[1] * ne[2] * ne[3]; }
};

/// A GGUF file opened for reading. The header is parsed by ggml's gguf_init_from_file after our
/// own checks (exists, regular file, magic, version), and every tensor's data range is checked
/// against the file size before anything reads it, so a bad file is a voodoo::error, never an
/// abort inside ggml. Tensor data is memory-mapped, never read as a whole.
class gguf_file {
public:
    /// Throws voodoo::error naming the path: missing, not a GGUF, unsupported version, malformed
    /// header (with ggml's reason), or a tensor whose data runs past the end of the file.
    explicit gguf_file(const std::string & path);
    ~gguf_file();
    gguf_file(const gguf_file &) = delete;
    gguf_file & operator=(const gguf_file &) = delete;

    const std::string & path() const { return path_; }
    const gguf_context * ctx() const { return ctx_; }
    uint32_t version() const;
    size_t alignment() const;
    size_t data_offset() const;     // bytes from the start of the file to the first tensor's data
    size_t file_size() const { return map_.size(); }

    const std::vector<gguf_tensor> & tensors() const { return tensors_; }
    /// nullptr when absent.
    const gguf_tensor * find_tensor(std::string_view name) const;
    /// Throws voodoo::error naming the file and tensor when absent.
    const gguf_tensor & tensor(std::string_view name) const;
    /// The tensor's bytes, straight from the memory map.
    std::span<const uint8_t> data(const gguf_tensor & t) const;

    /// Metadata: -1 when the key is absent.
    int64_t find_key(std::string_view key) const;
    int64_t n_kv() const;
    std::optional<std::string> get_string(std::string_view key) const;
    /// Any integer type (u8…i64, bool); throws voodoo::error when present with another type.
    std::optional<int64_t> get_int(std::string_view key) const;
    /// f32, f64 or any integer type; throws voodoo::error when present with another type.
    std::optional<double> get_float(std::string_view key) const;
    /// `general.architecture`, or "" when missing.
    std::string architecture() const;
    /// One key's value as JSON; arrays longer than max_array keep their first max_array items.
    nlohmann::json kv_json(int64_t key_id, size_t max_array = SIZE_MAX) const;

private:
    std::string path_;
    mapped_file map_;
    gguf_context * ctx_ = nullptr;
    std::vector<gguf_tensor> tensors_;
};

/// Writes a GGUF file in one pass: metadata and tensor infos first (laid out by ggml's gguf API),
/// then each tensor's bytes in the order they were added, padded to the alignment. Memory holds
/// the metadata and whatever one write_tensor call is given, never the whole model. The file is
/// an atomic_file: it appears under its name only after commit().
class gguf_writer {
public:
    /// `alignment` = general.alignment of the output (32 is GGUF's default).
    /// Throws voodoo::error when the destination folder cannot be written.
    explicit gguf_writer(const std::string & path, size_t alignment = GGUF_DEFAULT_ALIGNMENT);
    ~gguf_writer();
    gguf_writer(const gguf_writer &) = delete;
    gguf_writer & operator=(const gguf_writer &) = delete;

    /// For setting metadata directly with gguf_set_val_* before begin_data().
    gguf_context * ctx() { return ctx_; }
    /// Copies every key/value of src (general.alignment must agree with this writer's alignment).
    void copy_kv(const gguf_file & src);
    /// Declares the next tensor. Throws voodoo::error when ne0 does not fit the type or the name repeats.
    void add_tensor(std::string_view name, ggml_type type, std::span<const int64_t> ne);
    /// Writes the header, metadata and tensor infos. No metadata or tensor may be added afterwards.
    void begin_data();
    /// Writes the next tensor's bytes; the name and byte count must match the declaration.
    void write_tensor(std::string_view name, std::span<const uint8_t> bytes);
    /// Checks every tensor was written, then fsyncs and renames onto the destination.
    void commit();

    size_t bytes_written() const { return out_.tell(); }
    const std::string & path() const { return out_.path(); }

private:
    atomic_file out_;
    gguf_context * ctx_ = nullptr;
    ggml_context * meta_ = nullptr;
    size_t alignment_;
    size_t next_tensor_ = 0;
    bool data_started_ = false;
};

}  // namespace voodoo
