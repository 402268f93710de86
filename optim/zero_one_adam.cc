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

// zero-one-adam's variance step on the elements [b, b + n) of x (b global,
// for the weight-decay ranges), the same on the server and every worker
// (docs/design.md §1.6): the moments from the mean gradient g, then
// den = sqrt(max(v / (1 - beta2^r), v_floor)) + eps with r the refreshes of v
// so far (this one included), then x moves by m / den as in every other step.
// The floor: between variance steps m takes the codec's +-s where the
// gradient is ~0, and an unfloored sqrt(v) + eps there is ~eps (NaN by step
// 26 on the mlp with the defaults). The correction: v gains one term per
// refresh, and refreshes grow rare, so the raw v stays a few percent of its
// settled value for the whole job (den 3-8x too small).
void ZeroOneVarianceStep(const OptimizerOptions& o, uint64_t step, float lr, const float* g,
                         uint64_t b, size_t n, float* m, float* v, float* den, float* x) {
  UpdateMoments(g, o.beta1, 1.0f - o.beta1, o.beta2, 1.0f - o.beta2, n, m, v);
  const float c = ZeroOneVarianceCorrection(o, step);
  for (size_t i = 0; i < n; ++i) den[i] = FrozenDenominator(std::max(v[i] / c, o.v_floor), o.eps);
  ForEachWeightDecay(o, b, n, [&](size_t p, size_t q, float wd) {
    ApplyMomentum(m + p, den + p, lr, wd, q, x + p);
  });
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

  void InitWorker(WorkerState* s) const override {
    s->v.assign(s->x.size(), 0.0f);
    s->den.assign(s->x.size(), 0.0f);
  }
  void EnterCompression(WorkerState* s) const override {
    Algorithm::EnterCompression(s);
    // As the server's: the errors start again for the summed updates.
    std::fill(s->e.begin(), s->e.end(), 0.0f);
    s->x_sync = s->x;
    s->lrs = 0.0f;
    s->v.clear();  // frozen: den holds all that is needed of it
    s->v.shrink_to_fit();
  }
  // After the freeze the worker keeps the sum of the learning rates since
  // the last sync step.
  void BeginStep(uint64_t step, float lr, WorkerState* s) const override {
    (void)step;
    if (s->frozen) s->lrs += lr;
  }
  void EndStep(uint64_t step, WorkerState* s) const override {
    if (s->frozen && KindOf(step, Phase::kCompress) == StepKind::kCompressed) s->lrs = 0.0f;
  }
  absl::Status Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n, WorkerState* s,
                    uint8_t* out) const override;
  absl::Status LocalStep(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                         WorkerState* s) const override {
    if (KindOf(step, PhaseOf(*s)) != StepKind::kLocal)
      return Algorithm::LocalStep(step, lr, g, b, n, s);
    LocalUpdate(lr, g + b, b, n, s);
    return absl::OkStatus();
  }
  absl::Status Apply(uint64_t step, float lr, bool last_warmup, const uint8_t* reply, uint64_t b,
                     size_t n, WorkerState* s) const override;

 private:
  // The local step's m and x update of [b, b + n).
  void LocalUpdate(float lr, const float* g, uint64_t b, size_t n, WorkerState* s) const {
    float* m = s->mbar.data() + b;
    float* x = s->x.data() + b;
    const float* den = s->den.data() + b;
    UpdateMomentum(g, o_.beta1, 1.0f - o_.beta1, n, m);
    ForEachWeightDecay(o_, b, n, [&](size_t p, size_t c, float wd) {
      ApplyMomentum(m + p, den + p, lr, wd, c, x + p);
    });
  }
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
    ZeroOneVarianceStep(o_, step, lr, acc, s->begin + off, n, s->m.data() + off, s->v.data() + off,
                        den, x);
    return CheckFinite(o_, "the update", step, s->begin + off, x, n);
  }
  const Codec& codec = *server_codec_;
  absl::Status st =
      EncodeMaybeWithFeedback(codec, o_.server_error_feedback, acc, s->e.data() + off, n, reply);
  if (!st.ok()) return Diverged(o_, "the averaged update", step, s->begin + off, st);
  if (st = codec.Decode(reply, n, acc); !st.ok()) return st;
  if (!s->frozen) {
    float* m = s->m.data() + off;
    UpdateMomentum(acc, o_.beta1, 1.0f - o_.beta1, n, m);
    ForEachWeightDecay(o_, s->begin + off, n, [&](size_t p, size_t c, float wd) {
      ApplyMomentum(m + p, den + p, lr, wd, c, x + p);
    });
  } else {
    for (size_t i = 0; i < n; ++i) x[i] += acc[i] / den[i];
  }
  return CheckFinite(o_, "the update", step, s->begin + off, x, n);
}

