// The Worker of include/onebit/worker.h: its part in the job (registering,
// the heartbeat, rejoining, checkpoint files: job/member.h), the data plane
// (worker/ps_client.h) and the replica that holds x, the gradient and the
// optimizer state (worker/replica.h).
#include "onebit/worker.h"

#include <algorithm>
#include <cerrno>  // program_invocation_short_name
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/state_file.h"
#include "job/config.h"
#include "job/member.h"
#include "local/local_group.h"
#include "metrics/endpoint.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "net/health.h"
#include "optim/update_kernels.h"
#include "util/checksum.h"
#include "util/memory.h"
#include "util/phase_medians.h"
#include "util/stop_signal.h"
#include "worker/device.h"
#include "worker/ps_client.h"
#include "worker/worker_internal.h"
#include "worker/worker_metrics.h"

namespace onebit {
namespace {

// Status payloads: the coordinator said REJOIN (internal), and the worker
// has rejoined (IsRolledBack).
constexpr char kRejoinMark[] = "onebit.worker/rejoin";
constexpr char kRolledBackMark[] = "onebit.worker/rolled-back";

bool HasMark(const absl::Status& st, const char* mark) {
  return !st.ok() && st.GetPayload(mark).has_value();
}

// A loss the program reported (StepOptions) that is not finite in fp32,
// the precision metrics travel in: the error that fails the step, worded
// as the mlp's; OK otherwise.
absl::Status CheckReportedLoss(const StepOptions& o, uint32_t rank, uint64_t step,
                               const OptimizerOptions& optimizer) {
  if (!o.has_loss && std::isnan(o.loss)) return absl::OkStatus();  // none reported
  const bool finite = std::isfinite(o.loss);
  if (finite && std::fabs(o.loss) <= std::numeric_limits<float>::max()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "loss is not finite (", o.loss, finite ? ", beyond fp32's range" : "", ") at rank ", rank,
      " step ", step, ": training diverged; try ", DivergenceRemedy(optimizer)));
}

}  // namespace

bool IsRolledBack(const absl::Status& status) { return HasMark(status, kRolledBackMark); }

struct Worker::Impl {
  // Declared in the order they are built; destroyed in reverse, so the
  // sockets go before their context and the replica before its model.
  JobInfo job;
  control::TrainingConfig cfg;
  std::string device;
  bool on_device = false;
  ShardMap map = ShardMap::Create(0, 1, 32).value();  // the job's, from the coordinator
  std::unique_ptr<grpc::Server> health;
  // Prometheus (WorkerOptions::metrics_port): before the member, whose
  // checkpoint writer counts its files in them.
  std::unique_ptr<MetricsEndpoint> endpoint;
  std::unique_ptr<WorkerMetrics> metrics;
  absl::Duration metrics_linger;
  const std::atomic<int>* stop_signal = nullptr;
  uint64_t idle_since_ns = 0;     // the end of the last step: the gradient's time begins
  std::optional<CurveKeys> keys;  // the data plane's, unless --insecure
  // Registration, heartbeat, rejoining and checkpoint files.
  std::unique_ptr<JobMember> member;
  std::unique_ptr<WorkerOptimizer> optimizer;
  std::unique_ptr<zmq::context_t> ctx;
  std::unique_ptr<PsClient> client;
  std::unique_ptr<Model> model;
  std::unique_ptr<Replica> replica;

  bool broadcast = false;
  bool defer_scale_next = false;  // DeferGradientScale(): the coming step waits for its scale
  bool resumed = false;           // from a checkpoint: x comes from the servers
  absl::Duration wall_before;     // training time before the checkpoint
  bool finished = false;
  absl::Status failure;
  uint64_t step = 0;        // steps completed
  std::optional<float> lr;  // set by the caller; else the schedule's
  Phase step_phase = Phase::kWarmup;
  std::optional<absl::Time> t0;  // the first step's start
  absl::Time step_start;
  // The last step's metrics, sent with the next step (or Finish) so an
  // evaluation can join them.
  std::optional<control::StepMetrics> last;

  absl::Status stopped;  // CANCELLED once it has stopped

  // --local_ranks K > 1 (docs/design.md §1.9): local rank 0 leads its host's
  // group (it is the job's worker; `leader`), ranks 1..K-1 follow it
  // (`follower`; no member, client or heartbeat: the leader speaks for them).
  uint32_t local_rank = 0;
  uint32_t local_ranks = 1;
  std::unique_ptr<LocalLeader> leader;
  std::unique_ptr<LocalFollower> follower;
  bool follower_compressing = false;  // as the leader last said
  std::vector<float> host_grads;      // a device leader's gradient, in host memory
  // Local ranks on devices add their gradients on the leader's device: a
  // follower's handle of its gradient (Replica::ExportGrads; empty on the
  // CPU), and whether the leader has taken it (then the gradient stays on
  // the device); the leader says once where it adds them.
  std::string grads_handle;
  bool grads_on_device = false;
  bool said_where_grads_meet = false;
  // Where its steps' time went, by phase (WorkerAccess::StepParts).
  PhaseMedians step_parts{{"gradient", "encode and send", "wait", "apply"}};
  absl::Duration register_timeout;

