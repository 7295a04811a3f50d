// One file per subcommand; each adds itself to the app and returns the code to run once parsed.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace voodoo::cli {

struct command {
    CLI::App * sub;             // the subcommand
    std::function<int()> run;   // runs it once parsed; returns the exit code
};

command add_doctor(CLI::App & app);
command add_inspect(CLI::App & app);

}  // namespace voodoo::cli
