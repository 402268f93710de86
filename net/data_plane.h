// The data plane between workers and servers (docs/design.md §2, proto/README.md):
// chunking of shards, header checks, and zero-copy ZeroMQ frames.
#ifndef ONEBIT_NET_DATA_PLANE_H_
#define ONEBIT_NET_DATA_PLANE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "compress/codec.h"
#include "proto/data.pb.h"
#include "shard/shard_map.h"
#include "zmq.hpp"

namespace onebit {

constexpr uint32_t kProtocolVersion = data::VERSION_CURRENT;

// The most elements a chunk may have (--chunk_elems), and so the largest
// frame any job sends (fp32; a worker's sockets take at most this from the
// servers it dialled). A server takes only its own job's: ServerFrameLimit.
constexpr uint64_t kMaxChunkElems = uint64_t{1} << 24;
constexpr uint64_t kMaxFrameBytes = 4 * kMaxChunkElems;

// The largest frame a worker of a job with chunks of `chunk_elems` sends a
// server, as ZeroMQ counts it: an fp32 chunk (INIT, warm-up PUSH; every
// other codec is narrower) or a header (a few dozen bytes), plus 4 KiB (a
// CURVE socket counts each frame with its encryption, 33 bytes more).
// `compressed_setting`: the job's --compressed_chunk_elems; a chunk of that
// many elements may be as wide as fp32 (the automatic size, 0, fits within
// an fp32 chunk of chunk_elems). ZeroMQ refuses a larger frame from its size
// prefix, before buffering any of it.
uint64_t ServerFrameLimit(uint64_t chunk_elems, uint64_t compressed_setting = 0);

// What a server checks a request against. Plain values; the codecs are owned
// by the caller and must outlive this.
struct DataPlaneJob {
  uint64_t job_id = 0;
  uint32_t workers = 0;
  uint64_t steps = 0;  // 0: not fixed (the job ends when the workers finish)
  ShardMap map = ShardMap::Create(0, 1, 32).value();
  uint64_t chunk_elems = 0;  // a multiple of map.block_size()
  // The chunks of the steps that push through the compression codecs:
  // --compressed_chunk_elems, which PsServer::Create resolves (0: auto) by
  // CompressedChunkElemsFor.
  uint64_t compressed_chunk_elems = 0;
  // The current step's push codec and chunk size (chunk_elems or
  // compressed_chunk_elems): what its PUSHes must have.
  const Codec* push_codec = nullptr;
  uint64_t push_chunk_elems = 0;      // 0: chunk_elems
  const Codec* init_codec = nullptr;  // fp32
  // Each worker's connections to this server (DataConnectionsFor): a
  // request may come on any of them.
  uint32_t connections = 1;
};

// The connections from each worker to each server of a job whose
// --data_connections is `setting` (0, a config from before the setting: 1).
// ZeroMQ encrypts a connection's messages (CURVE, about 1.3 GB/s a core)
// on one I/O thread at a time: a worker with few servers needs several to
// put more than one core on its traffic, where the host has the cores.
uint32_t DataConnectionsFor(uint32_t setting);
// Most --data_connections a job may ask for.
constexpr uint32_t kMaxDataConnections = 16;

// The first step a server serves (and a worker's first pull and step) may
// take this many --step_timeout: it carries the job's start-up, every
// worker connecting to every server (N·S CURVE handshakes; 16 384 at
// 128 × 128), which outlasts a step on a large or crowded job. A process
// that dies meanwhile is still found by the coordinator's heartbeats.
constexpr int kStartupSteps = 4;

// The connection (0 .. connections - 1) chunk `chunk` of a shard travels
// on, both ways: spread round-robin so consecutive chunks are encrypted and
// sent by different I/O threads.
inline uint32_t ChunkConnection(uint64_t chunk, uint32_t connections) {
  return static_cast<uint32_t>(chunk % connections);
}

// ZeroMQ I/O threads for a process with `connections` data connections:
// one per connection, at most 4 and at most the cores it has (a thread
// handles many connections; more threads than cores only switch).
int DataIoThreads(size_t connections);

// The chunk size of a job whose --chunk_elems is `setting` on `map`: the
// setting itself, or where it is 0 (auto, the default) an eighth of the
// largest shard, so that a shard's pushes and replies pipeline (the server
// works on the first chunks while the rest are on the wire), between 16 Ki
// and 1 Mi elements (64 KB to 4 MB of fp32: smaller ones cost more per byte
// than they save), rounded up to a multiple of the codec block.
uint64_t ChunkElemsFor(uint64_t setting, const ShardMap& map);

// The chunk size of the steps that push through `compressed` (the
// compression phase's codec), on a job with warm-up chunks of `chunk_elems`:
// `setting` (--compressed_chunk_elems), or where it is 0 (auto, the
// default) a quarter of the largest shard but at least 512 Ki elements
// (64 KB of 1-bit payload), at most the shard. A 1-bit chunk is 1/32 of an
// fp32 one, and each message costs its sender and server a fixed amount of
// CPU (ZeroMQ's wake-ups, a header, a reply per worker): the warm-up's grid
// would send 32 times the messages per byte. Never smaller than
// chunk_elems, nor so large that its payload outgrows an fp32 chunk of
// chunk_elems (so the servers' frame limit stays ServerFrameLimit's).
// Rounded up to a multiple of the codec block: a chunk's blocks, and so
// the result, are the same whatever the grid.
uint64_t CompressedChunkElemsFor(uint64_t setting, uint64_t chunk_elems, const ShardMap& map,
                                 const Codec& compressed);

// Number of chunks of a shard of `size` elements (0 for an empty shard).
uint64_t NumChunks(uint64_t size, uint64_t chunk_elems);
// Global element range of chunk c of shard k.
Range ChunkRange(const ShardMap& map, uint32_t shard, uint64_t chunk_elems, uint64_t c);

// The ZeroMQ routing id of worker `rank`'s data connection `connection`
// (< DataPlaneJob::connections) in job `job_id`: unique per job
// incarnation, so a leftover process of an earlier job cannot pass for a
// worker of this one.
std::string WorkerIdentity(uint64_t job_id, uint32_t rank, uint32_t connection = 0);

// The User-Id a server's ZAP handler gives worker `rank`'s key
// (security/curve.h): the rank a CURVE peer really is.
std::string WorkerPeerId(uint32_t rank);

// The job id data-plane messages carry in `incarnation` of job `job_id`
// (control::RegisterReply): a roll-back or restart makes a new one, so a
// message sent before it is refused after it.
inline uint64_t DataPlaneId(uint64_t job_id, uint64_t incarnation) { return job_id ^ incarnation; }

// Parses frame 0. Errors say "malformed header".
absl::StatusOr<data::Header> ParseHeader(const void* data, size_t size);

// Checks a PUSH, INIT, PULL, STATE_PULL, STATE_PUSH, VOTE or GRAD_SCALE request against the job and
// the shard this server owns, without the step (the server checks that against its own state):
// version, job id, kind, rank vs routing id, shard, chunk range and count, codec, block size,
// payload length (header vs codec vs the frame's size). The error message names the problem, e.g.
// "unknown worker rank 7 (job has 2 workers)".
absl::Status ValidateRequest(const data::Header& h, const DataPlaneJob& job, uint32_t owned_shard,
                             absl::string_view routing_id, size_t payload_frame_bytes);

// A payload buffer shared by several ZeroMQ messages without copying.
using SharedBytes = std::shared_ptr<const std::vector<uint8_t>>;

// A message over buf[offset, offset + size) that keeps `buf` alive until
// ZeroMQ is done with it.
zmq::message_t ShareFrame(const SharedBytes& buf, size_t offset, size_t size);

// Options of a worker's data-plane sockets: no high-water mark (the protocol
// bounds what is in flight: one step per shard, all of it this worker's own
// or its servers' replies), frames of at most kMaxFrameBytes, no linger,
// 4 MB kernel socket buffers (on loopback they took 1x1 push/pull of 10 M
// floats from 1.5 to 2.4 GB/s: fewer wake-ups per chunk), and no handshake
// timeout (a crowded host's handshakes may take longer than ZeroMQ's 30 s;
// the worker's own step bounds end the wait).
void ConfigureDataSocket(zmq::socket_t* socket);

// A server's data socket (a ROUTER; before bind: ZeroMQ copies a socket's
// options into each listener as it binds): as above, but what any one peer
// can make it hold is bounded: frames of at most `max_frame_bytes`
// (ServerFrameLimit of its job), kServerRcvHwm messages queued from each
// connection (then TCP pushes back on the sender; nothing is lost), and
// kServerSndHwm replies queued to each (a peer that does not read its
// replies loses them: see SendOrDrop), and a connection's handshake
// dropped when not done in kServerHandshakeMs (ZeroMQ's default; the
// server's ZAP handler answers well within it, security/curve.h).
constexpr int kServerRcvHwm = 8;
constexpr int kServerSndHwm = 1024;
constexpr int kServerHandshakeMs = 30000;
void ConfigureServerDataSocket(zmq::socket_t* socket, uint64_t max_frame_bytes);

// A TCP port held, bound but not listening, until the data socket is bound
// to it: a server names its data endpoint when it registers, but learns
// its job's frame limit only from the reply, and a port that listened
// before would have taken (and queued) frames of any size meanwhile. A
// connection to it meanwhile is refused; a worker's DEALER retries.
class ReservedPort {
 public:
  // `host` as ZeroMQ's tcp:// takes it for bind (an IPv4 address, a host
  // name, or "*" / "0.0.0.0" for all); port 0 picks a free one.
  static absl::StatusOr<ReservedPort> Reserve(const std::string& host, int port);
  ReservedPort(ReservedPort&& other) noexcept;
  ReservedPort& operator=(ReservedPort&&) = delete;
  ~ReservedPort();  // releases it

  int port() const { return port_; }
  // Gives the port up (for the data socket to bind it next).
  void Release();

 private:
  ReservedPort(int fd, int port) : fd_(fd), port_(port) {}
  int fd_;
  int port_;
};

// Sends a multipart message on a ROUTER without blocking. False when the
// peer is gone or its queue is full (it does not read): the message is
// dropped, and the caller counts it.
bool SendOrDrop(zmq::socket_t* socket, std::vector<zmq::message_t>& frames);

// zmq::poll, where a caught signal (util/stop_signal.h) interrupting the
// wait counts as a timeout: the caller's loop looks at its flags next.
int PollItems(zmq::pollitem_t* items, size_t n, std::chrono::milliseconds timeout);

// Makes malloc keep multi-MB chunk buffers (ZeroMQ allocates one per
// received message) instead of returning them to the kernel on free and
// faulting fresh zeroed pages in on the next step. Call once at start.
void KeepLargeBuffers();

// CLOCK_MONOTONIC in ns: comparable across processes on one host.
uint64_t MonotonicNs();

// A copy of a small message (a header).
zmq::message_t CopyFrame(absl::string_view bytes);

}  // namespace onebit

#endif  // ONEBIT_NET_DATA_PLANE_H_
