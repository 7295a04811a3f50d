// `voodoo data`: calibration text → train/val token files in a folder (docs/DATA.md).
//
//   DIR/train.tokens   chunks for training and the imatrix (token_file)
//   DIR/val.tokens     chunks held out for validation (token_file; 0 chunks when --val-fraction 0)
//   DIR/data.json      sidecar: vocab hash, counts, options, source files and their sha256
#pragma once

#include "data/token_file.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace voodoo {

struct data_options {
    std::string model;                  // GGUF whose vocabulary tokenizes (only the vocabulary is loaded)
    std::vector<std::string> texts;     // UTF-8 text files
    int64_t ctx = 512;                  // tokens per chunk, BOS included
    double val_fraction = 0.05;         // share of the tokens held out for validation, by whole documents
    uint64_t seed = 42;                 // the shuffle of the documents
    std::string out_dir;                // created when missing
};

/// Tokenizes the texts with the model's vocabulary and writes DIR/train.tokens, DIR/val.tokens, DIR/data.json.
///
/// Rule (docs/DATA.md): each file is split into documents (blank lines, or the vocabulary's EOS text); each
/// document is tokenized alone (llama_tokenize without special tokens: text is text) and followed by EOS when
/// the vocabulary has one; the documents of all files are shuffled with `seed` and the first ones go to val
/// until val holds val_fraction of the tokens; each split's token stream is cut into chunks of ctx tokens
/// that start with BOS when llama_vocab_get_add_bos says so (as llama-perplexity and llama-imatrix feed
/// chunks), the tail that does not fill a chunk is dropped. The same inputs and seed give the same bytes.
///
/// Returns the sidecar. Throws voodoo::error, having written nothing, when a text is missing, empty or not
/// UTF-8, when a split has fewer tokens than one chunk, or when an option is out of range.
nlohmann::json prepare_data(const data_options & options);

/// The folder `voodoo data` wrote, opened for reading.
class token_data {
public:
    /// Opens DIR/data.json, DIR/train.tokens and DIR/val.tokens. Throws voodoo::error naming the missing or bad file:
    /// data.json not JSON, without "format": "voodoo-tokens" or with malformed "sources"; a bad token file; token
    /// files that disagree; a train.tokens of no chunk.
    explicit token_data(const std::string & dir);

    const std::string & dir() const { return dir_; }
    const token_file & train() const { return *train_; }
    const token_file & val() const { return *val_; }
    const nlohmann::json & sidecar() const { return sidecar_; }
    /// The text files the tokens came from (as given to `voodoo data`).
    const std::vector<std::string> & sources() const { return sources_; }

    /// Throws voodoo::error when the tokens were made with another vocabulary than the model at model_path has.
    void require_vocab_of(const std::string & model_path) const;

private:
    std::string dir_;
    nlohmann::json sidecar_;
    std::vector<std::string> sources_;
    std::unique_ptr<token_file> train_;
    std::unique_ptr<token_file> val_;
};

}  // namespace voodoo
