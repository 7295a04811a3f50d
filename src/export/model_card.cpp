#include "export/model_card.h"

#include "common/units.h"
#include "eval/report.h"
#include "ggml/types.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

namespace fs = std::filesystem;

namespace voodoo {

namespace {

// A YAML scalar in double quotes (YAML 1.2 §7.3.1: backslash and double quote escaped).
std::string yaml_quoted(const std::string & s) {
    std::string out = "\"";
    for (const char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
        }
        out += (c == '\n' || c == '\r') ? ' ' : c;
    }
    return out + "\"";
}

// The Hub repository (owner/name) the source names, "" when it names none. The keys are those llama.cpp's
// converter writes (gguf-py's Keys.General): the source repository, else the first base model's Hub URL, else a
// name of the form owner/name. A bare model name ("llama") is no repository: the Hub would link it nowhere.
std::string base_model_of(const gguf_file & src) {
    auto is_repo = [](const std::string & s) {
        const size_t slash = s.find('/');
        return slash != std::string::npos && slash > 0 && slash + 1 < s.size() && s.find('/', slash + 1) == std::string::npos &&
               s.find(' ') == std::string::npos;
    };
    if (const auto repo = src.get_string("general.source.huggingface.repository"); repo && is_repo(*repo)) {
        return *repo;
    }
    if (const auto url = src.get_string("general.base_model.0.repo_url"); url) {
        const std::string hub = "https://huggingface.co/";
        if (url->rfind(hub, 0) == 0 && is_repo(url->substr(hub.size()))) {
            return url->substr(hub.size());
        }
    }
    if (const auto n = src.get_string("general.name"); n && is_repo(*n)) {
        return *n;
    }
    return "";
}

// "blk.12.attn_q.weight" → "blk.*.attn_q.weight": the tensor family the card's recipe table groups by.
std::string card_family(const std::string & name) {
    static const std::regex layer(R"(^blk\.[0-9]+\.)");
    return std::regex_replace(name, layer, "blk.*.");
}

// A word for the shell: as is when it is plain, else in single quotes.
std::string shell_word(const std::string & s) {
    if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-/+=:,@%") ==
                          std::string::npos) {
        return s;
    }
    std::string out = "'";
    for (const char c : s) {
        out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    }
    return out + "'";
}

std::string base_name(const std::string & path) { return fs::path(path).filename().string(); }

}  // namespace

