#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "optim/update_kernels.h"

namespace onebit {
namespace {

absl::Status Bad(absl::string_view flag, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", why));
}

// delta = -lr * (m / den + wd * x) and x += delta, for the delta reply.
void DeltaFromMomentum(const float* m, const float* den, float lr, float wd, size_t n, float* x,
                       float* delta) {
  const float neg_lr = -lr;
  for (size_t i = 0; i < n; ++i) {
    const float p = den != nullptr ? m[i] / den[i] : m[i];
    const float d = neg_lr * (p + wd * x[i]);
    delta[i] = d;
    x[i] += d;
  }
}

// Per-thread scratch of at least n floats (a chunk's decoded reply, a sync
// push, x before an fp16 warm-up step): the optimizers are shared and const,
// their callers' threads not.
float* Scratch(size_t n) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < n) scratch.resize(n);
  return scratch.data();
}

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

// The pieces of the layers that overlap the elements [b, b + n), as
// [first, second) offsets from b, in order (a layer may start before b or
// end after b + n).
std::vector<std::pair<uint64_t, uint64_t>> LayerPieces(const std::vector<uint64_t>& ends,
                                                       uint64_t b, uint64_t n) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  uint64_t start = 0;
  for (uint64_t e : ends) {
    if (e > b && start < b + n) out.emplace_back(std::max(start, b) - b, std::min(e, b + n) - b);
    start = e;
  }
  return out;
}

// The layers of the shard [begin, begin + n) (layer_ends as in
// OptimizerOptions), as shard-local [first, second) ranges; an error when a
// layer crosses either end of the shard (its map is not aligned to them).
absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> ShardLayers(
    const std::vector<uint64_t>& ends, uint64_t begin, uint64_t n) {
  if (n == 0) return std::vector<std::pair<uint64_t, uint64_t>>{};
  const uint64_t end = begin + n;
  if (ends.empty() || ends.back() < end) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model's layers end at ", ends.empty() ? 0 : ends.back(), ", before the shard [", begin,
        ", ", end, ") does: a layer-wise optimizer needs every layer declared"));
  }
  for (uint64_t at : {begin, end}) {
    const auto next = std::upper_bound(ends.begin(), ends.end(), at);  // the first end > at
    const uint64_t start = next == ends.begin() ? 0 : *(next - 1);
    if (at != start && next != ends.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer [", start, ", ", *next, ") crosses the shard [", begin, ", ", end,
                       "): a layer-wise optimizer needs a shard map aligned to the layers"));
    }
  }
  return LayerPieces(ends, begin, n);
}

// onebit-lamb's update direction of one element, u = p + wd x with p =
// m / den, and its step -lr * ratio * u with k = -lr * ratio: the server's
// norms and steps and the workers' steps all go through these.
inline float LambUpdate(float p, float wd, float x) { return wd == 0.0f ? p : p + wd * x; }
inline float LambDelta(float p, float wd, float x, float k) { return k * LambUpdate(p, wd, x); }

// c = C(y), with error feedback e when `feedback` (y + e is encoded, e
// keeps the rest); without it e is left alone.
absl::Status EncodeMaybeWithFeedback(const Codec& codec, bool feedback, const float* y, float* e,
                                     size_t n, uint8_t* out) {
  return feedback ? codec.EncodeWithFeedback(y, e, n, out) : codec.Encode(y, n, out);
}

absl::Status NotFinite(const OptimizerOptions& o, absl::string_view what, uint64_t step,
                       uint64_t global_index, float value) {
  return absl::InternalError(absl::StrCat(what, " of step ", step, " is not finite at parameter ",
                                          global_index, " (", value, "): training diverged; try ",
                                          DivergenceRemedy(o)));
}

// A codec refused a vector that starts at global index `begin`.
absl::Status Diverged(const OptimizerOptions& o, absl::string_view what, uint64_t step,
                      uint64_t begin, const absl::Status& codec_error) {
  return absl::InternalError(absl::StrCat(what, " of step ", step, " (parameters from ", begin,
                                          ") cannot be encoded: ", codec_error.message(),
                                          "; training diverged; try ", DivergenceRemedy(o)));
}

}  // namespace

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name) {
  if (name == "sgd") return OptimizerKind::kSgd;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "onebit-adam") return OptimizerKind::kOnebitAdam;
  if (name == "naive-onebit-adam") return OptimizerKind::kNaiveOnebitAdam;
  if (name == "ef-sgd") return OptimizerKind::kEfSgd;
  if (name == "zero-one-adam") return OptimizerKind::kZeroOneAdam;
  if (name == "onebit-lamb") return OptimizerKind::kOnebitLamb;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown optimizer '", name,
      "' (want sgd, adam, onebit-adam, naive-onebit-adam, ef-sgd, zero-one-adam or onebit-lamb)"));
}

absl::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kOnebitAdam:
      return "onebit-adam";
    case OptimizerKind::kNaiveOnebitAdam:
      return "naive-onebit-adam";
    case OptimizerKind::kEfSgd:
      return "ef-sgd";
    case OptimizerKind::kZeroOneAdam:
      return "zero-one-adam";
    case OptimizerKind::kOnebitLamb:
      return "onebit-lamb";
  }
  return "unknown";
}

