// GGUF: header, metadata, tensor infos, offsets, alignment, sizes. A bad file must give voodoo::error and nothing
// else: no crash, no sanitizer report, no allocation beyond libFuzzer's -malloc_limit_mb.
#include "common/error.h"
#include "fuzz_input.h"
#include "ggml/gguf.h"

#include <nlohmann/json.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string path = voodoo::fuzz::as_file(data, size, ".gguf");
    try {
        const voodoo::gguf_file f(path);
        for (int64_t i = 0; i < f.n_kv(); ++i) {
            (void) f.kv_json(i, 64).dump(2, ' ', false, nlohmann::json::error_handler_t::replace);  // as the CLI writes it
        }
        (void) f.get_string("general.architecture");
        uint64_t sum = 0;
        for (const voodoo::gguf_tensor & t : f.tensors()) {
            const auto bytes = f.data(t);  // every tensor's data lies inside the file
            if (!bytes.empty()) {
                sum += bytes.front() + bytes.back();
            }
        }
        (void) sum;
    } catch (const voodoo::error &) {
    }
    return 0;
}
