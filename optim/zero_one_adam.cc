// zero-one-adam, 0/1 Adam (docs/design.md §1.6): v refreshed at growing
// intervals until var_freeze_step, the steps in between compressing raw
// gradients; after the freeze, local steps with synchronisations at growing
// intervals, each pushing the worker's update since the last one. Every
// worker keeps its own m, v and den; the server steps the master alike.
#include "optim/zero_one_adam.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "optim/algorithm.h"
#include "optim/algorithms.h"
#include "optim/step_parts.h"
#include "optim/update_kernels.h"

namespace onebit {

bool IsVarianceStep(const ZeroOneOptions& z, uint64_t step) {
  const uint64_t k = step + 1;
  if (k > z.var_freeze_step || z.var_update_scaler == 0) return false;
  // Stage j refreshes at var_update_scaler multiples of 2^j, from the first
  // one after the previous stage's last refresh.
  uint64_t prev = 0;
  for (int j = 0; j < 63; ++j) {
    const uint64_t w = uint64_t{1} << j;
    const uint64_t first = (prev / w + 1) * w;
    if (k < first) return false;
    const uint64_t more = z.var_update_scaler - 1;
    const uint64_t last =
        more > (std::numeric_limits<uint64_t>::max() - first) / w ? kNever : first + more * w;
    if (k <= last) return k % w == 0;
    prev = last;
  }
  return false;
}

uint64_t VarianceRefreshes(const ZeroOneOptions& z, uint64_t step) {
  const uint64_t k = std::min<uint64_t>(step + 1, z.var_freeze_step);
  if (z.var_update_scaler == 0) return 0;
  // Stage j refreshes at k = first + i 2^j, i < var_update_scaler, as in
  // IsVarianceStep; count whole stages, then the current one's part.
  uint64_t prev = 0, count = 0;
  for (int j = 0; j < 63; ++j) {
    const uint64_t w = uint64_t{1} << j;
    const uint64_t first = (prev / w + 1) * w;
    if (k < first) return count;
    const uint64_t more = z.var_update_scaler - 1;
    if (more > (std::numeric_limits<uint64_t>::max() - first) / w || k <= first + more * w) {
      return count + (k - first) / w + 1;
    }
    count += z.var_update_scaler;
    prev = first + more * w;
  }
  return count;
}

float ZeroOneVarianceCorrection(const OptimizerOptions& o, uint64_t step) {
  const double r = static_cast<double>(VarianceRefreshes(o.zero_one, step));
  return static_cast<float>(1.0 - std::pow(static_cast<double>(o.beta2), r));
}

bool IsSyncStep(const ZeroOneOptions& z, uint64_t step) {
  const uint64_t k = step + 1;
  if (k <= z.var_freeze_step) return true;  // before the freeze every step communicates
  if (z.steps > 0 && k == z.steps) return true;
  if (z.local_step_scaler == 0 || z.local_step_clipper == 0) return true;
  // The interval doubles every local_step_scaler steps after the freeze, up
  // to the clipper.
  const uint64_t doublings = (k - z.var_freeze_step - 1) / z.local_step_scaler;
  uint64_t interval = z.local_step_clipper;
  if (doublings < 32) interval = std::min<uint64_t>(interval, uint64_t{1} << doublings);
  return k % interval == 0;
}

namespace {

// zero-one-adam's step of m and x from the gradient g (the mean one, a
// decoded one or the worker's own) over the elements [first, first + n) of x
// (first global, for the weight-decay ranges): m = b1 m + (1 - b1) g, then
// x -= lr (m / den + wd x). The same on the server and every worker.
absl::Status MomentumStep(const OptimizerOptions& o, const ArrayOps& ops, float lr, const float* g,
                          uint64_t first, size_t n, float* m, const float* den, float* x) {
  absl::Status st = ops.UpdateMomentum(g, o.beta1, 1.0f - o.beta1, n, m);
  ForEachRangeSetting(o, first, n, [&](size_t p, size_t c, float wd, float ls) {
    if (st.ok()) st = ops.ApplyMomentum(m + p, den + p, lr * ls, wd, c, x + p);
  });
  return st;
}

// zero-one-adam's variance step, the same on the server and every worker
// (docs/design.md §1.6): the moments from the mean gradient g, then
// den = sqrt(max(v / (1 - beta2^r), v_floor)) + eps with r the refreshes of v
// so far (this one included), then x moves by m / den as in every other step.
// The floor: between variance steps m takes the codec's +-s where the
// gradient is ~0, and an unfloored sqrt(v) + eps there is ~eps (NaN by step
// 26 on the mlp with the defaults). The correction: v gains one term per
// refresh, and refreshes grow rare, so the raw v stays a few percent of its
// settled value for the whole job (den 3-8x too small).
absl::Status ZeroOneVarianceStep(const OptimizerOptions& o, const ArrayOps& ops, uint64_t step,
                                 float lr, const float* g, uint64_t first, size_t n, float* m,
                                 float* v, float* den, float* x) {
  absl::Status st = ops.UpdateMoments(g, o.beta1, 1.0f - o.beta1, o.beta2, 1.0f - o.beta2, n, m, v);
  const float c = ZeroOneVarianceCorrection(o, step);
  if (st.ok()) st = ops.VarianceDenominators(v, c, o.v_floor, o.eps, n, den);
  ForEachRangeSetting(o, first, n, [&](size_t p, size_t q, float wd, float ls) {
    if (st.ok()) st = ops.ApplyMomentum(m + p, den + p, lr * ls, wd, q, x + p);
  });
  return st;
}

class ZeroOneAdam final : public Algorithm {
 public:
  ZeroOneAdam(const AlgorithmTraits& t, const OptimizerOptions& o) : Algorithm(t, o) {}

