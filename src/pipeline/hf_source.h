// Hugging Face checkpoints in: a model folder (config.json, *.safetensors or pytorch_model*.bin, tokenizer files)
// is converted once to a BF16 GGUF with llama.cpp's own converter from the pinned bundle (convert_hf_to_gguf.py
// and its gguf-py), kept in a folder and reused while the checkpoint is unchanged.
#pragma once

#include <string>
#include <vector>

namespace voodoo {

/// True when `path` is a folder holding config.json: a Hugging Face checkpoint rather than a GGUF file.
bool is_hf_folder(const std::string & path);

/// The GGUF a Voodoo command reads for `path`. A GGUF file is returned as it is. A Hugging Face folder is
/// converted to `<cache_dir>/hf-<key>/<name>.gguf` (named after the folder) by `python3 convert_hf_to_gguf.py DIR --outtype bf16
/// --outfile …` (written under a temporary name and renamed, so a stopped conversion leaves nothing half made;
/// its output goes to `<cache_dir>/convert.log`), where <key> is a digest of every file of the folder (name,
/// size and modification time; config.json and the tokenizer files by content): the same checkpoint is converted
/// once, a changed one again. Prints one line on stderr saying which.
///
/// The interpreter is $VOODOO_PYTHON (default python3) and the converter $VOODOO_CONVERT_HF (default: the pinned
/// bundle's, fixed at build time). Before converting, the interpreter is asked for the converter's packages
/// (numpy, torch, transformers, yaml; sentencepiece when the folder has tokenizer.model). Throws voodoo::error:
/// with no interpreter or a missing package, one message naming what is missing, the pip command that installs
/// the bundle's requirements, and the converter command to run by hand instead; a folder with no weights, naming
/// it; a failed conversion, with the end of convert.log.
std::string gguf_of_source(const std::string & path, const std::string & cache_dir);

/// The folder a command keeps a converted checkpoint in when it has no work folder of its own: `<name>.voodoo`
/// in the current folder, the default work folder of `voodoo quantize` for the same source, so the two share one
/// conversion. <name> is the last component of `path` without a trailing '/' and, for a file, its extension.
std::string default_work_folder(const std::string & path);

/// The converter this build uses ($VOODOO_CONVERT_HF, else the bundle's) and the interpreter ($VOODOO_PYTHON,
/// else python3).
std::string hf_converter_path();
std::string hf_python();

}  // namespace voodoo
