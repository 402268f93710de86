// RunCoordinator (include/onebit/server.h): the coordinator's gRPC service
// (coordinator/coordinator.h), its watch loop, and the run folder.
#include <malloc.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <optional>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint_dir.h"
#include "coordinator/control_limits.h"
#include "coordinator/coordinator.h"
#include "coordinator/job_metrics.h"
#include "job/config.h"
#include "job/config_file.h"
#include "job/run_folder.h"
#include "job/settings.h"
#include "metrics/endpoint.h"
#include "net/control.h"
#include "net/health.h"
#include "onebit/server.h"
#include "security/tls.h"
#include "util/refusal_log.h"
#include "util/stop_signal.h"

namespace onebit {
namespace {

// The newest complete checkpoint under --checkpoint_dir that this job may
// continue from; none when there is none (an error under --resume). Ones
// refused (corrupt, incomplete) are named on stderr.
absl::StatusOr<std::optional<CompleteCheckpoint>> FindResumePoint(
    const control::TrainingConfig& cfg) {
  if (cfg.checkpoint().dir().empty()) return std::nullopt;
  std::vector<std::string> refused;
  auto latest = LatestCheckpoint(cfg.checkpoint().dir(), &refused);
  for (const std::string& r : refused) {
    std::fprintf(stderr, "coordinator: not resuming from %s\n", r.c_str());
  }
  if (absl::IsNotFound(latest.status())) {
    if (!cfg.checkpoint().resume()) return std::nullopt;
    return absl::FailedPreconditionError(absl::StrCat(
        "--resume: no complete checkpoint under ", cfg.checkpoint().dir(),
        refused.empty() ? "" : absl::StrCat(" (refused: ", absl::StrJoin(refused, "; "), ")")));
  }
  if (!latest.ok()) return latest.status();
  // A --model external job's d comes from its workers: checked again then.
  control::TrainingConfig mine = cfg;
  if (cfg.model().name() == kExternalModel)
    mine.mutable_model()->set_dim(latest->manifest.config().model().dim());
  if (absl::Status st = CheckResumable(mine, *latest); !st.ok()) return st;
  return std::optional<CompleteCheckpoint>(*std::move(latest));
}

// CoordinatorOptions' own checks (the config has ValidateConfig).
absl::Status CheckOptions(const CoordinatorOptions& o) {
  for (auto [name, port] : {std::pair{"port", o.port}, {"health_port", o.health_port}}) {
    if (port < 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("CoordinatorOptions.", name, ": must be in [0, 65535]"));
    }
  }
  if (o.metrics_port < -1 || o.metrics_port > 65535) {
    return absl::InvalidArgumentError(
        "CoordinatorOptions.metrics_port: must be -1 (none) or in [0, 65535]");
  }
  if (absl::Status st = CheckTimeout(o.register_timeout); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("CoordinatorOptions.register_timeout: ", st.message()));
  }
  // Bounded: a coordinator that lingers for ever never reports its outcome.
  if (o.metrics_linger < absl::ZeroDuration() || o.metrics_linger > absl::Hours(1)) {
    return absl::InvalidArgumentError("CoordinatorOptions.metrics_linger: must be in [0s, 1h]");
  }
  return absl::OkStatus();
}

// Where the job starts: afresh, or from a checkpoint with the run folder's
// rows before it and the job's history.
struct StartingPoint {
  std::optional<CompleteCheckpoint> checkpoint;
  std::optional<MetricsLog> metrics;  // metrics.csv, when there is a run folder
  std::vector<MetricsRow> prior_rows;
  // The checkpoint's history, or the run folder's when that knows of later
  // restarts (the manifest was written before them).
  uint32_t restarts = 0;
  uint64_t rolled_back = 0;
  uint64_t reached = 0;  // the most steps the interrupted run is known to have completed
};

