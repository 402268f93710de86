// What the coordinator exports to Prometheus (metrics/endpoint.h): the job
// as a whole, from the rows it completes (step, loss, bytes per phase, step
// times) and its state (processes alive, restarts, checkpoints, the freeze
// rule's measure). Names follow Prometheus' conventions: units in the name,
// counters end in _total, bytes and seconds in base units.
//
// Not thread-safe: one thread (the coordinator's loop) updates it; scrapes
// read the metrics themselves, which are.
#ifndef ONEBIT_COORDINATOR_JOB_METRICS_H_
#define ONEBIT_COORDINATOR_JOB_METRICS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/job_state.h"
#include "job/run_folder.h"
#include "metrics/endpoint.h"
#include "metrics/families.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"

namespace onebit {

class JobMetrics {
 public:
  // Its metrics go into endpoint's registry; the endpoint must outlive it.
  explicit JobMetrics(MetricsEndpoint* endpoint);

  // The state as of now (call before AddRows: the compression ratio needs
  // d); `checkpoint_bytes`: the size of the checkpoint completed since the
  // last call, if one was.
  void Set(const JobState& s, std::optional<uint64_t> checkpoint_bytes);
  void AddRows(const std::vector<MetricsRow>& rows);

 private:
  uint64_t fp32_per_step_ = 0;
  prometheus::Gauge& steps_;
  prometheus::Gauge& compressing_;
  prometheus::Gauge& loss_;
  LazyGauge test_accuracy_;
  LazyGauge test_loss_;
  prometheus::Gauge& epoch_;
  prometheus::Counter& up_warmup_;
  prometheus::Counter& up_compress_;
  prometheus::Counter& down_warmup_;
  prometheus::Counter& down_compress_;
  prometheus::Gauge& ratio_up_;
  prometheus::Gauge& ratio_down_;
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& push_seconds_;
  prometheus::Histogram& reply_seconds_;
  prometheus::Counter& rounds_;
  prometheus::Counter& local_steps_;
  LazyGauge freeze_change_;
  prometheus::Gauge& workers_alive_;
  prometheus::Gauge& servers_alive_;
  prometheus::Gauge& workers_expected_;
  prometheus::Gauge& servers_expected_;
  prometheus::Counter& refused_unauthenticated_;
  prometheus::Counter& refused_malformed_;
  prometheus::Counter& refused_registration_;
  prometheus::Counter& refused_handshake_;
  prometheus::Counter& restarts_;
  prometheus::Counter& rollbacks_;
  prometheus::Counter& rolled_back_steps_;
  prometheus::Counter& checkpoints_;
  prometheus::Counter& checkpoint_errors_;
  LazyGauge checkpoint_step_;
  LazyGauge checkpoint_time_;
  LazyGauge checkpoint_bytes_;
  prometheus::Gauge& finished_;
  uint64_t checkpoints_seen_ = 0;
};

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_JOB_METRICS_H_
