// The optimizers of onebit-ps in parameter-server form (docs/design.md §1): the
// arithmetic a server applies to its shard and a worker to its replica, chunk
// by chunk. Servers, workers and the single-process reference (reference.h)
// all call these functions, so a distributed run and the reference round the
// same way; compiled with -ffp-contract=off.
//
// Phases: steps t < freeze_step are the warm-up (plain Adam, or SGD, in fp32
// both ways); from freeze_step on, the compression phase: pushes and replies
// go through the worker and server codecs with error feedback.
//
// ServerOptimizer and WorkerOptimizer are immutable and thread-safe; the
// state structs are plain values (vectors and counters) that can be saved and
// restored as they are.
#ifndef ONEBIT_OPTIM_OPTIMIZER_H_
#define ONEBIT_OPTIM_OPTIMIZER_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "compress/codec.h"

namespace onebit {

enum class OptimizerKind : uint8_t {
  kSgd,              // plain SGD, fp32 throughout
  kAdam,             // plain Adam, fp32 throughout (a warm-up that never ends)
  kOnebitAdam,       // Adam warm-up, then frozen v and 1-bit momentum (§1.2)
  kNaiveOnebitAdam,  // Adam warm-up, then Adam on the average of 1-bit gradients
  kEfSgd,            // 1-bit error-feedback momentum SGD from step 0
  kZeroOneAdam,      // 0/1 Adam: v refreshed at growing intervals, then local steps (§1.6)
  kOnebitLamb,       // 1-bit LAMB: LAMB warm-up, then frozen v and ratios, 1-bit momentum (§1.7)
};

// What the server replies in the compression phase (docs/design.md §1.4).
enum class ReplyMode : uint8_t {
  kMomentum,  // C(synchronized momentum): every replica equals the master
  kDelta,     // C(Δ + e_s): replicas trail the master by the server error
};

enum class Phase : uint8_t { kWarmup, kCompress };

// What one step sends. Every process derives it from the step number and the
// phase alone, so no round trip is needed to agree on it.
enum class StepKind : uint8_t {
  kFull,        // fp32 both ways: the warm-up, 0/1 Adam's variance steps
  kCompressed,  // the worker and server codecs, with error feedback
  kLocal,       // nothing: 0/1 Adam's local steps
};

enum class LrScheduleKind : uint8_t { kConstant, kWarmup, kCosine };

constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

// A range [begin, end) of x with its own decoupled weight decay (0 for
// biases and norms, as BERT recipes do), in global indices.
struct DecayRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  float weight_decay = 0.0f;
};

// 0/1 Adam's schedule (docs/design.md §1.6), in the terms of DeepSpeed's
// ZeroOneAdam. Steps are counted from 1 here, as there: k = step + 1.
struct ZeroOneOptions {
  // The last k that may refresh v; steps k > var_freeze_step are local
  // steps with v frozen.
  uint64_t var_freeze_step = 100000;
  // κ: v is refreshed at k = 1, ..., κ, then at κ multiples of 2, then of
  // 4, ...: the interval doubles after every κ refreshes.
  uint32_t var_update_scaler = 64;
  // After the freeze, workers synchronise when k is a multiple of the local
  // interval; it starts at 1 and doubles every local_step_scaler steps...
  uint64_t local_step_scaler = 32678;
  // ...up to local_step_clipper (H).
  uint32_t local_step_clipper = 16;
  // The job's length: its last step always synchronises, so the job ends
  // with every replica equal to the master. 0: unknown.
  uint64_t steps = 0;
};

