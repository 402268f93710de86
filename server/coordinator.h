// The coordinator's gRPC service (proto/control.proto): rendezvous, heartbeats
// and failure detection, metrics collection, the final summary.
//
// Thread-safe: gRPC calls it from its threads; the owner polls Tick() and
// state from another.
#ifndef ONEBIT_SERVER_COORDINATOR_H_
#define ONEBIT_SERVER_COORDINATOR_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "checkpoint/checkpoint_dir.h"
#include "net/loss_watch.h"
#include "net/refusal_log.h"
#include "net/run_folder.h"
#include "onebit/server.h"
#include "optim/optimizer.h"
#include "proto/checkpoint.pb.h"
#include "proto/control.grpc.pb.h"
#include "security/job_secret.h"
#include "shard/shard_map.h"

namespace onebit {

class CoordinatorService final : public control::Coordinator::Service {
 public:
  // kStopped: ended early on request, after a complete checkpoint (or at
  // step 0, with nothing to save); it resumes from there.
  enum class State { kRegistering, kRunning, kFinished, kFailed, kStopped };

  // `config` must be valid (ValidateConfig); `given`: the settings the job
  // set explicitly (the workers may declare the others). The shard map is
  // built once the cluster has formed: from config.dim(), or for --model
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
                  uint32_t restarts, uint64_t rolled_back_steps, uint64_t reached);

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
  void Tick();
  static constexpr int kSlowFactor = 6;

  State state() const;
  std::string reason() const;
  // True once every live process has been told the outcome (or it exited).
  bool EveryoneTold() const;
  // True unless the job failed and a worker may still send the metrics of
  // the steps it completed: once the job has failed, every registered
  // worker has finished, reported an error itself (that report carries its
  // last metrics; see Heartbeater::ReportError) or been presumed dead.
  bool WorkersReportedLastMetrics() const;

  // Checkpoints whose every file (each server's, each worker's) has been
  // reported since the last call, as manifests to write (step order).
  std::vector<checkpoint::Manifest> TakeCompleteCheckpoints();
  // The manifest of `checkpoint` is written: counted for summary.json, and
  // the job rolls back to it if a process is lost.
  void CheckpointWritten(CompleteCheckpoint checkpoint);
  // The checkpoint of `step` cannot be completed (a file or the manifest
  // could not be written: `error`): counted for summary.json, and under
  // --checkpoint_failure=fail the job fails naming it.
  void CheckpointFailed(uint64_t step, const std::string& error);
  // The steps of failed checkpoints whose folders are to be removed since
  // the last call (a step again when a part of it came after it failed).
  std::vector<uint64_t> TakeFailedCheckpoints();
  // After a roll-back changed the job's history (restarts,
  // rolled_back_steps): the checkpoint rolled back to, its manifest carrying
  // the history as of now, to write over the old one, so that a coordinator
  // started after this one counts it; nullopt when nothing changed.
  std::optional<CompleteCheckpoint> TakeHistoryToRecord();

  // A stop asked for by `who` (e.g. "SIGTERM to worker 2"): a running job
  // with a --checkpoint_dir stops after a checkpoint at the next step
  // boundary every worker can reach; otherwise it fails ("stopped by
  // <who>"). Repeated calls change nothing.
  void RequestStop(const std::string& who);

  std::vector<MetricsRow> MetricsRows() const;
  // The rows completed since the last call, in step order (a row is complete
  // once every worker reported its step); for appending to metrics.csv.
  // Each passes the divergence watch (net/loss_watch.h), which logs a
  // warning the first time the loss is found to have diverged.
  std::vector<MetricsRow> TakeNewRows();
  // wall_s: from the cluster forming to the outcome.
  Summary MakeSummary() const;
  double WallSeconds() const;

