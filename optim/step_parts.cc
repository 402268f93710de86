#include "optim/step_parts.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "optim/registry.h"
#include "optim/update_kernels.h"

namespace onebit {

float* Scratch(size_t n) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < n) scratch.resize(n);
  return scratch.data();
}

absl::Status EncodeMaybeWithFeedback(const Codec& codec, bool feedback, const float* y, float* e,
                                     size_t n, uint8_t* out) {
  return feedback ? codec.EncodeWithFeedback(y, e, n, out) : codec.Encode(y, n, out);
}

absl::Status CheckLocalGradient(const ArrayOps& ops, uint64_t step, const float* g, uint64_t b,
                                size_t n) {
  absl::StatusOr<size_t> bad = ops.FirstNonFinite(g + b, n);
  if (!bad.ok()) return bad.status();
  if (*bad == n) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the gradient of step ", step, " is not finite in elements [", b, ", ", b + n, ") at index ",
      *bad, " (element ", b + *bad, " of x): the loss or the model made it; nothing was updated"));
}

absl::Status NotFinite(const OptimizerOptions& o, absl::string_view what, uint64_t step,
                       uint64_t global_index, float value) {
  return absl::InternalError(absl::StrCat(what, " of step ", step, " is not finite at parameter ",
                                          global_index, " (", value, "): training diverged; try ",
                                          DivergenceRemedy(o)));
}

absl::Status Diverged(const OptimizerOptions& o, absl::string_view what, uint64_t step,
                      uint64_t begin, const absl::Status& codec_error) {
  return absl::InternalError(absl::StrCat(what, " of step ", step, " (parameters from ", begin,
                                          ") cannot be encoded: ", codec_error.message(),
                                          "; training diverged; try ", DivergenceRemedy(o)));
}

absl::Status CheckFinite(const OptimizerOptions& o, absl::string_view what, uint64_t step,
                         uint64_t first, const float* x, size_t n) {
  const size_t i = FirstNonFinite(x, n);
  return i < n ? NotFinite(o, what, step, first + i, x[i]) : absl::OkStatus();
}

absl::Status AdamStepOnShard(const OptimizerOptions& o, uint64_t step, float lr, float* g,
                             uint64_t off, size_t n, ServerShardState* s) {
  float* x = s->x.data() + off;
  ForEachRangeSetting(o, s->begin + off, n, [&](size_t p, size_t m, float wd, float ls) {
    const AdamCoefficients c = MakeAdamCoefficients(o.beta1, o.beta2, o.eps, wd, lr * ls,
                                                    o.bias_correction, s->bias_steps + step);
    AdamUpdate(c, m, g + p, s->m.data() + off + p, s->v.data() + off + p, x + p);
  });
  return CheckFinite(o, "the Adam update", step, s->begin + off, x, n);
}

void SizeAdamMoments(ServerShardState* s) {
  s->m.assign(s->x.size(), 0.0f);
  s->v.assign(s->x.size(), 0.0f);
}

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

}  // namespace onebit
