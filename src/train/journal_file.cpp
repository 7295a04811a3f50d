#include "train/journal_file.h"

#include "common/error.h"
#include "common/file.h"

#include <cstring>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace voodoo {

namespace {

constexpr char k_magic[8] = {'V', 'O', 'O', 'D', 'O', 'J', 'N', 'L'};

}  // namespace

void write_journal_file(const std::string & path, std::string_view archive) {
    journal_header h{};
    std::memcpy(h.magic, k_magic, sizeof k_magic);
    h.version = journal_version;
    h.archive_bytes = archive.size();
    h.archive_xxh3 = XXH3_64bits(archive.data(), archive.size());
    atomic_file out(path);
    out.write(&h, sizeof h);
    out.write(archive.data(), archive.size());
    out.commit();
}

std::string read_journal_file(const std::string & path) {
    const mapped_file map(path);
    const auto bytes = map.bytes();
    if (bytes.size() < sizeof(journal_header) || std::memcmp(bytes.data(), k_magic, sizeof k_magic) != 0) {
        fail("journal '{}' is not a Voodoo journal (no 'VOODOJNL' header; before it had one, a journal was a plain "
             "LibTorch archive); delete it to start the training over",
             path);
    }
    journal_header h{};
    std::memcpy(&h, bytes.data(), sizeof h);
    if (h.version != journal_version) {
        fail("journal '{}' has version {}, this Voodoo reads version {}; delete it to start the training over", path,
             h.version, journal_version);
    }
    if (h.reserved != 0) {
        fail("journal '{}': its header is damaged (reserved bytes are not 0); delete it to start the training over",
             path);
    }
    const auto archive = bytes.subspan(sizeof h);
    if (h.archive_bytes != archive.size()) {
        fail("journal '{}': the header gives {} bytes of archive but the file holds {}; it is cut short or damaged, "
             "delete it to start the training over",
             path, h.archive_bytes, archive.size());
    }
    if (XXH3_64bits(archive.data(), archive.size()) != h.archive_xxh3) {
        fail("journal '{}': its checksum does not match its bytes, it is damaged; delete it to start the training over",
             path);
    }
    return {reinterpret_cast<const char *>(archive.data()), archive.size()};
}

}  // namespace voodoo
