// The coordinator's gRPC server, bounded by its job (docs/design.md §2.1):
// the largest request a process of the job sends, how many calls run at
// once, and how long a connection may sit in its TLS handshake or idle.
// Together with the credential checked from a call's headers
// (security/tls.h), what anyone can make the coordinator hold is bounded by
// the job's size, not by what they send. Not bounded: how many connections
// one peer opens (gRPC 1.51 has no hook for it); a burst of 1000 costs
// about 40 MB until their handshakes fail or time out (kSlowCoordinatorFactor
// heartbeat timeouts, 1 min by default, since a starved process of the job
// may take that long).
#ifndef ONEBIT_COORDINATOR_CONTROL_LIMITS_H_
#define ONEBIT_COORDINATOR_CONTROL_LIMITS_H_

#include <cstdint>

#include "grpcpp/grpcpp.h"
#include "proto/control.pb.h"

namespace onebit {

// The largest request (any method, serialized) a process of `cfg`'s job
// sends: a worker's Register with its model's tensors (built-in models:
// their layers; --model external: up to kMaxExternalTensors), a Heartbeat
// or Done with up to kMaxMetricsPerHeartbeat rows (net/control.h) and one
// checksum per shard, and an allowance for strings (error reasons, names,
// settings).
uint64_t LargestControlRequest(const control::TrainingConfig& cfg);

// The most tensors a --model external job's workers may declare.
inline constexpr uint64_t kMaxExternalTensors = uint64_t{1} << 16;

// Sets the limits of `cfg`'s job on the coordinator's `builder`.
void BoundControlServer(const control::TrainingConfig& cfg, grpc::ServerBuilder* builder);

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_CONTROL_LIMITS_H_
