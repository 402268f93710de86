// One optimizer in parameter-server form: its server rule (what a server
// does with the mean of the workers' pushes for its shard) and its worker rule
// (what a worker pushes and how it applies the reply), for both phases
// (docs/design.md §1). Each algorithm is a subclass in a file of its own,
// made through its row in optim/registry.h; servers, workers and the
// reference reach it through ServerOptimizer and WorkerOptimizer
// (optim/optimizer.h), whose contracts these calls share.
//
// Immutable once made, so thread-safe; the states it updates are the
// caller's, one thread at a time per state.
#ifndef ONEBIT_OPTIM_ALGORITHM_H_
#define ONEBIT_OPTIM_ALGORITHM_H_

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

namespace onebit {

class Algorithm {
 public:
  virtual ~Algorithm() = default;
  Algorithm(const Algorithm&) = delete;
  Algorithm& operator=(const Algorithm&) = delete;

  const AlgorithmTraits& traits() const { return traits_; }
  const OptimizerOptions& options() const { return o_; }
  const Codec& fp32_codec() const { return *fp32_; }
  // The warm-up codec for kFull steps; the worker / server codec for
  // kCompressed ones.
  const Codec& push_codec(StepKind kind) const {
    return kind == StepKind::kFull ? *warmup_codec_ : *worker_codec_;
  }
  const Codec& reply_codec(StepKind kind) const {
    return kind == StepKind::kFull ? *warmup_codec_ : *server_codec_;
  }

  // What step `step` sends when the state is in `phase`; by default kFull
  // in the warm-up and kCompressed after it.
  virtual StepKind KindOf(uint64_t step, Phase phase) const {
    (void)step;
    return phase == Phase::kWarmup ? StepKind::kFull : StepKind::kCompressed;
  }
  // What step `step` does with the shard that holds element b: by default
  // KindOf. diloco's fragments sync shard by shard; its KindOf is then what
  // the step sends anywhere (kCompressed if any shard syncs).
  virtual StepKind KindAt(uint64_t step, Phase phase, uint64_t b) const {
    (void)b;
    return KindOf(step, phase);
  }
  // The step at whose end the worker merges the replies of sync step
  // `step` into its local model (Merge); by default `step` itself. Between
  // the two the worker takes that shard's steps as local steps and may
  // Apply the replies whenever they arrive.
  virtual uint64_t MergeStep(uint64_t step) const { return step; }
  // Payload bytes of the reply of n elements; by default the reply codec's
  // (none for kLocal), and at the last warm-up step m and v in fp32 after
  // it when den_of_frozen_v (the hand-over).
  virtual size_t ReplyBytes(StepKind kind, size_t n, bool last_warmup) const;
  // The same for the chunk of global elements [b, b + n); by default as
  // ReplyBytes.
  virtual size_t ChunkReplyBytes(StepKind kind, uint64_t b, size_t n, bool last_warmup) const {
    (void)b;
    return ReplyBytes(kind, n, last_warmup);
  }

  // --- The server's rule (ServerOptimizer has the contracts) ---
  // Sizes the arrays of its own (m and v for the Adam family) in a state
  // whose x is sized; by default none.
  virtual void InitServer(ServerShardState* s) const { (void)s; }
  // Enters the compression phase: the base sets frozen, zeroes e and drops
  // the freeze check's v; subclasses add theirs after calling it.
  virtual void EnterCompression(ServerShardState* s) const;
  virtual absl::Status Step(uint64_t step, float lr, bool last_warmup, float* acc, uint64_t off,
                            size_t n, ServerShardState* s, uint8_t* reply) const = 0;
  // Whether Step in `phase` reads the mean of the pushes piece by piece
  // (StepFromPushes) rather than from acc; by default not.
  virtual bool MeansInPieces(Phase phase) const {
    (void)phase;
    return false;
  }
  // Step with the pushes not yet summed, where MeansInPieces.
  virtual absl::Status StepFromPushes(uint64_t step, float lr, bool last_warmup,
                                      const ChunkPushes& pushes, uint64_t off, ServerShardState* s,
                                      uint8_t* reply) const;
  // By default Step for each chunk in turn.
  virtual absl::Status StepShard(uint64_t step, float lr, bool last_warmup,
                                 const std::vector<ChunkSpan>& chunks, ServerShardState* s) const;

  // --- The worker's rule (WorkerOptimizer has the contracts) ---
  // Written once against ArrayOps, so CPU workers run it on host memory and
  // GPU workers on the device's (optim/array_ops.h).
  //
  // The arrays a worker holds in `phase`; `hand_over`: while the last
  // warm-up step's replies are applied. By default m̄ and e for the
  // compressing algorithms, and den after the hand-over when
  // den_of_frozen_v.
  virtual WorkerArraySet WorkerArraysIn(Phase phase, bool hand_over) const;
  // Enters the compression phase, on a state that holds the arrays of both
  // phases: by default sets frozen; subclasses add theirs after calling it.
  virtual absl::Status EnterCompression(const ArrayOps& ops, WorkerView* s) const {
    (void)ops;
    s->frozen = true;
    return absl::OkStatus();
  }
  virtual void BeginStep(uint64_t step, float lr, WorkerView* s) const {
    (void)step, (void)lr, (void)s;
  }
  virtual void EndStep(uint64_t step, WorkerView* s) const { (void)step, (void)s; }
  // `out`: in the memory of ops.
  virtual absl::Status Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                            const ArrayOps& ops, WorkerView* s, uint8_t* out) const = 0;
  // By default an error: only algorithms with kLocal steps have local steps.
  virtual absl::Status LocalStep(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                                 const ArrayOps& ops, WorkerView* s) const;
  virtual absl::Status Apply(uint64_t step, float lr, bool last_warmup, Payload reply, uint64_t b,
                             size_t n, const ArrayOps& ops, WorkerView* s) const = 0;
  // At the end of MergeStep(pushed), where that is a later step, once Apply
  // has taken every reply of sync step `pushed` for [b, b + n) (Apply does
  // all of a sync merged at its own step); by default nothing.
  virtual absl::Status Merge(uint64_t pushed, uint64_t step, uint64_t b, size_t n,
                             const ArrayOps& ops, WorkerView* s) const {
    (void)pushed, (void)step, (void)b, (void)n, (void)ops, (void)s;
    return absl::OkStatus();
  }

 protected:
  Algorithm(const AlgorithmTraits& traits, const OptimizerOptions& o) : traits_(traits), o_(o) {}

  const AlgorithmTraits& traits_;
  const OptimizerOptions o_;
  std::unique_ptr<const Codec> fp32_, warmup_codec_, worker_codec_, server_codec_;

 private:
  friend absl::StatusOr<std::unique_ptr<const Algorithm>> NewAlgorithm(const OptimizerOptions& o);
};

// A registry row's `make` for the algorithm class T.
template <typename T>
std::unique_ptr<Algorithm> MakeAlgorithm(const AlgorithmTraits& traits, const OptimizerOptions& o) {
  return std::make_unique<T>(traits, o);
}

// Validates `o` (ValidateOptimizerOptions) and makes the algorithm o.kind
// names, with its codecs.
absl::StatusOr<std::unique_ptr<const Algorithm>> NewAlgorithm(const OptimizerOptions& o);

}  // namespace onebit

#endif  // ONEBIT_OPTIM_ALGORITHM_H_
