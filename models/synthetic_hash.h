// The arithmetic of the synthetic model (models/synthetic_model.h), shared by
// its CPU loop and its CUDA kernel (cuda/synthetic.cu): one definition, so that
// both compute the same gradient bit for bit. Plain integer and fp32
// operations, each an IEEE operation on either side as long as no FMA is
// contracted (-ffp-contract=off for g++, -fmad=false for nvcc: both set in the
// build, docs/design.md §1.3).
#ifndef ONEBIT_MODELS_SYNTHETIC_HASH_H_
#define ONEBIT_MODELS_SYNTHETIC_HASH_H_

#include <cstdint>

#ifdef __CUDACC__
#define ONEBIT_HOST_DEVICE __host__ __device__
#else
#define ONEBIT_HOST_DEVICE
#endif

namespace onebit::synthetic {

// splitmix64's finaliser.
ONEBIT_HOST_DEVICE inline uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The counter-based generator: the mixer of a combined key.
ONEBIT_HOST_DEVICE inline uint64_t HashCounter(uint64_t key, uint64_t counter) {
  return Mix(key + 0x9e3779b97f4a7c15ULL * (counter + 1));
}

// Two uniform floats in [0, 1) from one hash: 24 bits each, exact in fp32.
ONEBIT_HOST_DEVICE inline float Hi(uint64_t h) {
  return static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
}
ONEBIT_HOST_DEVICE inline float Lo(uint64_t h) {
  return static_cast<float>((h >> 8) & 0xffffff) * (1.0f / 16777216.0f);
}

// The keys of the generator's streams: x0, the curvature spread, the problem
// (curvature and target of every coordinate), the noise of (rank, step).
ONEBIT_HOST_DEVICE inline uint64_t InitKey(uint64_t seed) {
  return Mix(seed ^ 0x5851f42d4c957f2dULL);
}
ONEBIT_HOST_DEVICE inline uint64_t SpreadKey(uint64_t seed) {
  return Mix(seed ^ 0x2545f4914f6cdd1dULL);
}
ONEBIT_HOST_DEVICE inline uint64_t ProblemKey(uint64_t seed) { return Mix(seed); }
ONEBIT_HOST_DEVICE inline uint64_t NoiseKey(uint64_t seed, uint32_t rank, uint64_t step) {
  return Mix(Mix(seed ^ (uint64_t{rank} << 40)) ^ Mix(step + 0x632be5ab));
}

// Coordinate j: returns the gradient a (x_j - c) + sigma xi and sets *loss to
// its term ½ a r² (in double). spread: the curvature-spread table, or nullptr
// when there is none.
ONEBIT_HOST_DEVICE inline float Coordinate(uint64_t problem, uint64_t noise, float sigma,
                                           const float* spread, uint64_t j, float xj,
                                           double* loss) {
  const uint64_t h = HashCounter(problem, j);
  const float a = spread == nullptr ? 0.5f + Hi(h) : (0.5f + Hi(h)) * spread[j];
  const float c = 2.0f * Lo(h) - 1.0f;
  const float xi = 2.0f * Hi(HashCounter(noise, j)) - 1.0f;
  const float r = xj - c;
  *loss = 0.5 * static_cast<double>(a) * static_cast<double>(r) * static_cast<double>(r);
  return a * r + sigma * xi;
}

}  // namespace onebit::synthetic

#endif  // ONEBIT_MODELS_SYNTHETIC_HASH_H_
