// The synthetic model (models/synthetic_model.h) against an independent
// re-implementation of its formula written out here, so that moving its
// arithmetic into models/synthetic_hash.h (shared with the GPU kernel) is
// checked to have changed no bit of x0, g or the loss.
#include "models/synthetic_model.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace onebit {
namespace {

// ------------------------------------------------- the formula, written anew

uint64_t SplitMixFinal(uint64_t z) {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ULL;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return z;
}

// Element `counter` of the stream `key`: splitmix64's (counter + 1)-th output
// for the state `key`.
uint64_t Draw(uint64_t key, uint64_t counter) {
  return SplitMixFinal(key + (counter + 1) * 0x9e3779b97f4a7c15ULL);
}

// Top and middle 24 bits of h as multiples of 2^-24 in [0, 1).
float Top24(uint64_t h) { return std::ldexp(static_cast<float>(h >> 40), -24); }
float Mid24(uint64_t h) { return std::ldexp(static_cast<float>((h >> 8) & 0xffffffu), -24); }

struct Reference {
  std::vector<float> x0, g;
  double loss = 0;
};

// x0, then g and the loss at x for (rank, step), as the model's header states
// them: a_j = (0.5 + U) 10^(spread u_j), c_j, x0_j, xi_j uniform on [-1, 1).
Reference Compute(const SyntheticOptions& o, const std::vector<float>& x, uint32_t rank,
                  uint64_t step) {
  Reference r;
  const uint64_t d = o.dim;
  r.x0.resize(d);
  r.g.resize(d);
  const uint64_t init_key = SplitMixFinal(o.seed ^ 0x5851f42d4c957f2dULL);
  const uint64_t spread_key = SplitMixFinal(o.seed ^ 0x2545f4914f6cdd1dULL);
  const uint64_t problem_key = SplitMixFinal(o.seed);
  const uint64_t rank_part = SplitMixFinal(o.seed ^ (static_cast<uint64_t>(rank) << 40));
  const uint64_t step_part = SplitMixFinal(step + 0x632be5abULL);
  const uint64_t noise_key = SplitMixFinal(rank_part ^ step_part);
  double sum = 0;
  for (uint64_t j = 0; j < d; ++j) {
    r.x0[j] = 2.0f * Top24(Draw(init_key, j)) - 1.0f;
    const uint64_t h = Draw(problem_key, j);
    float a = 0.5f + Top24(h);
    if (o.curvature_spread != 0.0f) {
      const double u = 2.0 * Top24(Draw(spread_key, j)) - 1.0;
      a = a * static_cast<float>(std::pow(10.0, o.curvature_spread * u));
    }
    const float c = 2.0f * Mid24(h) - 1.0f;
    const float xi = 2.0f * Top24(Draw(noise_key, j)) - 1.0f;
    const float res = x[j] - c;
    const float curv = a * res;
    const float kick = o.noise * xi;
    r.g[j] = curv + kick;
    const double ad = a, rd = res;
    sum += 0.5 * ad * rd * rd;
  }
  r.loss = sum / static_cast<double>(d);
  return r;
}

// ---------------------------------------------------------------------- tests

// splitmix64 from state 0 first returns 0xe220a8397b1dcdaf (its published
// reference output): the shared hash is that generator.
TEST(SyntheticHash, IsSplitMix64) {
  EXPECT_EQ(synthetic::HashCounter(0, 0), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(synthetic::HashCounter(0, 0), Draw(0, 0));
  EXPECT_EQ(synthetic::Hi(~uint64_t{0}), 16777215.0f / 16777216.0f);
  EXPECT_EQ(synthetic::Lo(uint64_t{0xabcdef} << 8), static_cast<float>(0xabcdef) / 16777216.0f);
  EXPECT_EQ(synthetic::Lo(~uint64_t{0} ^ (uint64_t{0xffffff} << 8)), 0.0f);
}

TEST(SyntheticModel, MatchesTheFormulaBitForBit) {
  std::mt19937 rng(1);
  for (uint64_t d : {uint64_t{1}, uint64_t{31}, uint64_t{1000}, uint64_t{4099}}) {
    for (float spread : {0.0f, 1.0f, 2.5f}) {
      for (float noise : {0.1f, 0.0f}) {
        SyntheticOptions o;
        o.dim = d;
        o.seed = 3 + d;
        o.noise = noise;
        o.curvature_spread = spread;
        const SyntheticModel m(o);
        ASSERT_EQ(m.num_params(), d);
        std::vector<float> x(d);
        m.Init(x.data());
        std::uniform_real_distribution<float> wide(-40.0f, 40.0f);
        std::vector<float> far(d);
        for (float& v : far) v = wide(rng);
        for (const std::vector<float>* at : {&x, &far}) {
          for (uint32_t rank : {0u, 3u}) {
            for (uint64_t step : {uint64_t{0}, uint64_t{1}, (uint64_t{1} << 33) + 5}) {
              SCOPED_TRACE(absl::StrCat("d ", d, " spread ", spread, " noise ", noise, " rank ",
                                        rank, " step ", step, at == &x ? " at x0" : " far"));
              const Reference want = Compute(o, *at, rank, step);
              ASSERT_EQ(std::memcmp(x.data(), want.x0.data(), d * 4), 0) << "Init differs";
              std::vector<float> g(d);
              absl::StatusOr<double> loss = m.Gradient(at->data(), rank, step, g.data());
              ASSERT_TRUE(loss.ok()) << loss.status();
              for (uint64_t j = 0; j < d; ++j) {
                uint32_t got_bits, want_bits;
                std::memcpy(&got_bits, &g[j], 4);
                std::memcpy(&want_bits, &want.g[j], 4);
                ASSERT_EQ(got_bits, want_bits) << "g[" << j << "]: " << g[j] << " vs " << want.g[j];
              }
              EXPECT_EQ(*loss, want.loss);
            }
          }
        }
      }
    }
  }
}

TEST(SyntheticModel, SpreadTableAndOptions) {
  SyntheticOptions o;
  o.dim = 50;
  o.seed = 9;
  EXPECT_TRUE(SyntheticModel(o).spread().empty());
  o.curvature_spread = 2.0f;
  const SyntheticModel m(o);
  EXPECT_EQ(m.options().dim, 50u);
  EXPECT_EQ(m.options().curvature_spread, 2.0f);
  ASSERT_EQ(m.spread().size(), 50u);
  for (float f : m.spread()) {
    EXPECT_GE(f, 0.01f);
    EXPECT_LE(f, 100.0f);
  }
}

TEST(SyntheticModel, SkipLeavesGradientAlone) {
  SyntheticOptions o;
  o.dim = 10;
  o.skip = true;
  const SyntheticModel m(o);
  std::vector<float> x(10, 1.0f), g(10, 7.0f);
  absl::StatusOr<double> loss = m.Gradient(x.data(), 0, 0, g.data());
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_EQ(*loss, 0.0);
  EXPECT_EQ(g, std::vector<float>(10, 7.0f));
}

TEST(SyntheticModel, DeterministicPerSeedRankStep) {
  SyntheticModel m({1000, 3, 0.5f, false});
  std::vector<float> x(1000), g1(1000), g2(1000), g3(1000);
  m.Init(x.data());
  auto l1 = m.Gradient(x.data(), 1, 5, g1.data());
  auto l2 = m.Gradient(x.data(), 1, 5, g2.data());
  m.Gradient(x.data(), 2, 5, g3.data()).IgnoreError();
  ASSERT_TRUE(l1.ok() && l2.ok());
  EXPECT_EQ(*l1, *l2);
  EXPECT_EQ(std::memcmp(g1.data(), g2.data(), 4000), 0);
  EXPECT_NE(std::memcmp(g1.data(), g3.data(), 4000), 0);  // per-rank noise
  for (float v : x) {
    EXPECT_GE(v, -1.0f);
    EXPECT_LT(v, 1.0f);
  }
  // Without noise, the gradient is a (x - c) with a in [0.5, 1.5): descending
  // along it lowers the loss.
  SyntheticModel quiet({1000, 3, 0.0f, false});
  std::vector<float> g(1000);
  const double before = *quiet.Gradient(x.data(), 0, 0, g.data());
  for (size_t i = 0; i < x.size(); ++i) x[i] -= 0.5f * g[i];
  EXPECT_LT(*quiet.Gradient(x.data(), 0, 1, g.data()), 0.5 * before);
}

}  // namespace
}  // namespace onebit
