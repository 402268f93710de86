// --freeze auto on the coordinator's side: each server reports, every
// window of steps, how far v moved on its shard (FreezeCheck); a check is
// decided once every server with a non-empty shard has reported it, in
// order, by the rule of optim/reference.h AutoFreezeStep, until one fixes
// the first compression step. Records each decided check for summary.json.
//
// Not thread-safe: CoordinatorService calls it under its mutex.
#ifndef ONEBIT_COORDINATOR_FREEZE_VOTE_H_
#define ONEBIT_COORDINATOR_FREEZE_VOTE_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "optim/optimizer.h"
#include "proto/checkpoint.pb.h"
#include "proto/control.pb.h"
#include "shard/shard_map.h"

namespace onebit {

class FreezeVote {
 public:
  explicit FreezeVote(FreezeOptions options) : options_(options) {}

  // The job's options, once the workers' settings are applied.
  void set_options(FreezeOptions options) { options_ = options; }
  const FreezeOptions& options() const { return options_; }

  // Server `shard`'s check `c` (ignored unless the freeze is automatic and
  // undecided); decides every check now complete under `map`. `job_steps`
  // (0: not fixed) is for the log only.
  void Add(uint32_t shard, const control::FreezeCheck& c, const ShardMap& map, uint64_t job_steps);
  // Resuming from a checkpoint: the checks it had decided, and its decision
  // (0: none yet).
  void ResumeAt(uint64_t decided, uint64_t step) {
    decided_ = decided;
    step_ = step;
  }
  // Rolling back to a checkpoint: the same, and the checks under way go.
  void RollBackTo(uint64_t decided, uint64_t step);
  // Sets the manifest of the checkpoint of `step` to the vote as of that
  // step: the servers may have run ahead and had later checks decided;
  // those are decided again after a resume.
  void Record(uint64_t step, checkpoint::Manifest* m) const;

  uint64_t decided() const { return decided_; }  // steps completed at the last decided check
  uint64_t step() const { return step_; }        // first compression step; 0: undecided
  // Every check decided by this coordinator: steps completed, largest change.
  const std::vector<std::pair<uint64_t, double>>& history() const { return history_; }
  // Why the freeze never fired, for a job that ran without compression.
  std::string NeverFiredWarning() const;

 private:
  FreezeOptions options_;
  // completed steps -> shard -> VarianceChange
  std::map<uint64_t, std::map<uint32_t, double>> checks_;
  uint64_t decided_ = 0;
  uint64_t step_ = 0;
  std::vector<std::pair<uint64_t, double>> history_;
};

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_FREEZE_VOTE_H_
