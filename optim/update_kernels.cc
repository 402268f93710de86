#include "optim/update_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

namespace onebit {

namespace {

// The loops, written once and compiled for each instruction set below:
// elementwise IEEE +, -, *, / and sqrt round the same in every vector width
// (FMA contraction is off), so every copy computes the same bits and a
// cluster may mix CPUs. -O3 vectorises them; the wider copies do more
// elements per instruction (the divisions are what the compression step
// spends most of its arithmetic on).
#define ONEBIT_INLINE [[gnu::always_inline]] inline

ONEBIT_INLINE void UpdateMomentumLoop(const float* g, float b1, float c1, size_t n, float* m) {
  for (size_t i = 0; i < n; ++i) m[i] = b1 * m[i] + c1 * g[i];
}

ONEBIT_INLINE void ApplyMomentumLoop(const float* mbar, const float* den, float lr, float wd,
                                     size_t n, float* x) {
  if (den != nullptr) {
    for (size_t i = 0; i < n; ++i) x[i] = x[i] - lr * (mbar[i] / den[i] + wd * x[i]);
  } else {
    for (size_t i = 0; i < n; ++i) x[i] = x[i] - lr * (mbar[i] + wd * x[i]);
  }
}

ONEBIT_INLINE void FrozenDenominatorsLoop(const float* v, float eps, size_t n, float* den) {
  for (size_t i = 0; i < n; ++i) den[i] = FrozenDenominator(v[i], eps);
}

ONEBIT_INLINE void VarianceDenominatorsLoop(const float* v, float c, float floor, float eps,
                                            size_t n, float* den) {
  for (size_t i = 0; i < n; ++i) den[i] = FrozenDenominator(std::max(v[i] / c, floor), eps);
}

ONEBIT_INLINE void UpdateSinceSyncLoop(const float* x, const float* x_sync, const float* den,
                                       size_t n, float* u) {
  for (size_t i = 0; i < n; ++i) u[i] = (x[i] - x_sync[i]) * den[i];
}

ONEBIT_INLINE void ApplySyncLoop(const float* a, const float* den, float lrs, size_t n,
                                 float* x_sync, float* m, float* x) {
  for (size_t i = 0; i < n; ++i) {
    x_sync[i] += a[i] / den[i];
    m[i] = lrs > 0.0f ? -(a[i] / lrs) : 0.0f;
    x[i] = x_sync[i];
  }
}

ONEBIT_INLINE void LambApplyLoop(const float* mbar, const float* den, float k, float wd, size_t n,
                                 float* x) {
  for (size_t i = 0; i < n; ++i) x[i] += LambDelta(mbar[i] / den[i], wd, x[i], k);
}

ONEBIT_INLINE void UpdateMomentsLoop(const float* g, float b1, float c1, float b2, float c2,
                                     size_t n, float* m, float* v) {
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    m[i] = b1 * m[i] + c1 * gi;
    v[i] = b2 * v[i] + c2 * gi * gi;
  }
}

ONEBIT_INLINE void AxpyLoop(const float* x, size_t n, float w, float* acc) {
  for (size_t i = 0; i < n; ++i) acc[i] += w * x[i];
}

ONEBIT_INLINE void AdamUpdateLoop(const AdamCoefficients& c, size_t n, float* g, float* m, float* v,
                                  float* x) {
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = c.b1 * m[i] + c.c1 * gi;
    const float vi = c.b2 * v[i] + c.c2 * gi * gi;
    const float mh = c.bias_correction ? mi / c.k1 : mi;
    const float vh = c.bias_correction ? vi / c.k2 : vi;
    const float d = c.neg_lr * (mh / (std::sqrt(vh) + c.eps) + c.wd * x[i]);
    m[i] = mi;
    v[i] = vi;
    g[i] = d;
    x[i] += d;
  }
}

// The first non-finite x[i], or n: blocks without a branch per element (so
// that they vectorise), then the bad block element by element.
ONEBIT_INLINE size_t FirstNonFiniteLoop(const float* x, size_t n) {
  constexpr size_t kBlock = 256;
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t end = std::min(n, b + kBlock);
    uint32_t bad = 0;
    for (size_t i = b; i < end; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, 4);
      bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
    }
    if (bad != 0) {
      for (size_t i = b; i < end; ++i) {
        if (!std::isfinite(x[i])) return i;
      }
    }
  }
  return n;
}

