#include "common/sha256.h"

#include "common/error.h"

#include <fmt/format.h>
#include <openssl/evp.h>

namespace voodoo {

std::string sha256_hex(std::span<const uint8_t> bytes) {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    if (EVP_Digest(bytes.data(), bytes.size(), digest, &n, EVP_sha256(), nullptr) != 1) {
        fail("OpenSSL could not compute a SHA-256 of {} bytes", bytes.size());
    }
    std::string hex;
    hex.reserve(2 * n);
    for (unsigned int i = 0; i < n; ++i) {
        hex += fmt::format("{:02x}", digest[i]);
    }
    return hex;
}

}  // namespace voodoo