  // Variance steps are kFull, the other steps before the freeze
  // kCompressed; after it sync steps are kCompressed, the rest kLocal.
  StepKind KindOf(uint64_t step, Phase phase) const override {
    if (phase == Phase::kWarmup) {
      return IsVarianceStep(o_.zero_one, step) ? StepKind::kFull : StepKind::kCompressed;
    }
    return IsSyncStep(o_.zero_one, step) ? StepKind::kCompressed : StepKind::kLocal;
  }

  void InitServer(ServerShardState* s) const override {
    SizeAdamMoments(s);
    s->den.assign(s->x.size(), 0.0f);
    s->e.assign(s->x.size(), 0.0f);
  }
  void EnterCompression(ServerShardState* s) const override {
    // e, zeroed by the base, was of gradients; from here on it is of the
    // workers' summed updates, so it starts again (as DeepSpeed's).
    Algorithm::EnterCompression(s);
    s->m.clear();  // the momentum is now the workers'
    s->m.shrink_to_fit();
    for (float v : s->v) s->floored += v < o_.v_floor ? 1 : 0;
  }
  absl::Status Step(uint64_t step, float lr, bool last_warmup, float* acc, uint64_t off, size_t n,
                    ServerShardState* s, uint8_t* reply) const override;

  // m̄ (the worker's own m), e and den throughout; v until the freeze,
  // x_sync after it.
  WorkerArraySet WorkerArraysIn(Phase phase, bool hand_over) const override {
    (void)hand_over;
    WorkerArraySet set;
    set.mbar = set.e = set.den = true;
    set.v = phase == Phase::kWarmup;
    set.x_sync = phase == Phase::kCompress;
    return set;
  }
  absl::Status EnterCompression(const ArrayOps& ops, WorkerView* s) const override {
    absl::Status st = Algorithm::EnterCompression(ops, s);
    // As the server's: the errors start again for the summed updates; v is
    // frozen (den holds all that is needed of it).
    if (st.ok()) st = ops.Zero(s->d, s->e);
    if (st.ok()) st = ops.Copy(s->x, s->d, s->x_sync);
    s->lrs = 0.0f;
    return st;
  }
  // After the freeze the worker keeps the sum of the learning rates since
  // the last sync step.
  void BeginStep(uint64_t step, float lr, WorkerView* s) const override {
    (void)step;
    if (s->frozen) s->lrs += lr;
  }
  void EndStep(uint64_t step, WorkerView* s) const override {
    if (s->frozen && KindOf(step, Phase::kCompress) == StepKind::kCompressed) s->lrs = 0.0f;
  }
  absl::Status Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                    const ArrayOps& ops, WorkerView* s, uint8_t* out) const override;
  absl::Status LocalStep(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                         const ArrayOps& ops, WorkerView* s) const override {
    if (KindOf(step, PhaseOf(*s)) != StepKind::kLocal) {
      return Algorithm::LocalStep(step, lr, g, b, n, ops, s);
    }
    if (absl::Status st = CheckLocalGradient(ops, step, g, b, n); !st.ok()) return st;
    return MomentumStep(o_, ops, lr, g + b, b, n, s->mbar + b, s->den + b, s->x + b);
  }
  absl::Status Apply(uint64_t step, float lr, bool last_warmup, Payload reply, uint64_t b, size_t n,
                     const ArrayOps& ops, WorkerView* s) const override;
};

// zero-one-adam's server (docs/design.md §1.6). Variance step: acc is the mean
// gradient, replied as it is; every worker runs the same Adam step on its
// own m, v and x. Other steps before the freeze: reply c_s = C(acc + e_s)
// and step m and x with its decoding. Sync steps after it: acc is the mean
// of the workers' updates u * den, x += D(c_s) / den.
absl::Status ZeroOneAdam::Step(uint64_t step, float lr, bool last_warmup, float* acc, uint64_t off,
                               size_t n, ServerShardState* s, uint8_t* reply) const {
  (void)last_warmup;  // the freeze needs no hand-over: every worker has its own v
  float* x = s->x.data() + off;
  float* den = s->den.data() + off;
  const StepKind kind = KindOf(step, PhaseOf(*s));
  if (kind == StepKind::kLocal) {
    return absl::InternalError(absl::StrCat("step ", step, " is a local step: nothing to serve"));
  }
  if (kind == StepKind::kFull) {
    absl::Status st = fp32_->Encode(acc, n, reply);
    if (!st.ok()) return Diverged(o_, "the mean gradient", step, s->begin + off, st);
    st = ZeroOneVarianceStep(o_, HostArrayOps(), step, lr, acc, s->begin + off, n,
                             s->m.data() + off, s->v.data() + off, den, x);
    if (!st.ok()) return st;
    return CheckFinite(o_, "the update", step, s->begin + off, x, n);
  }
  const Codec& codec = *server_codec_;
  absl::Status st =
      EncodeMaybeWithFeedback(codec, o_.server_error_feedback, acc, s->e.data() + off, n, reply);
  if (!st.ok()) return Diverged(o_, "the averaged update", step, s->begin + off, st);
  if (st = codec.Decode(reply, n, acc); !st.ok()) return st;
  if (!s->frozen) {
    st = MomentumStep(o_, HostArrayOps(), lr, acc, s->begin + off, n, s->m.data() + off, den, x);
    if (!st.ok()) return st;
  } else {
    for (size_t i = 0; i < n; ++i) x[i] += acc[i] / den[i];
  }
  return CheckFinite(o_, "the update", step, s->begin + off, x, n);
}

absl::Status ZeroOneAdam::Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                               const ArrayOps& ops, WorkerView* s, uint8_t* out) const {
  if (KindOf(step, PhaseOf(*s)) == StepKind::kFull) {
    return ops.Encode(*warmup_codec_, g + b, nullptr, n, out);
  }
  const float* y = g + b;
  if (s->frozen) {
    // The sync step's own local step, then its update since the last
    // sync, u = x - x_sync, in momentum units: u * den.
    const float* den = s->den + b;
    absl::Status st = MomentumStep(o_, ops, lr, g + b, b, n, s->mbar + b, den, s->x + b);
    if (!st.ok()) return st;
    absl::StatusOr<float*> u = ops.Scratch(n);
    if (!u.ok()) return u.status();
    if (st = ops.UpdateSinceSync(s->x + b, s->x_sync + b, den, n, *u); !st.ok()) return st;
    y = *u;
  }
  return ops.Encode(*worker_codec_, y, o_.worker_error_feedback ? s->e + b : nullptr, n, out);
}

