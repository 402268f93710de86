// The pieces the algorithms' rules share (internal to optim/): errors that
// name the step and the parameter, error-feedback encoding, per-thread
// scratch, the warm-up's Adam step, and the layers of a shard.
#ifndef ONEBIT_OPTIM_STEP_PARTS_H_
#define ONEBIT_OPTIM_STEP_PARTS_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "compress/codec.h"
#include "optim/array_ops.h"
#include "optim/options.h"
#include "optim/state.h"

namespace onebit {

// Per-thread scratch of at least n floats (a chunk's decoded reply, a sync
// push, x before an fp16 warm-up step): the algorithms are shared and
// const, their callers' threads not. Valid until the thread's next call.
float* Scratch(size_t n);

// c = C(y), with error feedback e when `feedback` (y + e is encoded, e
// keeps the rest); without it e is left alone.
absl::Status EncodeMaybeWithFeedback(const Codec& codec, bool feedback, const float* y, float* e,
                                     size_t n, uint8_t* out);

// "<what> of step <step> is not finite at parameter <i> (<value>): training
// diverged; try <remedy>".
absl::Status NotFinite(const OptimizerOptions& o, absl::string_view what, uint64_t step,
                       uint64_t global_index, float value);
// A codec refused a vector that starts at global index `begin`.
absl::Status Diverged(const OptimizerOptions& o, absl::string_view what, uint64_t step,
                      uint64_t begin, const absl::Status& codec_error);
// NotFinite for the first non-finite x[i], i < n (x at global index `first`).
absl::Status CheckFinite(const OptimizerOptions& o, absl::string_view what, uint64_t step,
                         uint64_t first, const float* x, size_t n);

// A local step's gradient g[b, b + n) (in the memory of ops) is finite;
// else an error naming the step and the first bad element: a local step
// sends nothing, so without it a NaN would surface only at the next sync.
absl::Status CheckLocalGradient(const ArrayOps& ops, uint64_t step, const float* g, uint64_t b,
                                size_t n);

// Adam on the averaged gradient g of the shard-local elements [off, off +
// n) (g overwritten with Δ); x += Δ. Fails naming the first parameter whose
// x is not finite.
absl::Status AdamStepOnShard(const OptimizerOptions& o, uint64_t step, float lr, float* g,
                             uint64_t off, size_t n, ServerShardState* s);

// Sizes Adam's m and v to the shard, zero.
void SizeAdamMoments(ServerShardState* s);

// delta = -lr * (m / den + wd * x) and x += delta, for the delta reply.
void DeltaFromMomentum(const float* m, const float* den, float lr, float wd, size_t n, float* x,
                       float* delta);

// The pieces of the layers that overlap the elements [b, b + n), as
// [first, second) offsets from b, in order (a layer may start before b or
// end after b + n).
std::vector<std::pair<uint64_t, uint64_t>> LayerPieces(const std::vector<uint64_t>& ends,
                                                       uint64_t b, uint64_t n);

// The layers of the shard [begin, begin + n) (layer_ends as in
// OptimizerOptions), as shard-local [first, second) ranges; an error when a
// layer crosses either end of the shard (its map is not aligned to them).
absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> ShardLayers(
    const std::vector<uint64_t>& ends, uint64_t begin, uint64_t n);

}  // namespace onebit

#endif  // ONEBIT_OPTIM_STEP_PARTS_H_