absl::StatusOr<ReplyMode> ParseReplyMode(absl::string_view name) {
  if (name == "momentum") return ReplyMode::kMomentum;
  if (name == "delta") return ReplyMode::kDelta;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown server reply '", name, "' (want momentum or delta)"));
}

absl::string_view ReplyModeName(ReplyMode mode) {
  return mode == ReplyMode::kDelta ? "delta" : "momentum";
}

absl::Status ParseLrSchedule(absl::string_view text, uint64_t steps, OptimizerOptions* o) {
  if (text == "constant") {
    o->schedule = LrScheduleKind::kConstant;
    o->schedule_steps = 0;
    return absl::OkStatus();
  }
  if (text == "cosine") {
    if (steps == 0) return Bad("lr_schedule", "cosine needs the job's length (--steps)");
    o->schedule = LrScheduleKind::kCosine;
    o->schedule_steps = steps;
    return absl::OkStatus();
  }
  uint64_t n = 0;
  if (absl::ConsumePrefix(&text, "warmup:") && absl::SimpleAtoi(text, &n) && n > 0) {
    o->schedule = LrScheduleKind::kWarmup;
    o->schedule_steps = n;
    return absl::OkStatus();
  }
  return Bad("lr_schedule", "want constant, warmup:N (N >= 1) or cosine");
}

absl::Status ParseErrorFeedback(absl::string_view text, OptimizerOptions* o) {
  if (text != "both" && text != "worker" && text != "server" && text != "none") {
    return Bad("error_feedback", absl::StrCat("'", text, "': want both, worker, server or none"));
  }
  o->worker_error_feedback = text == "both" || text == "worker";
  o->server_error_feedback = text == "both" || text == "server";
  return absl::OkStatus();
}

std::string ErrorFeedbackName(const OptimizerOptions& o) {
  if (o.worker_error_feedback && o.server_error_feedback) return "both";
  if (o.worker_error_feedback) return "worker";
  if (o.server_error_feedback) return "server";
  return "none";
}

absl::StatusOr<FreezeOptions> ParseAutoFreeze(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  FreezeOptions f;
  f.automatic = true;
  auto bad = [&] {
    return Bad("freeze", absl::StrCat("'", text,
                                      "': want auto, auto:TAU, auto:TAU:K or auto:TAU:K:F "
                                      "(0 < TAU, K >= 1, 0 < F <= 1)"));
  };
  if (parts[0] != "auto" || parts.size() > 4) return bad();
  if (parts.size() >= 2 && (!absl::SimpleAtod(parts[1], &f.tau) || !(f.tau > 0))) return bad();
  if (parts.size() >= 3 && (!absl::SimpleAtoi(parts[2], &f.window) || f.window < 1)) return bad();
  if (parts.size() == 4 && (!absl::SimpleAtod(parts[3], &f.latest_fraction) ||
                            !(f.latest_fraction > 0 && f.latest_fraction <= 1))) {
    return bad();
  }
  return f;
}

bool HasCompressionPhase(OptimizerKind kind) {
  return kind == OptimizerKind::kOnebitAdam || kind == OptimizerKind::kNaiveOnebitAdam ||
         kind == OptimizerKind::kEfSgd || kind == OptimizerKind::kZeroOneAdam ||
         kind == OptimizerKind::kOnebitLamb;
}

bool IsLayerwise(OptimizerKind kind) { return kind == OptimizerKind::kOnebitLamb; }

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

