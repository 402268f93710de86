#include "worker/synthetic_model.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "models/synthetic_hash.h"

namespace onebit {

using synthetic::HashCounter;
using synthetic::Hi;

SyntheticModel::SyntheticModel(const SyntheticOptions& o) : o_(o) {
  if (o_.curvature_spread == 0.0f) return;
  // Precomputed: a pow() per parameter and step would dominate the gradient.
  const uint64_t key = synthetic::SpreadKey(o_.seed);
  spread_.resize(o_.dim);
  for (uint64_t j = 0; j < o_.dim; ++j) {
    const double u = 2.0 * Hi(HashCounter(key, j)) - 1.0;
    spread_[j] = static_cast<float>(std::pow(10.0, o_.curvature_spread * u));
  }
}

void SyntheticModel::Init(float* x) const {
  const uint64_t key = synthetic::InitKey(o_.seed);
  for (uint64_t j = 0; j < o_.dim; ++j) x[j] = 2.0f * Hi(HashCounter(key, j)) - 1.0f;
}

absl::StatusOr<double> SyntheticModel::Gradient(const float* x, uint32_t rank, uint64_t step,
                                                float* g) const {
  if (o_.skip) return 0.0;
  const uint64_t problem = synthetic::ProblemKey(o_.seed);
  const uint64_t noise = synthetic::NoiseKey(o_.seed, rank, step);
  const float* spread = spread_.empty() ? nullptr : spread_.data();
  double loss = 0;
  for (uint64_t j = 0; j < o_.dim; ++j) {
    double term;
    g[j] = synthetic::Coordinate(problem, noise, o_.noise, spread, j, x[j], &term);
    loss += term;
  }
  loss /= static_cast<double>(o_.dim);
  if (!std::isfinite(loss)) {
    return absl::InternalError(absl::StrCat("synthetic loss is not finite at step ", step));
  }
  return loss;
}

}  // namespace onebit
