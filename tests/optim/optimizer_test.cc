// Tests of the optimizers (optim/optimizer.h) against the formulas of
// docs/design.md §1, written out here by hand, on vectors small enough to follow.
#include "optim/optimizer.h"

#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "optim/held_momentum.h"
#include "optim/reference.h"

namespace onebit {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// The 1-bit codec of docs/design.md §1.3 for one block of n <= 32 elements: lane
// l holds element l alone, then the halving tree; s = sum / n.
float Scale(const std::vector<float>& z) {
  float t[32] = {};
  for (size_t i = 0; i < z.size(); ++i) t[i] = std::fabs(z[i]);
  for (int w = 16; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) t[l] += t[l + w];
  }
  return t[0] / static_cast<float>(z.size());
}
std::vector<float> OneBit(const std::vector<float>& z) {
  const float s = Scale(z);
  std::vector<float> d;
  for (float v : z) d.push_back(std::signbit(v) ? -s : s);
  return d;
}

OptimizerOptions OnebitOptions(OptimizerKind kind) {
  OptimizerOptions o;
  o.kind = kind;
  o.lr = 0.1f;
  o.weight_decay = 0.25f;
  o.codec.block_size = 32;
  o.worker_codec = o.server_codec = "onebit";
  o.reply = DefaultReplyMode(kind);
  return o;
}

TEST(LearningRate, Schedules) {
  OptimizerOptions o;
  o.lr = 0.1f;
  EXPECT_EQ(LearningRate(o, 0), 0.1f);
  EXPECT_EQ(LearningRate(o, 12345), 0.1f);
  ASSERT_TRUE(ParseLrSchedule("warmup:4", 100, &o).ok());
  EXPECT_FLOAT_EQ(LearningRate(o, 0), 0.025f);
  EXPECT_FLOAT_EQ(LearningRate(o, 1), 0.05f);
  EXPECT_EQ(LearningRate(o, 3), 0.1f);
  EXPECT_EQ(LearningRate(o, 50), 0.1f);
  ASSERT_TRUE(ParseLrSchedule("cosine", 100, &o).ok());
  EXPECT_EQ(LearningRate(o, 0), 0.1f);
  EXPECT_FLOAT_EQ(LearningRate(o, 50), 0.05f);
  EXPECT_NEAR(LearningRate(o, 100), 0.0f, 1e-9);
  EXPECT_THAT(std::string(ParseLrSchedule("warmup:0", 10, &o).message()),
              HasSubstr("--lr_schedule"));
  EXPECT_THAT(std::string(ParseLrSchedule("linear", 10, &o).message()), HasSubstr("--lr_schedule"));
}

TEST(OptimizerOptions, CombinationsAreCheckedNamingTheFlag) {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kAdam);
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--worker_codec"));
  o.worker_codec = "fp32";
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--server_codec"));
  o.server_codec = "fp32";
  EXPECT_TRUE(ValidateOptimizerOptions(o).ok());
  o = OnebitOptions(OptimizerKind::kNaiveOnebitAdam);
  o.reply = ReplyMode::kMomentum;
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--server_reply"));
  o = OnebitOptions(OptimizerKind::kOnebitAdam);
  o.worker_codec = "int8";
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("'int8'"));
  o = OnebitOptions(OptimizerKind::kOnebitAdam);
  o.v_floor = -1;
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--v_floor"));
  EXPECT_THAT(std::string(ParseOptimizerKind("lamb").status().message()), HasSubstr("lamb"));
  EXPECT_THAT(std::string(ParseErrorFeedback("some", &o).message()), HasSubstr("--error_feedback"));
  EXPECT_THAT(std::string(ParseAutoFreeze("auto:0").status().message()), HasSubstr("--freeze"));
  auto f = ParseAutoFreeze("auto:0.02:7");
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(f->automatic);
  EXPECT_EQ(f->tau, 0.02);
  EXPECT_EQ(f->window, 7u);
  EXPECT_EQ(f->latest_fraction, 0.25);
  f = ParseAutoFreeze("auto:0.02:7:0.5");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->latest_fraction, 0.5);
  for (const char* bad : {"auto:0.02:7:0", "auto:0.02:7:1.5", "auto:0.02:7:0.5:1"}) {
    EXPECT_THAT(std::string(ParseAutoFreeze(bad).status().message()), HasSubstr("0 < F <= 1"))
        << bad;
  }
}

// The flag a refused setting names travels as data: read back without
// parsing the message, and not invented for a message that merely looks
// like one.
TEST(OptimizerOptions, ARefusedSettingNamesItsFlagAsData) {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kZeroOneAdam);
  o.zero_one.local_step_clipper = 0;
  const absl::Status st = ValidateOptimizerOptions(o);
  EXPECT_EQ(SettingOfError(st), "local_step_clipper");
  EXPECT_THAT(std::string(st.message()), HasSubstr("--local_step_clipper: must be >= 1"));
  o = OnebitOptions(OptimizerKind::kOnebitAdam);
  o.lr = -1;
  EXPECT_EQ(SettingOfError(ValidateOptimizerOptions(o)), "lr");
  EXPECT_EQ(SettingOfError(absl::InvalidArgumentError("--lr: looks like one")), "");
  EXPECT_EQ(SettingOfError(absl::OkStatus()), "");
}

// A server that keeps a step's pushes and has the rule read their mean piece
// by piece (StepFromPushes) replies and moves its shard exactly as one that
// adds each push into acc as it comes: in the warm-up (the hand-over
// included), for the momentum replies that read it in pieces and, through
// the default, for a delta reply that needs it whole.
TEST(ServerOptimizer, StepFromPushesIsStepOnTheAddedPushesBitForBit) {
  constexpr size_t kN = 10000;  // pieces of 4096 and a short one
  constexpr uint32_t kWorkers = 3;
  int cases = 0;
  for (OptimizerKind kind :
       {OptimizerKind::kOnebitAdam, OptimizerKind::kEfSgd, OptimizerKind::kAdam}) {
    for (ReplyMode reply : {ReplyMode::kMomentum, ReplyMode::kDelta}) {
      OptimizerOptions o = OnebitOptions(kind);
      o.worker_codec = o.server_codec = std::string(DefaultCodec(kind));
      o.reply = reply;
      if (!ValidateOptimizerOptions(o).ok()) continue;
      ++cases;
      SCOPED_TRACE(std::string(OptimizerKindName(kind)) +
                   (reply == ReplyMode::kMomentum ? " momentum" : " delta"));
      auto server = *ServerOptimizer::Create(o);
      EXPECT_EQ(server->MeansInPieces(Phase::kCompress), reply == ReplyMode::kMomentum);
      EXPECT_TRUE(server->MeansInPieces(Phase::kWarmup));
      ServerShardState added, kept;
      server->InitState(0, 0, kN, &added);
      std::mt19937 rng(7);
      std::normal_distribution<float> normal(0.0f, 0.01f);
      for (float& x : added.x) x = normal(rng);
      kept = added;
      const bool warmup = HasWarmup(kind) && HasCompressionPhase(kind);
      for (uint64_t t = 0; t < 7; ++t) {
        SCOPED_TRACE("step " + std::to_string(t));
        const bool last_warmup = warmup && t == 2;
        const StepKind step_kind = added.frozen ? StepKind::kCompressed : StepKind::kFull;
        const Codec& codec = server->push_codec(step_kind);
        std::vector<std::vector<uint8_t>> payloads;
        std::vector<float> acc(kN, 0.0f);
        for (uint32_t r = 0; r < kWorkers; ++r) {
          std::vector<float> g(kN);
          for (size_t i = 0; i < kN; ++i) g[i] = (i % 11 == r) ? -0.0f : normal(rng);
          payloads.emplace_back(codec.EncodedSize(kN));
          ASSERT_TRUE(codec.Encode(g.data(), kN, payloads.back().data()).ok());
          ASSERT_TRUE(
              codec.DecodeAdd(payloads.back().data(), kN, 1.0f / kWorkers, acc.data()).ok());
        }
        const size_t bytes = server->ReplyBytes(step_kind, 0, kN, last_warmup);
        std::vector<uint8_t> want(bytes), got(bytes);
        const float lr = LearningRate(o, t);
        ASSERT_TRUE(server->Step(t, lr, last_warmup, acc.data(), 0, kN, &added, want.data()).ok());
        ChunkPushes pushes;
        pushes.codec = &codec;
        pushes.n = kN;
        pushes.w = 1.0f / kWorkers;
        for (const auto& p : payloads) pushes.payloads.push_back(p.data());
        ASSERT_TRUE(server->StepFromPushes(t, lr, last_warmup, pushes, 0, &kept, got.data()).ok());
        ASSERT_EQ(got, want);
        ASSERT_EQ(kept.x, added.x);
        ASSERT_EQ(kept.e, added.e);
        ASSERT_EQ(kept.m, added.m);
        ASSERT_EQ(kept.v, added.v);
        ASSERT_EQ(kept.den, added.den);
        if (last_warmup) {
          server->EnterCompression(&added);
          server->EnterCompression(&kept);
        }
      }
      EXPECT_EQ(kept.frozen, kind != OptimizerKind::kAdam);
    }
  }
  EXPECT_EQ(cases, 6) << "onebit-adam, ef-sgd and adam, each with both replies";
}

