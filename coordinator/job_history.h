// Where the job continues from and what it has been through: the
// checkpoint it resumed or last rolled back to, the newest checkpoint
// written (what a roll-back goes to), and the history that manifests and
// summary.json carry: restarts, steps run again, live roll-backs.
//
// Not thread-safe: CoordinatorService calls it under its mutex.
#ifndef ONEBIT_COORDINATOR_JOB_HISTORY_H_
#define ONEBIT_COORDINATOR_JOB_HISTORY_H_

#include <cstdint>
#include <optional>

#include "checkpoint/checkpoint_dir.h"

namespace onebit {

class JobHistory {
 public:
  // A coordinator started again continues from `checkpoint`, with the
  // job's `restarts` and `rolled_back_steps` (this resume included);
  // `reached`: the most steps the interrupted run is known to have completed.
  void ResumeFrom(CompleteCheckpoint checkpoint, uint32_t restarts, uint64_t rolled_back_steps,
                  uint64_t reached);
  // A live roll-back to latest() (which must be set), the furthest worker
  // having completed `reached` steps: those past the checkpoint are run again.
  void RollBack(uint64_t reached);
  // Processes that outlived the coordinator before this one registered
  // again: a live roll-back too.
  void CountLiveRejoin() { ++rollbacks_; }
  // A worker registering again after a roll-back had completed
  // `steps_done` of a job of `job_steps` (0: not fixed): those beyond what
  // was counted are run again too.
  void CountRolledBack(uint64_t steps_done, uint64_t job_steps);
  // The manifest of `checkpoint` is written: the newest, unless one after
  // it was.
  void Written(CompleteCheckpoint checkpoint);
  // After the history changed: latest() with the history as of now, to
  // write over its manifest; nullopt when nothing changed.
  std::optional<CompleteCheckpoint> TakeToRecord();

  const std::optional<CompleteCheckpoint>& resume() const { return resume_; }
  const std::optional<CompleteCheckpoint>& latest() const { return latest_; }
  uint32_t restarts() const { return restarts_; }
  uint64_t rolled_back_steps() const { return rolled_back_steps_; }
  uint32_t rollbacks() const { return rollbacks_; }

 private:
  std::optional<CompleteCheckpoint> resume_;
  std::optional<CompleteCheckpoint> latest_;  // newest written
  uint32_t restarts_ = 0;
  // Steps completed (by the furthest worker) beyond the checkpoint rolled
  // back to, summed over the roll-backs. The last roll-back's furthest step
  // known so far: workers registering again may report more.
  uint64_t rolled_back_steps_ = 0;
  uint64_t reached_ = 0;
  bool changed_ = false;    // for TakeToRecord
  uint32_t rollbacks_ = 0;  // live ones, by this coordinator
};

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_JOB_HISTORY_H_
