// Client side of the control plane (proto/control.proto): channels, the
// blocking Register, and a background heartbeat that carries step metrics
// and brings back the coordinator's commands.
#ifndef ONEBIT_NET_CONTROL_H_
#define ONEBIT_NET_CONTROL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "net/liveness.h"
#include "optim/optimizer.h"
#include "proto/control.grpc.pb.h"
#include "security/job_secret.h"

namespace onebit {

// A channel to the coordinator at "host:port": TLS with the job's credential
// on every call, or plaintext under --insecure (security/tls.h).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, const Security& security);
// A plaintext channel, for grpc.health.v1 (which stays open to probes).
std::shared_ptr<grpc::Channel> MakeHealthChannel(const std::string& target);

// absl::Status from a failed RPC, naming what was called.
absl::Status RpcError(absl::string_view what, const grpc::Status& status);

// This machine's hostname (the default address to advertise).
std::string Hostname();

// What a timeout of the options or flags must be: > 0 and finite. OK, or an
// InvalidArgument whose message is the reason ("must be > 0"), for the
// caller to prefix with the option's or flag's name.
absl::Status CheckTimeout(absl::Duration timeout);

// Registers and waits for the whole cluster (the coordinator replies once all
// processes are in). Retries while the coordinator is not up yet; gives up
// after `timeout` with an error naming the coordinator.
absl::StatusOr<control::RegisterReply> RegisterWithCoordinator(
    control::Coordinator::Stub* stub, const std::string& target,
    const control::RegisterRequest& request, absl::Duration timeout);

// Weight-decay ranges from their protobuf form (RegisterRequest, RegisterReply)
// for OptimizerOptions::weight_decay_ranges.
std::vector<DecayRange> DecayRangesOf(
    const google::protobuf::RepeatedPtrField<control::WeightDecayRange>& ranges);
// Lr-scale ranges likewise, for OptimizerOptions::lr_scale_ranges.
std::vector<LrScaleRange> LrScaleRangesOf(
    const google::protobuf::RepeatedPtrField<control::LrScaleRange>& ranges);
// Writes both kinds of ranges into a RegisterRequest or RegisterReply.
template <typename Message>
void AddRanges(const std::vector<DecayRange>& decay, const std::vector<LrScaleRange>& lr,
               Message* m) {
  for (const DecayRange& r : decay) {
    control::WeightDecayRange* p = m->add_weight_decay_ranges();
    p->set_begin(r.begin);
    p->set_end(r.end);
    p->set_weight_decay(r.weight_decay);
  }
  for (const LrScaleRange& r : lr) {
    control::LrScaleRange* p = m->add_lr_scale_ranges();
    p->set_begin(r.begin);
    p->set_end(r.end);
    p->set_lr_scale(r.lr_scale);
  }
}

// The most metrics rows one heartbeat, error report or Done carries (the
// rest go with the next): what one call may carry is bounded
// (coordinator/control_limits.h).
inline constexpr uint64_t kMaxMetricsPerHeartbeat = uint64_t{1} << 14;

// Sends a heartbeat every `interval` from its own thread. Thread-safe.
class Heartbeater {
 public:
  // `stub` must outlive this. The coordinator is declared lost when no
  // heartbeat got through for `coordinator_timeout`.
  Heartbeater(control::Coordinator::Stub* stub, std::string target, control::Role role,
              uint32_t rank, uint64_t job_id, absl::Duration interval,
              absl::Duration coordinator_timeout);
  ~Heartbeater();  // stops the thread

  // Before Start(): the incarnation of the job this process registered in
  // (RegisterReply.incarnation), sent with every heartbeat and Done.
  void SetIncarnation(uint64_t incarnation);
  // Before Start(): this process's credential (RegisterReply.credential),
  // sent with every heartbeat and Done.
  void SetCredential(std::string credential);
  // Before Start(): each heartbeat carries the peers `peers` heard since the
  // previous one (net/liveness.h), for the coordinator's failure detector.
  void SetPeersHeard(std::shared_ptr<PeersHeard> peers);
  // Before Start(): when the coordinator is lost, keep trying for this long
  // in all (saying so on stderr once), for a restarted one to answer,
  // rather than for `coordinator_timeout`.
  void WaitForLostCoordinator(absl::Duration wait);

  void Start();
  void SetStep(uint64_t steps_done);
  void AddMetrics(const control::StepMetrics& m);

  // Tells the coordinator this process failed (one RPC, best effort: the
  // process exits non-zero either way). Like Done, it carries the pending
  // metrics and the steps done, after any heartbeat in flight has been
  // answered, so that the steps completed before the failure keep their rows.
  void ReportError(const std::string& error);

  // Sends the final checksums, the steps done (workers) and any pending
  // metrics, after any heartbeat in flight has been answered: the
  // coordinator may end the job on Done, and whatever reached it after
  // would be lost. A coordinator that does not answer at all is asked again
  // until it has been silent for the lost coordinator's wait; one that
  // answers too late, for kSlowCoordinatorFactor timeouts, as heartbeats.
  absl::Status Done(const std::vector<control::ShardChecksum>& checksums, uint64_t steps = 0);

  // A job without a fixed step count: the steps every worker finished
  // after, once the coordinator knows it.
  std::optional<uint64_t> end_step() const;

  // Sends a heartbeat now rather than at the next interval.
  void Kick();

  // CONTINUE until the coordinator says SHUTDOWN, ABORT, STOP or REJOIN, or
  // is lost (ABORT). The first command other than CONTINUE stays.
  control::Command command() const;
  std::string reason() const;

  // Blocks until command() != CONTINUE or `timeout` passes.
  control::Command WaitForCommand(absl::Duration timeout);