std::string DivergenceRemedy(const OptimizerOptions& o) {
  if (o.kind == OptimizerKind::kZeroOneAdam) {
    const std::string block =
        o.codec.block_size > DefaultBlockSize(o.kind)
            ? absl::StrCat("a smaller --block_size (this job's ", o.codec.block_size, "; ",
                           DefaultBlockSize(o.kind), " by default), ")
            : std::string();
    return absl::StrCat("zero-one-adam: ", block,
                        "a learning-rate warm-up (--lr_schedule warmup:N, N about a tenth of the "
                        "job's steps), --v_floor 1e-6 or a lower --lr (docs/design.md §1.6)");
  }
  return "a lower --lr, a learning-rate warm-up (--lr_schedule warmup:N) or a larger --v_floor";
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

bool HasWarmup(OptimizerKind kind) { return kind != OptimizerKind::kEfSgd; }

namespace {

StateSize SizeOf(std::vector<const char*> arrays, uint64_t n) {
  StateSize s;
  s.bytes = arrays.size() * n * sizeof(float);  // n <= 2^34: no overflow
  s.arrays = absl::StrJoin(arrays, ", ");
  return s;
}

}  // namespace

StateSize WorkerStateSize(const OptimizerOptions& o, uint64_t d) {
  std::vector<const char*> arrays = {"x", "g"};
  if (HasCompressionPhase(o.kind)) arrays.insert(arrays.end(), {"mbar", "e_w"});
  // v before the freeze, x_sync after it; den throughout.
  if (o.kind == OptimizerKind::kZeroOneAdam) arrays.insert(arrays.end(), {"v or x_sync", "den"});
  return SizeOf(arrays, d);
}

StateSize ServerShardSize(const OptimizerOptions& o, uint64_t n) {
  std::vector<const char*> arrays = {"x", "the accumulators"};
  const bool adam = o.kind != OptimizerKind::kSgd && o.kind != OptimizerKind::kEfSgd;
  if (adam) arrays.insert(arrays.end(), {"m", "v"});
  // onebit-adam drops m when e_s arrives.
  if (HasCompressionPhase(o.kind) && o.kind != OptimizerKind::kOnebitAdam) arrays.push_back("e_s");
  if (o.kind == OptimizerKind::kZeroOneAdam || o.kind == OptimizerKind::kOnebitLamb) {
    arrays.push_back("den");
  }
  if (o.reply == ReplyMode::kDelta) arrays.push_back("the replica");
  return SizeOf(arrays, n);
}

absl::string_view DefaultCodec(OptimizerKind kind) {
  return HasCompressionPhase(kind) ? "onebit" : "fp32";
}

uint32_t DefaultBlockSize(OptimizerKind kind) {
  // One scale per block: raw gradients' magnitudes spread far wider within
  // a block than momenta's, and the scale swamps the small coordinates.
  return kind == OptimizerKind::kZeroOneAdam ? 256 : CodecOptions{}.block_size;
}

ReplyMode DefaultReplyMode(OptimizerKind kind) {
  return kind == OptimizerKind::kNaiveOnebitAdam ? ReplyMode::kDelta : ReplyMode::kMomentum;
}

std::string DecayRangesText(const std::vector<DecayRange>& ranges) {
  if (ranges.empty()) return "none";
  std::vector<std::string> parts;
  for (const DecayRange& r : ranges) {
    parts.push_back(absl::StrCat("[", r.begin, ", ", r.end, "): ", r.weight_decay));
  }
  return absl::StrJoin(parts, ", ");
}

absl::Status ValidateDecayRanges(const std::vector<DecayRange>& ranges, uint64_t d) {
  uint64_t last_end = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const DecayRange& r = ranges[i];
    if (r.begin >= r.end || (i > 0 && r.begin < last_end) || (d != kNever && r.end > d) ||
        !std::isfinite(r.weight_decay)) {
      return Bad("weight_decay",
                 absl::StrCat("range ", i, " [", r.begin, ", ", r.end, ") with weight decay ",
                              r.weight_decay, ": ranges must be non-empty, sorted, disjoint",
                              d != kNever ? absl::StrCat(", within the d = ", d, " parameters")
                                          : std::string(),
                              ", with a finite value"));
    }
    last_end = r.end;
  }
  return absl::OkStatus();
}

absl::Status ValidateOptimizerOptions(const OptimizerOptions& o) {
  if (!std::isfinite(o.lr) || o.lr < 0) return Bad("lr", "must be finite and >= 0");
  if (!(o.beta1 >= 0 && o.beta1 < 1)) return Bad("beta1", "must lie in [0, 1)");
  if (!(o.beta2 >= 0 && o.beta2 < 1)) return Bad("beta2", "must lie in [0, 1)");
  if (!(o.eps > 0) || !std::isfinite(o.eps)) return Bad("eps", "must be finite and > 0");
  if (!std::isfinite(o.weight_decay)) return Bad("weight_decay", "must be finite");
  if (absl::Status st = ValidateDecayRanges(o.weight_decay_ranges, kNever); !st.ok()) return st;
  if (!(o.v_floor >= 0) || !std::isfinite(o.v_floor)) {
    return Bad("v_floor", "must be finite and >= 0");
  }
  for (const auto& [flag, name] :
       {std::pair<const char*, std::string>{"worker_codec", o.worker_codec},
        std::pair<const char*, std::string>{"server_codec", o.server_codec}}) {
    if (!ParseCodecKind(name).ok()) {
      return Bad(flag, absl::StrCat("unknown codec '", name, "' (want fp32, fp16 or onebit)"));
    }
    if (!HasCompressionPhase(o.kind) && name != "fp32") {
      return Bad(flag, absl::StrCat(OptimizerKindName(o.kind),
                                    " communicates in fp32 throughout (it has no compression "
                                    "phase); compress with onebit-adam, naive-onebit-adam or "
                                    "ef-sgd"));
    }
  }
  if (o.kind == OptimizerKind::kNaiveOnebitAdam && o.reply != ReplyMode::kDelta) {
    return Bad("server_reply",
               "naive-onebit-adam replies deltas: its v changes every step, so workers cannot "
               "expand a momentum reply");
  }
  if (o.warmup_codec != "fp32") {
    if (o.warmup_codec != "fp16") {
      return Bad("warmup_codec", absl::StrCat("'", o.warmup_codec, "': want fp32 or fp16"));
    }
    if (!HasWarmup(o.kind) || o.kind == OptimizerKind::kZeroOneAdam) {
      return Bad("warmup_codec",
                 absl::StrCat(OptimizerKindName(o.kind), " has no warm-up to send in fp16"));
    }
  }
  if (o.kind == OptimizerKind::kZeroOneAdam) {
    const ZeroOneOptions& z = o.zero_one;
    if (z.var_freeze_step < 1) return Bad("var_freeze_step", "must be >= 1");
    if (z.var_update_scaler < 1) return Bad("var_update_scaler", "must be >= 1");
    if (z.local_step_scaler < 1) return Bad("local_step_scaler", "must be >= 1");
    if (z.local_step_clipper < 1) return Bad("local_step_clipper", "must be >= 1");
    if (o.reply != ReplyMode::kMomentum) {
      return Bad("server_reply",
                 "zero-one-adam replies the averaged gradient or momentum: every worker keeps "
                 "its own m and v for its local steps, so there is no delta to reply");
    }
    if (o.bias_correction) {
      return Bad("bias_correction",
                 "zero-one-adam always corrects v for its refreshes (docs/design.md §1.6) and "
                 "never m (as DeepSpeed's ZeroOneAdam): drop the flag");
    }
  }
  for (size_t i = 0; i < o.layer_ends.size(); ++i) {
    if (o.layer_ends[i] == 0 || (i > 0 && o.layer_ends[i] <= o.layer_ends[i - 1])) {
      return Bad("layer_ends", absl::StrCat("must be strictly increasing and > 0; end ", i, " is ",
                                            o.layer_ends[i]));
    }
  }
  if (o.kind == OptimizerKind::kOnebitLamb) {
    const LambOptions& l = o.lamb;
    if (!(l.min_coeff > 0) || !(l.max_coeff >= l.min_coeff) || !std::isfinite(l.max_coeff)) {
      return Bad("min_coeff", "want 0 < --min_coeff <= --max_coeff, both finite");
    }
    if (!(l.coeff_beta >= 0 && l.coeff_beta < 1)) return Bad("coeff_beta", "must lie in [0, 1)");
    if (!(l.factor_min > 0) || !(l.factor_max >= l.factor_min) || !std::isfinite(l.factor_max)) {
      return Bad("factor_min", "want 0 < --factor_min <= --factor_max, both finite");
    }
    if (!(l.factor_threshold >= 0) || !std::isfinite(l.factor_threshold)) {
      return Bad("factor_threshold", "must be finite and >= 0");
    }
    if (o.bias_correction) {
      return Bad("bias_correction", "onebit-lamb has none (as DeepSpeed's OnebitLamb)");
    }
  }
  if (o.schedule == LrScheduleKind::kWarmup && o.schedule_steps < 1) {
    return Bad("lr_schedule", "warmup:N needs N >= 1");
  }
  return absl::OkStatus();
}

