// The data plane of one server (docs/design.md §2): owns one shard's state,
// aggregates exactly N pushes per chunk per step — decoded and summed in
// worker-rank order, holding out-of-order pushes until the ranks before them
// are in — applies the update rule, and replies to all N workers from one
// shared buffer. Bad requests get an ERROR reply naming the problem and
// change no state.
//
// Not thread-safe: one thread calls Serve(); other threads may only call
// RequestStop().
#ifndef ONEBIT_SERVER_PS_SERVER_H_
#define ONEBIT_SERVER_PS_SERVER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "compress/codec.h"
#include "net/data_plane.h"
#include "net/liveness.h"
#include "optim/optimizer.h"
#include "security/data_seal.h"
#include "server/server_metrics.h"
#include "util/phase_medians.h"
#include "util/refusal_log.h"
#include "zmq.hpp"

namespace onebit {

struct PsServerOptions {
  DataPlaneJob job;  // codecs are filled in by Create()
  uint32_t shard = 0;
  OptimizerOptions optimizer;
  FreezeOptions freeze;
  absl::Duration step_timeout = absl::Seconds(30);
  // Instead of step_timeout for the first step Serve serves: it carries the
  // job's start-up (every worker connecting to every server), which
  // outlasts a step on a crowded or large job.
  absl::Duration startup_timeout = absl::Seconds(120);
  // --freeze auto: where this shard's checks go, and where the coordinator's
  // decision comes from (see Heartbeater::FreezeDecision).
  std::function<void(uint64_t completed, double change)> report_freeze_check;
  std::function<std::optional<uint64_t>(uint64_t completed)> freeze_decision;
  // When set: called after every step, on Serve's thread, with the shard's
  // consistent state (e.g. to snapshot it for a checkpoint).
  std::function<void(const ServerShardState&)> on_step_end;
  // When set: the shard's state from a checkpoint (its begin and size must
  // be this shard's); the server continues at its step, without INIT, and
  // the workers PULL x from it.
  std::optional<ServerShardState> restored;
  // The data-plane ids of this job's earlier incarnations (before a
  // roll-back): their messages, sent before it, are dropped unanswered.
  std::vector<uint64_t> earlier_job_ids;
  // The socket is a CURVE server whose ZAP handler tags each worker's
  // messages with WorkerPeerId(rank) (security/curve.h): a request is
  // accepted only from the key of the rank it names.
  bool authenticated = false;
  // A sealed data plane (--data_cipher aes-gcm, security/data_seal.h): the
  // secret this server shares with each worker (index = rank), from which
  // each of its connections' keys come; every message then carries a seal
  // frame, and one that does not open is refused. Empty: not sealed (CURVE
  // or --insecure).
  std::vector<PairSecret> sealed;
  // When set: what the shard does goes into these metrics (they must
  // outlive the server).
  ServerMetrics* metrics = nullptr;
  // Marked with each worker whose valid request arrives (JobMember's, for
  // its heartbeats); null: none.
  std::shared_ptr<PeersHeard> peers_heard;
};

class PsServer {
 public:
  // `socket` is a bound ROUTER; it must outlive the server.
  static absl::StatusOr<std::unique_ptr<PsServer>> Create(PsServerOptions options,
                                                          zmq::socket_t* socket);

  // Serves until `should_stop` returns true (checked every ~50 ms) and
  // returns OK, or fails: a step timed out (naming the missing ranks) or the
  // socket broke. on_finished runs once, when the last step is done.
  absl::Status Serve(const std::function<bool()>& should_stop,
                     const std::function<void()>& on_finished);

  const ServerShardState& state() const { return state_; }
  // The medians of its steps by phase (ms): the arithmetic (decoding,
  // summing, the update, encoding the reply) and the whole step, from its
  // first push to its last reply. Call from the thread that runs Serve.
  std::string StepSummary() const { return step_parts_.Summary(); }
  // The workers' connections (routing ids) that have sent a valid request
  // (at most workers x connections).
  size_t connections_seen() const { return connections_seen_.size(); }
  // Whether state() is also the state after `step` steps: `step` is its
  // step, or one of the local steps (zero-one-adam's) it has skipped since
  // the last step it served, which leave the shard as it was.
  bool StateIsOfStep(uint64_t step) const;
  // Whether the job's last step is done here.
  bool finished() const { return end_step_ && state_.step >= *end_step_; }
  // A job without a fixed step count (job.steps 0): the workers have all
  // finished after `steps` steps. An error when this shard is not at that
  // step. Call from the thread that runs Serve (e.g. in should_stop).
  absl::Status SetEndStep(uint64_t steps);