  // After a step: the snapshot of a checkpoint step, handed to the writer.
  absl::Status MaybeCheckpoint() {
    if (!member->CheckpointDue(step)) return absl::OkStatus();
    return Checkpoint();
  }
  absl::Status Checkpoint() {
    // A sync still travelling (diloco's --sync_delay): its outer step goes
    // into x_sync now, as the servers' checkpoint has it; the merge stays
    // due, and a job resumed here merges at the same step.
    if (absl::Status st = client->TakeReplies(replica.get(), [this] { return CheckJob(); });
        !st.ok()) {
      return st;
    }
    return member->Checkpoint(
        step, [this](std::shared_ptr<SnapshotBuffers> buffers) -> absl::StatusOr<StateWriter> {
          // Not what the checkpoint holds elsewhere: x and den are the servers',
          // a momentum reply's mbar worker 0's (WorkerOmits).
          const WorkerFileOmits omit = WorkerOmits(optimizer->options(), job.rank);
          Replica::Parts parts;
          parts.x = !omit.x;
          parts.mbar = !omit.mbar;
          parts.den = !omit.den;
          parts.buffers = buffers.get();
          auto state = replica->SaveState(parts);
          if (!state.ok()) return state.status();
          StateWriter file = SaveWorkerState(*std::move(state), job.rank, step, job.num_params);
          file.SetValue("wall_s", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - *t0)));
          return file;
        });
  }

  // Records the first fatal error and tells the coordinator: the job fails.
  // The metrics of the steps completed so far go with the report, so that
  // metrics.csv keeps every step before the failure.
  absl::Status Fail(const absl::Status& st) {
    if (failure.ok()) {
      failure = st;
      if (member != nullptr && member->has_heartbeat()) {
        FlushMetrics();
        member->ReportFailure(st);
      }
    }
    return failure;
  }
  absl::Duration StopWait() const {
    return 3 * absl::Milliseconds(cfg.timeouts().heartbeat_ms()) +
           2 * absl::Milliseconds(cfg.timeouts().step_ms());
  }
  // The job stops here: saves this worker's state, waits for the checkpoint
  // to be complete and returns CANCELLED.
  absl::Status StopHere() {
    FlushMetrics();
    if (absl::Status st = Checkpoint(); !st.ok()) return Fail(st);
    member->FlushCheckpoints();
    Heartbeater& hb = member->heartbeat();
    hb.Kick();
    const control::Command c = hb.WaitForCommand(StopWait());
    if (c == control::STOP) {
      finished = true;
      stopped = absl::CancelledError(absl::StrCat("the job stopped: ", hb.reason()));
      return stopped;
    }
    if (c == control::CONTINUE) {
      return Fail(absl::DeadlineExceededError(absl::StrCat("the checkpoint to stop at (step ", step,
                                                           ") was not complete within ",
                                                           absl::FormatDuration(StopWait()))));
    }
    return Fail(CheckJob());
  }

  // A finished worker has nothing more to say or serve: its sockets,
  // heartbeat, health and metrics services end now. Left to the process's
  // exit (a Python program keeps the worker until then), their threads
  // went on reconnecting to a coordinator that had exited while the
  // runtime tore OpenSSL down under them: failed TLS handshakes logged
  // after a successful job, and now and then a crash at exit.
  void Disconnect() {
    if (client != nullptr) client->LingerOnClose(absl::Seconds(5));
    client.reset();  // the sockets before their context, which waits for them
    ctx.reset();
    member.reset();  // its checkpoint writer counts files in the metrics
    metrics.reset();
    endpoint.reset();
    if (health != nullptr) health->Shutdown(absl::ToChronoTime(absl::Now()));
    health.reset();
  }
  absl::Status Usable() const {
    if (!stopped.ok()) return stopped;
    if (!failure.ok()) return failure;
    if (finished) return absl::FailedPreconditionError("the worker has finished");
    return absl::OkStatus();
  }
  absl::Status CheckJob() const {
    const Heartbeater& hb = member->heartbeat();
    const control::Command c = hb.command();
    if (c == control::CONTINUE) return absl::OkStatus();
    if (c == control::REJOIN) {
      absl::Status st = absl::AbortedError(absl::StrCat("the job rolls back: ", hb.reason()));
      st.SetPayload(kRejoinMark, absl::Cord("1"));
      return st;
    }
    return absl::AbortedError(absl::StrCat("job aborted by the coordinator: ", hb.reason()));
  }
  // A call failed with `st`: when the coordinator has said REJOIN (the
  // failure may have come of the loss it rolls back for), rejoins and
  // returns the IsRolledBack status; else fails the worker with `st`.
  absl::Status FailOrRejoin(const absl::Status& st) {
    if (!failure.ok() || !stopped.ok()) return Usable();
    if (HasMark(st, kRejoinMark) || (member != nullptr && member->rolling_back())) return Rejoin();
    return Fail(st);
  }
  // Registers again under this rank and continues from the checkpoint the
  // job rolls back to.
  absl::Status Rejoin();
  // Part of Connect that a rejoin does again, for the last registration.
  absl::Status ConnectToServers();
  // Connections to each server, as the servers resolve them.
  uint32_t DataConnections() const;
  absl::Status ReadyToStep() const {
    if (absl::Status st = Usable(); !st.ok()) return st;
    if (!broadcast) {
      return absl::FailedPreconditionError("call BroadcastParameters() before the first step");
    }
    // A follower has no client: it is never in the middle of a step.
    const bool in_step = client != nullptr && client->in_step();
    if (cfg.model().steps() > 0 && step >= cfg.model().steps() && !in_step) {
      return absl::OutOfRangeError(absl::StrCat("the job has ", cfg.model().steps(),
                                                " steps and all are done: call Finish()"));
    }
    return absl::OkStatus();
  }
  // Begins the step unless one is begun. `may_wait` false (a
  // GradientsReady): when the job is stopping, *deferred says the step
  // waits for Step() to decide it.
  absl::Status BeginStepIfNeeded(bool may_wait, bool* deferred = nullptr) {
    if (client->in_step()) return absl::OkStatus();
    const Heartbeater::StepGate gate =
        member->heartbeat().BeginStep(step, may_wait ? StopWait() : absl::ZeroDuration());
    if (gate != Heartbeater::StepGate::kGo && !may_wait) {
      *deferred = true;
      return absl::OkStatus();
    }
    if (gate == Heartbeater::StepGate::kStopHere) return StopHere();
    if (gate == Heartbeater::StepGate::kUndecided) {
      if (absl::Status st = CheckJob(); !st.ok()) return st;  // the caller's to fail
      return Fail(absl::DeadlineExceededError(
          absl::StrCat("the job is stopping, but the coordinator named no step to stop at within ",
                       absl::FormatDuration(StopWait()))));
    }
    FlushMetrics();
    step_start = absl::Now();
    if (!t0) t0 = step_start - wall_before;
    step_phase = replica->phase();
    const bool defer = defer_scale_next;
    defer_scale_next = false;
    return client->BeginStep(step, lr, defer);
  }
  void FlushMetrics() {
    if (last) member->heartbeat().AddMetrics(*last);
    last.reset();
  }

  absl::Status Connect(const WorkerOptions& o, const ModelFactory& make_model);
  // Parts of Connect: the model (when make_model is given) and the
  // optimizer, from the registration; the replica on its device.
  absl::Status MakeModelAndOptimizer(const control::RegisterReply& reg, const DeviceChoice& choice,
                                     const ModelFactory& make_model);
  absl::Status MakeReplica(const DeviceChoice& choice, const std::string& device_flag);
  // Connect for local rank >= 1: joins its leader's group instead of the job.
  absl::Status ConnectFollower(const WorkerOptions& o, const ModelFactory& make_model);
  // Local rank 0's side of a call every rank of its host makes: the
  // followers' requests (waiting at most `wait`), its own part, then the
  // outcome and x to every follower. Returns the outcome.
  using LeadFn = std::function<absl::Status(const std::vector<LocalRequest>&, LocalAnswer*)>;
  absl::Status Lead(LocalCall call, absl::Duration wait, const LeadFn& own);
  // A follower's side: the leader's answer, with x taken into the replica;
  // an error (the leader's outcome, or the leader gone) as a Worker call's.
  absl::StatusOr<LocalAnswer> Follow(LocalRequest request);
  absl::Duration StepWait() const { return absl::Milliseconds(cfg.timeouts().step_ms()); }
  // The part of Step that pushes the host's gradient (or this worker's).
  absl::StatusOr<StepStats> OwnStep(const StepOptions& options);
  // The host's gradient, the mean of its local ranks' (in local-rank order),
  // into replica's g: on this device where every follower's is on one of
  // its kind (a->device_grads), else in host memory.
  absl::Status MeanOfLocalRanks(const std::vector<LocalRequest>& requests, LocalAnswer* a);
  // A follower gone (Unavailable from the group): the job's failure, or
  // under live recovery this worker's alone, not reported (Fail otherwise).
  absl::Status LoseLocalRank(const absl::Status& st);
  absl::StatusOr<StepStats> LeadStep(const StepOptions& options);
  absl::Status OwnBroadcast();
  absl::Status OwnFinish();
  absl::StatusOr<bool> OwnVote(bool found_inf);
  absl::StatusOr<StepStats> FollowStep(const StepOptions& options);
  // This worker's state from the checkpoint the job resumes from (x comes
  // from the servers in BroadcastParameters).
  absl::Status Restore(const control::ResumePoint& resume);
  // What the worker file `own` of the checkpoint left out (WorkerOmits),
  // from worker 0's file and the servers'.
  absl::Status CompleteFromCheckpoint(const control::ResumePoint& resume, uint32_t own,
                                      const StateReader& file, WorkerState* s) const;
};

absl::Status Worker::Impl::CompleteFromCheckpoint(const control::ResumePoint& resume, uint32_t own,
                                                  const StateReader& file, WorkerState* s) const {
  const bool needs_den = s->frozen && optimizer->traits().den_of_frozen_v;
  if (!(s->mbar.empty() && HasCompressionPhase(optimizer->options().kind)) &&
      !(needs_den && s->den.empty())) {
    return absl::OkStatus();
  }
  std::optional<StateReader> worker0;  // `file` where it is worker 0's
  if (own != 0) {
    auto w0 = StateReader::Open(absl::StrCat(resume.dir(), "/worker-0.state"));
    if (!w0.ok()) return w0.status();
    worker0 = *std::move(w0);
  }
  std::vector<StateReader> servers;
  if (needs_den && s->den.empty()) {
    for (const std::string& name : resume.server_files()) {
      auto f = StateReader::Open(absl::StrCat(resume.dir(), "/", name));
      if (!f.ok()) return f.status();
      servers.push_back(*std::move(f));
    }
  }
  std::vector<const StateReader*> parts;
  for (const StateReader& f : servers) parts.push_back(&f);
  return CompleteWorkerState(worker0 ? *worker0 : file, parts, job.num_params,
                             optimizer->options().eps, s);
}

