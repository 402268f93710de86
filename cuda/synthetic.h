// The GPU twin of the synthetic model's gradient (models/synthetic_model.h):
// one kernel running the same per-coordinate code as the CPU loop
// (models/synthetic_hash.h), compiled without FMA contraction, so that g is
// bitwise equal to SyntheticModel::Gradient's. The loss, a sum in double, is
// reduced per thread, then per thread block, then over the blocks: another
// order than the CPU's sequential sum, so it agrees to rounding only (about
// 1e-16 relative per term; the terms are all >= 0). The grid is fixed, so a
// given x gives the same loss bits on every GPU.
//
// Requires a build with ONEBIT_WITH_CUDA (target onebit_cuda_kernels). Its CPU
// twin is SyntheticModel::Gradient.
#ifndef ONEBIT_CUDA_SYNTHETIC_H_
#define ONEBIT_CUDA_SYNTHETIC_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "cuda/kernels.h"

namespace onebit::cuda {

// Doubles of device scratch SyntheticGradient needs: one partial loss per
// thread block of its (fixed) grid.
inline constexpr size_t kSyntheticPartials = 1024;

// The synthetic problem (SyntheticOptions) as the kernel needs it. spread:
// the device copy of SyntheticModel::spread() (dim floats), or nullptr when
// that table is empty.
struct SyntheticProblem {
  uint64_t dim = 0;
  uint64_t seed = 1;
  float noise = 0.1f;
  const float* spread = nullptr;
};

// Enqueues on `stream`: g[j] for j < dim as SyntheticModel::Gradient(x, rank,
// step, g) computes it, and *loss_sum = the sum over j of ½ a_j r_j² in double
// (not yet divided by dim). x, g, partials (kSyntheticPartials doubles) and
// loss_sum are device pointers; g must not overlap x. Returns once the work is
// enqueued (launch errors only). dim == 0 writes *loss_sum = 0.
absl::Status SyntheticGradient(const SyntheticProblem& p, const float* x, uint32_t rank,
                               uint64_t step, float* g, double* partials, double* loss_sum,
                               Stream stream);

}  // namespace onebit::cuda

#endif  // ONEBIT_CUDA_SYNTHETIC_H_
