// A small deterministic random generator for data shuffling and model
// initialisation. std::shuffle and std::uniform_*_distribution are
// implementation-defined, so every worker process on every platform must draw
// from this instead to agree on the same numbers.
#ifndef ONEBIT_MODELS_RNG_H_
#define ONEBIT_MODELS_RNG_H_

#include <cstdint>

namespace onebit {

// splitmix64's finaliser: a bijective 64-bit mixer.
inline uint64_t SplitMix64Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// splitmix64 (Steele, Lea, Flood 2014): a 64-bit counter run through the mixer.
// Not thread-safe (it has a state); cheap to copy.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    state_ += 0x9e3779b97f4a7c15ULL;
    return SplitMix64Mix(state_);
  }

  // Uniform on [0, n); requires n > 0. Rejection sampling, so it is unbiased
  // and uses only integer arithmetic (the same result everywhere).
  uint64_t Uniform(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;  // a multiple of n
    uint64_t r;
    do {
      r = Next();
    } while (r >= limit);
    return r % n;
  }

  // Uniform on [0, 1) with 53 random bits: exact in double.
  double UniformDouble() { return static_cast<double>(Next() >> 11) * (1.0 / 9007199254740992.0); }

 private:
  uint64_t state_;
};

}  // namespace onebit

#endif  // ONEBIT_MODELS_RNG_H_
