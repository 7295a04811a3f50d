// data.json, the sidecar `voodoo data` writes beside train.tokens and val.tokens: read by token_data, whose
// sources() name the texts in an imatrix. The token files beside it are valid and fixed; only the JSON varies.
#include "common/error.h"
#include "data/dataset.h"
#include "fuzz_input.h"

#include <filesystem>

namespace {

// One folder per process, with a train.tokens and a val.tokens of 2 chunks of 4 tokens (vocabulary of 512).
std::string data_dir() {
    static const std::string dir = [] {
        const std::string d = voodoo::fuzz::scratch_path("-data");
        std::filesystem::create_directories(d);
        const int32_t tokens[8] = {1, 5, 6, 7, 1, 8, 9, 10};
        for (const char * name : {"/train.tokens", "/val.tokens"}) {
            voodoo::write_token_file(d + name, tokens, 4, 0x1234, 512, voodoo::token_file_flag_bos);
        }
        return d;
    }();
    return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string dir = data_dir();
    voodoo::fuzz::write_file(dir + "/data.json", data, size);
    try {
        const voodoo::token_data d(dir);
        size_t n = 0;
        for (const std::string & s : d.sources()) {
            n += s.size();
        }
        (void) n;
    } catch (const voodoo::error &) {
    }
    return 0;
}