absl::Status ZeroOneAdam::Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                               WorkerState* s, uint8_t* out) const {
  if (KindOf(step, PhaseOf(*s)) == StepKind::kFull) return warmup_codec_->Encode(g + b, n, out);
  const Codec& codec = *worker_codec_;
  float* e = s->e.data() + b;
  const float* y = g + b;
  if (s->frozen) {
    // The sync step's own local step, then its update since the last
    // sync, u = x - x_sync, in momentum units: u * den.
    LocalUpdate(lr, g + b, b, n, s);
    float* u = Scratch(n);
    const float* x = s->x.data() + b;
    const float* xs = s->x_sync.data() + b;
    const float* den = s->den.data() + b;
    for (size_t i = 0; i < n; ++i) u[i] = (x[i] - xs[i]) * den[i];
    y = u;
  }
  return EncodeMaybeWithFeedback(codec, o_.worker_error_feedback, y, e, n, out);
}

// zero-one-adam's worker side of Step, the same
// arithmetic on the worker's own m, v and x.
absl::Status ZeroOneAdam::Apply(uint64_t step, float lr, bool last_warmup, const uint8_t* reply,
                                uint64_t b, size_t n, WorkerState* s) const {
  (void)last_warmup;
  const StepKind kind = KindOf(step, PhaseOf(*s));  // not kLocal (WorkerOptimizer::Apply)
  float* x = s->x.data() + b;
  float* m = s->mbar.data() + b;
  float* den = s->den.data() + b;
  float* a = Scratch(n);
  const Codec& codec = reply_codec(kind);
  if (absl::Status st = codec.Decode(reply, n, a); !st.ok()) return st;
  if (kind == StepKind::kFull) {
    // The variance step the server took, on the worker's own moments (the
    // fp32 Decode above refused a non-finite mean gradient).
    ZeroOneVarianceStep(o_, step, lr, a, b, n, m, s->v.data() + b, den, x);
    return absl::OkStatus();
  }
  if (!s->frozen) {
    UpdateMomentum(a, o_.beta1, 1.0f - o_.beta1, n, m);
    ForEachWeightDecay(o_, b, n, [&](size_t p, size_t c, float wd) {
      ApplyMomentum(m + p, den + p, lr, wd, c, x + p);
    });
    return absl::OkStatus();
  }
  // A sync step: the replica moves as the master did; the local model
  // starts again from it, with m the mean update per unit of learning rate.
  float* xs = s->x_sync.data() + b;
  const float lrs = s->lrs;
  for (size_t i = 0; i < n; ++i) {
    xs[i] += a[i] / den[i];
    m[i] = lrs > 0.0f ? -(a[i] / lrs) : 0.0f;
    x[i] = xs[i];
  }
  return absl::OkStatus();
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

// Every worker keeps its own m and den; v until the freeze, x_sync after it.
WorkerArraysHeld WorkerArraysHeldBy(const OptimizerOptions& o, Phase phase) {
  (void)o;
  WorkerArraysHeld held;
  held.mbar = held.e = held.den = true;
  held.v = phase == Phase::kWarmup;
  held.x_sync = phase == Phase::kCompress;
  return held;
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
    r->worker_arrays_held = WorkerArraysHeldBy;
    r->make = MakeAlgorithm<ZeroOneAdam>;
    return r;
  }();
  return *row;
}

}  // namespace onebit
