// What a server exports to Prometheus (metrics/endpoint.h), labels
// role=server and shard=<its shard>: the data plane as this shard sees it
// (bytes of the pushes taken and the replies sent, by phase; the time its
// steps take and the update's part of it; pushes waiting), what it refused
// and why, and its own checkpoint files and roll-backs. Names follow
// Prometheus' conventions (metrics/families.h).
//
// Thread-safe, as the metrics are: the serving thread updates most, the
// ZAP handler's count and the checkpoint writer's come from others.
#ifndef ONEBIT_SERVER_SERVER_METRICS_H_
#define ONEBIT_SERVER_SERVER_METRICS_H_

#include <array>
#include <cstdint>

#include "metrics/endpoint.h"
#include "metrics/families.h"
#include "optim/state.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"

namespace onebit {

// Why a server refused a request (onebit_server_refused_requests_total's
// reason label).
enum class Refusal {
  kMalformed,           // "malformed": framing, header or fields wrong for the job
  kWrongJob,            // "wrong_job": another job's id
  kEarlierIncarnation,  // "earlier_incarnation": sent before a roll-back, dropped
  kHandshake,           // "handshake": a handshake without a key (or password) of the job
  kWrongKey,            // "wrong_key": a rank claimed by another worker's key
  kWrongStep,           // "wrong_step": a step this shard is not at
  kDuplicate,           // "duplicate": pushed, pulled or initialised twice
  kBadPayload,          // "bad_payload": a payload that does not decode
  kLrMismatch,          // "lr_mismatch": the workers' learning rates disagree
  kBadSeal,             // "bad_seal": a sealed message that does not open (forged, altered,
                        // replayed) or is not sealed
};
inline constexpr int kNumRefusals = 10;
const char* RefusalName(Refusal r);

class ServerMetrics {
 public:
  // Its metrics go into endpoint's registry; the endpoint must outlive it.
  ServerMetrics(MetricsEndpoint* endpoint, uint32_t shard);

  // A push taken for a step of `phase` (header and payload bytes).
  void Pushed(Phase phase, uint64_t bytes) {
    (phase == Phase::kCompress ? up_compress_ : up_warmup_).Increment(static_cast<double>(bytes));
  }
  // A reply sent (header and payload bytes).
  void Replied(Phase phase, uint64_t bytes) {
    (phase == Phase::kCompress ? down_compress_ : down_warmup_)
        .Increment(static_cast<double>(bytes));
  }
  // A reply that could not be sent (the worker gone or not reading).
  void ReplyDropped() { dropped_replies_.Increment(); }
  void Refused(Refusal r) { refused_[static_cast<int>(r)]->Increment(); }
  // The ZAP handler's count of refused handshakes so far.
  void SetHandshakesRefused(uint64_t total);
  // A step served: `steps` completed now, the update's time, and the time
  // from its first push to its last reply.
  void StepServed(uint64_t steps, bool compressing, double apply_s, double step_s);
  // Steps completed without serving (a zero-one-adam local step, a resume).
  void SetSteps(uint64_t steps) { steps_.Set(static_cast<double>(steps)); }
  // Pushes taken for the current step whose chunk is not applied yet.
  void SetPendingPushes(uint64_t n) { pending_.Set(static_cast<double>(n)); }
  // The workers' data connections that have sent this incarnation a valid
  // request (--data_connections per worker, when all are up).
  void SetDataConnections(uint64_t n) { connections_.Set(static_cast<double>(n)); }
  // --freeze auto: the shard's last measure of v's change.
  void FreezeChecked(double change) { freeze_change_.Set(change); }
  // The job rolled back and this server joined it again; it continued
  // from a checkpoint.
  void RolledBack() { rollbacks_.Increment(); }
  void Resumed() { resumes_.Increment(); }
  CheckpointWriteMetrics& checkpoints() { return checkpoints_; }

 private:
  MetricFactory f_;
  prometheus::Counter& up_warmup_;
  prometheus::Counter& up_compress_;
  prometheus::Counter& down_warmup_;
  prometheus::Counter& down_compress_;
  prometheus::Counter& dropped_replies_;
  std::array<prometheus::Counter*, kNumRefusals> refused_;
  prometheus::Gauge& steps_;
  prometheus::Gauge& compressing_;
  prometheus::Histogram& apply_seconds_;
  prometheus::Histogram& step_seconds_;
  prometheus::Gauge& pending_;
  prometheus::Gauge& connections_;
  LazyGauge freeze_change_;
  prometheus::Counter& rollbacks_;
  prometheus::Counter& resumes_;
  CheckpointWriteMetrics checkpoints_;
};

}  // namespace onebit

#endif  // ONEBIT_SERVER_SERVER_METRICS_H_
