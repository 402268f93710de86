// Whether a process still holds its listening socket, asked of the kernel
// rather than of the process: a TCP connect to its health endpoint completes
// while the process lives, however starved of CPU it is (the kernel
// completes the handshake from the listen backlog), and is refused as soon
// as it has died (its sockets close with it). The coordinator uses this to
// tell a slow process from a dead one (docs/design.md §2).
//
// Thread-safe: no shared state.
#ifndef ONEBIT_NET_LIVENESS_H_
#define ONEBIT_NET_LIVENESS_H_

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

}  // namespace onebit

#endif  // ONEBIT_NET_LIVENESS_H_
