#include "local/local_group.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace onebit {
namespace {

constexpr uint32_t kMagic = 0x474c424f;  // "OBLG"
constexpr uint32_t kVersion = 1;
// Message kinds beyond LocalCall's.
constexpr uint32_t kHello = 100;    // follower -> leader: local rank, d
constexpr uint32_t kWelcome = 101;  // leader -> follower, with the memfd
constexpr uint32_t kRefused = 102;  // leader -> follower: text says why
constexpr uint32_t kAnswer = 200;
constexpr size_t kPage = 4096;

// One message, whatever its kind: fixed size, so a short or long read is a
// broken peer, and both sides are the same build of this file.
struct Wire {
  uint32_t magic = kMagic;
  uint32_t version = kVersion;
  uint32_t kind = 0;
  uint32_t local_rank = 0;
  uint64_t step = 0;
  uint64_t num_params = 0;
  // kWelcome: K, hello bytes, map bytes, x's offset, the slot's offset.
  // kAnswer: steps done, step, bytes up, bytes down, chunks.
  uint64_t u[5] = {};
  double f[5] = {};  // loss, epoch; kAnswer: step_s, push_s, reply_s
  float lr = 0;
  uint32_t flags = 0;
  int32_t code = 0;
  uint32_t text_len = 0;
  char text[kMaxText] = {};
};

// Wire::flags.
constexpr uint32_t kHasLoss = 1;
constexpr uint32_t kHasLr = 2;
constexpr uint32_t kFoundInf = 4;
constexpr uint32_t kRolledBack = 8;
constexpr uint32_t kCompressing = 16;
constexpr uint32_t kVoteYes = 32;
constexpr uint32_t kCompressed = 64;
constexpr uint32_t kFailed = 128;
constexpr uint32_t kDeviceGrads = 256;

void SetText(Wire* w, absl::string_view text) {
  w->text_len = static_cast<uint32_t>(std::min(text.size(), kMaxText));
  std::memcpy(w->text, text.data(), w->text_len);
}
std::string TextOf(const Wire& w) { return std::string(w.text, w.text_len); }

size_t RoundUp(size_t n) { return (n + kPage - 1) / kPage * kPage; }

int MillisLeft(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
}

sockaddr_un AddressOf(absl::string_view name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  // Abstract: a leading NUL, no file.
  const size_t n = std::min(name.size(), sizeof(a.sun_path) - 1);
  std::memcpy(a.sun_path + 1, name.data(), n);
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

absl::Status SendWire(int fd, const Wire& w, int pass_fd = -1) {
  iovec iov{const_cast<Wire*>(&w), sizeof(w)};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (pass_fd >= 0) {
    m.msg_control = control;
    m.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = sendmsg(fd, &m, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof(w))) {
    return absl::UnavailableError(n < 0 ? std::strerror(errno) : "short send");
  }
  return absl::OkStatus();
}

// What RecvWire found.
enum class Got { kMessage, kClosed, kTimeout };

// One message within the deadline; `passed` (if given) takes a file
// descriptor sent with it. A message of the wrong size or magic is an error.
absl::StatusOr<Got> RecvWire(int fd, absl::Time deadline, Wire* w, int* passed = nullptr) {
  while (true) {
    pollfd p{fd, POLLIN, 0};
    const int r = poll(&p, 1, MillisLeft(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return absl::InternalError(absl::StrCat("poll: ", std::strerror(errno)));
    if (r == 0) return Got::kTimeout;
    break;
  }
  iovec iov{w, sizeof(*w)};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  m.msg_control = control;
  m.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(fd, &m, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n == 0 || (n < 0 && errno == ECONNRESET)) return Got::kClosed;
  if (n < 0) return absl::InternalError(absl::StrCat("recvmsg: ", std::strerror(errno)));
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      int got;
      std::memcpy(&got, CMSG_DATA(c), sizeof(int));
      if (passed != nullptr) {
        *passed = got;
      } else {
        close(got);
      }
    }
  }
  if (n != static_cast<ssize_t>(sizeof(*w)) || (m.msg_flags & MSG_TRUNC) != 0 ||
      w->magic != kMagic || w->version != kVersion || w->text_len > kMaxText) {
    return absl::DataLossError(absl::StrCat(
        "a malformed message (", n, " bytes", w->magic == kMagic ? "" : ", not onebit-ps's",
        w->magic == kMagic && w->version != kVersion
            ? absl::StrCat(", protocol version ", w->version, " where this build speaks ", kVersion)
            : "",
        ")"));
  }
  return Got::kMessage;
}

void CloseFd(int* fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

}  // namespace

const char* LocalCallName(LocalCall call) {
  switch (call) {
    case LocalCall::kBroadcast:
      return "BroadcastParameters";
    case LocalCall::kStep:
      return "Step";
    case LocalCall::kVote:
      return "AgreeOnOverflow";
    case LocalCall::kFinish:
      return "Finish";
    case LocalCall::kAbort:
      return "Abort";
  }
  return "an unknown call";
}

std::string LocalGroupName(absl::string_view coordinator, uint32_t rank) {
  // Long coordinator names are hashed to fit sun_path (107 bytes).
  std::string c(coordinator);
  if (c.size() > 80) c = absl::StrCat("h", std::hash<std::string>()(c));
  return absl::StrCat("onebit-ps/", c, "/worker", rank);
}

absl::StatusOr<std::unique_ptr<LocalLeader>> LocalLeader::Start(
    absl::string_view name, uint32_t local_ranks, uint64_t num_params, absl::string_view hello,
    uint64_t steps_done, absl::Duration timeout) {
  if (local_ranks < 2) return absl::InvalidArgumentError("a local group needs K >= 2 ranks");
  std::unique_ptr<LocalLeader> g(new LocalLeader());
  g->local_ranks_ = local_ranks;
  g->num_params_ = num_params;
  g->name_ = std::string(name);
  const size_t stride = RoundUp(num_params * sizeof(float));
  g->x_offset_ = RoundUp(std::max<size_t>(hello.size(), 1));
  g->map_bytes_ = g->x_offset_ + local_ranks * stride;
  int mem = memfd_create("onebit-local-group", MFD_CLOEXEC);
  if (mem < 0) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  if (ftruncate(mem, static_cast<off_t>(g->map_bytes_)) != 0) {
    const int e = errno;
    close(mem);
    return absl::ResourceExhaustedError(absl::StrCat("the local group's shared memory (",
                                                     g->map_bytes_, " bytes): ", std::strerror(e)));
  }
  void* map = mmap(nullptr, g->map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, mem, 0);
  if (map == MAP_FAILED) {
    const int e = errno;
    close(mem);
    return absl::ResourceExhaustedError(absl::StrCat("mapping the local group's shared memory (",
                                                     g->map_bytes_, " bytes): ", std::strerror(e)));
  }
  g->map_ = map;
  std::memcpy(map, hello.data(), hello.size());

  g->listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  socklen_t len;
  const sockaddr_un a = AddressOf(g->name_, &len);
  if (g->listen_fd_ < 0 || bind(g->listen_fd_, reinterpret_cast<const sockaddr*>(&a), len) != 0 ||
      listen(g->listen_fd_, static_cast<int>(local_ranks)) != 0) {
    const int e = errno;
    close(mem);
    return absl::FailedPreconditionError(absl::StrCat(
        "the local group's socket '@", g->name_, "': ", std::strerror(e),
        e == EADDRINUSE ? " (another local rank 0 of this worker runs on this host)" : ""));
  }
  g->fds_.assign(local_ranks - 1, -1);
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status failed;
  for (uint32_t joined = 0; joined + 1 < local_ranks && failed.ok();) {
    pollfd p{g->listen_fd_, POLLIN, 0};
    const int r = poll(&p, 1, MillisLeft(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      std::vector<uint32_t> missing;
      for (uint32_t k = 1; k < local_ranks; ++k) {
        if (g->fds_[k - 1] < 0) missing.push_back(k);
      }
      failed = absl::DeadlineExceededError(
          absl::StrCat("local rank", missing.size() > 1 ? "s " : " ", absl::StrJoin(missing, ", "),
                       " of this host did not join within ", absl::FormatDuration(timeout),
                       " (--local_ranks ", local_ranks, "; each connects to '@", g->name_, "')"));
      break;
    }
    int c = accept4(g->listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    // An abstract socket has no file permissions: anyone in this network
    // namespace can connect. Only this user's processes may join.
    ucred peer{};
    socklen_t peer_len = sizeof(peer);
    if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) != 0 || peer.uid != getuid()) {
      std::fprintf(stderr,
                   "local group '@%s': refused a connection from uid %u (pid %d): only uid %u's "
                   "processes join\n",
                   g->name_.c_str(), static_cast<unsigned>(peer.uid), static_cast<int>(peer.pid),
                   static_cast<unsigned>(getuid()));
      close(c);
      continue;
    }
    Wire w;
    auto got = RecvWire(c, deadline, &w);
    if (!got.ok() || *got != Got::kMessage || w.kind != kHello) {
      close(c);  // not a follower, or one that died in its hello
      continue;
    }
    Wire reply;
    std::string why;
    if (w.local_rank < 1 || w.local_rank >= local_ranks) {
      why = absl::StrCat("local rank ", w.local_rank, " is not in [1, ", local_ranks,
                         ") (--local_ranks ", local_ranks, ")");
    } else if (g->fds_[w.local_rank - 1] >= 0) {
      why = absl::StrCat("local rank ", w.local_rank, " joined twice");
    } else if (w.num_params != 0 && w.num_params != num_params) {
      why = absl::StrCat("local rank ", w.local_rank, " declared d = ", w.num_params,
                         "; its local rank 0 has d = ", num_params);
    }
    if (!why.empty()) {
      reply.kind = kRefused;
      SetText(&reply, why);
      (void)SendWire(c, reply);
      close(c);
      failed = absl::InvalidArgumentError(why);
      break;
    }
    reply.kind = kWelcome;
    reply.local_rank = w.local_rank;
    reply.step = steps_done;
    reply.num_params = num_params;
    reply.u[0] = local_ranks;
    reply.u[1] = hello.size();
    reply.u[2] = g->map_bytes_;
    reply.u[3] = g->x_offset_;
    reply.u[4] = g->x_offset_ + w.local_rank * stride;
    if (absl::Status st = SendWire(c, reply, mem); !st.ok()) {
      close(c);
      continue;  // it died meanwhile; it may come again
    }
    g->fds_[w.local_rank - 1] = c;
    ++joined;
  }
  close(mem);  // the mappings keep it
  CloseFd(&g->listen_fd_);
  if (!failed.ok()) return failed;
  return g;
}

LocalLeader::~LocalLeader() {
  for (int& fd : fds_) CloseFd(&fd);
  CloseFd(&listen_fd_);
  if (map_ != nullptr) munmap(map_, map_bytes_);
}

const float* LocalLeader::gradient(uint32_t local_rank) const {
  const size_t stride = RoundUp(num_params_ * sizeof(float));
  return reinterpret_cast<const float*>(static_cast<const char*>(map_) + x_offset_ +
                                        local_rank * stride);
}

float* LocalLeader::params() {
  return reinterpret_cast<float*>(static_cast<char*>(map_) + x_offset_);
}

absl::StatusOr<std::vector<LocalRequest>> LocalLeader::Gather(LocalCall call, uint64_t step,
                                                              absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<LocalRequest> out(local_ranks_ - 1);
  for (uint32_t k = 1; k < local_ranks_; ++k) {
    Wire w;
    auto got = RecvWire(fds_[k - 1], deadline, &w);
    const std::string who = absl::StrCat("local rank ", k, " of this host");
    if (!got.ok()) return absl::DataLossError(absl::StrCat(who, " sent ", got.status().message()));
    if (*got == Got::kClosed) {
      return absl::UnavailableError(
          absl::StrCat(who, " left (its connection closed): presumed dead"));
    }
    if (*got == Got::kTimeout) {
      return absl::DeadlineExceededError(absl::StrCat(who, " did not call ", LocalCallName(call),
                                                      " (step ", step, ") within ",
                                                      absl::FormatDuration(timeout)));
    }
    const auto theirs = static_cast<LocalCall>(w.kind);
    if (theirs == LocalCall::kAbort) {
      return absl::AbortedError(absl::StrCat(who, " aborted: ", TextOf(w)));
    }
    if (theirs != call || w.step != step) {
      return absl::FailedPreconditionError(
          absl::StrCat(who, " called ", LocalCallName(theirs), " after ", w.step,
                       " steps while local rank 0 called ", LocalCallName(call), " after ", step,
                       ": every rank of a host must make the same calls"));
    }
    LocalRequest& r = out[k - 1];
    r.call = theirs;
    r.local_rank = k;
    r.step = w.step;
    r.loss = w.f[0];
    r.epoch = w.f[1];
    r.has_loss = (w.flags & kHasLoss) != 0;
    r.has_lr = (w.flags & kHasLr) != 0;
    r.lr = w.lr;
    r.found_inf = (w.flags & kFoundInf) != 0;
    r.text = TextOf(w);
  }
  return out;
}

absl::Status LocalLeader::Answer(const LocalAnswer& a) {
  Wire w;
  w.kind = kAnswer;
  w.code = a.code;
  SetText(&w, a.message);
  w.flags = (a.rolled_back ? kRolledBack : 0) | (a.compressing ? kCompressing : 0) |
            (a.vote ? kVoteYes : 0) | (a.compressed ? kCompressed : 0) | (a.failed ? kFailed : 0) |
            (a.device_grads ? kDeviceGrads : 0);
  w.u[0] = a.steps_done;
  w.u[1] = a.step;
  w.u[2] = a.bytes_up;
  w.u[3] = a.bytes_down;
  w.u[4] = a.chunks;
  w.f[2] = a.step_s;
  w.f[3] = a.push_s;
  w.f[4] = a.reply_s;
  absl::Status first;
  for (uint32_t k = 1; k < local_ranks_; ++k) {
    if (absl::Status st = SendWire(fds_[k - 1], w); !st.ok() && first.ok()) {
      first = absl::UnavailableError(absl::StrCat("local rank ", k, " of this host is gone (",
                                                  st.message(), "): presumed dead"));
    }
  }
  return first;
}

absl::StatusOr<std::unique_ptr<LocalFollower>> LocalFollower::Connect(absl::string_view name,
                                                                      uint32_t local_rank,
                                                                      uint64_t num_params,
                                                                      absl::Duration timeout) {
  if (local_rank < 1) return absl::InvalidArgumentError("a follower's local rank is >= 1");
  std::unique_ptr<LocalFollower> f(new LocalFollower());
  f->local_rank_ = local_rank;
  f->name_ = std::string(name);
  const absl::Time deadline = absl::Now() + timeout;
  socklen_t len;
  const sockaddr_un a = AddressOf(f->name_, &len);
  while (true) {
    f->fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (f->fd_ < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
    if (connect(f->fd_, reinterpret_cast<const sockaddr*>(&a), len) == 0) break;
    const int e = errno;
    CloseFd(&f->fd_);
    if ((e != ECONNREFUSED && e != ENOENT && e != EAGAIN) || absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "local rank ", local_rank, ": no local rank 0 listened on '@", f->name_, "' within ",
          absl::FormatDuration(timeout), " (", std::strerror(e),
          "): local rank 0 of this worker, on this host, joins the job and then waits for its "
          "local ranks"));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  Wire hello;
  hello.kind = kHello;
  hello.local_rank = local_rank;
  hello.num_params = num_params;
  if (absl::Status st = SendWire(f->fd_, hello); !st.ok()) {
    return absl::UnavailableError(
        absl::StrCat("local rank ", local_rank, ": its local rank 0 is gone (", st.message(), ")"));
  }
  Wire w;
  int mem = -1;
  auto got = RecvWire(f->fd_, deadline, &w, &mem);
  if (!got.ok()) return got.status();
  if (*got != Got::kMessage) {
    if (mem >= 0) close(mem);
    return absl::UnavailableError(absl::StrCat(
        "local rank ", local_rank, ": its local rank 0 ",
        *got == Got::kClosed ? "closed the connection" : "did not answer", " when it joined"));
  }
  if (w.kind == kRefused) {
    if (mem >= 0) close(mem);
    return absl::InvalidArgumentError(
        absl::StrCat("local rank 0 refused local rank ", local_rank, ": ", TextOf(w)));
  }
  if (w.kind != kWelcome || mem < 0 || w.u[2] < w.u[4] + w.num_params * sizeof(float) ||
      w.u[1] > w.u[3]) {
    if (mem >= 0) close(mem);
    return absl::DataLossError(
        absl::StrCat("local rank ", local_rank, ": a malformed welcome from local rank 0"));
  }
  f->local_ranks_ = static_cast<uint32_t>(w.u[0]);
  f->num_params_ = w.num_params;
  f->map_bytes_ = w.u[2];
  f->x_offset_ = w.u[3];
  f->slot_offset_ = w.u[4];
  void* map = mmap(nullptr, f->map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, mem, 0);
  const int e = errno;
  close(mem);
  if (map == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mapping the local group's shared memory (",
                                                     f->map_bytes_, " bytes): ", std::strerror(e)));
  }
  f->map_ = map;
  f->hello_.assign(static_cast<const char*>(map), w.u[1]);
  f->steps_at_join_ = w.step;
  return f;
}

LocalFollower::~LocalFollower() {
  CloseFd(&fd_);
  if (map_ != nullptr) munmap(map_, map_bytes_);
}

float* LocalFollower::gradient() {
  return reinterpret_cast<float*>(static_cast<char*>(map_) + slot_offset_);
}

const float* LocalFollower::params() const {
  return reinterpret_cast<const float*>(static_cast<const char*>(map_) + x_offset_);
}

absl::StatusOr<LocalAnswer> LocalFollower::Call(LocalRequest r, absl::Duration timeout) {
  Wire w;
  w.kind = static_cast<uint32_t>(r.call);
  w.local_rank = local_rank_;
  w.step = r.step;
  w.f[0] = r.loss;
  w.f[1] = r.epoch;
  w.lr = r.lr;
  w.flags = (r.has_loss ? kHasLoss : 0) | (r.has_lr ? kHasLr : 0) | (r.found_inf ? kFoundInf : 0);
  SetText(&w, r.text);
  const std::string leader = "its local rank 0 (the host's pushing worker)";
  if (absl::Status st = SendWire(fd_, w); !st.ok()) {
    return absl::UnavailableError(absl::StrCat(leader, " is gone (", st.message(), ")"));
  }
  auto got = RecvWire(fd_, absl::Now() + timeout, &w);
  if (!got.ok()) return got.status();
  if (*got == Got::kClosed) {
    return absl::UnavailableError(absl::StrCat(leader, " is gone: its connection closed"));
  }
  if (*got == Got::kTimeout || w.kind != kAnswer) {
    return absl::DeadlineExceededError(absl::StrCat(leader, " did not answer ",
                                                    LocalCallName(r.call), " within ",
                                                    absl::FormatDuration(timeout)));
  }
  LocalAnswer a;
  a.code = w.code;
  a.message = TextOf(w);
  a.rolled_back = (w.flags & kRolledBack) != 0;
  a.compressing = (w.flags & kCompressing) != 0;
  a.vote = (w.flags & kVoteYes) != 0;
  a.compressed = (w.flags & kCompressed) != 0;
  a.failed = (w.flags & kFailed) != 0;
  a.device_grads = (w.flags & kDeviceGrads) != 0;
  a.steps_done = w.u[0];
  a.step = w.u[1];
  a.bytes_up = w.u[2];
  a.bytes_down = w.u[3];
  a.chunks = w.u[4];
  a.step_s = w.f[2];
  a.push_s = w.f[3];
  a.reply_s = w.f[4];
  return a;
}

void LocalFollower::Abort(absl::string_view reason) {
  Wire w;
  w.kind = static_cast<uint32_t>(LocalCall::kAbort);
  w.local_rank = local_rank_;
  SetText(&w, reason);
  (void)SendWire(fd_, w);
}

}  // namespace onebit
