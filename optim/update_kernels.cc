#include "optim/update_kernels.h"

#include <algorithm>
#include <cmath>

namespace onebit {

void UpdateMomentum(const float* g, float b1, float c1, size_t n, float* m) {
  for (size_t i = 0; i < n; ++i) m[i] = b1 * m[i] + c1 * g[i];
}

void ApplyMomentum(const float* mbar, const float* den, float lr, float wd, size_t n, float* x) {
  if (den != nullptr) {
    for (size_t i = 0; i < n; ++i) x[i] = x[i] - lr * (mbar[i] / den[i] + wd * x[i]);
  } else {
    for (size_t i = 0; i < n; ++i) x[i] = x[i] - lr * (mbar[i] + wd * x[i]);
  }
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
  for (size_t i = 0; i < n; ++i) den[i] = FrozenDenominator(v[i], eps);
}

void VarianceDenominators(const float* v, float c, float floor, float eps, size_t n, float* den) {
  for (size_t i = 0; i < n; ++i) den[i] = FrozenDenominator(std::max(v[i] / c, floor), eps);
}

void UpdateSinceSync(const float* x, const float* x_sync, const float* den, size_t n, float* u) {
  for (size_t i = 0; i < n; ++i) u[i] = (x[i] - x_sync[i]) * den[i];
}

void ApplySync(const float* a, const float* den, float lrs, size_t n, float* x_sync, float* m,
               float* x) {
  for (size_t i = 0; i < n; ++i) {
    x_sync[i] += a[i] / den[i];
    m[i] = lrs > 0.0f ? -(a[i] / lrs) : 0.0f;
    x[i] = x_sync[i];
  }
}

void LambApply(const float* mbar, const float* den, float k, float wd, size_t n, float* x) {
  for (size_t i = 0; i < n; ++i) x[i] += LambDelta(mbar[i] / den[i], wd, x[i], k);
}

void UpdateMoments(const float* g, float b1, float c1, float b2, float c2, size_t n, float* m,
                   float* v) {
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    m[i] = b1 * m[i] + c1 * gi;
    v[i] = b2 * v[i] + c2 * gi * gi;
  }
}

void Axpy(const float* x, size_t n, float w, float* acc) {
  for (size_t i = 0; i < n; ++i) acc[i] += w * x[i];
}

void AdamUpdate(const AdamCoefficients& c, size_t n, float* g, float* m, float* v, float* x) {
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

}  // namespace onebit
