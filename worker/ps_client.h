// The worker's side of the data plane: one ZeroMQ DEALER per server
// (or several: PsClientOptions::connections); pushes
// every shard's chunks (interleaved across servers, so all servers receive
// at once, or in the order the caller releases them), waits for every reply
// and has the replica apply them.
//
// Not thread-safe: one thread drives it.
#ifndef ONEBIT_WORKER_PS_CLIENT_H_
#define ONEBIT_WORKER_PS_CLIENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "compress/codec.h"
#include "net/data_plane.h"
#include "net/liveness.h"
#include "optim/optimizer.h"
#include "security/curve.h"
#include "security/data_seal.h"
#include "shard/shard_map.h"
#include "worker/replica.h"
#include "zmq.hpp"

namespace onebit {

struct PsClientOptions {
  uint64_t job_id = 0;
  uint32_t rank = 0;
  ShardMap map = ShardMap::Create(0, 1, 32).value();
  uint64_t chunk_elems = 1 << 20;
  // The compressed steps' chunks (CompressedChunkElemsFor, as the servers
  // resolve it); 0: chunk_elems.
  uint64_t compressed_chunk_elems = 0;
  const WorkerOptimizer* optimizer = nullptr;  // must outlive the client
  std::vector<std::string> server_endpoints;   // index = shard
  // CURVE (security/curve.h): this worker's keys and each server's public
  // key (index = shard); none under --insecure.
  std::optional<CurveKeys> keys;
  std::vector<std::string> server_keys;
  // A sealed data plane (--data_cipher aes-gcm, security/data_seal.h):
  // the secret this worker shares with each server (index = shard), which
  // replaces CURVE on its connections (keys still given). Empty: CURVE, or
  // --insecure.
  std::vector<PairSecret> sealed;
  // Connections to each server (DataConnectionsFor, as the servers resolve
  // it): chunk i of a shard goes out on connection ChunkConnection(i).
  uint32_t connections = 1;
  // A server that sends nothing for this long while replies are due is dead.
  absl::Duration reply_timeout = absl::Seconds(60);
  // Instead of reply_timeout for the initial pull and the replies of the
  // first step (which may be merged in the second): they carry the job's
  // start-up, every worker connecting to every server (N·S CURVE
  // handshakes), which outlasts a step on a crowded or large job.
  absl::Duration startup_timeout = absl::Seconds(240);
  // Marked with each server whose valid message arrives (JobMember's, for
  // its heartbeats); null: none.
  std::shared_ptr<PeersHeard> peers_heard;
};

class PsClient {
 public:
  // Runs between waits (~100 ms); a non-OK result aborts the wait with it.
  using Check = std::function<absl::Status()>;

  static absl::StatusOr<std::unique_ptr<PsClient>> Connect(PsClientOptions options,
                                                           zmq::context_t* ctx);

  // Rank 0 only, before step 0: sends x (fp32, host memory) so the masters
  // start from it.
  absl::Status SendInit(const float* x);
  // At the end of a job, before this is destroyed: whatever is still queued
  // for the servers (rank 0's x in a job that ends before its first step:
  // nothing acknowledges it) gets up to `bound` to leave when the sockets
  // close, rather than being dropped with them. The context's destruction
  // waits for it.
  void LingerOnClose(absl::Duration bound);
  // Fetches the servers' x as of the start of `step` into the replica:
  // before step 0 on every other rank (rank 0's x, once it has arrived);
  // on every rank of a job resumed at `step` (where a sync's merge is
  // still due then, its step merges it: TakeReplies).
  absl::Status PullParams(uint64_t step, Replica* replica, const Check& check);
  // Between steps (none of `step`'s chunks pushed): fetches every shard's
  // master x and optimizer state arrays as of the start of `step`, by name
  // ("x", "m", "v", "den", "e"; d floats each, an array every shard holds),
  // and whether the servers are in the compression phase. Changes nothing
  // on the servers.
  struct ServerState {
    bool frozen = false;
    uint64_t bias_steps = 0;  // Adam steps of a seeded state before this job
    std::map<std::string, std::vector<float>> arrays;
  };
  absl::StatusOr<ServerState> PullState(uint64_t step, const Check& check);
  // Rank 0 only, before its first push of step 0: sets each named array
  // ("m" or "v"; d floats, host memory) on every shard, and the shards'
  // bias_steps, and waits until every server has taken it. A server that
  // refuses (another optimizer, a step under way) answers with its reason.
  absl::Status PushState(const std::map<std::string, const float*>& arrays, uint64_t bias_steps,
                         const Check& check);
  // Before the first push of `step`: sends this rank's overflow flag to
  // server 0 and waits for the verdict of all N: whether any rank's
  // gradient overflowed (then every rank skips the step).
  absl::StatusOr<bool> Vote(uint64_t step, bool found_inf, const Check& check);