absl::Status Worker::Impl::Restore(const control::ResumePoint& resume) {
  // (Under another number of workers: the file of rank mod N, for its step and time.)
  const uint32_t own = resume.workers() == 0 ? job.rank : job.rank % resume.workers();
  const std::string path = absl::StrCat(resume.dir(), "/worker-", own, ".state");
  auto file = StateReader::Open(path);
  if (!file.ok()) return file.status();
  if (file->header().step() != resume.step()) {
    return absl::DataLossError(absl::StrCat(path, " is of step ", file->header().step(),
                                            ", its checkpoint's manifest of step ", resume.step()));
  }
  WorkerState s;
  s.x.resize(job.num_params);
  absl::Status st = replica->ReadX(s.x.data());
  if (st.ok() && resume.workers() != 0 && resume.workers() != job.workers) {
    // Another number of workers than wrote the checkpoint.
    std::vector<std::string> paths;
    for (const std::string& name : resume.worker_files()) {
      paths.push_back(absl::StrCat(resume.dir(), "/", name));
    }
    st = LoadWorkerStateResized(paths, job.rank, job.num_params, &s);
  } else if (st.ok()) {
    st = LoadWorkerState(*file, job.num_params, &s);
  }
  if (st.ok()) st = CompleteFromCheckpoint(resume, own, *file, &s);
  if (st.ok()) st = replica->RestoreState(s);
  if (!st.ok())
    return absl::Status(st.code(), absl::StrCat("resuming from ", path, ": ", st.message()));
  double wall = 0;
  if (auto text = file->Value("wall_s"); text.ok() && absl::SimpleAtod(*text, &wall)) {
    wall_before = absl::Seconds(wall);
  }
  step = resume.step();
  member->heartbeat().SetStep(step);
  resumed = true;
  std::fprintf(stderr, "worker %u: resuming from %s (step %llu)\n", job.rank, resume.dir().c_str(),
               static_cast<unsigned long long>(step));
  return absl::OkStatus();
}

namespace {

// Errors before registering concern only this process; after it, the job.
absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("WorkerOptions.", field, ": ", why));
}

// The options' own checks, before anything starts.
absl::Status CheckOptions(const WorkerOptions& o) {
  if (o.coordinator.empty()) return Invalid("coordinator", "required (host:port)");
  if (o.num_params > kMaxParams) {
    return Invalid("num_params", absl::StrCat(o.num_params, " is above the limit of ", kMaxParams));
  }
  if (o.health_port < 0 || o.health_port > 65535) {
    return Invalid("health_port", "must be in [0, 65535]");
  }
  if (o.rank < -1) return Invalid("rank", "must be -1 (any) or a rank");
  if (o.local_rank < 0 || o.local_rank > 255) {
    return Invalid("local_rank", "must be in [0, 256) (0: the worker itself)");
  }
  if (absl::Status st = CheckTimeout(o.register_timeout); !st.ok()) {
    return Invalid("register_timeout", st.message());
  }
  if (absl::Status st = CheckMetricsPort(o.metrics_port); !st.ok()) {
    return Invalid("metrics_port", st.message());
  }
  if (absl::Status st = CheckMetricsLinger(o.metrics_linger); !st.ok()) {
    return Invalid("metrics_linger", st.message());
  }
  return absl::OkStatus();
}

// What the job tells a worker's program (JobInfo), from its registration.
JobInfo JobOf(const control::RegisterReply& reg) {
  const control::TrainingConfig& cfg = reg.config();
  JobInfo job;
  job.job_id = reg.job_id();
  job.rank = reg.rank();
  job.workers = cfg.cluster().workers();
  job.local_ranks = std::max<uint32_t>(1, cfg.cluster().local_ranks());
  job.servers = cfg.cluster().servers();
  job.steps = cfg.model().steps();
  job.model = cfg.model().name();
  job.optimizer = EnumText(cfg.optimizer().algorithm());
  job.lr = cfg.optimizer().lr();
  job.config_json = JobSettingsJson(cfg);
  return job;
}

}  // namespace

absl::Status Worker::Impl::Connect(const WorkerOptions& o, const ModelFactory& make_model) {
  if (absl::Status st = CheckOptions(o); !st.ok()) return st;
  if (o.local_rank > 0) return ConnectFollower(o, make_model);
  register_timeout = o.register_timeout;
  // Before joining: a worker that cannot use its device must not hold up a job.
  auto choice = ChooseDevice(o.device);
  if (!choice.ok()) return choice.status();
  if (!choice->notice.empty()) {
    std::fprintf(stderr, "%s: %s\n", program_invocation_short_name, choice->notice.c_str());
  }
  on_device = choice->kind != DeviceChoice::Kind::kCpu;

  int health_bound = 0;
  auto h = StartHealthServer(o.bind_host, o.health_port, &health_bound);
  if (!h.ok()) return h.status();
  health = std::move(*h);
  // The metrics listen from the start (a port taken fails the worker before
  // it joins); they are made once the rank is known.
  const std::string metrics_host = o.metrics_host.empty() ? o.bind_host : o.metrics_host;
  if (o.metrics_port >= 0) {
    auto e = MetricsEndpoint::Start(metrics_host, o.metrics_port, {{"role", "worker"}});
    if (!e.ok()) return e.status();
    endpoint = *std::move(e);
    metrics_linger = o.metrics_linger;
    stop_signal = o.stop_signal;
  }
  const std::string advertise = o.advertise_host.empty() ? Hostname() : o.advertise_host;

  auto security = ResolveSecurity(o.secret_file, o.insecure, "WorkerOptions.secret_file");
  if (!security.ok()) return security.status();
  if (security->insecure()) {
    std::fprintf(stderr, "%s\n", SecurityNotice(*security, "worker").c_str());
  } else {
    keys = NewCurveKeys();
  }
  control::RegisterRequest req;
  req.set_role(control::WORKER);
  if (keys) req.set_curve_public_key(keys->public_key);
  req.set_requested_rank(o.rank);
  req.set_health_endpoint(absl::StrCat(advertise, ":", health_bound));
  req.set_host(Hostname());
  req.set_device(DeviceName(*choice));
  req.set_num_params(o.num_params);
  std::vector<DecayRange> decay;
  for (const WeightDecayRange& r : o.weight_decay) {
    decay.push_back(DecayRange{r.begin, r.end, r.weight_decay});
  }
  std::vector<LrScaleRange> scales;
  for (const LearningRateScale& r : o.lr_scale) {
    scales.push_back(LrScaleRange{r.begin, r.end, r.scale});
  }
  AddRanges(decay, scales, &req);
  for (uint64_t e : o.layer_ends) req.add_layer_ends(e);
  for (const WorkerOptions::LocalTensor& t : o.local_state) {
    control::LocalTensor* l = req.add_local_state();
    l->set_name(t.name);
    l->set_crc32(t.crc32);
  }
  req.mutable_settings()->insert(o.settings.begin(), o.settings.end());
  JobMemberOptions mo;
  mo.coordinator = o.coordinator;
  mo.register_timeout = o.register_timeout;
  mo.stop_signal = o.stop_signal;
  mo.snapshot_arrays = 3;  // mbar, e, den at most
  // `metrics` is made before the first checkpoint; read on the writer's thread.
  mo.on_written = [this](const absl::StatusOr<WrittenFile>& f) {
    if (metrics != nullptr) {
      metrics->checkpoints().Written(f.ok(), f.ok() ? static_cast<double>(f->size) : 0,
                                     f.ok() ? f->seconds : 0);
    }
  };
  member = std::make_unique<JobMember>(mo, *security, std::move(req));
  if (absl::Status st = member->Join(); !st.ok()) return st;
  const control::RegisterReply& reg = member->registration();
  cfg = reg.config();
  job = JobOf(reg);

  // From here on a failure is the job's: Fail() tells the coordinator.
  auto map = ShardMap::Deserialize(reg.shard_map());
  if (!map.ok())
    return Fail(absl::DataLossError(absl::StrCat("bad shard map: ", map.status().message())));
  job.num_params = map->num_params();
  this->map = *map;
  if (endpoint != nullptr) {
    metrics = std::make_unique<WorkerMetrics>(endpoint.get(), job.rank, job.num_params);
    std::fprintf(stderr, "worker %u: metrics on http://%s:%d/metrics\n", job.rank,
                 metrics_host.c_str(), endpoint->port());
  }
  if (o.num_params != 0 && o.num_params != job.num_params) {
    return Fail(absl::InternalError(absl::StrCat(
        "declared d = ", o.num_params, " but the job was sharded for d = ", job.num_params)));
  }
  if (absl::Status st = MakeModelAndOptimizer(reg, *choice, make_model); !st.ok()) return Fail(st);

  ctx = std::make_unique<zmq::context_t>(
      DataIoThreads(size_t{cfg.cluster().servers()} * DataConnections()));
  if (absl::Status st = ConnectToServers(); !st.ok()) return Fail(st);

  if (absl::Status st = MakeReplica(*choice, o.device); !st.ok()) return Fail(st);
  if (absl::Status st = member->LoadCheckpoint(
          [this](const control::ResumePoint& resume) { return Restore(resume); });
      !st.ok()) {
    return Fail(st);
  }
  if (metrics != nullptr) metrics->SetSteps(step);
  local_ranks = job.local_ranks;
  if (local_ranks > 1) {
    // The followers learn the job from the registration, as this worker did.
    auto group =
        LocalLeader::Start(LocalGroupName(o.coordinator, job.rank), local_ranks, job.num_params,
                           reg.SerializeAsString(), step, register_timeout);
    if (!group.ok()) {
      return Fail(absl::Status(
          group.status().code(),
          absl::StrCat("worker ", job.rank, "'s local ranks: ", group.status().message())));
    }
    leader = std::move(*group);
  }
  return absl::OkStatus();
}

