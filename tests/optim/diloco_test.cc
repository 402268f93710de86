// diloco (optim/diloco.cc, docs/design.md §1.8) against its formulas written
// out here by hand: inner AdamW steps on each worker, the outer Nesterov step
// on the servers, 1-bit outer gradients and outer steps with both error
// feedbacks; its schedule and its refusals.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "optim/optimizer.h"
#include "optim/reference.h"
#include "shard/shard_map.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

// The 1-bit codec of docs/design.md §1.3 on blocks of 32: each block's
// scale is its mean |z| summed as a halving tree over 32 lanes.
std::vector<float> OneBit(const std::vector<float>& z) {
  std::vector<float> out;
  for (size_t b = 0; b < z.size(); b += 32) {
    const size_t n = std::min<size_t>(32, z.size() - b);
    float t[32] = {};
    for (size_t i = 0; i < n; ++i) t[i] = std::fabs(z[b + i]);
    for (int w = 16; w >= 1; w /= 2) {
      for (int l = 0; l < w; ++l) t[l] += t[l + w];
    }
    const float s = t[0] / static_cast<float>(n);
    for (size_t i = 0; i < n; ++i) out.push_back(std::signbit(z[b + i]) ? -s : s);
  }
  return out;
}

// Worker r's gradient at x for step t: depends on x, so the local models'
// paths matter, and on the rank, so they part.
float Gradient(const float* x, uint32_t r, uint64_t t, size_t j) {
  return 0.5f * x[j] + 0.01f * static_cast<float>((j * 7 + r * 3 + t * 5) % 11) - 0.05f;
}

OptimizerOptions DilocoOptionsForTest() {
  OptimizerOptions o;
  o.kind = OptimizerKind::kDiloco;
  o.lr = 0.01f;
  o.weight_decay = 0.1f;
  o.weight_decay_ranges = {{0, 16, 0.0f}};  // a bias-like range without decay
  o.bias_correction = true;
  o.codec.block_size = 32;
  o.worker_codec = o.server_codec = "onebit";
  o.diloco.sync_every = 3;
  o.diloco.outer_lr = 0.7f;
  o.diloco.outer_momentum = 0.9f;
  o.diloco.steps = 6;
  return o;
}

ReferenceOptions ReferenceFor(const OptimizerOptions& o, uint32_t workers, uint64_t d,
                              uint64_t steps) {
  ReferenceOptions ro;
  ro.workers = workers;
  ro.map = *ShardMap::Create(d, 2, 32);
  ro.steps = steps;
  ro.optimizer = o;
  return ro;
}

TEST(DilocoSchedule, SyncsEveryHStepsAndAtTheJobsLastStep) {
  OptimizerOptions o = DilocoOptionsForTest();
  o.diloco.sync_every = 4;
  o.diloco.steps = 10;
  auto w = WorkerOptimizer::Create(o);
  ASSERT_TRUE(w.ok()) << w.status();
  std::string kinds;
  for (uint64_t t = 0; t < 10; ++t) {
    kinds += (*w)->KindOf(t, Phase::kCompress) == StepKind::kLocal ? 'l' : 'S';
  }
  EXPECT_EQ(kinds, "lllSlllSlS");
  // No warm-up: a fresh state is in the compression phase, and holds the
  // inner AdamW's m and v, x_sync and e_w.
  WorkerState s;
  (*w)->InitState(8, &s);
  EXPECT_TRUE(s.frozen);
  EXPECT_EQ(s.mbar.size(), 8u);
  EXPECT_EQ(s.v.size(), 8u);
  EXPECT_EQ(s.x_sync.size(), 8u);
  EXPECT_EQ(s.e.size(), 8u);
  EXPECT_TRUE(s.den.empty());
}

