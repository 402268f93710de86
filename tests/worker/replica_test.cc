// The worker's replicas (worker/replica.h) without a network: the CPU replica
// and the device replica on the CPU twin backend (the GPU worker's code) are
// driven with the same gradients and the same server replies, made here by
// the server's own optimizer. Their pushes and their x must agree bit for bit
// through the warm-up, the hand-over and the compression phase; a bad reply
// or a non-finite gradient must be refused by both with the same error,
// naming the element, and change nothing either of them goes on with.
#include "worker/replica.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "optim/optimizer.h"
#include "worker/device.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kD = 200;  // 6.25 blocks of 32: a short last block

// Gradients set by the test; the loss is unused.
class FixedModel final : public Model {
 public:
  uint64_t num_params() const override { return kD; }
  void Init(float* x) const override {
    for (uint64_t i = 0; i < kD; ++i) x[i] = 0.01f * static_cast<float>(i % 13) - 0.05f;
  }
  absl::StatusOr<double> Gradient(const float*, uint32_t, uint64_t step, float* g) const override {
    for (uint64_t i = 0; i < kD; ++i) {
      g[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(step)) * 1e-2f;
    }
    if (nan_at < kD) g[nan_at] = std::numeric_limits<float>::quiet_NaN();
    return 1.0;
  }
  uint64_t nan_at = kD;  // an index < kD: that gradient element is NaN
};

// zero-one-adam's schedule here (as tests/cluster/onebit_test.cc's): k = 1,
// 2, 4 refresh v, k = 3 compresses gradients; after the freeze at k = 4,
// k = 5, 6, 8, 12 and 13 (the last) synchronise, 7, 9, 10 and 11 are local.
constexpr uint64_t kSteps = 13;

OptimizerOptions Options(const std::string& kind, const std::string& warmup_codec = "fp32",
                         std::optional<ReplyMode> reply = std::nullopt) {
  OptimizerOptions o;
  o.kind = *ParseOptimizerKind(kind);
  o.lr = 0.01f;
  o.weight_decay = 0.01f;
  o.codec.block_size = 32;
  o.worker_codec = o.server_codec =
      std::string(DefaultCodec(o.kind));  // onebit where it compresses
  o.warmup_codec = warmup_codec;
  o.reply = reply.value_or(DefaultReplyMode(o.kind));
  o.zero_one.var_freeze_step = 4;
  o.zero_one.var_update_scaler = 1;
  o.zero_one.local_step_scaler = 2;
  o.zero_one.local_step_clipper = 4;
  o.zero_one.steps = kSteps;
  o.diloco.sync_every = 3;  // k = 3, 6, 9, 12 and 13 (the last) synchronise
  o.diloco.steps = kSteps;
  o.bias_correction = o.kind == OptimizerKind::kDiloco;
  if (IsLayerwise(o.kind)) o.layer_ends = {64, 96, kD};  // onebit-lamb's layers
  return o;
}

struct Fixture {
  FixedModel model;
  std::unique_ptr<WorkerOptimizer> worker;
  std::unique_ptr<ServerOptimizer> server;
  ServerShardState shard;
  std::unique_ptr<Replica> cpu, twin;
  // A third replica when set (a device replica restored from a checkpoint),
  // driven and compared alike.
  std::unique_ptr<Replica> restored;

  explicit Fixture(const std::string& kind = "onebit-adam") : Fixture(Options(kind)) {}
  explicit Fixture(const OptimizerOptions& o) {
    worker = *WorkerOptimizer::Create(o);
    server = *ServerOptimizer::Create(o);
    server->InitState(0, 0, kD, &shard);
    model.Init(shard.x.data());
    cpu = NewCpuReplica(kD, &model, worker.get());
    twin = NewTwin();
    EXPECT_TRUE(cpu->Init().ok());
    EXPECT_TRUE(twin->Init().ok());
    // The job's start: the master is every replica's, its x_sync's too.
    for (Replica* r : {cpu.get(), twin.get()}) {
      EXPECT_TRUE(r->WriteX(0, kD, shard.x.data(), true).ok());
    }
  }

  std::unique_ptr<Replica> NewTwin() {
    DeviceChoice twin_choice;
    twin_choice.kind = DeviceChoice::Kind::kCudaTwin;
    return *NewReplica(twin_choice, kD, &model, worker.get());
  }

