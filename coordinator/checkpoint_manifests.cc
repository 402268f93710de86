#include "coordinator/checkpoint_manifests.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace onebit {

std::optional<std::string> CheckpointManifests::AddPart(
    const std::string& who, const control::CheckpointPart& part, uint64_t every,
    std::optional<uint64_t> stop_step, size_t expected,
    absl::FunctionRef<checkpoint::Manifest(uint64_t step)> manifest_of) {
  const uint64_t step = part.step();
  // Only the steps the schedule names, and a stop's. (A part can arrive
  // before the heartbeat that says its sender got there.)
  const bool scheduled = every > 0 && step % every == 0;
  if (step == 0 || !(scheduled || (stop_step && step == *stop_step))) return std::nullopt;
  if (last_written_ && step <= *last_written_) return std::nullopt;
  // Bounded: a checkpoint still incomplete 16 checkpoints later never will be.
  while (parts_.size() >= 16 && parts_.begin()->first < step) parts_.erase(parts_.begin());
  auto& files = parts_[step];
  if (files.count("")) {
    // Failed already: this file (or what is left of it) goes too.
    failed_dirs_.push_back(step);
    return std::nullopt;
  }
  if (!part.error().empty()) {
    files.clear();
    files.emplace("", part);  // the mark of a failed one
    return absl::StrCat(who, ": ", part.error());
  }
  files[who] = part;
  if (files.size() < expected) return std::nullopt;
  checkpoint::Manifest m = manifest_of(step);
  for (const auto& [name, f] : files) {
    checkpoint::ManifestFile* e = m.add_files();
    e->set_name(f.name());
    e->set_size(f.size());
    e->set_crc32(f.crc32());
  }
  complete_.push_back(std::move(m));
  parts_.erase(parts_.begin(), parts_.upper_bound(step));
  return std::nullopt;
}

void CheckpointManifests::Failed(uint64_t step, const std::string& error) {
  ++errors_;
  last_error_ = absl::StrCat("step ", step, ": ", error);
  failed_dirs_.push_back(step);  // the files written before the failure
}

void CheckpointManifests::Written(uint64_t step) {
  ++written_;
  last_written_ = std::max(step, last_written_.value_or(0));
}

void CheckpointManifests::DropPending(uint64_t rows_taken) {
  parts_.clear();
  complete_.erase(
      std::remove_if(complete_.begin(), complete_.end(),
                     [&](const checkpoint::Manifest& m) { return m.step() > rows_taken; }),
      complete_.end());
}

std::vector<checkpoint::Manifest> CheckpointManifests::TakeComplete(uint64_t rows_taken) {
  // complete_ is in step order: a prefix is ready.
  auto ready = std::find_if(complete_.begin(), complete_.end(),
                            [&](const checkpoint::Manifest& m) { return m.step() > rows_taken; });
  std::vector<checkpoint::Manifest> taken(std::make_move_iterator(complete_.begin()),
                                          std::make_move_iterator(ready));
  complete_.erase(complete_.begin(), ready);
  return taken;
}

std::vector<uint64_t> CheckpointManifests::TakeFailed() { return std::exchange(failed_dirs_, {}); }

}  // namespace onebit
