// Whether a process still holds its listening socket, asked of the kernel
// rather than of the process: a TCP connect to its health endpoint completes
// while the process lives, however starved of CPU it is (the kernel
// completes the handshake from the listen backlog), and is refused as soon
// as it has died (its sockets close with it). The coordinator uses this to
// tell a slow process from a dead one (docs/design.md §2).
//
// PeersHeard is the other evidence: which peers' data-plane messages a
// process has received lately, which its heartbeats pass on, so that a
// process whose own heartbeats are late (a starved host, a crowded
// coordinator) but whose peers still hear from it is not taken for hung.
//
// ProbeListening is thread-safe (no shared state); so is PeersHeard.
#ifndef ONEBIT_NET_LIVENESS_H_
#define ONEBIT_NET_LIVENESS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace onebit {

enum class Liveness {
  kListening,  // something accepted the connection: the process is there
  kGone,       // refused: nothing listens there any more
  kUnknown,    // no answer within the time, no route, or an endpoint that does not resolve
};

// Probes every "host:port" at once (the connections are closed again at
// once, nothing is sent); returns one answer per endpoint, in order, within
// about `timeout` plus name resolution. An empty endpoint is kUnknown.
std::vector<Liveness> ProbeListening(const std::vector<std::string>& endpoints,
                                     absl::Duration timeout);

// The ranks of the other role (a server's workers, a worker's servers) that
// this process received a valid data-plane message from since the last
// Take(). Heard() is called for every message, from any thread: lock-free,
// and it writes only the first time a rank is heard between two takes.
class PeersHeard {
 public:
  // `peers`: how many the other role has.
  explicit PeersHeard(uint32_t peers);
  // A rank at or beyond `peers` is ignored (the data plane checks ranks).
  void Heard(uint32_t rank);
  // The ranks heard since the last Take(), in increasing order; clears them.
  std::vector<uint32_t> Take();

 private:
  const uint32_t peers_;
  std::unique_ptr<std::atomic<bool>[]> heard_;
};

}  // namespace onebit

#endif  // ONEBIT_NET_LIVENESS_H_