float LearningRate(const OptimizerOptions& o, uint64_t step) {
  const double lr = o.lr;
  switch (o.schedule) {
    case LrScheduleKind::kConstant:
      return o.lr;
    case LrScheduleKind::kWarmup:
      return static_cast<float>(lr * std::min(1.0, static_cast<double>(step + 1) /
                                                       static_cast<double>(o.schedule_steps)));
    case LrScheduleKind::kCosine: {
      const double t = std::min<double>(static_cast<double>(step), o.schedule_steps);
      const double total = std::max<double>(1.0, static_cast<double>(o.schedule_steps));
      return static_cast<float>(lr * 0.5 * (1.0 + std::cos(M_PI * t / total)));
    }
  }
  return o.lr;
}

double VarianceChange(const std::vector<float>& v, const std::vector<float>& v_before, double scale,
                      double scale_before) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    const double now = scale * static_cast<double>(v[i]);
    diff += std::fabs(now - scale_before * static_cast<double>(v_before[i]));
    norm += std::fabs(now);
  }
  return norm > 0 ? diff / norm : 0.0;
}

double FreezeCheckScale(const OptimizerOptions& o, uint64_t done) {
  if (!o.bias_correction || done == 0) return 1.0;
  return 1.0 / (1.0 - std::pow(static_cast<double>(o.beta2), static_cast<double>(done)));
}

double FreezeCheckChange(const OptimizerOptions& o, uint64_t window, uint64_t done,
                         const std::vector<float>& v, const std::vector<float>& v_before) {
  if (v_before.size() != v.size() || done <= window) return 1.0;
  return VarianceChange(v, v_before, FreezeCheckScale(o, done), FreezeCheckScale(o, done - window));
}

// ---------------------------------------------------------------------------

absl::Status OptimizerCodecs::Init() {
  if (absl::Status st = ValidateOptimizerOptions(o_); !st.ok()) return st;
  auto fp32 = NewCodec(CodecKind::kFp32, o_.codec);
  auto warmup = NewCodec(o_.warmup_codec, o_.codec);
  auto w = NewCodec(o_.worker_codec, o_.codec);
  auto s = NewCodec(o_.server_codec, o_.codec);
  for (const auto* c : {&fp32, &warmup, &w, &s}) {
    if (!c->ok()) return c->status();
  }
  fp32_ = std::move(*fp32);
  warmup_codec_ = std::move(*warmup);
  worker_codec_ = std::move(*w);
  server_codec_ = std::move(*s);
  return absl::OkStatus();
}

StepKind OptimizerCodecs::KindOf(uint64_t step, Phase phase) const {
  if (o_.kind != OptimizerKind::kZeroOneAdam) return KindOfPhase(phase);
  if (phase == Phase::kWarmup) {
    return IsVarianceStep(o_.zero_one, step) ? StepKind::kFull : StepKind::kCompressed;
  }
  return IsSyncStep(o_.zero_one, step) ? StepKind::kCompressed : StepKind::kLocal;
}

const Codec& OptimizerCodecs::push_codec(StepKind kind) const {
  return kind == StepKind::kFull ? *warmup_codec_ : *worker_codec_;
}

