// onebit-lamb, 1-bit LAMB (docs/design.md §1.7): LAMB in fp32 for the warm-up,
// each layer's step scaled by its trust ratio, whose running average is
// frozen with v; after the freeze every worker pushes its 1-bit momentum as
// onebit-adam's do, and each layer steps by its frozen ratio times a factor
// measured from how far v has moved since. Steps whole shards, aligned to
// the layers.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "optim/algorithms.h"
#include "optim/momentum_family.h"
#include "optim/step_parts.h"
#include "optim/update_kernels.h"

namespace onebit {
namespace {

// The worker side pushes as onebit-adam's; the server side and the replies
// are its own.
class OnebitLamb final : public MomentumFamily {
 public:
  OnebitLamb(const AlgorithmTraits& t, const OptimizerOptions& o) : MomentumFamily(t, o) {}

  // The last warm-up step's reply also carries m and v in fp32 (momentum
  // replies) or m alone (delta replies).
  size_t ReplyBytes(StepKind kind, size_t n, bool last_warmup) const override {
    size_t bytes = Algorithm::ReplyBytes(kind, n, last_warmup);
    if (kind == StepKind::kFull && last_warmup) {
      bytes += (o_.reply == ReplyMode::kMomentum ? 2 : 1) * fp32_->EncodedSize(n);
    }
    return bytes;
  }
  // Momentum replies after the freeze also carry, in fp32, the step's ratio
  // (c f) of each layer the chunk overlaps, in order.
  size_t ChunkReplyBytes(StepKind kind, uint64_t b, size_t n, bool last_warmup) const override {
    size_t bytes = ReplyBytes(kind, n, last_warmup);
    if (kind == StepKind::kCompressed && o_.reply == ReplyMode::kMomentum && n > 0) {
      bytes += 4 * LayerPieces(o_.layer_ends, b, n).size();
    }
    return bytes;
  }

  void InitServer(ServerShardState* s) const override {
    SizeAdamMoments(s);
    // A map not aligned to the layers leaves these empty; Step names the
    // layer that crosses the shard's end.
    auto layers = ShardLayers(o_.layer_ends, s->begin, s->x.size());
    if (layers.ok()) {
      s->lamb_coeff.assign(layers->size(), 0.0f);
      s->lamb_factor.assign(layers->size(), 1.0f);
      s->layers = *std::move(layers);
    }
  }
  // A whole shard only (StepShard with one chunk).
  absl::Status Step(uint64_t step, float lr, bool last_warmup, float* acc, uint64_t off, size_t n,
                    ServerShardState* s, uint8_t* reply) const override {
    if (off != 0 || n != s->x.size()) {
      return absl::InternalError(
          absl::StrCat(traits_.name, " steps whole shards: StepShard takes the chunks"));
    }
    return StepShard(step, lr, last_warmup, {ChunkSpan{0, n, acc, reply}}, s);
  }
  absl::Status StepShard(uint64_t step, float lr, bool last_warmup,
                         const std::vector<ChunkSpan>& chunks, ServerShardState* s) const override;
  // Its layer norms need the whole mean before any element is stepped.
  bool MeansInPieces(Phase) const override { return false; }

