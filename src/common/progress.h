// A progress bar for long work: done/total, rate and ETA on one line of stderr, redrawn at most
// ten times a second on a terminal; on a pipe or in CI, a plain line every 10% so logs stay short.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace voodoo {

class progress {
public:
    /// `label` heads the line ("candidates"), `unit` names what is counted ("tensors", "tok").
    progress(std::string label, int64_t total, std::string unit);
    ~progress();
    progress(const progress &) = delete;
    progress & operator=(const progress &) = delete;

    /// Adds n to the count done (thread-safe). `note` (optional) is shown after the rate.
    void add(int64_t n, const std::string & note = {});
    /// Counts n as done before this bar started (a resumed job's finished steps): shown in the count, left out of the
    /// rate and the ETA, which are this run's (a new user's trial read a resumed training's rate as millions a second).
    void resume_from(int64_t n);
    /// Ends the line with the final count, rate and elapsed time (also done by the destructor).
    void finish();

    /// Set VOODOO_PROGRESS=0 to silence every bar (tests do).
    static bool enabled();

    /// While alive on a thread, bars made on that thread draw nothing (work in the background, whose bars would
    /// cut into the foreground's lines: quantize's eval ahead).
    class quiet_scope {
    public:
        quiet_scope();
        ~quiet_scope();
        quiet_scope(const quiet_scope &) = delete;
        quiet_scope & operator=(const quiet_scope &) = delete;
    };

private:
    void draw(bool final);

    std::string label_;
    std::string unit_;
    std::string note_;
    int64_t total_;
    int64_t done_ = 0;
    int64_t before_ = 0;            // of done_, counted by resume_from (not this run's work)
    int last_decile_ = -1;
    bool tty_;
    bool finished_ = false;
    bool quiet_ = false;            // made under a quiet_scope
    std::chrono::steady_clock::time_point start_;
    std::chrono::steady_clock::time_point last_draw_;
    std::mutex mutex_;
};

}  // namespace voodoo
