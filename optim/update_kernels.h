// The element loops of the parameter updates (docs/design.md §1.1, §1.2), shared by
// the server, the workers and the reference, and the CPU twins of the CUDA
// update kernels in cuda/kernels.h: both sides evaluate the same expressions
// in the same order (no FMA contraction), so they agree bit for bit.
#ifndef ONEBIT_OPTIM_UPDATE_KERNELS_H_
#define ONEBIT_OPTIM_UPDATE_KERNELS_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"

namespace onebit {

// The frozen preconditioner of one coordinate, sqrt(v) + eps: the server
// computes it from its v at the hand-over, every worker from the v it is sent.
inline float FrozenDenominator(float v, float eps) { return std::sqrt(v) + eps; }

// den[i] = FrozenDenominator(v[i], eps) (den may be v).
void FrozenDenominators(const float* v, float eps, size_t n, float* den);

// zero-one-adam's refreshed preconditioner, den = sqrt(max(v / c, floor)) +
// eps with c its correction for the refreshes so far (docs/design.md §1.6).
// max as std::max: a NaN v / c stays NaN. den may be v.
void VarianceDenominators(const float* v, float c, float floor, float eps, size_t n, float* den);

// zero-one-adam's sync push: a worker's update since the last sync in
// momentum units, u = (x - x_sync) * den.
void UpdateSinceSync(const float* x, const float* x_sync, const float* den, size_t n, float* u);

// zero-one-adam's sync on a worker, from the decoded reply a (the mean
// update in momentum units): x_sync += a / den; m = -a / lrs (0 when lrs is
// not positive); x = x_sync.
void ApplySync(const float* a, const float* den, float lrs, size_t n, float* x_sync, float* m,
               float* x);

// onebit-lamb's update direction of one element, u = p + wd x with p =
// m / den, and its step k u with k = -lr * ratio: the server's norms and
// steps and the workers' steps all go through these.
inline float LambUpdate(float p, float wd, float x) { return wd == 0.0f ? p : p + wd * x; }
inline float LambDelta(float p, float wd, float x, float k) { return k * LambUpdate(p, wd, x); }

// onebit-lamb's momentum reply on a worker: x += LambDelta(mbar / den, wd, x, k).
void LambApply(const float* mbar, const float* den, float k, float wd, size_t n, float* x);

// acc += w * x, elementwise (the CUDA twin's axpy rounds the same way).
void Axpy(const float* x, size_t n, float w, float* acc);

// out = sum over j < k of (1/k) * g[j], accumulated from +0 in j's order:
// the gradient of a worker whose k local ranks computed g[0..k) (docs/
// design.md §1.9), as the servers average workers. out may be g[0].
void MeanInOrder(const float* const* g, uint32_t k, size_t n, float* out);

// A worker's local momentum before it compresses it: m <- b1 * m + c1 * g,
// c1 = 1 - b1 (docs/design.md §1.2).
void UpdateMomentum(const float* g, float b1, float c1, size_t n, float* m);

// Both moments of one Adam step, without touching x: m <- b1 m + c1 g and
// v <- b2 v + c2 g g (zero-one-adam's variance steps, whose update then uses
// the floored denominator).
void UpdateMoments(const float* g, float b1, float c1, float b2, float c2, size_t n, float* m,
                   float* v);

// Compression phase: x <- x - lr * (mbar / den + wd * x), identically on the
// server's master and every worker's replica. den == nullptr: no
// preconditioner (ef-sgd), x <- x - lr * (mbar + wd * x).
void ApplyMomentum(const float* mbar, const float* den, float lr, float wd, size_t n, float* x);

// The index of the first non-finite x[i], or n.
size_t FirstNonFinite(const float* x, size_t n);

// The per-step scalars of one warm-up Adam step, computed once on the host so
// that CPU and GPU loops use the very same floats.
struct AdamCoefficients {
  float b1 = 0, b2 = 0;  // beta1, beta2
  float c1 = 0, c2 = 0;  // 1 - beta1, 1 - beta2
  float eps = 0, wd = 0;
  float neg_lr = 0;              // -learning rate of this step
  bool bias_correction = false;  // divide m, v by k1, k2
  float k1 = 1, k2 = 1;          // 1 - beta1^t, 1 - beta2^t with t = step + 1
};

AdamCoefficients MakeAdamCoefficients(float beta1, float beta2, float eps, float weight_decay,
                                      float lr, bool bias_correction, uint64_t step);

// One Adam step on n elements: m = b1 m + c1 g; v = b2 v + c2 g g;
// d = -lr (m^ / (sqrt(v^) + eps) + wd x); g <- d; x += d. Does not check that
// x stays finite (callers do).
void AdamUpdate(const AdamCoefficients& c, size_t n, float* g, float* m, float* v, float* x);

// Which instruction set the loops above run with: the widest this CPU has,
// chosen at start-up. Every path computes the same bits (IEEE operations
// elementwise, no FMA contraction), so processes on different CPUs agree;
// tests hold each path to the baseline. Thread-safe.
enum class UpdatePath { kBaseline, kAvx2, kAvx512 };
// The paths this CPU runs, narrowest first.
std::vector<UpdatePath> UpdatePaths();
UpdatePath ActiveUpdatePath();
absl::string_view UpdatePathName(UpdatePath path);
// For tests: this process's loops from now on run `path` (one of
// UpdatePaths()); not while another thread runs them.
void UseUpdatePathForTest(UpdatePath path);

}  // namespace onebit

#endif  // ONEBIT_OPTIM_UPDATE_KERNELS_H_
