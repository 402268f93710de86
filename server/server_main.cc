// onebit-server: RunServer (include/onebit/server.h) from the command line:
// registers with the coordinator, binds a ZeroMQ ROUTER on its data port and
// serves one shard until the coordinator says the job is over.

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "job/flags.h"
#include "job/metrics_flags.h"
#include "job/security_flags.h"
#include "metrics/endpoint.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "onebit/server.h"
#include "util/crash_report.h"
#include "util/process_exit.h"
#include "util/stop_signal.h"

ABSL_FLAG(std::string, coordinator, "", "coordinator address host:port (required)");
ABSL_FLAG(int32_t, shard, -1, "the shard (server rank) to serve; -1: any free one");
ABSL_FLAG(std::string, bind_host, "0.0.0.0", "address to bind the data and health ports on");
ABSL_FLAG(int32_t, data_port, 0, "ZeroMQ data port; 0: any free port");
ABSL_FLAG(std::string, advertise_host, "",
          "address workers use to reach this server (default: the hostname)");
ABSL_FLAG(int32_t, health_port, 0, "grpc.health.v1 port; 0: any free port");
ABSL_FLAG(absl::Duration, register_timeout, absl::Seconds(60),
          "how long to wait for the coordinator and the whole cluster to register");
ABSL_FLAG(std::string, dump_x, "", "write the final master shard (raw fp32) to this file");
ABSL_FLAG(std::string, dump_error, "",
          "write the final server error feedback e_s of the shard (raw fp32) to this file");

ABSL_FLAG(int32_t, exit_code_when_stopped, 0,
          "exit with this code when the job stopped on request (SIGTERM to one of its processes) "
          "after a complete checkpoint; e.g. 75, which a Kubernetes Job's podFailurePolicy ignores "
          "(deploy/k8s): the pod is started again and the job resumes");

namespace onebit {
namespace {

int Main(int argc, char** argv) {
  ReportCrashes(argc > 0 ? argv[0] : "");
  KeepLargeBuffers();
  ParseFlagsOrExit(argc, argv,
                   "onebit-server --coordinator HOST:PORT [--data_port P] [--advertise_host H]\n"
                   "Serves one shard of the parameters over ZeroMQ.");
  ServerOptions o;
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  if (o.coordinator.empty()) ExitFlagError("coordinator", "required");
  o.shard = absl::GetFlag(FLAGS_shard);
  if (o.shard < -1) ExitFlagError("shard", "must be -1 (any) or a shard");
  if (const int code = absl::GetFlag(FLAGS_exit_code_when_stopped); code < 0 || code > 255) {
    ExitFlagError("exit_code_when_stopped", "must be in [0, 255] (an exit status)");
  }
  o.bind_host = absl::GetFlag(FLAGS_bind_host);
  o.data_port = absl::GetFlag(FLAGS_data_port);
  if (o.data_port < 0 || o.data_port > 65535) ExitFlagError("data_port", "must be in [0, 65535]");
  o.health_port = absl::GetFlag(FLAGS_health_port);
  if (o.health_port < 0 || o.health_port > 65535) {
    ExitFlagError("health_port", "must be in [0, 65535]");
  }
  o.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  o.register_timeout = absl::GetFlag(FLAGS_register_timeout);
  if (absl::Status st = CheckTimeout(o.register_timeout); !st.ok()) {
    ExitFlagError("register_timeout", st.message());
  }
  const MetricsFlags metrics = MetricsFlagsOrExit();
  o.metrics_port = metrics.port;
  o.metrics_host = metrics.host;
  o.metrics_linger = metrics.linger;
  o.dump_x = absl::GetFlag(FLAGS_dump_x);
  o.dump_error = absl::GetFlag(FLAGS_dump_error);
  // SIGTERM (Kubernetes, onebit-launch): stop the job after a checkpoint.
  CatchStopSignals();
  // Last: every other flag is checked first.
  const SecurityFlags security = SecurityFlagsOrExit();
  o.secret_file = security.secret_file;
  o.insecure = security.insecure;
  o.stop_signal = StopSignalFlag();
  absl::Status st = RunServer(o);
  if (absl::IsCancelled(st)) {
    std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
    return absl::GetFlag(FLAGS_exit_code_when_stopped);
  }
  if (!st.ok()) ExitError(1, std::string(st.message()));
  return 0;
}

}  // namespace
}  // namespace onebit

// Ends without static destructors (util/process_exit.h says why).
int main(int argc, char** argv) { onebit::ExitWithoutTeardown(onebit::Main(argc, argv)); }
