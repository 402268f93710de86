// A process's Prometheus metrics, served over HTTP at /metrics by
// prometheus-cpp (its registry, its text format): one endpoint per process,
// off unless the operator names a port. Nothing secret goes into it (no job
// id, no keys): labels say the role and rank or shard only.
//
// Thread-safe: the registry and the metrics made from it may be used from
// any thread; scrapes are served on the endpoint's own threads.
#ifndef ONEBIT_METRICS_ENDPOINT_H_
#define ONEBIT_METRICS_ENDPOINT_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace onebit {

class MetricsEndpoint {
 public:
  // Listens on `host`:`port` (port 0: a free one); every metric made from
  // registry() carries `labels` (e.g. {"role", "server"}, {"shard", "0"}).
  // Errors: UNAVAILABLE naming the address when it cannot listen.
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
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::map<std::string, std::string> labels_;
  int port_ = 0;
};

}  // namespace onebit

#endif  // ONEBIT_METRICS_ENDPOINT_H_
