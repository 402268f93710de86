// The optimizers of onebit-ps in parameter-server form (docs/design.md §1): the
// arithmetic a server applies to its shard and a worker to its replica, chunk
// by chunk. Servers, workers and the single-process reference (reference.h)
// all call these, so a distributed run and the reference round the same way;
// compiled with -ffp-contract=off. Each algorithm is one file behind the
// registry (optim/registry.h); these classes are what the rest of the system
// holds.
//
// Phases: steps t < freeze_step are the warm-up (plain Adam, or SGD, in fp32
// both ways); from freeze_step on, the compression phase: pushes and replies
// go through the worker and server codecs with error feedback.
//
// ServerOptimizer and WorkerOptimizer are immutable and thread-safe; the
// state structs (optim/state.h) are plain values that can be saved and
// restored as they are.
#ifndef ONEBIT_OPTIM_OPTIMIZER_H_
#define ONEBIT_OPTIM_OPTIMIZER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "compress/codec.h"
#include "optim/array_ops.h"
#include "optim/options.h"
#include "optim/registry.h"
#include "optim/state.h"
#include "optim/zero_one_adam.h"

namespace onebit {

class Algorithm;

// Codecs and reply sizes, common to both sides.
class OptimizerCodecs {
 public:
  const OptimizerOptions& options() const;
  // What the algorithm is (its row in optim/registry.h).
  const AlgorithmTraits& traits() const;
  // fp32, whatever the job's codecs: what the hand-over sends m and v in.
  const Codec& fp32_codec() const;
  // What step `step` sends when the state is in `phase`: kFull in the
  // warm-up and kCompressed after it, except for zero-one-adam, whose
  // variance steps are kFull, its other steps before the freeze kCompressed,
  // and after the freeze its sync steps kCompressed, the rest kLocal.
  StepKind KindOf(uint64_t step, Phase phase) const;
  // What step `step` does with the shard that holds element b: KindOf,
  // except for diloco with fragments (--fragments), whose shards sync at
  // steps of their own; KindOf is then kCompressed if any shard syncs.
  StepKind KindAt(uint64_t step, Phase phase, uint64_t b) const;
  // The step at whose end a worker merges the replies of sync step `step`
  // (WorkerOptimizer::Merge): `step` itself, except for diloco with
  // --sync_delay, whose worker steps on while they travel.
  uint64_t MergeStep(uint64_t step) const;
  // The warm-up codec for kFull steps; the worker / server codec for
  // kCompressed ones.
  const Codec& push_codec(StepKind kind) const;
  const Codec& reply_codec(StepKind kind) const;
  // Payload bytes of the reply of n elements; the last warm-up step's reply
  // also carries m and v in fp32 for onebit-adam (the hand-over), and for
  // onebit-lamb m and v (momentum replies) or m alone (delta replies).
  size_t ReplyBytes(StepKind kind, size_t n, bool last_warmup) const;
  // The same for the chunk of global elements [b, b + n): onebit-lamb's
  // momentum replies after the freeze also carry, in fp32, the step's
  // ratio (c f) of each layer the chunk overlaps, in order.
  size_t ReplyBytes(StepKind kind, uint64_t b, size_t n, bool last_warmup) const;
  // The same for the optimizers whose kind follows the phase alone
  // (kWarmup: kFull, kCompress: kCompressed).
  const Codec& push_codec(Phase phase) const { return push_codec(KindOfPhase(phase)); }
  const Codec& reply_codec(Phase phase) const { return reply_codec(KindOfPhase(phase)); }
  size_t ReplyBytes(Phase phase, size_t n, bool last_warmup) const {
    return ReplyBytes(KindOfPhase(phase), n, last_warmup);
  }

 protected:
  explicit OptimizerCodecs(std::unique_ptr<const Algorithm> algorithm);
  ~OptimizerCodecs();
  static StepKind KindOfPhase(Phase phase) {
    return phase == Phase::kWarmup ? StepKind::kFull : StepKind::kCompressed;
  }

  std::unique_ptr<const Algorithm> algorithm_;  // immutable
};

class ServerOptimizer : public OptimizerCodecs {
 public:
  static absl::StatusOr<std::unique_ptr<ServerOptimizer>> Create(const OptimizerOptions& options);

  // Sizes the state to `size` elements, x zero (the initial x arrives from
  // worker 0). Optimizers without a warm-up start in the compression phase.
  void InitState(uint32_t shard, uint64_t begin, uint64_t size, ServerShardState* s) const;

  // Applies step `step` to the shard-local elements [off, off + n), given acc,
  // the mean of the decoded pushes (clobbered: used as scratch), and writes the
  // reply payload, ReplyBytes(PhaseOf(*s), n, last_warmup) bytes. The phase is
  // the state's. `last_warmup` marks the last warm-up step: onebit-adam then
  // freezes v for these elements and appends m and v to the reply. Elementwise,
  // so chunks may come in any order. Fails, naming the first bad element, when
  // the update is not finite.
  absl::Status Step(uint64_t step, bool last_warmup, float* acc, uint64_t off, size_t n,
                    ServerShardState* s, uint8_t* reply) const;
  // The same with the step's learning rate given (the workers' loop chose
  // it) instead of LearningRate(options(), step).
  absl::Status Step(uint64_t step, float lr, bool last_warmup, float* acc, uint64_t off, size_t n,
                    ServerShardState* s, uint8_t* reply) const;