// 1-bit LAMB's coefficients (docs/design.md §1.7), named and defaulted as
// in DeepSpeed's OnebitLamb.
struct LambOptions {
  // The warm-up's trust ratio ||x|| / ||u|| of a layer is clipped to
  // [min_coeff, max_coeff]...
  float max_coeff = 10.0f;
  float min_coeff = 0.01f;
  // ...and averaged, c = coeff_beta c + (1 - coeff_beta) ratio; c is frozen
  // with v.
  float coeff_beta = 0.9f;
  // After the freeze a layer steps by c times a factor in [factor_min,
  // factor_max] (how far v has moved since the freeze), which changes by at
  // most factor_threshold (a fraction) per step.
  float factor_max = 4.0f;
  float factor_min = 0.5f;
  float factor_threshold = 0.1f;
};

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kSgd;
  float lr = 0.01f;
  LrScheduleKind schedule = LrScheduleKind::kConstant;
  uint64_t schedule_steps = 0;  // warmup: ramp length N; cosine: total steps
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: Δ includes -lr * wd * x
  // Sorted, disjoint ranges whose weight decay replaces weight_decay.
  std::vector<DecayRange> weight_decay_ranges;
  bool bias_correction = false;  // off, as DeepSpeed's OneBitAdam
  float v_floor = 1e-8f;         // frozen v = max(v, v_floor) (docs/design.md §1.1)
  bool worker_error_feedback = true;
  bool server_error_feedback = true;
  ReplyMode reply = ReplyMode::kMomentum;
  CodecOptions codec;                 // block size, scale rule, SIMD path
  std::string worker_codec = "fp32";  // compression-phase push codec
  std::string server_codec = "fp32";  // compression-phase reply codec
  // Warm-up pushes and replies: fp32, or fp16 (the server still sums and
  // updates in fp32, and its master takes the fp16-rounded Δ the workers
  // take, so replicas stay equal to it).
  std::string warmup_codec = "fp32";
  ZeroOneOptions zero_one;  // zero-one-adam only
  LambOptions lamb;         // onebit-lamb only
  // The model's layers (its tensors), as their ends in x: strictly
  // increasing, the last one d. onebit-lamb's trust ratios are per layer,
  // and its shard map is aligned to them (ShardMap::CreateAligned).
  std::vector<uint64_t> layer_ends;
};

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name);
absl::string_view OptimizerKindName(OptimizerKind kind);
absl::StatusOr<ReplyMode> ParseReplyMode(absl::string_view name);
absl::string_view ReplyModeName(ReplyMode mode);
// "constant", "warmup:N" or "cosine"; cosine takes its length from `steps`.
absl::Status ParseLrSchedule(absl::string_view text, uint64_t steps, OptimizerOptions* options);
// "both", "worker", "server" or "none".
absl::Status ParseErrorFeedback(absl::string_view text, OptimizerOptions* options);
std::string ErrorFeedbackName(const OptimizerOptions& options);

// 0/1 Adam's schedule, for step `step` (counted from 0): whether it
// refreshes v (only steps before the freeze do), and, after the freeze,
// whether it synchronises.
bool IsVarianceStep(const ZeroOneOptions& z, uint64_t step);
bool IsSyncStep(const ZeroOneOptions& z, uint64_t step);
// What a diverged job should try, for its error or warning: a lower --lr
// or a warm-up first, or for zero-one-adam a smaller block first.
std::string DivergenceRemedy(const OptimizerOptions& o);
// How many of the steps 0..step refresh v (none after var_freeze_step).
uint64_t VarianceRefreshes(const ZeroOneOptions& z, uint64_t step);
// 1 - beta2^r, r = VarianceRefreshes(step), computed in double and rounded
// once: a variance step's den is sqrt(max(v / this, v_floor)) + eps.
float ZeroOneVarianceCorrection(const OptimizerOptions& o, uint64_t step);

// Whether the optimizer ever leaves the warm-up, and whether it has one.
// Layer-wise optimizers (onebit-lamb) step a whole shard at once.
bool HasCompressionPhase(OptimizerKind kind);
bool HasWarmup(OptimizerKind kind);
bool IsLayerwise(OptimizerKind kind);
// The codec an optimizer uses when the user names none.
absl::string_view DefaultCodec(OptimizerKind kind);
// The codec block size (--block_size) an optimizer uses when the user
// names none: 256 for zero-one-adam, whose 1-bit codec carries raw
// gradients (docs/design.md §1.6); CodecOptions' 2048 for the rest.
uint32_t DefaultBlockSize(OptimizerKind kind);

// The fp32 arrays of n elements that a process holds for the whole job,
// for the memory check before allocating them (shard/memory.h): at least
// this much, since buffers, snapshots and the model's own come on top.
struct StateSize {
  uint64_t bytes = 0;
  std::string arrays;  // which, e.g. "x, g, mbar, e_w"
};
// A worker's replica of d parameters: x, the gradient g, and m̄, e_w for
// the compressing optimizers.
StateSize WorkerStateSize(const OptimizerOptions& options, uint64_t d);
// A server's shard of n parameters: x, the chunks' accumulators, m and v
// for the Adam family, e_s (onebit-adam's takes m's place), and the
// workers' replica under --server_reply delta.
StateSize ServerShardSize(const OptimizerOptions& options, uint64_t n);
// The reply mode an optimizer uses when the user names none.
ReplyMode DefaultReplyMode(OptimizerKind kind);