const Codec& OptimizerCodecs::reply_codec(StepKind kind) const {
  return kind == StepKind::kFull ? *warmup_codec_ : *server_codec_;
}

size_t OptimizerCodecs::ReplyBytes(StepKind kind, uint64_t b, size_t n, bool last_warmup) const {
  size_t bytes = ReplyBytes(kind, n, last_warmup);
  if (kind == StepKind::kCompressed && RepliesRatios() && n > 0) {
    bytes += 4 * LayerPieces(o_.layer_ends, b, n).size();
  }
  return bytes;
}

size_t OptimizerCodecs::ReplyBytes(StepKind kind, size_t n, bool last_warmup) const {
  if (kind == StepKind::kLocal) return 0;
  size_t bytes = reply_codec(kind).EncodedSize(n);
  if (kind == StepKind::kFull && last_warmup && HandsOver()) bytes += 2 * fp32_->EncodedSize(n);
  if (kind == StepKind::kFull && last_warmup && HandsOverMomentum()) {
    bytes += fp32_->EncodedSize(n);
  }
  return bytes;
}

// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<ServerOptimizer>> ServerOptimizer::Create(
    const OptimizerOptions& options) {
  std::unique_ptr<ServerOptimizer> s(new ServerOptimizer(options));
  if (absl::Status st = s->Init(); !st.ok()) return st;
  return s;
}

void ServerOptimizer::InitState(uint32_t shard, uint64_t begin, uint64_t size,
                                ServerShardState* s) const {
  *s = ServerShardState{};
  s->shard = shard;
  s->begin = begin;
  s->x.assign(size, 0.0f);
  if (o_.kind != OptimizerKind::kSgd && o_.kind != OptimizerKind::kEfSgd) {
    s->m.assign(size, 0.0f);
    s->v.assign(size, 0.0f);
  }
  if (o_.kind == OptimizerKind::kZeroOneAdam) {
    s->den.assign(size, 0.0f);
    s->e.assign(size, 0.0f);
  }
  if (o_.kind == OptimizerKind::kOnebitLamb) {
    // A map not aligned to the layers leaves these empty; Step names the
    // layer that crosses the shard's end.
    auto layers = ShardLayers(o_.layer_ends, begin, size);
    if (layers.ok()) {
      s->lamb_coeff.assign(layers->size(), 0.0f);
      s->lamb_factor.assign(layers->size(), 1.0f);
    }
  }
  if (!HasWarmup(o_.kind)) EnterCompression(s);
}

void ServerOptimizer::EnterCompression(ServerShardState* s) const {
  s->frozen = true;
  s->e.assign(s->x.size(), 0.0f);
  s->v_check.clear();
  s->v_check.shrink_to_fit();
  if (o_.kind == OptimizerKind::kOnebitAdam || o_.kind == OptimizerKind::kZeroOneAdam) {
    s->m.clear();  // the server's momentum is now the synchronized one (0/1: the workers')
    s->m.shrink_to_fit();
  }
  // zero-one-adam: e, assigned zeros above, was of gradients; from here on
  // it is of the workers' summed updates, so it starts again (as DeepSpeed's).
  if (o_.kind == OptimizerKind::kZeroOneAdam) {
    for (float v : s->v) s->floored += v < o_.v_floor ? 1 : 0;
  }
}

// Adam on the averaged gradient g (overwritten with Δ); x += Δ.
absl::Status ServerOptimizer::AdamStep(uint64_t step, float lr, float* g, uint64_t off, size_t n,
                                       ServerShardState* s) const {
  float* x = s->x.data() + off;
  ForEachWeightDecay(o_, s->begin + off, n, [&](size_t p, size_t m, float wd) {
    const AdamCoefficients c =
        MakeAdamCoefficients(o_.beta1, o_.beta2, o_.eps, wd, lr, o_.bias_correction, step);
    AdamUpdate(c, m, g + p, s->m.data() + off + p, s->v.data() + off + p, x + p);
  });
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i]))
      return NotFinite(o_, "the Adam update", step, s->begin + off + i, x[i]);
  }
  return absl::OkStatus();
}

absl::Status ServerOptimizer::Step(uint64_t step, bool last_warmup, float* acc, uint64_t off,
                                   size_t n, ServerShardState* s, uint8_t* reply) const {
  return Step(step, LearningRate(o_, step), last_warmup, acc, off, n, s, reply);
}