// DiLoCo written out by hand for 2 workers and d = 64 (two 32-element
// blocks, one per shard), H = 3 and 6 steps: steps k = 1, 2, 4, 5 are inner
// AdamW steps alone, k = 3 and 6 an inner step and then a sync. Then the
// reference, which runs the servers' and workers' rules, must equal it bit
// for bit.
TEST(Diloco, ReferenceMatchesHandComputationStepByStep) {
  const OptimizerOptions o = DilocoOptionsForTest();
  const size_t d = 64;
  const uint32_t N = 2;
  const float b1 = o.beta1, c1 = 1.0f - o.beta1, b2 = o.beta2, c2 = 1.0f - o.beta2;
  const float mu = o.diloco.outer_momentum, olr = o.diloco.outer_lr;
  std::vector<float> x0(d);
  for (size_t j = 0; j < d; ++j) x0[j] = 0.1f * static_cast<float>(static_cast<int>(j % 13) - 6);

  std::vector<float> xs = x0, M(d, 0.0f), e_s(d, 0.0f);
  std::vector<std::vector<float>> xl(N, x0), m(N, std::vector<float>(d, 0.0f)), v = m, e_w = m;
  for (uint64_t t = 0; t < 6; ++t) {
    const double k = static_cast<double>(t + 1);
    const float k1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), k));
    const float k2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), k));
    for (uint32_t r = 0; r < N; ++r) {
      std::vector<float> g(d);
      for (size_t j = 0; j < d; ++j) g[j] = Gradient(xl[r].data(), r, t, j);
      for (size_t j = 0; j < d; ++j) {  // AdamW, bias-corrected
        const float wd = j < 16 ? 0.0f : o.weight_decay;
        m[r][j] = b1 * m[r][j] + c1 * g[j];
        v[r][j] = b2 * v[r][j] + c2 * g[j] * g[j];
        const float step =
            -o.lr * ((m[r][j] / k1) / (std::sqrt(v[r][j] / k2) + o.eps) + wd * xl[r][j]);
        xl[r][j] += step;
      }
    }
    if ((t + 1) % 3 != 0) continue;
    // The outer gradients, 1-bit with the workers' errors, averaged.
    std::vector<float> a(d, 0.0f);
    for (uint32_t r = 0; r < N; ++r) {
      std::vector<float> z(d);
      for (size_t j = 0; j < d; ++j) z[j] = (xs[j] - xl[r][j]) + e_w[r][j];
      const std::vector<float> c = OneBit(z);
      for (size_t j = 0; j < d; ++j) {
        e_w[r][j] = z[j] - c[j];
        a[j] += 0.5f * c[j];
      }
    }
    // Nesterov on the servers, the step 1-bit with the server's error.
    std::vector<float> z(d);
    for (size_t j = 0; j < d; ++j) {
      M[j] = mu * M[j] + a[j];
      z[j] = olr * (a[j] + mu * M[j]) + e_s[j];
    }
    const std::vector<float> c = OneBit(z);
    for (size_t j = 0; j < d; ++j) {
      e_s[j] = z[j] - c[j];
      xs[j] -= c[j];
      for (uint32_t r = 0; r < N; ++r) xl[r][j] = xs[j];
    }
  }

  auto r = RunReference(ReferenceFor(o, N, d, 6), x0,
                        [&](const float* at, uint32_t rank, uint64_t t, float* out) {
                          for (size_t j = 0; j < d; ++j) out[j] = Gradient(at, rank, t, j);
                          return 0.0;
                        });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rounds, 2u);
  EXPECT_EQ(r->freeze_step, 0u);  // compresses from the start
  for (uint64_t t : {0, 1, 3, 4}) EXPECT_EQ(r->push_bytes[t], 0u) << t;
  // Per shard and worker: a scale and 32 bits, both ways.
  EXPECT_EQ(r->push_bytes[2], N * 2 * (4 + 32 / 8));
  EXPECT_EQ(r->reply_bytes[5], N * 2 * (4 + 32 / 8));
  ASSERT_EQ(r->servers.size(), 2u);
  for (size_t j = 0; j < d; ++j) {
    const ServerShardState& s = r->servers[j / 32];
    ASSERT_EQ(s.x[j % 32], xs[j]) << j;
    ASSERT_EQ(s.m[j % 32], M[j]) << j;
    ASSERT_EQ(s.e[j % 32], e_s[j]) << j;
    for (uint32_t w = 0; w < N; ++w) {
      ASSERT_EQ(r->workers[w].x[j], xs[j]) << "worker " << w << " " << j;
      ASSERT_EQ(r->workers[w].x_sync[j], xs[j]) << "worker " << w << " " << j;
      ASSERT_EQ(r->workers[w].mbar[j], m[w][j]) << "worker " << w << " " << j;
      ASSERT_EQ(r->workers[w].v[j], v[w][j]) << "worker " << w << " " << j;
      ASSERT_EQ(r->workers[w].e[j], e_w[w][j]) << "worker " << w << " " << j;
    }
  }
  // The workers' local models parted between syncs: the test has teeth.
  EXPECT_NE(xs, x0);
}