  std::vector<Replica*> All() {
    std::vector<Replica*> all = {cpu.get(), twin.get()};
    if (restored != nullptr) all.push_back(restored.get());
    return all;
  }

  float Lr(uint64_t t) const { return LearningRate(worker->options(), t); }

  // Whether step t ends the warm-up: step 2 where there is one to end,
  // zero-one-adam's var_freeze_step - 1.
  bool LastWarmup(uint64_t t) const {
    const AlgorithmTraits& tr = worker->traits();
    if (!tr.warmup || !tr.compression) return false;
    return t == (tr.schedule_freeze ? worker->options().zero_one.var_freeze_step - 1 : 2);
  }

  std::vector<float> X(Replica* r) {
    std::vector<float> x(kD);
    EXPECT_TRUE(r->ReadX(x.data()).ok());
    return x;
  }

  // Every replica pushes step t (their payloads must be equal); returns the
  // server's reply to that push.
  std::vector<uint8_t> PushAndServe(uint64_t t, bool last_warmup) {
    const Phase phase = cpu->phase();
    const StepKind kind = worker->KindOf(t, phase);
    const size_t bytes = worker->push_codec(kind).EncodedSize(kD);
    std::vector<uint8_t> a(bytes);
    for (Replica* r : All()) {
      EXPECT_EQ(r->phase(), phase) << r->device();
      EXPECT_TRUE(r->ComputeGradient(0, t).ok());
      std::vector<uint8_t> b(bytes);
      const absl::Status st = r->Push(t, 0, kD, b.data());
      EXPECT_TRUE(st.ok()) << r->device() << ": " << st;
      if (r == cpu.get()) a = b;
      EXPECT_EQ(a, b) << "push of step " << t << " by " << r->device();
    }
    std::vector<float> acc(kD);
    EXPECT_TRUE(server->push_codec(kind).Decode(a.data(), kD, acc.data()).ok());
    std::vector<uint8_t> reply(server->ReplyBytes(kind, 0, kD, last_warmup));
    absl::Status st = server->Step(t, last_warmup, acc.data(), 0, kD, &shard, reply.data());
    EXPECT_TRUE(st.ok()) << st;
    return reply;
  }

  // Every replica applies `reply` and finishes the step.
  void ApplyBoth(uint64_t t, bool last_warmup, const std::vector<uint8_t>& reply) {
    for (Replica* r : All()) {
      absl::Status st = r->Apply(t, Lr(t), last_warmup, reply.data(), 0, kD);
      ASSERT_TRUE(st.ok()) << r->device() << ": " << st;
      ASSERT_TRUE(r->FinishStep(last_warmup).ok());
    }
    if (last_warmup) server->EnterCompression(&shard);
  }

  // Step t on every replica: pushes and the reply, or a local step.
  void Step(uint64_t t, bool last_warmup) {
    for (Replica* r : All()) ASSERT_TRUE(r->BeginStep(t, Lr(t)).ok());
    if (worker->KindOf(t, cpu->phase()) == StepKind::kLocal) {
      for (Replica* r : All()) {
        ASSERT_TRUE(r->ComputeGradient(0, t).ok());
        const absl::Status st = r->LocalStep(t, 0, kD);
        ASSERT_TRUE(st.ok()) << r->device() << ": " << st;
        ASSERT_TRUE(r->FinishStep(false).ok());
      }
      return;
    }
    ApplyBoth(t, last_warmup, PushAndServe(t, last_warmup));
  }
};

// Both refuse `reply` with the same error containing `what`, and keep x.
void ExpectBothRefuse(Fixture* f, uint64_t t, bool last_warmup, const std::vector<uint8_t>& reply,
                      const std::string& what) {
  const std::vector<float> x_cpu = f->X(f->cpu.get()), x_twin = f->X(f->twin.get());
  const absl::Status a = f->cpu->Apply(t, f->Lr(t), last_warmup, reply.data(), 0, kD);
  const absl::Status b = f->twin->Apply(t, f->Lr(t), last_warmup, reply.data(), 0, kD);
  EXPECT_THAT(std::string(a.message()), HasSubstr(what)) << a;
  EXPECT_EQ(a, b);
  EXPECT_TRUE(f->twin->FinishStep(false).ok());
  EXPECT_EQ(f->X(f->cpu.get()), x_cpu) << "the CPU replica changed x on a refused reply";
  EXPECT_EQ(f->X(f->twin.get()), x_twin) << "the device replica changed x on a refused reply";
}