absl::StatusOr<StartingPoint> FindStartingPoint(const control::TrainingConfig& cfg,
                                                const std::string& out) {
  auto resume = FindResumePoint(cfg);
  if (!resume.ok()) return resume.status();
  StartingPoint p;
  p.checkpoint = *std::move(resume);
  if (p.checkpoint) {
    p.restarts = p.checkpoint->manifest.restarts() + 1;
    p.rolled_back = p.checkpoint->manifest.rolled_back_steps();
  }
  if (out.empty()) return p;
  if (absl::Status st = MakeDirs(out); !st.ok()) return st;
  if (absl::Status st = CheckNotFinished(out); !st.ok()) return st;
  const std::string path = out + "/metrics.csv";
  if (p.checkpoint) {
    // The interrupted run's rows before the checkpoint stay; the steps
    // after it are run again.
    auto rows = ReadMetricsCsv(path);
    if (!rows.ok()) return rows.status();
    uint64_t lost = 0;
    for (MetricsRow& r : *rows) {
      if (r.step < p.checkpoint->manifest.step()) {
        p.prior_rows.push_back(std::move(r));
      } else {
        ++lost;
      }
    }
    if (auto before = ReadRestartHistory(out + "/summary.json")) {
      p.restarts = std::max(p.restarts, before->restarts + 1);
      p.rolled_back = std::max(p.rolled_back, before->rolled_back_steps);
    }
    p.rolled_back += lost;
    p.reached = p.checkpoint->manifest.step() + lost;
  }
  auto log = MetricsLog::Open(path, p.prior_rows);
  if (!log.ok()) return log.status();
  p.metrics = *std::move(log);
  return p;
}

// The control plane's gRPC server for `service`, mutual-TLS unless
// insecure; calls without the job's credential are refused from their
// headers (before their requests are read) and counted in `refusals`.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartControlServer(const control::TrainingConfig& cfg,
                                                                 const CoordinatorOptions& o,
                                                                 const Security& security,
                                                                 CoordinatorService* service,
                                                                 RefusalLog* refusals, int* bound) {
  grpc::ServerBuilder builder;
  ConfigureExclusivePort(&builder);
  BoundControlServer(cfg, &builder);
  const std::string addr = absl::StrCat(o.bind_host, ":", o.port);
  builder.AddListeningPort(addr,
                           ControlServerCredentials(security,
                                                    [refusals](absl::string_view rpc) {
                                                      refusals->Refused(absl::StrCat(
                                                          "a ", rpc, ": no valid job credential"));
                                                    }),
                           bound);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *bound == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", addr, ": address in use or not available"));
  }
  return server;
}

// The coordinator's side of a running job, turn by turn: the rows to
// metrics.csv and Prometheus, the checkpoints' manifests, the outcome.
// One thread.
class JobRun {
 public:
  JobRun(const control::TrainingConfig& cfg, const CoordinatorOptions& o,
         CoordinatorService* service, std::optional<MetricsLog> metrics)
      : cfg_(cfg), o_(o), service_(*service), metrics_(std::move(metrics)) {}

  absl::Status StartMetricsEndpoint() {
    if (o_.metrics_port < 0) return absl::OkStatus();
    const std::string host = o_.metrics_host.empty() ? o_.bind_host : o_.metrics_host;
    auto e = MetricsEndpoint::Start(host, o_.metrics_port, {{"role", "coordinator"}});
    if (!e.ok()) return e.status();
    endpoint_ = *std::move(e);
    job_metrics_ = std::make_unique<JobMetrics>(endpoint_.get());
    std::fprintf(stderr, "coordinator: metrics on http://%s:%d/metrics\n", host.c_str(),
                 endpoint_->port());
    return absl::OkStatus();
  }