struct Loops {
  void (*update_momentum)(const float*, float, float, size_t, float*);
  void (*apply_momentum)(const float*, const float*, float, float, size_t, float*);
  void (*frozen_denominators)(const float*, float, size_t, float*);
  void (*variance_denominators)(const float*, float, float, float, size_t, float*);
  void (*update_since_sync)(const float*, const float*, const float*, size_t, float*);
  void (*apply_sync)(const float*, const float*, float, size_t, float*, float*, float*);
  void (*lamb_apply)(const float*, const float*, float, float, size_t, float*);
  void (*update_moments)(const float*, float, float, float, float, size_t, float*, float*);
  void (*axpy)(const float*, size_t, float, float*);
  void (*adam_update)(const AdamCoefficients&, size_t, float*, float*, float*, float*);
  size_t (*first_nonfinite)(const float*, size_t);
};

// One copy of every loop for the instruction set `attr` names.
#define ONEBIT_LOOPS(NAME, ATTR)                                                             \
  namespace NAME {                                                                           \
  ATTR void UpdateMomentum(const float* g, float b1, float c1, size_t n, float* m) {         \
    UpdateMomentumLoop(g, b1, c1, n, m);                                                     \
  }                                                                                          \
  ATTR void ApplyMomentum(const float* mbar, const float* den, float lr, float wd, size_t n, \
                          float* x) {                                                        \
    ApplyMomentumLoop(mbar, den, lr, wd, n, x);                                              \
  }                                                                                          \
  ATTR void FrozenDenominators(const float* v, float eps, size_t n, float* den) {            \
    FrozenDenominatorsLoop(v, eps, n, den);                                                  \
  }                                                                                          \
  ATTR void VarianceDenominators(const float* v, float c, float floor, float eps, size_t n,  \
                                 float* den) {                                               \
    VarianceDenominatorsLoop(v, c, floor, eps, n, den);                                      \
  }                                                                                          \
  ATTR void UpdateSinceSync(const float* x, const float* x_sync, const float* den, size_t n, \
                            float* u) {                                                      \
    UpdateSinceSyncLoop(x, x_sync, den, n, u);                                               \
  }                                                                                          \
  ATTR void ApplySync(const float* a, const float* den, float lrs, size_t n, float* x_sync,  \
                      float* m, float* x) {                                                  \
    ApplySyncLoop(a, den, lrs, n, x_sync, m, x);                                             \
  }                                                                                          \
  ATTR void LambApply(const float* mbar, const float* den, float k, float wd, size_t n,      \
                      float* x) {                                                            \
    LambApplyLoop(mbar, den, k, wd, n, x);                                                   \
  }                                                                                          \
  ATTR void UpdateMoments(const float* g, float b1, float c1, float b2, float c2, size_t n,  \
                          float* m, float* v) {                                              \
    UpdateMomentsLoop(g, b1, c1, b2, c2, n, m, v);                                           \
  }                                                                                          \
  ATTR void Axpy(const float* x, size_t n, float w, float* acc) { AxpyLoop(x, n, w, acc); }  \
  ATTR void AdamUpdate(const AdamCoefficients& c, size_t n, float* g, float* m, float* v,    \
                       float* x) {                                                           \
    AdamUpdateLoop(c, n, g, m, v, x);                                                        \
  }                                                                                          \
  ATTR size_t FirstNonFinite(const float* x, size_t n) { return FirstNonFiniteLoop(x, n); }  \
  constexpr Loops kLoops = {UpdateMomentum,                                                  \
                            ApplyMomentum,                                                   \
                            FrozenDenominators,                                              \
                            VarianceDenominators,                                            \
                            UpdateSinceSync,                                                 \
                            ApplySync,                                                       \
                            LambApply,                                                       \
                            UpdateMoments,                                                   \
                            Axpy,                                                            \
                            AdamUpdate,                                                      \
                            FirstNonFinite};                                                 \
  }  // namespace NAME

ONEBIT_LOOPS(baseline, )
#if defined(__x86_64__)
ONEBIT_LOOPS(avx2, [[gnu::target("avx2")]])
ONEBIT_LOOPS(avx512, [[gnu::target("avx512f")]])
#endif

const Loops& LoopsOf(UpdatePath path) {
  switch (path) {
#if defined(__x86_64__)
    case UpdatePath::kAvx2:
      return avx2::kLoops;
    case UpdatePath::kAvx512:
      return avx512::kLoops;
#endif
    default:
      return baseline::kLoops;
  }
}

UpdatePath Widest() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return UpdatePath::kAvx512;
  if (__builtin_cpu_supports("avx2")) return UpdatePath::kAvx2;
#endif
  return UpdatePath::kBaseline;
}

// A function's static: set on first use, whatever the order in which the
// program's static objects are built.
std::atomic<const Loops*>& Active() {
  static std::atomic<const Loops*> active{&LoopsOf(Widest())};
  return active;
}

