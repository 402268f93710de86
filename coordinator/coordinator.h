// The coordinator's gRPC service (proto/control.proto): rendezvous, heartbeats
// and failure detection, metrics collection, the final summary. It
// authenticates each call, keeps the job's state machine (registering,
// running, an outcome) and dispatches to the parts that each own a duty:
// Membership (the processes, the incarnation), DeclaredSettings (what the
// workers declare), MetricsTable (the rows), CheckpointManifests,
// JobHistory (resumes and roll-backs), FreezeVote (--freeze auto) and
// StopProtocol; none of those locks, all are kept under mu_.
//
// Thread-safe: gRPC calls it from its threads; the owner polls Tick() and
// state from another.
#ifndef ONEBIT_COORDINATOR_COORDINATOR_H_
#define ONEBIT_COORDINATOR_COORDINATOR_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "checkpoint/checkpoint_dir.h"
#include "coordinator/checkpoint_manifests.h"
#include "coordinator/declared_settings.h"
#include "coordinator/freeze_vote.h"
#include "coordinator/job_history.h"
#include "coordinator/job_state.h"
#include "coordinator/membership.h"
#include "coordinator/metrics_table.h"
#include "coordinator/replica_verdict.h"
#include "coordinator/stop_protocol.h"
#include "job/run_folder.h"
#include "onebit/server.h"
#include "optim/optimizer.h"
#include "proto/checkpoint.pb.h"
#include "proto/control.grpc.pb.h"
#include "security/job_secret.h"
#include "shard/shard_map.h"
#include "util/refusal_log.h"

namespace onebit {

class CoordinatorService final : public control::Coordinator::Service {
 public:
  // kStopped: ended early on request, after a complete checkpoint (or at
  // step 0, with nothing to save); it resumes from there.
  enum class State { kRegistering, kRunning, kFinished, kFailed, kStopped };

  // `config` must be valid (ValidateConfig); `given`: the settings the job
  // set explicitly (the workers may declare the others). The shard map is
  // built once the cluster has formed: from config.model().dim(), or for --model
  // external from the d every worker declared.
  // `security`: every call must carry its job credential (CheckCallCredential),
  // except under --insecure.
  CoordinatorService(control::TrainingConfig config, std::set<std::string> given, uint64_t job_id,
                     absl::Duration register_timeout, Security security);

  // Before serving: the job continues from `checkpoint` (its config is
  // checked against the job's once the cluster forms); `prior_rows`:
  // metrics.csv's rows of the steps before it, for summary.json;
  // `restarts` and `rolled_back_steps`: the job's history, this resume
  // included; `reached`: the most steps the interrupted run is known to
  // have completed (from metrics.csv), of which those past the checkpoint
  // are in rolled_back_steps already. Workers that outlived the last
  // coordinator report further steps when they register again.
  void ResumeFrom(CompleteCheckpoint checkpoint, std::vector<MetricsRow> prior_rows,
                  uint32_t restarts, uint64_t rolled_back_steps, uint64_t reached)
      ABSL_LOCKS_EXCLUDED(mu_);

  grpc::Status Register(grpc::ServerContext* ctx, const control::RegisterRequest* req,
                        control::RegisterReply* reply) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const control::HeartbeatRequest* req,
                         control::HeartbeatReply* reply) override;
  grpc::Status Done(grpc::ServerContext* ctx, const control::DoneRequest* req,
                    control::DoneReply* reply) override;
  grpc::Status Status(grpc::ServerContext* ctx, const control::StatusRequest* req,
                      control::StatusReply* reply) override;

  // Checks the registration deadline and heartbeat timeouts; call often.
  // A process silent for half --heartbeat_timeout is probed (a TCP connect
  // to its health endpoint, outside the lock, at most 1 s): one still
  // listening is slow, not dead, and gets up to kSlowFactor times the
  // timeout; one that is gone or does not answer is presumed dead at the
  // timeout, as without the probe.
  void Tick() ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr int kSlowFactor = 6;

  State state() const ABSL_LOCKS_EXCLUDED(mu_);
  std::string reason() const ABSL_LOCKS_EXCLUDED(mu_);
  // True once every live process has been told the outcome (or it exited).
  bool EveryoneTold() const ABSL_LOCKS_EXCLUDED(mu_);
  // True unless the job failed and a worker may still send the metrics of
  // the steps it completed: once the job has failed, every registered
  // worker has finished, reported an error itself (that report carries its
  // last metrics; see Heartbeater::ReportError) or been presumed dead.
  bool WorkersReportedLastMetrics() const ABSL_LOCKS_EXCLUDED(mu_);