TEST(HeldMomentum, HoldsRangesUntilOneOverlapsAndReleasesThemIntoTheDenseArray) {
  auto codec = *NewCodec("onebit", CodecOptions{.block_size = 32});
  std::vector<float> y(128);
  for (size_t i = 0; i < y.size(); ++i) y[i] = (i % 3 == 0 ? -1.0f : 0.5f) * (1 + i / 32);
  auto encode = [&](size_t b, size_t n) {
    std::vector<uint8_t> p(codec->EncodedSize(n));
    EXPECT_TRUE(codec->Encode(y.data() + b, n, p.data()).ok());
    return p;
  };
  HeldMomentum held;
  EXPECT_TRUE(held.empty());
  held.Hold(*codec, 0, 64, encode(0, 64).data());
  held.Hold(*codec, 64, 64, encode(64, 64).data());
  ASSERT_NE(held.Find(0, 64), nullptr);
  EXPECT_EQ(held.Find(0, 64)->payload, encode(0, 64));
  EXPECT_EQ(held.Find(0, 32), nullptr) << "only the exact range is found";
  held.Hold(*codec, 32, 64, encode(32, 64).data());  // overlaps both
  EXPECT_EQ(held.Find(0, 64), nullptr);
  EXPECT_EQ(held.Find(64, 64), nullptr);
  ASSERT_NE(held.Find(32, 64), nullptr);
  std::vector<float> mbar(128, 7.0f);
  held.Release(mbar.data());
  EXPECT_TRUE(held.empty());
  std::vector<float> want(64);
  ASSERT_TRUE(codec->Decode(encode(32, 64).data(), 64, want.data()).ok());
  for (size_t i = 0; i < 128; ++i) {
    EXPECT_EQ(mbar[i], i >= 32 && i < 96 ? want[i - 32] : 7.0f) << "element " << i;
  }
}

TEST(ServerOptimizer, AdamWarmupStepMatchesHandComputation) {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kAdam);
  o.worker_codec = o.server_codec = "fp32";
  o.weight_decay = 0.5f;
  auto server = ServerOptimizer::Create(o);
  ASSERT_TRUE(server.ok()) << server.status();
  ServerShardState s;
  (*server)->InitState(0, 0, 1, &s);
  s.x[0] = 2.0f;
  float g = 0.5f;
  float delta = 0;
  ASSERT_TRUE((*server)->Step(0, false, &g, 0, 1, &s, reinterpret_cast<uint8_t*>(&delta)).ok());
  // m = 0.05, v = (1 - 0.999) 0.25; m / sqrt(v) = sqrt(10); Δ = -0.1 (sqrt(10) + 1).
  EXPECT_FLOAT_EQ(s.m[0], 0.05f);
  EXPECT_EQ(s.v[0], (1.0f - 0.999f) * 0.5f * 0.5f);
  EXPECT_NEAR(delta, -0.416227766, 1e-5);
  EXPECT_EQ(s.x[0], 2.0f + delta);
}

// The IEEE half nearest to f (round to nearest even), back as a float, for
// normal halves: what an fp16 payload carries.
float Half(float f) {
  const float mag = std::fabs(f);
  const int e = std::ilogb(mag);               // 2^e <= mag < 2^(e+1)
  const float ulp = std::ldexp(1.0f, e - 10);  // 10 mantissa bits
  return std::copysign(std::nearbyint(mag / ulp) * ulp, f);
}

// --warmup_codec fp16: the pushes and the reply are halves; the server sums
// and steps in fp32, and its master takes the same rounded Δ as the workers.
TEST(Optimizer, Fp16WarmupMasterTakesTheRoundedDelta) {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kOnebitAdam);
  o.warmup_codec = "fp16";
  auto server = ServerOptimizer::Create(o);
  auto worker = WorkerOptimizer::Create(o);
  ASSERT_TRUE(server.ok() && worker.ok()) << server.status();
  const size_t n = 3;
  ServerShardState s;
  (*server)->InitState(0, 0, n, &s);
  s.x = {2.0f, -1.0f, 0.5f};
  WorkerState w;
  (*worker)->InitState(n, &w);
  w.x = s.x;
  const std::vector<float> g = {0.3f, -0.7f, 0.11f};
  EXPECT_EQ((*worker)->push_codec(Phase::kWarmup).EncodedSize(n), 2 * n);
  std::vector<uint8_t> push(2 * n);
  ASSERT_TRUE((*worker)->Push(0, g.data(), 0, n, &w, push.data()).ok());
  std::vector<float> acc(n, 0.0f);
  ASSERT_TRUE(
      (*server)->push_codec(Phase::kWarmup).DecodeAdd(push.data(), n, 1.0f, acc.data()).ok());
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(acc[i], Half(g[i])) << i;
  // The last warm-up step: Δ in fp16, then m and v in fp32.
  std::vector<uint8_t> reply((*server)->ReplyBytes(Phase::kWarmup, n, true));
  ASSERT_EQ(reply.size(), 2 * n + 8 * n);
  const std::vector<float> x0 = s.x;
  ASSERT_TRUE((*server)->Step(0, true, acc.data(), 0, n, &s, reply.data()).ok());
  ASSERT_TRUE((*worker)->Apply(0, true, reply.data(), 0, n, &w).ok());
  for (size_t i = 0; i < n; ++i) {
    // By hand: m = 0.1 g, v = 0.001 g², Δ = -lr (m / (sqrt(v) + eps) + wd x).
    const float gi = Half(g[i]);
    const float m = 0.9f * 0.0f + (1.0f - 0.9f) * gi;
    const float v = 0.999f * 0.0f + (1.0f - 0.999f) * gi * gi;
    const float d = -0.1f * (m / (std::sqrt(v) + 1e-8f) + 0.25f * x0[i]);
    EXPECT_EQ(s.x[i], x0[i] + Half(d)) << i;
    EXPECT_NE(s.x[i], x0[i] + d) << i << ": the master must take the rounded Δ";
    EXPECT_EQ(w.x[i], s.x[i]) << i;
    EXPECT_EQ(w.mbar[i], m) << i;  // m and v travel in fp32
  }
}

TEST(Optimizer, Fp16WarmupNeedsAWarmup) {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kEfSgd);
  o.warmup_codec = "fp16";
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--warmup_codec"));
  o = OnebitOptions(OptimizerKind::kOnebitAdam);
  o.warmup_codec = "onebit";
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()),
              HasSubstr("'onebit': want fp32 or fp16"));
}

TEST(ServerOptimizer, BiasCorrectionDividesTheMoments) {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kAdam);
  o.worker_codec = o.server_codec = "fp32";
  o.weight_decay = 0;
  o.bias_correction = true;
  auto server = ServerOptimizer::Create(o);
  ASSERT_TRUE(server.ok());
  ServerShardState s;
  (*server)->InitState(0, 0, 1, &s);
  float g = 0.5f, delta = 0;
  ASSERT_TRUE((*server)->Step(0, false, &g, 0, 1, &s, reinterpret_cast<uint8_t*>(&delta)).ok());
  // At t = 1 the corrected moments are g and g²: Δ = -lr g / (|g| + eps) ≈ -lr.
  EXPECT_NEAR(delta, -0.1, 1e-6);
}

// The last warm-up step: v frozen with the floor, m and v handed to workers,
// who then hold m̄ = m and den = sqrt(v) + eps.
TEST(Optimizer, HandOverFloorsVAndGivesWorkersMAndV) {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kOnebitAdam);
  o.v_floor = 1e-8f;
  auto server = ServerOptimizer::Create(o);
  auto worker = WorkerOptimizer::Create(o);
  ASSERT_TRUE(server.ok() && worker.ok());
  const size_t n = 3;
  ServerShardState s;
  (*server)->InitState(0, 0, n, &s);
  WorkerState w;
  (*worker)->InitState(n, &w);
  std::vector<float> g = {1.0f, 0.0f, 1e-5f};
  std::vector<uint8_t> push((*worker)->push_codec(Phase::kWarmup).EncodedSize(n));
  ASSERT_TRUE((*worker)->Push(0, g.data(), 0, n, &w, push.data()).ok());
  EXPECT_EQ(push.size(), 4 * n);  // the warm-up pushes fp32
  std::vector<float> acc = g;
  std::vector<uint8_t> reply((*server)->ReplyBytes(Phase::kWarmup, n, true));
  ASSERT_EQ(reply.size(), 12 * n);  // Δ, m, v
  ASSERT_TRUE((*server)->Step(0, true, acc.data(), 0, n, &s, reply.data()).ok());
  ASSERT_TRUE((*worker)->Apply(0, true, reply.data(), 0, n, &w).ok());
  (*server)->EnterCompression(&s);
  (*worker)->EnterCompression(&w);
  const float c2 = 1.0f - 0.999f;
  EXPECT_EQ(s.v[0], c2 * 1.0f);
  EXPECT_EQ(s.v[1], 1e-8f);  // 0 raised to the floor
  EXPECT_EQ(s.v[2], 1e-8f);  // 1e-13 raised to the floor
  EXPECT_EQ(s.floored, 2u);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(w.mbar[i], (1.0f - 0.9f) * g[i]) << i;
    EXPECT_EQ(w.den[i], std::sqrt(s.v[i]) + 1e-8f) << i;
    EXPECT_EQ(w.den[i], s.den[i]) << i;
    EXPECT_EQ(w.x[i], s.x[i]) << i;
  }
  EXPECT_TRUE(s.frozen && w.frozen);
  EXPECT_EQ((*worker)->push_codec(PhaseOf(w)).name(), "onebit-l1-b32");
}

