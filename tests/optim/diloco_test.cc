// diloco (optim/diloco.cc, docs/design.md §1.8) against its formulas written
// out here by hand: inner AdamW steps on each worker, the outer Nesterov step
// on the servers, 1-bit outer gradients and outer steps with both error
// feedbacks; its schedule and its refusals.
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
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
// blocks, one per shard, as ReferenceFor cuts them), 6 steps: an inner
// AdamW step on every worker at every step, and then, at the steps where
// shard k's fragment syncs (`syncs(k, t)`), that shard's outer step. With
// o.diloco.sync_delay = tau > 0 the local models take it tau steps later
// (by step 4, the second-to-last), merged: x = x_sync + alpha (x - x_sync).
struct ByHand {
  std::vector<float> xs, M, e_s;                  // the master, its momentum, its error
  std::vector<std::vector<float>> xl, m, v, e_w;  // per worker
  uint64_t rounds = 0;
};
template <typename Syncs>
ByHand DilocoByHand(const OptimizerOptions& o, const std::vector<float>& x0, Syncs syncs) {
  const size_t d = x0.size();
  const uint32_t N = 2;
  const float b1 = o.beta1, c1 = 1.0f - o.beta1, b2 = o.beta2, c2 = 1.0f - o.beta2;
  const float mu = o.diloco.outer_momentum, olr = o.diloco.outer_lr;
  ByHand h;
  h.xs = x0;
  h.M.assign(d, 0.0f);
  h.e_s.assign(d, 0.0f);
  h.xl.assign(N, x0);
  h.m.assign(N, std::vector<float>(d, 0.0f));
  h.v = h.e_w = h.m;
  std::vector<std::pair<size_t, uint64_t>> merges;  // block begin, step
  const uint64_t tau = o.diloco.sync_delay;
  for (uint64_t t = 0; t < 6; ++t) {
    const double k = static_cast<double>(t + 1);
    const float k1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), k));
    const float k2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), k));
    for (uint32_t r = 0; r < N; ++r) {
      std::vector<float> g(d);
      for (size_t j = 0; j < d; ++j) g[j] = Gradient(h.xl[r].data(), r, t, j);
      for (size_t j = 0; j < d; ++j) {  // AdamW, bias-corrected
        const float wd = j < 16 ? 0.0f : o.weight_decay;
        h.m[r][j] = b1 * h.m[r][j] + c1 * g[j];
        h.v[r][j] = b2 * h.v[r][j] + c2 * g[j] * g[j];
        const float step =
            -o.lr * ((h.m[r][j] / k1) / (std::sqrt(h.v[r][j] / k2) + o.eps) + wd * h.xl[r][j]);
        h.xl[r][j] += step;
      }
    }
    bool any = false;
    for (size_t b = 0; b < d; b += 32) {  // shard b / 32
      if (!syncs(b / 32, t)) continue;
      any = true;
      // The outer gradients, 1-bit with the workers' errors, averaged.
      std::vector<float> a(32, 0.0f);
      for (uint32_t r = 0; r < N; ++r) {
        std::vector<float> z(32);
        for (size_t j = 0; j < 32; ++j) z[j] = (h.xs[b + j] - h.xl[r][b + j]) + h.e_w[r][b + j];
        const std::vector<float> c = OneBit(z);
        for (size_t j = 0; j < 32; ++j) {
          h.e_w[r][b + j] = z[j] - c[j];
          a[j] += 0.5f * c[j];
        }
      }
      // Nesterov on the server, the step 1-bit with the server's error.
      std::vector<float> z(32);
      for (size_t j = 0; j < 32; ++j) {
        h.M[b + j] = mu * h.M[b + j] + a[j];
        z[j] = olr * (a[j] + mu * h.M[b + j]) + h.e_s[b + j];
      }
      const std::vector<float> c = OneBit(z);
      const uint64_t merge = tau == 0 ? t : std::max<uint64_t>(t, std::min<uint64_t>(t + tau, 4));
      for (size_t j = 0; j < 32; ++j) {
        h.e_s[b + j] = z[j] - c[j];
        h.xs[b + j] -= c[j];
        if (merge > t) continue;
        for (uint32_t r = 0; r < N; ++r) h.xl[r][b + j] = h.xs[b + j];
      }
      if (merge > t) merges.emplace_back(b, merge);
    }
    for (const auto& [b, merge] : merges) {
      if (merge != t) continue;
      for (uint32_t r = 0; r < N; ++r) {
        for (size_t j = b; j < b + 32; ++j) {
          h.xl[r][j] = h.xs[j] + o.diloco.sync_mix * (h.xl[r][j] - h.xs[j]);
        }
      }
    }
    h.rounds += any;
  }
  return h;
}

