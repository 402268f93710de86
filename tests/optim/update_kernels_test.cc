// The update loops' instruction-set paths (optim/update_kernels.h): each
// path this CPU runs computes the baseline's bits, element for element, on
// inputs that include the values where rounding differs first (subnormals,
// signed zeros, huge and tiny magnitudes), at lengths that exercise every
// vector tail.
#include "optim/update_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace onebit {
namespace {

std::vector<float> Values(size_t n, uint32_t seed, bool positive) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> exponent(-40.0f, 30.0f), mantissa(1.0f, 2.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    float x = mantissa(rng) * std::ldexp(1.0f, static_cast<int>(exponent(rng)));
    switch (rng() % 16) {
      case 0:
        x = 1e-42f;  // subnormal
        break;
      case 1:
        x = 0.0f;
        break;
      default:
        break;
    }
    if (!positive && (rng() & 1)) x = -x;
    v[i] = positive && x == 0.0f ? 1e-30f : x;
  }
  return v;
}

::testing::AssertionResult SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    if (x != y) {
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs " << b[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// Runs every loop on fresh copies of the same inputs, returning all outputs.
std::vector<std::vector<float>> RunAll(size_t n, uint32_t seed) {
  const std::vector<float> g = Values(n, seed, false), den = Values(n, seed + 1, true),
                           v0 = Values(n, seed + 2, true), x0 = Values(n, seed + 3, false),
                           m0 = Values(n, seed + 4, false);
  std::vector<std::vector<float>> out;
  auto keep = [&](std::vector<float> a) { out.push_back(std::move(a)); };
  std::vector<float> m = m0, x = x0, x2 = x0, v = v0, u(n), xs = x0;
  UpdateMomentum(g.data(), 0.9f, 0.1f, n, m.data());
  keep(m);
  ApplyMomentum(m.data(), den.data(), 1e-3f, 0.01f, n, x.data());
  keep(x);
  ApplyMomentum(m.data(), nullptr, 1e-3f, 0.0f, n, x2.data());
  keep(x2);
  std::vector<float> d(n);
  FrozenDenominators(v0.data(), 1e-8f, n, d.data());
  keep(d);
  VarianceDenominators(v0.data(), 0.7f, 1e-12f, 1e-8f, n, d.data());
  keep(d);
  UpdateSinceSync(x0.data(), g.data(), den.data(), n, u.data());
  keep(u);
  std::vector<float> mm(n), xx(n);
  ApplySync(g.data(), den.data(), 0.01f, n, xs.data(), mm.data(), xx.data());
  keep(xs);
  keep(mm);
  keep(xx);
  std::vector<float> xl = x0;
  LambApply(m0.data(), den.data(), -0.02f, 0.01f, n, xl.data());
  keep(xl);
  std::vector<float> m2 = m0, v2 = v0;
  UpdateMoments(g.data(), 0.9f, 0.1f, 0.999f, 0.001f, n, m2.data(), v2.data());
  keep(m2);
  keep(v2);
  std::vector<float> acc = x0;
  Axpy(g.data(), n, 0.25f, acc.data());
  keep(acc);
  for (bool bias : {false, true}) {
    const AdamCoefficients c = MakeAdamCoefficients(0.9f, 0.999f, 1e-8f, 0.01f, 1e-3f, bias, 6);
    std::vector<float> ga = g, ma = m0, va = v0, xa = x0;
    AdamUpdate(c, n, ga.data(), ma.data(), va.data(), xa.data());
    keep(ga);
    keep(ma);
    keep(va);
    keep(xa);
  }
  return out;
}

TEST(UpdateKernels, EveryPathComputesTheBaselinesBits) {
  const UpdatePath active = ActiveUpdatePath();
  const std::vector<UpdatePath> paths = UpdatePaths();
  ASSERT_EQ(paths.front(), UpdatePath::kBaseline);
  // The process starts on the widest path this CPU has.
  EXPECT_EQ(active, paths.back());
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{15}, size_t{16}, size_t{17}, size_t{63},
                   size_t{257}, size_t{100003}}) {
    UseUpdatePathForTest(UpdatePath::kBaseline);
    const auto want = RunAll(n, static_cast<uint32_t>(n) + 11);
    for (UpdatePath p : paths) {
      SCOPED_TRACE(std::string(UpdatePathName(p)) + " n=" + std::to_string(n));
      UseUpdatePathForTest(p);
      ASSERT_EQ(ActiveUpdatePath(), p);
      const auto got = RunAll(n, static_cast<uint32_t>(n) + 11);
      ASSERT_EQ(got.size(), want.size());
      for (size_t k = 0; k < got.size(); ++k)
        EXPECT_TRUE(SameBits(got[k], want[k])) << "output " << k;
    }
  }
  UseUpdatePathForTest(active);
}

