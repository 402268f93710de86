#include "worker/synthetic_model.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace onebit {
namespace {

inline uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Two uniform floats in [0, 1) from one hash: 24 bits each, exact in fp32.
inline float Hi(uint64_t h) { return static_cast<float>(h >> 40) * (1.0f / 16777216.0f); }
inline float Lo(uint64_t h) {
  return static_cast<float>((h >> 8) & 0xffffff) * (1.0f / 16777216.0f);
}

}  // namespace

uint64_t HashCounter(uint64_t key, uint64_t counter) {
  return Mix(key + 0x9e3779b97f4a7c15ULL * (counter + 1));
}

SyntheticModel::SyntheticModel(const SyntheticOptions& o) : o_(o) {
  if (o_.curvature_spread == 0.0f) return;
  // Precomputed: a pow() per parameter and step would dominate the gradient.
  const uint64_t key = Mix(o_.seed ^ 0x2545f4914f6cdd1dULL);
  spread_.resize(o_.dim);
  for (uint64_t j = 0; j < o_.dim; ++j) {
    const double u = 2.0 * Hi(HashCounter(key, j)) - 1.0;
    spread_[j] = static_cast<float>(std::pow(10.0, o_.curvature_spread * u));
  }
}

void SyntheticModel::Init(float* x) const {
  const uint64_t key = Mix(o_.seed ^ 0x5851f42d4c957f2dULL);
  for (uint64_t j = 0; j < o_.dim; ++j) x[j] = 2.0f * Hi(HashCounter(key, j)) - 1.0f;
}

absl::StatusOr<double> SyntheticModel::Gradient(const float* x, uint32_t rank, uint64_t step,
                                                float* g) const {
  if (o_.skip) return 0.0;
  const uint64_t problem = Mix(o_.seed);
  const uint64_t noise_key = Mix(Mix(o_.seed ^ (uint64_t{rank} << 40)) ^ Mix(step + 0x632be5ab));
  const float sigma = o_.noise;
  double loss = 0;
  for (uint64_t j = 0; j < o_.dim; ++j) {
    const uint64_t h = HashCounter(problem, j);
    const float a = spread_.empty() ? 0.5f + Hi(h) : (0.5f + Hi(h)) * spread_[j];
    const float c = 2.0f * Lo(h) - 1.0f;
    const float xi = 2.0f * Hi(HashCounter(noise_key, j)) - 1.0f;
    const float r = x[j] - c;
    g[j] = a * r + sigma * xi;
    loss += 0.5 * static_cast<double>(a) * static_cast<double>(r) * static_cast<double>(r);
  }
  loss /= static_cast<double>(o_.dim);
  if (!std::isfinite(loss)) {
    return absl::InternalError(absl::StrCat("synthetic loss is not finite at step ", step));
  }
  return loss;
}

}  // namespace onebit
