// The optimizer registry: every row where its kind says, and traits that
// agree with what the algorithm's states actually hold.
#include "optim/registry.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "optim/optimizer.h"
#include "optim/reference.h"

namespace onebit {
namespace {

TEST(Registry, EveryRowSitsAtItsKindAndItsNameParsesBack) {
  const auto& rows = AlgorithmRows();
  ASSERT_EQ(rows.size(), 8u);
  for (size_t i = 0; i < rows.size(); ++i) {
    const AlgorithmTraits& t = rows[i]->traits;
    EXPECT_EQ(static_cast<size_t>(t.kind), i) << t.name;
    EXPECT_EQ(&RowOf(t.kind), rows[i]) << t.name;
    auto parsed = ParseOptimizerKind(t.name);
    ASSERT_TRUE(parsed.ok()) << t.name;
    EXPECT_EQ(*parsed, t.kind);
    EXPECT_EQ(OptimizerKindName(t.kind), t.name);
    EXPECT_NE(rows[i]->make, nullptr) << t.name;
    // Every algorithm has a warm-up, a compression phase or both.
    EXPECT_TRUE(t.warmup || t.compression) << t.name;
  }
  // An unknown name is refused listing every known one.
  auto bad = ParseOptimizerKind("adamw");
  ASSERT_FALSE(bad.ok());
  for (const AlgorithmRow* row : rows) {
    EXPECT_NE(bad.status().message().find(std::string(row->traits.name)), std::string::npos)
        << bad.status();
  }
}

// How many of `all` hold n elements.
size_t Sized(const std::vector<const std::vector<float>*>& all, size_t n) {
  size_t k = 0;
  for (const auto* a : all) k += a->size() == n;
  return k;
}

// Runs a one-worker, one-shard job of `steps` steps through the reference
// (freeze after step 2) and returns its final states.
ReferenceResult RunTiny(OptimizerKind kind, uint64_t steps) {
  constexpr uint64_t d = 64;
  ReferenceOptions ro;
  ro.workers = 1;
  ro.map = *ShardMap::Create(d, 1, 32);
  ro.steps = steps;
  OptimizerOptions& o = ro.optimizer;
  o.kind = kind;
  o.lr = 0.01f;
  o.codec.block_size = 32;
  o.worker_codec = o.server_codec = std::string(DefaultCodec(kind));
  o.reply = DefaultReplyMode(kind);
  o.zero_one.var_freeze_step = 3;
  o.zero_one.steps = steps;
  o.diloco.steps = steps;
  o.layer_ends = {32, d};
  ro.freeze.step = 3;
  auto r = RunReference(ro, std::vector<float>(d, 0.5f),
                        [](const float*, uint32_t, uint64_t step, float* g) {
                          for (uint64_t j = 0; j < d; ++j) {
                            g[j] = (step % 2 == 0 ? 1.0f : -0.5f) * 0.01f * (j + 1);
                          }
                          return 0.0;
                        });
  EXPECT_TRUE(r.ok()) << OptimizerKindName(kind) << ": " << r.status();
  return r.ok() ? *std::move(r) : ReferenceResult{};
}

// The memory check before a job (WorkerStateSize, ServerShardSize) names
// as many arrays as the states hold at their largest, in the warm-up or
// after the freeze: a trait that forgot one would let a job past the check
// that then runs out of memory.
TEST(Registry, TheMemoryCheckCountsEveryArrayTheStatesHold) {
  constexpr uint64_t d = 64;
  for (const AlgorithmRow* row : AlgorithmRows()) {
    const AlgorithmTraits& t = row->traits;
    size_t worker = 0, server = 0;
    OptimizerOptions o;
    for (uint64_t steps : {2, 6}) {
      ReferenceResult r = RunTiny(t.kind, steps);
      ASSERT_EQ(r.workers.size(), 1u) << t.name;
      ASSERT_EQ(r.servers.size(), 1u) << t.name;
      const WorkerState& w = r.workers[0];
      const ServerShardState& s = r.servers[0];
      // +1: the worker's gradient g; the server's chunk accumulators.
      worker = std::max(worker, 1 + Sized({&w.x, &w.mbar, &w.e, &w.den, &w.v, &w.x_sync}, d));
      server = std::max(server, 1 + Sized({&s.x, &s.m, &s.v, &s.den, &s.e, &s.replica}, d));
    }
    o.kind = t.kind;
    o.reply = DefaultReplyMode(t.kind);
    const StateSize ws = WorkerStateSize(o, d), ss = ServerShardSize(o, d);
    EXPECT_EQ(ws.bytes, worker * d * 4) << t.name << ": " << ws.arrays;
    EXPECT_EQ(ss.bytes, server * d * 4) << t.name << ": " << ss.arrays;
    EXPECT_EQ(std::vector<std::string>(absl::StrSplit(ws.arrays, ", ")).size(), worker) << t.name;
  }
}

}  // namespace
}  // namespace onebit
