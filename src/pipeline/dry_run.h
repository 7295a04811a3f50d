// `voodoo quantize --dry-run` and `voodoo train --dry-run` (issue #20): what a run would build and how long it
// would take, without making anything: the menus, the candidates (count and bytes, and how many the cache already
// holds), the feasible size range and each target in it, the GPU memory a --device cuda run needs, and an estimate
// of each stage's time from rates measured here in a fraction of a second.
#pragma once

#include "ggml/gguf.h"
#include "train/trainer.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace voodoo {

struct dry_run_input {
    const gguf_file * src = nullptr;
    train_options train;                    // menus (menu.types/per_role), steps, batch, seq, probe, device, threads
    std::vector<target> goals;              // the targets (bpw, size, ratio); --like ones are in like_sizes
    std::vector<std::pair<std::string, double>> like_sizes;  // a --like recipe and its stock file's bytes (0: not
                                                             // made yet, so unknown in a dry run)
    std::string imatrix;                    // an imatrix that exists (given, or a finished run's), or "" (none yet:
                                            // its coverage is predicted, and no candidate can be in the cache, since
                                            // a candidate's key holds its importance)
    std::string planned_imatrix_file;       // with no imatrix yet: the path and first dataset the imatrix stage will
    std::string planned_imatrix_dataset;    // record in the file (quantize); "" = no imatrix stage (sizes without them)
    std::string cache_dir;                  // the candidate cache a run would use
    int64_t ctx = 512;                      // calibration chunk length
    int64_t text_bytes = 0;                 // the calibration texts' bytes (quantize), 0 = data already made
    int64_t train_chunks = 0;               // chunks the token data holds (train), 0 = estimated from text_bytes
    int64_t imatrix_chunks = 0;             // chunks the imatrix stage would run (0 = no imatrix stage)
    int64_t stock_files = 0;                // stock files the run would make with llama_model_quantize
    std::vector<std::string> stock_recipes; // those of them not made yet, by recipe name (their bytes are estimated)
    bool exports = true;                    // the run writes a GGUF per target (quantize; train writes a recipe only)
    int64_t eval_files = 0;                 // files the eval would compare (0 = no eval stage)
    int64_t eval_tokens_per_file = 0;       // tokens each eval file runs
    int eval_speed_reps = 0;                // llama-bench runs (pp512 and tg128) per eval file (quantize --speed-reps)
    bool eval_reference_speed = false;      // and of the reference too
    int ggml_threads = 0;                   // libllama's threads (imatrix, eval)
    int ranks = 1;                          // the train stage's ranks (quantize --gpus; train.parallel says how)
};

/// The plan as JSON: {"model", "device", "menus": [{"tensors", "n", "types"}], "candidates": {"count", "bytes",
/// "in_cache", "in_cache_bytes", "to_build", "to_build_bytes", "cache_dir", "cache_known"}, "sizes": {"min_bytes",
/// "max_bytes", "min_bpw", "max_bpw", "exact", "targets": [{"target", "bytes", "feasible"}]}, "disk": {"folder",
/// "free_bytes" (-1: unreadable), "candidates_to_build_bytes", "candidates_exact" (false with --candidates targets:
/// an upper bound), "exported_files", "exported_files_bytes", "exported_files_unknown", "stock_files", "stock_files_to_make",
/// "stock_files_bytes_estimate", "data_bytes_estimate", "reserve_bytes", "fits_every_candidate"}, "gpu_memory": {…}
/// (cuda only), "stages": [{"stage", "work", "seconds"}], "rates": {…}}. Byte counts are exact: the candidates'
/// are what build_candidates makes (every tensor × menu type, the source type included) and what the cache
/// would hold (the others, each entry with its 8-byte checksum); the size range is make_budget's, exact once the
/// imatrix exists ("exact": true) and otherwise without the imatrix's header keys (a few hundred bytes). Times are
/// estimates (the method is in "rates"). Throws voodoo::error as check_quantize_options does for a menu type no
/// tensor takes.
nlohmann::json plan_dry_run(const dry_run_input & in);

/// The plan as text for a terminal: a few lines per section.
std::string dry_run_to_text(const nlohmann::json & plan);

/// Throws voodoo::error naming every target of `plan` outside its feasible sizes ("feasible": false) and the range,
/// as the real run refuses them, so that a script can take --dry-run (quantize, train) as its check; called once the
/// plan is printed. Targets not sized yet (a --like before its imatrix) pass. `model`: the source, for the message.
void fail_if_outside_the_range(const nlohmann::json & plan, const std::string & model);

}  // namespace voodoo
