// The processes of a job as the coordinator knows them: each server and
// worker rank, whether it has registered (and with what), its credential,
// when it was last heard of, what it reported last; and the job's
// incarnation, the forming of the cluster those registrations belong to.
//
// Not thread-safe: CoordinatorService calls it under its mutex.
#ifndef ONEBIT_COORDINATOR_MEMBERSHIP_H_
#define ONEBIT_COORDINATOR_MEMBERSHIP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "net/liveness.h"
#include "proto/control.pb.h"

namespace onebit {

class Membership {
 public:
  struct Process {
    bool registered = false;
    control::RegisterRequest info;
    absl::Time last_seen;
    uint64_t step = 0;
    bool done = false;            // sent Done (workers exit after it)
    bool told = false;            // got SHUTDOWN/ABORT/STOP in a heartbeat reply
    bool reported_error = false;  // sent a heartbeat with its own error
    bool lost = false;            // presumed dead (no heartbeat in time)
    // The liveness probe (net/liveness.h) of a silent process: when it was
    // last probed, and last found still listening at its health endpoint.
    absl::Time probed_at = absl::InfinitePast();
    absl::Time answered_at = absl::InfinitePast();  // any answer (listening, gone, unknown)
    absl::Time listening_at = absl::InfinitePast();
    Liveness answer = Liveness::kUnknown;  // the answer at answered_at
    bool slow_said = false;                // the log said it is slow, not dead
    // When a peer last heard from it in the data plane (HeartbeatRequest.heard,
    // dated by the arrival of that peer's previous heartbeat), and whether
    // the log said it works while its own heartbeats are late.
    absl::Time heard_at = absl::InfinitePast();
    bool heard_said = false;
    std::optional<uint64_t> stop_ack;  // workers, while stopping: steps begun
    std::vector<control::ShardChecksum> checksums;
    std::string credential;  // issued at its registration (RegisterReply.credential)
  };

  // Every rank unregistered.
  Membership(uint32_t servers, uint32_t workers);

  // "server 1", "worker 0".
  static std::string Name(control::Role role, uint32_t rank);
  // "server", "worker".
  static const char* RoleName(control::Role role) {
    return role == control::SERVER ? "server" : "worker";
  }
  // The role a process of `role` exchanges data with: a server's workers, a
  // worker's servers.
  static control::Role PeerRole(control::Role role) {
    return role == control::SERVER ? control::WORKER : control::SERVER;
  }

  // The servers for SERVER, else the workers.
  std::vector<Process>& Group(control::Role role) {
    return role == control::SERVER ? servers_ : workers_;
  }
  const std::vector<Process>& Group(control::Role role) const {
    return role == control::SERVER ? servers_ : workers_;
  }
  std::vector<Process>& servers() { return servers_; }
  const std::vector<Process>& servers() const { return servers_; }
  std::vector<Process>& workers() { return workers_; }
  const std::vector<Process>& workers() const { return workers_; }

  // A registered process: a server or worker of a rank the job has.
  bool IsRegistered(control::Role role, uint32_t rank) const;
  // A registered process whose request carries its credential.
  bool IsOwner(control::Role role, uint32_t rank, const std::string& credential) const;
  bool AllRegistered() const;
  // The ranks not registered, e.g. "server 1, worker 0".
  std::string Missing() const;
  // Every process counts as heard from at `now`.
  void SeenAllAt(absl::Time now);
  // The first worker that has finished (sent Done); nullopt when none has.
  std::optional<uint32_t> FinishedWorker() const;
  // The most steps any worker is known to have completed, at least `step`.
  uint64_t FurthestWorkerStep(uint64_t step) const;
  // A roll-back to the checkpoint of `step`: every process is to register
  // again, its Done, stop acknowledgement and checksums forgotten.
  void ExpectRejoin(uint64_t step);
  // True once every live process has been told the outcome (or it exited).
  bool EveryoneTold() const;
  // True once no registered worker may still send metrics: each has
  // finished, reported its own error or been presumed dead.
  bool WorkersSilent() const;

  // This forming of the cluster (RegisterReply.incarnation; 0 until the
  // first NewIncarnation) and why it was formed again, if it was.
  uint64_t incarnation() const { return incarnation_; }
  const std::string& rejoin_why() const { return rejoin_why_; }
  // Processes of an earlier forming (or of the job before the coordinator
  // restarted) must not pass for this one's: a fresh random incarnation.
  void NewIncarnation(std::string why);

 private:
  std::vector<Process> servers_;
  std::vector<Process> workers_;
  uint64_t incarnation_ = 0;
  std::string rejoin_why_;  // what the last roll-back was for
};

// A random 64-bit id, never 0: a job's id, and each incarnation's, so that
// no earlier one (of this coordinator or of one before a restart) can be
// taken for it. Thread-safe.
uint64_t NewRandomId();

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_MEMBERSHIP_H_
