// Errors: every failure a user can cause is a voodoo::error whose message names the file, tensor or
// flag and says what would work. The CLI prints it on one line and exits 1.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace voodoo {

struct error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

/// The job was stopped (Ctrl-C): what was finished is kept and the same command resumes. The CLI prints it on one
/// line and exits 130, the shell's code for SIGINT.
struct stopped : error {
    using error::error;
};

/// Throws voodoo::error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args &&... args) {
    throw error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace voodoo