// Weight-decay ranges are non-empty, sorted, disjoint, within [0, d) (d
// kNever: unbounded) and finite; errors start with "--weight_decay: ".
absl::Status ValidateDecayRanges(const std::vector<DecayRange>& ranges, uint64_t d);
// "[0, 500): 0, [600, 700): 0.5", or "none".
std::string DecayRangesText(const std::vector<DecayRange>& ranges);

// Checks values and combinations; errors start with "--<flag>: ".
absl::Status ValidateOptimizerOptions(const OptimizerOptions& options);

// Calls fn(offset, count, wd) for the consecutive pieces of the global
// elements [b, b + n) that have one weight decay each (offset from b).
template <typename Fn>
void ForEachWeightDecay(const OptimizerOptions& o, uint64_t b, size_t n, Fn&& fn) {
  uint64_t at = b;
  const uint64_t end = b + n;
  for (const DecayRange& r : o.weight_decay_ranges) {
    if (at >= end) break;
    if (r.end <= at) continue;
    if (r.begin > at) {
      const uint64_t stop = std::min<uint64_t>(r.begin, end);
      fn(at - b, stop - at, o.weight_decay);
      at = stop;
      if (at >= end) break;
    }
    const uint64_t stop = std::min<uint64_t>(r.end, end);
    fn(at - b, stop - at, r.weight_decay);
    at = stop;
  }
  if (at < end) fn(at - b, end - at, o.weight_decay);
}

// γ_t, the same float on every process: computed in double, rounded once.
float LearningRate(const OptimizerOptions& options, uint64_t step);

// The master copy of one shard and its optimizer state.
struct ServerShardState {
  uint32_t shard = 0;
  uint64_t begin = 0;  // global index of x[0]
  uint64_t step = 0;   // completed steps
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
  // master), lrs the sum of the learning rates since then.
  std::vector<float> v;
  std::vector<float> x_sync;
  float lrs = 0.0f;
};

inline Phase PhaseOf(const ServerShardState& s) {
  return s.frozen ? Phase::kCompress : Phase::kWarmup;
}
inline Phase PhaseOf(const WorkerState& s) { return s.frozen ? Phase::kCompress : Phase::kWarmup; }

// When the warm-up ends (docs/design.md §1.4): at a fixed step, or automatically
// once every shard's v has settled. Optimizers without a warm-up ignore it.
struct FreezeOptions {
  uint64_t step = kNever;  // first compression step, when fixed
  bool automatic = false;
  double tau = 0.05;     // freeze once VarianceChange < tau on every shard...
  uint64_t window = 50;  // ...checked every `window` steps against K steps back,
  // or, settled or not, at the first check whose freeze would come at or
  // after `latest`: the warm-up takes at most this share of a job with a
  // fixed length (the 1-bit Adam paper warms up for 15-25 % of the steps);
  // 1: no such bound.
  double latest_fraction = 0.25;
  uint64_t latest = kNever;  // latest_fraction of the job's steps, rounded up
};
// "auto", "auto:TAU", "auto:TAU:K" or "auto:TAU:K:F" (F: latest_fraction).
absl::StatusOr<FreezeOptions> ParseAutoFreeze(absl::string_view text);

// Codecs and reply sizes, common to both sides.
class OptimizerCodecs {
 public:
  const OptimizerOptions& options() const { return o_; }
  // fp32, whatever the job's codecs: what the hand-over sends m and v in.
  const Codec& fp32_codec() const { return *fp32_; }
  // What step `step` sends when the state is in `phase`: kFull in the
  // warm-up and kCompressed after it, except for zero-one-adam, whose
  // variance steps are kFull, its other steps before the freeze kCompressed,
  // and after the freeze its sync steps kCompressed, the rest kLocal.
  StepKind KindOf(uint64_t step, Phase phase) const;
  // The warm-up codec for kFull steps; the worker / server codec for
  // kCompressed ones.
  const Codec& push_codec(StepKind kind) const;
  const Codec& reply_codec(StepKind kind) const;
  // Payload bytes of the reply of n elements; the last warm-up step's reply
  // also carries m and v in fp32 for onebit-adam (the hand-over), and for
  // onebit-lamb m and v (momentum replies) or m alone (delta replies).
  size_t ReplyBytes(StepKind kind, size_t n, bool last_warmup) const;
  // The same for the chunk of global elements [b, b + n): onebit-lamb's
  // momentum replies after the freeze also carry, in fp32, the step's
  // ratio (c f) of each layer the chunk overlaps, in order.
  size_t ReplyBytes(StepKind kind, uint64_t b, size_t n, bool last_warmup) const;
  // The same for the optimizers whose kind follows the phase alone
  // (kWarmup: kFull, kCompress: kCompressed).
  const Codec& push_codec(Phase phase) const { return push_codec(KindOfPhase(phase)); }
  const Codec& reply_codec(Phase phase) const { return reply_codec(KindOfPhase(phase)); }
  size_t ReplyBytes(Phase phase, size_t n, bool last_warmup) const {
    return ReplyBytes(KindOfPhase(phase), n, last_warmup);
  }

