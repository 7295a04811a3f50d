// The envelope of the training journal (<run_dir>/journal.pt): LibTorch's archive behind a header that gives its
// length and checksum. LibTorch's deserializer is not safe on damaged bytes (a flipped byte in the archive's
// TorchScript source crashed libtorch 1.13's type parser), so no byte reaches it that Voodoo did not write.
// No LibTorch here: fuzz/fuzz_journal.cpp fuzzes this reader.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace voodoo {

/// The header at the start of a journal, 32 bytes, little-endian; the archive follows it.
struct journal_header {
    char magic[8];              // "VOODOJNL"
    uint32_t version;           // 1
    uint32_t reserved;          // 0
    uint64_t archive_bytes;     // the archive's length: the file is 32 + archive_bytes bytes
    uint64_t archive_xxh3;      // XXH3-64 of the archive
};
static_assert(sizeof(journal_header) == 32);

inline constexpr uint32_t journal_version = 1;

/// Writes the archive (a serialized torch::serialize::OutputArchive) behind its header, atomically.
/// Throws voodoo::error when the file cannot be written (then `path` is untouched).
void write_journal_file(const std::string & path, std::string_view archive);

/// The archive of the journal at `path`. Throws voodoo::error naming the file when it cannot be opened, has no
/// journal header (not a journal, or one of a Voodoo before the header), another version, another length than
/// the header gives (cut short) or another checksum (damaged).
std::string read_journal_file(const std::string & path);

}  // namespace voodoo
