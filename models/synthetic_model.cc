#include "models/synthetic_model.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "models/registry.h"
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
    return absl::InternalError(
        absl::StrCat("synthetic: loss is not finite (", loss, ") at rank ", rank, " step ", step));
  }
  return loss;
}

namespace {

absl::StatusOr<uint64_t> SyntheticParams(const control::TrainingConfig& c) {
  return c.model().dim();
}

absl::Status ValidateSynthetic(const control::TrainingConfig& c) {
  if (!std::isfinite(c.model().noise()) || c.model().noise() < 0) {
    return absl::InvalidArgumentError("--noise: must be finite and >= 0");
  }
  if (!(c.model().curvature_spread() >= 0 && c.model().curvature_spread() <= 6)) {
    return absl::InvalidArgumentError("--curvature_spread: must lie in [0, 6]");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Model>> MakeSynthetic(const control::TrainingConfig& c) {
  SyntheticOptions o;
  o.dim = c.model().dim();
  o.seed = c.model().seed();
  o.noise = c.model().noise();
  o.curvature_spread = c.model().curvature_spread();
  o.skip = c.model().skip_model();
  return std::unique_ptr<Model>(new SyntheticModel(o));
}

}  // namespace

// Its settings are job settings of their own (--dim ...), from before the registry.
extern const ModelEntry kSyntheticModel = {
    "synthetic",
    "a noisy quadratic over d = --dim parameters, no data set",
    "--dim --noise --curvature_spread --skip_model",
    {},
    SyntheticParams,
    ValidateSynthetic,
    nullptr,
    MakeSynthetic,
};

}  // namespace onebit
