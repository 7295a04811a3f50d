// The training journal (<run_dir>/journal.pt): what `voodoo train --resume` continues from. A LibTorch archive
// (torch::serialize, a zip of pickles) in a checksummed envelope (train/journal_file.h), written every
// --journal-every steps and at the end.
#pragma once

#include "train/gated.h"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace voodoo {

/// Writes the journal atomically: the run's fingerprint, the number of steps done, each tensor's gate logits
/// ([K] f32, K = its menu's size) and the optimizer's state.
void save_journal(const std::string & path, const std::string & fingerprint, int step,
                  const std::vector<gated_tensor> & gated, torch::optim::Optimizer & opt);

/// Reads the journal into the gates and the optimizer and returns the steps it holds.
/// Throws voodoo::error naming the file, and changing no gate, when it is cut short, damaged or not a journal
/// (read_journal_file), when LibTorch cannot read the archive (its own reason is quoted), when it belongs to a run
/// with another fingerprint, when a gate is missing, of another length or not finite, or when the step is outside
/// [0, max_steps]; and when the optimizer's state does not load (the gates are then already set: the run stops).
int load_journal(const std::string & path, const std::string & fingerprint, std::vector<gated_tensor> & gated,
                 torch::optim::Optimizer & opt, int max_steps);

}  // namespace voodoo