absl::Status Worker::Impl::MakeModelAndOptimizer(const control::RegisterReply& reg,
                                                 const DeviceChoice& choice,
                                                 const ModelFactory& make_model) {
  auto opt_options = OptimizerOptionsFromConfig(cfg);
  if (!opt_options.ok()) return opt_options.status();
  // Before the model and the replica exist: a job too large for this
  // machine fails naming the bytes, not by the OOM killer. (On a GPU they
  // live in its memory, whose allocation errors say so.)
  if (choice.kind != DeviceChoice::Kind::kCuda) {
    const StateSize size = WorkerStateSize(*opt_options, job.num_params);
    if (absl::Status st = CheckMemory(
            absl::StrCat("a replica of d = ", job.num_params, " (", size.arrays, ")"), size.bytes);
        !st.ok()) {
      return st;
    }
  }
  if (make_model) {
    auto m = make_model(cfg);
    if (!m.ok()) return m.status();
    model = std::move(*m);
    if (model->num_params() != job.num_params) {
      return absl::InternalError(absl::StrCat("the model has ", model->num_params(),
                                              " parameters; the job has ", job.num_params));
    }
  }
  opt_options->weight_decay_ranges = DecayRangesOf(reg.weight_decay_ranges());
  opt_options->lr_scale_ranges = LrScaleRangesOf(reg.lr_scale_ranges());
  opt_options->layer_ends.assign(reg.layer_ends().begin(), reg.layer_ends().end());
  auto opt = WorkerOptimizer::Create(*opt_options);
  if (!opt.ok()) return opt.status();
  optimizer = std::move(*opt);
  return absl::OkStatus();
}

absl::Status Worker::Impl::MakeReplica(const DeviceChoice& choice, const std::string& device_flag) {
  auto r = NewReplica(choice, job.num_params, model.get(), optimizer.get());
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat("device ", device_flag, ": ", r.status().message()));
  }
  replica = std::move(*r);
  device = replica->device();
  if (absl::Status st = replica->Init(); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("initialising on ", device, ": ", st.message()));
  }
  return absl::OkStatus();
}

absl::Status Worker::Impl::ConnectFollower(const WorkerOptions& o, const ModelFactory& make_model) {
  if (o.rank < 0) {
    return Invalid("rank", absl::StrCat("local rank ", o.local_rank,
                                        " must name its worker's rank (its local rank 0's)"));
  }
  auto choice = ChooseDevice(o.device);
  if (!choice.ok()) return choice.status();
  on_device = choice->kind != DeviceChoice::Kind::kCpu;
  local_rank = static_cast<uint32_t>(o.local_rank);
  // Its leader registers, waits for the whole cluster and then for its
  // local ranks: a follower waits as long again.
  auto f = LocalFollower::Connect(LocalGroupName(o.coordinator, static_cast<uint32_t>(o.rank)),
                                  local_rank, o.num_params, 2 * o.register_timeout);
  if (!f.ok()) return f.status();
  follower = std::move(*f);
  local_ranks = follower->local_ranks();
  control::RegisterReply reg;
  if (!reg.ParseFromString(follower->hello())) {
    return absl::DataLossError("local rank 0 sent a registration that does not parse");
  }
  cfg = reg.config();
  job = JobOf(reg);
  job.local_rank = local_rank;
  if (local_rank >= local_ranks) {
    return Invalid("local_rank",
                   absl::StrCat(local_rank, " is not below the job's --local_ranks ", local_ranks));
  }
  auto map = ShardMap::Deserialize(reg.shard_map());
  if (!map.ok())
    return absl::DataLossError(absl::StrCat("bad shard map: ", map.status().message()));
  job.num_params = map->num_params();
  this->map = *map;
  register_timeout = o.register_timeout;
  step = follower->steps_done_at_join();  // a resumed job's checkpoint step
  if (absl::Status st = MakeModelAndOptimizer(reg, *choice, make_model); !st.ok()) return st;
  if (absl::Status st = MakeReplica(*choice, o.device); !st.ok()) return st;
  // On a device: its gradient's handle, for the leader to add it there.
  // Without one the gradient goes through its slot in host memory.
  if (on_device) {
    auto handle = replica->ExportGrads();
    if (handle.ok() && handle->size() <= kMaxText) {
      grads_handle = *handle;
    } else {
      std::fprintf(stderr, "worker %u local rank %u: its gradient goes through host memory (%s)\n",
                   job.rank, local_rank,
                   handle.ok() ? "its handle is longer than a message holds"
                               : std::string(handle.status().message()).c_str());
    }
  }
  return absl::OkStatus();
}

uint32_t Worker::Impl::DataConnections() const {
  return DataConnectionsFor(cfg.compression().data_connections());
}

absl::Status Worker::Impl::ConnectToServers() {
  const control::RegisterReply& reg = member->registration();
  PsClientOptions po;
  po.job_id = member->data_plane_id();
  po.rank = job.rank;
  po.map = map;
  po.chunk_elems = ChunkElemsFor(cfg.compression().chunk_elems(), po.map);
  po.compressed_chunk_elems =
      CompressedChunkElemsFor(cfg.compression().compressed_chunk_elems(), po.chunk_elems, po.map,
                              optimizer->push_codec(StepKind::kCompressed));
  po.optimizer = optimizer.get();
  for (const auto& s : reg.servers()) {
    po.server_endpoints.push_back(s.data_endpoint());
    po.server_keys.push_back(s.curve_public_key());
  }
  po.keys = keys;
  if (keys && DataPlaneSealed(cfg)) {
    for (uint32_t k = 0; k < po.server_keys.size(); ++k) {
      const std::string& server_key = po.server_keys[k];
      auto secret = PairSecret::Agree(*keys, server_key, keys->public_key, server_key, po.job_id,
                                      job.rank, k);
      if (!secret.ok()) {
        return absl::DataLossError(
            absl::StrCat("server ", k, "'s key from the coordinator: ", secret.status().message()));
      }
      po.sealed.push_back(*std::move(secret));
    }
  }
  po.connections = DataConnections();
  // The server gives up on a missing push after the step timeout and says
  // why; this is the backstop for a server that died.
  po.reply_timeout = 2 * absl::Milliseconds(cfg.timeouts().step_ms());
  po.startup_timeout = 2 * kStartupSteps * absl::Milliseconds(cfg.timeouts().step_ms());
  po.peers_heard = member->peers_heard();
  auto c = PsClient::Connect(po, ctx.get());
  if (!c.ok()) return c.status();
  client = std::move(*c);
  return absl::OkStatus();
}

absl::Status Worker::Impl::Rejoin() {
  const std::string why = member->heartbeat().reason();
  // The old incarnation's sockets go first; the member finishes its files
  // and heartbeat.
  client.reset();
  defer_scale_next = false;  // the step it was for does not happen
  if (absl::Status st = member->Rejoin(step); !st.ok()) return Fail(st);
  absl::Status st = ConnectToServers();
  if (st.ok()) {
    st = member->LoadCheckpoint(
        [this](const control::ResumePoint& resume) { return Restore(resume); });
  }
  if (st.ok()) st = client->PullParams(step, replica.get(), [this] { return CheckJob(); });
  if (!st.ok()) {
    if (HasMark(st, kRejoinMark)) return Rejoin();  // rolled back again meanwhile
    return Fail(st);
  }
  broadcast = true;
  last.reset();
  t0.reset();
  idle_since_ns = MonotonicNs();
  if (metrics != nullptr) {
    metrics->RolledBack();
    metrics->SetSteps(step);
  }
  absl::Status rolled =
      absl::AbortedError(absl::StrCat("the job rolled back to the checkpoint of step ", step, " (",
                                      why, "); continue at steps_done()"));
  rolled.SetPayload(kRolledBackMark, absl::Cord("1"));
  return rolled;
}

