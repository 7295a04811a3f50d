// Routing of ggml's and libllama's log lines: kept quiet by default, captured while Voodoo asks
// ggml to parse something so that its complaint can be part of our one-line error.
#pragma once

#include <string>
#include <string_view>

namespace voodoo {

/// Installs Voodoo's log callback in ggml and libllama (idempotent). Lines at or above
/// `min_level` (ggml_log_level: 2 = info, 3 = warn, 4 = error) are printed to stderr.
void ggml_log_install(int min_level = 4);

/// While alive on a thread, ggml/llama log lines from that thread are collected instead of printed.
class ggml_log_capture {
public:
    ggml_log_capture();
    ~ggml_log_capture();
    ggml_log_capture(const ggml_log_capture &) = delete;
    ggml_log_capture & operator=(const ggml_log_capture &) = delete;

    /// The error and warning lines collected so far, joined with "; ", without the function prefixes.
    std::string text() const;

    /// The first info line collected so far that contains `containing` (as llama.cpp printed it), or "".
    std::string info_line(std::string_view containing) const;

    /// Every info message collected so far, joined as printed (llama.cpp prints some lines in two calls).
    std::string info_text() const;

private:
    ggml_log_capture * outer_;
};

}  // namespace voodoo
