#include "data/text.h"

#include "common/error.h"

#include <algorithm>
#include <cstdint>

namespace voodoo {

namespace {

size_t line_of(std::string_view text, size_t offset) {
    return 1 + static_cast<size_t>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(offset), '\n'));
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' || c == '\v'; }

std::string_view trim(std::string_view s) {
    while (!s.empty() && is_space(s.front())) {
        s.remove_prefix(1);
    }
    while (!s.empty() && is_space(s.back())) {
        s.remove_suffix(1);
    }
    return s;
}

// Splits one separator-free piece at blank lines.
void split_paragraphs(std::string_view piece, std::vector<std::string_view> & out) {
    size_t doc_start = 0;
    size_t pos = 0;
    while (pos <= piece.size()) {
        const size_t eol = std::min(piece.find('\n', pos), piece.size());
        const std::string_view line = piece.substr(pos, eol - pos);
        if (trim(line).empty()) {
            const std::string_view doc = trim(piece.substr(doc_start, pos - doc_start));
            if (!doc.empty()) {
                out.push_back(doc);
            }
            doc_start = eol + 1;
        }
        pos = eol + 1;
    }
    if (doc_start < piece.size()) {
        const std::string_view doc = trim(piece.substr(doc_start));
        if (!doc.empty()) {
            out.push_back(doc);
        }
    }
}

}  // namespace

void require_utf8(std::string_view text, std::string_view what) {
    const auto * s = reinterpret_cast<const uint8_t *>(text.data());
    const size_t n = text.size();
    size_t i = 0;
    while (i < n) {
        const uint8_t c = s[i];
        size_t len = 0;
        uint32_t cp = 0;
        uint32_t min = 0;
        if (c < 0x80) {
            ++i;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            len = 2, cp = c & 0x1F, min = 0x80;
        } else if ((c & 0xF0) == 0xE0) {
            len = 3, cp = c & 0x0F, min = 0x800;
        } else if ((c & 0xF8) == 0xF0) {
            len = 4, cp = c & 0x07, min = 0x10000;
        }
        bool ok = len != 0 && i + len <= n;
        for (size_t k = 1; ok && k < len; ++k) {
            ok = (s[i + k] & 0xC0) == 0x80;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        ok = ok && cp >= min && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
        if (!ok) {
            fail("'{}' is not valid UTF-8: byte 0x{:02x} at offset {} (line {}); convert it to UTF-8 (e.g. "
                 "`iconv -f latin1 -t utf-8`)",
                 what, c, i, line_of(text, i));
        }
        i += len;
    }
}

std::vector<std::string_view> split_documents(std::string_view text, std::string_view separator) {
    std::vector<std::string_view> out;
    size_t start = 0;
    while (start <= text.size()) {
        const size_t at = separator.empty() ? std::string_view::npos : text.find(separator, start);
        const size_t end = at == std::string_view::npos ? text.size() : at;
        split_paragraphs(text.substr(start, end - start), out);
        if (at == std::string_view::npos) {
            break;
        }
        start = at + separator.size();
    }
    return out;
}

}  // namespace voodoo
