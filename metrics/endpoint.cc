#include "metrics/endpoint.h"

#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"
#include "prometheus/exposer.h"

namespace onebit {

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& host, int port, const std::map<std::string, std::string>& labels) {
  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
  e->registry_ = std::make_shared<prometheus::Registry>();
  e->labels_ = labels;
  const std::string address = absl::StrCat(host, ":", port);
  try {
    // One thread: a scrape is a few kilobytes, a few times a minute.
    e->exposer_ = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/1);
  } catch (const std::exception& ex) {
    // civetweb throws when it cannot bind.
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", ex.what()));
  }
  const std::vector<int> ports = e->exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address));
  }
  e->port_ = ports.front();
  e->exposer_->RegisterCollectable(e->registry_);
  return e;
}

MetricsEndpoint::~MetricsEndpoint() = default;

}  // namespace onebit
