// Checkpoints of real clusters through onebit-launch: what every server and
// worker wrote at a checkpoint step is, bit for bit, the state of the same
// job stopped there (the single-process reference), and the coordinator's
// manifest makes it complete.
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/state_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shard/shard_map.h"
#include "tests/cluster/test_util.h"

namespace onebit::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(Checkpoints, EveryProcessWritesTheStateOfThatStep) {
  // The freeze at step 4 and checkpoints after 3, 6, 9 and 12 steps: one in
  // the warm-up, three in the compression phase; the last two kept.
  control::TrainingConfig cfg = MakeConfig(3, 2, 9973, 12, "onebit-adam");
  cfg.mutable_optimizer()->set_freeze_step(4);
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
  EXPECT_EQ(nine->config().cluster().workers(), 3u);
  EXPECT_EQ(nine->config().model().dim(), 9973u);

  // The reference stopped after 9 steps.
  control::TrainingConfig at9 = cfg;
  at9.mutable_model()->set_steps(9);
  ReferenceResult ref = Reference(at9);
  auto map =
      ShardMap::Create(cfg.model().dim(), cfg.cluster().servers(), cfg.compression().block_size());
  ASSERT_TRUE(map.ok());
  for (uint32_t k = 0; k < 2; ++k) {
    auto file = StateReader::Open(absl::StrCat(StepDir(root, 9), "/server-", k, ".state"));
    ASSERT_TRUE(file.ok()) << file.status();
    ServerShardState s;
    ASSERT_TRUE(LoadServerShard({&*file}, map->shard(k).begin, map->shard(k).end, &s).ok());
    // den is left out: made again from the frozen v, it is the reference's.
    EXPECT_TRUE(s.den.empty()) << "server " << k;
    ASSERT_TRUE(RestoreDenominators(cfg.optimizer().eps(), &s).ok());
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
    ASSERT_TRUE(LoadWorkerState(*file, cfg.model().dim(), &s).ok());
    EXPECT_EQ(s.mbar.empty(), w != 0) << "worker " << w;
    EXPECT_TRUE(s.den.empty()) << "worker " << w;
    ASSERT_TRUE(CompleteWorkerState(*worker0, {&server_files[0], &server_files[1]},
                                    cfg.model().dim(), cfg.optimizer().eps(), &s)
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

// A checkpoint volume too small for the job's checkpoints. Each of the 2
// servers' files (x, m and v of 300 000 parameters: 3.6 MB) may fit, not
// both; the workers' small ones do. 4 checkpoints (steps 5, 10, 15, 20)
// are due.
std::vector<std::string> FullVolumeJob(const std::string& out, const std::string& root,
                                       const std::string& failure) {
  return {Bin("onebit-launch"),
          "--out=" + out,
          "--workers=2",
          "--servers=2",
          "--dim=600000",
          "--steps=20",
          "--optimizer=adam",
          "--chunk_elems=65536",
          "--checkpoint_dir=" + root,
          "--checkpoint_every=5",
          "--checkpoint_failure=" + failure};
}

// Everything under `root`, as paths relative to it.
std::vector<std::string> Contents(const std::string& root) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root, ec)) {
    found.push_back(std::filesystem::relative(e.path(), root).string());
  }
  return found;
}

// The default (--checkpoint_failure=continue): the job ends ok, its summary
// says it was not durable and why, and nothing of the failed checkpoints is
// left; with --checkpoint_failure=fail the job fails naming the error.
void ExpectNotDurable(const std::string& dir, const std::string& root, const std::string& why,
                      const std::function<RunResult(const std::vector<std::string>&)>& run) {
  const std::string out = dir + "/run";
  RunResult r = run(FullVolumeJob(out, root, "continue"));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "status"), "\"ok\"");
  EXPECT_EQ(Field(summary, "durable"), "false") << summary;
  EXPECT_EQ(Field(summary, "checkpoint_errors"), "4") << summary;
  EXPECT_EQ(Field(summary, "checkpoints"), "0");
  EXPECT_EQ(Field(summary, "last_checkpoint_step"), "null");
  EXPECT_THAT(Field(summary, "last_checkpoint_error"), HasSubstr("cannot write " + root));
  EXPECT_THAT(Field(summary, "last_checkpoint_error"), HasSubstr(why));
  EXPECT_THAT(r.output, HasSubstr("job finished; not durable: 4 checkpoint(s) could not be "
                                  "written (last: step "));
  EXPECT_THAT(r.output, HasSubstr("none is complete"));
  EXPECT_THAT(r.output, HasSubstr("launch: job finished, but not durable: checkpoints failed"));
  // No partial file, no step folder.
  EXPECT_EQ(Contents(root), std::vector<std::string>{}) << r.output;

  const std::string failed = dir + "/failed";
  r = run(FullVolumeJob(failed, root, "fail"));
  EXPECT_NE(r.code, 0) << r.output;
  const std::string status = Field(ReadFile(failed + "/summary.json"), "status");
  EXPECT_THAT(status, HasSubstr("failed: the checkpoint of step 5 could not be written: "));
  EXPECT_THAT(status, HasSubstr(why));
  EXPECT_THAT(status, HasSubstr("(--checkpoint_failure=fail)"));
  EXPECT_THAT(r.output, Not(HasSubstr("not durable")));
}

// A full volume: a 4 MB tmpfs (mounting needs root, or CAP_SYS_ADMIN).
TEST(Checkpoints, AFullVolumeLeavesNothingAndTheSummarySaysNotDurable) {
  const std::string dir = TempDir("full_volume");
  const std::string root = dir + "/ckpt";
  std::filesystem::create_directories(root);
  if (mount("tmpfs", root.c_str(), "tmpfs", 0, "size=4m") != 0) {
    GTEST_SKIP() << "cannot mount a 4 MB tmpfs on " << root << ": " << std::strerror(errno)
                 << " (the file-size-limit test covers the same)";
  }
  struct Unmount {
    std::string path;
    ~Unmount() { umount2(path.c_str(), MNT_DETACH); }
  } unmount{root};
  ExpectNotDurable(dir, root, "No space left on device", [](const std::vector<std::string>& argv) {
    return RunCommand(argv, absl::Seconds(120));
  });
}

// The same where the files cannot grow past 1 MB (RLIMIT_FSIZE on the
// launched processes, SIGXFSZ ignored, so that writes fail with EFBIG):
// what a machine that cannot mount tests.
TEST(Checkpoints, AFileSizeLimitLeavesNothingAndTheSummarySaysNotDurable) {
  const std::string dir = TempDir("file_size_limit");
  const std::string root = dir + "/ckpt";
  ExpectNotDurable(dir, root, "File too large", [](const std::vector<std::string>& argv) {
    // Inherited by the launcher and everything it starts; ours again at once.
    rlimit before{};
    getrlimit(RLIMIT_FSIZE, &before);
    rlimit limited = before;
    limited.rlim_cur = 1 << 20;
    struct sigaction ignore = {};
    struct sigaction old = {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGXFSZ, &ignore, &old);
    setrlimit(RLIMIT_FSIZE, &limited);
    RunResult r = RunCommand(argv, absl::Seconds(120));
    setrlimit(RLIMIT_FSIZE, &before);
    sigaction(SIGXFSZ, &old, nullptr);
    return r;
  });
}

}  // namespace
}  // namespace onebit::testing
