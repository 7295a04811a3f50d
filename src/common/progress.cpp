#include "common/progress.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <unistd.h>

namespace voodoo {

namespace {

std::string human_duration(double s) {
    if (s < 0 || s > 1e7) {
        return "?";
    }
    const int total = static_cast<int>(s + 0.5);
    if (total >= 3600) {
        return fmt::format("{}h{:02}m", total / 3600, (total % 3600) / 60);
    }
    if (total >= 60) {
        return fmt::format("{}m{:02}s", total / 60, total % 60);
    }
    return fmt::format("{:.1f}s", s);
}

std::string human_rate(double r) {
    if (r >= 1e6) {
        return fmt::format("{:.2f}M", r / 1e6);
    }
    if (r >= 1e3) {
        return fmt::format("{:.1f}k", r / 1e3);
    }
    return fmt::format("{:.2f}", r);
}

}  // namespace

namespace {
thread_local int t_quiet = 0;
}  // namespace

progress::quiet_scope::quiet_scope() { ++t_quiet; }
progress::quiet_scope::~quiet_scope() { --t_quiet; }

bool progress::enabled() {
    const char * v = std::getenv("VOODOO_PROGRESS");
    return !(v && std::strcmp(v, "0") == 0);
}

progress::progress(std::string label, int64_t total, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), tty_(isatty(fileno(stderr)) != 0),
      quiet_(t_quiet > 0), start_(std::chrono::steady_clock::now()), last_draw_(start_) {}

progress::~progress() { finish(); }

void progress::add(int64_t n, const std::string & note) {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ += n;
    if (!note.empty()) {
        note_ = note;
    }
    draw(false);
}

void progress::resume_from(int64_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ += n;
    before_ += n;
    draw(false);
}

void progress::finish() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) {
        return;
    }
    finished_ = true;
    draw(true);
}

void progress::draw(bool final) {
    if (quiet_ || !enabled()) {
        return;
    }
    const auto now = std::chrono::steady_clock::now();
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double frac = total_ > 0 ? static_cast<double>(done_) / static_cast<double>(total_) : 0.0;
    if (!final) {
        if (tty_ && now - last_draw_ < std::chrono::milliseconds(100)) {
            return;
        }
        const int decile = static_cast<int>(frac * 10);
        // On a pipe the 100% line is left to finish(), so it is printed once.
        if (!tty_ && (decile == last_decile_ || done_ >= total_)) {
            return;
        }
        last_decile_ = decile;
    }
    last_draw_ = now;
    const double rate = elapsed > 0 ? static_cast<double>(done_ - before_) / elapsed : 0.0;
    const double eta = rate > 0 ? static_cast<double>(total_ - done_) / rate : -1.0;
    constexpr int k_width = 24;
    const int filled = static_cast<int>(frac * k_width);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(k_width, '.');
    std::string line = fmt::format("{} [{}] {}/{} {} {:>5.1f}% {} {}/s", label_, bar, done_, total_, unit_,
                                   100.0 * frac, final ? "in " + human_duration(elapsed) : "ETA " + human_duration(eta),
                                   human_rate(rate), unit_);
    if (!note_.empty()) {
        line += "  " + note_;
    }
    if (tty_) {
        fmt::print(stderr, "\r\033[K{}{}", line, final ? "\n" : "");
    } else {
        fmt::print(stderr, "{}\n", line);
    }
    std::fflush(stderr);
}

}  // namespace voodoo
