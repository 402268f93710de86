#include "metrics/endpoint.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "prometheus/text_serializer.h"

namespace onebit {

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& host, int port, const std::map<std::string, std::string>& labels) {
  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
  e->registry_ = std::make_shared<prometheus::Registry>();
  e->labels_ = labels;
  const std::string address = absl::StrCat(host, ":", port);
  auto fail = [&](const std::string& why) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address, ": ", why));
  };
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
      rc != 0) {
    return fail(gai_strerror(rc));
  }
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr && e->listen_fd_ < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 16) == 0) {
      e->listen_fd_ = fd;
    } else {
      error = std::strerror(errno);
      close(fd);
    }
  }
  freeaddrinfo(found);
  if (e->listen_fd_ < 0) return fail(error);
  sockaddr_storage bound = {};
  socklen_t len = sizeof(bound);
  getsockname(e->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  e->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  e->thread_ = std::thread([p = e.get()] { p->Serve(); });
  return e;
}

MetricsEndpoint::~MetricsEndpoint() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
}

void MetricsEndpoint::Serve() {
  while (!stop_) {
    pollfd p = {listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Answer(fd);
    close(fd);
  }
}

void MetricsEndpoint::Answer(int fd) {
  // A scraper that sends nothing, or reads nothing, gives up the endpoint
  // after at most these.
  const timeval timeout = {2, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  // The whole request within the same 2 s, however slowly it trickles in
  // (one scrape at a time: a slow peer must not hold the endpoint).
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  std::string request;
  char buf[2048];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < 16384) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return;
    pollfd in = {fd, POLLIN, 0};
    if (poll(&in, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) return;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  // "GET /metrics HTTP/1.1" (a query string is ignored).
  const std::string line = request.substr(0, request.find("\r\n"));
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? sp1 : line.find(' ', sp1 + 1);
  const std::string method = line.substr(0, sp1);
  std::string path = sp2 == std::string::npos ? "" : line.substr(sp1 + 1, sp2 - sp1 - 1);
  path = path.substr(0, path.find('?'));
  std::string status = "200 OK", type = "text/plain; version=0.0.4; charset=utf-8", body;
  if (method != "GET" && method != "HEAD") {
    status = "405 Method Not Allowed";
    type = "text/plain";
    body = "GET /metrics\n";
  } else if (path != "/metrics") {
    status = "404 Not Found";
    type = "text/plain";
    body = "GET /metrics\n";
  } else {
    const std::vector<prometheus::MetricFamily> families = registry_->Collect();
    if (families.empty()) {
      // Listening starts before the process has made its families: an
      // empty page would read as a process without metrics; say "not yet".
      status = "503 Service Unavailable";
      type = "text/plain";
      body = "no metrics registered yet\n";
    } else {
      body = prometheus::TextSerializer().Serialize(families);
    }
  }
  std::string reply =
      absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                   "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n");
  if (method != "HEAD") reply += body;
  for (size_t sent = 0; sent < reply.size();) {
    const ssize_t n = send(fd, reply.data() + sent, reply.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

absl::Status CheckMetricsPort(int port) {
  if (port < -1 || port > 65535) {
    return absl::InvalidArgumentError("must be -1 (none) or in [0, 65535]");
  }
  return absl::OkStatus();
}

absl::Status CheckMetricsLinger(absl::Duration linger) {
  if (linger < absl::ZeroDuration() || linger > absl::Hours(1)) {
    return absl::InvalidArgumentError("must be in [0s, 1h]");
  }
  return absl::OkStatus();
}

void LingerForLastScrape(absl::Duration linger, const std::atomic<int>* stop_signal) {
  const absl::Time until = absl::Now() + linger;
  while (absl::Now() < until && (stop_signal == nullptr || stop_signal->load() == 0)) {
    absl::SleepFor(std::min(absl::Milliseconds(50), until - absl::Now()));
  }
}

}  // namespace onebit