void SetFloat(std::vector<uint8_t>* bytes, size_t offset, float v) {
  std::memcpy(bytes->data() + offset, &v, 4);
}

TEST(Replica, DeviceCodeOnTheTwinEqualsTheCpuReplicaStepByStep) {
  for (const char* kind : {"onebit-adam", "naive-onebit-adam", "ef-sgd"}) {
    SCOPED_TRACE(kind);
    Fixture f(kind);
    EXPECT_EQ(f.cpu->device(), "cpu");
    EXPECT_EQ(f.twin->device(), "cuda-twin");
    const bool warmup = HasWarmup(*ParseOptimizerKind(kind));
    for (uint64_t t = 0; t < 6; ++t) {
      f.Step(t, warmup && t == 1);  // steps 0, 1 warm up; 2.. compress
      ASSERT_EQ(f.X(f.cpu.get()), f.X(f.twin.get())) << "x after step " << t;
    }
    EXPECT_EQ(f.cpu->phase(), Phase::kCompress);
    EXPECT_NE(f.X(f.cpu.get()), [&] {
      std::vector<float> x0(kD);
      f.model.Init(x0.data());
      return x0;
    }()) << "nothing was trained";
  }
}

void ExpectSameState(const WorkerState& a, const WorkerState& b) {
  EXPECT_EQ(a.x, b.x);
  EXPECT_EQ(a.mbar, b.mbar);
  EXPECT_EQ(a.e, b.e);
  EXPECT_EQ(a.den, b.den);
  EXPECT_EQ(a.v, b.v);
  EXPECT_EQ(a.x_sync, b.x_sync);
  EXPECT_EQ(a.frozen, b.frozen);
}

// The runs the device code must match: every optimizer with the warm-up
// codecs and reply modes it takes.
std::vector<OptimizerOptions> EveryOptimizer() {
  std::vector<OptimizerOptions> out;
  for (const AlgorithmRow* row : AlgorithmRows()) {
    for (const char* warmup : {"fp32", "fp16"}) {
      for (ReplyMode reply : {ReplyMode::kMomentum, ReplyMode::kDelta}) {
        if (!row->traits.compression && reply == ReplyMode::kDelta) continue;  // no replies to vary
        OptimizerOptions o = Options(std::string(row->traits.name), warmup, reply);
        if (ValidateOptimizerOptions(o).ok()) out.push_back(o);
      }
    }
  }
  return out;
}

std::string NameOf(const OptimizerOptions& o) {
  return absl::StrCat(OptimizerKindName(o.kind), " warmup ", o.warmup_codec,
                      o.reply == ReplyMode::kDelta ? " delta replies" : "");
}

// The GPU worker's code on the twin pushes what the CPU replica pushes and
// ends every step in the same state, for every optimizer and warm-up codec:
// through the warm-up, the hand-over and compression, zero-one-adam's
// variance steps, local steps and syncs, and diloco's inner AdamW steps and
// outer steps.
TEST(Replica, EveryOptimizerAndWarmupCodecOnTheTwinEqualsTheCpuReplica) {
  const std::vector<OptimizerOptions> runs = EveryOptimizer();
  // sgd, adam: 2 warm-up codecs; onebit-adam 2 x 2 replies; naive 2;
  // ef-sgd 2 replies; zero-one-adam 1; onebit-lamb 2 x 2; diloco 1.
  EXPECT_EQ(runs.size(), 2u + 2u + 4u + 2u + 2u + 1u + 4u + 1u);
  for (const OptimizerOptions& o : runs) {
    SCOPED_TRACE(NameOf(o));
    Fixture f(o);
    std::vector<float> x0(kD);
    f.model.Init(x0.data());
    for (uint64_t t = 0; t < kSteps; ++t) {
      f.Step(t, f.LastWarmup(t));
      ASSERT_EQ(f.X(f.cpu.get()), f.X(f.twin.get())) << "x after step " << t;
      ExpectSameState(*f.cpu->SaveState({}), *f.twin->SaveState({}));
    }
    EXPECT_EQ(f.cpu->phase(), HasCompressionPhase(o.kind) ? Phase::kCompress : Phase::kWarmup);
    EXPECT_NE(f.X(f.cpu.get()), x0) << "nothing was trained";
  }
}

