// The checkpoints as the coordinator assembles them: the files each process
// reports for a step, the manifest of a step once every file is in, the
// failed checkpoints (counted, and their folders to remove), and the step
// of the last one written.
//
// Not thread-safe: CoordinatorService calls it under its mutex.
#ifndef ONEBIT_COORDINATOR_CHECKPOINT_MANIFESTS_H_
#define ONEBIT_COORDINATOR_CHECKPOINT_MANIFESTS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "proto/checkpoint.pb.h"
#include "proto/control.pb.h"

namespace onebit {

class CheckpointManifests {
 public:
  // Process `who`'s ("server 1") report of its file of a checkpoint. Only
  // the steps the schedule names (every `every`) and `stop_step` count, and
  // only past the last checkpoint written. Once `expected` files of a step
  // are in, its manifest is made from `manifest_of(step)` and the files and
  // queued for TakeComplete. Returns the error ("worker 0: disk full") when
  // this report fails the checkpoint: the caller then calls Failed.
  std::optional<std::string> AddPart(
      const std::string& who, const control::CheckpointPart& part, uint64_t every,
      std::optional<uint64_t> stop_step, size_t expected,
      absl::FunctionRef<checkpoint::Manifest(uint64_t step)> manifest_of);
  // The checkpoint of `step` cannot be completed: counted, and its folder
  // queued for TakeFailed.
  void Failed(uint64_t step, const std::string& error);
  // The manifest of the checkpoint of `step` is written.
  void Written(uint64_t step);
  // A job resumed from the checkpoint of `step`: none before it is due.
  void ResumeAt(uint64_t step) { last_written_ = step; }
  // A roll-back: the checkpoints under way are forgotten, and so are the
  // complete ones still waiting for rows past `rows_taken` (the reports
  // they wait for are dropped; the steps run again make them anew).
  void DropPending(uint64_t rows_taken);

  // The manifests completed since the last call (step order) whose steps
  // have every metrics row before them taken (step <= `rows_taken`): a
  // job resumed from a checkpoint keeps metrics.csv's rows before its step
  // and runs the rest again, so the rows must be written first. A worker's
  // row of step S - 1 can come after its file of step S (it goes with the
  // next step's start, so an evaluation can join it); the others wait.
  std::vector<checkpoint::Manifest> TakeComplete(uint64_t rows_taken);
  // The steps of failed checkpoints since the last call (a step again when
  // a part of it came after it failed).
  std::vector<uint64_t> TakeFailed();

  std::optional<uint64_t> last_written() const { return last_written_; }
  uint64_t written() const { return written_; }
  uint64_t errors() const { return errors_; }
  const std::string& last_error() const { return last_error_; }

 private:
  // step -> "server 1" / "worker 0" -> its file; a failed one drops the step.
  std::map<uint64_t, std::map<std::string, control::CheckpointPart>> parts_;
  std::vector<checkpoint::Manifest> complete_;
  uint64_t written_ = 0;
  std::optional<uint64_t> last_written_;
  uint64_t errors_ = 0;  // failed checkpoints, one per step
  std::string last_error_;
  std::vector<uint64_t> failed_dirs_;  // for TakeFailed
};

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_CHECKPOINT_MANIFESTS_H_
