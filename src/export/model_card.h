// The model card published beside Voodoo's files: README.md in the Hugging Face model-card form (YAML front
// matter, then Markdown), the form https://huggingface.co/docs/hub/model-cards describes.
#pragma once

#include "eval/eval.h"
#include "export/recipe.h"
#include "ggml/gguf.h"

#include <string>
#include <vector>

namespace voodoo {

/// One file the card describes: the exported GGUF, its recipe and the tensor-types file beside it.
struct card_file {
    std::string gguf;           // path of the exported file
    std::string tensor_types;   // path of its llama-quantize --tensor-type-file beside it
    recipe r;
};

struct model_card_input {
    std::string source;                 // path of the source GGUF (its metadata gives base_model and license)
    std::vector<card_file> files;       // Voodoo's files, by increasing size
    std::string imatrix;                // path of the imatrix the files were quantized with ("" = none)
    const eval_result * eval = nullptr; // the comparison with the stock recipes (null: no eval ran)
    std::string plot;                   // file name of the comparison plot beside the card ("" = none)
    std::string command;                // the command line that made the files
    std::string quantized_by = "Voodoo";
};

/// The card's text. Front matter: base_model (the source's general.source.huggingface.repository, else the Hub
/// repository of general.base_model.0.repo_url, else general.name when it has the form owner/name; omitted when
/// the source names no repository), license (general.license, omitted when absent), tags [gguf,
/// quantized, voodoo], quantized_by. Body: what each file is (size, bits per weight), the types per tensor family
/// (blk.N. folded to blk.*), the comparison table and plot when an eval ran, the command, and the stock
/// llama-quantize command that rebuilds each file byte for byte from the same source and imatrix
/// (`--tensor-type-file`, llama.cpp tools/quantize). Pure: reads the source's metadata, writes nothing.
std::string model_card_markdown(const gguf_file & src, const model_card_input & in);

/// The words as one command line for a POSIX shell: plain words as they are, others in single quotes.
std::string shell_command(const std::vector<std::string> & words);

/// Where the card goes in `folder`: README.md unless a README.md that Voodoo did not write is there (then
/// `<stem>.README.md`, stem of the first file), so a publisher's own card is never overwritten.
std::string model_card_path(const std::string & folder, const std::string & first_gguf);

/// The line every card Voodoo writes starts its body with; model_card_path looks for it.
inline constexpr const char * k_model_card_marker = "<!-- model card written by voodoo quantize -->";

}  // namespace voodoo
