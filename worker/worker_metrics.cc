#include "worker/worker_metrics.h"

#include <string>

namespace onebit {

WorkerMetrics::WorkerMetrics(MetricsEndpoint* e, uint32_t rank, uint64_t num_params)
    : f_(e, {{"rank", std::to_string(rank)}}),
      fp32_bytes_(4.0 * static_cast<double>(num_params)),
      steps_(f_.Gauge("onebit_worker_steps", "Steps this worker has completed")),
      compressing_(f_.Gauge("onebit_worker_compression_phase",
                            "1 once the last step ran in the compression phase, 0 in the warm-up")),
      step_seconds_(f_.Histogram("onebit_worker_step_seconds",
                                 "Duration of a step: its first push to its replies applied")),
      gradient_seconds_(f_.Histogram("onebit_worker_step_part_seconds",
                                     "A step's parts on this worker: gradient (the time between "
                                     "steps, pushes aside), push (encode and send), wait (for "
                                     "the replies), apply (decode and update)",
                                     {{"part", "gradient"}})),
      push_seconds_(f_.Histogram("onebit_worker_step_part_seconds", "", {{"part", "push"}})),
      wait_seconds_(f_.Histogram("onebit_worker_step_part_seconds", "", {{"part", "wait"}})),
      apply_seconds_(f_.Histogram("onebit_worker_step_part_seconds", "", {{"part", "apply"}})),
      up_warmup_(f_.Counter("onebit_worker_sent_bytes_total",
                            "Data-plane bytes this worker sent (up) or received (down) in its "
                            "steps, headers included",
                            {{"direction", "up"}, {"phase", "warmup"}})),
      up_compress_(f_.Counter("onebit_worker_sent_bytes_total", "",
                              {{"direction", "up"}, {"phase", "compress"}})),
      down_warmup_(f_.Counter("onebit_worker_sent_bytes_total", "",
                              {{"direction", "down"}, {"phase", "warmup"}})),
      down_compress_(f_.Counter("onebit_worker_sent_bytes_total", "",
                                {{"direction", "down"}, {"phase", "compress"}})),
      ratio_up_(f_.Gauge("onebit_worker_compression_ratio",
                         "Bytes of this worker's last compression-phase step over 4·d (what "
                         "fp32 moves)",
                         {{"direction", "up"}})),
      ratio_down_(f_.Gauge("onebit_worker_compression_ratio", "", {{"direction", "down"}})),
      rounds_(f_.Counter("onebit_worker_rounds_total", "Steps that communicated")),
      local_steps_(f_.Counter("onebit_worker_local_steps_total",
                              "Steps taken without communicating (0/1 Adam's local steps)")),
      chunks_(f_.Counter("onebit_worker_pushed_chunks_total", "Chunks this worker pushed")),
      chunks_overlapped_(f_.Counter("onebit_worker_overlapped_chunks_total",
                                    "Of the chunks pushed, those that went out while the "
                                    "gradient was still being computed")),
      loss_(f_.GaugeFamily("onebit_worker_loss", "The loss this worker reported last")),
      rollbacks_(f_.Counter("onebit_worker_rollbacks_total",
                            "Times the job rolled back and this worker joined it again")),
      checkpoints_(f_, "onebit_worker") {}

void WorkerMetrics::StepDone(const WorkerStepSample& s) {
  steps_.Set(static_cast<double>(s.steps_done));
  compressing_.Set(s.compressed ? 1 : 0);
  step_seconds_.Observe(s.step_s);
  gradient_seconds_.Observe(s.gradient_s);
  push_seconds_.Observe(s.push_s);
  wait_seconds_.Observe(s.wait_s);
  apply_seconds_.Observe(s.apply_s);
  (s.compressed ? up_compress_ : up_warmup_).Increment(static_cast<double>(s.bytes_up));
  (s.compressed ? down_compress_ : down_warmup_).Increment(static_cast<double>(s.bytes_down));
  if (s.compressed && !s.local && fp32_bytes_ > 0) {
    ratio_up_.Set(static_cast<double>(s.bytes_up) / fp32_bytes_);
    ratio_down_.Set(static_cast<double>(s.bytes_down) / fp32_bytes_);
  }
  (s.local ? local_steps_ : rounds_).Increment();
  chunks_.Increment(static_cast<double>(s.chunks));
  chunks_overlapped_.Increment(static_cast<double>(s.chunks_overlapped));
  if (s.has_loss) loss_.Set(s.loss);
}

}  // namespace onebit
