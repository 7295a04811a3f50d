// recipe.json: any JSON (or not JSON) a user or another tool hands to `voodoo export --recipe`.
#include "common/error.h"
#include "export/recipe.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string path = voodoo::fuzz::as_file(data, size, ".recipe.json");
    try {
        const voodoo::recipe r = voodoo::recipe_load(path);
        (void) voodoo::recipe_tensor_types(r);
        (void) voodoo::recipe_hash(r);
    } catch (const voodoo::error &) {
    }
    return 0;
}
