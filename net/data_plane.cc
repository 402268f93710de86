#include "net/data_plane.h"

#include <arpa/inet.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace onebit {

uint64_t ChunkElemsFor(uint64_t setting, const ShardMap& map) {
  if (setting != 0) return setting;
  constexpr uint64_t kMin = uint64_t{1} << 14, kMax = uint64_t{1} << 20;
  uint64_t largest = 0;
  for (uint32_t k = 0; k < map.num_shards(); ++k) largest = std::max(largest, map.shard(k).size());
  const uint64_t b = map.block_size();
  const uint64_t want = std::clamp((largest + 7) / 8, kMin, kMax);
  return std::max(b, (want + b - 1) / b * b);
}

uint64_t CompressedChunkElemsFor(uint64_t setting, uint64_t chunk_elems, const ShardMap& map,
                                 const Codec& compressed) {
  if (setting != 0) return setting;
  constexpr uint64_t kMin = uint64_t{1} << 19;
  uint64_t largest = 0;
  for (uint32_t k = 0; k < map.num_shards(); ++k) largest = std::max(largest, map.shard(k).size());
  const uint64_t b = map.block_size();
  uint64_t want = std::min(largest, std::max((largest + 3) / 4, kMin));
  want = (want + b - 1) / b * b;
  // chunk_elems is a multiple of the block, so a payload of k such chunks
  // is k times one's.
  const uint64_t per_chunk = std::max<uint64_t>(1, compressed.EncodedSize(chunk_elems));
  const uint64_t fit = std::max<uint64_t>(1, 4 * chunk_elems / per_chunk);
  const uint64_t cap = std::min(kMaxChunkElems / chunk_elems, fit) * chunk_elems;
  return std::clamp(want, chunk_elems, std::max(chunk_elems, cap));
}

uint64_t NumChunks(uint64_t size, uint64_t chunk_elems) {
  return (size + chunk_elems - 1) / chunk_elems;
}

Range ChunkRange(const ShardMap& map, uint32_t shard, uint64_t chunk_elems, uint64_t c) {
  Range s = map.shard(shard);
  Range r;
  r.begin = std::min(s.end, s.begin + c * chunk_elems);
  r.end = std::min(s.end, r.begin + chunk_elems);
  return r;
}

std::string WorkerIdentity(uint64_t job_id, uint32_t rank, uint32_t connection) {
  // Connection 0 keeps the id of a job with one connection per server.
  if (connection == 0) return absl::StrFormat("w%u-%016x", rank, job_id);
  return absl::StrFormat("w%u.%u-%016x", rank, connection, job_id);
}

uint32_t DataConnectionsFor(uint32_t setting) { return std::max(setting, 1u); }

int DataIoThreads(size_t connections) {
  const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<int>(std::clamp<size_t>(connections, 1, std::min<size_t>(4, cores)));
}

std::string WorkerPeerId(uint32_t rank) { return absl::StrCat("worker ", rank); }

absl::StatusOr<data::Header> ParseHeader(const void* data, size_t size) {
  // A header is some dozens of bytes. Protobuf takes an int size: a frame of
  // 2 GiB or more would make it abort the process (one hostile message).
  constexpr size_t kMaxHeaderBytes = 1 << 20;
  if (size > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "malformed header: ", size, " bytes (a header has at most ", kMaxHeaderBytes, ")"));
  }
  data::Header h;
  if (size == 0 || !h.ParseFromArray(data, static_cast<int>(size))) {
    return absl::InvalidArgumentError(absl::StrCat("malformed header: ", size,
                                                   " bytes that do not parse as a header "
                                                   "(truncated or not onebit)"));
  }
  return h;
}