  // den from the hand-over with momentum replies; delta replies need none.
  WorkerArraySet WorkerArraysIn(Phase phase, bool hand_over) const override {
    WorkerArraySet set = MomentumFamily::WorkerArraysIn(phase, hand_over);
    set.den = o_.reply == ReplyMode::kMomentum && (phase == Phase::kCompress || hand_over);
    return set;
  }
  absl::Status Apply(uint64_t step, float lr, bool last_warmup, Payload reply, uint64_t b, size_t n,
                     const ArrayOps& ops, WorkerView* s) const override;
};

// onebit-lamb's server (docs/design.md §1.7): the whole shard, whose layers
// it holds whole. Warm-up: LAMB on the mean gradient, each layer scaled by
// its trust ratio, the reply Δ. After the freeze: the mean of the workers'
// momenta (momentum replies: through the server codec) is m; each layer
// steps with the frozen den and its frozen ratio times a factor measured
// from the v of the gradients that m implies. The reply is C(a + e_s) and
// the layers' ratios, or C(Δ + e_s).
absl::Status OnebitLamb::StepShard(uint64_t step, float lr, bool last_warmup,
                                   const std::vector<ChunkSpan>& chunks,
                                   ServerShardState* s) const {
  const size_t n = s->x.size();
  uint64_t covered = 0;
  for (const ChunkSpan& c : chunks) {
    if (c.off != covered) break;
    covered += c.n;
  }
  if (covered != n) {
    return absl::InternalError(absl::StrCat(traits_.name,
                                            " steps whole shards: the chunks must cover [0, ", n,
                                            ") in order; they cover [0, ", covered, ")"));
  }
  auto layers = ShardLayers(o_.layer_ends, s->begin, n);
  if (!layers.ok()) return layers.status();
  if (s->lamb_coeff.size() != layers->size() || s->lamb_factor.size() != layers->size()) {
    return absl::InternalError(absl::StrCat("shard state holds ", s->lamb_coeff.size(),
                                            " layers' ratios, the shard has ", layers->size()));
  }
  float* a = Scratch(n);
  for (const ChunkSpan& c : chunks) std::copy(c.acc, c.acc + c.n, a + c.off);
  const bool momentum_reply = s->frozen && o_.reply == ReplyMode::kMomentum;
  if (momentum_reply) {
    // c_s = C(a + e_s), and everyone's momentum is D(c_s).
    const Codec& codec = *server_codec_;
    for (const ChunkSpan& c : chunks) {
      absl::Status st = EncodeMaybeWithFeedback(codec, o_.server_error_feedback, a + c.off,
                                                s->e.data() + c.off, c.n, c.reply);
      if (!st.ok()) return Diverged(o_, "the averaged momentum", step, s->begin + c.off, st);
      if (st = codec.Decode(c.reply, c.n, a + c.off); !st.ok()) return st;
    }
  }
  std::vector<float> ratios(layers->size(), 1.0f);
  float* x = s->x.data();
  float* m = s->m.data();
  float* v = s->v.data();
  const LambOptions& l = o_.lamb;
  const float b1 = o_.beta1, c1 = 1.0f - o_.beta1, b2 = o_.beta2, c2 = 1.0f - o_.beta2;
  if (!s->frozen) {
    // No bias correction, as DeepSpeed's OnebitLamb; a becomes m / (sqrt(v) + eps).
    for (size_t i = 0; i < n; ++i) {
      const float g = a[i];
      m[i] = b1 * m[i] + c1 * g;
      v[i] = b2 * v[i] + c2 * g * g;
      a[i] = m[i] / (std::sqrt(v[i]) + o_.eps);
    }
  } else {
    // a is the new m; the gradient it implies moves v, den stays frozen.
    const float* den = s->den.data();
    for (size_t i = 0; i < n; ++i) {
      const float g = (a[i] - b1 * m[i]) / c1;
      v[i] = b2 * v[i] + c2 * g * g;
      m[i] = a[i];
      a[i] = m[i] / den[i];
    }
  }
  // Per layer: the norms of p, u and x, summed in double in index order;
  // then the layer's ratio, and a = Δ.
  for (size_t j = 0; j < layers->size(); ++j) {
    const uint64_t lb = (*layers)[j].first, le = (*layers)[j].second;
    double p2 = 0, u2 = 0, x2 = 0;
    ForEachRangeSetting(o_, s->begin + lb, le - lb, [&](size_t q, size_t c, float wd, float) {
      for (size_t i = lb + q; i < lb + q + c; ++i) {
        const float u = LambUpdate(a[i], wd, x[i]);
        p2 += static_cast<double>(a[i]) * a[i];
        u2 += static_cast<double>(u) * u;
        x2 += static_cast<double>(x[i]) * x[i];
      }
    });
    float ratio = 1.0f;
    if (!s->frozen) {
      // The trust ratio, where both norms are non-zero (else 1, and the
      // average skips the step, as DeepSpeed's).
      if (x2 > 0 && u2 > 0) {
        ratio = static_cast<float>(std::sqrt(x2) / std::sqrt(u2));
        ratio = std::min(std::max(ratio, l.min_coeff), l.max_coeff);
        s->lamb_coeff[j] = l.coeff_beta * s->lamb_coeff[j] + (1.0f - l.coeff_beta) * ratio;
      }
    } else {
      // How much further v would let the layer step: max den / den_now,
      // weighted by the part of u that is not weight decay.
      const float* den = s->den.data();
      float factor = 0.0f;
      for (uint64_t i = lb; i < le; ++i) {
        factor = std::max(factor, den[i] / (std::sqrt(v[i]) + o_.eps));
      }
      const float w =
          u2 > 0 ? static_cast<float>(std::min(1.0, std::sqrt(p2) / std::sqrt(u2))) : 1.0f;
      factor = factor * w + (1.0f - w);
      factor = std::min(std::max(factor, l.factor_min), l.factor_max);
      const float last = s->lamb_factor[j];
      factor = std::min(std::max(factor, last * (1.0f - l.factor_threshold)),
                        last * (1.0f + l.factor_threshold));
      s->lamb_factor[j] = factor;
      ratio = s->lamb_coeff[j] * factor;
    }
    ratios[j] = ratio;
    ForEachRangeSetting(o_, s->begin + lb, le - lb, [&](size_t q, size_t c, float wd, float ls) {
      const float k = -(lr * ls) * ratio;
      for (size_t i = lb + q; i < lb + q + c; ++i) a[i] = LambDelta(a[i], wd, x[i], k);
    });
  }
  // a is Δ.
  if (!s->frozen) {
    // The master takes the Δ the workers decode (fp16: rounded).
    const Codec& codec = *warmup_codec_;
    for (const ChunkSpan& c : chunks) {
      absl::Status st = codec.Encode(a + c.off, c.n, c.reply);
      if (!st.ok()) return Diverged(o_, "the update", step, s->begin + c.off, st);
      if (st = codec.DecodeAdd(c.reply, c.n, 1.0f, x + c.off); !st.ok()) return st;
    }
    if (last_warmup) {
      // The freeze: den from the floored v, which the reconstructed
      // gradients move from here on; the workers' momentum starts at m.
      s->den.resize(n);
      for (size_t i = 0; i < n; ++i) {
        if (v[i] < o_.v_floor) {
          v[i] = o_.v_floor;
          ++s->floored;
        }
        s->den[i] = FrozenDenominator(v[i], o_.eps);
      }
      for (const ChunkSpan& c : chunks) {
        std::memcpy(c.reply + codec.EncodedSize(c.n), m + c.off, 4 * c.n);
        if (o_.reply == ReplyMode::kMomentum)
          std::memcpy(c.reply + codec.EncodedSize(c.n) + 4 * c.n, v + c.off, 4 * c.n);
      }
    }
  } else if (momentum_reply) {
    // The master steps as the workers will, from the same m and ratios.
    for (size_t i = 0; i < n; ++i) x[i] += a[i];
    for (const ChunkSpan& c : chunks) {
      uint8_t* tail = c.reply + server_codec_->EncodedSize(c.n);
      size_t at = 0;
      for (size_t j = 0; j < layers->size(); ++j) {
        if ((*layers)[j].second > c.off && (*layers)[j].first < c.off + c.n) {
          std::memcpy(tail + 4 * at++, &ratios[j], 4);
        }
      }
    }
  } else {
    // The exact update on the master; the replicas take C(Δ + e_s).
    if (s->replica.size() != n) s->replica = s->x;
    for (size_t i = 0; i < n; ++i) x[i] += a[i];
    const Codec& codec = *server_codec_;
    for (const ChunkSpan& c : chunks) {
      absl::Status st = EncodeMaybeWithFeedback(codec, o_.server_error_feedback, a + c.off,
                                                s->e.data() + c.off, c.n, c.reply);
      if (!st.ok()) return Diverged(o_, "the update", step, s->begin + c.off, st);
      if (st = codec.DecodeAdd(c.reply, c.n, 1.0f, s->replica.data() + c.off); !st.ok()) return st;
    }
  }
  return CheckFinite(o_, "the update", step, s->begin, x, n);
}

absl::Status OnebitLamb::Apply(uint64_t step, float lr, bool last_warmup, Payload reply, uint64_t b,
                               size_t n, const ArrayOps& ops, WorkerView* s) const {
  float* x = s->x + b;
  if (!s->frozen) {
    if (last_warmup && o_.reply == ReplyMode::kDelta) {
      // Δ, then the momentum the worker's own starts from.
      const Codec& codec = *warmup_codec_;
      const Payload m = reply.At(codec.EncodedSize(n));
      absl::Status st = codec.CheckPayload(reply.host, n);
      if (st.ok()) st = fp32_->CheckPayload(m.host, n);
      if (st.ok()) st = ops.DecodeAdd(codec, reply, n, x);
      if (st.ok()) st = ops.Decode(*fp32_, m, n, s->mbar + b);
      return st;
    }
    return ApplyWarmup(last_warmup && o_.reply == ReplyMode::kMomentum, reply, b, n, ops, s);
  }
  const Codec& codec = *server_codec_;
  if (o_.reply == ReplyMode::kDelta) return ops.DecodeAdd(codec, reply, n, x);
  float* mbar = s->mbar + b;
  // onebit-lamb: m̄ = D(c_s), then every layer's piece of [b, b + n) steps
  // by the ratio the server sent for it (StepShard), read on the host.
  const auto pieces = LayerPieces(o_.layer_ends, b, n);
  std::vector<float> ratios(pieces.size());
  std::memcpy(ratios.data(), reply.host + codec.EncodedSize(n), 4 * ratios.size());
  for (size_t j = 0; j < ratios.size(); ++j) {
    if (!std::isfinite(ratios[j])) {
      return absl::DataLossError(absl::StrCat("reply of step ", step,
                                              ": the ratio of the layer at ", b + pieces[j].first,
                                              " is not finite"));
    }
  }
  absl::Status st = ops.Decode(codec, reply, n, mbar);
  const float* den = s->den + b;
  for (size_t j = 0; j < pieces.size() && st.ok(); ++j) {
    const uint64_t first = pieces[j].first;
    ForEachRangeSetting(
        o_, b + first, pieces[j].second - first, [&](size_t p, size_t c, float wd, float ls) {
          const float k = -(lr * ls) * ratios[j];
          if (st.ok())
            st = ops.LambApply(mbar + first + p, den + first + p, k, wd, c, x + first + p);
        });
  }
  return st;
}

absl::Status Validate(const OptimizerOptions& o) {
  const LambOptions& l = o.lamb;
  if (!(l.min_coeff > 0) || !(l.max_coeff >= l.min_coeff) || !std::isfinite(l.max_coeff)) {
    return SettingError("min_coeff", "want 0 < --min_coeff <= --max_coeff, both finite");
  }
  if (!(l.coeff_beta >= 0 && l.coeff_beta < 1)) {
    return SettingError("coeff_beta", "must lie in [0, 1)");
  }
  if (!(l.factor_min > 0) || !(l.factor_max >= l.factor_min) || !std::isfinite(l.factor_max)) {
    return SettingError("factor_min", "want 0 < --factor_min <= --factor_max, both finite");
  }
  if (!(l.factor_threshold >= 0) || !std::isfinite(l.factor_threshold)) {
    return SettingError("factor_threshold", "must be finite and >= 0");
  }
  if (o.bias_correction) {
    return SettingError("bias_correction", "onebit-lamb has none (as DeepSpeed's OnebitLamb)");
  }
  return absl::OkStatus();
}

}  // namespace

const AlgorithmRow& OnebitLambRow() {
  static const AlgorithmRow* row = [] {
    auto* r = new AlgorithmRow;
    r->traits.kind = OptimizerKind::kOnebitLamb;
    r->traits.name = "onebit-lamb";
    r->traits.compression = true;
    r->traits.worker_momentum = true;
    r->traits.layerwise = true;
    r->traits.fp16_warmup = true;
    // den from the hand-over, with momentum replies.
    r->traits.worker_arrays = {"mbar", "e_w", "den"};
    r->traits.server_arrays = {"m", "v", "e_s", "den"};
    r->validate = Validate;
    r->make = MakeAlgorithm<OnebitLamb>;
    return r;
  }();
  return *row;
}

}  // namespace onebit
