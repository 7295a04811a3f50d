// imatrix files: GGUF (llama-imatrix's current format) and the legacy .dat; the reader tells them by the magic.
#include "common/error.h"
#include "fuzz_input.h"
#include "imatrix/imatrix.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string path = voodoo::fuzz::as_file(data, size, ".imatrix");
    try {
        const voodoo::imatrix im = voodoo::read_imatrix(path);
        (void) voodoo::imatrix_importance(im);
    } catch (const voodoo::error &) {
    }
    return 0;
}