  // Until the job has finished, failed or stopped.
  void RunToEnd() {
    absl::Time trimmed = absl::Now();
    bool stop_passed = false;  // the stop signal, to the service once
    while (true) {
      service_.Tick();
      refusals_.Flush();
      // gRPC's threads free a closed connection's buffers into glibc's
      // arenas, which keep them (1000 refused TLS handshakes left 88 MB held
      // for good); this hands them back.
      if (absl::Now() - trimmed > absl::Seconds(1)) {
        malloc_trim(0);
        trimmed = absl::Now();
      }
      if (!stop_passed && Signalled()) {
        stop_passed = true;
        std::string who;
        if (!o_.stop_reason_file.empty()) std::getline(std::ifstream(o_.stop_reason_file), who);
        if (who.empty())
          who = absl::StrCat(SignalName(o_.stop_signal->load()), " to the coordinator");
        service_.RequestStop(who);
      }
      Turn();
      const auto s = service_.state();
      if (s == CoordinatorService::State::kFinished || s == CoordinatorService::State::kFailed ||
          s == CoordinatorService::State::kStopped) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    // The last rows and parts came with Done (Turn takes the rows before
    // the manifests that wait for them).
    Turn();
    if (!cfg_.checkpoint().dir().empty() &&
        service_.state() != CoordinatorService::State::kFailed) {
      // Every process has written what it will: incomplete folders go too.
      if (absl::Status st =
              PruneCheckpoints(cfg_.checkpoint().dir(), static_cast<int>(cfg_.checkpoint().keep()),
                               /*nothing_in_making=*/true);
          !st.ok()) {
        std::fprintf(stderr, "coordinator: %s\n", std::string(st.message()).c_str());
      }
    }
  }

  // Writes summary.json, lets the processes hear the outcome, and returns
  // the job's result; `server` is shut down.
  absl::Status Conclude(grpc::Server* server, grpc::Server* health) {
    const double wall = service_.WallSeconds();
    run::Summary summary = Summarize();
    // Written at once, in case this process is killed while it waits below.
    absl::Status written;
    if (metrics_) written = WriteSummaryJson(o_.out + "/summary.json", summary);
    const bool signalled = WaitForEveryoneTold();
    if (AppendRows() > 0) {
      summary = Summarize();
      if (metrics_) written = WriteSummaryJson(o_.out + "/summary.json", summary);
    }
    if (metrics_) {
      absl::Status st = metrics_status_;
      if (absl::Status closed = metrics_->Close(); st.ok()) st = closed;
      if (st.ok()) st = written;
      if (!st.ok() && (result_.ok() || absl::IsCancelled(result_))) result_ = st;
    }
    server->Shutdown(
        absl::ToChronoTime(absl::Now() + (signalled ? absl::Milliseconds(200) : absl::Seconds(1))));
    health->Shutdown(absl::ToChronoTime(absl::Now()));
    std::fprintf(
        stderr, "coordinator: %s (%.3f s, final loss %s)\n", verdict_.c_str(), wall,
        summary.has_final_loss() ? absl::StrFormat("%.6g", summary.final_loss()).c_str() : "n/a");
    LingerForLastScrape();
    return result_;
  }

  RefusalLog* refusals() { return &refusals_; }

 private:
  // A stop signal has come (SIGTERM, SIGINT).
  bool Signalled() const { return o_.stop_signal != nullptr && o_.stop_signal->load() != 0; }

  void Turn() {
    AppendRows();
    WriteManifests();
    RemoveFailed();
    RecordHistory();
  }

  // Returns how many rows it took. (Taken with or without a run folder: the
  // divergence watch sees every row.)
  size_t AppendRows() {
    const std::vector<MetricsRow> rows = service_.TakeNewRows();
    if (metrics_ && metrics_status_.ok()) metrics_status_ = metrics_->Append(rows);
    if (job_metrics_ != nullptr) {
      job_metrics_->Set(Progress(), checkpoint_bytes_);
      checkpoint_bytes_.reset();
      job_metrics_->AddRows(rows);
    }
    return rows.size();
  }

  // A checkpoint is complete once its manifest is written, last.
  void WriteManifests() {
    for (const checkpoint::Manifest& m : service_.TakeCompleteCheckpoints()) {
      const std::string dir = StepDir(cfg_.checkpoint().dir(), m.step());
      if (absl::Status st = WriteManifest(dir, m); !st.ok()) {
        service_.CheckpointFailed(m.step(), absl::StrCat("the coordinator: ", st.message()));
        continue;
      }
      // Complete; what the pruning leaves behind goes at the next one.
      if (absl::Status st =
              PruneCheckpoints(cfg_.checkpoint().dir(), static_cast<int>(cfg_.checkpoint().keep()));
          !st.ok()) {
        std::fprintf(stderr, "coordinator: checkpoint of step %llu: %s\n",
                     static_cast<unsigned long long>(m.step()), std::string(st.message()).c_str());
      }
      service_.CheckpointWritten(CompleteCheckpoint{dir, m});
      uint64_t bytes = 0;
      for (const checkpoint::ManifestFile& f : m.files()) bytes += f.size();
      checkpoint_bytes_ = bytes;
      std::fprintf(stderr, "coordinator: checkpoint of step %llu complete (%d files) in %s\n",
                   static_cast<unsigned long long>(m.step()), m.files_size(), dir.c_str());
    }
  }

  // A failed checkpoint's files go (a full volume keeps room for the next).
  void RemoveFailed() {
    for (uint64_t step : service_.TakeFailedCheckpoints()) {
      if (absl::Status st = RemoveIncompleteCheckpoint(cfg_.checkpoint().dir(), step); !st.ok()) {
        std::fprintf(stderr, "coordinator: %s\n", std::string(st.message()).c_str());
      }
    }
  }

  // After a roll-back: the history into the manifest rolled back to.
  void RecordHistory() {
    if (auto c = service_.TakeHistoryToRecord()) {
      if (absl::Status st = WriteManifest(c->dir, c->manifest); !st.ok()) {
        std::fprintf(stderr, "coordinator: recording the restarts in %s: %s\n", c->dir.c_str(),
                     std::string(st.message()).c_str());
      }
    }
  }

  // The summary, and the verdict and result it implies (called again when
  // late rows came).
  run::Summary Summarize() {
    verdict_ = "job finished";
    result_ = absl::OkStatus();
    run::Summary summary = service_.MakeSummary();
    if (service_.state() == CoordinatorService::State::kFailed) {
      result_ = absl::AbortedError(absl::StrCat("job failed: ", service_.reason()));
      verdict_ = std::string(result_.message());
    } else if (service_.state() == CoordinatorService::State::kStopped) {
      verdict_ = absl::StrCat("job stopped: ", service_.reason());
      result_ = absl::CancelledError(verdict_);
    } else if (!summary.workers_agree()) {
      verdict_ = "job finished but the replicas differ from the masters";
      result_ = absl::DataLossError(verdict_);
      summary.set_status(verdict_);
    } else if (!summary.replicas_equal()) {
      // --server-reply delta with a lossy reply codec: by design (docs/design.md §1.4).
      verdict_ = absl::StrFormat(
          "job finished; replicas trail the masters by the server error (largest %g)",
          summary.max_replica_master_diff());
    }
    if (service_.state() == CoordinatorService::State::kFinished && summary.has_durable() &&
        !summary.durable()) {
      // Trained as it should have been, but losing a process would have
      // cost more than the user planned for: say so where they look.
      absl::StrAppend(
          &verdict_, "; not durable: ", summary.checkpoint_errors(),
          " checkpoint(s) could not be written (last: ", summary.last_checkpoint_error(), "); ",
          summary.has_last_checkpoint_step()
              ? absl::StrCat("the last complete one is of step ", summary.last_checkpoint_step())
              : std::string("none is complete"));
    }
    return summary;
  }

  // Lets every live process hear the outcome through its heartbeat,
  // bounded; after a failure, also lets the workers send the metrics of the
  // steps they completed (their error reports carry them). Briefly when a
  // signal stopped us: the sender's grace period is short. (A job stopped
  // on request was stopped by that signal: its processes need the usual
  // time to hear STOP.) Returns whether a signal cut it short.
  bool WaitForEveryoneTold() {
    auto signalled_now = [&] {
      return Signalled() && service_.state() != CoordinatorService::State::kStopped;
    };
    bool signalled = signalled_now();
    const absl::Time deadline =
        absl::Now() +
        (signalled
             ? absl::Milliseconds(300)
             : std::max(absl::Seconds(2), absl::Milliseconds(cfg_.timeouts().heartbeat_ms()) / 2));
    while (!(service_.EveryoneTold() && service_.WorkersReportedLastMetrics()) &&
           absl::Now() < deadline) {
      // A signal meanwhile (onebit-launch stopping the rest after a
      // failure) ends the wait: SIGKILL may follow soon.
      if (!signalled && signalled_now()) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return signalled;
  }

  // The metrics stay up for --metrics_linger (a signal ends it), so that
  // the next scrape sees the outcome.
  void LingerForLastScrape() {
    if (job_metrics_ == nullptr) return;
    job_metrics_->Set(Progress(), checkpoint_bytes_);
    const absl::Time until = absl::Now() + o_.metrics_linger;
    while (absl::Now() < until && !Signalled()) {
      absl::SleepFor(std::min(absl::Milliseconds(50), until - absl::Now()));
    }
  }

  // The service's view, with the calls refused from their headers.
  JobState Progress() const {
    JobState s = service_.Progress();
    s.refused_unauthenticated += refusals_.total();
    return s;
  }

  const control::TrainingConfig& cfg_;
  const CoordinatorOptions& o_;
  CoordinatorService& service_;
  std::optional<MetricsLog> metrics_;
  absl::Status metrics_status_;  // the first error appending to metrics.csv
  // Calls without the job's credential, refused from their headers.
  RefusalLog refusals_{"coordinator"};
  std::unique_ptr<MetricsEndpoint> endpoint_;
  std::unique_ptr<JobMetrics> job_metrics_;
  std::optional<uint64_t> checkpoint_bytes_;  // of the checkpoint completed since the last Set
  std::string verdict_ = "job finished";
  absl::Status result_;
};

}  // namespace

absl::Status RunCoordinatorJob(const control::TrainingConfig& cfg,
                               const std::set<std::string>& given, const CoordinatorOptions& o) {
  if (absl::Status st = CheckOptions(o); !st.ok()) return st;
  if (absl::Status st = ValidateConfig(cfg); !st.ok()) return st;
  auto security = ResolveSecurity(o.secret_file, o.insecure, "CoordinatorOptions.secret_file");
  if (!security.ok()) return security.status();
  if (cfg.model().name() != kExternalModel) {
    auto map = ShardMapForConfig(cfg, ModelLayerEnds(cfg).value_or(std::vector<uint64_t>{}));
    if (!map.ok()) return map.status();
  }
  auto start = FindStartingPoint(cfg, o.out);
  if (!start.ok()) return start.status();
  // A resumed job is the same job: the same id.
  uint64_t job_id = NewRandomId();
  if (start->checkpoint && !absl::SimpleHexAtoi(start->checkpoint->manifest.job_id(), &job_id)) {
    return absl::DataLossError(absl::StrCat(start->checkpoint->dir, "/", kManifestName,
                                            ": job id '", start->checkpoint->manifest.job_id(),
                                            "' is not hex"));
  }
  std::fprintf(stderr, "%s\n", SecurityNotice(*security, "coordinator").c_str());
  CoordinatorService service(cfg, given, job_id, o.register_timeout, *security);
  if (start->checkpoint) {
    service.ResumeFrom(*std::move(start->checkpoint), std::move(start->prior_rows), start->restarts,
                       start->rolled_back, start->reached);
  }
  JobRun job(cfg, o, &service, std::move(start->metrics));
  EnableHealthService();
  int bound = 0;
  auto server = StartControlServer(cfg, o, *security, &service, job.refusals(), &bound);
  if (!server.ok()) return server.status();
  int health_bound = 0;
  auto health = StartHealthServer(o.bind_host, o.health_port, &health_bound);
  if (!health.ok()) return health.status();
  std::fprintf(stderr,
               "coordinator: job %016llx on %s:%d (health on port %d), waiting for %u servers and "
               "%u workers (%s, d=%llu, %llu steps)\n",
               static_cast<unsigned long long>(job_id), o.bind_host.c_str(), bound, health_bound,
               cfg.cluster().servers(), cfg.cluster().workers(),
               EnumText(cfg.optimizer().algorithm()).c_str(),
               static_cast<unsigned long long>(cfg.model().dim()),
               static_cast<unsigned long long>(cfg.model().steps()));
  // After that line, so that whoever reads --port_file finds it in the log.
  if (o.on_listening) o.on_listening(bound);
  if (absl::Status st = job.StartMetricsEndpoint(); !st.ok()) return st;
  job.RunToEnd();
  return job.Conclude(server->get(), health->get());
}

absl::Status RunCoordinator(const CoordinatorOptions& o) {
  control::TrainingConfig cfg = DefaultJobConfig();
  std::set<std::string> given;
  std::vector<std::string> ignored;
  absl::Status st =
      LoadConfigJson(o.config_json, "CoordinatorOptions.config_json", &cfg, &given, &ignored);
  if (st.ok()) st = ResolveConfig(given, &cfg);
  if (!st.ok()) return st;
  return RunCoordinatorJob(cfg, given, o);
}

}  // namespace onebit
