// The rules shared by the algorithms that warm up in full precision and then
// compress momenta (or, without a warm-up, compress from the start): sgd and
// adam (a warm-up that never ends), onebit-adam, naive-onebit-adam and
// ef-sgd, and the worker side of onebit-lamb (docs/design.md §1.1-§1.4).
// Each of those files says only where it differs, through the hooks below.
// Internal to optim/; thread-safety as Algorithm's.
#ifndef ONEBIT_OPTIM_MOMENTUM_FAMILY_H_
#define ONEBIT_OPTIM_MOMENTUM_FAMILY_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "optim/algorithm.h"

namespace onebit {

class MomentumFamily : public Algorithm {
 public:
  // Warm-up: Δ from the mean gradient (WarmupUpdate), replied in the warm-up
  // codec, and at the last warm-up step the hand-over when den_of_frozen_v.
  // Compression: a momentum reply C(a + e_s), which master and replicas
  // apply alike, or a delta reply C(Δ + e_s) of the master's exact update
  // (MasterUpdate).
  absl::Status Step(uint64_t step, float lr, bool last_warmup, float* acc, uint64_t off, size_t n,
                    ServerShardState* s, uint8_t* reply) const override;
  // A momentum reply's step reads the mean once, piece by piece.
  bool MeansInPieces(Phase phase) const override;
  absl::Status StepFromPushes(uint64_t step, float lr, bool last_warmup, const ChunkPushes& pushes,
                              uint64_t off, ServerShardState* s, uint8_t* reply) const override;

  // The gradient itself in the warm-up; after it the momentum m̄ = b1 m̄ +
  // (1 - b1) g when worker_momentum, else the gradient, through the worker
  // codec with error feedback.
  absl::Status Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                    const ArrayOps& ops, WorkerView* s, uint8_t* out) const override;
  absl::Status Apply(uint64_t step, float lr, bool last_warmup, Payload reply, uint64_t b, size_t n,
                     const ArrayOps& ops, WorkerView* s) const override;

 protected:
  using Algorithm::Algorithm;

  // The warm-up's update of the shard-local elements [off, off + n) from
  // the mean gradient d, which it overwrites with Δ; x += Δ. Adam by default.
  virtual absl::Status WarmupUpdate(uint64_t step, float lr, float* d, uint64_t off, size_t n,
                                    ServerShardState* s) const;
  // A delta reply's exact update of the master from the mean a of the
  // pushes, which it overwrites with Δ; x += Δ. By default the momentum step
  // -lr (a / den + wd x), den null where the algorithm has none.
  virtual absl::Status MasterUpdate(uint64_t step, float lr, float* a, uint64_t off, size_t n,
                                    ServerShardState* s) const;
  // The warm-up's reply applied by a worker: x += Δ, and with `hand_over`
  // the m and v that follow Δ (the last warm-up step): m̄ = m, and den from
  // v. All or nothing: a bad reply changes nothing.
  absl::Status ApplyWarmup(bool hand_over, Payload reply, uint64_t b, size_t n, const ArrayOps& ops,
                           WorkerView* s) const;
  // The warm-up's elements per piece: Δ still in L2 when it is encoded.
  static constexpr size_t kWarmupPiece = 16384;
  // The warm-up's step (Δ replied, and with last_warmup the hand-over),
  // piece by piece: mean(p, m) gives the mean of the pushes over [p, p + m)
  // in floats the update may overwrite with Δ.
  absl::Status WarmupStep(uint64_t step, float lr, bool last_warmup,
                          absl::FunctionRef<float*(size_t p, size_t m)> mean, uint64_t off,
                          size_t n, ServerShardState* s, uint8_t* reply) const;
  // The compression phase's momentum reply from the mean of the pushes:
  // a[0, n), or where a is null a_pieces(b, e) giving a[b, e) piece by
  // piece (Codec::PieceHooks::source).
  absl::Status MomentumReply(
      uint64_t step, float lr, const float* a,
      std::optional<absl::FunctionRef<const float*(size_t, size_t)>> a_pieces, uint64_t off,
      size_t n, ServerShardState* s, uint8_t* reply) const;
  // x += -lr (m̄ / den + wd x) over [b, b + n), m̄ and den (null where the
  // algorithm has none) from their element b, each weight-decay range with
  // its own wd.
  absl::Status ApplyMomentumRanges(float lr, const float* mbar, const float* den, uint64_t b,
                                   size_t n, const ArrayOps& ops, WorkerView* s) const;
};

}  // namespace onebit

#endif  // ONEBIT_OPTIM_MOMENTUM_FAMILY_H_
