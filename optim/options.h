// The settings of an optimizer in parameter-server form (docs/design.md §1) and
// the arithmetic every process derives from them alone: the learning rate of
// a step, the weight decay of an element, the automatic freeze's measure.
// Plain values; the functions are pure and thread-safe.
#ifndef ONEBIT_OPTIM_OPTIONS_H_
#define ONEBIT_OPTIM_OPTIONS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "compress/codec.h"

namespace onebit {

// The algorithms, one row each in the registry (optim/registry.h).
enum class OptimizerKind : uint8_t {
  kSgd,              // plain SGD, fp32 throughout
  kAdam,             // plain Adam, fp32 throughout (a warm-up that never ends)
  kOnebitAdam,       // Adam warm-up, then frozen v and 1-bit momentum (§1.2)
  kNaiveOnebitAdam,  // Adam warm-up, then Adam on the average of 1-bit gradients
  kEfSgd,            // 1-bit error-feedback momentum SGD from step 0
  kZeroOneAdam,      // 0/1 Adam: v refreshed at growing intervals, then local steps (§1.6)
  kOnebitLamb,       // 1-bit LAMB: LAMB warm-up, then frozen v and ratios, 1-bit momentum (§1.7)
  kDiloco,           // DiLoCo: local AdamW steps, an outer Nesterov step on the servers (§1.8)
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
  kLocal,       // nothing: 0/1 Adam's and DiLoCo's local steps
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

// A range [begin, end) of x whose learning rate is the job's times
// lr_scale (torch param groups with their own lr, e.g. layer-wise decay in
// fine-tuning), in global indices. The scale multiplies the step's lr, so a
// schedule moves every range alike.
struct LrScaleRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  float lr_scale = 1.0f;
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

// DiLoCo's outer loop (docs/design.md §1.8): every worker takes inner AdamW
// steps on its own replica; every `sync_every` steps the servers average the
// workers' outer gradients x_sync - x and take one Nesterov step with them.
struct DilocoOptions {
  uint32_t sync_every = 32;     // H: inner steps per outer step
  float outer_lr = 0.7f;        // DiLoCo's defaults
  float outer_momentum = 0.9f;  // Nesterov; 0: plain averaging steps
  // F, Streaming DiLoCo's fragments: groups of whole shards (shard k is in
  // fragment k F / S), fragment f synchronised at the steps t with
  // (t + 1 + f H / F) mod H = 0 (integer division), so that the wire carries
  // 1/F of the model at a time. 1: the whole model every H steps.
  uint32_t fragments = 1;
  // tau, the inner steps a sync overlaps: the worker pushes at a sync step
  // and goes on with its inner steps; at the end of tau steps later it
  // merges its local fragment with the outer step's result,
  // x = x_sync + sync_mix (x - x_sync) (Streaming DiLoCo's overlapped
  // variant). A reply due past the job's second-to-last step is merged
  // there. 0: the worker waits for the reply and starts again from it.
  uint32_t sync_delay = 0;
  float sync_mix = 0.5f;  // alpha: the local model's weight in the merge
  // The job's length: its last step always synchronises, so the job ends
  // with every replica equal to the master. 0: unknown.
  uint64_t steps = 0;
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
  // Sorted, disjoint ranges that step at lr * lr_scale (elsewhere: lr).
  std::vector<LrScaleRange> lr_scale_ranges;
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
  DilocoOptions diloco;     // diloco only
  // The model's layers (its tensors), as their ends in x: strictly
  // increasing, the last one d. onebit-lamb's trust ratios are per layer,
  // and its shard map is aligned to them (ShardMap::CreateAligned).
  std::vector<uint64_t> layer_ends;
  // The first element of each shard, in shard order (the job's shard map):
  // diloco's fragments are groups of them. Needed when diloco.fragments > 1.
  std::vector<uint64_t> shard_begins;
};

// An InvalidArgument error "--<flag>: <why>" that carries the setting's name
// as a payload, so that whoever reports it can name the flag without
// parsing the text.
absl::Status SettingError(absl::string_view flag, absl::string_view why);
// The setting a SettingError names; "" for any other status.
std::string SettingOfError(const absl::Status& status);

absl::StatusOr<ReplyMode> ParseReplyMode(absl::string_view name);
absl::string_view ReplyModeName(ReplyMode mode);
// "constant", "warmup:N" or "cosine"; cosine takes its length from `steps`.
absl::Status ParseLrSchedule(absl::string_view text, uint64_t steps, OptimizerOptions* options);
// "both", "worker", "server" or "none".
absl::Status ParseErrorFeedback(absl::string_view text, OptimizerOptions* options);
std::string ErrorFeedbackName(const OptimizerOptions& options);

// Weight-decay ranges are non-empty, sorted, disjoint, within [0, d) (d
// kNever: unbounded) and finite; errors start with "--weight_decay: ".
absl::Status ValidateDecayRanges(const std::vector<DecayRange>& ranges, uint64_t d);
// "[0, 500): 0, [600, 700): 0.5", or "none".
std::string DecayRangesText(const std::vector<DecayRange>& ranges);
// Lr-scale ranges are non-empty, sorted, disjoint, within [0, d) (d kNever:
// unbounded), finite and >= 0; errors start with "--lr: ".
absl::Status ValidateLrScaleRanges(const std::vector<LrScaleRange>& ranges, uint64_t d);
// "[0, 500): x0.5, [600, 700): x2", or "none".
std::string LrScaleRangesText(const std::vector<LrScaleRange>& ranges);

// Calls fn(offset, count, wd, lr_scale) for the consecutive pieces of the
// global elements [b, b + n) that have one weight decay and one lr scale
// each (offset from b), in order. Every update that uses lr or wd goes
// through it, so each element steps with its own range's settings.
template <typename Fn>
void ForEachRangeSetting(const OptimizerOptions& o, uint64_t b, size_t n, Fn&& fn) {
  size_t i = 0, j = 0;
  uint64_t at = b;
  const uint64_t end = b + n;
  // The value at `at` of one sorted list of ranges (`fallback` outside
  // them), moving *k past the ranges that end before it and cutting `stop`
  // at the next boundary.
  auto value_at = [&](const auto& ranges, size_t* k, float fallback, auto value, uint64_t* stop) {
    while (*k < ranges.size() && ranges[*k].end <= at) ++*k;
    if (*k == ranges.size()) return fallback;
    const auto& r = ranges[*k];
    *stop = std::min<uint64_t>(*stop, r.begin <= at ? r.end : r.begin);
    return r.begin <= at ? value(r) : fallback;
  };
  while (at < end) {
    uint64_t stop = end;
    const float decay = value_at(
        o.weight_decay_ranges, &i, o.weight_decay,
        [](const DecayRange& r) { return r.weight_decay; }, &stop);
    const float scale = value_at(
        o.lr_scale_ranges, &j, 1.0f, [](const LrScaleRange& r) { return r.lr_scale; }, &stop);
    fn(at - b, stop - at, decay, scale);
    at = stop;
  }
}

// γ_t, the same float on every process: computed in double, rounded once.
float LearningRate(const OptimizerOptions& options, uint64_t step);

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

#endif  // ONEBIT_OPTIM_OPTIONS_H_
