// Calibration text: UTF-8 checks and the split into documents (the unit of the train/val split).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace voodoo {

/// Throws voodoo::error naming `what` (a file), the byte offset and the line when `text` is not valid UTF-8
/// (overlong forms, surrogates and code points past U+10FFFF are invalid too, as RFC 3629 says).
void require_utf8(std::string_view text, std::string_view what);

/// Splits text into documents: a line that is empty or only whitespace ends a document, and so does
/// `separator` (e.g. the vocabulary's EOS text "</s>" or "<|endoftext|>") wherever it stands, when not empty.
/// Each document keeps its inner newlines and loses surrounding whitespace; empty documents are dropped.
/// Returns views into `text`.
std::vector<std::string_view> split_documents(std::string_view text, std::string_view separator);

}  // namespace voodoo
