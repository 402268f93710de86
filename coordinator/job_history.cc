#include "coordinator/job_history.h"

#include <algorithm>
#include <utility>

namespace onebit {

void JobHistory::ResumeFrom(CompleteCheckpoint checkpoint, uint32_t restarts,
                            uint64_t rolled_back_steps, uint64_t reached) {
  latest_ = checkpoint;
  resume_ = std::move(checkpoint);
  restarts_ = restarts;
  rolled_back_steps_ = rolled_back_steps;
  reached_ = std::max(reached, resume_->manifest.step());
  changed_ = true;
}

void JobHistory::RollBack(uint64_t reached) {
  rolled_back_steps_ += reached - latest_->manifest.step();
  reached_ = reached;
  changed_ = true;
  ++restarts_;
  ++rollbacks_;
  resume_ = latest_;
}

void JobHistory::CountRolledBack(uint64_t steps_done, uint64_t job_steps) {
  // Only while rolling back (or resuming) from a checkpoint; a count past
  // the job's end would be made up.
  if (!resume_ || steps_done <= reached_ || (job_steps > 0 && steps_done > job_steps)) return;
  rolled_back_steps_ += steps_done - reached_;
  reached_ = steps_done;
  changed_ = true;
}

void JobHistory::Written(CompleteCheckpoint checkpoint) {
  const uint64_t step = checkpoint.manifest.step();
  if (!latest_ || latest_->manifest.step() < step) latest_ = std::move(checkpoint);
}

std::optional<CompleteCheckpoint> JobHistory::TakeToRecord() {
  if (!changed_ || !latest_) return std::nullopt;
  changed_ = false;
  latest_->manifest.set_restarts(restarts_);
  latest_->manifest.set_rolled_back_steps(rolled_back_steps_);
  return latest_;
}

}  // namespace onebit
