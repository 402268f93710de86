// Building a process's metrics (metrics/endpoint.h) the one way every role
// does: each family carries the endpoint's labels and the role's own (a
// server's shard, a worker's rank), names follow Prometheus' conventions
// (units in the name, counters end in _total, bytes and seconds in base
// units), and a metric is made once, when its owner is built: the returned
// references are kept and updated without any lookup.
//
// Thread-safe: building and updating may happen on any thread.
#ifndef ONEBIT_METRICS_FAMILIES_H_
#define ONEBIT_METRICS_FAMILIES_H_

#include <map>
#include <string>

#include "metrics/endpoint.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"

namespace onebit {

using MetricLabels = std::map<std::string, std::string>;

// Bucket bounds for durations: 1 ms to about 65 s, doubling.
prometheus::Histogram::BucketBoundaries SecondsBuckets();

class MetricFactory {
 public:
  // Families go into endpoint's registry (it must outlive them) with its
  // labels and `labels` (e.g. {"shard", "2"}).
  explicit MetricFactory(MetricsEndpoint* endpoint, const MetricLabels& labels = {});

  // One metric of family `name`; a family made before (same name) is
  // reused, so `help` counts only the first time. `labels`: this metric's
  // own (e.g. {"direction", "up"}).
  prometheus::Gauge& Gauge(const std::string& name, const std::string& help,
                           const MetricLabels& labels = {});
  prometheus::Counter& Counter(const std::string& name, const std::string& help,
                               const MetricLabels& labels = {});
  prometheus::Histogram& Histogram(
      const std::string& name, const std::string& help, const MetricLabels& labels = {},
      const prometheus::Histogram::BucketBoundaries& buckets = SecondsBuckets());
  prometheus::Family<prometheus::Gauge>& GaugeFamily(const std::string& name,
                                                     const std::string& help);

 private:
  prometheus::Registry& registry_;
  MetricLabels labels_;
};

// A gauge that appears at its first value: absent (not 0) until then, as a
// test accuracy never reported or a checkpoint never written. Not
// thread-safe (one owner thread); the gauge itself is.
class LazyGauge {
 public:
  explicit LazyGauge(prometheus::Family<prometheus::Gauge>& family) : family_(family) {}
  void Set(double v);

 private:
  prometheus::Family<prometheus::Gauge>& family_;
  prometheus::Gauge* gauge_ = nullptr;
};

// Advances a counter of a count kept elsewhere (a ZAP handler's refusals,
// a history restored from a checkpoint) to `value`; never back.
void AdvanceTo(prometheus::Counter& c, double value);

// What a process's checkpoint files cost it: writes, their duration and
// bytes, and the writes that failed. Families `<prefix>_checkpoint_...`.
class CheckpointWriteMetrics {
 public:
  CheckpointWriteMetrics(MetricFactory& f, const std::string& prefix);
  // One file written (ok) or not; any thread.
  void Written(bool ok, double bytes, double seconds);

 private:
  prometheus::Counter& writes_;
  prometheus::Counter& errors_;
  prometheus::Counter& bytes_;
  prometheus::Histogram& seconds_;
};

}  // namespace onebit

#endif  // ONEBIT_METRICS_FAMILIES_H_
