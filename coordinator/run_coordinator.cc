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
  if (cfg.checkpoint_dir().empty()) return std::nullopt;
  std::vector<std::string> refused;
  auto latest = LatestCheckpoint(cfg.checkpoint_dir(), &refused);
  for (const std::string& r : refused) {
    std::fprintf(stderr, "coordinator: not resuming from %s\n", r.c_str());
  }
  if (absl::IsNotFound(latest.status())) {
    if (!cfg.resume()) return std::nullopt;
    return absl::FailedPreconditionError(absl::StrCat(
        "--resume: no complete checkpoint under ", cfg.checkpoint_dir(),
        refused.empty() ? "" : absl::StrCat(" (refused: ", absl::StrJoin(refused, "; "), ")")));
  }
  if (!latest.ok()) return latest.status();
  // A --model external job's d comes from its workers: checked again then.
  control::TrainingConfig mine = cfg;
  if (cfg.model() == kExternalModel) mine.set_dim(latest->manifest.config().dim());
  if (absl::Status st = CheckResumable(mine, *latest); !st.ok()) return st;
  return std::optional<CompleteCheckpoint>(*std::move(latest));
}

}  // namespace

absl::Status RunCoordinatorJob(const control::TrainingConfig& cfg,
                               const std::set<std::string>& given, const CoordinatorOptions& o) {
  for (auto [name, port] : {std::pair{"port", o.port}, {"health_port", o.health_port}}) {
    if (port < 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("CoordinatorOptions.", name, ": must be in [0, 65535]"));
    }
  }
  if (absl::Status st = CheckTimeout(o.register_timeout); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("CoordinatorOptions.register_timeout: ", st.message()));
  }
  if (absl::Status st = ValidateConfig(cfg); !st.ok()) return st;
  auto security = ResolveSecurity(o.secret_file, o.insecure, "CoordinatorOptions.secret_file");
  if (!security.ok()) return security.status();
  if (cfg.model() != kExternalModel) {
    auto map = ShardMapForConfig(cfg, ModelLayerEnds(cfg).value_or(std::vector<uint64_t>{}));
    if (!map.ok()) return map.status();
  }
  auto resume = FindResumePoint(cfg);
  if (!resume.ok()) return resume.status();
  std::optional<MetricsLog> metrics;
  std::vector<MetricsRow> prior_rows;
  // The job's history: the checkpoint's, or the run folder's when that
  // knows of later restarts (the manifest was written before them).
  uint32_t restarts = 0;
  uint64_t rolled_back = 0;
  uint64_t reached = 0;  // the most steps the interrupted run is known to have completed
  if (*resume) {
    restarts = (*resume)->manifest.restarts() + 1;
    rolled_back = (*resume)->manifest.rolled_back_steps();
  }
  if (!o.out.empty()) {
    if (absl::Status st = MakeDirs(o.out); !st.ok()) return st;
    if (absl::Status st = CheckNotFinished(o.out); !st.ok()) return st;
    const std::string path = o.out + "/metrics.csv";
    if (*resume) {
      // The interrupted run's rows before the checkpoint stay; the steps
      // after it are run again.
      auto rows = ReadMetricsCsv(path);
      if (!rows.ok()) return rows.status();
      uint64_t lost = 0;
      for (MetricsRow& r : *rows) {
        if (r.step < (*resume)->manifest.step()) {
          prior_rows.push_back(std::move(r));
        } else {
          ++lost;
        }
      }
      if (auto before = ReadRestartHistory(o.out + "/summary.json")) {
        restarts = std::max(restarts, before->restarts + 1);
        rolled_back = std::max(rolled_back, before->rolled_back_steps);
      }
      rolled_back += lost;
      reached = (*resume)->manifest.step() + lost;
    }
    auto log = MetricsLog::Open(path, prior_rows);
    if (!log.ok()) return log.status();
    metrics = *std::move(log);
  }

  // A resumed job is the same job: the same id.
  uint64_t job_id = NewRandomId();
  if (*resume && !absl::SimpleHexAtoi((*resume)->manifest.job_id(), &job_id)) {
    return absl::DataLossError(absl::StrCat((*resume)->dir, "/", kManifestName, ": job id '",
                                            (*resume)->manifest.job_id(), "' is not hex"));
  }
  std::fprintf(stderr, "%s\n", SecurityNotice(*security, "coordinator").c_str());
  CoordinatorService service(cfg, given, job_id, o.register_timeout, *security);
  if (*resume) {
    service.ResumeFrom(**std::move(resume), std::move(prior_rows), restarts, rolled_back, reached);
  }
  EnableHealthService();
  // Calls without the job's credential, refused from their headers (before
  // their requests are read) and counted here.
  RefusalLog unauthenticated("coordinator");
  grpc::ServerBuilder builder;
  ConfigureExclusivePort(&builder);
  BoundControlServer(cfg, &builder);
  const std::string addr = absl::StrCat(o.bind_host, ":", o.port);
  int bound = 0;
  builder.AddListeningPort(addr,
                           ControlServerCredentials(*security,
                                                    [&unauthenticated](absl::string_view rpc) {
                                                      unauthenticated.Refused(absl::StrCat(
                                                          "a ", rpc, ": no valid job credential"));
                                                    }),
                           &bound);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", addr, ": address in use or not available"));
  }
  int health_bound = 0;
  auto health = StartHealthServer(o.bind_host, o.health_port, &health_bound);
  if (!health.ok()) return health.status();
  std::fprintf(stderr,
               "coordinator: job %016llx on %s:%d (health on port %d), waiting for %u servers and "
               "%u workers (%s, d=%llu, %llu steps)\n",
               static_cast<unsigned long long>(job_id), o.bind_host.c_str(), bound, health_bound,
               cfg.servers(), cfg.workers(), cfg.optimizer().c_str(),
               static_cast<unsigned long long>(cfg.dim()),
               static_cast<unsigned long long>(cfg.steps()));
  // After that line, so that whoever reads --port_file finds it in the log.
  if (o.on_listening) o.on_listening(bound);

  // Prometheus: the job's metrics, refreshed at every turn of the loop below.
  std::unique_ptr<MetricsEndpoint> endpoint;
  std::unique_ptr<JobMetrics> job_metrics;
  std::optional<uint64_t> checkpoint_bytes;  // of the checkpoint completed since the last refresh
  if (o.metrics_port >= 0) {
    const std::string host = o.metrics_host.empty() ? o.bind_host : o.metrics_host;
    auto e = MetricsEndpoint::Start(host, o.metrics_port, {{"role", "coordinator"}});
    if (!e.ok()) return e.status();
    endpoint = *std::move(e);
    job_metrics = std::make_unique<JobMetrics>(endpoint.get());
    std::fprintf(stderr, "coordinator: metrics on http://%s:%d/metrics\n", host.c_str(),
                 endpoint->port());
  }
  absl::Status metrics_status;
  // Returns how many rows it took. (Taken with or without a run folder: the
  // divergence watch sees every row.)
  auto append_rows = [&] {
    const std::vector<MetricsRow> rows = service.TakeNewRows();
    if (metrics && metrics_status.ok()) metrics_status = metrics->Append(rows);
    if (job_metrics != nullptr) {
      job_metrics->Set(service.Progress(), checkpoint_bytes);
      checkpoint_bytes.reset();
      job_metrics->AddRows(rows);
    }
    return rows.size();
  };
  // A checkpoint is complete once its manifest is written, last.
  auto write_manifests = [&] {
    for (const checkpoint::Manifest& m : service.TakeCompleteCheckpoints()) {
      const std::string dir = StepDir(cfg.checkpoint_dir(), m.step());
      if (absl::Status st = WriteManifest(dir, m); !st.ok()) {
        service.CheckpointFailed(m.step(), absl::StrCat("the coordinator: ", st.message()));
        continue;
      }
      // Complete; what the pruning leaves behind goes at the next one.
      if (absl::Status st =
              PruneCheckpoints(cfg.checkpoint_dir(), static_cast<int>(cfg.checkpoint_keep()));
          !st.ok()) {
        std::fprintf(stderr, "coordinator: checkpoint of step %llu: %s\n",
                     static_cast<unsigned long long>(m.step()), std::string(st.message()).c_str());
      }
      service.CheckpointWritten(CompleteCheckpoint{dir, m});
      uint64_t bytes = 0;
      for (const checkpoint::ManifestFile& f : m.files()) bytes += f.size();
      checkpoint_bytes = bytes;
      std::fprintf(stderr, "coordinator: checkpoint of step %llu complete (%d files) in %s\n",
                   static_cast<unsigned long long>(m.step()), m.files_size(), dir.c_str());
    }
  };
  // A failed checkpoint's files go (a full volume keeps room for the next).
  auto remove_failed = [&] {
    for (uint64_t step : service.TakeFailedCheckpoints()) {
      if (absl::Status st = RemoveIncompleteCheckpoint(cfg.checkpoint_dir(), step); !st.ok()) {
        std::fprintf(stderr, "coordinator: %s\n", std::string(st.message()).c_str());
      }
    }
  };
  // After a roll-back: the history into the manifest rolled back to.
  auto record_history = [&] {
    if (auto c = service.TakeHistoryToRecord()) {
      if (absl::Status st = WriteManifest(c->dir, c->manifest); !st.ok()) {
        std::fprintf(stderr, "coordinator: recording the restarts in %s: %s\n", c->dir.c_str(),
                     std::string(st.message()).c_str());
      }
    }
  };
  absl::Time trimmed = absl::Now();
  bool stop_passed = false;  // the stop signal, to the service once
  while (true) {
    service.Tick();
    unauthenticated.Flush();
    // gRPC's threads free a closed connection's buffers into glibc's
    // arenas, which keep them (1000 refused TLS handshakes left 88 MB held
    // for good); this hands them back.
    if (absl::Now() - trimmed > absl::Seconds(1)) {
      malloc_trim(0);
      trimmed = absl::Now();
    }
    if (!stop_passed && o.stop_signal != nullptr && o.stop_signal->load() != 0) {
      stop_passed = true;
      std::string who;
      if (!o.stop_reason_file.empty()) std::getline(std::ifstream(o.stop_reason_file), who);
      if (who.empty()) who = absl::StrCat(SignalName(o.stop_signal->load()), " to the coordinator");
      service.RequestStop(who);
    }
    append_rows();
    write_manifests();
    remove_failed();
    record_history();
    const auto s = service.state();
    if (s == CoordinatorService::State::kFinished || s == CoordinatorService::State::kFailed ||
        s == CoordinatorService::State::kStopped) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  write_manifests();  // the last parts came with Done
  remove_failed();
  record_history();
  if (!cfg.checkpoint_dir().empty() && service.state() != CoordinatorService::State::kFailed) {
    // Every process has written what it will: incomplete folders go too.
    if (absl::Status st =
            PruneCheckpoints(cfg.checkpoint_dir(), static_cast<int>(cfg.checkpoint_keep()),
                             /*nothing_in_making=*/true);
        !st.ok()) {
      std::fprintf(stderr, "coordinator: %s\n", std::string(st.message()).c_str());
    }
  }
  append_rows();
  const double wall = service.WallSeconds();
  absl::Status result;
  std::string verdict = "job finished";
  auto summarize = [&] {
    verdict = "job finished";  // (called again when late rows came)
    run::Summary summary = service.MakeSummary();
    if (service.state() == CoordinatorService::State::kFailed) {
      result = absl::AbortedError(absl::StrCat("job failed: ", service.reason()));
      verdict = std::string(result.message());
    } else if (service.state() == CoordinatorService::State::kStopped) {
      verdict = absl::StrCat("job stopped: ", service.reason());
      result = absl::CancelledError(verdict);
    } else if (!summary.workers_agree()) {
      verdict = "job finished but the replicas differ from the masters";
      result = absl::DataLossError(verdict);
      summary.set_status(verdict);
    } else if (!summary.replicas_equal()) {
      // --server-reply delta with a lossy reply codec: by design (docs/design.md §1.4).
      verdict = absl::StrFormat(
          "job finished; replicas trail the masters by the server error (largest %g)",
          summary.max_replica_master_diff());
    }
    if (service.state() == CoordinatorService::State::kFinished && summary.has_durable() &&
        !summary.durable()) {
      // Trained as it should have been, but losing a process would have
      // cost more than the user planned for: say so where they look.
      absl::StrAppend(
          &verdict, "; not durable: ", summary.checkpoint_errors(),
          " checkpoint(s) could not be written (last: ", summary.last_checkpoint_error(), "); ",
          summary.has_last_checkpoint_step()
              ? absl::StrCat("the last complete one is of step ", summary.last_checkpoint_step())
              : std::string("none is complete"));
    }
    return summary;
  };
  run::Summary summary = summarize();
  // Written at once, in case this process is killed while it waits below.
  absl::Status written;
  if (metrics) written = WriteSummaryJson(o.out + "/summary.json", summary);
  // Let every live process hear the outcome through its heartbeat, bounded;
  // after a failure, also let the workers send the metrics of the steps
  // they completed (their error reports carry them). Briefly when a signal
  // stopped us: the sender's grace period is short.
  // (A job stopped on request was stopped by that signal: its processes
  // need the usual time to hear STOP.)
  auto signalled_now = [&] {
    return o.stop_signal != nullptr && o.stop_signal->load() != 0 &&
           service.state() != CoordinatorService::State::kStopped;
  };
  bool signalled = signalled_now();
  const absl::Time deadline =
      absl::Now() +
      (signalled ? absl::Milliseconds(300)
                 : std::max(absl::Seconds(2), absl::Milliseconds(cfg.heartbeat_timeout_ms()) / 2));
  while (!(service.EveryoneTold() && service.WorkersReportedLastMetrics()) &&
         absl::Now() < deadline) {
    // A signal meanwhile (onebit-launch stopping the rest after a
    // failure) ends the wait: SIGKILL may follow soon.
    if (!signalled && signalled_now()) {
      signalled = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (append_rows() > 0) {
    summary = summarize();
    if (metrics) written = WriteSummaryJson(o.out + "/summary.json", summary);
  }
  if (metrics) {
    absl::Status st = metrics_status;
    if (absl::Status closed = metrics->Close(); st.ok()) st = closed;
    if (st.ok()) st = written;
    if (!st.ok() && (result.ok() || absl::IsCancelled(result))) result = st;
  }
  server->Shutdown(
      absl::ToChronoTime(absl::Now() + (signalled ? absl::Milliseconds(200) : absl::Seconds(1))));
  (*health)->Shutdown(absl::ToChronoTime(absl::Now()));
  std::fprintf(
      stderr, "coordinator: %s (%.3f s, final loss %s)\n", verdict.c_str(), wall,
      summary.has_final_loss() ? absl::StrFormat("%.6g", summary.final_loss()).c_str() : "n/a");
  if (job_metrics != nullptr) {
    job_metrics->Set(service.Progress(), checkpoint_bytes);
    const absl::Time until = absl::Now() + o.metrics_linger;
    while (absl::Now() < until && !(o.stop_signal != nullptr && o.stop_signal->load() != 0)) {
      absl::SleepFor(std::min(absl::Milliseconds(50), until - absl::Now()));
    }
  }
  return result;
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