// With fp32 both ways, outer_lr 1 and no momentum, an outer step is model
// averaging: the master becomes the mean of the workers' local models (up to
// rounding), and every replica starts again from it.
TEST(Diloco, UnitOuterStepWithoutMomentumAveragesTheLocalModels) {
  OptimizerOptions o = DilocoOptionsForTest();
  o.worker_codec = o.server_codec = "fp32";
  o.diloco.outer_lr = 1.0f;
  o.diloco.outer_momentum = 0.0f;
  o.diloco.sync_every = 4;
  o.diloco.steps = 4;
  const size_t d = 64;
  std::vector<float> x0(d, 0.25f);
  // The same model trained alone for 4 steps, once per rank.
  std::vector<std::vector<float>> local;
  for (uint32_t rank = 0; rank < 3; ++rank) {
    OptimizerOptions alone = o;
    alone.diloco.sync_every = 1000;
    alone.diloco.steps = 0;
    auto w = WorkerOptimizer::Create(alone);
    ASSERT_TRUE(w.ok());
    WorkerState s;
    (*w)->InitState(d, &s);
    s.x = s.x_sync = x0;
    std::vector<float> g(d);
    for (uint64_t t = 0; t < 4; ++t) {
      for (size_t j = 0; j < d; ++j) g[j] = Gradient(s.x.data(), rank, t, j);
      ASSERT_TRUE((*w)->LocalStep(t, o.lr, g.data(), 0, d, &s).ok());
    }
    local.push_back(s.x);
  }
  auto r = RunReference(ReferenceFor(o, 3, d, 4), x0,
                        [&](const float* at, uint32_t rank, uint64_t t, float* out) {
                          for (size_t j = 0; j < d; ++j) out[j] = Gradient(at, rank, t, j);
                          return 0.0;
                        });
  ASSERT_TRUE(r.ok()) << r.status();
  for (size_t j = 0; j < d; ++j) {
    const float mean = (local[0][j] + local[1][j] + local[2][j]) / 3.0f;
    EXPECT_NEAR(r->workers[1].x[j], mean, 1e-6f) << j;
    EXPECT_NE(local[0][j], local[2][j]) << j;  // the ranks' models did part
  }
}

TEST(Diloco, RefusalsNameTheFlag) {
  auto refusal = [](void (*edit)(OptimizerOptions*)) {
    OptimizerOptions o = DilocoOptionsForTest();
    edit(&o);
    return std::string(ValidateOptimizerOptions(o).message());
  };
  EXPECT_THAT(refusal([](OptimizerOptions* o) { o->diloco.sync_every = 0; }),
              HasSubstr("--sync_every: must be >= 1"));
  EXPECT_THAT(refusal([](OptimizerOptions* o) { o->diloco.outer_lr = 0; }),
              HasSubstr("--outer_lr"));
  EXPECT_THAT(refusal([](OptimizerOptions* o) { o->diloco.outer_lr = NAN; }),
              HasSubstr("--outer_lr"));
  EXPECT_THAT(refusal([](OptimizerOptions* o) { o->diloco.outer_momentum = 1.0f; }),
              HasSubstr("--outer_momentum: must lie in [0, 1)"));
  EXPECT_THAT(refusal([](OptimizerOptions* o) { o->reply = ReplyMode::kDelta; }),
              HasSubstr("--server_reply"));
  EXPECT_THAT(refusal([](OptimizerOptions* o) { o->warmup_codec = "fp16"; }),
              HasSubstr("--warmup_codec"));
  EXPECT_EQ(refusal([](OptimizerOptions*) {}), "");
}

// A worker of 64 parameters (x and x_sync 0.5) synchronising every
// `sync_every` steps, after the local step 0 with the gradient *g (0.25).
std::unique_ptr<WorkerOptimizer> AfterOneLocalStep(const OptimizerOptions& o, WorkerState* s,
                                                   std::vector<float>* g) {
  auto w = WorkerOptimizer::Create(o);
  EXPECT_TRUE(w.ok()) << w.status();
  (*w)->InitState(64, s);
  s->x.assign(64, 0.5f);
  s->x_sync = s->x;
  g->assign(64, 0.25f);
  EXPECT_TRUE((*w)->LocalStep(0, o.lr, g->data(), 0, 64, s).ok());
  return *std::move(w);
}

// A worker whose local model went non-finite is refused at its next sync,
// naming the outer gradient, the step and the parameter.
TEST(Diloco, ANonFiniteLocalModelIsRefusedAtTheSyncNamingIt) {
  OptimizerOptions o = DilocoOptionsForTest();
  o.diloco.sync_every = 2;
  WorkerState s;
  std::vector<float> g;
  auto w = AfterOneLocalStep(o, &s, &g);
  s.x[40] = NAN;
  std::vector<uint8_t> out(w->push_codec(StepKind::kCompressed).EncodedSize(64));
  const absl::Status st = w->Push(1, o.lr, g.data(), 0, 64, &s, out.data());
  EXPECT_THAT(std::string(st.message()), HasSubstr("outer gradient"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("step 1"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("40"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("--outer_lr"));
}

// A NaN gradient in a local step is refused at that step, naming it and the
// parameter, and changes nothing (not found H steps later as a diverged
// outer gradient).
TEST(Diloco, ANonFiniteGradientIsRefusedAtItsLocalStepChangingNothing) {
  OptimizerOptions o = DilocoOptionsForTest();
  o.diloco.sync_every = 4;
  WorkerState s;
  std::vector<float> g;
  auto w = AfterOneLocalStep(o, &s, &g);
  const WorkerState before = s;
  g[37] = INFINITY;
  const absl::Status st = w->LocalStep(1, o.lr, g.data(), 32, 32, &s);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("the gradient of step 1 is not finite in elements [32, 64) at index 5 "
                        "(element 37 of x)"));
  EXPECT_EQ(s.x, before.x);
  EXPECT_EQ(s.mbar, before.mbar);
  EXPECT_EQ(s.v, before.v);
}

}  // namespace
}  // namespace onebit