absl::Status Worker::Impl::Lead(LocalCall call, absl::Duration wait, const LeadFn& own) {
  LocalAnswer answer;
  absl::Status st = Usable();
  if (st.ok()) {
    auto requests = leader->Gather(call, step, wait);
    st = requests.ok() ? own(*requests, &answer) : LoseLocalRank(requests.status());
  }
  if (absl::Status read = replica->ReadX(leader->params()); !read.ok() && st.ok()) {
    st = Fail(read);
  }
  answer.code = static_cast<int32_t>(st.code());
  answer.message = std::string(st.message());
  answer.rolled_back = IsRolledBack(st);
  answer.failed = !failure.ok();
  answer.steps_done = step;
  answer.compressing = replica->phase() == Phase::kCompress;
  if (absl::Status sent = leader->Answer(answer); !sent.ok() && st.ok()) st = LoseLocalRank(sent);
  return st;
}

absl::Status Worker::Impl::LoseLocalRank(const absl::Status& st) {
  // Under live recovery the host's ranks are started again together (by
  // onebit-launch, or the cluster's controller) and the job rolls back: the
  // coordinator must not hear it as the job's failure. It hears of this
  // worker as of a killed one, by its missing heartbeat or its registering
  // again.
  const bool live = RejoinWait(cfg) > absl::ZeroDuration();
  if (!absl::IsUnavailable(st) || !live) return Fail(st);
  if (failure.ok()) {
    failure =
        absl::Status(st.code(), absl::StrCat(st.message(), "; its host's ranks must start again"));
  }
  return failure;
}

absl::StatusOr<LocalAnswer> Worker::Impl::Follow(LocalRequest request) {
  if (absl::Status st = Usable(); !st.ok()) return st;
  request.step = step;
  // The leader's part may be a step, a roll-back or a stop; its death ends
  // the wait at once.
  const absl::Duration wait =
      2 * register_timeout + absl::Milliseconds(cfg.timeouts().rejoin_ms()) + StopWait();
  auto a = follower->Call(request, wait);
  if (!a.ok()) {
    failure = absl::Status(a.status().code(), absl::StrCat("local rank ", local_rank, " of worker ",
                                                           job.rank, ": ", a.status().message()));
    return failure;
  }
  const absl::Status outcome(static_cast<absl::StatusCode>(a->code), a->message);
  if (outcome.ok() || a->rolled_back) {
    step = a->steps_done;
    follower_compressing = a->compressing;
    if (absl::Status st = replica->WriteX(0, job.num_params, follower->params(), true); !st.ok()) {
      failure = st;
      return st;
    }
  }
  if (outcome.ok()) return *a;
  if (a->rolled_back) {
    absl::Status rolled = outcome;
    rolled.SetPayload(kRolledBackMark, absl::Cord("1"));
    return rolled;
  }
  // A stop or a failure ends this rank too; a refused call (e.g. Finish
  // before the last step) does not.
  if (absl::IsCancelled(outcome)) {
    stopped = outcome;
    finished = true;
  } else if (a->failed) {
    failure = outcome;
  }
  return outcome;
}

absl::Status Worker::Impl::MeanOfLocalRanks(const std::vector<LocalRequest>& requests,
                                            LocalAnswer* a) {
  // On this device, where every follower's gradient is on one of the same
  // kind (CUDA IPC between GPUs; the twin's shared pages): nothing crosses
  // to the host.
  std::string why_not = on_device ? "" : "local rank 0 is on the CPU";
  std::vector<std::string> peers;
  for (const LocalRequest& r : requests) {
    if (!why_not.empty()) break;
    if (r.text.empty()) why_not = absl::StrCat("local rank ", r.local_rank, " is on the CPU");
    peers.push_back(r.text);
  }
  if (why_not.empty()) {
    absl::Status st = replica->MeanGradsWith(peers);
    // Before the followers rely on it, a failure leaves their slots to use.
    if (!st.ok() && grads_on_device) return st;
    if (st.ok()) {
      grads_on_device = a->device_grads = true;
      if (!said_where_grads_meet) {
        std::fprintf(stderr,
                     "worker %u: its %u local ranks add their gradients on the device (%s)\n",
                     job.rank, local_ranks, device.c_str());
        said_where_grads_meet = true;
      }
      return absl::OkStatus();
    }
    why_not = absl::StrCat("mapping the followers' gradients failed: ", st.message());
  }
  if (!said_where_grads_meet) {
    std::fprintf(stderr, "worker %u: its %u local ranks add their gradients in host memory (%s)\n",
                 job.rank, local_ranks, why_not.c_str());
    said_where_grads_meet = true;
  }
  // In host memory: a device's gradient goes there and back.
  float* mine = replica->grads();
  if (on_device) {
    host_grads.resize(job.num_params);
    mine = host_grads.data();
    if (absl::Status st = replica->ReadGrads(mine); !st.ok()) return st;
  }
  std::vector<const float*> g = {mine};
  for (uint32_t k = 1; k < local_ranks; ++k) g.push_back(leader->gradient(k));
  MeanInOrder(g.data(), local_ranks, job.num_params, mine);
  if (on_device) return replica->WriteGrads(mine);
  return absl::OkStatus();
}

absl::StatusOr<StepStats> Worker::Impl::LeadStep(const StepOptions& options) {
  absl::StatusOr<StepStats> result = absl::InternalError("no step");
  absl::Status st =
      Lead(LocalCall::kStep, StepWait(),
           [&](const std::vector<LocalRequest>& requests, LocalAnswer* a) -> absl::Status {
             for (const LocalRequest& r : requests) {
               if (r.has_lr != lr.has_value() || (r.has_lr && r.lr != *lr)) {
                 auto text = [](bool has, float v) {
                   return has ? absl::StrCat(v) : std::string("none (the schedule's)");
                 };
                 return Fail(absl::InvalidArgumentError(absl::StrCat(
                     "step ", step, ": local rank ", r.local_rank, " set the learning rate ",
                     text(r.has_lr, r.lr), ", local rank 0 ", text(lr.has_value(), lr.value_or(0)),
                     ": every rank must set the same")));
               }
             }
             // The host's gradient: the mean of its ranks', in local-rank order.
             if (absl::Status st = MeanOfLocalRanks(requests, a); !st.ok()) return Fail(st);
             // Its loss: the mean of those reported.
             StepOptions host = options;
             const bool own = options.has_loss || !std::isnan(options.loss);
             double sum = own ? options.loss : 0;
             int reported = own ? 1 : 0;
             for (const LocalRequest& r : requests) {
               if (!r.has_loss) continue;
               sum += r.loss;
               ++reported;
             }
             if (reported > 0) {
               host.loss = sum / reported;
               host.has_loss = true;
             }
             result = OwnStep(host);
             if (!result.ok()) return result.status();
             a->step = result->step;
             a->compressed = result->compressed;
             a->bytes_up = result->bytes_up;
             a->bytes_down = result->bytes_down;
             a->chunks = result->chunks;
             a->step_s = result->step_s;
             a->push_s = result->push_s;
             a->reply_s = result->reply_s;
             return absl::OkStatus();
           });
  if (!st.ok()) return st;
  return result;
}

