// The state an optimizer keeps: a server's master copy of its shard and a
// worker's replica. Plain values (vectors and counters) that can be saved
// and restored as they are; every algorithm uses the fields its row in
// optim/registry.h names, and leaves the others empty.
#ifndef ONEBIT_OPTIM_STATE_H_
#define ONEBIT_OPTIM_STATE_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "compress/codec.h"
#include "optim/options.h"

namespace onebit {

class HeldMomentum;

// The master copy of one shard and its optimizer state.
struct ServerShardState {
  uint32_t shard = 0;
  uint64_t begin = 0;  // global index of x[0]
  uint64_t step = 0;   // completed steps
  // Adam steps taken before this job by a state it was seeded with
  // (data::STATE_PUSH): bias correction counts t from bias_steps + step.
  uint64_t bias_steps = 0;
  std::vector<float> x;
  std::vector<float> m;        // Adam first moment (warm-up; naive: always)
  std::vector<float> v;        // Adam second moment; after the freeze, the floored v
  std::vector<float> den;      // after the freeze (onebit-adam): sqrt(v) + eps
  std::vector<float> e;        // server error feedback (compression phase)
  bool frozen = false;         // in the compression phase
  uint64_t floored = 0;        // coordinates the v floor raised at the freeze
  std::vector<float> v_check;  // automatic freeze: v at the previous check
  // --server-reply delta: the workers' replica of this shard, x0 + sum D(c_s),
  // kept to report how far replicas trail the master.
  std::vector<float> replica;
  // zero-one-adam keeps m and v (m dropped, v frozen after the freeze),
  // den = sqrt(max(v, v_floor)) + eps refreshed with v, and e from the
  // start: its first phase compresses gradients too.
  //
  // onebit-lamb keeps m (the averaged momentum of the previous step) and v
  // after the freeze too: v is then the second moment of the gradients
  // reconstructed from m, den the frozen one. Per layer of the shard, in
  // order: the averaged trust ratio (frozen at the freeze) and the last
  // step's factor on it.
  std::vector<float> lamb_coeff;
  std::vector<float> lamb_factor;
  // The shard-local [first, second) of each of those layers (ShardLayers):
  // a checkpoint places their values by global position, so that they
  // restore onto another number of shards.
  std::vector<std::pair<uint64_t, uint64_t>> layers;
};

// The replica a worker trains, and its state.
struct WorkerState {
  std::vector<float> x;
  std::vector<float> mbar;  // synchronized (or, delta mode, local) momentum
  std::vector<float> e;     // worker error feedback
  std::vector<float> den;   // sqrt(frozen v) + eps, from the hand-over
  bool frozen = false;
  // zero-one-adam: mbar is the worker's own m (equal on every worker before
  // the freeze); v its own second moment until the freeze; den refreshed
  // with v. After the freeze x is the local model the worker trains,
  // x_sync the replica as of the last synchronisation (equal to the
  // master), lrs the sum of the learning rates since then. (Which step
  // refreshes v or synchronises is a function of the step number alone.)
  std::vector<float> v;
  std::vector<float> x_sync;
  float lrs = 0.0f;
};

// Which of WorkerState's arrays a worker holds besides x (d floats each).
struct WorkerArraySet {
  bool mbar = false;
  bool e = false;
  bool den = false;
  bool v = false;
  bool x_sync = false;
};

// A worker's state as its rule sees it (optim/algorithm.h), wherever it
// lives: WorkerState's arrays, d floats each, in the memory of the
// ArrayOps the rule is given (optim/array_ops.h), nullptr where the state
// does not hold one; and its scalars, which the rule updates here.
struct WorkerView {
  uint64_t d = 0;
  float* x = nullptr;
  float* mbar = nullptr;
  float* e = nullptr;
  float* den = nullptr;
  float* v = nullptr;
  float* x_sync = nullptr;
  bool frozen = false;
  float lrs = 0.0f;
  // Where given (a CPU replica's), the rule may hold parts of m̄ as the
  // replies they came in rather than in mbar: optim/held_momentum.h.
  HeldMomentum* held = nullptr;
};

// Whether a saved state fits d parameters under `o`: x and the arrays its
// algorithm's worker holds in the state's phase (Algorithm::WorkerArraysIn)
// of d floats, the others empty. The error names each array that is
// missing or of another size.
absl::Status CheckWorkerStateFits(const OptimizerOptions& o, uint64_t d, const WorkerState& s);

inline Phase PhaseOf(const ServerShardState& s) {
  return s.frozen ? Phase::kCompress : Phase::kWarmup;
}
inline Phase PhaseOf(const WorkerState& s) { return s.frozen ? Phase::kCompress : Phase::kWarmup; }
inline Phase PhaseOf(const WorkerView& s) { return s.frozen ? Phase::kCompress : Phase::kWarmup; }

// A chunk of a server's step: its shard-local elements [off, off + n), the
// mean of the workers' decoded pushes for them, and where its reply goes.
struct ChunkSpan {
  uint64_t off = 0;  // shard-local
  size_t n = 0;
  float* acc = nullptr;  // the mean of the decoded pushes (clobbered)
  uint8_t* reply = nullptr;
};

// A chunk's pushes, one payload per worker, not yet summed: for a server
// rule that reads their mean piece by piece (Algorithm::MeansInPieces), so
// that the mean is never written to memory and read back.
struct ChunkPushes {
  const Codec* codec = nullptr;
  size_t n = 0;                          // elements of each payload
  std::vector<const uint8_t*> payloads;  // by rank; each accepted by CheckPayload
  float w = 0.0f;                        // 1 / workers
  // out[0, e - b) = the mean over [b, e): +0 + w D_0 + w D_1 + ... in rank
  // order, bit for bit what a server that adds each push as it comes holds
  // (DecodeScaled, then DecodeAdd). b a multiple of codec->piece_elems().
  void Mean(size_t b, size_t e, float* out) const;
};

// A worker's side of the hand-over (docs/design.md §1.1): den[i] =
// FrozenDenominator(v[i], eps) for the second moments the server sent for
// parameters [first, first + n). A negative or NaN v is an error naming the
// parameter, and then den is untouched. den may be v.
absl::Status HandOverDenominators(const float* v, size_t n, uint64_t first, float eps, float* den);
// HandOverDenominators' check alone, of n floats as they arrived (any
// alignment), for a worker that computes den elsewhere.
absl::Status CheckHandOverMoments(const uint8_t* v, size_t n, uint64_t first);

}  // namespace onebit

#endif  // ONEBIT_OPTIM_STATE_H_
