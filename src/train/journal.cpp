#include "train/journal.h"

#include "common/error.h"
#include "train/journal_file.h"

#include <fmt/format.h>

#include <sstream>

namespace voodoo {

void save_journal(const std::string & path, const std::string & fingerprint, int step,
                  const std::vector<gated_tensor> & gated, torch::optim::Optimizer & opt) {
    torch::serialize::OutputArchive a;
    a.write("fingerprint", c10::IValue(fingerprint));
    a.write("step", torch::tensor(static_cast<int64_t>(step)));
    for (size_t i = 0; i < gated.size(); ++i) {
        a.write(fmt::format("gate.{}", i), gated[i].gate.detach().cpu());
    }
    torch::serialize::OutputArchive o;
    opt.save(o);
    a.write("optimizer", o);
    std::ostringstream archive;
    a.save_to(archive);
    write_journal_file(path, archive.view());
}

int load_journal(const std::string & path, const std::string & fingerprint, std::vector<gated_tensor> & gated,
                 torch::optim::Optimizer & opt, int max_steps) {
    // The envelope first: a damaged archive would reach LibTorch's deserializer, which can crash on one. Then
    // everything is read before anything is set; LibTorch says what is wrong with an archive of the right checksum
    // (not one Voodoo wrote) by throwing c10::Error or, from deeper down, another std::exception: each becomes one
    // error naming the file.
    const std::string bytes = read_journal_file(path);
    auto cannot_read = [&](const std::string & why) {
        fail("journal '{}' cannot be read ({}); delete it to start the training over", path, why);
    };
    c10::IValue stored_fingerprint;
    torch::Tensor step;
    std::vector<torch::Tensor> gates(gated.size());
    torch::serialize::InputArchive optimizer;
    try {
        torch::serialize::InputArchive a;
        a.load_from(bytes.data(), bytes.size());
        a.read("fingerprint", stored_fingerprint);
        a.read("step", step);
        for (size_t i = 0; i < gated.size(); ++i) {
            a.read(fmt::format("gate.{}", i), gates[i]);
        }
        a.read("optimizer", optimizer);
    } catch (const c10::Error & e) {
        cannot_read(e.what_without_backtrace());
    } catch (const std::exception & e) {
        cannot_read(e.what());
    }
    if (!stored_fingerprint.isString() || stored_fingerprint.toStringRef() != fingerprint) {
        fail("journal '{}' belongs to a run with other options, menus or data; resume with the same command, "
             "or start a new run directory",
             path);
    }
    if (step.numel() != 1 || step.scalar_type() != torch::kLong || step.item<int64_t>() < 0 ||
        step.item<int64_t>() > max_steps) {
        cannot_read(fmt::format("its step is not a count in [0, {}]", max_steps));
    }
    for (size_t i = 0; i < gated.size(); ++i) {
        if (gates[i].sizes() != gated[i].gate.sizes() || !torch::isfinite(gates[i]).all().item<bool>()) {
            cannot_read(fmt::format("gate {} is not {} finite logits", i, gated[i].gate.numel()));
        }
    }
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < gated.size(); ++i) {
        gated[i].gate.copy_(gates[i]);
    }
    try {
        opt.load(optimizer);
    } catch (const c10::Error & e) {
        cannot_read(fmt::format("the optimizer's state: {}", e.what_without_backtrace()));
    } catch (const std::exception & e) {
        cannot_read(fmt::format("the optimizer's state: {}", e.what()));
    }
    return static_cast<int>(step.item<int64_t>());
}

}  // namespace voodoo