absl::StatusOr<StepStats> Worker::Impl::FollowStep(const StepOptions& options) {
  if (absl::Status st = ReadyToStep(); !st.ok()) return st;
  absl::Status bad;
  if (options.gradient_scale) {
    bad = absl::InvalidArgumentError(
        "StepOptions.gradient_scale: a deferred gradient scale is not available with "
        "--local_ranks > 1; scale the gradient before Step()");
  } else {
    bad = CheckReportedLoss(options, job.rank, step, optimizer->options());
  }
  if (!bad.ok()) {
    // The job fails: the leader hears why.
    follower->Abort(absl::StrCat("local rank ", local_rank, ": ", bad.message()));
    failure = bad;
    return bad;
  }
  // The leader reads it on its device once it has taken the handle, else
  // from the slot.
  if (absl::Status st =
          grads_on_device ? replica->SyncGrads() : replica->ReadGrads(follower->gradient());
      !st.ok()) {
    follower->Abort(absl::StrCat("local rank ", local_rank, ": ", st.message()));
    failure = st;
    return st;
  }
  LocalRequest r;
  r.call = LocalCall::kStep;
  r.text = grads_handle;
  r.has_loss = options.has_loss || !std::isnan(options.loss);
  r.loss = options.loss;
  r.epoch = options.epoch;
  r.has_lr = lr.has_value();
  r.lr = lr.value_or(0);
  auto a = Follow(r);
  if (!a.ok()) return a.status();
  if (a->device_grads) grads_on_device = true;
  StepStats s;
  s.step = a->step;
  s.compressed = a->compressed;
  s.bytes_up = a->bytes_up;
  s.bytes_down = a->bytes_down;
  s.chunks = a->chunks;
  s.step_s = a->step_s;
  s.push_s = a->push_s;
  s.reply_s = a->reply_s;
  return s;
}

const std::atomic<int>* StopOnSignals() {
  CatchStopSignals();
  return StopSignalFlag();
}

absl::StatusOr<WorkerOptions> WorkerOptionsFromEnvironment(uint64_t num_params) {
  auto get = [](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string(v);
  };
  WorkerOptions o;
  o.num_params = num_params;
  auto coordinator = get("ONEBIT_COORDINATOR");
  if (!coordinator) {
    return absl::InvalidArgumentError(
        "ONEBIT_COORDINATOR is not set (host:port of the job's coordinator; onebit-launch "
        "--worker_cmd sets it)");
  }
  o.coordinator = *coordinator;
  for (const char* name : {"ONEBIT_RANK", "RANK"}) {
    auto rank = get(name);
    if (!rank) continue;
    if (!absl::SimpleAtoi(*rank, &o.rank) || o.rank < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "='", *rank, "' is not a rank (an integer >= 0)"));
    }
    break;
  }
  if (auto local = get("ONEBIT_LOCAL_RANK")) {
    if (!absl::SimpleAtoi(*local, &o.local_rank) || o.local_rank < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ONEBIT_LOCAL_RANK='", *local, "' is not a local rank (an integer >= 0)"));
    }
  }
  if (auto device = get("ONEBIT_DEVICE")) o.device = *device;
  if (auto host = get("ONEBIT_ADVERTISE_HOST")) o.advertise_host = *host;
  if (auto port = get("ONEBIT_METRICS_PORT")) {
    if (!absl::SimpleAtoi(*port, &o.metrics_port) || !CheckMetricsPort(o.metrics_port).ok()) {
      return absl::InvalidArgumentError(absl::StrCat("ONEBIT_METRICS_PORT='", *port,
                                                     "' is not -1 (none) or a port in [0, 65535]"));
    }
  }
  if (auto host = get("ONEBIT_METRICS_HOST")) o.metrics_host = *host;
  if (auto linger = get("ONEBIT_METRICS_LINGER")) {
    if (!absl::ParseDuration(*linger, &o.metrics_linger) ||
        !CheckMetricsLinger(o.metrics_linger).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ONEBIT_METRICS_LINGER='", *linger, "' is not a duration in [0s, 1h]"));
    }
  }
  if (auto insecure = get("ONEBIT_INSECURE")) {
    if (*insecure != "0" && *insecure != "1") {
      return absl::InvalidArgumentError(
          absl::StrCat("ONEBIT_INSECURE='", *insecure, "' is not 0 or 1"));
    }
    o.insecure = *insecure == "1";
  }
  return o;
}

absl::StatusOr<std::unique_ptr<Worker>> ConnectWithModel(const WorkerOptions& options,
                                                         const ModelFactory& make_model) {
  auto impl = std::make_unique<Worker::Impl>();
  absl::Status st = impl->Connect(options, make_model);
  if (!st.ok()) {
    impl->failure = st;  // already reported, or nobody to report to
    return st;
  }
  return WorkerAccess::Wrap(std::move(impl));
}

absl::StatusOr<std::unique_ptr<Worker>> Worker::Connect(const WorkerOptions& options) {
  return ConnectWithModel(options, nullptr);
}

Worker::Worker(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Worker::~Worker() {
  if (!impl_->finished && impl_->failure.ok()) {
    impl_->Fail(absl::AbortedError("left the job before Finish()")).IgnoreError();
  }
}

const JobInfo& Worker::job() const { return impl_->job; }
const std::string& Worker::device() const { return impl_->device; }
bool Worker::on_device() const { return impl_->on_device; }
float* Worker::params() { return impl_->replica->params(); }
float* Worker::grads() { return impl_->replica->grads(); }
uint64_t Worker::steps_done() const { return impl_->step; }
bool Worker::compressing() const {
  if (impl_->follower != nullptr) return impl_->follower_compressing;
  return impl_->replica->phase() == Phase::kCompress;
}

absl::Status Worker::BroadcastParameters() {
  Impl& w = *impl_;
  if (absl::Status st = w.Usable(); !st.ok()) return st;
  if (w.broadcast) return absl::FailedPreconditionError("the parameters were broadcast already");
  if (w.follower != nullptr) {
    LocalRequest r;
    r.call = LocalCall::kBroadcast;
    auto a = w.Follow(r);
    if (a.ok() || IsRolledBack(a.status())) w.broadcast = true;
    return a.status();
  }
  if (w.leader != nullptr) {
    // The followers may still be loading their model and data.
    return w.Lead(
        LocalCall::kBroadcast, w.register_timeout,
        [&w](const std::vector<LocalRequest>&, LocalAnswer*) { return w.OwnBroadcast(); });
  }
  return w.OwnBroadcast();
}

absl::Status Worker::Impl::OwnBroadcast() {
  Impl& w = *this;
  absl::Status st;
  if (w.job.rank == 0 && !w.resumed) {
    std::vector<float> x(w.job.num_params);
    st = w.replica->ReadX(x.data());
    if (st.ok()) st = w.client->SendInit(x.data());
    // Where the worker keeps the master apart from its local model
    // (x_sync), the master is now this x.
    if (st.ok()) st = w.replica->WriteX(0, x.size(), x.data(), true);
  } else {
    st = w.client->PullParams(w.step, w.replica.get(), [&w] { return w.CheckJob(); });
  }
  if (!st.ok()) {
    return w.FailOrRejoin(absl::Status(
        st.code(), absl::StrCat("broadcasting the initial parameters: ", st.message())));
  }
  w.broadcast = true;
  w.idle_since_ns = MonotonicNs();
  return absl::OkStatus();
}

absl::Status Worker::SetLearningRate(float lr) {
  Impl& w = *impl_;
  if (absl::Status st = w.Usable(); !st.ok()) return st;
  if (!std::isfinite(lr) || lr < 0) {
    return absl::InvalidArgumentError(absl::StrCat("learning rate ", lr, ": want finite, >= 0"));
  }
  if (w.follower != nullptr) {  // it goes with the step, to be checked against local rank 0's
    w.lr = lr;
    return absl::OkStatus();
  }
  if (w.client->in_step() && w.client->pushed_any()) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", w.step,
                     " has pushed gradients already; set its learning rate "
                     "before the first GradientsReady()"));
  }
  w.lr = lr;
  // A step begun by GradientsReady calls that completed no chunk yet.
  if (w.client->in_step()) return w.client->SetStepLr(lr);
  return absl::OkStatus();
}

absl::Status Worker::GradientsReady(uint64_t begin, uint64_t end) {
  Impl& w = *impl_;
  if (absl::Status st = w.ReadyToStep(); !st.ok()) return st;
  if (begin > end || end > w.job.num_params) {
    return absl::OutOfRangeError(absl::StrCat("GradientsReady(", begin, ", ", end,
                                              "): not a range within [0, ", w.job.num_params, ")"));
  }
  // A host's gradient is whole only once every local rank's is in (Step).
  if (w.local_ranks > 1) return absl::OkStatus();
  // Stopping: Step() decides whether this step runs, and pushes it then.
  bool deferred = false;
  if (absl::Status st = w.BeginStepIfNeeded(false, &deferred); !st.ok()) {
    return w.FailOrRejoin(st);
  }
  if (deferred) return absl::OkStatus();
  if (absl::Status st = w.client->PushReady(begin, end, w.replica.get()); !st.ok()) {
    return w.FailOrRejoin(st);
  }
  return absl::OkStatus();
}

