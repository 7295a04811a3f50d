// What made each stage's output in a work folder, so that a re-run re-does exactly the stages whose inputs or
// options changed. Each stage keeps a small JSON record beside its output: the options it depends on and the
// content hashes of its inputs, including the digest of the stage before it, so that a change anywhere re-does
// that stage and every stage after it (the rule of build systems such as Make or Bazel, with content hashes
// instead of times).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace voodoo {

/// XXH3-64 of a file's bytes, as 16 hex digits. Throws voodoo::error naming the path when it cannot be read.
std::string file_digest(const std::string & path);

/// XXH3-64 of `inputs.dump()`, as 16 hex digits: what a later stage records of this one.
std::string stage_digest(const nlohmann::json & inputs);

/// The content digest of a (large) model file, remembered in `cache_path` under the file's size, modification
/// time and inode, so that a re-run does not read gigabytes again to learn that nothing changed. A file
/// rewritten in place gets a new modification time and is hashed again.
std::string model_digest(const std::string & model_path, const std::string & cache_path);

/// Compares `inputs` (a flat JSON object: option or input name → value) with the record at `record_path`.
/// Returns "" when they are the same; else one line saying what changed, e.g. "ctx 256 → 512, seed 42 → 7",
/// or "no record of what made it" when the record is missing or unreadable.
std::string stage_changes(const std::string & record_path, const nlohmann::json & inputs);

/// Writes the record of a finished stage atomically.
void stage_save(const std::string & record_path, const nlohmann::json & inputs);

}  // namespace voodoo
