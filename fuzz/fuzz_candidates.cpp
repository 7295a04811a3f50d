// Candidate cache entries (<cache>/<key[0:2]>/<key>.bin): whatever bytes lie there, load() gives back what
// store() wrote or nothing (the caller rebuilds the candidate); never a crash, never bytes of another size. The
// bytes it gives go to ggml's checks and to_float, as the trainer and export use them.
#include "common/error.h"
#include "fuzz_input.h"
#include "ggml/quant.h"
#include "ggml/types.h"
#include "train/candidates.h"

#include <algorithm>
#include <filesystem>

namespace {

constexpr int64_t k_ne0 = 256;  // every type's block fits
const std::string k_key = "0123456789abcdef0123456789abcdef";

const voodoo::candidate_cache & cache() {
    static const voodoo::candidate_cache c(voodoo::fuzz::scratch_path("-cache"));
    return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size == 0) {
        return 0;
    }
    // The first byte: the candidate's ggml type (its enum value, low 7 bits), and whether the entry is voodoo's
    // own (written by store(), high bit) or the raw bytes of a damaged or foreign file; the rest is the entry.
    // The size asked for is the nearest whole number of rows, so that sizes match often.
    // (Compared as numbers: a cast of 100 to ggml_type is itself undefined behaviour, as UBSan said.)
    const int number = data[0] & 0x7f;
    const auto & types = voodoo::type_table();
    const auto info = std::find_if(types.begin(), types.end(),
                                   [&](const voodoo::type_info & t) { return static_cast<int>(t.type) == number; });
    if (info == types.end()) {
        return 0;
    }
    const ggml_type type = info->type;
    const bool stored = (data[0] & 0x80) != 0;
    const std::span<const uint8_t> bytes(data + 1, size - 1);
    const size_t row = ggml_row_size(type, k_ne0);
    const size_t expected = std::max<size_t>(1, bytes.size() / row) * row;
    if (stored) {
        cache().store(k_key, bytes);
    } else {
        namespace fs = std::filesystem;
        const fs::path entry = fs::path(cache().dir()) / k_key.substr(0, 2) / (k_key + ".bin");  // as path_of lays it
        std::filesystem::create_directories(entry.parent_path());
        voodoo::fuzz::write_file(entry.string(), bytes.data(), bytes.size());
    }
    const auto hit = cache().load(k_key, expected);
    if (hit && hit->size() != expected) {
        __builtin_trap();  // bytes of another size than asked for
    }
    if (stored && bytes.size() == expected && (!hit || !std::equal(hit->begin(), hit->end(), bytes.begin()))) {
        __builtin_trap();  // what store() wrote does not come back
    }
    if (hit) {
        try {
            voodoo::validate_rows(type, *hit, k_ne0);
            (void) voodoo::dequantize(type, *hit, k_ne0, 1);
        } catch (const voodoo::error &) {
        }
    }
    return 0;
}