absl::Status ValidateRequest(const data::Header& h, const DataPlaneJob& job, uint32_t owned_shard,
                             absl::string_view routing_id, size_t payload_frame_bytes) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (h.version() != kProtocolVersion) {
    return bad("unsupported protocol version ", h.version(), " (this server speaks ",
               kProtocolVersion, ")");
  }
  if (h.job_id() != job.job_id) {
    // Not saying which id would be right.
    return bad(absl::StrFormat("wrong job id %016x (not this job's)", h.job_id()));
  }
  if (h.kind() != data::PUSH && h.kind() != data::INIT && h.kind() != data::PULL &&
      h.kind() != data::STATE_PULL && h.kind() != data::STATE_PUSH && h.kind() != data::VOTE &&
      h.kind() != data::GRAD_SCALE) {
    return bad("unexpected message kind ", data::Kind_Name(h.kind()),
               " (want PUSH, INIT, PULL, STATE_PULL, STATE_PUSH, VOTE or GRAD_SCALE)");
  }
  if (h.rank() >= job.workers) {
    return bad("unknown worker rank ", h.rank(), " (job has ", job.workers, " workers)");
  }
  // The connection the id names ("w<rank>.<c>-<job>"; none: 0), then one
  // comparison with that connection's id decides.
  uint32_t connection = 0;
  const size_t dot = routing_id.find('.'), dash = routing_id.find('-');
  if (dot != absl::string_view::npos && dash != absl::string_view::npos && dot < dash &&
      !absl::SimpleAtoi(routing_id.substr(dot + 1, dash - dot - 1), &connection)) {
    connection = UINT32_MAX;
  }
  if (connection >= std::max(job.connections, 1u) ||
      routing_id != WorkerIdentity(job.job_id, h.rank(), connection)) {
    return bad("rank ", h.rank(), " claimed by a socket that is not that worker's (routing id '",
               absl::CHexEscape(routing_id), "')");
  }
  if (h.kind() == data::INIT && h.rank() != 0) {
    return bad("INIT from rank ", h.rank(), " (only rank 0 sends the initial x)");
  }
  if (h.kind() == data::VOTE && (h.shard() != 0 || h.begin() != 0)) {
    return bad("VOTE for shard ", h.shard(), " at element ", h.begin(),
               " (votes name chunk 0 of shard 0)");
  }
  if (h.kind() == data::STATE_PUSH && h.rank() != 0) {
    return bad("STATE_PUSH from rank ", h.rank(), " (only rank 0 seeds the optimizer state)");
  }
  if (h.shard() >= job.map.num_shards()) {
    return bad("shard ", h.shard(), " out of range (job has ", job.map.num_shards(), " shards)");
  }
  if (h.shard() != owned_shard) {
    return bad("shard ", h.shard(), " is not served here (this server owns shard ", owned_shard,
               ")");
  }
  const Range s = job.map.shard(h.shard());
  // A step's pushes are cut by its own grid; everything else by the warm-up's.
  const uint64_t elems =
      h.kind() == data::PUSH && job.push_chunk_elems != 0 ? job.push_chunk_elems : job.chunk_elems;
  if (h.begin() < s.begin || h.begin() >= s.end || (h.begin() - s.begin) % elems != 0) {
    return bad("element range begins at ", h.begin(), ", not at a chunk of shard ", h.shard(), " [",
               s.begin, ", ", s.end, ") with chunks of ", elems);
  }
  const uint64_t chunk = (h.begin() - s.begin) / elems;
  const Range want = ChunkRange(job.map, h.shard(), elems, chunk);
  if (h.count() != want.size()) {
    return bad("wrong element count ", h.count(), " for chunk ", chunk, " of shard ", h.shard(),
               " (want ", want.size(), ")");
  }
  const bool init = h.kind() != data::PUSH;
  const Codec* codec = init ? job.init_codec : job.push_codec;
  if (h.codec() != codec->name()) {
    return bad("unknown codec '", absl::CHexEscape(h.codec()), "' (this job ",
               init ? "initialises with" : "pushes", " '", codec->name(), "')");
  }
  if (h.block_size() != job.map.block_size()) {
    return bad("wrong block size ", h.block_size(), " (job uses ", job.map.block_size(), ")");
  }
  if (h.kind() == data::GRAD_SCALE && !(std::isfinite(h.grad_scale()) && h.grad_scale() >= 0)) {
    return bad("gradient scale ", h.grad_scale(), " (want finite, >= 0)");
  }
  if (h.scale_pending() && (h.kind() != data::PUSH || h.codec() != "fp32")) {
    return bad("scale_pending on a ", data::Kind_Name(h.kind()), " of codec '",
               absl::CHexEscape(h.codec()), "' (only an fp32 PUSH can wait for its scale)");
  }
  if (h.has_lr() && (h.kind() != data::PUSH || !std::isfinite(h.lr()) || h.lr() < 0)) {
    return bad("learning rate ", h.lr(), " (a PUSH may carry a finite lr >= 0)");
  }
  // A PULL or STATE_PULL asks for data, a VOTE or GRAD_SCALE is its header:
  // none carries any.
  const bool pull = h.kind() == data::PULL || h.kind() == data::STATE_PULL ||
                    h.kind() == data::VOTE || h.kind() == data::GRAD_SCALE;
  const size_t need = pull ? 0 : codec->EncodedSize(h.count());
  if (h.payload_bytes() != need) {
    return bad("wrong payload length ", h.payload_bytes(), " in header (", codec->name(), " needs ",
               need, " bytes for ", h.count(), " elements)");
  }
  if (payload_frame_bytes != h.payload_bytes()) {
    return bad("wrong payload length: header says ", h.payload_bytes(), " bytes, frame has ",
               payload_frame_bytes);
  }
  return absl::OkStatus();
}