  // A step in parts: BeginStep, then PushReady as gradient ranges become
  // final (each chunk is pushed once all of it is ready), then CompleteStep,
  // which pushes the rest, waits for every reply and has the replica apply
  // them. The order of pushes does not change the result. A step the
  // optimizer's schedule makes local (StepKind::kLocal) sends nothing:
  // CompleteStep has the replica take it alone. `lr`: the step's
  // learning rate when the caller sets it (sent with every push; the servers
  // check that all workers agree); nullopt: the job's schedule.
  // Whether step `step`, in `phase`, can push before its gradient scale is
  // known (BeginStep's defer_scale): a full-precision step with fp32 on the
  // wire, which pushes the gradient itself (every warm-up and zero-one-adam
  // variance step of a job with the fp32 warm-up codec).
  bool CanDeferScale(uint64_t step, Phase phase) const;
  // `defer_scale`: this step's pushes carry scale_pending (fp32 gradient
  // pushes only: CanDeferScale), and CompleteStep's `grad_scale` follows them.
  absl::Status BeginStep(uint64_t step, std::optional<float> lr, bool defer_scale = false);
  // Changes the current step's lr while none of its chunks has gone out.
  absl::Status SetStepLr(std::optional<float> lr);
  // [b, e) of the replica's gradient is final for this step.
  absl::Status PushReady(uint64_t b, uint64_t e, Replica* replica);
  // `grad_scale`: given exactly when the step was begun with defer_scale;
  // sent to every server once the pushes are out.
  absl::Status CompleteStep(Replica* replica, const Check& check,
                            std::optional<float> grad_scale = std::nullopt);
  // All three at once.
  absl::Status PushPull(uint64_t step, Replica* replica, const Check& check);
  // A sync whose merge is due at a later step (diloco's --sync_delay:
  // WorkerOptimizer::MergeStep) leaves CompleteStep without waiting for its
  // replies; the CompleteStep of that step receives, applies and merges
  // them. Between steps, TakeReplies receives and applies (into x_sync)
  // those still outstanding, so that a checkpoint's state is the servers';
  // the merge stays due.
  absl::Status TakeReplies(Replica* replica, const Check& check);

  // Whether a step is between BeginStep and the end of CompleteStep, and
  // whether any of its chunks has gone out.
  bool in_step() const { return in_step_; }
  bool pushed_any() const { return pushed_count_ > 0; }

  // Bytes of the last step, headers included.
  uint64_t last_bytes_up() const { return bytes_up_; }
  uint64_t last_bytes_down() const { return bytes_down_; }
  // Phases of the last step (same-host clocks; see StepMetrics.push_s).
  double last_push_s() const { return push_s_; }
  double last_reply_s() const { return reply_s_; }
  // Chunks the last step pushed, and how many of them went out before its
  // last PushReady call: while the rest of the gradient was being computed.
  size_t last_chunks() const { return step_chunks_; }
  size_t last_chunks_overlapped() const { return chunks_overlapped_; }
  // The last step's parts on this worker's clock: encoding and sending its
  // pushes, waiting for the replies, applying them (and finishing the
  // step; a local step's whole update); whether it was a local step.
  double last_send_s() const { return send_ns_ * 1e-9; }
  double last_wait_s() const { return wait_ns_ * 1e-9; }
  double last_apply_s() const { return apply_ns_ * 1e-9; }
  bool last_local() const { return kind_ == StepKind::kLocal; }
  // The current step's encoding and sending so far (PushReady's).
  double sending_s() const { return send_ns_ * 1e-9; }