// With bias correction the frozen v is the corrected v / (1 - b2^t).
TEST(Optimizer, HandOverWithBiasCorrectionFreezesTheCorrectedV) {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kOnebitAdam);
  o.bias_correction = true;
  auto server = ServerOptimizer::Create(o);
  ASSERT_TRUE(server.ok());
  ServerShardState s;
  (*server)->InitState(0, 0, 2, &s);
  std::vector<float> acc = {2.0f, -0.5f};
  std::vector<uint8_t> reply((*server)->ReplyBytes(Phase::kWarmup, 2, true));
  ASSERT_TRUE((*server)->Step(0, true, acc.data(), 0, 2, &s, reply.data()).ok());
  const float k2 = static_cast<float>(1.0 - std::pow(static_cast<double>(0.999f), 1.0));
  EXPECT_EQ(s.v[0], ((1.0f - 0.999f) * 2.0f * 2.0f) / k2);
  EXPECT_EQ(s.v[1], ((1.0f - 0.999f) * -0.5f * -0.5f) / k2);
  EXPECT_NEAR(s.v[0], 4.0f, 1e-5);  // at t = 1 the corrected v is g²
  EXPECT_EQ(s.den[0], std::sqrt(s.v[0]) + 1e-8f);
}

// One compression step with two workers, computed by hand: each worker
// compresses m_i = b1 m̄ + (1 - b1) g_i with its error; the server averages,
// compresses again with its error, and everyone applies
// x -= lr (m̄ / den + wd x) with m̄ = D(c_s).
TEST(Optimizer, CompressionStepMatchesHandComputation) {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kOnebitAdam);
  auto server = ServerOptimizer::Create(o);
  auto worker = WorkerOptimizer::Create(o);
  ASSERT_TRUE(server.ok() && worker.ok());
  const size_t n = 5;
  ServerShardState s;
  (*server)->InitState(0, 0, n, &s);
  s.frozen = true;
  s.den = {1.5f, 0.25f, 2.0f, 1.0f, 0.5f};
  s.e = {0.01f, -0.02f, 0.0f, 0.03f, -0.01f};
  s.x = {1.0f, -1.0f, 0.5f, 0.0f, 2.0f};
  std::vector<WorkerState> ws(2);
  for (WorkerState& w : ws) {
    (*worker)->InitState(n, &w);
    w.frozen = true;
    w.x = s.x;
    w.den = s.den;
    w.mbar = {0.2f, -0.1f, 0.05f, 0.0f, -0.3f};
  }
  ws[0].e = {0.0f, 0.01f, -0.01f, 0.02f, 0.0f};
  ws[1].e = {-0.02f, 0.0f, 0.01f, 0.0f, 0.05f};
  const std::vector<std::vector<float>> g = {{0.5f, -0.2f, 0.1f, -0.3f, 0.7f},
                                             {-0.4f, 0.3f, 0.2f, 0.1f, -0.6f}};

  // By hand.
  std::vector<float> a(n, 0.0f);
  std::vector<std::vector<float>> e_w(2);
  for (int r = 0; r < 2; ++r) {
    std::vector<float> z(n);
    for (size_t i = 0; i < n; ++i) {
      const float m = 0.9f * ws[r].mbar[i] + (1.0f - 0.9f) * g[r][i];
      z[i] = m + ws[r].e[i];
    }
    const std::vector<float> d = OneBit(z);
    for (size_t i = 0; i < n; ++i) {
      e_w[r].push_back(z[i] - d[i]);
      a[i] += 0.5f * d[i];
    }
  }
  std::vector<float> zs(n);
  for (size_t i = 0; i < n; ++i) zs[i] = a[i] + s.e[i];
  const std::vector<float> mbar = OneBit(zs);
  std::vector<float> x = s.x, e_s(n);
  for (size_t i = 0; i < n; ++i) {
    e_s[i] = zs[i] - mbar[i];
    x[i] = x[i] - 0.1f * (mbar[i] / s.den[i] + 0.25f * x[i]);
  }

  // Through the optimizers.
  const size_t push_bytes = (*worker)->push_codec(Phase::kCompress).EncodedSize(n);
  EXPECT_EQ(push_bytes, 4u + 1u);  // one scale, five bits
  std::vector<float> acc(n, 0.0f);
  for (int r = 0; r < 2; ++r) {
    std::vector<uint8_t> push(push_bytes);
    ASSERT_TRUE((*worker)->Push(7, g[r].data(), 0, n, &ws[r], push.data()).ok());
    ASSERT_TRUE(
        (*server)->push_codec(Phase::kCompress).DecodeAdd(push.data(), n, 0.5f, acc.data()).ok());
  }
  std::vector<uint8_t> reply((*server)->ReplyBytes(Phase::kCompress, n, false));
  ASSERT_TRUE((*server)->Step(7, false, acc.data(), 0, n, &s, reply.data()).ok());
  for (WorkerState& w : ws) ASSERT_TRUE((*worker)->Apply(7, false, reply.data(), 0, n, &w).ok());

  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(ws[0].e[i], e_w[0][i]) << i;
    EXPECT_EQ(ws[1].e[i], e_w[1][i]) << i;
    EXPECT_EQ(s.e[i], e_s[i]) << i;
    EXPECT_EQ(s.x[i], x[i]) << i;
    for (const WorkerState& w : ws) {
      EXPECT_EQ(w.x[i], x[i]) << i;
      EXPECT_EQ(w.mbar[i], mbar[i]) << i;
    }
  }
}

// Without error feedback the errors stay zero and the codec sees m itself.
TEST(Optimizer, ErrorFeedbackOffLeavesErrorsZero) {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kEfSgd);
  ASSERT_TRUE(ParseErrorFeedback("none", &o).ok());
  auto server = ServerOptimizer::Create(o);
  auto worker = WorkerOptimizer::Create(o);
  ASSERT_TRUE(server.ok() && worker.ok());
  const size_t n = 40;
  ServerShardState s;
  (*server)->InitState(0, 0, n, &s);
  WorkerState w;
  (*worker)->InitState(n, &w);
  EXPECT_TRUE(s.frozen && w.frozen);  // ef-sgd has no warm-up
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (uint64_t t = 0; t < 4; ++t) {
    std::vector<float> g(n);
    for (float& v : g) v = normal(rng);
    std::vector<uint8_t> push((*worker)->push_codec(Phase::kCompress).EncodedSize(n));
    ASSERT_TRUE((*worker)->Push(t, g.data(), 0, n, &w, push.data()).ok());
    std::vector<float> acc(n, 0.0f);
    ASSERT_TRUE(
        (*server)->push_codec(Phase::kCompress).DecodeAdd(push.data(), n, 1.0f, acc.data()).ok());
    std::vector<uint8_t> reply((*server)->ReplyBytes(Phase::kCompress, n, false));
    ASSERT_TRUE((*server)->Step(t, false, acc.data(), 0, n, &s, reply.data()).ok());
    ASSERT_TRUE((*worker)->Apply(t, false, reply.data(), 0, n, &w).ok());
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(w.e[i], 0.0f);
    EXPECT_EQ(s.e[i], 0.0f);
    EXPECT_EQ(w.x[i], s.x[i]);
  }
  EXPECT_NE(w.x[0], 0.0f);
}

// --server-reply delta: the master takes the exact update, replicas add
// D(C(Δ + e_s)), so master - replica = e_s up to rounding after any number of
// steps; every replica equals the server's mirror of it bit for bit.
TEST(Optimizer, DeltaReplyReplicasTrailTheMasterByTheServerError) {
  for (OptimizerKind kind :
       {OptimizerKind::kOnebitAdam, OptimizerKind::kNaiveOnebitAdam, OptimizerKind::kEfSgd}) {
    OptimizerOptions o = OnebitOptions(kind);
    o.reply = ReplyMode::kDelta;
    o.lr = 0.01f;
    const uint64_t d = 300;
    ReferenceOptions ro;
    ro.workers = 3;
    ro.map = *ShardMap::Create(d, 2, 32);
    ro.steps = 12;
    ro.optimizer = o;
    ro.freeze.step = 4;
    std::vector<float> x0(d);
    for (uint64_t j = 0; j < d; ++j) x0[j] = std::sin(static_cast<float>(j));
    auto r = RunReference(ro, x0, [&](const float* x, uint32_t rank, uint64_t step, float* g) {
      for (uint64_t j = 0; j < d; ++j) g[j] = x[j] - std::cos(static_cast<float>(j + rank + step));
      return 0.0;
    });
    ASSERT_TRUE(r.ok()) << r.status();
    double largest = 0;
    for (const ServerShardState& s : r->servers) {
      for (size_t i = 0; i < s.x.size(); ++i) {
        const float master = s.x[i], error = s.e[i];
        for (const WorkerState& w : r->workers) {
          const float replica = w.x[s.begin + i];
          EXPECT_EQ(replica, s.replica[i]);
          // 12 steps of fp32 rounding on values of order 1.
          EXPECT_NEAR(replica + error, master, 1e-5) << OptimizerKindName(kind) << " " << i;
        }
        largest = std::max(largest, std::fabs(static_cast<double>(error)));
      }
    }
    EXPECT_GT(largest, 1e-4) << "the server error must be non-trivial for the check to mean much";
  }
}

