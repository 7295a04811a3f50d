#include "pipeline/hf_source.h"

#include "common/error.h"
#include "common/file.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#ifndef VOODOO_CONVERT_HF_DEFAULT
#define VOODOO_CONVERT_HF_DEFAULT ""
#endif

namespace fs = std::filesystem;

namespace voodoo {

namespace {

/// Runs args (args[0] looked up in PATH) with stdout and stderr into `out_fd` and waits. Returns the exit status,
/// or -1 when the program could not be started (errno_out = the reason), or 128 + signal.
int run_program(const std::vector<std::string> & args, int out_fd, int & errno_out) {
    std::vector<char *> argv;
    for (const std::string & a : args) {
        argv.push_back(const_cast<char *>(a.c_str()));
    }
    argv.push_back(nullptr);
    int report[2];  // the child writes its exec errno here; closed on a successful exec
    if (pipe2(report, O_CLOEXEC) != 0) {
        fail("cannot start {}: {}", args[0], std::strerror(errno));
    }
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
        fail("cannot start {}: {}", args[0], std::strerror(errno));
    }
    if (pid == 0) {
        close(report[0]);
        dup2(out_fd, STDOUT_FILENO);
        dup2(out_fd, STDERR_FILENO);
        execvp(argv[0], argv.data());
        const int e = errno;
        [[maybe_unused]] const ssize_t w = write(report[1], &e, sizeof e);
        _exit(127);
    }
    close(report[1]);
    int exec_errno = 0;
    const ssize_t n = read(report[0], &exec_errno, sizeof exec_errno);
    close(report[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (n == static_cast<ssize_t>(sizeof exec_errno)) {
        errno_out = exec_errno;
        return -1;
    }
    if (WIFSIGNALED(status)) {
        return 128 + WTERMSIG(status);
    }
    return WEXITSTATUS(status);
}

std::string read_text(const std::string & path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

/// The last `n` lines of a text.
std::string tail_lines(const std::string & text, int n) {
    size_t end = text.find_last_not_of('\n');
    if (end == std::string::npos) {
        return "";
    }
    size_t pos = end + 1;
    for (int i = 0; i < n && pos != std::string::npos && pos > 0; ++i) {
        pos = text.rfind('\n', pos - 1);
    }
    return text.substr(pos == std::string::npos ? 0 : pos + 1, end + 1 - (pos == std::string::npos ? 0 : pos + 1));
}

bool by_content(const std::string & name) {
    return name == "config.json" || name == "generation_config.json" || name == "special_tokens_map.json" ||
           name == "tokenizer.model" || name.rfind("tokenizer", 0) == 0 || name == "added_tokens.json";
}

std::string hex64(uint64_t v) {
    return fmt::format("{:016x}", v);
}

/// The digest naming a conversion: every regular file of the folder (sorted by name), by content for the small
/// configuration and tokenizer files and by size and modification time for the weights; and the converter.
std::string checkpoint_key(const fs::path & dir, const std::string & converter) {
    std::vector<fs::path> files;
    for (const fs::directory_entry & e : fs::directory_iterator(dir)) {
        if (e.is_regular_file()) {
            files.push_back(e.path());
        }
    }
    std::sort(files.begin(), files.end());
    XXH3_state_t * st = XXH3_createState();
    XXH3_64bits_reset(st);
    auto add = [&](const std::string & s) {
        XXH3_64bits_update(st, s.data(), s.size());
        XXH3_64bits_update(st, "\0", 1);
    };
    for (const fs::path & f : files) {
        const std::string name = f.filename().string();
        add(name);
        if (by_content(name)) {
            add(read_text(f.string()));
        } else {
            add(std::to_string(fs::file_size(f)));
            add(std::to_string(fs::last_write_time(f).time_since_epoch().count()));
        }
    }
    std::error_code ec;
    add(converter);
    add(std::to_string(fs::file_size(converter, ec)));
    add(std::to_string(fs::last_write_time(converter, ec).time_since_epoch().count()));
    const uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return hex64(h);
}

std::string name_of(const std::string & path) {
    fs::path p(path);
    while (!p.empty() && p.filename().empty()) {
        p = p.parent_path();  // "dir/" → "dir"
    }
    if (p.filename() == "." || p.filename() == "..") {
        p = fs::absolute(p).lexically_normal();
        while (!p.empty() && p.filename().empty()) {
            p = p.parent_path();
        }
    }
    return p.filename().string();
}

}  // namespace

std::string hf_python() {
    const char * py = std::getenv("VOODOO_PYTHON");
    return py && *py ? py : "python3";
}

std::string hf_converter_path() {
    const char * c = std::getenv("VOODOO_CONVERT_HF");
    return c && *c ? c : VOODOO_CONVERT_HF_DEFAULT;
}

bool is_hf_folder(const std::string & path) {
    std::error_code ec;
    return fs::is_directory(path, ec) && fs::is_regular_file(fs::path(path) / "config.json", ec);
}

std::string default_work_folder(const std::string & path) {
    const std::string name = name_of(path);
    return (is_hf_folder(path) ? name : fs::path(name).stem().string()) + ".voodoo";
}

std::string gguf_of_source(const std::string & path, const std::string & cache_dir) {
    if (!is_hf_folder(path)) {
        std::error_code ec;
        if (fs::is_directory(path, ec)) {
            fail("{}: a folder without config.json: give a GGUF file, or a Hugging Face model folder (config.json, "
                 "*.safetensors, tokenizer files)", path);
        }
        return path;
    }
    const fs::path dir(path);
    bool has_weights = false, has_spm = false;
    for (const fs::directory_entry & e : fs::directory_iterator(dir)) {
        const std::string n = e.path().filename().string();
        has_weights |= n.ends_with(".safetensors") || (n.rfind("pytorch_model", 0) == 0 && n.ends_with(".bin"));
        has_spm |= n == "tokenizer.model";
    }
    if (!has_weights) {
        fail("{}: a Hugging Face folder (it has config.json) with no weights: expected *.safetensors or "
             "pytorch_model*.bin beside it", path);
    }
    const std::string converter = hf_converter_path(), python = hf_python();
    const std::string name = name_of(path);
    const std::string by_hand = fmt::format("{} {} {} --outtype bf16 --outfile {}.bf16.gguf, then give {}.bf16.gguf "
                                            "to voodoo", python, converter.empty() ? "convert_hf_to_gguf.py" : converter,
                                            path, name, name);
    if (converter.empty() || !fs::is_regular_file(converter)) {
        fail("{}: converting a Hugging Face folder needs llama.cpp's convert_hf_to_gguf.py, and this build has none{}: "
             "set VOODOO_CONVERT_HF to its path (it is in the llama.cpp source, with gguf-py beside it)", path,
             converter.empty() ? "" : fmt::format(" at {}", converter));
    }
    const std::string key = checkpoint_key(dir, converter);
    // <cache_dir>/hf-<key>/<name>.gguf: named after the folder, so every file made from it is too.
    const fs::path out = fs::path(cache_dir) / fmt::format("hf-{}", key) / fmt::format("{}.gguf", name);
    if (fs::is_regular_file(out)) {
        fmt::print(stderr, "voodoo: {}: the Hugging Face checkpoint as GGUF: {} (converted before, unchanged since)\n",
                   path, out.string());
        return out.string();
    }

    // The converter's packages, asked of the interpreter itself.
    std::vector<std::string> modules = {"numpy", "torch", "transformers", "yaml"};
    if (has_spm) {
        modules.push_back("sentencepiece");
    }
    std::string missing;
    {
        std::FILE * said_file = std::tmpfile();  // what the interpreter prints (nothing is made in cache_dir yet)
        if (!said_file) {
            fail("cannot make a temporary file: {}", std::strerror(errno));
        }
        const int fd = fileno(said_file);
        std::vector<std::string> args = {python, "-c",
                                         "import importlib.util, sys\n"
                                         "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"};
        args.insert(args.end(), modules.begin(), modules.end());
        int err = 0;
        const int rc = run_program(args, fd, err);
        std::string said;
        std::rewind(said_file);
        for (int c; (c = std::fgetc(said_file)) != EOF;) {
            said.push_back(static_cast<char>(c));
        }
        std::fclose(said_file);
        const fs::path req = fs::path(converter).parent_path() / "requirements" / "requirements-convert_hf_to_gguf.txt";
        const std::string install = fmt::format("{} -m pip install -r {}", python, req.string());
        if (rc == -1) {
            fail("{}: a Hugging Face folder is converted to GGUF with Python, and '{}' cannot be run ({}): install "
                 "Python 3 (apt-get install python3 python3-pip) and the converter's packages ({}), or set "
                 "VOODOO_PYTHON to a Python that has them; or convert it yourself: {}",
                 path, python, std::strerror(err), install, by_hand);
        }
        if (rc != 0) {
            const std::string why = tail_lines(said, 3);
            fail("{}: '{}' did not run (exit {}){}{}; set VOODOO_PYTHON to a working Python 3, or convert it yourself: {}",
                 path, python, rc, why.empty() ? "" : ": ", why, by_hand);
        }
        missing = said.substr(0, said.find_last_not_of(" \n\r") + 1);
        if (!missing.empty()) {
            fail("{}: converting a Hugging Face folder needs Python packages that {} lacks: {} (needed: {}). "
                 "Install them: {}; or convert it yourself where they are: {}",
                 path, python, missing, fmt::join(modules, ", "), install, by_hand);
        }
    }

    const std::string log = (fs::path(cache_dir) / "convert.log").string();
    const fs::path tmp = out.parent_path() / fmt::format(".{}.gguf.tmp", name);
    fs::create_directories(out.parent_path());
    fs::remove(tmp);
    fmt::print(stderr, "voodoo: {}: converting the Hugging Face checkpoint to BF16 GGUF with llama.cpp's {} "
                       "(once; log: {})\n", path, fs::path(converter).filename().string(), log);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        fail("{}: cannot write {}: {}", cache_dir, log, std::strerror(errno));
    }
    int err = 0;
    const int rc = run_program({python, converter, path, "--outtype", "bf16", "--outfile", tmp.string()}, fd, err);
    close(fd);
    if (rc != 0 || !fs::is_regular_file(tmp)) {
        fs::remove(tmp);
        fail("{}: llama.cpp's converter failed ({}); the end of {}:\n{}", path,
             rc == -1 ? std::string(std::strerror(err)) : fmt::format("exit {}", rc), log, tail_lines(read_text(log), 8));
    }
    fs::rename(tmp, out);
    fmt::print(stderr, "voodoo: {}: converted to {} ({} bytes)\n", path, out.string(), file_size(out.string()));
    return out.string();
}

}  // namespace voodoo