 protected:
  explicit OptimizerCodecs(const OptimizerOptions& o) : o_(o) {}
  absl::Status Init();
  // m and v at the hand-over; m alone (onebit-lamb's delta replies).
  bool HandsOver() const {
    return o_.kind == OptimizerKind::kOnebitAdam ||
           (o_.kind == OptimizerKind::kOnebitLamb && o_.reply == ReplyMode::kMomentum);
  }
  bool HandsOverMomentum() const {
    return o_.kind == OptimizerKind::kOnebitLamb && o_.reply == ReplyMode::kDelta;
  }
  // onebit-lamb's momentum replies after the freeze carry layer ratios.
  bool RepliesRatios() const {
    return o_.kind == OptimizerKind::kOnebitLamb && o_.reply == ReplyMode::kMomentum;
  }
  static StepKind KindOfPhase(Phase phase) {
    return phase == Phase::kWarmup ? StepKind::kFull : StepKind::kCompressed;
  }

  OptimizerOptions o_;
  std::unique_ptr<const Codec> fp32_, warmup_codec_, worker_codec_, server_codec_;
};

class ServerOptimizer : public OptimizerCodecs {
 public:
  static absl::StatusOr<std::unique_ptr<ServerOptimizer>> Create(const OptimizerOptions& options);

  // Sizes the state to `size` elements, x zero (the initial x arrives from
  // worker 0). Optimizers without a warm-up start in the compression phase.
  void InitState(uint32_t shard, uint64_t begin, uint64_t size, ServerShardState* s) const;

  // Applies step `step` to the shard-local elements [off, off + n), given acc,
  // the mean of the decoded pushes (clobbered: used as scratch), and writes the
  // reply payload, ReplyBytes(PhaseOf(*s), n, last_warmup) bytes. The phase is
  // the state's. `last_warmup` marks the last warm-up step: onebit-adam then
  // freezes v for these elements and appends m and v to the reply. Elementwise,
  // so chunks may come in any order. Fails, naming the first bad element, when
  // the update is not finite.
  absl::Status Step(uint64_t step, bool last_warmup, float* acc, uint64_t off, size_t n,
                    ServerShardState* s, uint8_t* reply) const;
  // The same with the step's learning rate given (the workers' loop chose
  // it) instead of LearningRate(options(), step).
  absl::Status Step(uint64_t step, float lr, bool last_warmup, float* acc, uint64_t off, size_t n,
                    ServerShardState* s, uint8_t* reply) const;

  // Layer-wise optimizers (IsLayerwise) need every chunk of a step before
  // any is done: StepShard takes them all, in order, covering the shard, and
  // writes each chunk's reply (as Step would for it alone). The result does
  // not depend on how the shard is cut. Step is StepShard with one chunk for
  // them, so then it needs the whole shard (off 0, n its size). Other
  // optimizers step chunk by chunk.
  struct ChunkSpan {
    uint64_t off = 0;  // shard-local
    size_t n = 0;
    float* acc = nullptr;  // the mean of the decoded pushes (clobbered)
    uint8_t* reply = nullptr;
  };
  absl::Status StepShard(uint64_t step, float lr, bool last_warmup,
                         const std::vector<ChunkSpan>& chunks, ServerShardState* s) const;

  // Called once every chunk of the last warm-up step is done: the shard is in
  // the compression phase from the next step on.
  void EnterCompression(ServerShardState* s) const;

