#include "optim/momentum_family.h"

#include <algorithm>
#include <cstring>

#include "optim/held_momentum.h"
#include "optim/step_parts.h"
#include "optim/update_kernels.h"

namespace onebit {

absl::Status MomentumFamily::WarmupUpdate(uint64_t step, float lr, float* d, uint64_t off, size_t n,
                                          ServerShardState* s) const {
  return AdamStepOnShard(o_, step, lr, d, off, n, s);
}

absl::Status MomentumFamily::MasterUpdate(uint64_t step, float lr, float* a, uint64_t off, size_t n,
                                          ServerShardState* s) const {
  (void)step;
  const float* den = traits_.den_of_frozen_v ? s->den.data() + off : nullptr;
  float* x = s->x.data() + off;
  ForEachRangeSetting(o_, s->begin + off, n, [&](size_t p, size_t m, float wd, float ls) {
    DeltaFromMomentum(a + p, den == nullptr ? nullptr : den + p, lr * ls, wd, m, x + p, a + p);
  });
  return absl::OkStatus();
}

absl::Status MomentumFamily::Step(uint64_t step, float lr, bool last_warmup, float* acc,
                                  uint64_t off, size_t n, ServerShardState* s,
                                  uint8_t* reply) const {
  if (!s->frozen) {
    return WarmupStep(
        step, lr, last_warmup, [acc](size_t p, size_t) { return acc + p; }, off, n, s, reply);
  }
  // Compression phase: acc is the mean of the decoded pushes, a.
  const Codec& codec = *server_codec_;
  absl::Status st;
  if (o_.reply == ReplyMode::kDelta) {
    // Replicas equal the master until the first delta reply: mirror them
    // from here (before any chunk of this step has moved the master).
    if (s->replica.size() != s->x.size()) s->replica = s->x;
    // The exact update on the master; reply C(Δ + e_s).
    if (st = MasterUpdate(step, lr, acc, off, n, s); !st.ok()) return st;
    st = EncodeMaybeWithFeedback(codec, o_.server_error_feedback, acc, s->e.data() + off, n, reply);
    if (!st.ok()) return Diverged(o_, "the update", step, s->begin + off, st);
    return codec.DecodeAdd(reply, n, 1.0f, s->replica.data() + off);
  }
  return MomentumReply(step, lr, acc, std::nullopt, off, n, s, reply);
}

absl::Status MomentumFamily::WarmupStep(uint64_t step, float lr, bool last_warmup,
                                        absl::FunctionRef<float*(size_t p, size_t m)> mean,
                                        uint64_t off, size_t n, ServerShardState* s,
                                        uint8_t* reply) const {
  float* x = s->x.data() + off;
  // Warm-up: the reply is Δ itself. Update and encode piece by piece, so Δ
  // is still in L2 when it is copied out (fp32 and fp16 encode element by
  // element: the pieces' encodings concatenate).
  const Codec& codec = *warmup_codec_;
  const bool exact = codec.kind() == CodecKind::kFp32;
  float* before = exact ? nullptr : Scratch(std::min(kWarmupPiece, n));
  for (size_t p = 0; p < n; p += kWarmupPiece) {
    const size_t m = std::min(kWarmupPiece, n - p);
    float* d = mean(p, m);
    // fp16: the master takes the rounded Δ the workers take.
    if (!exact) std::copy(x + p, x + p + m, before);
    if (absl::Status st = WarmupUpdate(step, lr, d, off + p, m, s); !st.ok()) return st;
    uint8_t* out = reply + codec.EncodedSize(p);
    absl::Status st = codec.Encode(d, m, out);
    if (!st.ok()) return Diverged(o_, "the update", step, s->begin + off + p, st);
    if (!exact) {
      std::copy(before, before + m, x + p);
      if (st = codec.DecodeAdd(out, m, 1.0f, x + p); !st.ok()) return st;
    }
  }
  if (!last_warmup || !traits_.den_of_frozen_v) return absl::OkStatus();
  // The hand-over (docs/design.md §1.1): freeze v, floored, and send m and v.
  float* v = s->v.data() + off;
  s->den.resize(s->x.size());
  // With bias correction the frozen v is the corrected one, v / (1 - b2^t),
  // divided by the same float the step itself used.
  const float k2 = MakeAdamCoefficients(o_.beta1, o_.beta2, o_.eps, o_.weight_decay, lr,
                                        o_.bias_correction, s->bias_steps + step)
                       .k2;
  for (size_t i = 0; i < n; ++i) {
    if (o_.bias_correction) v[i] = v[i] / k2;
    if (v[i] < o_.v_floor) {
      v[i] = o_.v_floor;
      ++s->floored;
    }
    s->den[off + i] = FrozenDenominator(v[i], o_.eps);
  }
  uint8_t* tail = reply + codec.EncodedSize(n);
  std::memcpy(tail, s->m.data() + off, 4 * n);
  std::memcpy(tail + 4 * n, v, 4 * n);
  return absl::OkStatus();
}

bool MomentumFamily::MeansInPieces(Phase phase) const {
  return phase == Phase::kWarmup || o_.reply == ReplyMode::kMomentum;
}

absl::Status MomentumFamily::StepFromPushes(uint64_t step, float lr, bool last_warmup,
                                            const ChunkPushes& pushes, uint64_t off,
                                            ServerShardState* s, uint8_t* reply) const {
  // The mean, piece by piece, into one buffer: never written whole. (The
  // warm-up's update overwrites it with Δ.)
  thread_local std::vector<float> piece;
  auto mean = [&](size_t b, size_t e) {
    piece.resize(std::max(piece.size(), e - b));
    pushes.Mean(b, e, piece.data());
    return piece.data();
  };
  if (!s->frozen && kWarmupPiece % pushes.codec->piece_elems() == 0) {
    return WarmupStep(
        step, lr, last_warmup, [&](size_t p, size_t m) { return mean(p, p + m); }, off, pushes.n, s,
        reply);
  }
  if (s->frozen && MeansInPieces(Phase::kCompress) &&
      server_codec_->piece_elems() % pushes.codec->piece_elems() == 0) {
    return MomentumReply(
        step, lr, nullptr, [&](size_t b, size_t e) -> const float* { return mean(b, e); }, off,
        pushes.n, s, reply);
  }
  return Algorithm::StepFromPushes(step, lr, last_warmup, pushes, off, s, reply);
}

absl::Status MomentumFamily::MomentumReply(
    uint64_t step, float lr, const float* a,
    std::optional<absl::FunctionRef<const float*(size_t, size_t)>> a_pieces, uint64_t off, size_t n,
    ServerShardState* s, uint8_t* reply) const {
  // Momentum reply: c_s = C(a + e_s); m̄ = D(c_s); x -= lr (m̄ / den + wd x),
  // piece by piece: each piece of m̄ steps x while in cache.
  const Codec& codec = *server_codec_;
  float* x = s->x.data() + off;
  const float* den = traits_.den_of_frozen_v ? s->den.data() + off : nullptr;
  absl::Status stepped;
  auto step_x = [&](size_t b, size_t end, const float* mbar) {
    ForEachRangeSetting(o_, s->begin + off + b, end - b,
                        [&](size_t p, size_t m, float wd, float ls) {
                          ApplyMomentum(mbar + p, den == nullptr ? nullptr : den + b + p, lr * ls,
                                        wd, m, x + b + p);
                        });
    stepped = CheckFinite(o_, "the update", step, s->begin + off + b, x + b, end - b);
    return stepped;
  };
  absl::Status st = codec.EncodeInPieces(a, o_.server_error_feedback ? s->e.data() + off : nullptr,
                                         n, reply, {std::nullopt, step_x, a_pieces});
  if (!stepped.ok()) return stepped;
  if (!st.ok()) return Diverged(o_, "the averaged momentum", step, s->begin + off, st);
  return absl::OkStatus();
}

absl::Status MomentumFamily::Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                                  const ArrayOps& ops, WorkerView* s, uint8_t* out) const {
  (void)lr;
  if (KindOf(step, PhaseOf(*s)) == StepKind::kFull) {
    return ops.Encode(*warmup_codec_, g + b, nullptr, n, out);
  }
  const float* y = g + b;
  float* e = o_.worker_error_feedback ? s->e + b : nullptr;
  if (traits_.worker_momentum) {
    if (s->held != nullptr && o_.reply == ReplyMode::kMomentum) {
      // m̄ held as the last reply: m_i from it piece by piece, and not
      // written (the reply replaces it).
      const HeldMomentum::Range* h = s->held->Find(b, n);
      if (h != nullptr && worker_codec_->piece_elems() % h->codec->piece_elems() == 0) {
        return ops.UpdateHeldMomentumAndEncode(*h->codec, h->payload.data(), *worker_codec_, y,
                                               o_.beta1, 1.0f - o_.beta1, n, e, out);
      }
      s->held->Release(s->mbar);  // another grid than the replies': m̄ dense again
    }
    // m_i = b1 m̄ + (1 - b1) g_i, kept in m̄ (a momentum reply overwrites it;
    // a delta reply leaves the worker its own momentum), and encoded in the
    // same pass.
    return ops.UpdateMomentumAndEncode(*worker_codec_, y, o_.beta1, 1.0f - o_.beta1, n, s->mbar + b,
                                       e, out);
  }
  return ops.Encode(*worker_codec_, y, e, n, out);
}

