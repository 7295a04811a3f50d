// Token files (train.tokens, val.tokens): the header's counts against the file's size, every token id against
// n_vocab, and every chunk the trainer and the imatrix collector would read.
#include "common/error.h"
#include "data/token_file.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string path = voodoo::fuzz::as_file(data, size, ".tokens");
    try {
        const voodoo::token_file f(path);
        int64_t sum = 0;
        for (int64_t i = 0; i < f.n_chunks(); ++i) {
            const auto c = f.chunk(i);
            sum += c.front() + c.back();
        }
        (void) sum;
        (void) f.starts_with_bos();
    } catch (const voodoo::error &) {
    }
    return 0;
}