// The reference's end against the hand computation's, element by element.
void ExpectEqualToHand(const ReferenceResult& r, const ByHand& h) {
  ASSERT_EQ(r.servers.size(), 2u);
  for (size_t j = 0; j < h.xs.size(); ++j) {
    const ServerShardState& s = r.servers[j / 32];
    ASSERT_EQ(s.x[j % 32], h.xs[j]) << j;
    ASSERT_EQ(s.m[j % 32], h.M[j]) << j;
    ASSERT_EQ(s.e[j % 32], h.e_s[j]) << j;
    for (uint32_t w = 0; w < h.xl.size(); ++w) {
      ASSERT_EQ(r.workers[w].x[j], h.xl[w][j]) << "worker " << w << " " << j;
      ASSERT_EQ(r.workers[w].x_sync[j], h.xs[j]) << "worker " << w << " " << j;
      ASSERT_EQ(r.workers[w].mbar[j], h.m[w][j]) << "worker " << w << " " << j;
      ASSERT_EQ(r.workers[w].v[j], h.v[w][j]) << "worker " << w << " " << j;
      ASSERT_EQ(r.workers[w].e[j], h.e_w[w][j]) << "worker " << w << " " << j;
    }
  }
}

std::vector<float> HandX0(size_t d) {
  std::vector<float> x0(d);
  for (size_t j = 0; j < d; ++j) x0[j] = 0.1f * static_cast<float>(static_cast<int>(j % 13) - 6);
  return x0;
}

absl::StatusOr<ReferenceResult> ReferenceOfHandJob(const OptimizerOptions& o,
                                                   const std::vector<float>& x0) {
  const size_t d = x0.size();
  return RunReference(ReferenceFor(o, 2, d, 6), x0,
                      [&](const float* at, uint32_t rank, uint64_t t, float* out) {
                        for (size_t j = 0; j < d; ++j) out[j] = Gradient(at, rank, t, j);
                        return 0.0;
                      });
}

// H = 3: steps k = 1, 2, 4, 5 are inner AdamW steps alone, k = 3 and 6 an
// inner step and then a sync. The reference, which runs the servers' and
// workers' rules, must equal the hand computation bit for bit.
TEST(Diloco, ReferenceMatchesHandComputationStepByStep) {
  const OptimizerOptions o = DilocoOptionsForTest();
  const std::vector<float> x0 = HandX0(64);
  const ByHand h = DilocoByHand(o, x0, [](size_t, uint64_t t) { return (t + 1) % 3 == 0; });
  auto r = ReferenceOfHandJob(o, x0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rounds, 2u);
  EXPECT_EQ(h.rounds, 2u);
  EXPECT_EQ(r->freeze_step, 0u);  // compresses from the start
  for (uint64_t t : {0, 1, 3, 4}) EXPECT_EQ(r->push_bytes[t], 0u) << t;
  // Per shard and worker: a scale and 32 bits, both ways.
  EXPECT_EQ(r->push_bytes[2], 2 * 2 * (4 + 32 / 8));
  EXPECT_EQ(r->reply_bytes[5], 2 * 2 * (4 + 32 / 8));
  ExpectEqualToHand(*r, h);
  // The workers' local models parted between syncs: the test has teeth.
  EXPECT_NE(h.xs, x0);
}

// Streaming (F = 2 fragments, one shard each, H = 3): fragment 0 syncs at
// (t + 1) mod 3 = 0, fragment 1 at an offset of 3 / 2 = 1 step,
// (t + 1 + 1) mod 3 = 0, and both at the last step: shard 1 at t = 1 and 4,
// shard 0 at t = 2, both at t = 5. Between its syncs a shard's elements
// take local steps while the other's sync.
TEST(Diloco, FragmentsSyncInTurnAsTheHandComputation) {
  OptimizerOptions o = DilocoOptionsForTest();
  o.diloco.fragments = 2;
  o.shard_begins = {0, 32};
  const std::vector<float> x0 = HandX0(64);
  const ByHand h = DilocoByHand(
      o, x0, [](size_t shard, uint64_t t) { return t == 5 || (t + 1 + shard) % 3 == 0; });
  auto w = WorkerOptimizer::Create(o);
  ASSERT_TRUE(w.ok()) << w.status();
  std::string kinds;
  for (uint64_t t = 0; t < 6; ++t) {
    for (uint64_t b : {0, 32}) {
      kinds += (*w)->KindAt(t, Phase::kCompress, b) == StepKind::kLocal ? 'l' : 'S';
    }
    kinds += (*w)->KindOf(t, Phase::kCompress) == StepKind::kLocal ? "l " : "S ";
  }
  EXPECT_EQ(kinds, "lll lSS SlS lll lSS SSS ");
  auto r = ReferenceOfHandJob(o, x0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rounds, 4u);
  EXPECT_EQ(h.rounds, 4u);
  // One shard's pushes at t = 1, 2, 4; both at 5.
  for (uint64_t t : {1, 2, 4}) EXPECT_EQ(r->push_bytes[t], 2 * (4 + 32 / 8)) << t;
  EXPECT_EQ(r->push_bytes[5], 2 * 2 * (4 + 32 / 8));
  ExpectEqualToHand(*r, h);
  // Not the unstreamed job: the fragments' schedule changed the result.
  const ByHand whole = DilocoByHand(o, x0, [](size_t, uint64_t t) { return (t + 1) % 3 == 0; });
  EXPECT_NE(h.xs, whole.xs);
  // A local step on a syncing shard, or a push of a local one, is refused.
  WorkerState s;
  (*w)->InitState(64, &s);
  std::vector<float> g(64, 0.1f);
  std::vector<uint8_t> out(64);
  EXPECT_THAT(std::string((*w)->LocalStep(1, o.lr, g.data(), 32, 32, &s).message()),
              HasSubstr("step 1 synchronises: it is no local step"));
  EXPECT_THAT(std::string((*w)->Push(1, o.lr, g.data(), 0, 32, &s, out.data()).message()),
              HasSubstr("step 1 is a local step for the shard of element 0"));
}