  // Checkpoints whose every file (each server's, each worker's) has been
  // reported since the last call, as manifests to write (step order); one
  // waits until TakeNewRows has taken every row before its step.
  std::vector<checkpoint::Manifest> TakeCompleteCheckpoints() ABSL_LOCKS_EXCLUDED(mu_);
  // The manifest of `checkpoint` is written: counted for summary.json, and
  // the job rolls back to it if a process is lost.
  void CheckpointWritten(CompleteCheckpoint checkpoint) ABSL_LOCKS_EXCLUDED(mu_);
  // The checkpoint of `step` cannot be completed (a file or the manifest
  // could not be written: `error`): counted for summary.json, and under
  // --checkpoint_failure=fail the job fails naming it.
  void CheckpointFailed(uint64_t step, const std::string& error) ABSL_LOCKS_EXCLUDED(mu_);
  // The steps of failed checkpoints whose folders are to be removed since
  // the last call (a step again when a part of it came after it failed).
  std::vector<uint64_t> TakeFailedCheckpoints() ABSL_LOCKS_EXCLUDED(mu_);
  // After a roll-back changed the job's history (restarts,
  // rolled_back_steps): the checkpoint rolled back to, its manifest carrying
  // the history as of now, to write over the old one, so that a coordinator
  // started after this one counts it; nullopt when nothing changed.
  std::optional<CompleteCheckpoint> TakeHistoryToRecord() ABSL_LOCKS_EXCLUDED(mu_);

