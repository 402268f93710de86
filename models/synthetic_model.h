// The synthetic model: a noisy quadratic
//   f_rank,step(x) = 1/d Σ_j ½ a_j (x_j - c_j)²,  ∇_j = a_j (x_j - c_j) + σ ξ_j
// with curvatures a_j ∈ [0.5, 1.5) (times 10^(spread·u_j), u_j ∈ [-1, 1), for an
// ill-conditioned problem with --curvature_spread), targets c_j ∈ [-1, 1), x0_j ∈ [-1, 1) and
// noise ξ_j ∈ [-1, 1) drawn from a counter-based hash of (seed, j) and
// (seed, rank, step, j): no tables, so it runs from 10 to 300 M parameters in
// O(1) memory and gives the same numbers on every host. (The gradient is of
// the unnormalised sum; the loss is reported per parameter.) The arithmetic
// is in models/synthetic_hash.h, shared with the GPU version (cuda/synthetic.h).
#ifndef ONEBIT_MODELS_SYNTHETIC_MODEL_H_
#define ONEBIT_MODELS_SYNTHETIC_MODEL_H_

#include <vector>

#include "models/model.h"
#include "models/synthetic_hash.h"

namespace onebit {

struct SyntheticOptions {
  uint64_t dim = 1000;
  uint64_t seed = 1;
  float noise = 0.1f;
  // Curvatures spread over 10^±spread: coordinates of very different scales
  // share a codec block, as in real models. 0: a_j ∈ [0.5, 1.5).
  float curvature_spread = 0.0f;
  // Data-plane benchmark: Gradient() leaves g as it is and returns 0.
  bool skip = false;
};

class SyntheticModel final : public Model {
 public:
  explicit SyntheticModel(const SyntheticOptions& o);
  uint64_t num_params() const override { return o_.dim; }
  void Init(float* x) const override;
  absl::StatusOr<double> Gradient(const float* x, uint32_t rank, uint64_t step,
                                  float* g) const override;

  const SyntheticOptions& options() const { return o_; }
  // The curvature factors 10^(spread·u_j), j < dim; empty when
  // curvature_spread is 0 (then the factor is 1).
  const std::vector<float>& spread() const { return spread_; }

 private:
  const SyntheticOptions o_;
  std::vector<float> spread_;  // 10^(spread·u_j), only when spread != 0
};

}  // namespace onebit

#endif  // ONEBIT_MODELS_SYNTHETIC_MODEL_H_
