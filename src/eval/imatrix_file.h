// The importance matrix as llama-quantize passes it to llama_model_quantize, read from llama.cpp's
// GGUF imatrix file. Only what `voodoo baseline` needs; src/imatrix/ is the full reader/writer.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace voodoo {

struct quantize_imatrix {
    std::string path;
    /// Per weight tensor (its GGUF name), the mean of x² per input column: in_sum2 / counts, one
    /// [ne0] slice per expert (count 0 → 1), exactly llama-quantize's load_imatrix (tools/quantize).
    std::map<std::string, std::vector<float>> data;
    std::vector<std::string> datasets;      // imatrix.datasets
    int64_t chunk_count = 0;                // imatrix.chunk_count (0 when absent)
};

/// Reads `<tensor>.in_sum2` and `<tensor>.counts` (both F32) of a GGUF imatrix (llama-imatrix's
/// default output). Throws voodoo::error naming the file and tensor: not a GGUF (a legacy .dat is
/// not read: convert it with `llama-imatrix --in-file x.dat -o x.gguf`), a sum without its counts,
/// a non-F32 entry, counts that do not divide the sums, no entries, or a non-finite value.
quantize_imatrix read_quantize_imatrix(const std::string & path);

}  // namespace voodoo