// naive-onebit-adam keeps updating v after the warm-up; onebit-adam freezes it.
TEST(Optimizer, NaiveKeepsAdamRunningOnebitFreezesV) {
  for (OptimizerKind kind : {OptimizerKind::kOnebitAdam, OptimizerKind::kNaiveOnebitAdam}) {
    ReferenceOptions ro;
    ro.workers = 2;
    ro.map = *ShardMap::Create(64, 1, 32);
    ro.steps = 6;
    ro.optimizer = OnebitOptions(kind);
    ro.freeze.step = 3;
    std::vector<float> v_at_freeze;
    std::vector<float> x0(64, 1.0f);
    auto grad = [&](const float* x, uint32_t rank, uint64_t step, float* g) {
      for (int j = 0; j < 64; ++j) g[j] = x[j] * (1.0f + static_cast<float>(j + rank + step) / 64);
      return 0.0;
    };
    ro.steps = 3;
    auto before = RunReference(ro, x0, grad);
    ro.steps = 6;
    auto after = RunReference(ro, x0, grad);
    ASSERT_TRUE(before.ok() && after.ok());
    EXPECT_EQ(before->freeze_step, 3u);
    const bool same = before->servers[0].v == after->servers[0].v;
    EXPECT_EQ(same, kind == OptimizerKind::kOnebitAdam) << OptimizerKindName(kind);
  }
}

TEST(WeightDecayRanges, PiecesCoverTheRangeWithTheirOwnValues) {
  OptimizerOptions o;
  o.weight_decay = 0.5f;
  o.weight_decay_ranges = {{10, 20, 0.0f}, {20, 25, 0.25f}, {40, 50, 1.0f}};
  using Piece = std::tuple<size_t, size_t, float, float>;
  std::vector<Piece> got;
  auto record = [&](size_t p, size_t n, float wd, float ls) { got.emplace_back(p, n, wd, ls); };
  ForEachRangeSetting(o, 15, 30, record);
  // [15, 45): 15..20 at 0, 20..25 at 0.25, 25..40 at the job's, 40..45 at 1.
  EXPECT_EQ(got, (std::vector<Piece>{
                     {0, 5, 0.0f, 1}, {5, 5, 0.25f, 1}, {10, 15, 0.5f, 1}, {25, 5, 1.0f, 1}}));
  got.clear();
  ForEachRangeSetting(o, 0, 5, record);
  EXPECT_EQ(got, (std::vector<Piece>{{0, 5, 0.5f, 1}}));
  // Lr scales cut the pieces where either setting changes.
  o.lr_scale_ranges = {{0, 12, 2.0f}, {22, 30, 0.5f}};
  got.clear();
  ForEachRangeSetting(o, 5, 40, record);
  EXPECT_EQ(got, (std::vector<Piece>{{0, 5, 0.5f, 2},
                                     {5, 2, 0.0f, 2},
                                     {7, 8, 0.0f, 1},
                                     {15, 2, 0.25f, 1},
                                     {17, 3, 0.25f, 0.5f},
                                     {20, 5, 0.5f, 0.5f},
                                     {25, 10, 0.5f, 1},
                                     {35, 5, 1.0f, 1}}));
  o.weight_decay_ranges = {{10, 20, 0.0f}, {15, 30, 0.1f}};
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("disjoint"));
  o.weight_decay_ranges.clear();
  o.lr_scale_ranges = {{0, 12, -1.0f}};
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--lr: range 0"));
  o.lr_scale_ranges = {{5, 5, 1.0f}};
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("non-empty"));
}

// Server and worker give each element the step of its own range's weight
// decay: elementwise equal to runs with that decay everywhere.
TEST(WeightDecayRanges, EachElementStepsWithItsRangesDecay) {
  for (const char* kind : {"adam", "onebit-adam", "ef-sgd"}) {
    SCOPED_TRACE(kind);
    auto options = [&](float wd) {
      OptimizerOptions o;
      o.kind = *ParseOptimizerKind(kind);
      o.lr = 0.01f;
      o.weight_decay = wd;
      o.codec.block_size = 32;
      o.worker_codec = o.server_codec = "fp32";  // elementwise, so elements compare
      return o;
    };
    OptimizerOptions ranged = options(0.2f);
    ranged.weight_decay_ranges = {{100 + 3, 100 + 40, 0.0f}};  // shard starts at 100
    const size_t n = 64;
    std::vector<std::vector<float>> x;
    for (const OptimizerOptions& o : {ranged, options(0.2f), options(0.0f)}) {
      auto server = ServerOptimizer::Create(o);
      ASSERT_TRUE(server.ok()) << server.status();
      ServerShardState s;
      (*server)->InitState(0, 100, n, &s);
      for (size_t i = 0; i < n; ++i) s.x[i] = 1.0f + 0.01f * i;
      // onebit-adam: one warm-up step, then the compression phase.
      const bool last = HasWarmup(o.kind) && HasCompressionPhase(o.kind);
      for (uint64_t t = 0; t < 3; ++t) {
        std::vector<float> acc(n);
        for (size_t i = 0; i < n; ++i) acc[i] = 0.1f * std::sin(1.0f * i + t);
        std::vector<uint8_t> reply((*server)->ReplyBytes(PhaseOf(s), n, last && t == 0));
        ASSERT_TRUE((*server)->Step(t, last && t == 0, acc.data(), 0, n, &s, reply.data()).ok());
        if (last && t == 0) (*server)->EnterCompression(&s);
      }
      x.push_back(s.x);
    }
    for (size_t i = 0; i < n; ++i) {
      const bool in = i >= 3 && i < 40;
      EXPECT_EQ(x[0][i], x[in ? 2 : 1][i]) << "element " << i;
    }
    EXPECT_NE(x[1], x[2]);  // the decay matters
  }
}

// Every optimizer steps each element at its own range's lr: a job with
// [0, 64) at x0.5 equals, element for element, the job at lr / 2 there and
// the job at lr elsewhere, through warm-up, freeze, compression and (0/1
// Adam) local and sync steps. 0.5 scales exactly; 64 is a layer end and a
// block boundary, and blocks and layers never mix elements across it.
TEST(LrScaleRanges, EveryOptimizerStepsEachElementAtItsRangesLr) {
  const uint64_t d = 192, cut = 64;
  for (const AlgorithmRow* row : AlgorithmRows()) {
    const OptimizerKind kind = row->traits.kind;
    SCOPED_TRACE(std::string(OptimizerKindName(kind)));
    auto run = [&](float lr, bool scaled) {
      ReferenceOptions ro;
      ro.workers = 2;
      ro.steps = 14;
      ro.map = IsLayerwise(kind) ? *ShardMap::CreateAligned(d, 2, 32, {cut, d})
                                 : *ShardMap::Create(d, 2, 32);
      OptimizerOptions& o = ro.optimizer;
      o.kind = kind;
      o.lr = lr;
      o.weight_decay = 0.1f;
      o.codec.block_size = 32;
      o.worker_codec = o.server_codec = std::string(DefaultCodec(kind));
      o.reply = DefaultReplyMode(kind);
      o.layer_ends = {cut, d};
      o.zero_one.var_freeze_step = 6;
      o.zero_one.var_update_scaler = 2;
      o.zero_one.local_step_scaler = 2;
      o.zero_one.local_step_clipper = 4;
      o.zero_one.steps = ro.steps;
      if (scaled) o.lr_scale_ranges = {{0, cut, 0.5f}};
      ro.freeze.step = 4;
      std::vector<float> x0(d);
      for (uint64_t j = 0; j < d; ++j) x0[j] = std::sin(static_cast<float>(j) + 0.5f);
      auto r = RunReference(ro, x0, [&](const float* x, uint32_t rank, uint64_t step, float* g) {
        for (uint64_t j = 0; j < d; ++j) {
          g[j] = x[j] - std::cos(static_cast<float>(j + 3 * rank + step));
        }
        return 0.0;
      });
      EXPECT_TRUE(r.ok()) << r.status();
      return r.ok() ? r->workers[1].x : std::vector<float>();
    };
    const std::vector<float> ranged = run(0.02f, true), half = run(0.01f, false),
                             whole = run(0.02f, false);
    ASSERT_EQ(ranged.size(), d);
    for (uint64_t j = 0; j < d; ++j) {
      EXPECT_EQ(ranged[j], j < cut ? half[j] : whole[j]) << "element " << j;
    }
    EXPECT_NE(half, whole);  // the lr matters
  }
}

TEST(AutoFreeze, VarianceChangeAndDecision) {
  EXPECT_DOUBLE_EQ(VarianceChange({1, 2, -3}, {1, 1, -1}), 3.0 / 6.0);
  EXPECT_EQ(VarianceChange({}, {}), 0.0);
  EXPECT_EQ(VarianceChange({0, 0}, {0, 0}), 0.0);
  FreezeOptions f;
  f.automatic = true;
  f.tau = 0.05;
  f.window = 10;
  EXPECT_EQ(AutoFreezeStep(f, 30, {0.01, 0.049}), 40u);
  EXPECT_EQ(AutoFreezeStep(f, 30, {0.01, 0.05}), kNever);
  EXPECT_EQ(AutoFreezeStep(f, 30, {}), 40u);
  // At the latest: the first check whose freeze comes at or after it fires,
  // settled or not (40 steps, F 0.25: latest 10, window 10: after 0 steps).
  f.latest = 10;
  EXPECT_EQ(AutoFreezeStep(f, 0, {1.0, 0.9}), 10u);
  f.latest = 11;
  EXPECT_EQ(AutoFreezeStep(f, 0, {1.0, 0.9}), kNever);
  EXPECT_EQ(AutoFreezeStep(f, 10, {1.0, 0.9}), 20u);
}

