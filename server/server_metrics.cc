#include "server/server_metrics.h"

#include <string>

namespace onebit {

const char* RefusalName(Refusal r) {
  switch (r) {
    case Refusal::kMalformed:
      return "malformed";
    case Refusal::kWrongJob:
      return "wrong_job";
    case Refusal::kEarlierIncarnation:
      return "earlier_incarnation";
    case Refusal::kHandshake:
      return "handshake";
    case Refusal::kWrongKey:
      return "wrong_key";
    case Refusal::kWrongStep:
      return "wrong_step";
    case Refusal::kDuplicate:
      return "duplicate";
    case Refusal::kBadPayload:
      return "bad_payload";
    case Refusal::kLrMismatch:
      return "lr_mismatch";
    case Refusal::kBadSeal:
      return "bad_seal";
  }
  return "unknown";
}

ServerMetrics::ServerMetrics(MetricsEndpoint* e, uint32_t shard)
    : f_(e, {{"shard", std::to_string(shard)}}),
      up_warmup_(f_.Counter("onebit_server_received_bytes_total",
                            "Bytes of the pushes this shard took (header and payload)",
                            {{"phase", "warmup"}})),
      up_compress_(f_.Counter("onebit_server_received_bytes_total", "", {{"phase", "compress"}})),
      down_warmup_(f_.Counter("onebit_server_sent_bytes_total",
                              "Bytes of the replies this shard sent (header and payload)",
                              {{"phase", "warmup"}})),
      down_compress_(f_.Counter("onebit_server_sent_bytes_total", "", {{"phase", "compress"}})),
      dropped_replies_(f_.Counter("onebit_server_dropped_replies_total",
                                  "Replies that could not be sent (the worker gone, or not "
                                  "reading)")),
      refused_(),
      steps_(f_.Gauge("onebit_server_steps", "Steps this shard has completed")),
      compressing_(f_.Gauge("onebit_server_compression_phase",
                            "1 once this shard is in the compression phase, 0 in the warm-up")),
      apply_seconds_(f_.Histogram("onebit_server_apply_seconds",
                                  "Time a step's update took on this shard (decoded pushes to "
                                  "reply encoded)")),
      step_seconds_(f_.Histogram("onebit_server_step_seconds",
                                 "Time from a step's first push to its last reply on this shard")),
      pending_(f_.Gauge("onebit_server_pending_pushes",
                        "Pushes taken for the current step whose chunk is not applied yet")),
      connections_(f_.Gauge("onebit_server_data_connections",
                            "Workers' data connections that have sent this server a valid "
                            "request since the job (or its last roll-back) began")),
      freeze_change_(f_.GaugeFamily("onebit_server_freeze_change_ratio",
                                    "--freeze auto: this shard's last relative change of v")),
      rollbacks_(f_.Counter("onebit_server_rollbacks_total",
                            "Times the job rolled back and this server joined it again")),
      resumes_(f_.Counter("onebit_server_resumes_total",
                          "Times this server continued from a checkpoint (a resumed job or a "
                          "roll-back)")),
      checkpoints_(f_, "onebit_server") {
  for (int i = 0; i < kNumRefusals; ++i) {
    refused_[i] = &f_.Counter("onebit_server_refused_requests_total",
                              "Requests and handshakes this server refused, by reason",
                              {{"reason", RefusalName(static_cast<Refusal>(i))}});
  }
}

void ServerMetrics::SetHandshakesRefused(uint64_t total) {
  AdvanceTo(*refused_[static_cast<int>(Refusal::kHandshake)], static_cast<double>(total));
}

void ServerMetrics::StepServed(uint64_t steps, bool compressing, double apply_s, double step_s) {
  steps_.Set(static_cast<double>(steps));
  compressing_.Set(compressing ? 1 : 0);
  apply_seconds_.Observe(apply_s);
  step_seconds_.Observe(step_s);
}

}  // namespace onebit
