#include "coordinator/control_limits.h"

#include <algorithm>
#include <limits>

#include "models/registry.h"
#include "net/control.h"

namespace onebit {
namespace {

// Serialized sizes, each rounded up from the protobuf encoding with every
// field set to its widest value (proto/control.proto).
constexpr uint64_t kMetricsRowBytes = 128;  // StepMetrics: 113 and its tag
constexpr uint64_t kChecksumBytes = 80;     // ShardChecksum: 64
// A tensor of the model in Register: its end (11), its decay range (31),
// its lr-scale range (31), a local tensor's name (up to 256) and crc32 (5).
constexpr uint64_t kTensorBytes = 352;
// Strings and small repeated fields: error reasons, endpoints, host and
// device names, settings, checkpoint parts, freeze checks.
constexpr uint64_t kAllowanceBytes = 1 << 20;

}  // namespace

uint64_t LargestControlRequest(const control::TrainingConfig& cfg) {
  uint64_t tensors = kMaxExternalTensors;
  if (cfg.model().name() != kExternalModel) {
    auto ends = ModelLayerEnds(cfg);
    tensors = ends.ok() ? std::max<uint64_t>(ends->size(), 1) : kMaxExternalTensors;
  }
  const uint64_t reg = tensors * kTensorBytes;
  const uint64_t done = kMaxMetricsPerHeartbeat * kMetricsRowBytes +
                        uint64_t{std::max(cfg.cluster().servers(), 1u)} * kChecksumBytes;
  return kAllowanceBytes + std::max(reg, done);
}

void BoundControlServer(const control::TrainingConfig& cfg, grpc::ServerBuilder* builder) {
  // gRPC refuses a larger message as its length prefix arrives... only once
  // read; the credential check from the headers (security/tls.h) keeps an
  // outsider's from being read at all, this bounds the job's own.
  builder->SetMaxReceiveMessageSize(static_cast<int>(
      std::min<uint64_t>(LargestControlRequest(cfg), std::numeric_limits<int>::max())));
  const int processes = static_cast<int>(cfg.cluster().servers() + cfg.cluster().workers());
  // Each process holds one call at a time but Register (which blocks until
  // the cluster is in) beside its heartbeat; a roll-back doubles that.
  grpc::ResourceQuota quota("onebit-coordinator");
  quota.SetMaxThreads(4 * processes + 16);
  builder->SetResourceQuota(quota);
  // One process, one channel, a few calls at once.
  builder->AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 16);
  // A TLS handshake takes milliseconds, and a connection of a live process
  // carries a heartbeat every heartbeat_timeout / 10 or so; but a process of
  // the job on a starved host (or the coordinator on one) can take many
  // times that, and a connection the coordinator drops must be made again
  // by the same starved process. Both are given what a process waits for a
  // slow coordinator (kSlowCoordinatorFactor timeouts): with 10 s for
  // both, 256 processes on 2 cores lost their connections and then their
  // new handshakes ("Handshake read failed"), until they gave up.
  // A connection idle that long is nobody's (the coordinator has presumed
  // its process dead by then); one left half-done is dropped.
  const int slow_ms = static_cast<int>(std::min<uint64_t>(
      uint64_t{kSlowCoordinatorFactor} * std::max<uint32_t>(cfg.timeouts().heartbeat_ms(), 1000),
      std::numeric_limits<int>::max()));
  builder->AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, std::max(slow_ms, 10000));
  builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, slow_ms);
  // Control messages are small: no window growth beyond gRPC's 64 KB.
  builder->AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
}

}  // namespace onebit