// zero-one-adam's worker side of Step, the same arithmetic on the worker's
// own m, v and x.
absl::Status ZeroOneAdam::Apply(uint64_t step, float lr, bool last_warmup, Payload reply,
                                uint64_t b, size_t n, const ArrayOps& ops, WorkerView* s) const {
  (void)last_warmup;
  const StepKind kind = KindOf(step, PhaseOf(*s));  // not kLocal (WorkerOptimizer::Apply)
  float* x = s->x + b;
  float* m = s->mbar + b;
  float* den = s->den + b;
  absl::StatusOr<float*> a = ops.Scratch(n);
  if (!a.ok()) return a.status();
  if (absl::Status st = ops.Decode(reply_codec(kind), reply, n, *a); !st.ok()) return st;
  if (kind == StepKind::kFull) {
    // The variance step the server took, on the worker's own moments (the
    // fp32 Decode above refused a non-finite mean gradient).
    return ZeroOneVarianceStep(o_, ops, step, lr, *a, b, n, m, s->v + b, den, x);
  }
  if (!s->frozen) return MomentumStep(o_, ops, lr, *a, b, n, m, den, x);
  // A sync step: the replica moves as the master did; the local model
  // starts again from it, with m the mean update per unit of learning rate.
  // m is per unit of the range's own lr: the sum of lrs times its scale.
  absl::Status st;
  ForEachRangeSetting(o_, b, n, [&](size_t p, size_t c, float, float ls) {
    if (st.ok())
      st = ops.ApplySync(*a + p, den + p, s->lrs * ls, c, s->x_sync + b + p, m + p, x + p);
  });
  return st;
}

