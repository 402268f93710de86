// Checkpoints of real clusters through onebit-launch: what every server and
// worker wrote at a checkpoint step is, bit for bit, the state of the same
// job stopped there (the single-process reference), and the coordinator's
// manifest makes it complete.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/state_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shard/shard_map.h"
#include "tests/runtime/test_util.h"

namespace onebit::testing {
namespace {

using ::testing::HasSubstr;

TEST(Checkpoints, EveryProcessWritesTheStateOfThatStep) {
  // The freeze at step 4 and checkpoints after 3, 6, 9 and 12 steps: one in
  // the warm-up, three in the compression phase; the last two kept.
  control::TrainingConfig cfg = MakeConfig(3, 2, 9973, 12, "onebit-adam");
  cfg.set_freeze_step(4);
  const std::string dir = TempDir("checkpoints");
  const std::string root = dir + "/ckpt";
  std::vector<std::string> argv = {Bin("onebit-launch"), "--out=" + dir + "/run",
                                   "--checkpoint_dir=" + root, "--checkpoint_every=3"};
  for (const std::string& a : ConfigArgs(cfg)) argv.push_back(a);
  RunResult r = RunCommand(argv, absl::Seconds(60));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string summary = ReadFile(dir + "/run/summary.json");
  EXPECT_THAT(summary, HasSubstr("\"checkpoints\": 4,"));
  EXPECT_THAT(summary, HasSubstr("\"last_checkpoint_step\": 12,"));
  EXPECT_FALSE(VerifyCheckpoint(StepDir(root, 6)).ok());  // pruned: keep 2
  auto nine = VerifyCheckpoint(StepDir(root, 9));
  ASSERT_TRUE(nine.ok()) << nine.status();
  EXPECT_EQ(nine->step(), 9u);
  EXPECT_EQ(nine->files_size(), 5);
  EXPECT_EQ(nine->config().workers(), 3u);
  EXPECT_EQ(nine->config().dim(), 9973u);

  // The reference stopped after 9 steps.
  control::TrainingConfig at9 = cfg;
  at9.set_steps(9);
  ReferenceResult ref = Reference(at9);
  auto map = ShardMap::Create(cfg.dim(), cfg.servers(), cfg.block_size());
  ASSERT_TRUE(map.ok());
  for (uint32_t k = 0; k < 2; ++k) {
    auto file = StateReader::Open(absl::StrCat(StepDir(root, 9), "/server-", k, ".state"));
    ASSERT_TRUE(file.ok()) << file.status();
    ServerShardState s;
    ASSERT_TRUE(LoadServerShard({&*file}, map->shard(k).begin, map->shard(k).end, &s).ok());
    // den is left out: made again from the frozen v, it is the reference's.
    EXPECT_TRUE(s.den.empty()) << "server " << k;
    ASSERT_TRUE(RestoreDenominators(cfg.eps(), &s).ok());
    const ServerShardState& want = ref.masters[k];
    EXPECT_EQ(s.step, 9u);
    EXPECT_TRUE(s.frozen);
    EXPECT_EQ(FirstDifference(s.x, want.x), "") << "server " << k;
    EXPECT_EQ(FirstDifference(s.e, want.e), "") << "server " << k;
    EXPECT_EQ(FirstDifference(s.den, want.den), "") << "server " << k;
    EXPECT_EQ(FirstDifference(s.v, want.v), "") << "server " << k;
  }
  // A worker's file holds its error; its momentum only worker 0's (a
  // momentum reply makes it every worker's) and the frozen denominators
  // none (the servers' are the same): restored from those, the state is the
  // reference's, bit for bit.
  std::vector<StateReader> server_files;
  for (uint32_t k = 0; k < 2; ++k) {
    server_files.push_back(
        StateReader::Open(absl::StrCat(StepDir(root, 9), "/server-", k, ".state")).value());
  }
  auto worker0 = StateReader::Open(StepDir(root, 9) + "/worker-0.state");
  ASSERT_TRUE(worker0.ok()) << worker0.status();
  for (uint32_t w = 0; w < 3; ++w) {
    auto file = StateReader::Open(absl::StrCat(StepDir(root, 9), "/worker-", w, ".state"));
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(file->header().step(), 9u);
    WorkerState s;
    s.x = ref.worker_states[w].x;
    ASSERT_TRUE(LoadWorkerState(*file, cfg.dim(), &s).ok());
    EXPECT_EQ(s.mbar.empty(), w != 0) << "worker " << w;
    EXPECT_TRUE(s.den.empty()) << "worker " << w;
    ASSERT_TRUE(CompleteWorkerState(*worker0, {&server_files[0], &server_files[1]}, cfg.dim(),
                                    cfg.eps(), &s)
                    .ok());
    const WorkerState& want = ref.worker_states[w];
    EXPECT_TRUE(s.frozen);
    EXPECT_EQ(FirstDifference(s.e, want.e), "") << "worker " << w;
    EXPECT_EQ(FirstDifference(s.mbar, want.mbar), "") << "worker " << w;
    EXPECT_EQ(FirstDifference(s.den, want.den), "") << "worker " << w;
  }
  // Error feedback was saved, not zeros: the workers' errors differ.
  auto w0 = StateReader::Open(StepDir(root, 9) + "/worker-0.state");
  auto w1 = StateReader::Open(StepDir(root, 9) + "/worker-1.state");
  EXPECT_NE(w0->Floats("e").value(), w1->Floats("e").value());
}

}  // namespace
}  // namespace onebit::testing
