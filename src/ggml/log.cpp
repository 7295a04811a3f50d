#include "ggml/log.h"

#include <ggml.h>
#include <llama.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <vector>

namespace voodoo {

namespace {

std::atomic<int> g_min_level{GGML_LOG_LEVEL_ERROR};
thread_local ggml_log_capture * t_capture = nullptr;
thread_local std::vector<std::string> * t_lines = nullptr;
thread_local std::vector<std::string> * t_info = nullptr;  // the info lines of the capture in progress
thread_local int t_last_level = GGML_LOG_LEVEL_NONE;

void log_callback(ggml_log_level level, const char * text, void *) {
    // CONT continues the previous line at the previous line's level.
    if (level == GGML_LOG_LEVEL_CONT) {
        level = static_cast<ggml_log_level>(t_last_level);
    } else {
        t_last_level = level;
    }
    if (t_capture && t_lines) {
        if (level >= GGML_LOG_LEVEL_WARN) {
            t_lines->emplace_back(text);
        } else if (level == GGML_LOG_LEVEL_INFO && t_info) {
            t_info->emplace_back(text);
        }
        return;
    }
    if (level >= g_min_level.load()) {
        std::fputs(text, stderr);
    }
}

}  // namespace

void ggml_log_install(int min_level) {
    g_min_level = min_level;
    static std::once_flag once;
    std::call_once(once, [] {
        ggml_log_set(log_callback, nullptr);
        llama_log_set(log_callback, nullptr);
    });
}

ggml_log_capture::ggml_log_capture() : outer_(t_capture) {
    ggml_log_install(g_min_level.load());
    if (!t_lines) {
        t_lines = new std::vector<std::string>();
        t_info = new std::vector<std::string>();
    }
    if (!outer_) {
        t_lines->clear();
        t_info->clear();
    }
    t_capture = this;
}

ggml_log_capture::~ggml_log_capture() {
    t_capture = outer_;
}

std::string ggml_log_capture::info_line(std::string_view containing) const {
    for (const std::string & line : *t_info) {
        if (line.find(containing) != std::string::npos) {
            return line;
        }
    }
    return "";
}

std::string ggml_log_capture::info_text() const {
    std::string out;
    for (const std::string & part : *t_info) {
        out += part;
    }
    return out;
}

std::string ggml_log_capture::text() const {
    std::string out;
    for (std::string line : *t_lines) {
        // "gguf_init_from_file_impl: tensor 'x' ..." -> "tensor 'x' ..."
        if (const auto colon = line.find(": "); colon != std::string::npos && line.find(' ') > colon) {
            line = line.substr(colon + 2);
        }
        while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) {
            line.pop_back();
        }
        if (line.empty()) {
            continue;
        }
        if (!out.empty()) {
            out += "; ";
        }
        out += line;
    }
    return out;
}

}  // namespace voodoo
