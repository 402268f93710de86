#include "coordinator/job_metrics.h"

#include <cmath>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace onebit {
namespace {

prometheus::Family<prometheus::Gauge>& GaugeFamily(MetricsEndpoint* e, const std::string& name,
                                                   const std::string& help) {
  return MetricFactory(e).GaugeFamily(name, help);
}

prometheus::Gauge& NewGauge(MetricsEndpoint* e, const std::string& name, const std::string& help,
                            const MetricLabels& labels = {}) {
  return MetricFactory(e).Gauge(name, help, labels);
}

prometheus::Counter& NewCounter(MetricsEndpoint* e, const std::string& name,
                                const std::string& help, const MetricLabels& labels = {}) {
  return MetricFactory(e).Counter(name, help, labels);
}

prometheus::Histogram& NewSeconds(MetricsEndpoint* e, const std::string& name,
                                  const std::string& help) {
  return MetricFactory(e).Histogram(name, help);
}

}  // namespace

JobMetrics::JobMetrics(MetricsEndpoint* e)
    : steps_(NewGauge(e, "onebit_steps", "Steps completed by every worker")),
      compressing_(NewGauge(e, "onebit_compression_phase",
                            "1 once the job is in the compression phase (the last completed "
                            "step compressed), 0 in the warm-up")),
      loss_(NewGauge(e, "onebit_loss",
                     "Training loss of the last completed step (mean over "
                     "workers)")),
      test_accuracy_(
          GaugeFamily(e, "onebit_test_accuracy_ratio", "Test-set accuracy last reported (0 to 1)")),
      test_loss_(GaugeFamily(e, "onebit_test_loss", "Test-set loss last reported")),
      epoch_(NewGauge(e, "onebit_epochs", "Epochs done (models with a data set)")),
      up_warmup_(NewCounter(e, "onebit_sent_bytes_total",
                            "Data-plane bytes the workers sent (up) or received (down)",
                            {{"direction", "up"}, {"phase", "warmup"}})),
      up_compress_(NewCounter(e, "onebit_sent_bytes_total", "",
                              {{"direction", "up"}, {"phase", "compress"}})),
      down_warmup_(NewCounter(e, "onebit_sent_bytes_total", "",
                              {{"direction", "down"}, {"phase", "warmup"}})),
      down_compress_(NewCounter(e, "onebit_sent_bytes_total", "",
                                {{"direction", "down"}, {"phase", "compress"}})),
      ratio_up_(NewGauge(e, "onebit_compression_ratio",
                         "Bytes of the last compression-phase step over what fp32 moves in one",
                         {{"direction", "up"}})),
      ratio_down_(NewGauge(e, "onebit_compression_ratio", "", {{"direction", "down"}})),
      step_seconds_(
          NewSeconds(e, "onebit_step_seconds", "Duration of a step (the slowest worker's)")),
      push_seconds_(NewSeconds(e, "onebit_step_push_seconds",
                               "Time a step spent pushing (the slowest worker's)")),
      reply_seconds_(NewSeconds(e, "onebit_step_reply_wait_seconds",
                                "Time a step spent waiting for replies (the slowest worker's)")),
      rounds_(NewCounter(e, "onebit_rounds_total", "Steps that communicated")),
      local_steps_(NewCounter(e, "onebit_local_steps_total",
                              "Steps taken without communicating (0/1 Adam's local steps)")),
      freeze_change_(GaugeFamily(e, "onebit_freeze_change_ratio",
                                 "--freeze auto: the last decided check's largest relative change "
                                 "of v over the shards (the job freezes below tau)")),
      workers_alive_(NewGauge(e, "onebit_processes_alive",
                              "Processes registered and neither finished nor presumed dead",
                              {{"member", "worker"}})),
      servers_alive_(NewGauge(e, "onebit_processes_alive", "", {{"member", "server"}})),
      workers_expected_(NewGauge(e, "onebit_processes_expected", "Processes the job runs",
                                 {{"member", "worker"}})),
      servers_expected_(NewGauge(e, "onebit_processes_expected", "", {{"member", "server"}})),
      refused_unauthenticated_(NewCounter(
          e, "onebit_refused_requests_total",
          "Control-plane calls refused, by reason: without the job's credential "
          "(unauthenticated), malformed, registrations turned away, failed TLS handshakes "
          "(tls_handshake)",
          {{"reason", "unauthenticated"}})),
      refused_malformed_(
          NewCounter(e, "onebit_refused_requests_total", "", {{"reason", "malformed"}})),
      refused_registration_(
          NewCounter(e, "onebit_refused_requests_total", "", {{"reason", "registration"}})),
      refused_handshake_(
          NewCounter(e, "onebit_refused_requests_total", "", {{"reason", "tls_handshake"}})),
      restarts_(NewCounter(e, "onebit_restarts_total",
                           "Times the job went on from a checkpoint (restarted or rolled back)")),
      rollbacks_(NewCounter(e, "onebit_rollbacks_total",
                            "Of the restarts, those the running processes rolled back for")),
      rolled_back_steps_(NewCounter(e, "onebit_rolled_back_steps_total",
                                    "Steps done after a checkpoint, lost and run again")),
      checkpoints_(NewCounter(e, "onebit_checkpoints_total", "Complete checkpoints written")),
      checkpoint_errors_(NewCounter(e, "onebit_checkpoint_errors_total",
                                    "Scheduled checkpoints that could not be written")),
      checkpoint_step_(
          GaugeFamily(e, "onebit_checkpoint_last_step", "Step of the last complete checkpoint")),
      checkpoint_time_(GaugeFamily(e, "onebit_checkpoint_last_timestamp_seconds",
                                   "When the last complete checkpoint was written (Unix time; its "
                                   "age is time() minus this)")),
      checkpoint_bytes_(GaugeFamily(e, "onebit_checkpoint_last_bytes",
                                    "Size of the last complete checkpoint, every file")),
      finished_(NewGauge(e, "onebit_job_ended", "1 once the job has ended, whatever the outcome")) {
}