absl::Status Validate(const OptimizerOptions& o) {
  const ZeroOneOptions& z = o.zero_one;
  if (z.var_freeze_step < 1) return SettingError("var_freeze_step", "must be >= 1");
  if (z.var_update_scaler < 1) return SettingError("var_update_scaler", "must be >= 1");
  if (z.local_step_scaler < 1) return SettingError("local_step_scaler", "must be >= 1");
  if (z.local_step_clipper < 1) return SettingError("local_step_clipper", "must be >= 1");
  if (o.reply != ReplyMode::kMomentum) {
    return SettingError("server_reply",
                        "zero-one-adam replies the averaged gradient or momentum: every worker "
                        "keeps its own m and v for its local steps, so there is no delta to reply");
  }
  if (o.bias_correction) {
    return SettingError("bias_correction",
                        "zero-one-adam always corrects v for its refreshes (docs/design.md §1.6) "
                        "and never m (as DeepSpeed's ZeroOneAdam): drop the flag");
  }
  return absl::OkStatus();
}

std::string Remedy(const OptimizerOptions& o) {
  const uint32_t block = ZeroOneAdamRow().traits.default_block_size;
  const std::string smaller = o.codec.block_size > block
                                  ? absl::StrCat("a smaller --block_size (this job's ",
                                                 o.codec.block_size, "; ", block, " by default), ")
                                  : std::string();
  return absl::StrCat("zero-one-adam: ", smaller,
                      "a learning-rate warm-up (--lr_schedule warmup:N, N about a tenth of the "
                      "job's steps), --v_floor 1e-6 or a lower --lr (docs/design.md §1.6)");
}

}  // namespace

const AlgorithmRow& ZeroOneAdamRow() {
  static const AlgorithmRow* row = [] {
    auto* r = new AlgorithmRow;
    r->traits.kind = OptimizerKind::kZeroOneAdam;
    r->traits.name = "zero-one-adam";
    r->traits.compression = true;
    r->traits.worker_momentum = true;
    // One scale per block: raw gradients' magnitudes spread far wider
    // within a block than momenta's, and the scale swamps the small
    // coordinates.
    r->traits.default_block_size = 256;
    r->traits.schedule_freeze = true;
    r->traits.needs_job_length = true;
    r->traits.local_model = true;
    // v before the freeze, x_sync after it; den throughout.
    r->traits.worker_arrays = {"mbar", "e_w", "v or x_sync", "den"};
    r->traits.server_arrays = {"m", "v", "e_s", "den"};
    r->validate = Validate;
    r->remedy = Remedy;
    r->make = MakeAlgorithm<ZeroOneAdam>;
    return r;
  }();
  return *row;
}

}  // namespace onebit