absl::StatusOr<StepStats> Worker::Step(const StepOptions& options) {
  Impl& w = *impl_;
  if (w.follower != nullptr) return w.FollowStep(options);
  if (w.leader != nullptr) return w.LeadStep(options);
  return w.OwnStep(options);
}

absl::StatusOr<StepStats> Worker::Impl::OwnStep(const StepOptions& options) {
  Impl& w = *this;
  if (absl::Status st = w.ReadyToStep(); !st.ok()) return st;
  // The gradient's time: since the last step, less the pushes of this one
  // that went out meanwhile (GradientsReady).
  const uint64_t entered_ns = MonotonicNs();
  const double sent_before_s = w.client->in_step() ? w.client->sending_s() : 0;
  if (absl::Status st = CheckReportedLoss(options, w.job.rank, w.step, w.optimizer->options());
      !st.ok()) {
    return w.Fail(st);
  }
  if (options.gradient_scale && w.local_ranks > 1) {
    return w.Fail(absl::InvalidArgumentError(
        "StepOptions.gradient_scale: a deferred gradient scale is not available with "
        "--local_ranks > 1; scale the gradient before Step()"));
  }
  if (absl::Status st = w.BeginStepIfNeeded(true); !st.ok()) {
    return absl::IsCancelled(st) ? st : w.FailOrRejoin(st);
  }
  absl::Status st = w.client->CompleteStep(
      w.replica.get(), [&w] { return w.CheckJob(); }, options.gradient_scale);
  if (!st.ok()) return w.FailOrRejoin(st);
  const absl::Time end = absl::Now();
  StepStats s;
  s.step = w.step;
  s.compressed = w.step_phase == Phase::kCompress;
  s.bytes_up = w.client->last_bytes_up();
  s.bytes_down = w.client->last_bytes_down();
  s.step_s = absl::ToDoubleSeconds(end - w.step_start);
  s.push_s = w.client->last_push_s();
  s.reply_s = w.client->last_reply_s();
  s.chunks = w.client->last_chunks();
  s.chunks_overlapped = w.client->last_chunks_overlapped();
  control::StepMetrics m;
  m.set_step(s.step);
  m.set_loss(static_cast<float>(options.loss));
  m.set_wall_s(absl::ToDoubleSeconds(end - *w.t0));
  m.set_step_s(s.step_s);
  m.set_bytes_up(s.bytes_up);
  m.set_bytes_down(s.bytes_down);
  m.set_push_s(s.push_s);
  m.set_reply_s(s.reply_s);
  m.set_phase(s.compressed ? "compress" : "warmup");
  m.set_epoch(options.epoch);
  w.last = m;
  ++w.step;
  w.member->heartbeat().SetStep(w.step);
  WorkerStepSample sample;
  sample.steps_done = w.step;
  sample.compressed = s.compressed;
  sample.local = w.client->last_local();
  sample.bytes_up = s.bytes_up;
  sample.bytes_down = s.bytes_down;
  sample.step_s = s.step_s;
  sample.gradient_s = std::max(0.0, (entered_ns - w.idle_since_ns) * 1e-9 - sent_before_s);
  sample.push_s = w.client->last_send_s();
  sample.wait_s = w.client->last_wait_s();
  sample.apply_s = w.client->last_apply_s();
  sample.chunks = s.chunks;
  sample.chunks_overlapped = s.chunks_overlapped;
  sample.has_loss = options.has_loss || !std::isnan(options.loss);
  sample.loss = options.loss;
  if (w.metrics != nullptr) w.metrics->StepDone(sample);
  if (!sample.local) {
    w.step_parts.Add(sample.compressed,
                     {sample.gradient_s, sample.push_s, sample.wait_s, sample.apply_s});
  }
  w.idle_since_ns = MonotonicNs();
  if (absl::Status st = w.MaybeCheckpoint(); !st.ok()) return w.Fail(st);
  return s;
}

absl::Status Worker::ReportEvaluation(double test_loss, double test_accuracy) {
  Impl& w = *impl_;
  if (absl::Status st = w.Usable(); !st.ok()) return st;
  if (w.follower != nullptr) return absl::OkStatus();  // local rank 0 reports for its host
  // After Finish() or a step's first push, the step's metrics are gone.
  if (!w.last) {
    return absl::FailedPreconditionError(
        "ReportEvaluation() belongs after a completed Step() and before the next step begins");
  }
  w.last->set_has_eval(true);
  w.last->set_test_loss(test_loss);
  w.last->set_test_accuracy(test_accuracy);
  return absl::OkStatus();
}

absl::Status Worker::ReadParams(float* out) const { return impl_->replica->ReadX(out); }

absl::Status Worker::SeedOptimizerState(const AdamSeed& seed) {
  Impl& w = *impl_;
  if (absl::Status st = w.Usable(); !st.ok()) return st;
  auto refuse = [](auto&&... parts) {
    return absl::FailedPreconditionError(absl::StrCat("SeedOptimizerState(): ", parts...));
  };
  if (!w.broadcast) return refuse("before BroadcastParameters()");
  if (w.follower != nullptr) {
    // Local rank 0's seed (worker 0's) becomes the job's.
    if (seed.m.size() != w.job.num_params || seed.v.size() != w.job.num_params) {
      return absl::InvalidArgumentError(absl::StrCat("SeedOptimizerState(): m and v have ",
                                                     seed.m.size(), " and ", seed.v.size(),
                                                     " values, the model ", w.job.num_params));
    }
    return absl::OkStatus();
  }
  if (w.step != 0 || w.resumed) {
    return refuse("the job is at step ", w.step, w.resumed ? " (resumed from its checkpoint)" : "",
                  ": a state is seeded only before the job's first step");
  }
  if (w.client->in_step()) return refuse("step 0 has begun (GradientsReady was called)");
  if (!w.optimizer->traits().adam_state_on_servers) {
    return refuse("--optimizer ", w.optimizer->traits().name,
                  " keeps a state that is not Adam's m and v on the servers alone; only adam, "
                  "onebit-adam and naive-onebit-adam can be seeded");
  }
  if (w.replica->phase() == Phase::kCompress) {
    return refuse("the job compresses from step 0 (no warm-up): there is no Adam state to seed");
  }
  const uint64_t d = w.job.num_params;
  for (const auto& [name, a] :
       {std::pair<const char*, const std::vector<float>*>{"m", &seed.m}, {"v", &seed.v}}) {
    if (a->size() != d) {
      return absl::InvalidArgumentError(absl::StrCat("SeedOptimizerState(): ", name, " has ",
                                                     a->size(), " values, the model ", d));
    }
    for (uint64_t i = 0; i < d; ++i) {
      const float x = (*a)[i];
      if (!std::isfinite(x) || (a == &seed.v && x < 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("SeedOptimizerState(): ", name, "[", i, "] is ", x,
                         a == &seed.v ? " (want finite, >= 0)" : " (want finite)"));
      }
    }
  }
  if (w.job.rank != 0) return absl::OkStatus();
  absl::Status st = w.client->PushState({{"m", seed.m.data()}, {"v", seed.v.data()}}, seed.steps,
                                        [&w] { return w.CheckJob(); });
  if (!st.ok()) {
    return w.FailOrRejoin(
        absl::Status(st.code(), absl::StrCat("seeding the optimizer state: ", st.message())));
  }
  return absl::OkStatus();
}

bool Worker::CanDeferGradientScale() const {
  // An unusable worker (failed, stopped, finished) may have no client.
  const Impl& w = *impl_;
  return w.Usable().ok() && w.client != nullptr && w.local_ranks == 1 &&
         w.client->CanDeferScale(w.step, w.replica->phase());
}

