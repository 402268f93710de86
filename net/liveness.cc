#include "net/liveness.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"

namespace onebit {
namespace {

// A non-blocking socket connecting (or connected) to `endpoint`; or -1,
// with *answer kGone when the connection was refused at once.
int StartConnect(const std::string& endpoint, Liveness* answer) {
  *answer = Liveness::kUnknown;
  const size_t colon = endpoint.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(endpoint.substr(colon + 1), &port)) {
    return -1;
  }
  std::string host = endpoint.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return -1;
  int fd = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) != 0 && errno != EINPROGRESS) {
    *answer = errno == ECONNREFUSED ? Liveness::kGone : Liveness::kUnknown;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(found);
  return fd;
}

}  // namespace

std::vector<Liveness> ProbeListening(const std::vector<std::string>& endpoints,
                                     absl::Duration timeout) {
  std::vector<Liveness> answers(endpoints.size(), Liveness::kUnknown);
  std::vector<pollfd> fds;
  std::vector<size_t> which;  // fds[k] probes endpoints[which[k]]
  for (size_t i = 0; i < endpoints.size(); ++i) {
    if (endpoints[i].empty()) continue;
    const int fd = StartConnect(endpoints[i], &answers[i]);
    if (fd < 0) continue;  // refused at once, or unknown
    fds.push_back(pollfd{fd, POLLOUT, 0});
    which.push_back(i);
  }
  const absl::Time deadline = absl::Now() + timeout;
  size_t open = fds.size();
  bool last = false;
  while (open > 0 && !last) {
    // Past the deadline, one more look without waiting: a starved prober
    // that runs late must still read the connections the kernel completed
    // meanwhile (each has had its whole timeout), not call them unknown.
    const int64_t left_ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    last = left_ms == 0;
    const int n = poll(fds.data(), fds.size(), static_cast<int>(left_ms));
    if (n < 0 && errno == EINTR) {
      last = false;
      continue;
    }
    if (n < 0) break;
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].fd < 0 || fds[k].revents == 0) continue;
      int error = 0;
      socklen_t len = sizeof(error);
      getsockopt(fds[k].fd, SOL_SOCKET, SO_ERROR, &error, &len);
      answers[which[k]] = error == 0              ? Liveness::kListening
                          : error == ECONNREFUSED ? Liveness::kGone
                                                  : Liveness::kUnknown;
      close(fds[k].fd);
      fds[k].fd = -1;  // poll skips negative descriptors
      --open;
    }
  }
  for (const pollfd& p : fds) {
    if (p.fd >= 0) close(p.fd);
  }
  return answers;
}

PeersHeard::PeersHeard(uint32_t peers)
    : peers_(peers), heard_(std::make_unique<std::atomic<bool>[]>(peers)) {
  for (uint32_t r = 0; r < peers_; ++r) heard_[r].store(false, std::memory_order_relaxed);
}

void PeersHeard::Heard(uint32_t rank) {
  if (rank >= peers_) return;
  // Read first: a flag already set costs no write (no cache line bounced
  // between the data plane's threads and the heartbeat's).
  if (!heard_[rank].load(std::memory_order_relaxed)) {
    heard_[rank].store(true, std::memory_order_relaxed);
  }
}

std::vector<uint32_t> PeersHeard::Take() {
  std::vector<uint32_t> out;
  for (uint32_t r = 0; r < peers_; ++r) {
    if (heard_[r].load(std::memory_order_relaxed) &&
        heard_[r].exchange(false, std::memory_order_relaxed)) {
      out.push_back(r);
    }
  }
  return out;
}

}  // namespace onebit
