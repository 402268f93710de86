#include "optim/options.h"

#include <cmath>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace onebit {
namespace {

constexpr absl::string_view kSettingPayload = "type.onebit/setting";

}  // namespace

absl::Status SettingError(absl::string_view flag, absl::string_view why) {
  absl::Status st = absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", why));
  st.SetPayload(kSettingPayload, absl::Cord(flag));
  return st;
}

std::string SettingOfError(const absl::Status& status) {
  const auto flag = status.GetPayload(kSettingPayload);
  return flag.has_value() ? std::string(*flag) : std::string();
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
    if (steps == 0) return SettingError("lr_schedule", "cosine needs the job's length (--steps)");
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
  return SettingError("lr_schedule", "want constant, warmup:N (N >= 1) or cosine");
}

absl::Status ParseErrorFeedback(absl::string_view text, OptimizerOptions* o) {
  if (text != "both" && text != "worker" && text != "server" && text != "none") {
    return SettingError("error_feedback",
                        absl::StrCat("'", text, "': want both, worker, server or none"));
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
    return SettingError("freeze", absl::StrCat("'", text,
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

namespace {

// The two kinds of range share their rules; `value` reads a range's setting,
// `what` names it in the error.
template <typename Range, typename Value>
absl::Status ValidateRanges(const std::vector<Range>& ranges, uint64_t d, absl::string_view flag,
                            absl::string_view what, Value value, bool non_negative) {
  uint64_t last_end = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    const float v = value(r);
    if (r.begin >= r.end || (i > 0 && r.begin < last_end) || (d != kNever && r.end > d) ||
        !std::isfinite(v) || (non_negative && v < 0)) {
      return SettingError(
          flag,
          absl::StrCat(
              "range ", i, " [", r.begin, ", ", r.end, ") with ", what, " ", v,
              ": ranges must be non-empty, sorted, disjoint",
              d != kNever ? absl::StrCat(", within the d = ", d, " parameters") : std::string(),
              non_negative ? ", with a finite value >= 0" : ", with a finite value"));
    }
    last_end = r.end;
  }
  return absl::OkStatus();
}

template <typename Range, typename Text>
std::string RangesText(const std::vector<Range>& ranges, Text text) {
  if (ranges.empty()) return "none";
  std::vector<std::string> parts;
  for (const Range& r : ranges) {
    parts.push_back(absl::StrCat("[", r.begin, ", ", r.end, "): ", text(r)));
  }
  return absl::StrJoin(parts, ", ");
}

}  // namespace

std::string DecayRangesText(const std::vector<DecayRange>& ranges) {
  return RangesText(ranges, [](const DecayRange& r) { return absl::StrCat(r.weight_decay); });
}

absl::Status ValidateDecayRanges(const std::vector<DecayRange>& ranges, uint64_t d) {
  return ValidateRanges(
      ranges, d, "weight_decay", "weight decay", [](const DecayRange& r) { return r.weight_decay; },
      false);
}

std::string LrScaleRangesText(const std::vector<LrScaleRange>& ranges) {
  return RangesText(ranges, [](const LrScaleRange& r) { return absl::StrCat("x", r.lr_scale); });
}

absl::Status ValidateLrScaleRanges(const std::vector<LrScaleRange>& ranges, uint64_t d) {
  return ValidateRanges(
      ranges, d, "lr", "lr scale", [](const LrScaleRange& r) { return r.lr_scale; }, true);
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

}  // namespace onebit
