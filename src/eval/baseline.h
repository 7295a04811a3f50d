// `voodoo baseline`: stock llama.cpp recipes (Q4_K_M, IQ2_M, …) made by llama_model_quantize, the
// function llama-quantize calls, so the files are what llama-quantize would make.
#pragma once

#include "ggml/gguf.h"

#include <ggml.h>
#include <llama.h>

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace voodoo {

struct stock_recipe {
    std::string name;               // llama-quantize's name: "Q4_K_M"
    llama_ftype ftype;
    ggml_type main_type;            // the type most tensors get (llama-quant.cpp llama_ftype_get_default_type)
    bool standard;                  // part of `--recipes all-that-fit` (not F32, the ternary types, aliases)
};

/// Every recipe `voodoo baseline` knows, in llama-quantize's names (tools/quantize/quantize.cpp
/// QUANT_OPTIONS) with its aliases Q3_K, Q4_K, Q5_K (→ the _M recipes).
const std::vector<stock_recipe> & recipe_table();

/// Case-insensitive look-up. Throws voodoo::error listing the known names.
const stock_recipe & recipe_by_name(std::string_view name);

/// True when llama-quantize refuses the recipe without an imatrix: its main type is of the
/// IQ1/IQ2/IQ3_XXS family, or it is Q2_K_S (llama-quant.cpp tensor_requires_imatrix).
bool recipe_needs_imatrix(const stock_recipe & r);

struct baseline_options {
    std::string source;             // F32/F16/BF16 GGUF
    std::string imatrix;            // llama.cpp imatrix (GGUF or legacy .dat, src/imatrix), or empty
    int n_threads = 0;              // 0 = every core
    bool allow_requantize = false;  // llama_model_quantize_params.allow_requantize: a quantized source is accepted
    bool reuse_existing = false;    // make_baselines: a file already at its path is read, not made again. Only for a
                                    // folder whose files are known to come from this source and imatrix (voodoo
                                    // quantize keys its baselines folder on both and empties it when either changes);
                                    // the files are written whole or not at all (atomic), so one there is complete
};

struct baseline_result {
    std::string recipe;
    std::string path;
    bool ok = false;
    std::string error;              // why the file was not made (when !ok)
    size_t file_bytes = 0;
    size_t tensor_bytes = 0;
    int64_t n_weights = 0;
    double bpw = 0;                 // 8 · tensor bytes / weights over every tensor
    std::map<std::string, int> type_counts;     // ggml type name → tensors of that type in the file
    std::vector<ggml_type> tensor_types;        // per tensor, in file order
    std::string same_types_as;      // an earlier recipe of the same run whose file has every tensor's type equal
};

/// Makes one baseline: llama_model_quantize(source → out) with the recipe's ftype, llama-quantize's
/// default parameters, and the imatrix (as llama_model_imatrix_data, plus the quantize.imatrix.*
/// metadata llama-quantize adds) when given. The output is written under a temporary name beside
/// `out` and renamed when complete, then checked by opening it with gguf_file.
/// Throws voodoo::error: unknown recipe; a recipe that needs an imatrix without one ("pass --imatrix");
/// `out` is the source; an unreadable source or imatrix, or an imatrix of another model
/// (require_imatrix_fits); llama.cpp's refusal, with its reason.
baseline_result make_baseline(const baseline_options & opt, const std::string & recipe_name, const std::string & out);

/// An estimate of the bytes of the file llama_model_quantize would make from `src` with recipe r, for a dry run's disk
/// figure (never a budget): every tensor of two or more dimensions at the
/// recipe's main type, the output matrix (the embedding with a tied head) at Q6_K when that is larger (the first of
/// these, IQ4_NL, Q5_0, Q8_0, F16 whose block divides ne0), the others and the header at their bytes in the source.
/// It leaves out the recipe's other promotions (Q4_K_M's Q6_K tensors: a few percent).
double estimate_stock_bytes(const gguf_file & src, const stock_recipe & r);

/// The tensor bytes llama_model_quantize would give opt.source with recipe r, without making the file: its dry run
/// (llama_model_quantize_params.dry_run: llama.cpp's own type for every tensor, nothing quantized or written; 0.02 s
/// on mix30M), read from its "quant size = X MiB" line (two decimals: within 5 KiB). Throws voodoo::error when
/// llama.cpp refuses or prints no such line.
double stock_tensor_bytes(const baseline_options & opt, const stock_recipe & r);

/// The file llama_model_quantize would make from opt.source with recipe `recipe_name` (and opt.imatrix), planned
/// without making it (issue #16: `voodoo quantize --like Q4_K_M` made the whole stock file before training only to
/// read its size: 14.6 s of 16 cores at the Qwen3-1.7B shape, ≈ 70 s at Llama-3.1-8B's). llama.cpp's dry run
/// (llama_model_quantize_params.dry_run) decides every tensor's type by its own rules, with the imatrix given as the
/// real run gets it (some rules depend on one being there), and prints each ("[ i/ n] name - [shape], type = bf16,
/// size = … MiB -> … MiB (q4_K)"); those types give the tensor bytes (ggml_row_size per row), and the header is laid
/// out as llama-quant.cpp lays it (the source's keys, general.quantization_version and general.file_type, the split
/// keys removed, the imatrix's quantize.imatrix.* keys) by ggml's gguf API; the data section pads each tensor to
/// GGUF_DEFAULT_ALIGNMENT, as llama-quant.cpp writes it. So file_bytes is the made file's size to the byte
/// (tested against every recipe made on stories260K and mix30M). Nothing is quantized or written (≈ 0.02 s on mix30M).
/// Throws voodoo::error as make_baseline does for bad options, and when llama.cpp refuses the dry run or prints no
/// type for a tensor of the source.
struct stock_plan {
    size_t file_bytes = 0;                      // the whole file: header, tensor data, padding
    size_t tensor_bytes = 0;                    // the tensors' bytes, without padding
    std::map<std::string, ggml_type> types;     // llama.cpp's type for every tensor of the source, by name
};
stock_plan plan_stock_file(const baseline_options & opt, const std::string & recipe_name);

/// Of `names` (stock recipes), those whose file can be among the `n` nearest in size to one of `our_sizes` (file
/// bytes), found without making them (issue #16: `--baselines nearest` made every recipe, 29 files: at 8 B weights
/// ≈ 45 minutes and ≈ 145 GB, to keep six): each recipe's stock_tensor_bytes plus the source's bytes outside its
/// tensors, and for each size the n + 2 nearest (2 to spare for the headers' few differing keys) and any as near as
/// the last of them (ties). In `names`' order;
/// all of them when there are at most n + 2.
std::vector<std::string> nearest_stock_recipes(const baseline_options & opt, const std::vector<std::string> & names,
                                               const std::vector<size_t> & our_sizes, size_t n);

/// Of `names` (stock recipes), those whose tensor types differ from every earlier name's: the files make_baselines
/// keeps for the eval (it marks the others same_types_as; on a small model llama.cpp's fallbacks give many recipes one
/// file). Each recipe's types come from llama.cpp's dry run, with opt.imatrix when given. Without one, a recipe with
/// a tensor whose type needs one (llama.cpp's dry run warns that the quantization "will require an imatrix") is left
/// out, as llama_model_quantize refuses it, unless `imatrix_to_come` (quantize's dry run before its imatrix stage):
/// then it is planned as if the imatrix were there, and a few types can differ from the run's where llama.cpp's rules
/// ask whether there is one. In `names`' order; nothing is quantized or written (≈ 0.02 s a recipe on mix30M).
/// Throws voodoo::error as plan_stock_file does.
std::vector<std::string> distinct_stock_recipes(const baseline_options & opt, const std::vector<std::string> & names,
                                                bool imatrix_to_come = false);

/// The recipes `--recipes all-that-fit` makes: every standard recipe, less those needing an imatrix
/// when none is given. Recipes whose main type fits no tensor of the model are kept: llama.cpp falls
/// back per tensor (Q4_K → Q5_0, Q6_K → Q8_0, IQ* → IQ4_NL, then F16), and those files are what a user
/// of llama-quantize gets.
std::vector<std::string> recipes_all_that_fit(bool has_imatrix);

/// Reads a stock file already made (by make_baseline) into its result: sizes, BPW and tensor types, as
/// make_baseline reports them. Throws voodoo::error when `path` is not a readable GGUF.
baseline_result describe_baseline(const std::string & recipe_name, const std::string & path);

/// Makes each recipe as `<out_dir>/<source stem>-<RECIPE>.gguf`. A recipe llama.cpp fails on is
/// reported (ok = false, error) and the others are still made; same_types_as marks duplicates. With
/// opt.reuse_existing a file already there is described, not made again (issue #16: the eval ahead makes a stock
/// file during training, and the eval's baselines stage then finds it).
/// Throws voodoo::error for bad options (unknown recipe, missing imatrix, unwritable folder).
std::vector<baseline_result> make_baselines(const baseline_options & opt, const std::vector<std::string> & recipes,
                                            const std::string & out_dir);

/// The results as a markdown table: recipe, file, size (bytes and MiB), BPW, tensor types.
std::string baselines_to_markdown(const std::vector<baseline_result> & results);

}  // namespace voodoo