zmq::message_t ShareFrame(const SharedBytes& buf, size_t offset, size_t size) {
  auto* hold = new SharedBytes(buf);
  return zmq::message_t(
      const_cast<uint8_t*>(buf->data()) + offset, size,
      [](void*, void* hint) { delete static_cast<SharedBytes*>(hint); }, hold);
}

int PollItems(zmq::pollitem_t* items, size_t n, std::chrono::milliseconds timeout) {
  try {
    return zmq::poll(items, n, timeout);
  } catch (const zmq::error_t& e) {
    if (e.num() == EINTR) return 0;
    throw;
  }
}

void ConfigureDataSocket(zmq::socket_t* s) {
  s->set(zmq::sockopt::sndhwm, 0);
  s->set(zmq::sockopt::rcvhwm, 0);
  s->set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxFrameBytes));
  s->set(zmq::sockopt::linger, 0);
  s->set(zmq::sockopt::sndbuf, 4 << 20);
  s->set(zmq::sockopt::rcvbuf, 4 << 20);
  // No handshake timeout of ZeroMQ's own: the job's step bounds already
  // limit the wait, and a handshake restarted costs its crypto again. With
  // ZeroMQ's 30 s, 128 workers x 128 servers on 2 cores restarted theirs
  // for minutes and 21 workers never got their initial parameters.
  s->set(zmq::sockopt::handshake_ivl, 0);
}

uint64_t ServerFrameLimit(uint64_t chunk_elems, uint64_t compressed_setting) {
  return 4 * std::max(chunk_elems, compressed_setting) + 4096;
}

void ConfigureServerDataSocket(zmq::socket_t* s, uint64_t max_frame_bytes) {
  ConfigureDataSocket(s);
  // Anyone can connect here: a handshake left half-done is dropped.
  s->set(zmq::sockopt::handshake_ivl, kServerHandshakeMs);
  s->set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(max_frame_bytes));
  s->set(zmq::sockopt::rcvhwm, kServerRcvHwm);
  s->set(zmq::sockopt::sndhwm, kServerSndHwm);
  // EHOSTUNREACH for a peer that is gone, rather than a silent drop.
  s->set(zmq::sockopt::router_mandatory, 1);
}

absl::StatusOr<ReservedPort> ReservedPort::Reserve(const std::string& host, int port) {
  auto failed = [&](absl::string_view why) {
    return absl::UnavailableError(absl::StrCat("cannot bind the data port tcp://", host, ":",
                                               port == 0 ? "*" : absl::StrCat(port), ": ", why));
  };
  addrinfo hints{};
  hints.ai_family = AF_INET;  // as ZeroMQ binds without ZMQ_IPV6
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  if (int e = getaddrinfo(host == "*" ? nullptr : host.c_str(), service.c_str(), &hints, &found);
      e != 0) {
    return failed(gai_strerror(e));
  }
  // SO_REUSEADDR as ZeroMQ's own listener: a restarted server takes its
  // port back while connections of its predecessor are in TIME_WAIT.
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  const int bound = fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0
                        ? -1
                        : bind(fd, found->ai_addr, found->ai_addrlen);
  const int err = errno;
  freeaddrinfo(found);
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  if (bound != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) close(fd);
    return failed(std::strerror(err));
  }
  return ReservedPort(fd, ntohs(addr.sin_port));
}

ReservedPort::ReservedPort(ReservedPort&& other) noexcept : fd_(other.fd_), port_(other.port_) {
  other.fd_ = -1;
}

ReservedPort::~ReservedPort() { Release(); }

void ReservedPort::Release() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

bool SendOrDrop(zmq::socket_t* s, std::vector<zmq::message_t>& frames) {
  try {
    for (size_t i = 0; i < frames.size(); ++i) {
      const auto flags = i + 1 < frames.size()
                             ? zmq::send_flags::sndmore | zmq::send_flags::dontwait
                             : zmq::send_flags::dontwait;
      // Only the first frame can fail: ZeroMQ takes the rest of a message
      // whose first frame it took.
      if (!s->send(frames[i], flags)) return false;
    }
  } catch (const zmq::error_t&) {
    return false;  // EHOSTUNREACH: the peer is gone
  }
  return true;
}

void KeepLargeBuffers() {
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

uint64_t MonotonicNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

zmq::message_t CopyFrame(absl::string_view bytes) {
  return zmq::message_t(bytes.data(), bytes.size());
}

}  // namespace onebit