// Overlapped (--sync_delay tau): the outer step of a sync reaches the local
// models tau steps later, merged with what they learnt meanwhile, and by the
// second-to-last step (4), so that the last step (5) ends at the master.
// H = 3, tau = 2: the sync of t = 2 merges at t = 4. Streamed too (H = 4,
// F = 2, tau = 1): shard 1 syncs at t = 1 and merges at 2, shard 0 syncs at
// t = 3 and merges at 4, both sync at t = 5 and take it at once. alpha =
// 0.5 (the default): its products are exact, whatever the compiler fuses.
TEST(Diloco, ADelayedSyncMergesLaterAsTheHandComputation) {
  struct Case {
    uint32_t H, F, tau;
  };
  for (const Case c : {Case{3, 1, 2}, Case{4, 2, 1}}) {
    SCOPED_TRACE(absl::StrCat("H ", c.H, " F ", c.F, " tau ", c.tau));
    OptimizerOptions o = DilocoOptionsForTest();
    o.diloco.sync_every = c.H;
    o.diloco.fragments = c.F;
    o.diloco.sync_delay = c.tau;
    if (c.F > 1) o.shard_begins = {0, 32};
    auto w = WorkerOptimizer::Create(o);
    ASSERT_TRUE(w.ok()) << w.status();
    std::string merges;
    for (uint64_t t = 0; t < 6; ++t) merges += absl::StrCat((*w)->MergeStep(t), " ");
    EXPECT_EQ(merges, c.tau == 2 ? "2 3 4 4 4 5 " : "1 2 3 4 4 5 ");
    const std::vector<float> x0 = HandX0(64);
    const uint32_t H = c.H, F = c.F;
    const ByHand h = DilocoByHand(o, x0, [H, F](size_t shard, uint64_t t) {
      return t == 5 || (t + 1 + shard * H / F) % H == 0;
    });
    auto r = ReferenceOfHandJob(o, x0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->rounds, h.rounds);
    EXPECT_EQ(h.rounds, c.F == 1 ? 2u : 3u);
    ExpectEqualToHand(*r, h);
    // Not the job without the delay: the merge changed the result.
    OptimizerOptions at_once = o;
    at_once.diloco.sync_delay = 0;
    const ByHand h0 = DilocoByHand(at_once, x0, [H, F](size_t shard, uint64_t t) {
      return t == 5 || (t + 1 + shard * H / F) % H == 0;
    });
    EXPECT_NE(h.xs, h0.xs);
  }
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
  EXPECT_THAT(refusal([](OptimizerOptions* o) { o->diloco.sync_delay = 3; }),
              HasSubstr("--sync_delay: 3: must be below H / F (3 / 1)"));
  EXPECT_THAT(refusal([](OptimizerOptions* o) { o->diloco.sync_mix = 1.0f; }),
              HasSubstr("--sync_mix: must lie in [0, 1)"));
  EXPECT_THAT(refusal([](OptimizerOptions* o) { o->diloco.sync_mix = NAN; }),
              HasSubstr("--sync_mix"));
  EXPECT_THAT(refusal([](OptimizerOptions* o) { o->diloco.fragments = 0; }),
              HasSubstr("--fragments: 0: must be in [1, --sync_every (3)]"));
  EXPECT_THAT(refusal([](OptimizerOptions* o) { o->diloco.fragments = 4; }),
              HasSubstr("--fragments: 4: must be in [1, --sync_every (3)]"));
  EXPECT_THAT(refusal([](OptimizerOptions* o) {
                o->diloco.fragments = 3;
                o->shard_begins = {0, 32};
              }),
              HasSubstr("--fragments: 3: fragments are groups of whole shards; there are 2"));
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
