// SHA-256 of files (OpenSSL's EVP), for sidecars that record exactly which inputs made an output.
#pragma once

#include <span>
#include <cstdint>
#include <string>

namespace voodoo {

/// SHA-256 of bytes as 64 lower-case hex digits.
std::string sha256_hex(std::span<const uint8_t> bytes);

}  // namespace voodoo