const Loops& L() { return *Active().load(std::memory_order_relaxed); }

}  // namespace

std::vector<UpdatePath> UpdatePaths() {
  std::vector<UpdatePath> out = {UpdatePath::kBaseline};
  const UpdatePath widest = Widest();
  if (widest != UpdatePath::kBaseline) out.push_back(UpdatePath::kAvx2);
  if (widest == UpdatePath::kAvx512) out.push_back(UpdatePath::kAvx512);
  return out;
}

UpdatePath ActiveUpdatePath() {
  const Loops* l = Active().load(std::memory_order_relaxed);
  for (UpdatePath p : UpdatePaths()) {
    if (&LoopsOf(p) == l) return p;
  }
  return UpdatePath::kBaseline;
}

absl::string_view UpdatePathName(UpdatePath path) {
  switch (path) {
    case UpdatePath::kAvx2:
      return "avx2";
    case UpdatePath::kAvx512:
      return "avx512";
    default:
      return "baseline";
  }
}

void UseUpdatePathForTest(UpdatePath path) { Active().store(&LoopsOf(path)); }

void UpdateMomentum(const float* g, float b1, float c1, size_t n, float* m) {
  L().update_momentum(g, b1, c1, n, m);
}

void ApplyMomentum(const float* mbar, const float* den, float lr, float wd, size_t n, float* x) {
  L().apply_momentum(mbar, den, lr, wd, n, x);
}

AdamCoefficients MakeAdamCoefficients(float beta1, float beta2, float eps, float weight_decay,
                                      float lr, bool bias_correction, uint64_t step) {
  AdamCoefficients c;
  c.b1 = beta1;
  c.b2 = beta2;
  c.c1 = 1.0f - beta1;
  c.c2 = 1.0f - beta2;
  c.eps = eps;
  c.wd = weight_decay;
  c.neg_lr = -lr;
  c.bias_correction = bias_correction;
  // In double, then rounded once: the same floats the reference always used.
  const double t = static_cast<double>(step) + 1.0;
  c.k1 = bias_correction ? static_cast<float>(1.0 - std::pow(beta1, t)) : 1.0f;
  c.k2 = bias_correction ? static_cast<float>(1.0 - std::pow(beta2, t)) : 1.0f;
  return c;
}

void FrozenDenominators(const float* v, float eps, size_t n, float* den) {
  L().frozen_denominators(v, eps, n, den);
}

void VarianceDenominators(const float* v, float c, float floor, float eps, size_t n, float* den) {
  L().variance_denominators(v, c, floor, eps, n, den);
}

void UpdateSinceSync(const float* x, const float* x_sync, const float* den, size_t n, float* u) {
  L().update_since_sync(x, x_sync, den, n, u);
}

void ApplySync(const float* a, const float* den, float lrs, size_t n, float* x_sync, float* m,
               float* x) {
  L().apply_sync(a, den, lrs, n, x_sync, m, x);
}

void LambApply(const float* mbar, const float* den, float k, float wd, size_t n, float* x) {
  L().lamb_apply(mbar, den, k, wd, n, x);
}

void UpdateMoments(const float* g, float b1, float c1, float b2, float c2, size_t n, float* m,
                   float* v) {
  L().update_moments(g, b1, c1, b2, c2, n, m, v);
}

void Axpy(const float* x, size_t n, float w, float* acc) { L().axpy(x, n, w, acc); }

void MeanInOrder(const float* const* g, uint32_t k, size_t n, float* out) {
  const float w = 1.0f / static_cast<float>(k);
  // Block by block, one array at a time: each pass is a loop the compiler
  // vectorises (with k known only at run time, the element-wise loop over
  // the k arrays is not: 4 x 8 M took 24-25 ms that way against 16-20 ms
  // this way, side by side here), the block stays in L1, and every element
  // still sees ((0 + w g0) + w g1) + ... in that order.
  constexpr size_t kBlock = 2048;
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t e = std::min(n, b + kBlock);
    const float* g0 = g[0];
    for (size_t i = b; i < e; ++i) out[i] = 0.0f + w * g0[i];
    for (uint32_t j = 1; j < k; ++j) {
      const float* gj = g[j];
      for (size_t i = b; i < e; ++i) out[i] += w * gj[i];
    }
  }
}

void AdamUpdate(const AdamCoefficients& c, size_t n, float* g, float* m, float* v, float* x) {
  L().adam_update(c, n, g, m, v, x);
}

size_t FirstNonFinite(const float* x, size_t n) { return L().first_nonfinite(x, n); }

}  // namespace onebit
