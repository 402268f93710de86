#include "job/metrics_flags.h"

#include "absl/flags/flag.h"
#include "job/flags.h"
#include "metrics/endpoint.h"

ABSL_FLAG(int32_t, metrics_port, -1,
          "serve this process's Prometheus metrics over HTTP at /metrics on this port (README: "
          "Watching a job); -1: none, 0: any free port (the log says which)");
ABSL_FLAG(std::string, metrics_host, "", "address the metrics listen on; empty: --bind_host");
ABSL_FLAG(absl::Duration, metrics_linger, absl::ZeroDuration(),
          "after this process's part of the job ends, keep serving its metrics this long, so "
          "that the next scrape sees the end (at most 1h; a signal ends it)");

namespace onebit {

MetricsFlags MetricsFlagsOrExit() {
  MetricsFlags f;
  f.port = absl::GetFlag(FLAGS_metrics_port);
  if (absl::Status st = CheckMetricsPort(f.port); !st.ok()) {
    ExitFlagError("metrics_port", st.message());
  }
  f.host = absl::GetFlag(FLAGS_metrics_host);
  f.linger = absl::GetFlag(FLAGS_metrics_linger);
  if (absl::Status st = CheckMetricsLinger(f.linger); !st.ok()) {
    ExitFlagError("metrics_linger", st.message());
  }
  return f;
}

}  // namespace onebit
