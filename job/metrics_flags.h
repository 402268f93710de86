// --metrics_port, --metrics_host and --metrics_linger, for the programs that
// serve a process's Prometheus metrics (onebit-coordinator, -server,
// -worker). Linked only by them (onebit_metrics_flags), so the others do not
// take the flags.
#ifndef ONEBIT_JOB_METRICS_FLAGS_H_
#define ONEBIT_JOB_METRICS_FLAGS_H_

#include <string>

#include "absl/time/time.h"

namespace onebit {

struct MetricsFlags {
  int port = -1;     // -1: none; 0: any free port
  std::string host;  // "": the program's --bind_host
  absl::Duration linger;
};

// The flags' values once checked (metrics/endpoint.h): exits 2 naming the
// flag when one is out of range. Call after ParseFlagsOrExit.
MetricsFlags MetricsFlagsOrExit();

}  // namespace onebit

#endif  // ONEBIT_JOB_METRICS_FLAGS_H_
