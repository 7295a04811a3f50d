// The training journal's envelope (journal.pt): magic, version, the archive's length and checksum. Only what passes
// it reaches LibTorch's deserializer, which is not fuzzed here (see tests/test_train.cpp, the journal test, for why).
#include "common/error.h"
#include "fuzz_input.h"
#include "train/journal_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string path = voodoo::fuzz::as_file(data, size, ".journal.pt");
    try {
        const std::string archive = voodoo::read_journal_file(path);
        if (archive.size() + sizeof(voodoo::journal_header) != size) {
            __builtin_trap();  // the archive is the rest of the file, no more, no less
        }
    } catch (const voodoo::error &) {
    }
    return 0;
}
