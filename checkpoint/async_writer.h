// Writes state files beside training: the step loop hands over a snapshot
// (StateWriter, already a copy) and goes on; one background thread writes
// it and reports the outcome. At most one write runs and one waits, so
// memory stays bounded: a third Submit blocks until the first is written.
//
// Thread-safe. The destructor finishes what was submitted.
#ifndef ONEBIT_CHECKPOINT_ASYNC_WRITER_H_
#define ONEBIT_CHECKPOINT_ASYNC_WRITER_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "checkpoint/state_file.h"
#include "proto/control.pb.h"

namespace onebit {

class AsyncStateWriter {
 public:
  using Done = std::function<void(uint64_t step, const absl::StatusOr<WrittenFile>&)>;

  // `done` runs on the writer's thread after each write.
  explicit AsyncStateWriter(Done done);
  ~AsyncStateWriter();

  // Queues dir/name for `step`; blocks while two are already queued.
  void Submit(uint64_t step, StateWriter state, std::string dir, std::string name);
  // Blocks until everything submitted is written.
  void Flush();

 private:
  struct Job {
    uint64_t step;
    StateWriter state;
    std::string dir, name;
  };
  void Loop();

  const Done done_;
  absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// What a process reports to the coordinator about one written file.
control::CheckpointPart PartOf(uint64_t step, const absl::StatusOr<WrittenFile>& written);

}  // namespace onebit

#endif  // ONEBIT_CHECKPOINT_ASYNC_WRITER_H_
