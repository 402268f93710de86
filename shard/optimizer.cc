#include "shard/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "shard/update_kernels.h"

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

absl::Status NotFinite(absl::string_view what, uint64_t step, uint64_t global_index, float value) {
  return absl::InternalError(absl::StrCat(what, " of step ", step, " is not finite at parameter ",
                                          global_index, " (", value,
                                          "): training diverged; lower --lr or raise --v-floor"));
}

// A codec refused a vector that starts at global index `begin`.
absl::Status Diverged(absl::string_view what, uint64_t step, uint64_t begin,
                      const absl::Status& codec_error) {
  return absl::InternalError(absl::StrCat(what, " of step ", step, " (parameters from ", begin,
                                          ") cannot be encoded: ", codec_error.message(),
                                          "; training diverged: lower --lr or raise --v-floor"));
}

}  // namespace

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name) {
  if (name == "sgd") return OptimizerKind::kSgd;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "onebit-adam") return OptimizerKind::kOnebitAdam;
  if (name == "naive-onebit-adam") return OptimizerKind::kNaiveOnebitAdam;
  if (name == "ef-sgd") return OptimizerKind::kEfSgd;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown optimizer '", name, "' (want sgd, adam, onebit-adam, naive-onebit-adam or ef-sgd)"));
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
                                      "': want auto, auto:TAU or auto:TAU:K "
                                      "(0 < TAU, K >= 1)"));
  };
  if (parts[0] != "auto" || parts.size() > 3) return bad();
  if (parts.size() >= 2 && (!absl::SimpleAtod(parts[1], &f.tau) || !(f.tau > 0))) return bad();
  if (parts.size() == 3 && (!absl::SimpleAtoi(parts[2], &f.window) || f.window < 1)) return bad();
  return f;
}

bool HasCompressionPhase(OptimizerKind kind) {
  return kind == OptimizerKind::kOnebitAdam || kind == OptimizerKind::kNaiveOnebitAdam ||
         kind == OptimizerKind::kEfSgd;
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
  return SizeOf(arrays, d);
}

StateSize ServerShardSize(const OptimizerOptions& o, uint64_t n) {
  std::vector<const char*> arrays = {"x", "the accumulators"};
  const bool adam = o.kind != OptimizerKind::kSgd && o.kind != OptimizerKind::kEfSgd;
  if (adam) arrays.insert(arrays.end(), {"m", "v"});
  // onebit-adam drops m when e_s arrives.
  if (HasCompressionPhase(o.kind) && o.kind != OptimizerKind::kOnebitAdam) arrays.push_back("e_s");
  if (o.reply == ReplyMode::kDelta) arrays.push_back("the replica");
  return SizeOf(arrays, n);
}

absl::string_view DefaultCodec(OptimizerKind kind) {
  return HasCompressionPhase(kind) ? "onebit" : "fp32";
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

double VarianceChange(const std::vector<float>& v, const std::vector<float>& v_before) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    diff += std::fabs(static_cast<double>(v[i]) - static_cast<double>(v_before[i]));
    norm += std::fabs(static_cast<double>(v[i]));
  }
  return norm > 0 ? diff / norm : 0.0;
}

// ---------------------------------------------------------------------------

absl::Status OptimizerCodecs::Init() {
  if (absl::Status st = ValidateOptimizerOptions(o_); !st.ok()) return st;
  auto fp32 = NewCodec(CodecKind::kFp32, o_.codec);
  auto w = NewCodec(o_.worker_codec, o_.codec);
  auto s = NewCodec(o_.server_codec, o_.codec);
  for (const auto* c : {&fp32, &w, &s}) {
    if (!c->ok()) return c->status();
  }
  fp32_ = std::move(*fp32);
  worker_codec_ = std::move(*w);
  server_codec_ = std::move(*s);
  return absl::OkStatus();
}

const Codec& OptimizerCodecs::push_codec(Phase phase) const {
  return phase == Phase::kCompress ? *worker_codec_ : *fp32_;
}

const Codec& OptimizerCodecs::reply_codec(Phase phase) const {
  return phase == Phase::kCompress ? *server_codec_ : *fp32_;
}

size_t OptimizerCodecs::ReplyBytes(Phase phase, size_t n, bool last_warmup) const {
  size_t bytes = reply_codec(phase).EncodedSize(n);
  if (phase == Phase::kWarmup && last_warmup && HandsOver()) bytes += 2 * fp32_->EncodedSize(n);
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
  if (!HasWarmup(o_.kind)) EnterCompression(s);
}

