// What a worker exports to Prometheus (metrics/endpoint.h), labels
// role=worker and rank=<its rank>: its steps and their parts (the gradient
// computed between steps, the pushes encoded and sent, the wait for the
// replies, the replies applied), bytes up and down by phase and the
// compression ratio, rounds and local steps (zero-one-adam), chunks pushed
// while the gradient was still being computed, the loss it reported, its
// checkpoint files and roll-backs. Names follow Prometheus' conventions
// (metrics/families.h).
//
// Thread-safe, as the metrics are: the training thread updates most, the
// checkpoint writer's thread its files.
#ifndef ONEBIT_WORKER_WORKER_METRICS_H_
#define ONEBIT_WORKER_WORKER_METRICS_H_

#include <cstdint>

#include "metrics/endpoint.h"
#include "metrics/families.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"

namespace onebit {

// One completed step as the worker measured it (seconds on its own clock).
struct WorkerStepSample {
  uint64_t steps_done = 0;  // after it
  bool compressed = false;  // it ran in the compression phase
  bool local = false;       // it sent nothing (a local step)
  uint64_t bytes_up = 0;
  uint64_t bytes_down = 0;
  double step_s = 0;      // first push (or the step's begin) to its end
  double gradient_s = 0;  // between the last step's end and this one's, pushes aside
  double push_s = 0;      // encoding and sending its pushes
  double wait_s = 0;      // waiting for replies
  double apply_s = 0;     // decoding and applying the replies, finishing the step
  uint64_t chunks = 0;
  uint64_t chunks_overlapped = 0;
  bool has_loss = false;
  double loss = 0;
};

class WorkerMetrics {
 public:
  // Its metrics go into endpoint's registry; the endpoint must outlive it.
  // `num_params`: d, for the compression ratio (bytes over 4·d).
  WorkerMetrics(MetricsEndpoint* endpoint, uint32_t rank, uint64_t num_params);

  void StepDone(const WorkerStepSample& s);
  // Steps done without a step (a resume, a roll-back).
  void SetSteps(uint64_t steps) { steps_.Set(static_cast<double>(steps)); }
  void RolledBack() { rollbacks_.Increment(); }
  CheckpointWriteMetrics& checkpoints() { return checkpoints_; }

 private:
  MetricFactory f_;
  const double fp32_bytes_;
  prometheus::Gauge& steps_;
  prometheus::Gauge& compressing_;
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& gradient_seconds_;
  prometheus::Histogram& push_seconds_;
  prometheus::Histogram& wait_seconds_;
  prometheus::Histogram& apply_seconds_;
  prometheus::Counter& up_warmup_;
  prometheus::Counter& up_compress_;
  prometheus::Counter& down_warmup_;
  prometheus::Counter& down_compress_;
  prometheus::Gauge& ratio_up_;
  prometheus::Gauge& ratio_down_;
  prometheus::Counter& rounds_;
  prometheus::Counter& local_steps_;
  prometheus::Counter& chunks_;
  prometheus::Counter& chunks_overlapped_;
  LazyGauge loss_;
  prometheus::Counter& rollbacks_;
  CheckpointWriteMetrics checkpoints_;
};

}  // namespace onebit

#endif  // ONEBIT_WORKER_WORKER_METRICS_H_
