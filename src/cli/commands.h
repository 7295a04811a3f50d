// One file per subcommand; each adds itself to the app and returns the code to run once parsed.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json_fwd.hpp>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace voodoo::cli {

struct command {
    CLI::App * sub;             // the subcommand
    std::function<int()> run;   // runs it once parsed; returns the exit code
};

using command_factory = command (*)(CLI::App & app);

/// Called once per subcommand file at static-initialisation time (see VOODOO_COMMAND).
bool register_command(const char * name, command_factory factory);

/// The command line this process was started with, as a shell command ("voodoo quantize …"): what the model
/// card records. "" before main has parsed it.
const std::string & command_line();

/// Installs a SIGINT handler and returns a stop test for long work (train_options::should_stop): true once
/// Ctrl-C was pressed, so the run writes its journal and exits cleanly.
std::function<bool(int)> stop_on_sigint();

/// Adds --eager-types (train_options::eager_types) to `sub`: train and quantize take it alike.
inline CLI::Option * add_eager_types_option(CLI::App * sub, std::string & value) {
    return sub->add_option("--eager-types", value,
                           "With --candidates targets: how the two types per tensor that are built and probed first (the "
                           "others' ΔKL is predicted from them; with --probe-anchors N, N types) are chosen, spread from the "
                           "largest error to the least: cheap (among the quickest quantizers, at least 20 M weights/s on a "
                           "core, when they reach the menu's low end: Q3_K and Q8_0 with the default menu, Q4_0 and Q8_0 on "
                           "32-block rows) or fast (among every type without a lattice search: Q2_K and Q8_0 with the default "
                           "menu, the older rule)")
        ->capture_default_str()
        ->check(CLI::IsMember({"cheap", "fast"}));
}

/// A count that must be a whole number ≥ 0 (threads, anchors): "-3" is refused as "expected a whole number ≥ 0,
/// got '-3'" instead of CLI11's NonNegativeNumber message with its 300-digit range.
inline CLI::Validator non_negative() {
    return CLI::Validator(
        [](std::string & v) -> std::string {
            try {
                size_t used = 0;
                const long long n = std::stoll(v, &used);
                if (used == v.size() && n >= 0) {
                    return {};
                }
            } catch (const std::exception &) {
            }
            return "expected a whole number >= 0, got '" + v + "'";
        },
        "INT>=0");
}

/// A folder to write into, made if missing (--out-dir): refused when the path, or the nearest part of it that exists,
/// is not a folder ("'x.gguf' is a file, not a folder"), instead of the filesystem error that creating it would throw.
inline CLI::Validator folder_to_write() {
    return CLI::Validator(
        [](std::string & v) -> std::string {
            std::error_code ec;
            for (std::filesystem::path p(v); !p.empty(); p = p.parent_path()) {
                if (std::filesystem::exists(p, ec)) {
                    if (std::filesystem::is_directory(p, ec)) {
                        return {};
                    }
                    return "'" + p.string() + "' is a file, not a folder: give a folder (made if missing)";
                }
                if (p == p.parent_path()) {
                    break;
                }
            }
            return {};
        },
        "FOLDER");
}

/// A count ≥ 0 or "auto", which it turns into -1 (--probe-anchors auto); anything else is refused as
/// non_negative() refuses it, with "or auto" added.
inline CLI::Validator count_or_auto() {
    return CLI::Validator(
        [](std::string & v) -> std::string {
            if (v == "auto") {
                v = "-1";
                return {};
            }
            std::string w = v;
            return non_negative()(w).empty() ? std::string() : "expected a whole number >= 0 or auto, got '" + v + "'";
        },
        "INT>=0|auto");
}

/// A number ≥ 0 (a fraction such as --max-slowdown): "-0.1" or "abc" is refused as "expected a number >= 0, got …"
/// instead of CLI11's range message with its 300-digit bound.
inline CLI::Validator non_negative_number() {
    return CLI::Validator(
        [](std::string & v) -> std::string {
            try {
                size_t used = 0;
                const double x = std::stod(v, &used);
                if (used == v.size() && x >= 0 && x < 1e300) {
                    return {};
                }
            } catch (const std::exception &) {
            }
            return "expected a number >= 0, got '" + v + "'";
        },
        "NUMBER>=0");
}

/// `--json FILE` on a subcommand: the report as JSON in FILE, `-` for stdout (instead of the text summary), the
/// convention of every command that reports something (issue #21). dest stays "" when the flag is absent.
CLI::Option * add_json_option(CLI::App * sub, std::string & dest, const std::string & what);

/// Writes j (indented) to dest: stdout for "-", else the file, atomically (temp file + rename), parent folders made.
/// Nothing for "". Throws voodoo::error naming the file when it cannot be written.
void write_json_to(const std::string & dest, const nlohmann::json & j);

/// Every registered subcommand added to app, in name order.
std::vector<command> add_all_commands(CLI::App & app);

}  // namespace voodoo::cli

/// In a src/cli/*.cpp file: VOODOO_COMMAND(inspect, add_inspect) registers the subcommand.
#define VOODOO_COMMAND(name, factory) \
    static const bool voodoo_command_registered_##name = ::voodoo::cli::register_command(#name, factory)