void ServerOptimizer::EnterCompression(ServerShardState* s) const {
  s->frozen = true;
  s->e.assign(s->x.size(), 0.0f);
  s->v_check.clear();
  s->v_check.shrink_to_fit();
  if (o_.kind == OptimizerKind::kOnebitAdam) {
    s->m.clear();  // the server's momentum is now the synchronized one
    s->m.shrink_to_fit();
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
    if (!std::isfinite(x[i])) return NotFinite("the Adam update", step, s->begin + off + i, x[i]);
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
  float* x = s->x.data() + off;
  if (!s->frozen) {
    // Warm-up: full precision both ways; the reply is Δ itself. Update and
    // encode piece by piece, so Δ is still in L2 when it is copied out (fp32
    // encodes element by element: the pieces' encodings concatenate).
    constexpr size_t kPiece = 16384;
    for (size_t p = 0; p < n; p += kPiece) {
      const size_t m = std::min(kPiece, n - p);
      float* d = acc + p;
      if (o_.kind == OptimizerKind::kSgd) {
        for (size_t i = 0; i < m; ++i) {
          d[i] = -lr * d[i];
          x[p + i] += d[i];
        }
      } else if (absl::Status st = AdamStep(step, lr, d, off + p, m, s); !st.ok()) {
        return st;
      }
      absl::Status st = fp32_->Encode(d, m, reply + 4 * p);
      if (!st.ok()) return Diverged("the update", step, s->begin + off + p, st);
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
    uint8_t* tail = reply + fp32_->EncodedSize(n);
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
    st = o_.server_error_feedback ? codec.EncodeWithFeedback(acc, s->e.data() + off, n, reply)
                                  : codec.Encode(acc, n, reply);
    if (!st.ok()) return Diverged("the update", step, s->begin + off, st);
    return codec.DecodeAdd(reply, n, 1.0f, s->replica.data() + off);
  }
  // Momentum reply: c_s = C(a + e_s); m̄ = D(c_s); x -= lr (m̄ / den + wd x).
  st = o_.server_error_feedback ? codec.EncodeWithFeedback(acc, s->e.data() + off, n, reply)
                                : codec.Encode(acc, n, reply);
  if (!st.ok()) return Diverged("the averaged momentum", step, s->begin + off, st);
  st = codec.Decode(reply, n, acc);
  if (!st.ok()) return st;
  ForEachWeightDecay(o_, s->begin + off, n, [&](size_t p, size_t m, float wd) {
    ApplyMomentum(acc + p, den == nullptr ? nullptr : den + p, lr, wd, m, x + p);
  });
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return NotFinite("the update", step, s->begin + off + i, x[i]);
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
  if (!HasWarmup(o_.kind)) s->frozen = true;
}

void WorkerOptimizer::EnterCompression(WorkerState* s) const { s->frozen = true; }

absl::Status WorkerOptimizer::Push(uint64_t step, const float* g, uint64_t b, size_t n,
                                   WorkerState* s, uint8_t* out) const {
  (void)step;
  if (!s->frozen) return fp32_->Encode(g + b, n, out);
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
  return o_.worker_error_feedback ? codec.EncodeWithFeedback(y, e, n, out)
                                  : codec.Encode(y, n, out);
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
  (void)step;
  float* x = s->x.data() + b;
  if (!s->frozen) {
    // x += Δ: the same fp32 addition the server applied to its master.
    if (!last_warmup || !HandsOver()) return fp32_->DecodeAdd(reply, n, 1.0f, x);
    // The hand-over: Δ, then m and v. Everything is checked before anything
    // changes, so a bad reply leaves the state as it was.
    const uint8_t* tail = reply + fp32_->EncodedSize(n);
    absl::Status st = fp32_->CheckPayload(reply, n);
    if (st.ok()) st = fp32_->CheckPayload(tail, n);
    std::vector<float> den(n);
    if (st.ok()) st = fp32_->Decode(tail + 4 * n, n, den.data());
    if (st.ok()) st = HandOverDenominators(den.data(), n, b, o_.eps, den.data());
    if (!st.ok()) return st;
    if (s->den.size() != s->x.size()) s->den.assign(s->x.size(), 0.0f);
    st = fp32_->DecodeAdd(reply, n, 1.0f, x);
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
  absl::Status st = codec.Decode(reply, n, mbar);
  if (!st.ok()) return st;
  const float* den = o_.kind == OptimizerKind::kOnebitAdam ? s->den.data() + b : nullptr;
  ForEachWeightDecay(o_, b, n, [&](size_t p, size_t m, float wd) {
    ApplyMomentum(mbar + p, den == nullptr ? nullptr : den + p, lr, wd, m, x + p);
  });
  return absl::OkStatus();
}

}  // namespace onebit