 private:
  // Aggregation of one chunk for the current step. The chunks of a step
  // are those of its grid: the warm-up's (fp32/fp16 pushes) or the
  // compression phase's, coarser (DataPlaneJob::compressed_chunk_elems).
  struct Chunk {
    Range range;                                      // global
    float* acc = nullptr;                             // into acc_: the running mean, ranks
                                                      // [0, next_rank) added (null: none)
    uint32_t next_rank = 0;                           // next rank to decode-add
    std::vector<bool> pushed;                         // by rank, this step
    std::vector<std::optional<zmq::message_t>> held;  // payloads not yet added (MeanInPieces: all)
    std::vector<std::optional<float>> lr;             // by rank, this step: the lr of its push
    std::vector<bool> scale_pending;  // by rank, this step: waits for its GRAD_SCALE
    bool ready = false;               // every push is in; waits for the freeze decision
    bool done = false;                // this step's update applied and replied
    // The reply payload, reused once ZeroMQ has released every message over
    // it (fresh 4 MB buffers cost page faults on every step).
    std::shared_ptr<std::vector<uint8_t>> reply;
  };
  // A chunk of the warm-up grid as the messages about x and the state see
  // it (INIT, PULL, STATE_PULL, STATE_PUSH: fp32, whatever the step).
  struct Slice {
    Range range;                // global
    bool initialized = false;   // INIT received (needed before step 0 applies)
    std::vector<bool> pulled;   // by rank: asked for x this step (PULL)
    std::vector<bool> waiting;  // by rank: PULL before INIT, answered when it comes
    // STATE's payload and its arrays' names, built at the first STATE_PULL
    // of a step and shared by every answer until the slice's state changes
    // (INIT, the end of the step): however many a peer asks for, the
    // server holds one per slice.
    SharedBytes state;
    std::vector<const char*> state_arrays;
  };

  PsServer(PsServerOptions options, zmq::socket_t* socket);
  // Whether the pushes of a step in `phase` are kept whole and summed piece
  // by piece as the rule reads them (ServerOptimizer::MeansInPieces),
  // rather than added into acc as they come.
  bool MeanInPieces(Phase phase) const;
  void HandleMessage(std::vector<zmq::message_t>& frames);
  // Whether `h` is of an earlier incarnation's job id: then counted, said
  // once, and to be dropped unanswered.
  bool DroppedAsEarlier(const std::string& routing_id, const data::Header& h);
  // On an error, *why says which kind of refusal it is.
  absl::Status HandleRequest(const std::string& routing_id, const data::Header& h,
                             zmq::message_t& payload, Refusal* why);
  // The current step's chunks, and the one holding global element `begin`.
  std::vector<Chunk>& chunks() { return grids_[grid_]; }
  const std::vector<Chunk>& chunks() const { return grids_[grid_]; }
  Chunk& ChunkAt(uint64_t begin);
  // Whether every slice of c's range has had its INIT.
  bool Initialized(const Chunk& c) const;
  absl::Status DrainInOrder(Chunk& c, uint64_t chunk_index);
  void Complete(Chunk& c, uint64_t chunk_index);
  // Layer-wise optimizers: once every chunk is ready, the whole shard's step.
  void CompleteShard();
  // Sizes c's reply buffer for this step.
  void PrepareReply(Chunk& c, StepKind kind, bool last_warmup);
  void SendReply(Chunk& c, StepKind kind, bool last_warmup, uint64_t pushed_ns);
  float StepLr() const;
  // Whether the current step is the last warm-up step; nullopt while the
  // coordinator has not yet decided (--freeze auto).
  std::optional<bool> LastWarmup();
  void CompleteReady();
  void EndStep();
  // Moves past the steps that send nothing, and sets the push codec of the
  // step it stops at.
  void SkipLocalSteps();
  // The pushes of a complete chunk agree on the step's learning rate, and
  // with the chunks before them; else the step fails and nothing applies.
  absl::Status AgreeOnLr(const Chunk& c, uint64_t chunk_index);
  // PARAMS: slice c's x to worker `rank`, as of `step`, the step its PULL
  // named (the shard's, or one of the local steps it skipped).
  void SendParams(uint32_t rank, uint64_t step, const Slice& c);
  // STATE: slice c's x and optimizer state arrays, fp32, to `rank`.
  void SendState(uint32_t rank, uint64_t step, Slice& c);
  // STATE_PUSH: rank 0 seeds slice c's m or v (and the shard's bias_steps)
  // before the job's first step; answered with STATE_TAKEN.
  absl::Status SeedState(const data::Header& h, zmq::message_t& payload, Slice& c,
                         uint64_t slice_index, Refusal* why);
  // VOTE (shard 0): rank h.rank()'s overflow flag for the current step;
  // the last of the N answers every rank with the VERDICT.
  absl::Status TakeVote(const data::Header& h, Refusal* why);
  // GRAD_SCALE: rank h.rank()'s factor for its scale_pending pushes of the
  // step; the chunks waiting for it go on.
  absl::Status TakeGradScale(const data::Header& h, Refusal* why);
  // Rank `rank`'s GRAD_SCALE of the current step, once it has come.
  std::optional<float> GradScaleOf(uint32_t rank) const;
  // Sends `payload` (fp32 data of `range`) to `rank` as a message of `kind`
  // for `step`; `more` adds its own header fields.
  void SendFp32(data::Kind kind, uint32_t rank, uint64_t step, const Range& range,
                const SharedBytes& payload, const std::function<void(data::Header&)>& more);
  // `why`: the refusal it answers (counted in the metrics); none for a
  // failure that is not a request's (a step timeout).
  void SendError(const std::string& routing_id, const data::Header* request,
                 const std::string& error, std::optional<Refusal> why);
  // The routing id of `rank`'s connection that this shard's chunk at
  // `begin`, of a grid of `chunk_elems`, travels on (ChunkConnection).
  std::string ChunkPeer(uint32_t rank, uint64_t begin, uint64_t chunk_elems) const;
  // The bytes sent (routing id aside), or 0 when the peer could not take it.
  size_t Send(const std::string& routing_id, const data::Header& h, zmq::message_t* payload);
  std::string MissingRanks() const;