  // Queues a written (or failed) checkpoint file for the next heartbeat and
  // sends it now; Done() carries any still queued. Thread-safe.
  void ReportCheckpointPart(const control::CheckpointPart& part);

  // When *flag becomes non-zero (a signal's number, util/stop_signal.h),
  // asks the coordinator to stop the job after a checkpoint at the next
  // step boundary. Call before Start(); `flag` must outlive this.
  void WatchStopSignal(const std::atomic<int>* flag);
  // Once decided while the job is stopping: after how many completed steps
  // every process stops.
  std::optional<uint64_t> stop_step() const;
  // Workers, before beginning step `step` (0-based). kGo unless the job is
  // stopping; then, once the coordinator has named the stop step (waiting
  // at most `timeout` for it), kGo before it and kStopHere at it;
  // kUndecided when it did not come in time or the job ended otherwise
  // (see command()). Atomic with hearing of the stop, so that the steps a
  // worker says it has begun are all it begins.
  enum class StepGate { kGo, kStopHere, kUndecided };
  StepGate BeginStep(uint64_t step, absl::Duration timeout);

  // --freeze auto (servers): queues a check for the next heartbeat and sends
  // it now, so the coordinator can decide before anyone has to wait.
  void ReportFreezeCheck(uint64_t completed, double change);
  // The coordinator's decision for the check after `completed` steps: the
  // first compression step, kNever (not at this check), or nullopt while
  // undecided (then a heartbeat goes out now to ask again).
  std::optional<uint64_t> FreezeDecision(uint64_t completed, uint64_t window);

 private:
  void Loop();
  void SendOnce();
  // Moves the oldest pending rows, at most kMaxMetricsPerHeartbeat, to `out`.
  void TakeMetricsLocked(google::protobuf::RepeatedPtrField<control::StepMetrics>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  control::Coordinator::Stub* const stub_;
  const std::string target_;
  const control::Role role_;
  const uint32_t rank_;
  const uint64_t job_id_;
  const absl::Duration interval_;
  const absl::Duration coordinator_timeout_;
  // How long one heartbeat may wait for its answer: a starved coordinator
  // still counts a late call, while a cancelled one is lost work (and, when
  // most calls outwait a short deadline, no process is heard at all).
  const absl::Duration call_deadline_;
  // Set before Start() and only read after it (the thread starts after
  // them): no lock.
  uint64_t incarnation_ = 0;
  std::string credential_;
  absl::Duration coordinator_wait_;
  std::shared_ptr<PeersHeard> peers_heard_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool kick_ ABSL_GUARDED_BY(mu_) = false;  // send a heartbeat now
  std::vector<control::FreezeCheck> checks_ ABSL_GUARDED_BY(mu_);
  std::vector<control::CheckpointPart> parts_ ABSL_GUARDED_BY(mu_);
  uint64_t freeze_decided_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t freeze_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<uint64_t> end_step_ ABSL_GUARDED_BY(mu_);
  uint64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  const std::atomic<int>* stop_signal_ = nullptr;  // set before Start()
  bool stop_sent_ ABSL_GUARDED_BY(mu_) = false;    // the request reached the coordinator
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<uint64_t> stop_step_ ABSL_GUARDED_BY(mu_);
  uint64_t begun_ ABSL_GUARDED_BY(mu_) = 0;                // steps begun (workers)
  std::optional<uint64_t> stop_ack_ ABSL_GUARDED_BY(mu_);  // begun_ when stopping_ came
  std::vector<control::StepMetrics> pending_ ABSL_GUARDED_BY(mu_);
  // A heartbeat is between taking what is queued and hearing back (Done
  // waits for it, so that nothing it carries arrives after Done).
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* call_ ABSL_GUARDED_BY(mu_) = nullptr;  // the heartbeat in flight
  control::Command command_ ABSL_GUARDED_BY(mu_) = control::CONTINUE;
  std::string reason_ ABSL_GUARDED_BY(mu_);
  absl::Time last_ok_ ABSL_GUARDED_BY(mu_);
  bool lost_said_ ABSL_GUARDED_BY(mu_) = false;  // "waiting for the coordinator" printed
  std::thread thread_;
};

// How long a process of `cfg`'s job waits for a lost coordinator, and for
// the cluster to form again after a roll-back: --rejoin_timeout where the
// job has a --checkpoint_dir (else zero: no roll-backs).
absl::Duration RejoinWait(const control::TrainingConfig& cfg);

// How often a process of `config`'s job beats: every heartbeat_timeout / 10
// (20 ms to 1 s), and no faster than the job's processes together beating
// kMaxHeartbeatsPerSecond times a second (up to heartbeat_timeout / 3): a
// 160-process job on 2 cores starved its coordinator at 160 a second.
inline constexpr double kMaxHeartbeatsPerSecond = 50;
absl::Duration HeartbeatInterval(const control::TrainingConfig& config);

// A heartbeat that ran out of time (its connection was open), or failed on
// a dropped connection while the coordinator's port still takes connections
// (net/liveness.h), means a slow coordinator, not a gone one: the process
// waits this many heartbeat timeouts before it gives up, against one (or
// RejoinWait) for a refused connection.
inline constexpr int kSlowCoordinatorFactor = 6;

// The heartbeat of a process registered as `reg` (role and reg.rank()):
// every HeartbeatInterval, carrying reg.incarnation() and reg.credential(),
// waiting RejoinWait for a lost coordinator. Not started; `stub` must
// outlive it.
std::unique_ptr<Heartbeater> MakeHeartbeater(control::Coordinator::Stub* stub,
                                             const std::string& target, control::Role role,
                                             const control::RegisterReply& reg);

}  // namespace onebit

#endif  // ONEBIT_NET_CONTROL_H_