absl::Status ServerOptimizer::Step(uint64_t step, float lr, bool last_warmup, float* acc,
                                   uint64_t off, size_t n, ServerShardState* s,
                                   uint8_t* reply) const {
  if (o_.kind == OptimizerKind::kZeroOneAdam) return ZeroOneStep(step, lr, acc, off, n, s, reply);
  if (IsLayerwise(o_.kind)) {
    if (off != 0 || n != s->x.size()) {
      return absl::InternalError(absl::StrCat(OptimizerKindName(o_.kind),
                                              " steps whole shards: StepShard takes the chunks"));
    }
    return LambStep(step, lr, last_warmup, {ChunkSpan{0, n, acc, reply}}, s);
  }
  float* x = s->x.data() + off;
  if (!s->frozen) {
    // Warm-up: the reply is Δ itself. Update and encode piece by piece, so Δ
    // is still in L2 when it is copied out (fp32 and fp16 encode element by
    // element: the pieces' encodings concatenate).
    const Codec& codec = *warmup_codec_;
    const bool exact = codec.kind() == CodecKind::kFp32;
    constexpr size_t kPiece = 16384;
    float* before = exact ? nullptr : Scratch(std::min(kPiece, n));
    for (size_t p = 0; p < n; p += kPiece) {
      const size_t m = std::min(kPiece, n - p);
      float* d = acc + p;
      // fp16: the master takes the rounded Δ the workers take.
      if (!exact) std::copy(x + p, x + p + m, before);
      if (o_.kind == OptimizerKind::kSgd) {
        for (size_t i = 0; i < m; ++i) {
          d[i] = -lr * d[i];
          x[p + i] += d[i];
        }
      } else if (absl::Status st = AdamStep(step, lr, d, off + p, m, s); !st.ok()) {
        return st;
      }
      uint8_t* out = reply + codec.EncodedSize(p);
      absl::Status st = codec.Encode(d, m, out);
      if (!st.ok()) return Diverged(o_, "the update", step, s->begin + off + p, st);
      if (!exact) {
        std::copy(before, before + m, x + p);
        if (st = codec.DecodeAdd(out, m, 1.0f, x + p); !st.ok()) return st;
      }
    }
    if (!last_warmup || !HandsOver()) return absl::OkStatus();
    // The hand-over (docs/design.md §1.1): freeze v, floored, and send m and v.
    float* v = s->v.data() + off;
    s->den.resize(s->x.size());
    // With bias correction the frozen v is the corrected one, v / (1 - b2^t),
    // divided by the same float the step itself used.
    const float k2 = MakeAdamCoefficients(o_.beta1, o_.beta2, o_.eps, o_.weight_decay, lr,
                                          o_.bias_correction, step)
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

  // Compression phase: acc is the mean of the decoded pushes, a.
  const Codec& codec = *server_codec_;
  const float* den = o_.kind == OptimizerKind::kOnebitAdam ? s->den.data() + off : nullptr;
  absl::Status st;
  if (o_.kind == OptimizerKind::kNaiveOnebitAdam || o_.reply == ReplyMode::kDelta) {
    // Replicas equal the master until the first delta reply: mirror them
    // from here (before any chunk of this step has moved the master).
    if (s->replica.size() != s->x.size()) s->replica = s->x;
    // The exact update on the master; reply C(Δ + e_s).
    if (o_.kind == OptimizerKind::kNaiveOnebitAdam) {
      st = AdamStep(step, lr, acc, off, n, s);
      if (!st.ok()) return st;
    } else {
      ForEachWeightDecay(o_, s->begin + off, n, [&](size_t p, size_t m, float wd) {
        DeltaFromMomentum(acc + p, den == nullptr ? nullptr : den + p, lr, wd, m, x + p, acc + p);
      });
    }
    st = EncodeMaybeWithFeedback(codec, o_.server_error_feedback, acc, s->e.data() + off, n, reply);
    if (!st.ok()) return Diverged(o_, "the update", step, s->begin + off, st);
    return codec.DecodeAdd(reply, n, 1.0f, s->replica.data() + off);
  }
  // Momentum reply: c_s = C(a + e_s); m̄ = D(c_s); x -= lr (m̄ / den + wd x).
  st = EncodeMaybeWithFeedback(codec, o_.server_error_feedback, acc, s->e.data() + off, n, reply);
  if (!st.ok()) return Diverged(o_, "the averaged momentum", step, s->begin + off, st);
  st = codec.Decode(reply, n, acc);
  if (!st.ok()) return st;
  ForEachWeightDecay(o_, s->begin + off, n, [&](size_t p, size_t m, float wd) {
    ApplyMomentum(acc + p, den == nullptr ? nullptr : den + p, lr, wd, m, x + p);
  });
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return NotFinite(o_, "the update", step, s->begin + off + i, x[i]);
  }
  return absl::OkStatus();
}

