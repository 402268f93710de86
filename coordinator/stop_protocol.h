// A stop asked for while the job runs (a signal to a process, RequestStop):
// who asked, the deadline for the checkpoint to stop at, and the stop step
// once decided: the most steps any worker had begun when it heard of the
// stop (its acknowledgement), so that every worker can reach it.
//
// Not thread-safe: CoordinatorService calls it under its mutex.
#ifndef ONEBIT_COORDINATOR_STOP_PROTOCOL_H_
#define ONEBIT_COORDINATOR_STOP_PROTOCOL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/membership.h"

namespace onebit {

class StopProtocol {
 public:
  // The stop asked for by `who` (e.g. "SIGTERM to worker 2"), its
  // checkpoint due by `deadline`. Once only: the caller checks stopping().
  void Begin(std::string who, absl::Time deadline);
  // Once every worker still running has acknowledged the stop: fixes the
  // stop step and returns true (false when undecided, or decided before).
  bool Decide(const std::vector<Membership::Process>& workers);

  bool stopping() const { return !by_.empty(); }
  const std::string& by() const { return by_; }
  std::optional<uint64_t> step() const { return step_; }
  // Stopping, and the checkpoint to stop at is late.
  bool Overdue(absl::Time now) const { return stopping() && now > deadline_; }
  // Why the job fails when Overdue.
  std::string OverdueReason() const;
  // The job's outcome once the checkpoint of step() is complete (or at
  // step 0, with nothing to save).
  std::string StoppedReason() const;

 private:
  std::string by_;  // non-empty: stopping, asked by this
  std::optional<uint64_t> step_;
  absl::Time deadline_;
};

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_STOP_PROTOCOL_H_