absl::Status MomentumFamily::ApplyWarmup(bool hand_over, Payload reply, uint64_t b, size_t n,
                                         const ArrayOps& ops, WorkerView* s) const {
  // x += Δ: the same fp32 addition the server applied to its master.
  float* x = s->x + b;
  const Codec& codec = *warmup_codec_;
  if (!hand_over) return ops.DecodeAdd(codec, reply, n, x);
  // The hand-over: Δ, then m and v. Everything is checked, on the host,
  // before anything changes, so a bad reply leaves the state as it was.
  const Payload m = reply.At(codec.EncodedSize(n));
  const Payload v = m.At(4 * n);
  absl::Status st = codec.CheckPayload(reply.host, n);
  if (st.ok()) st = fp32_->CheckPayload(m.host, n);
  if (st.ok()) st = fp32_->CheckPayload(v.host, n);
  if (st.ok()) st = CheckHandOverMoments(v.host, n, b);
  if (!st.ok()) return st;
  float* den = s->den + b;
  st = ops.DecodeAdd(codec, reply, n, x);
  if (st.ok()) st = ops.Decode(*fp32_, m, n, s->mbar + b);
  if (st.ok()) st = ops.Decode(*fp32_, v, n, den);
  if (st.ok()) st = ops.FrozenDenominators(den, o_.eps, n, den);
  return st;
}

