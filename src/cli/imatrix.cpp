#include "cli/commands.h"
#include "common/error.h"
#include "common/file.h"
#include "dist/dist.h"
#include "ggml/gguf.h"
#include "imatrix/collect.h"
#include "imatrix/imatrix.h"
#include "train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <memory>

namespace voodoo::cli {

namespace {

nlohmann::json summary_json(const imatrix & im) {
    nlohmann::json entries = nlohmann::json::array();
    for (const auto & [name, e] : im.entries) {
        int64_t max_count = 0;
        for (int64_t c : e.counts) {
            max_count = std::max(max_count, c);
        }
        // "count": the tokens of a 2-D weight; for an expert tensor the most any one expert saw, with every expert's
        // in "counts".
        nlohmann::json entry = {{"name", name}, {"ne0", e.ne0()}, {"n_mat", e.n_mat()}, {"count", max_count}};
        if (e.n_mat() > 1) {
            entry["counts"] = e.counts;
        }
        entries.push_back(std::move(entry));
    }
    const nlohmann::json experts = expert_coverage_json(imatrix_expert_coverage(im));
    return {{"format", im.legacy ? "dat" : "gguf"}, {"datasets", im.datasets}, {"chunk_count", im.chunk_count},
            {"chunk_size", im.chunk_size},          {"n_entries", im.entries.size()}, {"entries", entries},
            {"experts", experts}};
}

void print_summary(const imatrix & im) {
    fmt::print("{} entries, {} chunks of {} tokens, datasets: {}\n", im.entries.size(), im.chunk_count, im.chunk_size,
               fmt::join(im.datasets, ", "));
    for (const auto & [name, e] : im.entries) {
        int64_t tokens = 0;
        for (const int64_t c : e.counts) {
            tokens = std::max(tokens, c);
        }
        fmt::print("  {:<28} {:>6} columns × {} matrices, {} tokens{}\n", name, e.ne0(), e.n_mat(), tokens,
                   e.n_mat() > 1 ? " (the most of one expert)" : "");
    }
    if (const std::string experts = expert_coverage_text(imatrix_expert_coverage(im)); !experts.empty()) {
        fmt::print("experts the calibration reached:\n{}", experts);
    }
}

command add_imatrix(CLI::App & app) {
    auto * sub = app.add_subcommand(
        "imatrix", "Collect the importance matrix (Σx² per input column of every matmul) in llama.cpp's GGUF format");
    sub->footer("examples:\n"
                "  voodoo imatrix --model model.gguf --data data/ --out imatrix.gguf\n"
                "  voodoo imatrix --model model.gguf --data data/ --chunks 64 --out imatrix.gguf\n"
                "  voodoo imatrix --model model.gguf --show imatrix.dat     (check one made by llama-imatrix)\n"
                "  torchrun --no-python --nproc-per-node 2 voodoo imatrix --model model.gguf --data data/ --device cuda \\\n"
                "      --out imatrix.gguf     (the chunks split over 2 GPUs; --forward torch on the CPU)\n"
                "  torchrun --no-python --nproc-per-node 2 voodoo imatrix … --device cuda --parallel layers\n"
                "                             (each GPU holds half the layers: a model larger than one GPU)");
    struct options {
        imatrix_options collect;
        std::string out;
        std::string show;
        std::string device = "cpu";
        std::string forward = "auto";
        int64_t batch_tokens = 8192;
        std::string parallel = "chunks";
        std::string json;
    };
    auto o = std::make_shared<options>();
    sub->add_option("--model,-m", o->collect.model, "Source GGUF (F32/F16/BF16)")->required();
    auto * data = sub->add_option("--data,-d", o->collect.data_dir, "A folder written by `voodoo data` (train split)");
    auto * out = sub->add_option("--out,-o", o->out, "Output imatrix GGUF");
    auto * show = sub->add_option("--show", o->show, "Read an imatrix (GGUF or legacy .dat), check it fits the model, list it");
    sub->add_option("--chunks", o->collect.max_chunks, "Use the first N train chunks (-1 or 0 = all)")->capture_default_str()
        ->check(CLI::Range(int64_t{-1}, std::numeric_limits<int64_t>::max()));
    sub->add_option("-t,--threads", o->collect.n_threads, "CPU threads (0 = VOODOO_THREADS if set, else every core)")->capture_default_str()->check(non_negative());
    sub->add_option("--device", o->device,
                    "cpu, cuda or cuda:N (CUDA builds). The forward (--forward auto): libllama's own graph on the CPU "
                    "(llama-imatrix's statistic), Voodoo's LibTorch forward on a GPU, the same statistic within the "
                    "two forwards' parity")
        ->capture_default_str();
    sub->add_option("--forward", o->forward,
                    "auto: libllama on the CPU, LibTorch on a GPU; torch: Voodoo's LibTorch forward on --device, the CPU "
                    "too (what several ranks split: under torchrun's variables each rank runs a share of the chunks)")
        ->capture_default_str()->check(CLI::IsMember({"auto", "libllama", "torch"}));
    sub->add_option("--batch-tokens", o->batch_tokens,
                    "LibTorch forward: tokens per forward (whole chunks, at least one; the unit several ranks share out)")
        ->capture_default_str()->check(CLI::Range(int64_t{1}, std::numeric_limits<int64_t>::max()));
    sub->add_option("--parallel", o->parallel,
                    "Several ranks (torchrun's variables): chunks (each rank runs whole forwards of a share of the chunks; "
                    "each column within one f32 ulp of one process's) or layers (every forward rank to rank, each rank "
                    "holding only its own layers: a model larger than one GPU; one process's imatrix bit for bit)")
        ->capture_default_str()->check(CLI::IsMember({"chunks", "layers"}));
    add_json_option(sub, o->json, "The summary");
    data->needs(out);
    out->needs(data);
    show->excludes(data);
    return {sub, [o] {
        o->collect.max_chunks = std::max<int64_t>(o->collect.max_chunks, 0);  // -1 = all, as llama.cpp's tools
        if (o->show.empty() && o->collect.data_dir.empty()) {
            fail("voodoo imatrix: give --data DIR --out FILE to collect, or --show FILE to check an imatrix");
        }
        imatrix im;
        if (!o->show.empty()) {
            im = read_imatrix(o->show);
            require_imatrix_fits(im, gguf_file(o->collect.model), o->show);
        } else {
            if (same_file(o->out, o->collect.model)) {
                fail("--out '{}' is the source model; choose another file", o->out);
            }
            const bool cpu = o->device == "cpu";
            if (o->forward == "libllama" && !cpu) {
                fail("--forward libllama runs on the CPU (libllama's CPU backend); with --device {} use --forward torch "
                     "or auto", o->device);
            }
            const bool torch_forward = o->forward == "torch" || (o->forward == "auto" && !cpu);
            // torchrun's ranks (issue #17), as `voodoo quantize --gpus N` starts them: each runs a share of the
            // chunks on cuda:LOCAL_RANK (or the CPU), the sums are added over the ranks, rank 0 writes.
            std::unique_ptr<dist::process_group> group;
            const std::optional<dist::launch_env> env = dist::launch_env_from_environment();
            if (env && env->world_size > 1) {
                if (!torch_forward) {
                    fail("voodoo imatrix as {} ranks (WORLD_SIZE) splits the chunks of the LibTorch forward: pass "
                         "--device cuda, or --forward torch on the CPU", env->world_size);
                }
                if (o->device == "cuda") {
                    o->device = fmt::format("cuda:{}", env->local_rank);
                }
                const torch::Device where = cpu ? torch::Device(torch::kCPU) : parse_train_device(o->device);
                group = std::make_unique<dist::process_group>(*env, std::chrono::minutes(30), where);
                fmt::print(stderr, "rank {} of {} ({}, {}): imatrix\n", env->rank, env->world_size, where.str(),
                           group->backend());
            }
            im = torch_forward ? collect_imatrix_torch(o->collect, parse_train_device(o->device), o->batch_tokens, group.get(),
                                                       o->parallel == "layers")
                               : collect_imatrix(o->collect);
            if (group && group->rank() != 0) {
                return 0;  // rank 0 writes the file and the summary
            }
            write_imatrix_gguf(o->out, im);
        }
        write_json_to(o->json, summary_json(im));
        if (o->json != "-") {
            print_summary(im);
            if (!o->out.empty()) {
                fmt::print("wrote {}\n", o->out);
            }
        }
        return 0;
    }};
}

}  // namespace

VOODOO_COMMAND(imatrix, add_imatrix);

}  // namespace voodoo::cli