 private:
  using OptimizerCodecs::OptimizerCodecs;
  absl::Status AdamStep(uint64_t step, float lr, float* g, uint64_t off, size_t n,
                        ServerShardState* s) const;
  absl::Status ZeroOneStep(uint64_t step, float lr, float* acc, uint64_t off, size_t n,
                           ServerShardState* s, uint8_t* reply) const;
  absl::Status LambStep(uint64_t step, float lr, bool last_warmup,
                        const std::vector<ChunkSpan>& chunks, ServerShardState* s) const;
};

class WorkerOptimizer : public OptimizerCodecs {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerOptimizer>> Create(const OptimizerOptions& options);

  // Sizes the state to d parameters, x zero (the model initialises it).
  void InitState(uint64_t d, WorkerState* s) const;

  // Once per step, before its pushes (or its local step), with the step's
  // learning rate; EndStep once after its last reply is applied (or after
  // LocalStep). zero-one-adam keeps the sum of learning rates there.
  void BeginStep(uint64_t step, float lr, WorkerState* s) const;
  void EndStep(uint64_t step, WorkerState* s) const;

  // The push of global elements [b, b + n) for `step`, from the gradient
  // g[b, b + n): push_codec(KindOf(step, PhaseOf(*s))).EncodedSize(n)
  // bytes into out. `lr`: the step's learning rate (a zero-one-adam sync
  // step takes its local step first).
  absl::Status Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n, WorkerState* s,
                    uint8_t* out) const;
  absl::Status Push(uint64_t step, const float* g, uint64_t b, size_t n, WorkerState* s,
                    uint8_t* out) const {
    return Push(step, LearningRate(o_, step), g, b, n, s, out);
  }
  // A step that sends nothing (kLocal): the worker's own update of x[b, b +
  // n) from g[b, b + n).
  absl::Status LocalStep(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                         WorkerState* s) const;

  // Applies the server's reply for [b, b + n), ReplyBytes(PhaseOf(*s), n,
  // last_warmup) bytes (see ServerOptimizer::Step).
  absl::Status Apply(uint64_t step, bool last_warmup, const uint8_t* reply, uint64_t b, size_t n,
                     WorkerState* s) const;
  // The same with the step's learning rate given, as ServerOptimizer::Step.
  absl::Status Apply(uint64_t step, float lr, bool last_warmup, const uint8_t* reply, uint64_t b,
                     size_t n, WorkerState* s) const;

  // Called once every reply of the last warm-up step has been applied.
  void EnterCompression(WorkerState* s) const;

 private:
  using OptimizerCodecs::OptimizerCodecs;
  absl::Status ZeroOneApply(uint64_t step, float lr, const uint8_t* reply, uint64_t b, size_t n,
                            WorkerState* s) const;
  // The local step's m and x update of [b, b + n).
  void LocalUpdate(float lr, const float* g, uint64_t b, size_t n, WorkerState* s) const;
};

// A worker's side of the hand-over (docs/design.md §1.1): den[i] =
// FrozenDenominator(v[i], eps) for the second moments the server sent for
// parameters [first, first + n). A negative or NaN v is an error naming the
// parameter, and then den is untouched. den may be v.
absl::Status HandOverDenominators(const float* v, size_t n, uint64_t first, float eps, float* den);

// The automatic freeze (docs/design.md §1.4): ||s v_t - s' v_{t-K}||_1 / ||s v_t||_1
// of a shard, s = `scale` and s' = `scale_before`, summed in double in index
// order (0 when both are zero).
double VarianceChange(const std::vector<float>& v, const std::vector<float>& v_before,
                      double scale = 1.0, double scale_before = 1.0);
// The scale of v after `done` steps in that check: the freeze keeps, and the
// warm-up divides by, the bias-corrected v / (1 - beta2^done) when
// o.bias_correction, else v itself. Without it, a v that starts from zero
// grows by the factor (1 - beta2^t) alone, so the raw change stays above
// tau = 0.05 (K = 50, beta2 = 0.999) until step ~700 whatever the gradients.
double FreezeCheckScale(const OptimizerOptions& o, uint64_t done);
// A shard's value in the check after `done` steps (a multiple of `window`):
// VarianceChange of v against v_before, the v of the check `window` steps
// earlier, each under its FreezeCheckScale; 1 (not settled) when there is
// no earlier check to compare with. The servers and the reference both call
// it, so that they decide the same freeze step.
double FreezeCheckChange(const OptimizerOptions& o, uint64_t window, uint64_t done,
                         const std::vector<float>& v, const std::vector<float>& v_before);

}  // namespace onebit

#endif  // ONEBIT_OPTIM_OPTIMIZER_H_
