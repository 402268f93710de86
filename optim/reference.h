// The single-process reference of docs/design.md §1.5: N workers and S server
// shards in one process, no network, the same optimizer code. A distributed
// run fed the same gradients must end with the same x, bit for bit.
#ifndef ONEBIT_OPTIM_REFERENCE_H_
#define ONEBIT_OPTIM_REFERENCE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "optim/optimizer.h"
#include "shard/shard_map.h"

namespace onebit {

struct ReferenceOptions {
  uint32_t workers = 1;
  // K > 1: worker r's gradient is the mean (MeanInOrder) of those of ranks
  // r * K .. r * K + K - 1, its local ranks (--local_ranks); its loss theirs
  // averaged.
  uint32_t local_ranks = 1;
  ShardMap map = ShardMap::Create(0, 1, 32).value();
  uint64_t steps = 0;
  OptimizerOptions optimizer;
  FreezeOptions freeze;
};

// g[0, d) = the gradient of worker `rank` at x for `step`; returns the loss.
using GradientFn =
    std::function<absl::StatusOr<double>(const float* x, uint32_t rank, uint64_t step, float* g)>;

struct ReferenceResult {
  std::vector<WorkerState> workers;       // final state of every worker
  std::vector<ServerShardState> servers;  // final state of every shard
  std::vector<double> losses;             // per step, mean over workers
  uint64_t freeze_step = kNever;          // first compression step
  std::vector<uint64_t> push_bytes;       // per step, payload bytes, all workers
  std::vector<uint64_t> reply_bytes;      // per step, payload bytes, all workers
  uint64_t rounds = 0;                    // steps that communicated (zero-one-adam: fewer)
};

// What RunReference holds (x0, and every worker's and every shard's state)
// and its caller must allocate first: check it (util/memory.h) before
// building the model and x0.
StateSize ReferenceSize(const ReferenceOptions& options);

// Runs the job from the initial parameters x0; refuses, before allocating,
// a job whose ReferenceSize does not fit in memory. A shard is one vector here;
// the distributed run cuts it into block-aligned chunks, which encode to the
// same blocks, so the arithmetic is the same.
absl::StatusOr<ReferenceResult> RunReference(const ReferenceOptions& options,
                                             const std::vector<float>& x0,
                                             const GradientFn& gradient);

// The automatic freeze rule, shared with the coordinator: after `completed`
// steps (a multiple of the window), given every shard's VarianceChange, the
// first compression step, or kNever while v is still moving and the
// freeze would still come before freeze.latest.
uint64_t AutoFreezeStep(const FreezeOptions& freeze, uint64_t completed,
                        const std::vector<double>& changes);

}  // namespace onebit

#endif  // ONEBIT_OPTIM_REFERENCE_H_