// A device replica restored mid-run from its own saved state (zero-one-adam
// between syncs: its local model, x_sync and the sum of learning rates)
// goes on exactly as the replicas that never stopped.
TEST(Replica, DeviceStateRestoresMidRunForEveryOptimizer) {
  for (const OptimizerOptions& o : EveryOptimizer()) {
    SCOPED_TRACE(NameOf(o));
    Fixture f(o);
    constexpr uint64_t kAt = 7;  // after k = 7, a local step of zero-one-adam
    for (uint64_t t = 0; t < kAt; ++t) f.Step(t, f.LastWarmup(t));
    absl::StatusOr<WorkerState> saved = f.twin->SaveState({});
    ASSERT_TRUE(saved.ok()) << saved.status();
    if (o.kind == OptimizerKind::kZeroOneAdam) {
      EXPECT_EQ(saved->x_sync.size(), kD);
      EXPECT_TRUE(saved->v.empty());
      EXPECT_EQ(saved->lrs, f.Lr(kAt - 1));
      EXPECT_NE(saved->x_sync, saved->x) << "no local step since the sync";
    }
    f.restored = f.NewTwin();
    ASSERT_TRUE(f.restored->Init().ok());
    const absl::Status st = f.restored->RestoreState(*saved);
    ASSERT_TRUE(st.ok()) << st;
    for (uint64_t t = kAt; t < kSteps; ++t) {
      f.Step(t, f.LastWarmup(t));
      ASSERT_EQ(f.X(f.cpu.get()), f.X(f.restored.get())) << "x after step " << t;
    }
  }
}

// What a checkpoint holds: the state after some steps, equal on both
// devices, and a run restored from it goes on exactly as the original.
TEST(Replica, SavedStateIsTheSameOnEveryDeviceAndRestoresMidRun) {
  for (const char* kind : {"onebit-adam", "naive-onebit-adam", "ef-sgd"}) {
    SCOPED_TRACE(kind);
    Fixture f(kind);
    const bool warmup = HasWarmup(*ParseOptimizerKind(kind));
    // Some steps into the compression phase.
    for (uint64_t t = 0; t < 5; ++t) f.Step(t, warmup && t == 1);
    auto a = f.cpu->SaveState({});
    auto b = f.twin->SaveState({});
    ASSERT_TRUE(a.ok() && b.ok());
    ExpectSameState(*a, *b);
    EXPECT_TRUE(a->frozen);
    EXPECT_EQ(a->e.size(), kD);
    EXPECT_EQ(a->den.size(), std::string(kind) == "onebit-adam" ? kD : 0u);
    EXPECT_NE(a->e, std::vector<float>(kD, 0.0f)) << "no error feedback to save";

    // Fresh replicas (a restarted worker) given the other device's state.
    Fixture g(kind);
    g.shard = f.shard;
    ASSERT_TRUE(g.cpu->RestoreState(*b).ok());
    ASSERT_TRUE(g.twin->RestoreState(*a).ok());
    EXPECT_EQ(g.cpu->phase(), Phase::kCompress);
    for (uint64_t t = 5; t < 8; ++t) {
      f.Step(t, false);
      g.Step(t, false);
      ASSERT_EQ(f.X(f.cpu.get()), g.X(g.cpu.get())) << "x after step " << t;
      ASSERT_EQ(f.X(f.cpu.get()), g.X(g.twin.get())) << "x after step " << t;
    }
    ExpectSameState(*f.twin->SaveState({}), *g.twin->SaveState({}));

    // A state of another size is refused and changes nothing.
    WorkerState bad = *a;
    bad.e.pop_back();
    const std::vector<float> before = g.X(g.twin.get());
    for (Replica* r : {g.cpu.get(), g.twin.get()}) {
      absl::Status st = r->RestoreState(bad);
      EXPECT_THAT(std::string(st.message()),
                  HasSubstr(absl::StrCat("has ", kD - 1, " floats of 'e' where ", kD, " fit")));
      EXPECT_THAT(std::string(st.message()), HasSubstr(absl::StrCat("with d = ", kD)));
      EXPECT_EQ(g.X(r), before);
    }
  }
}