// The reference freezes where the rule says: v settles on a problem whose
// gradients stop changing, and the first check (against v = 0) never fires.
// With bias correction the check compares the v the freeze would keep,
// v / (1 - beta2^t). Under a constant squared gradient that v is constant,
// while the raw v still grows by the bias factor: its change over K = 50
// steps at t = 500 is beta2^450 (1 - beta2^50) / (1 - beta2^500) = 0.080.
TEST(AutoFreeze, WithBiasCorrectionTheCheckSeesTheCorrectedV) {
  OptimizerOptions o;
  o.beta2 = 0.999f;
  const double b2 = 0.999f;
  auto raw_v = [&](uint64_t t) {  // v after t steps of g^2 = 1, from v = 0
    return static_cast<float>(1.0 - std::pow(b2, static_cast<double>(t)));
  };
  const std::vector<float> now(4, raw_v(500)), before(4, raw_v(450));
  o.bias_correction = false;
  EXPECT_EQ(FreezeCheckScale(o, 500), 1.0);
  const double raw =
      VarianceChange(now, before, FreezeCheckScale(o, 500), FreezeCheckScale(o, 450));
  EXPECT_NEAR(raw, std::pow(b2, 450) * (1 - std::pow(b2, 50)) / (1 - std::pow(b2, 500)), 1e-6);
  EXPECT_GT(raw, 0.05);
  o.bias_correction = true;
  EXPECT_DOUBLE_EQ(FreezeCheckScale(o, 500), 1.0 / (1.0 - std::pow(b2, 500)));
  EXPECT_EQ(FreezeCheckScale(o, 0), 1.0);
  const double corrected =
      VarianceChange(now, before, FreezeCheckScale(o, 500), FreezeCheckScale(o, 450));
  EXPECT_LT(corrected, 1e-6);  // only the float rounding of v is left
  // What the servers and the reference compute: the same, and 1 without an
  // earlier check (the first window, or no v kept from one).
  EXPECT_EQ(FreezeCheckChange(o, 50, 500, now, before), corrected);
  EXPECT_EQ(FreezeCheckChange(o, 50, 50, now, before), 1.0);
  EXPECT_EQ(FreezeCheckChange(o, 50, 500, now, {}), 1.0);
  o.bias_correction = false;
  EXPECT_EQ(FreezeCheckChange(o, 50, 500, now, before), raw);
}

TEST(AutoFreeze, ReferenceFreezesOnceVSettles) {
  ReferenceOptions ro;
  ro.workers = 2;
  ro.map = *ShardMap::Create(100, 2, 32);
  ro.steps = 200;
  ro.optimizer = OnebitOptions(OptimizerKind::kOnebitAdam);
  ro.optimizer.lr = 0;  // x stays put, so g is constant and v converges as 1 - b2^t
  ro.freeze = *ParseAutoFreeze("auto:0.05:20");
  auto run = [&ro] {
    return RunReference(ro, std::vector<float>(100, 1.0f),
                        [](const float*, uint32_t, uint64_t, float* g) {
                          for (int j = 0; j < 100; ++j) g[j] = 1.0f + j;
                          return 0.0;
                        });
  };
  auto r = run();
  ASSERT_TRUE(r.ok()) << r.status();
  // v_t = (1 - b2^t) g²: ||v_t - v_{t-20}|| / ||v_t|| = (b2^(t-20) - b2^t) / (1 - b2^t),
  // which with b2 = 0.999 is still 0.09 at t = 200: no freeze.
  EXPECT_EQ(r->freeze_step, kNever);
  ro.optimizer.beta2 = 0.9f;
  r = run();
  ASSERT_TRUE(r.ok());
  // Check at 20: against v = 0, no. At 40: (0.9^20 - 0.9^40) / (1 - 0.9^40) = 0.107. At 60:
  // (0.9^40 - 0.9^60) / (1 - 0.9^60) = 0.0132 < 0.05: compression from step 80.
  EXPECT_EQ(r->freeze_step, 80u);
  // With bias correction the corrected v is g² from the first step: the
  // check at 40 (the first with a previous one) finds it settled.
  ro.optimizer.beta2 = 0.999f;
  ro.optimizer.bias_correction = true;
  r = run();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->freeze_step, 60u);
}

// --------------------------------------------------------------- zero-one-adam

// DeepSpeed's ZeroOneAdam counters, run step by step (k from 1): which k
// refresh v, and which synchronise after the freeze.
struct ZeroOneCounters {
  std::vector<bool> variance, sync;
};
ZeroOneCounters RunCounters(const ZeroOneOptions& z, uint64_t steps) {
  ZeroOneCounters c;
  uint64_t var_interval = 1, var_counter = 0, local_interval = 1, local_counter = 0;
  for (uint64_t k = 1; k <= steps; ++k) {
    if (k <= z.var_freeze_step) {
      const bool var = k % var_interval == 0;
      c.variance.push_back(var);
      c.sync.push_back(true);
      if (var && ++var_counter == z.var_update_scaler) {
        var_counter = 0;
        var_interval *= 2;
      }
    } else {
      c.variance.push_back(false);
      c.sync.push_back(k % local_interval == 0 || k == z.steps);
      if (++local_counter == z.local_step_scaler) {
        local_counter = 0;
        local_interval = std::min<uint64_t>(z.local_step_clipper, local_interval * 2);
      }
    }
  }
  return c;
}

TEST(ZeroOneSchedule, VarianceStepsAtDoublingIntervals) {
  ZeroOneOptions z;
  z.var_update_scaler = 2;
  z.var_freeze_step = 20;
  // k = 1, 2; then two multiples of 2 after 2: 4, 6; of 4 after 6: 8, 12;
  // of 8 after 12: 16 (24 is past the freeze).
  std::vector<uint64_t> got;
  for (uint64_t t = 0; t < 40; ++t) {
    if (IsVarianceStep(z, t)) got.push_back(t + 1);
  }
  EXPECT_EQ(got, (std::vector<uint64_t>{1, 2, 4, 6, 8, 12, 16}));
  for (uint32_t kappa : {1u, 3u, 16u}) {
    z.var_update_scaler = kappa;
    z.var_freeze_step = 5000;
    const ZeroOneCounters c = RunCounters(z, 6000);
    uint64_t refreshes = 0;
    for (uint64_t t = 0; t < 6000; ++t) {
      ASSERT_EQ(IsVarianceStep(z, t), c.variance[t]) << "kappa " << kappa << " k " << t + 1;
      refreshes += c.variance[t] ? 1 : 0;
      ASSERT_EQ(VarianceRefreshes(z, t), refreshes) << "kappa " << kappa << " k " << t + 1;
    }
  }
  // The den correction 1 - beta2^r counts refreshes, not steps: at k = 16
  // (kappa 2, above) v has had 7 terms.
  z.var_update_scaler = 2;
  z.var_freeze_step = 20;
  OptimizerOptions o;
  o.zero_one = z;
  EXPECT_EQ(ZeroOneVarianceCorrection(o, 15),
            static_cast<float>(1.0 - std::pow(static_cast<double>(0.999f), 7.0)));
}

TEST(ZeroOneSchedule, LocalIntervalDoublesUpToTheClipperAndTheLastStepSyncs) {
  ZeroOneOptions z;
  z.var_freeze_step = 4;
  z.local_step_scaler = 3;
  z.local_step_clipper = 4;
  z.steps = 15;
  // Before the freeze every step; then interval 1 for k = 5..7, 2 for
  // 8..10, 4 from 11 on; k = 15 is the job's last.
  std::vector<uint64_t> local;
  for (uint64_t t = 0; t < 17; ++t) {
    if (!IsSyncStep(z, t)) local.push_back(t + 1);
  }
  EXPECT_EQ(local, (std::vector<uint64_t>{9, 11, 13, 14, 17}));
  for (uint32_t clip : {1u, 5u, 16u}) {
    z.var_freeze_step = 100;
    z.local_step_scaler = 7;
    z.local_step_clipper = clip;
    z.steps = 2001;
    const ZeroOneCounters c = RunCounters(z, 2001);
    for (uint64_t t = 0; t < 2001; ++t) {
      ASSERT_EQ(IsSyncStep(z, t), c.sync[t]) << "clipper " << clip << " k " << t + 1;
    }
  }
}

OptimizerOptions ZeroOneOptionsForTest() {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kZeroOneAdam);
  o.lr = 0.01f;
  o.weight_decay = 0.1f;
  o.v_floor = 1e-4f;
  o.zero_one.var_update_scaler = 1;
  o.zero_one.var_freeze_step = 3;
  o.zero_one.local_step_scaler = 2;
  o.zero_one.local_step_clipper = 2;
  o.zero_one.steps = 9;
  return o;
}

// The gradient of worker r at x for step t: depends on x (so local steps
// matter) and on the rank.
float TestGradient(const float* x, uint32_t r, uint64_t t, size_t j) {
  return 0.5f * x[j] + 0.01f * static_cast<float>((j * 7 + r * 3 + t * 5) % 11) - 0.05f;
}