TEST(UpdateKernels, FirstNonFiniteFindsTheFirstOnEveryPath) {
  const float kInf = std::numeric_limits<float>::infinity();
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const UpdatePath active = ActiveUpdatePath();
  for (UpdatePath p : UpdatePaths()) {
    SCOPED_TRACE(std::string(UpdatePathName(p)));
    UseUpdatePathForTest(p);
    std::vector<float> x = Values(1000, 3, false);
    x[10] = 3.4e38f;  // finite, the largest magnitude
    EXPECT_EQ(FirstNonFinite(x.data(), x.size()), x.size());
    EXPECT_EQ(FirstNonFinite(x.data(), 0), 0u);
    for (size_t at : {size_t{0}, size_t{255}, size_t{256}, size_t{700}, size_t{999}}) {
      for (float bad : {kNaN, kInf, -kInf}) {
        std::vector<float> y = x;
        y[at] = bad;
        if (at + 3 < y.size()) y[at + 3] = kNaN;  // a later one is not the answer
        EXPECT_EQ(FirstNonFinite(y.data(), y.size()), at) << bad;
        EXPECT_EQ(FirstNonFinite(y.data(), at), at) << "outside the n given";
      }
    }
  }
  UseUpdatePathForTest(active);
}

// A host's mean gradient (--local_ranks): ((0 + w g0) + w g1) + ... per
// element, w = 1/K rounded to float, bit for bit, over lengths that are
// not a multiple of the block, K = 1..5, the values where rounding or sign
// differ (−0, subnormals, huge, NaN), and out aliasing g[0].
TEST(UpdateKernels, MeanInOrderAddsEachRanksShareInOrder) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  const std::vector<float> special = {
      -0.0f,   0.0f, 1e-40f, -1e-40f, 3e38f, -3e38f, std::numeric_limits<float>::quiet_NaN(),
      1.0f / 3};
  for (uint32_t k = 1; k <= 5; ++k) {
    for (size_t n : {size_t{1}, size_t{2047}, size_t{2048}, size_t{5000}}) {
      std::vector<std::vector<float>> g(k, std::vector<float>(n));
      for (uint32_t j = 0; j < k; ++j) {
        for (size_t i = 0; i < n; ++i)
          g[j][i] = i % 7 == 0 ? special[(i + j) % special.size()] : u(rng);
      }
      std::vector<const float*> ptrs;
      for (const auto& a : g) ptrs.push_back(a.data());
      const float w = 1.0f / static_cast<float>(k);
      std::vector<float> want(n);
      for (size_t i = 0; i < n; ++i) {
        float acc = 0.0f;
        for (uint32_t j = 0; j < k; ++j) acc += w * g[j][i];
        want[i] = acc;
      }
      std::vector<float> out(n, 42.0f);
      MeanInOrder(ptrs.data(), k, n, out.data());
      EXPECT_EQ(std::memcmp(out.data(), want.data(), 4 * n), 0) << "k " << k << " n " << n;
      MeanInOrder(ptrs.data(), k, n, g[0].data());  // in place
      EXPECT_EQ(std::memcmp(g[0].data(), want.data(), 4 * n), 0) << "in place, k " << k;
    }
  }
  // −0 from every rank is +0 (0 + −0), as the servers' sum from +0 has it.
  const float minus_zero[2] = {-0.0f, -0.0f};
  const float* both[2] = {&minus_zero[0], &minus_zero[1]};
  float out = -1;
  MeanInOrder(both, 2, 1, &out);
  EXPECT_FALSE(std::signbit(out));
}

}  // namespace
}  // namespace onebit