  PsServerOptions options_;
  zmq::socket_t* const socket_;
  std::unique_ptr<const Codec> init_codec_;  // fp32
  std::unique_ptr<const ServerOptimizer> optimizer_;
  ServerShardState state_;
  std::optional<absl::Time> waiting_since_;  // for a freeze decision
  uint64_t first_step_ = 0;                  // the step Serve began at (startup_timeout)
  std::vector<Slice> slices_;                // the warm-up grid
  // [0]: the warm-up grid's chunks; [1]: the compression phase's, where
  // its chunks are larger (else empty, and grid_ stays 0). grid_: the
  // current step's.
  std::vector<Chunk> grids_[2];
  size_t grid_ = 0;
  std::vector<float> acc_;    // the shard's running means: each chunk's acc is its part
  uint64_t chunks_done_ = 0;  // of chunks()
  std::optional<absl::Time> step_started_;         // first push of the current step
  std::optional<uint64_t> end_step_;               // the job's step count, once known
  bool step_lr_known_ = false;                     // the current step's lr has been agreed...
  std::optional<float> step_lr_;                   // ...as this (nullopt: the schedule's)
  std::optional<uint64_t> seeded_bias_steps_;      // the STATE_PUSHes' (all must agree)
  std::vector<std::optional<bool>> votes_;         // by rank: the current round's VOTEs
  std::vector<std::optional<float>> grad_scales_;  // by rank: this step's GRAD_SCALE
  std::vector<float> scaled_;  // a scale_pending push times its GRAD_SCALE, being summed
  bool reported_finished_ = false;
  uint64_t dropped_ = 0;  // messages of an earlier incarnation
  std::set<std::string> connections_seen_;
  // Sealed: each worker connection's seal, by routing id.
  std::map<std::string, std::unique_ptr<ConnectionSeal>> seals_;
  RefusalLog refusals_;
  uint64_t unsent_ = 0;           // replies dropped: the peer was gone or did not read
  absl::Status failure_;          // first fatal error, e.g. a decode failure of the update
  ServerMetrics* const metrics_;  // null: none
  uint64_t pending_pushes_ = 0;   // taken this step, their chunk not applied yet
  uint64_t apply_ns_ = 0;         // the current step's update time so far
  PhaseMedians step_parts_{{"arithmetic", "step"}};  // StepSummary
};

}  // namespace onebit

#endif  // ONEBIT_SERVER_PS_SERVER_H_