// 0/1 Adam written out by hand for 2 workers and d = 64 (two 32-element
// blocks, one per shard), then the reference: every step kind is in the
// nine steps (k = 1, 2 refresh v; 3 compresses gradients; 4..9 are after the
// freeze: 4, 5, 6 and 8 synchronise, 7 is local, 9 is the job's last).
TEST(ZeroOneAdam, ReferenceMatchesHandComputationStepByStep) {
  const OptimizerOptions o = ZeroOneOptionsForTest();
  const size_t d = 64, N = 2;
  const float b1 = o.beta1, c1 = 1.0f - o.beta1, b2 = o.beta2, c2 = 1.0f - o.beta2;
  const float lr = o.lr, wd = o.weight_decay, eps = o.eps;
  std::vector<float> x0(d);
  for (size_t j = 0; j < d; ++j) x0[j] = 0.1f * static_cast<float>(static_cast<int>(j % 13) - 6);
  auto onebit = [](const std::vector<float>& z) {  // per 32-block
    std::vector<float> out;
    for (size_t b = 0; b < z.size(); b += 32) {
      const std::vector<float> d1 =
          OneBit(std::vector<float>(z.begin() + b, z.begin() + std::min(z.size(), b + 32)));
      out.insert(out.end(), d1.begin(), d1.end());
    }
    return out;
  };

  std::vector<float> x = x0, m(d, 0.0f), v(d, 0.0f), den(d, 0.0f), e_s(d, 0.0f);
  std::vector<std::vector<float>> e_w(N, std::vector<float>(d, 0.0f)), xl(N), ml(N);
  std::vector<float> xs;
  float lrs = 0.0f;
  std::vector<std::vector<float>> g(N, std::vector<float>(d));
  for (uint64_t t = 0; t < 9; ++t) {
    const uint64_t k = t + 1;
    for (uint32_t r = 0; r < N; ++r) {
      const float* at = k <= 3 ? x.data() : xl[r].data();
      for (size_t j = 0; j < d; ++j) g[r][j] = TestGradient(at, r, t, j);
    }
    if (k == 1 || k == 2) {  // variance steps: the moments, den (v corrected for k refreshes), x
      const float corr =
          static_cast<float>(1.0 - std::pow(static_cast<double>(b2), static_cast<double>(k)));
      for (size_t j = 0; j < d; ++j) {
        const float gb = 0.0f + 0.5f * g[0][j] + 0.5f * g[1][j];
        m[j] = b1 * m[j] + c1 * gb;
        v[j] = b2 * v[j] + c2 * gb * gb;
        den[j] = std::sqrt(std::max(v[j] / corr, o.v_floor)) + eps;
        x[j] = x[j] - lr * (m[j] / den[j] + wd * x[j]);
      }
    } else if (k == 3) {  // compressed gradients, both errors
      std::vector<float> a(d, 0.0f), zs(d);
      for (uint32_t r = 0; r < N; ++r) {
        std::vector<float> z(d);
        for (size_t j = 0; j < d; ++j) z[j] = g[r][j] + e_w[r][j];
        const std::vector<float> c = onebit(z);
        for (size_t j = 0; j < d; ++j) {
          e_w[r][j] = z[j] - c[j];
          a[j] += 0.5f * c[j];
        }
      }
      for (size_t j = 0; j < d; ++j) zs[j] = a[j] + e_s[j];
      const std::vector<float> gh = onebit(zs);
      for (size_t j = 0; j < d; ++j) {
        e_s[j] = zs[j] - gh[j];
        m[j] = b1 * m[j] + c1 * gh[j];
        x[j] = x[j] - lr * (m[j] / den[j] + wd * x[j]);
      }
      // The freeze: errors start again, local models from the replica.
      for (uint32_t r = 0; r < N; ++r) {
        std::fill(e_w[r].begin(), e_w[r].end(), 0.0f);
        xl[r] = x;
        ml[r] = m;
      }
      std::fill(e_s.begin(), e_s.end(), 0.0f);
      xs = x;
    } else {  // after the freeze: a local step, then maybe a sync
      lrs += lr;
      for (uint32_t r = 0; r < N; ++r) {
        for (size_t j = 0; j < d; ++j) {
          ml[r][j] = b1 * ml[r][j] + c1 * g[r][j];
          xl[r][j] = xl[r][j] - lr * (ml[r][j] / den[j] + wd * xl[r][j]);
        }
      }
      if (k == 7) continue;
      std::vector<float> a(d, 0.0f), zs(d);
      for (uint32_t r = 0; r < N; ++r) {
        std::vector<float> z(d);
        for (size_t j = 0; j < d; ++j) z[j] = (xl[r][j] - xs[j]) * den[j] + e_w[r][j];
        const std::vector<float> c = onebit(z);
        for (size_t j = 0; j < d; ++j) {
          e_w[r][j] = z[j] - c[j];
          a[j] += 0.5f * c[j];
        }
      }
      for (size_t j = 0; j < d; ++j) zs[j] = a[j] + e_s[j];
      const std::vector<float> ub = onebit(zs);
      for (size_t j = 0; j < d; ++j) {
        e_s[j] = zs[j] - ub[j];
        xs[j] += ub[j] / den[j];
        x[j] += ub[j] / den[j];
        for (uint32_t r = 0; r < N; ++r) {
          ml[r][j] = -(ub[j] / lrs);
          xl[r][j] = xs[j];
        }
      }
      lrs = 0.0f;
    }
  }

  ReferenceOptions ro;
  ro.workers = N;
  ro.map = *ShardMap::Create(d, 2, 32);
  ro.steps = 9;
  ro.optimizer = o;
  auto r = RunReference(ro, x0, [&](const float* at, uint32_t rank, uint64_t t, float* out) {
    for (size_t j = 0; j < d; ++j) out[j] = TestGradient(at, rank, t, j);
    return 0.0;
  });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->freeze_step, 3u);
  EXPECT_EQ(r->rounds, 8u);  // all but k = 7
  EXPECT_EQ(r->push_bytes[6], 0u);
  EXPECT_EQ(r->reply_bytes[6], 0u);
  EXPECT_EQ(r->push_bytes[0], N * 4 * d);             // fp32
  EXPECT_EQ(r->push_bytes[2], N * 2 * (4 + 32 / 8));  // a scale and 32 bits per shard
  ASSERT_EQ(r->servers.size(), 2u);
  for (size_t j = 0; j < d; ++j) {
    const ServerShardState& s = r->servers[j / 32];
    ASSERT_EQ(s.x[j % 32], x[j]) << j;
    ASSERT_EQ(s.e[j % 32], e_s[j]) << j;
    ASSERT_EQ(s.den[j % 32], den[j]) << j;
    for (uint32_t w = 0; w < N; ++w) {
      ASSERT_EQ(r->workers[w].x[j], x[j]) << "worker " << w << " " << j;
      ASSERT_EQ(r->workers[w].x_sync[j], x[j]) << "worker " << w << " " << j;
      ASSERT_EQ(r->workers[w].mbar[j], ml[w][j]) << "worker " << w << " " << j;
      ASSERT_EQ(r->workers[w].e[j], e_w[w][j]) << "worker " << w << " " << j;
    }
  }
  EXPECT_EQ(r->workers[0].lrs, 0.0f);
  EXPECT_TRUE(r->workers[0].v.empty());  // frozen: den is all that is kept
}

// A coordinate whose gradient is always 0 (the weight of a pixel blank in
// every image): v stays 0 there, but the compressed step k = 2 gives it
// m = (1 - b1) s, the server's block scale. The variance steps k = 3 and 4
// must move it by lr m / (sqrt(v_floor) + eps), as the compressed steps do,
// not by lr m / eps (a step of ~3000 here, NaN within a few steps on the mlp).
// The other coordinates check den's correction: v / (1 - b2^r), r = 1, 2, 3
// refreshes at k = 1, 3, 4.
TEST(ZeroOneAdam, VarianceStepsUseTheFlooredCorrectedDenominator) {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kZeroOneAdam);
  o.lr = 0.01f;
  o.weight_decay = 0.0f;
  o.zero_one.var_update_scaler = 1;  // v refreshed at k = 1, 2, 4: k = 3 compresses
  o.zero_one.var_freeze_step = 4;
  o.zero_one.steps = 4;
  const size_t d = 32;
  auto grad = [](size_t j) {
    return j == 0 ? 0.0f : 0.01f * static_cast<float>(1 + j % 5) * (j % 2 ? 1.0f : -1.0f);
  };
  std::vector<float> x0(d), x, m(d, 0.0f), v(d, 0.0f), den(d, 0.0f), e_w(d, 0.0f), e_s(d, 0.0f);
  for (size_t j = 0; j < d; ++j) x0[j] = 0.01f * static_cast<float>(j);
  x = x0;
  uint64_t r = 0;
  for (uint64_t k = 1; k <= 4; ++k) {
    std::vector<float> gh(d);
    if (k != 3) {
      ++r;
      const float corr =
          static_cast<float>(1.0 - std::pow(static_cast<double>(o.beta2), static_cast<double>(r)));
      for (size_t j = 0; j < d; ++j) {
        const float gb = 0.0f + 1.0f * grad(j);
        m[j] = o.beta1 * m[j] + (1.0f - o.beta1) * gb;
        v[j] = o.beta2 * v[j] + (1.0f - o.beta2) * gb * gb;
        den[j] = std::sqrt(std::max(v[j] / corr, o.v_floor)) + o.eps;
      }
    } else {
      std::vector<float> z(d), zs(d);
      for (size_t j = 0; j < d; ++j) z[j] = grad(j) + e_w[j];
      const std::vector<float> cw = OneBit(z);
      for (size_t j = 0; j < d; ++j) {
        e_w[j] = z[j] - cw[j];
        zs[j] = (0.0f + 1.0f * cw[j]) + e_s[j];
      }
      gh = OneBit(zs);
      for (size_t j = 0; j < d; ++j) {
        e_s[j] = zs[j] - gh[j];
        m[j] = o.beta1 * m[j] + (1.0f - o.beta1) * gh[j];
      }
      ASSERT_GT(m[0], 0.0f);  // +s for the zero gradient
    }
    for (size_t j = 0; j < d; ++j) x[j] = x[j] - o.lr * (m[j] / den[j] + 0.0f * x[j]);
  }
  EXPECT_EQ(v[0], 0.0f);
  EXPECT_LT(std::fabs(x[0] - x0[0]), 1.0f);

  ReferenceOptions ro;
  ro.workers = 1;
  ro.map = *ShardMap::Create(d, 1, 32);
  ro.steps = 4;
  ro.optimizer = o;
  auto res = RunReference(ro, x0, [&](const float*, uint32_t, uint64_t, float* out) {
    for (size_t j = 0; j < d; ++j) out[j] = grad(j);
    return 0.0;
  });
  ASSERT_TRUE(res.ok()) << res.status();
  for (size_t j = 0; j < d; ++j) {
    ASSERT_EQ(res->servers[0].den[j], den[j]) << j;
    ASSERT_EQ(res->servers[0].x[j], x[j]) << j;
    ASSERT_EQ(res->workers[0].x[j], x[j]) << j;
  }
}