 private:
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
    bool slow_said = false;            // the log said it is slow, not dead
    std::optional<uint64_t> stop_ack;  // workers, while stopping: steps begun
    std::vector<control::ShardChecksum> checksums;
    std::string credential;  // issued at its registration (RegisterReply.credential)
  };

  static std::string Name(control::Role role, uint32_t rank);
  // A process to probe: who, and where its health endpoint is.
  struct Suspect {
    control::Role role;
    uint32_t rank;
    std::string credential;
    std::string endpoint;
  };
  // Tick's checks of the deadlines and the silent processes; the processes
  // to probe before the next check go to *suspects.
  void CheckTimeoutsLocked(std::vector<Suspect>* suspects) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The process presumed dead: roll back, or fail the job, naming `lost`.
  void LoseLocked(const std::string& lost) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<Process>& Group(control::Role role) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AllRegisteredLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker's declared parameter count against the job's, or the other
  // workers'; the error names both.
  absl::Status CheckDeclaredParamsLocked(uint32_t rank, uint64_t d)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same for the weight-decay ranges.
  absl::Status CheckDeclaredLayersLocked(uint32_t rank, const control::RegisterRequest& req)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckDeclaredDecayLocked(uint32_t rank, const control::RegisterRequest& req)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Workers' tensors outside x (RegisterRequest.local_state): equal to the
  // first worker's, by name and CRC-32.
  absl::Status CheckDeclaredLocalStateLocked(uint32_t rank, const control::RegisterRequest& req)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same for the job settings the workers' program declares; the
  // first declaration is also tried against the job's config, so that a
  // contradiction fails the job at once.
  absl::Status CheckDeclaredSettingsLocked(uint32_t rank, const control::RegisterRequest& req)
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
  // The three checks above, in order.
  absl::Status CheckDeclaredLocked(uint32_t rank, const control::RegisterRequest& req)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A heartbeat of a process of another incarnation (or one the coordinator
  // has not registered, e.g. after the coordinator restarted).
  void ReplyToStrangerLocked(control::HeartbeatReply* reply) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string MissingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  void CheckpointFailedLocked(uint64_t step, const std::string& error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker registering again after a roll-back had completed `steps_done`:
  // those beyond what was counted are run again too.
  void CountRolledBackLocked(uint64_t steps_done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The row of `step` once every worker has reported it.
  std::optional<MetricsRow> RowLocked(uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  grpc::Status CheckJob(control::Role role, uint32_t rank, uint64_t job_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A registered process of this job whose request carries its credential.
  bool IsOwnerLocked(control::Role role, uint32_t rank, const std::string& credential) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when a Done's checksums cover the shard map exactly: a server's its
  // own shard, a worker's every shard once.
  absl::Status CheckCoverageLocked(const control::DoneRequest& req) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job credential; a refusal is logged (rate-limited).
  grpc::Status Authenticate(const grpc::ServerContext* ctx, absl::string_view rpc);
  // An RPC refused for `st`, logged (rate-limited) and returned.
  grpc::Status Refuse(absl::string_view rpc, grpc::Status st);
  // --freeze auto: records a server's check and decides every check that all
  // servers with a non-empty shard have reported.
  void AddFreezeCheckLocked(uint32_t shard, const control::FreezeCheck& c)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // dim() and the workers' declared settings fixed once the cluster forms
  control::TrainingConfig config_;
  std::set<std::string> given_;  // settings the job set itself
  const uint64_t job_id_;
  const Security security_;
  RefusalLog refusals_{"coordinator"};
  ShardMap map_ ABSL_GUARDED_BY(mu_) = ShardMap::Create(0, 1, 32).value();
  absl::Time register_deadline_ ABSL_GUARDED_BY(mu_);
  const absl::Duration heartbeat_timeout_;
  const absl::Duration rejoin_timeout_;  // zero: no live recovery
  FreezeOptions freeze_;

  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kRegistering;
  std::string reason_ ABSL_GUARDED_BY(mu_);
  std::vector<Process> servers_ ABSL_GUARDED_BY(mu_);
  std::vector<Process> workers_ ABSL_GUARDED_BY(mu_);
  // step -> per-worker metrics of that step
  std::map<uint64_t, std::vector<std::optional<control::StepMetrics>>> metrics_
      ABSL_GUARDED_BY(mu_);
  uint64_t rows_taken_ ABSL_GUARDED_BY(mu_) = 0;  // TakeNewRows: the next step's row
  LossWatch loss_watch_ ABSL_GUARDED_BY(mu_);     // over prior_rows_, then the rows taken
  // step -> "server 1" / "worker 0" -> its file; a failed one drops the step.
  std::map<uint64_t, std::map<std::string, control::CheckpointPart>> parts_ ABSL_GUARDED_BY(mu_);
  std::vector<checkpoint::Manifest> complete_ ABSL_GUARDED_BY(mu_);
  uint64_t checkpoints_written_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<uint64_t> last_checkpoint_ ABSL_GUARDED_BY(mu_);
  uint64_t checkpoint_errors_ ABSL_GUARDED_BY(mu_) = 0;  // failed checkpoints, one per step
  std::string last_checkpoint_error_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> failed_dirs_ ABSL_GUARDED_BY(mu_);  // for TakeFailedCheckpoints
  bool replicas_equal_ ABSL_GUARDED_BY(mu_) = false;
  bool workers_agree_ ABSL_GUARDED_BY(mu_) = false;  // every replica equals every other
  std::optional<double> max_replica_diff_ ABSL_GUARDED_BY(mu_);
  uint64_t floored_ ABSL_GUARDED_BY(mu_) = 0;
  // completed steps -> shard -> VarianceChange
  std::map<uint64_t, std::map<uint32_t, double>> freeze_checks_ ABSL_GUARDED_BY(mu_);
  uint64_t freeze_decided_ ABSL_GUARDED_BY(mu_) = 0;  // checks decided so far
  uint64_t freeze_step_ ABSL_GUARDED_BY(mu_) = 0;     // decided first compression step
  // Every decided check of this coordinator: steps completed, largest change.
  std::vector<std::pair<uint64_t, double>> freeze_history_ ABSL_GUARDED_BY(mu_);
  std::optional<uint32_t> declared_by_ ABSL_GUARDED_BY(mu_);     // first worker to declare d
  std::optional<uint32_t> decay_by_ ABSL_GUARDED_BY(mu_);        // first worker to register
  std::vector<DecayRange> decay_ ABSL_GUARDED_BY(mu_);           // its ranges
  std::optional<uint32_t> layers_by_ ABSL_GUARDED_BY(mu_);       // first to declare tensors
  std::vector<uint64_t> layers_ ABSL_GUARDED_BY(mu_);            // their ends
  std::optional<uint32_t> local_state_by_ ABSL_GUARDED_BY(mu_);  // first to declare local state
  std::vector<control::LocalTensor> local_state_ ABSL_GUARDED_BY(mu_);
  // The job's tensors once formed: the built-in model's, or layers_.
  std::vector<uint64_t> job_layers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> declared_ ABSL_GUARDED_BY(mu_);  // and its settings
  // A job without a fixed length: the steps every worker finished after.
  std::optional<uint64_t> end_step_ ABSL_GUARDED_BY(mu_);
  std::string stop_by_ ABSL_GUARDED_BY(mu_);  // non-empty: stopping, asked by this
  std::optional<uint64_t> stop_step_ ABSL_GUARDED_BY(mu_);
  absl::Time stop_deadline_ ABSL_GUARDED_BY(mu_);
  std::optional<CompleteCheckpoint> resume_ ABSL_GUARDED_BY(mu_);
  std::optional<CompleteCheckpoint> latest_ ABSL_GUARDED_BY(mu_);  // newest written
  bool formed_ ABSL_GUARDED_BY(mu_) = false;                       // FormLocked ran
  // This forming of the cluster (RegisterReply.incarnation).
  uint64_t incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  std::string rejoin_why_ ABSL_GUARDED_BY(mu_);              // what the last roll-back was for
  uint32_t rollbacks_ ABSL_GUARDED_BY(mu_) = 0;              // live ones, by this coordinator
  std::vector<MetricsRow> prior_rows_ ABSL_GUARDED_BY(mu_);  // before resume_'s step
  uint32_t restarts_ ABSL_GUARDED_BY(mu_) = 0;
  // Steps completed (by the furthest worker) beyond the checkpoint rolled
  // back to, summed over the roll-backs. The last roll-back's furthest step
  // known so far: workers registering again may report more.
  uint64_t rolled_back_steps_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t rollback_reached_ ABSL_GUARDED_BY(mu_) = 0;
  bool history_changed_ ABSL_GUARDED_BY(mu_) = false;       // for TakeHistoryToRecord
  std::optional<absl::Time> started_ ABSL_GUARDED_BY(mu_);  // all registered
  std::optional<absl::Time> ended_ ABSL_GUARDED_BY(mu_);    // finished or failed
};

const char* StateName(CoordinatorService::State s);

// A random 64-bit id, never 0: a job's id, and each incarnation's, so that
// no earlier one (of this coordinator or of one before a restart) can be
// taken for it. Thread-safe.
uint64_t NewRandomId();

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

#endif  // ONEBIT_SERVER_COORDINATOR_H_