  // A stop asked for by `who` (e.g. "SIGTERM to worker 2"): a running job
  // with a --checkpoint_dir stops after a checkpoint at the next step
  // boundary every worker can reach; otherwise it fails ("stopped by
  // <who>"). Repeated calls change nothing.
  void RequestStop(const std::string& who) ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<MetricsRow> MetricsRows() const ABSL_LOCKS_EXCLUDED(mu_);
  // The rows completed since the last call, in step order (a row is complete
  // once every worker reported its step); for appending to metrics.csv.
  // Each passes the divergence watch (job/loss_watch.h), which logs a
  // warning the first time the loss is found to have diverged.
  std::vector<MetricsRow> TakeNewRows() ABSL_LOCKS_EXCLUDED(mu_);
  // wall_s: from the cluster forming to the outcome.
  run::Summary MakeSummary() const ABSL_LOCKS_EXCLUDED(mu_);
  double WallSeconds() const ABSL_LOCKS_EXCLUDED(mu_);
  // The job's processes, restarts and checkpoints as of now, for its metrics.
  JobState Progress() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Process = Membership::Process;
  // A process to probe: who, and where its health endpoint is.
  struct Suspect {
    control::Role role;
    uint32_t rank;
    std::string credential;
    std::string endpoint;
  };
  // Tick's checks of the deadlines and the silent processes; the processes
  // to probe before the next check go to *suspects (none when null).
  void CheckTimeoutsLocked(std::vector<Suspect>* suspects) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // How long a liveness probe waits for a connection (net/liveness.h).
  absl::Duration ProbeTimeout() const { return std::min(absl::Seconds(1), heartbeat_timeout_ / 4); }
  // The process presumed dead: roll back, or fail the job, naming `lost`.
  void LoseLocked(const std::string& lost) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Register's parts: the rank the request may take (a requested one,
  // which a running job rolls back for, or the first free one), then the
  // process admitted under it (its declarations checked; the cluster formed
  // when it was the last), then the reply once the cluster has formed.
  grpc::Status TakeRankLocked(const control::RegisterRequest& req, int* rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  grpc::Status AdmitLocked(uint32_t rank, const control::RegisterRequest& req)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FillRegisterReplyLocked(uint32_t rank, const control::RegisterRequest& req,
                               control::RegisterReply* reply) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker's declarations (DeclaredSettings::Check) against the job's.
  absl::Status CheckDeclaredLocked(uint32_t rank, const control::RegisterRequest& req)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The cluster has formed: applies the declared settings, fixes d and the
  // shard map, starts the job.
  void FormLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Live recovery: when the job can roll back (a --checkpoint_dir, a
  // complete checkpoint, --rejoin_timeout > 0, no worker finished, no stop
  // under way), every process is told to REJOIN, the coordinator waits for
  // all to register again and the job goes on from that checkpoint; returns
  // true. Else false and *why_not says why (the caller fails the job).
  bool RollBackLocked(const std::string& why, std::string* why_not)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every process has registered again after a roll-back.
  void ReformLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A heartbeat of a process of another incarnation (or one the coordinator
  // has not registered, e.g. after the coordinator restarted).
  void ReplyToStrangerLocked(control::HeartbeatReply* reply) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a diverged job should try, for the optimizer config_ names.
  std::string RemedyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker's metrics row; refused beyond `steps_done`, the steps it has run.
  void AddMetricsLocked(uint32_t rank, const control::StepMetrics& m, uint64_t steps_done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RequestStopLocked(const std::string& who) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Once every worker has acknowledged the stop: the stop step, the most
  // steps any has begun.
  void MaybeDecideStopLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StoppedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A process's report of its file of a checkpoint.
  void AddCheckpointPartLocked(control::Role role, uint32_t rank, const control::CheckpointPart& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The manifest of a complete checkpoint of `step`, but for its files.
  checkpoint::Manifest ManifestLocked(uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckpointFailedLocked(uint64_t step, const std::string& error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  grpc::Status CheckJob(control::Role role, uint32_t rank, uint64_t job_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when a Done's checksums cover the shard map exactly: a server's its
  // own shard, a worker's every shard once.
  absl::Status CheckCoverageLocked(const control::DoneRequest& req) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job credential; a refusal is logged (rate-limited).
  grpc::Status Authenticate(const grpc::ServerContext* ctx, absl::string_view rpc);
  // Why a call was refused, for the metrics (JobState::refused_*).
  enum Refusal { kUnauthenticated, kMalformed, kRegistration, kRefusals };
  // An RPC refused for `st`, counted, logged (rate-limited) and returned.
  grpc::Status Refuse(absl::string_view rpc, grpc::Status st, Refusal why = kMalformed);

  const uint64_t job_id_;
  const Security security_;
  const absl::Duration heartbeat_timeout_;
  const absl::Duration rejoin_timeout_;                     // zero: no live recovery
  RefusalLog refusals_{"coordinator"};                      // thread-safe itself
  std::array<std::atomic<uint64_t>, kRefusals> refused_{};  // by Refusal

  mutable absl::Mutex mu_;
  // dim() and the workers' declared settings fixed once the cluster forms
  control::TrainingConfig config_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> given_ ABSL_GUARDED_BY(mu_);  // settings the job set itself
  ShardMap map_ ABSL_GUARDED_BY(mu_) = ShardMap::Create(0, 1, 32).value();
  // The job's tensors once formed: the built-in model's, or the declared ones.
  std::vector<uint64_t> job_layers_ ABSL_GUARDED_BY(mu_);
  State state_ ABSL_GUARDED_BY(mu_) = State::kRegistering;
  std::string reason_ ABSL_GUARDED_BY(mu_);
  bool formed_ ABSL_GUARDED_BY(mu_) = false;  // FormLocked ran
  absl::Time register_deadline_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Time> started_ ABSL_GUARDED_BY(mu_);  // all registered
  std::optional<absl::Time> ended_ ABSL_GUARDED_BY(mu_);    // finished or failed
  // A job without a fixed length: the steps every worker finished after.
  std::optional<uint64_t> end_step_ ABSL_GUARDED_BY(mu_);
  ReplicaVerdict verdict_ ABSL_GUARDED_BY(mu_);  // once finished

  Membership members_ ABSL_GUARDED_BY(mu_);
  DeclaredSettings declared_ ABSL_GUARDED_BY(mu_);
  MetricsTable metrics_ ABSL_GUARDED_BY(mu_);
  CheckpointManifests checkpoints_ ABSL_GUARDED_BY(mu_);
  JobHistory history_ ABSL_GUARDED_BY(mu_);
  FreezeVote freeze_ ABSL_GUARDED_BY(mu_);
  StopProtocol stop_ ABSL_GUARDED_BY(mu_);
};

const char* StateName(CoordinatorService::State s);

// OK when the job `config` may continue from `checkpoint`; else
// FAILED_PRECONDITION naming the checkpoint and every setting that differs
// ("--lr: 0.01 (here) vs 0.001 (there)"), save those a resumed job may
// change (where checkpoints go, the timeouts, the chunking, the numbers of
// servers and workers).
absl::Status CheckResumable(const control::TrainingConfig& config,
                            const CompleteCheckpoint& checkpoint);

// RunCoordinator (include/onebit/server.h) for a config already built, as
// onebit-coordinator builds it from its command line.
// `given`: the settings it set explicitly (the workers may declare the rest).
absl::Status RunCoordinatorJob(const control::TrainingConfig& config,
                               const std::set<std::string>& given,
                               const CoordinatorOptions& options);

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_COORDINATOR_H_