void JobMetrics::AddRows(const std::vector<MetricsRow>& rows) {
  for (const MetricsRow& r : rows) {
    const bool compress = r.phase == "compress";
    steps_.Set(static_cast<double>(r.step + 1));
    compressing_.Set(compress ? 1 : 0);
    loss_.Set(r.loss);
    if (r.test_accuracy) test_accuracy_.Set(*r.test_accuracy);
    if (r.test_loss) test_loss_.Set(*r.test_loss);
    epoch_.Set(r.epoch);
    (compress ? up_compress_ : up_warmup_).Increment(static_cast<double>(r.bytes_up));
    (compress ? down_compress_ : down_warmup_).Increment(static_cast<double>(r.bytes_down));
    if (compress && fp32_per_step_ > 0) {
      ratio_up_.Set(static_cast<double>(r.bytes_up) / static_cast<double>(fp32_per_step_));
      ratio_down_.Set(static_cast<double>(r.bytes_down) / static_cast<double>(fp32_per_step_));
    }
    step_seconds_.Observe(r.step_s);
    push_seconds_.Observe(r.push_s);
    reply_seconds_.Observe(r.reply_s);
    (r.bytes_up > 0 ? rounds_ : local_steps_).Increment();
  }
}

void JobMetrics::Set(const JobState& s, std::optional<uint64_t> checkpoint_bytes) {
  fp32_per_step_ = s.fp32_bytes_per_step;
  workers_alive_.Set(s.workers_alive);
  servers_alive_.Set(s.servers_alive);
  workers_expected_.Set(s.workers_expected);
  servers_expected_.Set(s.servers_expected);
  AdvanceTo(refused_unauthenticated_, static_cast<double>(s.refused_unauthenticated));
  AdvanceTo(refused_malformed_, static_cast<double>(s.refused_malformed));
  AdvanceTo(refused_registration_, static_cast<double>(s.refused_registration));
  AdvanceTo(refused_handshake_, static_cast<double>(s.failed_handshakes));
  AdvanceTo(restarts_, s.restarts);
  AdvanceTo(rollbacks_, s.rollbacks);
  AdvanceTo(rolled_back_steps_, static_cast<double>(s.rolled_back_steps));
  AdvanceTo(checkpoint_errors_, static_cast<double>(s.checkpoint_errors));
  if (s.checkpoints > checkpoints_seen_) {
    checkpoints_seen_ = s.checkpoints;
    checkpoints_.Increment();
    checkpoint_time_.Set(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
    if (checkpoint_bytes) checkpoint_bytes_.Set(static_cast<double>(*checkpoint_bytes));
  }
  if (s.last_checkpoint_step) checkpoint_step_.Set(static_cast<double>(*s.last_checkpoint_step));
  if (s.freeze_change && std::isfinite(*s.freeze_change)) freeze_change_.Set(*s.freeze_change);
  finished_.Set(s.finished ? 1 : 0);
}

}  // namespace onebit
