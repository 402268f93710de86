// A process's part in a job, the same for a server and a worker: it
// registers with the coordinator (and again, under the same rank, after a
// roll-back), keeps the credential and incarnation the coordinator hands
// out, runs the heartbeat, and writes and reports its checkpoint files.
// What is the role's own comes in as its RegisterRequest's fields and as
// callbacks: a snapshot of the state to write, and how to load a
// checkpoint back (docs/design.md §2, "Checkpoints" and "A roll-back").
//
// Not thread-safe: one thread (the process's step or serve loop) calls
// every method. heartbeat() is thread-safe in itself; the writer's own
// thread reports each written file through it.
#ifndef ONEBIT_JOB_MEMBER_H_
#define ONEBIT_JOB_MEMBER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "checkpoint/async_writer.h"
#include "checkpoint/state_file.h"
#include "net/control.h"
#include "proto/control.grpc.pb.h"
#include "security/job_secret.h"

namespace onebit {

struct JobMemberOptions {
  // The coordinator, "host:port". Required.
  std::string coordinator;
  // How long the first registration waits for the coordinator and for the
  // whole cluster to register (> 0: CheckTimeout). As ServerOptions' and
  // WorkerOptions' (include/onebit), whose value the processes pass.
  absl::Duration register_timeout = absl::Seconds(60);
  // When *stop_signal becomes non-zero, the coordinator is asked to stop
  // the job (Heartbeater::WatchStopSignal). Null: never. Must outlive this.
  const std::atomic<int>* stop_signal = nullptr;
  // The most arrays one snapshot holds: the last snapshot's buffers are
  // kept for the next (SnapshotBuffers), so that copying is not faulting.
  size_t snapshot_arrays = 0;
  // When set: called after each checkpoint file this process writes (or
  // fails to), on the writer's thread (e.g. to count it in the metrics).
  std::function<void(const absl::StatusOr<WrittenFile>&)> on_written;
};

class JobMember {
 public:
  // `request`: what this process registers as (its role, and the fields
  // that are the role's own: rank asked for, endpoints, keys, what a
  // worker declares). The channel is secured as `security` says.
  JobMember(JobMemberOptions options, const Security& security, control::RegisterRequest request);
  // Finishes the files handed to the writer, then stops the heartbeat.
  ~JobMember();

  JobMember(const JobMember&) = delete;
  JobMember& operator=(const JobMember&) = delete;

  // Registers and waits for the cluster to form (RegisterWithCoordinator,
  // register_timeout), then starts the heartbeat. Call once, first; its
  // errors are the registration's (nothing is reported to the coordinator).
  absl::Status Join();

  // After the coordinator said REJOIN (rolling_back()): finishes the files
  // handed to the writer, stops the heartbeat, registers again under this
  // rank naming the incarnation it leaves (waiting up to the larger of
  // register_timeout and RejoinWait), and starts a new heartbeat.
  // `steps_done`: the steps this process had completed; the heartbeat
  // starts there, and a worker reports it (RegisterRequest.
  // rejoin_steps_done: what the roll-back costs). Errors: "registering
  // again: ..." (then without a heartbeat), or an InternalError when the
  // reply is not of the same job, rank and shard map with a checkpoint to
  // continue from (with the new heartbeat, to report it).
  absl::Status Rejoin(uint64_t steps_done = 0);

  // The rest requires a successful Join; heartbeat(), Checkpoint and
  // FlushCheckpoints a running heartbeat too (has_heartbeat()).

  // The coordinator's reply to the last registration: the job, this
  // process's rank and credential, the incarnation, config and shard map.
  const control::RegisterReply& registration() const { return reg_; }
  uint32_t rank() const { return reg_.rank(); }
  uint64_t incarnation() const { return reg_.incarnation(); }
  // This incarnation's data-plane job id (DataPlaneId).
  uint64_t data_plane_id() const;
  // How the coordinator names this process: "server 2", "worker 0".
  std::string name() const;

  // Whether a heartbeat runs: after Join or Rejoin, not after a Rejoin
  // that failed to register.
  bool has_heartbeat() const { return heartbeat_ != nullptr; }
  // Requires has_heartbeat().
  Heartbeater& heartbeat() const { return *heartbeat_; }
  // The data-plane peers (a server's workers, a worker's servers) heard
  // from, which every heartbeat of this member passes on: the data plane
  // marks them (net/liveness.h). The same object across Rejoin; requires a
  // Join.
  const std::shared_ptr<PeersHeard>& peers_heard() const { return peers_heard_; }
  // The coordinator said REJOIN: the job rolls back, and this process is
  // to Rejoin. False without a heartbeat.
  bool rolling_back() const;

  // `st` as the coordinator hears of it: "<name>: <message>".
  absl::Status Named(const absl::Status& st) const;
  // Tells the coordinator this process failed with Named(st): one RPC, best
  // effort, and the job fails. Nothing without a heartbeat.
  void ReportFailure(const absl::Status& st);

  // Reads this process's state from the checkpoint the coordinator named
  // (RegisterReply.resume: a resumed job, or after a roll-back) and
  // restores it. Called on the caller's thread, within LoadCheckpoint.
  using Load = absl::FunctionRef<absl::Status(const control::ResumePoint& resume)>;
  // Calls `load` when the registration names a checkpoint to continue
  // from, and returns its status; OK without one.
  absl::Status LoadCheckpoint(Load load);

  // Copies this process's state for a checkpoint into a state file, taking
  // the copies' memory from `buffers` where it can; the caller goes on
  // changing its state as soon as this returns. Called on the caller's
  // thread, within Checkpoint.
  using Snapshot =
      absl::FunctionRef<absl::StatusOr<StateWriter>(std::shared_ptr<SnapshotBuffers> buffers)>;
  // Whether the job's schedule (--checkpoint_every) saves after `step`.
  bool CheckpointDue(uint64_t step) const;
  // Saves the state after `step` completed steps, unless step is 0 or
  // already saved in this incarnation (or is the checkpoint it continued
  // from): makes the step's folder under the job's --checkpoint_dir, takes
  // `snapshot` and hands it to the writer, whose thread writes it as
  // "<role>-<rank>.state" and reports the part to the coordinator (a file
  // that cannot be written, as a failed part). A folder that cannot be made
  // is reported as a failed part too, and OK returned: the coordinator
  // counts the checkpoint as failed. Only the snapshot's error comes back,
  // as "checkpoint of step N: ...", for the caller to fail with.
  absl::Status Checkpoint(uint64_t step, Snapshot snapshot);
  // Blocks until every file handed to the writer is written and its part
  // queued for the heartbeat (so that Done carries it).
  void FlushCheckpoints();

 private:
  // Takes `reg` as this incarnation's and starts its heartbeat at `steps_done`.
  void Start(control::RegisterReply reg, uint64_t steps_done);
  // The writer first: it reports through the heartbeat.
  void Stop();

  const JobMemberOptions options_;
  const std::unique_ptr<control::Coordinator::Stub> stub_;
  const control::RegisterRequest request_;  // as first sent
  const std::shared_ptr<SnapshotBuffers> buffers_;
  control::RegisterReply reg_;
  uint64_t checkpointed_ = 0;  // the last step saved in this incarnation
  std::unique_ptr<Heartbeater> heartbeat_;
  std::shared_ptr<PeersHeard> peers_heard_;
  std::unique_ptr<AsyncStateWriter> writer_;  // reports through heartbeat_
};

}  // namespace onebit

#endif  // ONEBIT_JOB_MEMBER_H_