// A NaN gradient in a local step after the freeze is refused at that step,
// naming it and the element, with the local model unchanged (not found at
// the next sync as a diverged update).
TEST(ZeroOneAdam, ANonFiniteGradientIsRefusedAtItsLocalStepChangingNothing) {
  const OptimizerOptions o = ZeroOneOptionsForTest();
  auto w = WorkerOptimizer::Create(o);
  ASSERT_TRUE(w.ok());
  ASSERT_EQ((*w)->KindOf(6, Phase::kCompress), StepKind::kLocal);  // k = 7
  WorkerState s;
  (*w)->InitState(64, &s);
  s.x.assign(64, 0.5f);
  (*w)->EnterCompression(&s);
  s.den.assign(64, 1.0f);
  const WorkerState before = s;
  std::vector<float> g(64, 0.25f);
  g[3] = NAN;
  const absl::Status st = (*w)->LocalStep(6, o.lr, g.data(), 0, 64, &s);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("the gradient of step 6 is not finite in elements [0, 64) at index 3 "
                        "(element 3 of x)"));
  EXPECT_EQ(s.x, before.x);
  EXPECT_EQ(s.mbar, before.mbar);
}

TEST(ZeroOneAdam, CombinationsThatMakeNoSenseAreRefusedNamingTheFlag) {
  OptimizerOptions o = ZeroOneOptionsForTest();
  EXPECT_TRUE(ValidateOptimizerOptions(o).ok());
  o.reply = ReplyMode::kDelta;
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--server_reply"));
  o = ZeroOneOptionsForTest();
  o.bias_correction = true;
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--bias_correction"));
  o = ZeroOneOptionsForTest();
  o.zero_one.var_update_scaler = 0;
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--var_update_scaler"));
  o = ZeroOneOptionsForTest();
  o.zero_one.local_step_clipper = 0;
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()),
              HasSubstr("--local_step_clipper"));
  // A diverged zero-one-adam job is told its block size first, naming it;
  // the others a lower lr. Each remedy names flags that exist.
  OptimizerOptions zo = ZeroOneOptionsForTest();
  zo.codec.block_size = 2048;
  const std::string remedy = DivergenceRemedy(zo);
  EXPECT_THAT(remedy, HasSubstr("a smaller --block_size (this job's 2048; 256 by default)"));
  EXPECT_THAT(remedy, HasSubstr("--lr_schedule warmup:N"));
  EXPECT_THAT(remedy, HasSubstr("--v_floor 1e-6"));
  zo.codec.block_size = 256;  // already the default: the remedy does not ask for it
  EXPECT_THAT(DivergenceRemedy(zo), Not(HasSubstr("--block_size")));
  EXPECT_THAT(DivergenceRemedy(zo), HasSubstr("--lr_schedule warmup:N"));
  EXPECT_THAT(DivergenceRemedy(OnebitOptions(OptimizerKind::kOnebitAdam)),
              AllOf(HasSubstr("a lower --lr"), HasSubstr("--v_floor")));
  EXPECT_EQ(DefaultBlockSize(OptimizerKind::kZeroOneAdam), 256u);
  EXPECT_EQ(DefaultBlockSize(OptimizerKind::kOnebitAdam), 2048u);
  auto w = WorkerOptimizer::Create(ZeroOneOptionsForTest());
  ASSERT_TRUE(w.ok());
  WorkerState s;
  (*w)->InitState(32, &s);
  std::vector<float> g(32, 1.0f);
  // Step 0 refreshes v: it is no local step.
  EXPECT_FALSE((*w)->LocalStep(0, 0.01f, g.data(), 0, 32, &s).ok());
}

OptimizerOptions LambOptionsForTest() {
  OptimizerOptions o = OnebitOptions(OptimizerKind::kOnebitLamb);
  o.lr = 0.01f;
  o.weight_decay = 0.1f;
  o.v_floor = 1e-4f;
  // Four tensors: W0 (40), b0 (4), W1 (52), b1 (4); no decay on the biases.
  o.layer_ends = {40, 44, 96, 100};
  o.weight_decay_ranges = {{40, 44, 0.0f}, {96, 100, 0.0f}};
  o.lamb.factor_threshold = 0.05f;
  return o;
}