TEST(Replica, BadHandOverIsRefusedByBothAndChangesNothing) {
  Fixture f;
  f.Step(0, false);
  std::vector<uint8_t> reply = f.PushAndServe(1, true);
  std::vector<uint8_t> bad = reply;
  SetFloat(&bad, 4 * kD * 2 + 4 * 5, -1.0f);  // v of parameter 5
  ExpectBothRefuse(&f, 1, true, bad, "negative second moment -1 at parameter 5");
  bad = reply;
  SetFloat(&bad, 4 * kD + 4 * 7, std::numeric_limits<float>::infinity());  // m of parameter 7
  ExpectBothRefuse(&f, 1, true, bad, "non-finite value inf at index 7");
  bad = reply;
  SetFloat(&bad, 4 * 9, std::numeric_limits<float>::quiet_NaN());  // Δ of parameter 9
  ExpectBothRefuse(&f, 1, true, bad, "at index 9");
  // The good reply still applies, and the replicas go on equal.
  f.ApplyBoth(1, true, reply);
  for (uint64_t t = 2; t < 5; ++t) f.Step(t, false);
  EXPECT_EQ(f.X(f.cpu.get()), f.X(f.twin.get()));
}

TEST(Replica, BadCompressedReplyIsRefusedByBoth) {
  Fixture f;
  f.Step(0, true);
  std::vector<uint8_t> reply = f.PushAndServe(1, false);
  std::vector<uint8_t> bad = reply;
  SetFloat(&bad, 4 * 3, std::numeric_limits<float>::quiet_NaN());  // scale of block 3
  ExpectBothRefuse(&f, 1, false, bad, "bad scale nan for block 3");
  bad = reply;
  SetFloat(&bad, 0, -0.5f);
  ExpectBothRefuse(&f, 1, false, bad, "bad scale -0.5 for block 0");
  f.ApplyBoth(1, false, reply);
  EXPECT_EQ(f.X(f.cpu.get()), f.X(f.twin.get()));
}

TEST(Replica, NonFiniteGradientIsRefusedAndTheErrorBufferKept) {
  // naive-onebit-adam encodes the gradient itself (no momentum in between),
  // so after a refused push the next one shows whether e was kept.
  Fixture f("naive-onebit-adam");
  f.Step(0, true);
  f.Step(1, false);
  f.model.nan_at = 11;
  std::vector<uint8_t> out(f.worker->push_codec(Phase::kCompress).EncodedSize(kD));
  for (Replica* r : {f.cpu.get(), f.twin.get()}) {
    ASSERT_TRUE(r->ComputeGradient(0, 2).ok());
    const absl::Status st = r->Push(2, 0, kD, out.data());
    EXPECT_THAT(std::string(st.message()), HasSubstr("non-finite input at index 11")) << st;
  }
  f.model.nan_at = kD;
  for (uint64_t t = 2; t < 5; ++t) f.Step(t, false);  // pushes compared inside
  EXPECT_EQ(f.X(f.cpu.get()), f.X(f.twin.get()));
}

TEST(Replica, NonFiniteGradientInTheWarmupNamesTheIndex) {
  Fixture f;
  f.model.nan_at = 3;
  std::vector<uint8_t> out(4 * kD);
  for (Replica* r : {f.cpu.get(), f.twin.get()}) {
    ASSERT_TRUE(r->ComputeGradient(0, 0).ok());
    const absl::Status st = r->Push(0, 0, kD, out.data());
    EXPECT_THAT(std::string(st.message()), HasSubstr("non-finite input at index 3")) << st;
  }
}

TEST(Replica, ChunksOutsideTheParametersAreRefused) {
  Fixture f;
  std::vector<uint8_t> out(4 * kD);
  ASSERT_TRUE(f.twin->ComputeGradient(0, 0).ok());
  const absl::Status st = f.twin->Push(0, kD - 10, 20, out.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("[190, 210) outside the 200 parameters"));
}

