// A process's Prometheus metrics, served over HTTP at /metrics: the
// registry and the text format are prometheus-cpp's; the HTTP server is a
// minimal one of our own (GET /metrics, one connection at a time, closed
// after the reply), because prometheus-cpp's (civetweb, Debian's build)
// runs its threads on fixed 100 KB stacks, out of which glibc also takes
// the process's static TLS: OpenBLAS alone holds 61 KB, and a worker's
// civetweb thread overflowed its stack on the first scrape. One endpoint
// per process, off unless the operator names a port. Nothing secret goes
// into it (no job id, no keys): labels say the role and rank or shard only.
//
// Thread-safe: the registry and the metrics made from it may be used from
// any thread; scrapes are served on the endpoint's own thread.
#ifndef ONEBIT_METRICS_ENDPOINT_H_
#define ONEBIT_METRICS_ENDPOINT_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "prometheus/registry.h"

namespace onebit {

class MetricsEndpoint {
 public:
  // Listens on `host`:`port` (port 0: a free one); every metric made from
  // registry() carries `labels` (e.g. {"role", "server"}, {"shard", "0"}).
  // Errors: UNAVAILABLE naming the address when it cannot listen.
  // The destructor stops serving (within ~100 ms).
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& host, int port, const std::map<std::string, std::string>& labels);
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  int port() const { return port_; }
  prometheus::Registry& registry() { return *registry_; }
  const std::map<std::string, std::string>& labels() const { return labels_; }

 private:
  MetricsEndpoint() = default;
  void Serve();
  // Answers one connection: the metrics, or an HTTP error.
  void Answer(int fd);

  std::shared_ptr<prometheus::Registry> registry_;
  std::map<std::string, std::string> labels_;
  int port_ = 0;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// What every process checks of its metrics options (the field's name
// before the message is the caller's): a port of -1 (none) or in
// [0, 65535]; a linger in [0s, 1h] (endless would keep a finished
// process up for ever).
absl::Status CheckMetricsPort(int port);
absl::Status CheckMetricsLinger(absl::Duration linger);

// After the process's work is done: keeps serving `linger` longer, so that
// the next scrape sees the end; returns early once *stop_signal (when not
// null) is non-zero.
void LingerForLastScrape(absl::Duration linger, const std::atomic<int>* stop_signal);

}  // namespace onebit

#endif  // ONEBIT_METRICS_ENDPOINT_H_
