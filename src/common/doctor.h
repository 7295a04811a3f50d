// `voodoo doctor`: is everything Voodoo needs here, and what is it?
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <vector>

namespace voodoo {

struct doctor_check {
    std::string name;       // "llama.cpp", "LibTorch", "BLAS", …
    bool ok;
    std::string value;      // what was found
    std::string fix;        // one actionable line when !ok
};

/// "voodoo 0.1.0 (llama.cpp b…, LibTorch …)": what `voodoo --version` prints.
std::string version_line();

/// Runs every check. `dir` is the folder whose free disk space is reported (runs and outputs go there).
std::vector<doctor_check> run_doctor(const std::string & dir);

std::string doctor_to_text(const std::vector<doctor_check> & checks);
nlohmann::json doctor_to_json(const std::vector<doctor_check> & checks);

}  // namespace voodoo