absl::Status MomentumFamily::ApplyMomentumRanges(float lr, const float* mbar, const float* den,
                                                 uint64_t b, size_t n, const ArrayOps& ops,
                                                 WorkerView* s) const {
  float* x = s->x + b;
  absl::Status st;
  ForEachRangeSetting(o_, b, n, [&](size_t p, size_t m, float wd, float ls) {
    if (!st.ok()) return;
    st = ops.ApplyMomentum(mbar + p, den == nullptr ? nullptr : den + p, lr * ls, wd, m, x + p);
  });
  return st;
}

absl::Status MomentumFamily::Apply(uint64_t step, float lr, bool last_warmup, Payload reply,
                                   uint64_t b, size_t n, const ArrayOps& ops, WorkerView* s) const {
  (void)step;
  if (!s->frozen) {
    return ApplyWarmup(last_warmup && traits_.den_of_frozen_v, reply, b, n, ops, s);
  }
  const Codec& codec = *server_codec_;
  if (o_.reply == ReplyMode::kDelta) return ops.DecodeAdd(codec, reply, n, s->x + b);
  // m̄ = D(c_s), and x stepped from each piece of it while in cache.
  const float* den = traits_.den_of_frozen_v ? s->den + b : nullptr;
  if (s->held != nullptr) {
    // m̄ kept as c_s itself (HeldMomentum): decoded pieces step x, and
    // nothing writes m̄.
    absl::Status st =
        ops.DecodePiecesThen(codec, reply, n, [&](size_t p, size_t q, const float* d) {
          return ApplyMomentumRanges(lr, d, den == nullptr ? nullptr : den + p, b + p, q - p, ops,
                                     s);
        });
    if (st.ok()) s->held->Hold(codec, b, n, reply.host);
    return st;
  }
  return ops.DecodeThen(codec, reply, n, s->mbar + b, [&](size_t p, size_t q) {
    return ApplyMomentumRanges(lr, s->mbar + b + p, den == nullptr ? nullptr : den + p, b + p,
                               q - p, ops, s);
  });
}

}  // namespace onebit