// 1-bit LAMB written out by hand for 2 workers and the four tensors above
// on two shards of whole tensors ([0, 44) and [44, 100), each cut into
// 32-element blocks from its start), then the reference: three LAMB
// warm-up steps (the last hands m over), then four compressed steps whose
// factors move from 1 within the threshold. Momentum replies: the server
// replies C(a + e_s) and the layers' ratios, and every replica steps as the
// master; delta replies: C(Δ + e_s), replicas trail.
void CheckLambByHand(ReplyMode mode) {
  OptimizerOptions o = LambOptionsForTest();
  o.reply = mode;
  const bool momentum = mode == ReplyMode::kMomentum;
  const size_t d = 100, N = 2, T = 7, freeze = 3;
  const std::vector<std::pair<size_t, size_t>> layers = {{0, 40}, {40, 44}, {44, 96}, {96, 100}};
  const std::vector<std::pair<size_t, size_t>> shards = {{0, 44}, {44, 100}};
  const float b1 = o.beta1, c1 = 1.0f - o.beta1, b2 = o.beta2, c2 = 1.0f - o.beta2;
  const float lr = o.lr, eps = o.eps;
  const LambOptions& l = o.lamb;
  auto wd_of = [&](size_t j) { return (j >= 40 && j < 44) || j >= 96 ? 0.0f : o.weight_decay; };
  auto onebit = [&](const std::vector<float>& z) {  // per shard, 32-blocks from its start
    std::vector<float> out(z.size());
    for (const auto& [sb, se] : shards) {
      for (size_t b = sb; b < se; b += 32) {
        const size_t e = std::min(se, b + 32);
        const std::vector<float> d1 = OneBit(std::vector<float>(z.begin() + b, z.begin() + e));
        std::copy(d1.begin(), d1.end(), out.begin() + b);
      }
    }
    return out;
  };
  std::vector<float> x0(d);
  for (size_t j = 0; j < d; ++j) x0[j] = 0.1f * static_cast<float>(static_cast<int>(j % 13) - 6);

  std::vector<float> x = x0, xw = x0, m(d, 0.0f), v(d, 0.0f), den(d), e_s(d, 0.0f);
  std::vector<float> coeff(layers.size(), 0.0f), factor(layers.size(), 1.0f);
  std::vector<std::vector<float>> mw(N), e_w(N, std::vector<float>(d, 0.0f));
  std::vector<std::vector<float>> g(N, std::vector<float>(d));
  uint64_t floored = 0;
  bool clipped = false;
  for (uint64_t t = 0; t < T; ++t) {
    for (uint32_t r = 0; r < N; ++r) {
      for (size_t j = 0; j < d; ++j) g[r][j] = TestGradient(xw.data(), r, t, j);
    }
    std::vector<float> a(d, 0.0f), u(d), p(d);
    const bool warm = t < freeze;
    if (warm) {
      for (size_t j = 0; j < d; ++j) {
        const float gb = 0.0f + 0.5f * g[0][j] + 0.5f * g[1][j];
        m[j] = b1 * m[j] + c1 * gb;
        v[j] = b2 * v[j] + c2 * gb * gb;
        p[j] = m[j] / (std::sqrt(v[j]) + eps);
      }
    } else {
      for (uint32_t r = 0; r < N; ++r) {
        std::vector<float> y(d);
        for (size_t j = 0; j < d; ++j) {
          mw[r][j] = b1 * mw[r][j] + c1 * g[r][j];
          y[j] = mw[r][j] + e_w[r][j];
        }
        const std::vector<float> c = onebit(y);
        for (size_t j = 0; j < d; ++j) {
          e_w[r][j] = y[j] - c[j];
          a[j] += 0.5f * c[j];
        }
      }
      if (momentum) {  // everyone's momentum is D(C(a + e_s))
        std::vector<float> z(d);
        for (size_t j = 0; j < d; ++j) z[j] = a[j] + e_s[j];
        const std::vector<float> cs = onebit(z);
        for (size_t j = 0; j < d; ++j) {
          e_s[j] = z[j] - cs[j];
          a[j] = cs[j];
        }
        for (uint32_t r = 0; r < N; ++r) mw[r] = a;
      }
      for (size_t j = 0; j < d; ++j) {
        const float gr = (a[j] - b1 * m[j]) / c1;
        v[j] = b2 * v[j] + c2 * gr * gr;
        m[j] = a[j];
        p[j] = m[j] / den[j];
      }
    }
    for (size_t j = 0; j < d; ++j) u[j] = wd_of(j) == 0.0f ? p[j] : p[j] + wd_of(j) * x[j];
    std::vector<float> delta(d);
    for (size_t li = 0; li < layers.size(); ++li) {
      const auto [lb, le] = layers[li];
      double x2 = 0, u2 = 0, p2 = 0;
      for (size_t j = lb; j < le; ++j) {
        x2 += static_cast<double>(x[j]) * x[j];
        u2 += static_cast<double>(u[j]) * u[j];
        p2 += static_cast<double>(p[j]) * p[j];
      }
      float ratio = 1.0f;
      if (warm) {
        ratio = static_cast<float>(std::sqrt(x2) / std::sqrt(u2));
        ratio = std::min(std::max(ratio, l.min_coeff), l.max_coeff);
        coeff[li] = l.coeff_beta * coeff[li] + (1.0f - l.coeff_beta) * ratio;
      } else {
        float f = 0.0f;
        for (size_t j = lb; j < le; ++j) f = std::max(f, den[j] / (std::sqrt(v[j]) + eps));
        const float w = static_cast<float>(std::min(1.0, std::sqrt(p2) / std::sqrt(u2)));
        f = f * w + (1.0f - w);
        f = std::min(std::max(f, l.factor_min), l.factor_max);
        const float lo = factor[li] * (1.0f - l.factor_threshold);
        const float hi = factor[li] * (1.0f + l.factor_threshold);
        clipped |= f < lo || f > hi;
        f = std::min(std::max(f, lo), hi);
        factor[li] = f;
        ratio = coeff[li] * f;
      }
      for (size_t j = lb; j < le; ++j) delta[j] = (-lr * ratio) * u[j];
    }
    if (warm) {
      for (size_t j = 0; j < d; ++j) {
        x[j] += delta[j];
        xw[j] += delta[j];
      }
      if (t + 1 == freeze) {  // the hand-over: v floored and frozen in den, m to the workers
        for (size_t j = 0; j < d; ++j) {
          if (v[j] < o.v_floor) {
            v[j] = o.v_floor;
            ++floored;
          }
          den[j] = std::sqrt(v[j]) + eps;
        }
        for (uint32_t r = 0; r < N; ++r) mw[r] = m;
      }
    } else if (momentum) {
      for (size_t j = 0; j < d; ++j) {
        x[j] += delta[j];
        xw[j] += delta[j];
      }
    } else {
      std::vector<float> z(d);
      for (size_t j = 0; j < d; ++j) {
        x[j] += delta[j];
        z[j] = delta[j] + e_s[j];
      }
      const std::vector<float> cs = onebit(z);
      for (size_t j = 0; j < d; ++j) {
        e_s[j] = z[j] - cs[j];
        xw[j] += cs[j];
      }
    }
  }
  EXPECT_TRUE(clipped) << "the test should make the threshold bite";

  ReferenceOptions ro;
  ro.workers = N;
  ro.map = *ShardMap::CreateAligned(d, 2, 32, o.layer_ends);
  ASSERT_EQ(ro.map.shard(0), (Range{0, 44}));
  ASSERT_EQ(ro.map.shard(1), (Range{44, 100}));
  ro.steps = T;
  ro.optimizer = o;
  ro.freeze.step = freeze;
  auto r = RunReference(ro, x0, [&](const float* at, uint32_t rank, uint64_t t, float* out) {
    for (size_t j = 0; j < d; ++j) out[j] = TestGradient(at, rank, t, j);
    return 0.0;
  });
  ASSERT_TRUE(r.ok()) << r.status();
  // The hand-over reply carries m (and for momentum replies v) after Δ;
  // momentum replies after it carry the two layers' ratios of each shard.
  EXPECT_EQ(r->reply_bytes[freeze - 1], N * (momentum ? 12 : 8) * d);
  EXPECT_EQ(r->reply_bytes[freeze],
            N * (4 * 4 + (44 + 7) / 8 + (56 + 7) / 8 + (momentum ? 4 * 4 : 0)));
  uint64_t server_floored = 0;
  for (size_t k = 0; k < shards.size(); ++k) {
    const ServerShardState& s = r->servers[k];
    const size_t sb = shards[k].first;
    server_floored += s.floored;
    for (size_t j = sb; j < shards[k].second; ++j) {
      ASSERT_EQ(s.x[j - sb], x[j]) << j;
      if (!momentum) {
        ASSERT_EQ(s.replica[j - sb], xw[j]) << j;
      }
      ASSERT_EQ(s.e[j - sb], e_s[j]) << j;
      ASSERT_EQ(s.m[j - sb], m[j]) << j;
      ASSERT_EQ(s.v[j - sb], v[j]) << j;
      ASSERT_EQ(s.den[j - sb], den[j]) << j;
    }
  }
  EXPECT_EQ(server_floored, floored);
  ASSERT_EQ(r->servers[0].lamb_coeff.size(), 2u);
  ASSERT_EQ(r->servers[1].lamb_coeff.size(), 2u);
  for (size_t li = 0; li < layers.size(); ++li) {
    const ServerShardState& s = r->servers[li / 2];
    EXPECT_EQ(s.lamb_coeff[li % 2], coeff[li]) << "layer " << li;
    EXPECT_EQ(s.lamb_factor[li % 2], factor[li]) << "layer " << li;
  }
  for (uint32_t w = 0; w < N; ++w) {
    for (size_t j = 0; j < d; ++j) {
      ASSERT_EQ(r->workers[w].x[j], xw[j]) << "worker " << w << " " << j;
      ASSERT_EQ(r->workers[w].mbar[j], mw[w][j]) << "worker " << w << " " << j;
      ASSERT_EQ(r->workers[w].e[j], e_w[w][j]) << "worker " << w << " " << j;
      if (momentum) {
        ASSERT_EQ(r->workers[w].den[j], den[j]) << "worker " << w << " " << j;
      }
    }
  }
  if (momentum) {
    EXPECT_EQ(xw, x);
  }
}

TEST(OnebitLamb, MomentumRepliesMatchHandComputationStepByStep) {
  CheckLambByHand(ReplyMode::kMomentum);
}

TEST(OnebitLamb, DeltaRepliesMatchHandComputationStepByStep) { CheckLambByHand(ReplyMode::kDelta); }

TEST(OnebitLamb, AShardThatCutsALayerIsRefusedNamingIt) {
  const OptimizerOptions o = LambOptionsForTest();
  auto s = ServerOptimizer::Create(o);
  ASSERT_TRUE(s.ok()) << s.status();
  ServerShardState st;
  (*s)->InitState(0, 0, 50, &st);  // [0, 50) cuts W1 = [44, 96)
  std::vector<float> acc(50, 0.1f);
  std::vector<uint8_t> reply((*s)->ReplyBytes(StepKind::kFull, 50, false));
  absl::Status bad = (*s)->Step(0, false, acc.data(), 0, 50, &st, reply.data());
  EXPECT_THAT(std::string(bad.message()), HasSubstr("layer [44, 96) crosses the shard [0, 50)"));
  // Steps of part of a shard are refused: the ratios need the whole of it.
  ServerShardState whole;
  (*s)->InitState(0, 0, 44, &whole);
  bad = (*s)->Step(0, false, acc.data(), 0, 32, &whole, reply.data());
  EXPECT_THAT(std::string(bad.message()), HasSubstr("steps whole shards"));
}

TEST(OnebitLamb, CombinationsThatMakeNoSenseAreRefusedNamingTheFlag) {
  OptimizerOptions o = LambOptionsForTest();
  EXPECT_TRUE(ValidateOptimizerOptions(o).ok());
  o.bias_correction = true;
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--bias_correction"));
  o = LambOptionsForTest();
  o.lamb.min_coeff = 2 * o.lamb.max_coeff;
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--min_coeff"));
  o = LambOptionsForTest();
  o.lamb.factor_min = 0;
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--factor_min"));
  o = LambOptionsForTest();
  o.lamb.coeff_beta = 1;
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--coeff_beta"));
  o = LambOptionsForTest();
  o.layer_ends = {40, 40, 100};
  EXPECT_THAT(std::string(ValidateOptimizerOptions(o).message()), HasSubstr("--layer_ends"));
}

}  // namespace
}  // namespace onebit
