#include "metrics/families.h"

namespace onebit {

prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double s = 0.001; s < 100; s *= 2) b.push_back(s);
  return b;
}

MetricFactory::MetricFactory(MetricsEndpoint* endpoint, const MetricLabels& labels)
    : registry_(endpoint->registry()), labels_(endpoint->labels()) {
  for (const auto& [k, v] : labels) labels_[k] = v;
}

prometheus::Family<prometheus::Gauge>& MetricFactory::GaugeFamily(const std::string& name,
                                                                  const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Labels(labels_).Register(registry_);
}

prometheus::Gauge& MetricFactory::Gauge(const std::string& name, const std::string& help,
                                        const MetricLabels& labels) {
  return GaugeFamily(name, help).Add(labels);
}

prometheus::Counter& MetricFactory::Counter(const std::string& name, const std::string& help,
                                            const MetricLabels& labels) {
  return prometheus::BuildCounter().Name(name).Help(help).Labels(labels_).Register(registry_).Add(
      labels);
}

prometheus::Histogram& MetricFactory::Histogram(
    const std::string& name, const std::string& help, const MetricLabels& labels,
    const prometheus::Histogram::BucketBoundaries& buckets) {
  return prometheus::BuildHistogram().Name(name).Help(help).Labels(labels_).Register(registry_).Add(
      labels, buckets);
}

void LazyGauge::Set(double v) {
  if (gauge_ == nullptr) gauge_ = &family_.Add({});
  gauge_->Set(v);
}

void AdvanceTo(prometheus::Counter& c, double value) {
  if (value > c.Value()) c.Increment(value - c.Value());
}

CheckpointWriteMetrics::CheckpointWriteMetrics(MetricFactory& f, const std::string& prefix)
    : writes_(f.Counter(prefix + "_checkpoint_writes_total",
                        "Checkpoint files this process wrote completely")),
      errors_(f.Counter(prefix + "_checkpoint_errors_total",
                        "Checkpoint files this process could not write")),
      bytes_(f.Counter(prefix + "_checkpoint_written_bytes_total",
                       "Bytes of the checkpoint files this process wrote")),
      seconds_(f.Histogram(prefix + "_checkpoint_write_seconds",
                           "Time to write one checkpoint file (beside training)")) {}

void CheckpointWriteMetrics::Written(bool ok, double bytes, double seconds) {
  if (!ok) {
    errors_.Increment();
    return;
  }
  writes_.Increment();
  bytes_.Increment(bytes);
  seconds_.Observe(seconds);
}

}  // namespace onebit
