// The lattice quantizers' tables (issue #16): built one after the other by ggml_quantize_init, as llama-quantize and
// every process before lattice_warmup built them, or in parallel by ggml/quant.h's lattice_warmup. The grids are
// built once per process, so each way runs in its own process: `lattice_grids serial` and `lattice_grids warmup
// [--threads N]`. Prints one JSON object per line (each grid's seconds for serial; the whole for both).
#include "ggml/quant.h"
#include "ggml/types.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <vector>

int main(int argc, char ** argv) {
    CLI::App app{"Build llama.cpp's lattice grids serially (ggml_quantize_init) or in parallel (lattice_warmup)"};
    std::string way;
    int threads = 0;
    app.add_option("way", way, "serial or warmup")->required()->check(CLI::IsMember({"serial", "warmup"}));
    app.add_option("-t,--threads", threads, "lattice_warmup's threads (0 = every core)");
    CLI11_PARSE(app, argc, argv);
    // The grids' types, the longest first; IQ1_M shares IQ1_S's grid.
    const std::vector<ggml_type> types = {GGML_TYPE_IQ1_S,   GGML_TYPE_IQ2_S, GGML_TYPE_IQ2_XS,
                                          GGML_TYPE_IQ2_XXS, GGML_TYPE_IQ3_S, GGML_TYPE_IQ3_XXS};
    using clock = std::chrono::steady_clock;
    const auto seconds = [](clock::time_point a) { return std::chrono::duration<double>(clock::now() - a).count(); };
    const auto t0 = clock::now();
    if (way == "serial") {
        for (ggml_type t : types) {
            const auto a = clock::now();
            ggml_quantize_init(t);
            fmt::print("{{\"way\": \"serial\", \"type\": \"{}\", \"seconds\": {:.3f}}}\n", voodoo::type_name(t), seconds(a));
        }
    } else {
        voodoo::lattice_warmup warmup(types, threads);
        warmup.wait();
    }
    fmt::print("{{\"way\": \"{}\", \"threads\": {}, \"grids\": {}, \"seconds\": {:.3f}}}\n", way,
               way == "serial" ? 1 : voodoo::resolve_threads(threads), types.size(), seconds(t0));
}