  // Whether Step in `phase` is better given the pushes themselves
  // (StepFromPushes): its rule reads their mean piece by piece, and a server
  // that sums them into acc would write and read d floats more.
  bool MeansInPieces(Phase phase) const;
  // Step of a chunk whose mean is `pushes`' (bitwise as Step on the acc a
  // server sums them into), where MeansInPieces(PhaseOf(*s)). n is
  // pushes.n.
  absl::Status StepFromPushes(uint64_t step, float lr, bool last_warmup, const ChunkPushes& pushes,
                              uint64_t off, ServerShardState* s, uint8_t* reply) const;

  // Layer-wise optimizers (IsLayerwise) need every chunk of a step before
  // any is done: StepShard takes them all, in order, covering the shard, and
  // writes each chunk's reply (as Step would for it alone). The result does
  // not depend on how the shard is cut. Step is StepShard with one chunk for
  // them, so then it needs the whole shard (off 0, n its size). Other
  // optimizers step chunk by chunk.
  using ChunkSpan = onebit::ChunkSpan;
  absl::Status StepShard(uint64_t step, float lr, bool last_warmup,
                         const std::vector<ChunkSpan>& chunks, ServerShardState* s) const;

  // Called once every chunk of the last warm-up step is done: the shard is in
  // the compression phase from the next step on.
  void EnterCompression(ServerShardState* s) const;

 private:
  using OptimizerCodecs::OptimizerCodecs;
};

// A worker's rule, in two forms: on a WorkerState in host memory (CPU
// workers, the reference), and on WorkerView anywhere with the ArrayOps
// of their memory (GPU workers; optim/array_ops.h). The first is the second
// with HostArrayOps(), sizing the state's vectors as WorkerArraysIn says:
// the same arithmetic either way.
class WorkerOptimizer : public OptimizerCodecs {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerOptimizer>> Create(const OptimizerOptions& options);

  // Sizes the state to d parameters, x zero (the model initialises it).
  void InitState(uint64_t d, WorkerState* s) const;

  // The arrays a worker holds besides x in `phase`; `hand_over`: while
  // the replies of the last warm-up step are applied (den appears then
  // where the hand-over sends v).
  WorkerArraySet WorkerArraysIn(Phase phase, bool hand_over) const;

  // Once per step, before its pushes (or its local step), with the step's
  // learning rate; EndStep once after its last reply is applied (or after
  // LocalStep). zero-one-adam keeps the sum of learning rates there.
  void BeginStep(uint64_t step, float lr, WorkerState* s) const;
  void EndStep(uint64_t step, WorkerState* s) const;

  // The push of global elements [b, b + n) for `step`, from the gradient
  // g[b, b + n): push_codec(KindOf(step, PhaseOf(*s))).EncodedSize(n)
  // bytes into out. `lr`: the step's learning rate (a zero-one-adam sync
  // step takes its local step first). `held`: where given, the state's m̄
  // may be held there in part (optim/held_momentum.h; Push and Apply must
  // then both be given it, and m̄ in *s is whole only after held->Release).
  absl::Status Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n, WorkerState* s,
                    uint8_t* out, HeldMomentum* held = nullptr) const;
  absl::Status Push(uint64_t step, const float* g, uint64_t b, size_t n, WorkerState* s,
                    uint8_t* out) const {
    return Push(step, LearningRate(options(), step), g, b, n, s, out);
  }
  // A step that sends nothing (kLocal): the worker's own update of x[b, b +
  // n) from g[b, b + n).
  absl::Status LocalStep(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                         WorkerState* s) const;

  // Applies the server's reply for [b, b + n), ReplyBytes(PhaseOf(*s), n,
  // last_warmup) bytes (see ServerOptimizer::Step).
  absl::Status Apply(uint64_t step, bool last_warmup, const uint8_t* reply, uint64_t b, size_t n,
                     WorkerState* s) const;
  // The same with the step's learning rate given, as ServerOptimizer::Step.
  absl::Status Apply(uint64_t step, float lr, bool last_warmup, const uint8_t* reply, uint64_t b,
                     size_t n, WorkerState* s, HeldMomentum* held = nullptr) const;

  // At the end of MergeStep(pushed) where that is after `pushed`, with
  // every reply of sync step `pushed` for [b, b + n) applied: the local
  // model takes them (diloco with --sync_delay: the merge).
  absl::Status Merge(uint64_t pushed, uint64_t step, uint64_t b, size_t n, WorkerState* s) const;

  // Called once every reply of the last warm-up step has been applied.
  void EnterCompression(WorkerState* s) const;

  // The same rule on a state in the memory of `ops`, which holds the
  // arrays WorkerArraysIn names for its phase (and, for Apply, with
  // hand_over = last_warmup). g and Push's out are in that memory; Apply's
  // reply is on the host and in that memory (Payload).
  void BeginStep(uint64_t step, float lr, WorkerView* s) const;
  void EndStep(uint64_t step, WorkerView* s) const;
  absl::Status Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                    const ArrayOps& ops, WorkerView* s, uint8_t* out) const;
  absl::Status LocalStep(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                         const ArrayOps& ops, WorkerView* s) const;
  absl::Status Apply(uint64_t step, float lr, bool last_warmup, Payload reply, uint64_t b, size_t n,
                     const ArrayOps& ops, WorkerView* s) const;
  absl::Status Merge(uint64_t pushed, uint64_t step, uint64_t b, size_t n, const ArrayOps& ops,
                     WorkerView* s) const;
  // With the arrays of both phases held; afterwards the state needs only
  // WorkerArraysIn(Phase::kCompress, false).
  absl::Status EnterCompression(const ArrayOps& ops, WorkerView* s) const;

 private:
  using OptimizerCodecs::OptimizerCodecs;
};

}  // namespace onebit

#endif  // ONEBIT_OPTIM_OPTIMIZER_H_
