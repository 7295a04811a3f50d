#include "cli/commands.h"
#include "common/doctor.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <memory>

namespace voodoo::cli {

namespace {

command add_doctor(CLI::App & app) {
    auto * sub = app.add_subcommand("doctor", "Check the llama.cpp libraries, LibTorch, CUDA, BLAS and disk");
    sub->footer("example:\n  voodoo doctor\n  voodoo doctor --json -");
    auto dir = std::make_shared<std::string>(".");
    auto json = std::make_shared<std::string>();
    sub->add_option("--dir", *dir, "Folder whose free disk space to report")->capture_default_str();
    add_json_option(sub, *json, "The checks");
    return {sub, [dir, json] {
        const auto checks = run_doctor(*dir);
        write_json_to(*json, doctor_to_json(checks));
        if (*json != "-") {
            fmt::print("{}", doctor_to_text(checks));
        }
        return std::all_of(checks.begin(), checks.end(), [](const doctor_check & c) { return c.ok; }) ? 0 : 1;
    }};
}

}  // namespace

VOODOO_COMMAND(doctor, add_doctor);

}  // namespace voodoo::cli
