// The worker's side of the data plane: one ZeroMQ DEALER per server; pushes
// every shard's chunks (interleaved across servers, so all servers receive
// at once), waits for every reply and adds the replied deltas to the replica.
//
// Not thread-safe: one thread drives it.
#ifndef ONEBIT_WORKER_PS_CLIENT_H_
#define ONEBIT_WORKER_PS_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "compress/codec.h"
#include "shard/optimizer.h"
#include "shard/shard_map.h"
#include "worker/replica.h"
#include "zmq.hpp"

namespace onebit {

struct PsClientOptions {
  uint64_t job_id = 0;
  uint32_t rank = 0;
  ShardMap map = ShardMap::Create(0, 1, 32).value();
  uint64_t chunk_elems = 1 << 20;
  const WorkerOptimizer* optimizer = nullptr;  // must outlive the client
  std::vector<std::string> server_endpoints;   // index = shard
  // A server that sends nothing for this long while replies are due is dead.
  absl::Duration reply_timeout = absl::Seconds(60);
};

class PsClient {
 public:
  static absl::StatusOr<std::unique_ptr<PsClient>> Connect(PsClientOptions options,
                                                           zmq::context_t* ctx);

  // Rank 0 only, before step 0: sends x (fp32) so the masters start from the
  // same initial parameters as the replicas.
  absl::Status SendInit(const float* x);

  // One step: pushes every chunk of the replica's gradient (the gradient in
  // the warm-up, the compressed momentum after it), waits for all replies
  // and has the replica apply them. The replica must follow
  // options.optimizer. `check` runs between waits (~100 ms); a non-OK result
  // aborts the step with it.
  absl::Status PushPull(uint64_t step, Replica* replica,
                        const std::function<absl::Status()>& check);

  // Bytes of the last step, headers included.
  uint64_t last_bytes_up() const { return bytes_up_; }
  uint64_t last_bytes_down() const { return bytes_down_; }
  // Phases of the last step (same-host clocks; see StepMetrics.push_s).
  double last_push_s() const { return push_s_; }
  double last_reply_s() const { return reply_s_; }

 private:
  struct Chunk {
    uint32_t shard;
    uint64_t index;  // within the shard
    Range range;     // global
    std::shared_ptr<std::vector<uint8_t>> buf;
  };
  explicit PsClient(PsClientOptions options) : options_(std::move(options)) {}
  // Encodes chunk i with `encode` (which writes codec.EncodedSize(n) bytes)
  // and sends it.
  absl::Status SendChunk(size_t i, uint64_t step, const Codec& codec, int kind,
                         const std::function<absl::Status(const Range&, uint8_t*)>& encode);
  absl::Status HandleReply(uint32_t server, uint64_t step, std::vector<zmq::message_t>& frames,
                           Replica* replica, std::vector<bool>* got, int* last_warmup);

  PsClientOptions options_;
  std::unique_ptr<const Codec> fp32_;  // INIT
  std::vector<zmq::socket_t> sockets_;
  std::vector<Chunk> chunks_;                  // send order: interleaved across servers
  std::vector<std::vector<size_t>> by_shard_;  // shard -> chunk index -> chunks_ index
  uint64_t bytes_up_ = 0;
  uint64_t bytes_down_ = 0;
  uint64_t last_pushed_ns_ = 0;  // max over this step's replies
  uint64_t first_sent_ns_ = 0;   // min over this step's replies
  double push_s_ = 0;
  double reply_s_ = 0;
};

}  // namespace onebit

#endif  // ONEBIT_WORKER_PS_CLIENT_H_