absl::Status Worker::DeferGradientScale() {
  Impl& w = *impl_;
  if (absl::Status st = w.Usable(); !st.ok()) return st;
  if (w.local_ranks > 1) {
    return absl::FailedPreconditionError(
        "DeferGradientScale(): not with --local_ranks > 1 (the host's gradient is the mean of its "
        "ranks'): scale the gradient before Step()");
  }
  if (w.client->in_step()) {
    return absl::FailedPreconditionError(absl::StrCat("DeferGradientScale(): step ", w.step,
                                                      " has begun (GradientsReady was called)"));
  }
  if (!CanDeferGradientScale()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "DeferGradientScale(): step ", w.step,
        " does not push the gradient itself in fp32 (a compression-phase step, or a warm-up "
        "codec other than fp32): scale the gradient before pushing it"));
  }
  w.defer_scale_next = true;
  return absl::OkStatus();
}

absl::StatusOr<bool> Worker::AgreeOnOverflow(bool found_inf) {
  Impl& w = *impl_;
  if (w.follower != nullptr) {
    LocalRequest r;
    r.call = LocalCall::kVote;
    r.found_inf = found_inf;
    auto a = w.Follow(r);
    if (!a.ok()) return a.status();
    return a->vote;
  }
  if (w.leader != nullptr) {
    bool any = false;
    absl::Status st = w.Lead(LocalCall::kVote, w.StepWait(),
                             [&](const std::vector<LocalRequest>& requests, LocalAnswer* a) {
                               bool host = found_inf;
                               for (const LocalRequest& r : requests) host |= r.found_inf;
                               auto agreed = w.OwnVote(host);
                               if (!agreed.ok()) return agreed.status();
                               any = a->vote = *agreed;
                               return absl::OkStatus();
                             });
    if (!st.ok()) return st;
    return any;
  }
  return w.OwnVote(found_inf);
}

absl::StatusOr<bool> Worker::Impl::OwnVote(bool found_inf) {
  Impl& w = *this;
  if (absl::Status st = w.Usable(); !st.ok()) return st;
  if (!w.broadcast) {
    return absl::FailedPreconditionError("AgreeOnOverflow() before BroadcastParameters()");
  }
  if (w.client->in_step() && w.client->pushed_any()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "AgreeOnOverflow(): step ", w.step,
        " has pushed gradients already; the ranks agree before the step's first push"));
  }
  auto any = w.client->Vote(w.step, found_inf, [&w] { return w.CheckJob(); });
  if (!any.ok()) {
    return w.FailOrRejoin(absl::Status(
        any.status().code(),
        absl::StrCat("agreeing on step ", w.step, "'s overflow: ", any.status().message())));
  }
  return *any;
}

absl::StatusOr<OptimizerState> Worker::GatherOptimizerState() {
  Impl& w = *impl_;
  if (absl::Status st = w.Usable(); !st.ok()) return st;
  if (w.follower != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("GatherOptimizerState(): local rank ", w.local_rank,
                     " holds no optimizer state; gather it on local rank 0"));
  }
  if (!w.broadcast) {
    return absl::FailedPreconditionError(
        "GatherOptimizerState() before BroadcastParameters(): the servers hold no state yet");
  }
  if (w.client->in_step()) {
    return absl::FailedPreconditionError(
        absl::StrCat("GatherOptimizerState() in the middle of step ", w.step,
                     " (GradientsReady without Step): call it between steps"));
  }
  auto server = w.client->PullState(w.step, [&w] { return w.CheckJob(); });
  if (!server.ok()) {
    return w.FailOrRejoin(
        absl::Status(server.status().code(),
                     absl::StrCat("gathering the optimizer state: ", server.status().message())));
  }
  auto mine = w.replica->SaveState(Replica::Parts{});
  if (!mine.ok()) return mine.status();
  OptimizerState out;
  out.step = w.step;
  out.frozen = server->frozen;
  out.bias_steps = server->bias_steps;
  out.server = std::move(server->arrays);
  for (auto& [name, a] : {std::pair<const char*, std::vector<float>*>{"mbar", &mine->mbar},
                          {"e", &mine->e},
                          {"den", &mine->den},
                          {"v", &mine->v},
                          {"x_sync", &mine->x_sync}}) {
    if (a->size() == w.job.num_params) out.worker[name] = std::move(*a);
  }
  return out;
}

absl::Status Worker::Finish() {
  Impl& w = *impl_;
  if (absl::Status st = w.Usable(); !st.ok()) return st;
  if (w.follower != nullptr) {
    LocalRequest r;
    r.call = LocalCall::kFinish;
    auto a = w.Follow(r);
    if (!a.ok()) return a.status();
    w.finished = true;
    return absl::OkStatus();
  }
  if (w.leader != nullptr) {
    return w.Lead(LocalCall::kFinish, w.StepWait(),
                  [&w](const std::vector<LocalRequest>&, LocalAnswer*) { return w.OwnFinish(); });
  }
  return w.OwnFinish();
}

absl::Status Worker::Impl::OwnFinish() {
  Impl& w = *this;
  if (w.client->in_step()) {
    return w.Fail(absl::FailedPreconditionError(
        absl::StrCat("Finish() in the middle of step ", w.step, " (GradientsReady without Step)")));
  }
  if (w.cfg.model().steps() > 0 && w.step != w.cfg.model().steps()) {
    return w.Fail(absl::FailedPreconditionError(absl::StrCat(
        "Finish() after ", w.step, " of the job's ", w.cfg.model().steps(), " steps")));
  }
  w.FlushMetrics();
  w.member->FlushCheckpoints();  // the last checkpoint's part goes with Done
  std::vector<float> x(w.job.num_params);
  if (absl::Status st = w.replica->ReadX(x.data()); !st.ok()) {
    return w.Fail(
        absl::Status(st.code(), absl::StrCat("reading x from ", w.device, ": ", st.message())));
  }
  std::vector<control::ShardChecksum> sums;
  for (uint32_t k = 0; k < w.map.num_shards(); ++k) {
    const Range r = w.map.shard(k);
    control::ShardChecksum c;
    c.set_shard(k);
    c.set_begin(r.begin);
    c.set_end(r.end);
    c.set_crc32(Crc32OfFloats(x.data() + r.begin, r.size()));
    sums.push_back(c);
  }
  if (w.member->rolling_back()) return w.Rejoin();
  Heartbeater& hb = w.member->heartbeat();
  if (absl::Status st = hb.Done(sums, w.step); !st.ok()) {
    // Refused by a coordinator that has rolled the job back: its REJOIN
    // comes with the next heartbeat.
    hb.Kick();
    hb.WaitForCommand(absl::Milliseconds(w.cfg.timeouts().heartbeat_ms()));
    return w.FailOrRejoin(st);
  }
  w.finished = true;
  if (w.endpoint != nullptr) LingerForLastScrape(w.metrics_linger, w.stop_signal);
  w.Disconnect();
  return absl::OkStatus();
}

void Worker::Abort(absl::string_view reason) {
  if (impl_->follower != nullptr && impl_->failure.ok()) {
    impl_->follower->Abort(absl::StrCat("local rank ", impl_->local_rank, ": ", reason));
  }
  impl_->Fail(absl::AbortedError(absl::StrCat("aborted by its program: ", reason))).IgnoreError();
}

std::unique_ptr<Worker> WorkerAccess::Wrap(std::unique_ptr<Worker::Impl> impl) {
  return std::unique_ptr<Worker>(new Worker(std::move(impl)));
}

Replica& WorkerAccess::replica(Worker& w) { return *w.impl_->replica; }
const control::TrainingConfig& WorkerAccess::config(const Worker& w) { return w.impl_->cfg; }
const Model* WorkerAccess::model(const Worker& w) { return w.impl_->model.get(); }
std::string WorkerAccess::StepParts(const Worker& w) { return w.impl_->step_parts.Summary(); }

uint32_t WorkerAccess::data_rank(const Worker& w) {
  return w.impl_->job.rank * w.impl_->local_ranks + w.impl_->local_rank;
}

absl::Status WorkerAccess::Fail(Worker& w, const absl::Status& st) { return w.impl_->Fail(st); }

absl::Status WorkerAccess::WaitForJobEnd(Worker& w, absl::Duration timeout) {
  if (w.impl_->member == nullptr) {  // a follower: its leader speaks for it
    absl::SleepFor(timeout);
    return absl::OkStatus();
  }
  w.impl_->member->heartbeat().WaitForCommand(timeout);
  return w.impl_->CheckJob();
}

}  // namespace onebit