 private:
  struct Chunk {
    uint32_t shard;
    uint64_t index;  // within the shard
    Range range;     // global
    std::shared_ptr<std::vector<uint8_t>> buf;
  };
  // The shards cut into chunks of one size.
  struct Grid {
    uint64_t chunk_elems = 0;
    std::vector<Chunk> chunks;                  // send order: interleaved across servers
    std::vector<std::vector<size_t>> by_shard;  // shard -> chunk index -> chunks index
    std::vector<size_t> by_begin;               // chunks indices in the order of x
  };
  void MakeGrid(uint64_t chunk_elems, Grid* g) const;
  // The replies of one step's pushes.
  struct Round {
    uint64_t step = 0;
    float lr = 0;
    size_t grid = 0;                   // grids_ index
    std::vector<StepKind> shard_kind;  // kLocal: that shard sent nothing
    std::vector<bool> got;             // by grid chunks index
    int last_warmup = -1;              // unknown until the first reply
    // A round whose merge is due later: that step, what each server still
    // owes, and its replies that came while another wait ran.
    uint64_t merge = 0;
    std::vector<size_t> outstanding;
    std::vector<std::pair<uint32_t, std::vector<zmq::message_t>>> early;
  };
  // The current step's grid (once BeginReplicaStep has run).
  Grid& step_grid() { return grids_[step_grid_]; }
  explicit PsClient(PsClientOptions options) : options_(std::move(options)) {}
  // Encodes chunk c with `encode` (which writes codec.EncodedSize(n) bytes)
  // and sends it.
  // `more`, when given, adds header fields of the kind's own.
  absl::Status SendChunk(Chunk& c, uint64_t step, const Codec& codec, int kind,
                         const std::function<absl::Status(const Range&, uint8_t*)>& encode,
                         const std::function<void(data::Header&)>& more = nullptr);
  // A message of chunk i that is its header alone (PULL, STATE_PULL, VOTE,
  // GRAD_SCALE).
  absl::Status SendHeader(Chunk& c, uint64_t step, int kind,
                          const std::function<void(data::Header&)>& more = nullptr);
  absl::Status PushChunk(size_t i, Replica* replica);
  // The step's learning rate: the caller's, else the job's schedule's.
  float StepLr() const;
  // Begins the replica's step (once, at the first push or the completion,
  // so that SetStepLr still counts) and learns what the step sends.
  absl::Status BeginReplicaStep(Replica* replica);
  // Receives until every chunk of `grid` of every server has been answered
  // (with `expected`: that many messages of server k); `handle` takes one
  // message of server k (and fails the wait with its error). A message
  // beyond what a server owes is an error naming it.
  absl::Status ReceiveAll(
      const Grid& grid, const std::string& what,
      const std::function<absl::Status(uint32_t k, std::vector<zmq::message_t>&)>& handle,
      const Check& check, const std::vector<size_t>& expected = {});
  // Checks what every reply header must have: parses it, turns ERROR into
  // its reason, checks version, job, kind, step, shard and chunk of `grid`;
  // returns the chunk's index into grid.chunks.
  absl::StatusOr<size_t> CheckReply(const Grid& grid, uint32_t server, uint64_t step, int kind,
                                    const std::vector<zmq::message_t>& frames, data::Header* h);
  absl::Status HandleReply(uint32_t server, std::vector<zmq::message_t>& frames, Replica* replica,
                           Round* round);
  // Whether `frames`, from server k, is a reply pending_ still waits for;
  // if so it is kept in pending_->early.
  bool KeepEarlyReply(uint32_t k, std::vector<zmq::message_t>& frames);
  // A job resumed at `step` (PullParams): the sync before it whose merge is
  // still due, its outer step already in the x_sync the pull wrote.
  void ResumeMerge(uint64_t step, Phase phase);
  // Waits until every reply pending_ is owed has arrived (kept, not yet
  // applied): then every server has completed its step, and a request
  // about the next one (a vote, a state pull) finds it there.
  absl::Status AwaitPending(const Check& check);
  // Receives and applies what pending_ still waits for.
  absl::Status ReceivePending(Replica* replica, const Check& check);

  uint32_t num_servers() const { return static_cast<uint32_t>(options_.server_endpoints.size()); }

  PsClientOptions options_;
  std::unique_ptr<const Codec> fp32_;  // INIT, PULL
  // Server k's connection l at k * connections + l.
  std::vector<zmq::socket_t> sockets_;
  // Sealed: each socket's seal (same index); empty otherwise.
  std::vector<std::unique_ptr<ConnectionSeal>> seals_;
  // [0]: the warm-up's grid, of every message but a compressed step's
  // pushes and replies; [1]: those, where their chunks are larger.
  Grid grids_[2];
  size_t step_grid_ = 0;
  // The current step.
  bool in_step_ = false;
  std::optional<uint64_t> first_step_;  // this client's first step (startup_timeout)
  bool defer_scale_ = false;            // this step's pushes wait for a GRAD_SCALE
  uint64_t step_ = 0;
  std::optional<float> lr_;
  bool replica_begun_ = false;
  StepKind kind_ = StepKind::kFull;  // what the step sends, once the replica has begun it
  // By shard: kind_, or kLocal for a diloco fragment that does not sync
  // then (OptimizerCodecs::KindAt); its chunks are neither pushed nor
  // answered, its elements take LocalStep.
  std::vector<StepKind> shard_kind_;
  // A sync whose replies are merged at a later step; at most one (diloco's
  // --sync_delay is below the spacing of two fragments' syncs).
  std::optional<Round> pending_;
  std::vector<bool> pushed_;  // by step_grid() chunks index
  size_t pushed_count_ = 0;
  size_t pushed_before_last_ready_ = 0;
  std::map<uint64_t, uint64_t> ready_;  // released ranges, merged: begin -> end
  uint64_t start_ns_ = 0;               // the step's first push
  uint64_t bytes_up_ = 0;
  uint64_t bytes_down_ = 0;
  uint64_t last_pushed_ns_ = 0;  // max over this step's replies
  uint64_t first_sent_ns_ = 0;   // min over this step's replies
  double push_s_ = 0;
  double reply_s_ = 0;
  size_t step_chunks_ = 0;
  size_t chunks_overlapped_ = 0;
  uint64_t send_ns_ = 0;
  uint64_t wait_ns_ = 0;
  uint64_t apply_ns_ = 0;
};

}  // namespace onebit

#endif  // ONEBIT_WORKER_PS_CLIENT_H_
