// The synthetic model's gradient kernel (cuda/synthetic.h). Compiled with
// -fmad=false (cuda/CMakeLists.txt): synthetic::Coordinate's multiplies and
// adds must round one by one, as on the CPU.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/cuda_status.h"
#include "cuda/synthetic.h"
#include "models/synthetic_hash.h"

namespace onebit::cuda {
namespace {

constexpr int kThreads = 256;

// The tree sum of one value per thread of the block (kThreads of them);
// the result in thread 0.
__device__ double BlockSum(double t) {
  __shared__ double s[kThreads];
  s[threadIdx.x] = t;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) s[threadIdx.x] += s[threadIdx.x + w];
    __syncthreads();
  }
  return s[0];
}

// Grid-stride over the coordinates; each block leaves its loss in partials.
__global__ void __launch_bounds__(kThreads)
    SyntheticKernel(const float* x, uint64_t dim, uint64_t problem, uint64_t noise, float sigma,
                    const float* spread, float* g, double* partials) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
  double t = 0;
  for (uint64_t j = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; j < dim;
       j += stride) {
    double term;
    g[j] = synthetic::Coordinate(problem, noise, sigma, spread, j, x[j], &term);
    t += term;
  }
  const double sum = BlockSum(t);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// One block: thread i adds partials i, i + kThreads, ... in order, then the tree.
__global__ void __launch_bounds__(kThreads)
    SumPartialsKernel(const double* partials, unsigned n, double* out) {
  double t = 0;
  for (unsigned i = threadIdx.x; i < n; i += kThreads) t += partials[i];
  const double sum = BlockSum(t);
  if (threadIdx.x == 0) *out = sum;
}

}  // namespace

absl::Status SyntheticGradient(const SyntheticProblem& p, const float* x, uint32_t rank,
                               uint64_t step, float* g, double* partials, double* loss_sum,
                               Stream stream) {
  // The grid depends on dim only, not on the GPU: the loss's summation order,
  // hence its bits, are the same everywhere.
  const uint64_t want = (p.dim + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(std::clamp<uint64_t>(want, 1, kSyntheticPartials));
  SyntheticKernel<<<blocks, kThreads, 0, stream>>>(x, p.dim, synthetic::ProblemKey(p.seed),
                                                   synthetic::NoiseKey(p.seed, rank, step), p.noise,
                                                   p.spread, g, partials);
  if (absl::Status st = CudaError(cudaGetLastError(), "synthetic_gradient"); !st.ok()) return st;
  SumPartialsKernel<<<1, kThreads, 0, stream>>>(partials, blocks, loss_sum);
  return CudaError(cudaGetLastError(), "synthetic_gradient (loss)");
}

}  // namespace onebit::cuda