absl::Status ServerOptimizer::StepShard(uint64_t step, float lr, bool last_warmup,
                                        const std::vector<ChunkSpan>& chunks,
                                        ServerShardState* s) const {
  if (IsLayerwise(o_.kind)) return LambStep(step, lr, last_warmup, chunks, s);
  for (const ChunkSpan& c : chunks) {
    if (absl::Status st = Step(step, lr, last_warmup, c.acc, c.off, c.n, s, c.reply); !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

// onebit-lamb's server (docs/design.md §1.7): the whole shard, whose layers
// it holds whole. Warm-up: LAMB on the mean gradient, each layer scaled by
// its trust ratio, the reply Δ. After the freeze: the mean of the workers'
// momenta (momentum replies: through the server codec) is m; each layer
// steps with the frozen den and its frozen ratio times a factor measured
// from the v of the gradients that m implies. The reply is C(a + e_s) and
// the layers' ratios, or C(Δ + e_s).
absl::Status ServerOptimizer::LambStep(uint64_t step, float lr, bool last_warmup,
                                       const std::vector<ChunkSpan>& chunks,
                                       ServerShardState* s) const {
  const size_t n = s->x.size();
  uint64_t covered = 0;
  for (const ChunkSpan& c : chunks) {
    if (c.off != covered) break;
    covered += c.n;
  }
  if (covered != n) {
    return absl::InternalError(absl::StrCat(OptimizerKindName(o_.kind),
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
  const bool momentum_reply = s->frozen && RepliesRatios();
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
    ForEachWeightDecay(o_, s->begin + lb, le - lb, [&](size_t q, size_t c, float wd) {
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
    const float k = -lr * ratio;
    ForEachWeightDecay(o_, s->begin + lb, le - lb, [&](size_t q, size_t c, float wd) {
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
        if (HandsOver())
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
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return NotFinite(o_, "the update", step, s->begin + i, x[i]);
  }
  return absl::OkStatus();
}

// zero-one-adam's server (docs/design.md §1.6). Variance step: acc is the mean
// gradient, replied as it is; every worker runs the same Adam step on its
// own m, v and x. Other steps before the freeze: reply c_s = C(acc + e_s)
// and step m and x with its decoding. Sync steps after it: acc is the mean
// of the workers' updates u * den, x += D(c_s) / den.
absl::Status ServerOptimizer::ZeroOneStep(uint64_t step, float lr, float* acc, uint64_t off,
                                          size_t n, ServerShardState* s, uint8_t* reply) const {
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
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(x[i])) return NotFinite(o_, "the update", step, s->begin + off + i, x[i]);
    }
    return absl::OkStatus();
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
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return NotFinite(o_, "the update", step, s->begin + off + i, x[i]);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<WorkerOptimizer>> WorkerOptimizer::Create(
    const OptimizerOptions& options) {
  std::unique_ptr<WorkerOptimizer> w(new WorkerOptimizer(options));
  if (absl::Status st = w->Init(); !st.ok()) return st;
  return w;
}

void WorkerOptimizer::InitState(uint64_t d, WorkerState* s) const {
  *s = WorkerState{};
  s->x.assign(d, 0.0f);
  if (HasCompressionPhase(o_.kind)) {
    s->mbar.assign(d, 0.0f);
    s->e.assign(d, 0.0f);
  }
  if (o_.kind == OptimizerKind::kZeroOneAdam) {
    s->v.assign(d, 0.0f);
    s->den.assign(d, 0.0f);
  }
  if (!HasWarmup(o_.kind)) s->frozen = true;
}

void WorkerOptimizer::EnterCompression(WorkerState* s) const {
  s->frozen = true;
  if (o_.kind != OptimizerKind::kZeroOneAdam) return;
  // As the server's: the errors start again for the summed updates.
  std::fill(s->e.begin(), s->e.end(), 0.0f);
  s->x_sync = s->x;
  s->lrs = 0.0f;
  s->v.clear();  // frozen: den holds all that is needed of it
  s->v.shrink_to_fit();
}

void WorkerOptimizer::BeginStep(uint64_t step, float lr, WorkerState* s) const {
  (void)step;
  if (o_.kind == OptimizerKind::kZeroOneAdam && s->frozen) s->lrs += lr;
}

void WorkerOptimizer::EndStep(uint64_t step, WorkerState* s) const {
  if (o_.kind == OptimizerKind::kZeroOneAdam && s->frozen &&
      KindOf(step, Phase::kCompress) == StepKind::kCompressed) {
    s->lrs = 0.0f;
  }
}

void WorkerOptimizer::LocalUpdate(float lr, const float* g, uint64_t b, size_t n,
                                  WorkerState* s) const {
  float* m = s->mbar.data() + b;
  float* x = s->x.data() + b;
  const float* den = s->den.data() + b;
  UpdateMomentum(g, o_.beta1, 1.0f - o_.beta1, n, m);
  ForEachWeightDecay(o_, b, n, [&](size_t p, size_t c, float wd) {
    ApplyMomentum(m + p, den + p, lr, wd, c, x + p);
  });
}

absl::Status WorkerOptimizer::LocalStep(uint64_t step, float lr, const float* g, uint64_t b,
                                        size_t n, WorkerState* s) const {
  if (KindOf(step, PhaseOf(*s)) != StepKind::kLocal) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " synchronises: it is no local step"));
  }
  LocalUpdate(lr, g + b, b, n, s);
  return absl::OkStatus();
}

absl::Status WorkerOptimizer::Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                                   WorkerState* s, uint8_t* out) const {
  const StepKind kind = KindOf(step, PhaseOf(*s));
  if (kind == StepKind::kLocal) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is a local step: it sends nothing"));
  }
  if (kind == StepKind::kFull) return warmup_codec_->Encode(g + b, n, out);
  if (o_.kind == OptimizerKind::kZeroOneAdam) {
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
  const Codec& codec = *worker_codec_;
  float* e = s->e.data() + b;
  const float* y = g + b;
  if (o_.kind != OptimizerKind::kNaiveOnebitAdam) {
    // m_i = b1 m̄ + (1 - b1) g_i, kept in m̄ (a momentum reply overwrites it;
    // a delta reply leaves the worker its own momentum).
    float* m = s->mbar.data() + b;
    UpdateMomentum(y, o_.beta1, 1.0f - o_.beta1, n, m);
    y = m;
  }
  return EncodeMaybeWithFeedback(codec, o_.worker_error_feedback, y, e, n, out);
}

absl::Status HandOverDenominators(const float* v, size_t n, uint64_t first, float eps, float* den) {
  for (size_t i = 0; i < n; ++i) {
    if (!(v[i] >= 0)) {
      return absl::DataLossError(
          absl::StrCat("hand-over: negative second moment ", v[i], " at parameter ", first + i));
    }
  }
  for (size_t i = 0; i < n; ++i) den[i] = FrozenDenominator(v[i], eps);
  return absl::OkStatus();
}

absl::Status WorkerOptimizer::Apply(uint64_t step, bool last_warmup, const uint8_t* reply,
                                    uint64_t b, size_t n, WorkerState* s) const {
  return Apply(step, LearningRate(o_, step), last_warmup, reply, b, n, s);
}

absl::Status WorkerOptimizer::Apply(uint64_t step, float lr, bool last_warmup, const uint8_t* reply,
                                    uint64_t b, size_t n, WorkerState* s) const {
  if (o_.kind == OptimizerKind::kZeroOneAdam) return ZeroOneApply(step, lr, reply, b, n, s);
  float* x = s->x.data() + b;
  if (!s->frozen) {
    // x += Δ: the same fp32 addition the server applied to its master.
    const Codec& codec = *warmup_codec_;
    if (last_warmup && HandsOverMomentum()) {
      // Δ, then the momentum the worker's own starts from.
      const uint8_t* tail = reply + codec.EncodedSize(n);
      absl::Status st = codec.CheckPayload(reply, n);
      if (st.ok()) st = fp32_->CheckPayload(tail, n);
      if (st.ok()) st = codec.DecodeAdd(reply, n, 1.0f, x);
      if (st.ok()) st = fp32_->Decode(tail, n, s->mbar.data() + b);
      return st;
    }
    if (!last_warmup || !HandsOver()) return codec.DecodeAdd(reply, n, 1.0f, x);
    // The hand-over: Δ, then m and v. Everything is checked before anything
    // changes, so a bad reply leaves the state as it was.
    const uint8_t* tail = reply + codec.EncodedSize(n);
    absl::Status st = codec.CheckPayload(reply, n);
    if (st.ok()) st = fp32_->CheckPayload(tail, n);
    std::vector<float> den(n);
    if (st.ok()) st = fp32_->Decode(tail + 4 * n, n, den.data());
    if (st.ok()) st = HandOverDenominators(den.data(), n, b, o_.eps, den.data());
    if (!st.ok()) return st;
    if (s->den.size() != s->x.size()) s->den.assign(s->x.size(), 0.0f);
    st = codec.DecodeAdd(reply, n, 1.0f, x);
    if (st.ok()) st = fp32_->Decode(tail, n, s->mbar.data() + b);
    if (!st.ok()) return st;  // not reached: both were checked
    std::copy(den.begin(), den.end(), s->den.begin() + b);
    return absl::OkStatus();
  }
  const Codec& codec = *server_codec_;
  if (o_.kind == OptimizerKind::kNaiveOnebitAdam || o_.reply == ReplyMode::kDelta) {
    return codec.DecodeAdd(reply, n, 1.0f, x);
  }
  float* mbar = s->mbar.data() + b;
  if (RepliesRatios()) {
    // onebit-lamb: m̄ = D(c_s), then every layer's piece of [b, b + n) steps
    // by the ratio the server sent for it (ServerOptimizer::StepShard).
    const auto pieces = LayerPieces(o_.layer_ends, b, n);
    std::vector<float> ratios(pieces.size());
    std::memcpy(ratios.data(), reply + codec.EncodedSize(n), 4 * ratios.size());
    for (size_t j = 0; j < ratios.size(); ++j) {
      if (!std::isfinite(ratios[j])) {
        return absl::DataLossError(absl::StrCat("reply of step ", step,
                                                ": the ratio of the layer at ", b + pieces[j].first,
                                                " is not finite"));
      }
    }
    if (absl::Status st = codec.Decode(reply, n, mbar); !st.ok()) return st;
    const float* den = s->den.data() + b;
    for (size_t j = 0; j < pieces.size(); ++j) {
      const float k = -lr * ratios[j];
      const uint64_t first = pieces[j].first;
      ForEachWeightDecay(o_, b + first, pieces[j].second - first,
                         [&](size_t p, size_t c, float wd) {
                           for (size_t i = first + p; i < first + p + c; ++i) {
                             x[i] += LambDelta(mbar[i] / den[i], wd, x[i], k);
                           }
                         });
    }
    return absl::OkStatus();
  }
  absl::Status st = codec.Decode(reply, n, mbar);
  if (!st.ok()) return st;
  const float* den = o_.kind == OptimizerKind::kOnebitAdam ? s->den.data() + b : nullptr;
  ForEachWeightDecay(o_, b, n, [&](size_t p, size_t m, float wd) {
    ApplyMomentum(mbar + p, den == nullptr ? nullptr : den + p, lr, wd, m, x + p);
  });
  return absl::OkStatus();
}

// zero-one-adam's worker side of ServerOptimizer::ZeroOneStep, the same
// arithmetic on the worker's own m, v and x.
absl::Status WorkerOptimizer::ZeroOneApply(uint64_t step, float lr, const uint8_t* reply,
                                           uint64_t b, size_t n, WorkerState* s) const {
  const StepKind kind = KindOf(step, PhaseOf(*s));
  if (kind == StepKind::kLocal) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is a local step: there is no reply to apply"));
  }
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

}  // namespace onebit
