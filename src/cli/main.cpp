// voodoo: learned per-tensor llama.cpp quantization. Parses the command line and calls the library.
#include "cli/commands.h"
#include "common/doctor.h"
#include "common/error.h"
#include "common/file.h"
#include "common/heap.h"
#include "export/model_card.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <cstdio>

#include <unistd.h>
#include <map>
#include <vector>
#include <string>

namespace voodoo::cli {

namespace {

std::map<std::string, command_factory> & registry() {
    static std::map<std::string, command_factory> r;
    return r;
}

}  // namespace

bool register_command(const char * name, command_factory factory) {
    registry()[name] = factory;
    return true;
}

namespace {

std::atomic<bool> g_interrupted{false};

void on_sigint(int) { g_interrupted = true; }

std::string & command_line_storage() {
    static std::string line;
    return line;
}

}  // namespace

const std::string & command_line() { return command_line_storage(); }

CLI::Option * add_json_option(CLI::App * sub, std::string & dest, const std::string & what) {
    // Checked with the rest of the command line, before any work: a folder, or a place no file can be written
    // (a read-only folder, /proc), is refused at once (exit 2) instead of after the job.
    auto writable = [](const std::string & path) -> std::string {
        if (path == "-") {
            return "";
        }
        namespace fs = std::filesystem;
        if (path.ends_with('/') || fs::is_directory(path)) {
            return fmt::format("'{}' is a folder; give a file name (or - for stdout)", path);
        }
        const fs::path parent = fs::path(path).parent_path().empty() ? fs::path(".") : fs::path(path).parent_path();
        std::error_code ec;
        if (!fs::exists(parent, ec)) {
            return "";  // made when the JSON is written, as the other outputs' folders are
        }
        if (const int err = voodoo::cannot_create_files_in(parent.string()); err != 0) {
            return fmt::format("cannot write in '{}': {}", parent.string(), std::strerror(err));
        }
        return "";
    };
    return sub->add_option("--json", dest, what + " as JSON in this file (- for stdout, instead of the text)")
        ->type_name("FILE")
        ->check(CLI::Validator(writable, "FILE", "writable"));
}

void write_json_to(const std::string & dest, const nlohmann::json & j) {
    if (dest.empty()) {
        return;
    }
    // Strings from outside files (GGUF metadata, tensor names) need not be UTF-8: invalid bytes are written as
    // U+FFFD instead of throwing (a GGUF with such a key made `inspect --json` abort: found by fuzz_gguf).
    const std::string text = j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    if (dest == "-") {
        fmt::print("{}", text);
        return;
    }
    if (const auto parent = std::filesystem::path(dest).parent_path(); !parent.empty()) {
        std::filesystem::create_directories(parent);
    }
    write_file_atomic(dest, text);
}

std::function<bool(int)> stop_on_sigint() {
    // Also when started with SIGINT ignored, as a non-interactive shell starts a background job (`voodoo … & kill
    // -INT $!` in a script stops the job): Ctrl-C here only ever asks for a clean stop.
    std::signal(SIGINT, on_sigint);
    return [](int) { return g_interrupted.load(); };
}

std::vector<command> add_all_commands(CLI::App & app) {
    std::vector<command> out;
    for (const auto & [name, factory] : registry()) {
        out.push_back(factory(app));
    }
    return out;
}

}  // namespace voodoo::cli

namespace {

int run_main(int argc, char ** argv);

}  // namespace

int main(int argc, char ** argv) {
    const int rc = run_main(argc, argv);
    // Every command has written and closed its outputs by now. Leave without running static destructors:
    // in the CUDA build, the teardown of LibTorch's CUDA libraries and libllama's dynamically loaded CPU
    // backend crashed (SIGSEGV after every output was written, on the GPU machine: docs/BENCHMARKS.md).
    std::fflush(nullptr);
    std::_Exit(rc);
}

namespace {

int run_main(int argc, char ** argv) {
    {
        std::vector<std::string> words = {"voodoo"};
        for (int i = 1; i < argc; ++i) {
            words.emplace_back(argv[i]);
        }
        voodoo::cli::command_line_storage() = voodoo::shell_command(words);
    }
    voodoo::keep_freed_memory_in_heap();
    CLI::App app{"voodoo: the best GGUF of an LLM for a given size, learned by gradient descent"};
    app.require_subcommand(0, 1);
    app.set_version_flag("--version", [] { return voodoo::version_line(); });
    app.footer(R"(examples:
  voodoo doctor
  voodoo inspect model.gguf
  voodoo inspect model.gguf --json model.json

Run `voodoo <command> --help` for a command's options.)");
    const std::vector<voodoo::cli::command> commands = voodoo::cli::add_all_commands(app);

    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp & e) {
        return app.exit(e);
    } catch (const CLI::CallForAllHelp & e) {
        return app.exit(e);
    } catch (const CLI::CallForVersion & e) {
        return app.exit(e);
    } catch (const CLI::ParseError & e) {
        // A command line that cannot be parsed: one line, the same prefix as every other error, exit 2.
        std::string what = e.what();
        fmt::print(stderr, "voodoo: error: {}; run `voodoo {}--help` for the options\n", what,
                   app.get_subcommands().empty() ? "" : app.get_subcommands().front()->get_name() + " ");
        return 2;
    }
    if (app.get_subcommands().empty()) {
        fmt::print(stderr, "voodoo: error: give a command; run `voodoo --help` for the list\n");
        return 2;
    }
    try {
        for (const auto & c : commands) {
            if (c.sub->parsed()) {
                return c.run();
            }
        }
    } catch (const voodoo::stopped & e) {
        std::fflush(stdout);
        fmt::print(stderr, "voodoo: {}\n", e.what());   // "… stopped …; run the same command again …"
        return 130;
    } catch (const voodoo::error & e) {
        std::fflush(stdout);
        fmt::print(stderr, "voodoo: error: {}\n", e.what());
        return 1;
    } catch (const std::exception & e) {
        std::fflush(stdout);
        fmt::print(stderr, "voodoo: internal error: {}\n", e.what());
        return 3;
    }
    return 0;
}

}  // namespace
