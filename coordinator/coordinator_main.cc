// onebit-coordinator: RunCoordinator (include/onebit/server.h) from the
// command line: holds the job's one training config, forms the cluster,
// watches heartbeats, collects metrics and checksums, writes --out.
#include <cstdio>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "coordinator/coordinator.h"
#include "job/config.h"
#include "job/flags.h"
#include "job/metrics_flags.h"
#include "job/run_folder.h"
#include "job/security_flags.h"
#include "net/control.h"
#include "onebit/server.h"
#include "util/crash_report.h"
#include "util/process_exit.h"
#include "util/stop_signal.h"

ABSL_FLAG(std::string, bind_host, "0.0.0.0", "address to listen on");
ABSL_FLAG(int32_t, port, 7070, "gRPC port; 0: any free port (see --port_file)");
ABSL_FLAG(int32_t, health_port, 0,
          "plaintext grpc.health.v1 port (health only, for probes such as Kubernetes' gRPC "
          "probes); 0: any free port");
ABSL_FLAG(std::string, port_file, "", "write the bound port to this file once listening");
ABSL_FLAG(std::string, stop_reason_file, "",
          "on SIGTERM/SIGINT, the first line of this file (if any) says who stopped the job, "
          "for summary.json (onebit-launch writes it)");
ABSL_FLAG(std::string, out, "", "run folder: metrics.csv and summary.json");
ABSL_FLAG(absl::Duration, register_timeout, absl::Seconds(60),
          "how long to wait for all servers and workers to register");
ABSL_FLAG(int32_t, exit_code_when_stopped, 0,
          "exit with this code when the job stopped on request (SIGTERM to one of its processes) "
          "after a complete checkpoint; e.g. 75, which a Kubernetes Job's podFailurePolicy ignores "
          "(deploy/k8s): the pod is started again and the job resumes");

namespace onebit {
namespace {

// Exit status (sysexits' EX_CONFIG) when the coordinator refuses to run this
// job against what it finds on disk: a finished run folder in --out
// (summary.json "ok"), a checkpoint written under another config, --resume
// without a complete checkpoint, or a config refused after parsing. Running
// it again would be refused again, so deploy/k8s's podFailurePolicy fails the
// job at once on it (as on 2, a refused command line or train.json) instead
// of retrying; any other failure (1) is retried.
constexpr int kExitRefused = 78;

int Main(int argc, char** argv) {
  ReportCrashes(argc > 0 ? argv[0] : "");
  std::set<std::string> given;
  const control::TrainingConfig cfg = ConfigFromCommandLineOrExit(
      argc, argv,
      "onebit-coordinator --workers N --servers S [--model synthetic --dim D --steps T ...]\n"
      "Forms the cluster, hands out ranks and the shard map, watches it, writes --out.",
      &given);
  CoordinatorOptions o;
  if (const int code = absl::GetFlag(FLAGS_exit_code_when_stopped); code < 0 || code > 255) {
    ExitFlagError("exit_code_when_stopped", "must be in [0, 255] (an exit status)");
  }
  o.bind_host = absl::GetFlag(FLAGS_bind_host);
  o.port = absl::GetFlag(FLAGS_port);
  if (o.port < 0 || o.port > 65535) ExitFlagError("port", "must be in [0, 65535]");
  o.health_port = absl::GetFlag(FLAGS_health_port);
  if (o.health_port < 0 || o.health_port > 65535) {
    ExitFlagError("health_port", "must be in [0, 65535]");
  }
  const MetricsFlags metrics = MetricsFlagsOrExit();
  o.metrics_port = metrics.port;
  o.metrics_host = metrics.host;
  o.metrics_linger = metrics.linger;
  o.out = absl::GetFlag(FLAGS_out);
  if (!o.out.empty()) {
    if (absl::Status st = MakeDirs(o.out); !st.ok()) ExitFlagError("out", st.message());
  }
  if (cfg.model().name() != kExternalModel) {
    auto map = ShardMapForConfig(cfg, ModelLayerEnds(cfg).value_or(std::vector<uint64_t>{}));
    if (!map.ok()) ExitError(2, std::string(map.status().message()));
  }
  o.register_timeout = absl::GetFlag(FLAGS_register_timeout);
  if (absl::Status st = CheckTimeout(o.register_timeout); !st.ok()) {
    ExitFlagError("register_timeout", st.message());
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  bool port_written = true;
  if (!port_file.empty()) {
    o.on_listening = [&](int port) {
      const std::string tmp = port_file + ".tmp";
      std::ofstream(tmp) << port << "\n";
      port_written = std::rename(tmp.c_str(), port_file.c_str()) == 0;
    };
  }
  // Last: every other flag is checked first.
  const SecurityFlags security = SecurityFlagsOrExit();
  o.secret_file = security.secret_file;
  o.insecure = security.insecure;
  // SIGTERM (Kubernetes, onebit-launch) or SIGINT: stop the job after a
  // checkpoint, or end it writing the run folder, instead of dying with it
  // unwritten.
  CatchStopSignals();
  o.stop_signal = StopSignalFlag();
  o.stop_reason_file = absl::GetFlag(FLAGS_stop_reason_file);
  absl::Status st = RunCoordinatorJob(cfg, given, o);
  if (!port_written) ExitError(1, absl::StrCat("cannot write --port_file ", port_file));
  if (absl::IsCancelled(st)) return absl::GetFlag(FLAGS_exit_code_when_stopped);
  // RunCoordinatorJob refuses before it listens with these two codes (a
  // finished run folder and a resume conflict are FailedPrecondition); the
  // job's own failures are Aborted, DataLoss or Unavailable.
  if (absl::IsFailedPrecondition(st) || absl::IsInvalidArgument(st)) {
    ExitError(kExitRefused, st.message());
  }
  if (!st.ok()) ExitError(1, st.message());
  return 0;
}

}  // namespace
}  // namespace onebit

// Ends without static destructors (util/process_exit.h says why).
int main(int argc, char** argv) { onebit::ExitWithoutTeardown(onebit::Main(argc, argv)); }