// A CPU replica holds a momentum reply as its payload (optim/held_momentum.h)
// rather than writing m̄: over chunks of several pieces, through a
// checkpoint's SaveState and a change of chunk grid, its pushes, x and m̄
// are the dense rule's bit for bit.
TEST(Replica, TheCpuReplicaHoldsMomentumRepliesAndEqualsTheDenseRule) {
  static constexpr uint64_t kBig = 10000;  // three onebit pieces of 4096 and a short one
  class SineModel final : public Model {
   public:
    uint64_t num_params() const override { return kBig; }
    void Init(float* x) const override {
      for (uint64_t i = 0; i < kBig; ++i) x[i] = 0.001f * static_cast<float>(i % 17);
    }
    absl::StatusOr<double> Gradient(const float*, uint32_t, uint64_t step,
                                    float* g) const override {
      for (uint64_t i = 0; i < kBig; ++i) {
        g[i] = std::sin(0.11f * static_cast<float>(i) * static_cast<float>(step + 1)) * 1e-2f;
      }
      return 1.0;
    }
  } model;
  OptimizerOptions o = Options("onebit-adam");
  ASSERT_EQ(o.reply, ReplyMode::kMomentum);
  auto worker = *WorkerOptimizer::Create(o);
  auto server = *ServerOptimizer::Create(o);
  ServerShardState shard;
  server->InitState(0, 0, kBig, &shard);
  model.Init(shard.x.data());
  std::unique_ptr<Replica> cpu = NewCpuReplica(kBig, &model, worker.get());
  ASSERT_TRUE(cpu->Init().ok());
  ASSERT_TRUE(cpu->WriteX(0, kBig, shard.x.data(), true).ok());
  WorkerState dense;  // the rule on a WorkerState: m̄ always written
  worker->InitState(kBig, &dense);
  model.Init(dense.x.data());
  std::vector<float> g(kBig);

  // Chunks not aligned to pieces: [0, 6016) and [6016, 10000); from step 9
  // one chunk of the whole (the held ranges no longer fit).
  auto chunks = [](uint64_t t) {
    return t < 9 ? std::vector<std::pair<uint64_t, size_t>>{{0, 6016}, {6016, kBig - 6016}}
                 : std::vector<std::pair<uint64_t, size_t>>{{0, kBig}};
  };
  for (uint64_t t = 0; t < 12; ++t) {
    SCOPED_TRACE(absl::StrCat("step ", t));
    const bool last_warmup = t == 2;
    const float lr = LearningRate(o, t);
    ASSERT_TRUE(cpu->BeginStep(t, lr).ok());
    worker->BeginStep(t, lr, &dense);
    ASSERT_TRUE(cpu->ComputeGradient(0, t).ok());
    ASSERT_TRUE(model.Gradient(dense.x.data(), 0, t, g.data()).ok());
    const StepKind kind = worker->KindOf(t, PhaseOf(dense));
    for (auto [b, n] : chunks(t)) {
      std::vector<uint8_t> a(worker->push_codec(kind).EncodedSize(n)), want(a.size());
      ASSERT_TRUE(cpu->Push(t, b, n, a.data()).ok());
      ASSERT_TRUE(worker->Push(t, lr, g.data(), b, n, &dense, want.data()).ok());
      ASSERT_EQ(a, want) << "push of [" << b << ", " << b + n << ")";
      std::vector<float> acc(n);
      ASSERT_TRUE(server->push_codec(kind).Decode(a.data(), n, acc.data()).ok());
      std::vector<uint8_t> reply(server->ReplyBytes(kind, b, n, last_warmup));
      ASSERT_TRUE(server->Step(t, lr, last_warmup, acc.data(), b, n, &shard, reply.data()).ok());
      ASSERT_TRUE(cpu->Apply(t, lr, last_warmup, reply.data(), b, n).ok());
      ASSERT_TRUE(worker->Apply(t, lr, last_warmup, reply.data(), b, n, &dense).ok());
    }
    ASSERT_TRUE(cpu->FinishStep(last_warmup).ok());
    worker->EndStep(t, &dense);
    if (last_warmup) {
      worker->EnterCompression(&dense);
      server->EnterCompression(&shard);
    }
    std::vector<float> x(kBig);
    ASSERT_TRUE(cpu->ReadX(x.data()).ok());
    ASSERT_EQ(x, dense.x);
    if (t == 6 || t == 11) {  // a checkpoint: m̄ whole, the dense rule's
      auto saved = cpu->SaveState({});
      ASSERT_TRUE(saved.ok());
      EXPECT_EQ(saved->mbar, dense.mbar);
      EXPECT_EQ(saved->e, dense.e);
    }
  }
  EXPECT_TRUE(dense.frozen);
}

}  // namespace
}  // namespace onebit