std::string model_card_markdown(const gguf_file & src, const model_card_input & in) {
    std::string md = "---\n";
    if (const std::string base = base_model_of(src); !base.empty()) {
        md += "base_model: " + yaml_quoted(base) + "\n";
    }
    if (const auto license = src.get_string("general.license"); license && !license->empty()) {
        md += "license: " + yaml_quoted(*license) + "\n";
    }
    md += "tags:\n- gguf\n- quantized\n- voodoo\n";
    md += "quantized_by: " + yaml_quoted(in.quantized_by) + "\n";
    md += "---\n\n";
    md += std::string(k_model_card_marker) + "\n\n";

    const std::string source_name = base_name(in.source);
    md += fmt::format("# {} — GGUF quantized by Voodoo\n\n", fs::path(in.source).stem().string());
    md += fmt::format("Quantized from `{}` ({}). Each tensor's type was chosen for the least KL divergence from the "
                      "source model at the file's size; every quantized byte comes from llama.cpp's own quantizer, "
                      "so stock llama.cpp runs these files as they are.\n\n",
                      source_name, src.get_string("general.architecture").value_or("?"));

    md += "## Files\n\n| file | size (MiB) | bits per weight of the quantized tensors | target |\n|---|---:|---:|---|\n";
    for (const card_file & f : in.files) {
        double bytes = 0, weights = 0;
        for (const recipe_tensor & t : f.r.tensors) {
            bytes += static_cast<double>(t.bytes);
            weights += static_cast<double>(n_elements(t.shape));
        }
        const double file_bytes = fs::exists(f.gguf) ? static_cast<double>(fs::file_size(f.gguf)) : 0.0;
        md += fmt::format("| `{}` | {:.3f} | {:.3f} | {} |\n", base_name(f.gguf), file_bytes / k_mib,
                          weights > 0 ? 8.0 * bytes / weights : 0.0, f.r.target.empty() ? "-" : f.r.target);
    }
    // A new user's trial read two BPW for one file: this one, and the comparison table's (every tensor's data, as
    // llama.cpp counts it, the norms' f32 included).
    md += fmt::format("\nThe bits per weight here count the tensors Voodoo chose a type for{}. The target is the size the "
                      "run was given, in bytes of the whole file (`--like` gives a stock file's).\n",
                      in.eval && !in.eval->files.empty()
                          ? "; the BPW of the comparison below counts every tensor's data, the f32 norms included, as "
                            "llama.cpp reports it"
                          : "");

    md += "\n## Types per tensor family\n\n";
    for (const card_file & f : in.files) {
        if (in.files.size() > 1) {
            md += fmt::format("`{}`:\n\n", base_name(f.gguf));
        }
        // family → type → count, in the order families first appear.
        std::vector<std::string> order;
        std::map<std::string, std::map<std::string, int>> counts;
        for (const recipe_tensor & t : f.r.tensors) {
            const std::string fam = card_family(t.name);
            if (!counts.contains(fam)) {
                order.push_back(fam);
            }
            ++counts[fam][ggml_type_name(t.type)];
        }
        md += "| tensor family | types (tensors) |\n|---|---|\n";
        for (const std::string & fam : order) {
            std::string types;
            for (const auto & [type, n] : counts[fam]) {
                types += fmt::format("{}{} ×{}", types.empty() ? "" : ", ", type, n);
            }
            md += fmt::format("| `{}` | {} |\n", fam, types);
        }
        md += "\n";
    }

    if (in.eval && !in.eval->files.empty()) {
        md += fmt::format("## Against the stock llama.cpp recipes\n\nKL divergence from the source model (nats per "
                          "token, llama-perplexity's method: the second half of each of {} chunks of {} tokens of "
                          "`{}` scored), every stock file made by llama-quantize with the same imatrix:\n\n",
                          in.eval->n_chunks, in.eval->n_ctx, base_name(in.eval->text));
        md += eval_to_markdown(*in.eval) + "\n";
        if (!in.plot.empty()) {
            md += fmt::format("![KL divergence against file size, these files and the stock recipes]({})\n\n", in.plot);
        }
    }

    md += "## How these files were made\n\n";
    if (!in.command.empty()) {
        md += "```sh\n" + in.command + "\n```\n\n";
    }
    md += "The same tensors, byte for byte, with stock llama.cpp's `llama-quantize` from the same source and imatrix "
          "(the metadata differ: Voodoo adds its `voodoo.*` keys):\n\n```sh\n";
    for (const card_file & f : in.files) {
        md += "llama-quantize";
        if (!in.imatrix.empty()) {
            md += " --imatrix " + shell_word(base_name(in.imatrix));
        }
        md += fmt::format(" --tensor-type-file {} {} {} Q8_0\n", shell_word(base_name(f.tensor_types)),
                          shell_word(source_name), shell_word(base_name(f.gguf)));
    }
    md += "```\n";
    return md;
}

std::string shell_command(const std::vector<std::string> & words) {
    std::string out;
    for (const std::string & w : words) {
        out += out.empty() ? "" : " ";
        out += shell_word(w);
    }
    return out;
}

std::string model_card_path(const std::string & folder, const std::string & first_gguf) {
    const fs::path readme = fs::path(folder) / "README.md";
    if (!fs::exists(readme)) {
        return readme.string();
    }
    std::ifstream in(readme);
    for (std::string line; std::getline(in, line);) {
        if (line == k_model_card_marker) {
            return readme.string();
        }
    }
    return (fs::path(folder) / (fs::path(first_gguf).stem().string() + ".README.md")).string();
}

}  // namespace voodoo
