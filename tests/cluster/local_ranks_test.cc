// --local_ranks K (docs/design.md §1.9), started for real by the launcher:
// N workers of K processes each; a worker's local ranks add their gradients
// in shared memory and its local rank 0 pushes once for them.
#include <signal.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster/test_util.h"

namespace onebit::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Runs `cfg` through onebit-launch into a fresh run folder, which it
// returns; *output (when set) gets the launcher's output.
std::string Launch(const control::TrainingConfig& cfg, const std::string& name,
                   const std::string& devices = "", std::string* output = nullptr) {
  const std::string out = TempDir(name);
  std::vector<std::string> argv = {Bin("onebit-launch"), "--out=" + out, "--dump_params"};
  if (!devices.empty()) argv.push_back("--worker_devices=" + devices);
  for (const std::string& a : ConfigArgs(cfg)) argv.push_back(a);
  RunResult r = RunCommand(argv, absl::Seconds(180));
  EXPECT_EQ(r.code, 0) << absl::StrJoin(argv, " ") << "\n" << r.output;
  if (output != nullptr) *output = r.output;
  return out;
}

double NumberField(const std::string& summary, const std::string& key) {
  double v = -1;
  EXPECT_TRUE(absl::SimpleAtod(Field(summary, key), &v)) << key << " in " << summary;
  return v;
}

control::TrainingConfig Config(const std::string& optimizer, uint32_t workers,
                               uint32_t local_ranks) {
  control::TrainingConfig cfg = MakeConfig(workers, 2, 6007, 12, optimizer);
  SetSetting(&cfg, "local_ranks", absl::StrCat(local_ranks));
  SetSetting(&cfg, "block_size", "64");
  SetSetting(&cfg, "chunk_elems", "1024");
  if (optimizer == "onebit-adam") SetSetting(&cfg, "freeze_step", "5");
  return cfg;
}

class LocalRanks : public ::testing::TestWithParam<std::string> {};

// Every replica of `out` (each worker's local rank 0's and its local
// ranks') and every master equal the reference's.
void ExpectReference(const control::TrainingConfig& cfg, const std::string& out,
                     const ReferenceResult& ref) {
  const uint32_t N = cfg.cluster().workers(), K = cfg.cluster().local_ranks();
  ASSERT_EQ(ref.workers.size(), N);
  for (uint32_t w = 0; w < N; ++w) {
    for (uint32_t k = 0; k < K; ++k) {
      const std::string file = k == 0 ? absl::StrCat(out, "/replica_w", w, ".f32")
                                      : absl::StrCat(out, "/replica_w", w, "_local", k, ".f32");
      EXPECT_EQ(FirstDifference(ReadFloats(file), ref.workers[w]), "") << file;
    }
  }
  for (uint32_t s = 0; s < cfg.cluster().servers(); ++s) {
    EXPECT_EQ(FirstDifference(ReadFloats(absl::StrCat(out, "/master_s", s, ".f32")),
                              ref.masters[s].x, ref.masters[s].begin),
              "")
        << "shard " << s;
  }
  EXPECT_EQ(Field(ReadFile(out + "/summary.json"), "replicas_equal"), "true");
}

// Every process of the job (each worker's local rank 0 and its local
// ranks) ends with the reference's replica of a job whose worker r's
// gradient is the mean of those of ranks r * K .. r * K + K - 1, and every
// shard with its master; that is not the flat job's result (N workers, or
// N * K, without local ranks).
TEST_P(LocalRanks, EveryProcessEqualsTheReferenceBitForBit) {
  constexpr uint32_t N = 2, K = 3;
  const control::TrainingConfig cfg = Config(GetParam(), N, K);
  const std::string out = Launch(cfg, "local_ranks_" + GetParam());
  const ReferenceResult ref = Reference(cfg);
  ExpectReference(cfg, out, ref);
  EXPECT_EQ(Field(ReadFile(out + "/summary.json"), "workers"), absl::StrCat(N));
  for (uint32_t flat : {N, N * K}) {
    EXPECT_NE(Reference(Config(GetParam(), flat, 1)).x, ref.x) << flat << " workers";
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, LocalRanks, ::testing::Values("onebit-adam", "adam"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

// Local ranks on a device (the GPU worker's code on its CPU twin) meet in
// host memory: a device leader's gradient goes there for the mean and
// back, a device follower's is copied there. Devices and the CPU mixed
// within each worker, and the same bits.
TEST(LocalRanksDevice, TwinWorkersEqualTheReferenceBitForBit) {
  const control::TrainingConfig cfg = Config("onebit-adam", 2, 3);
  // Worker 0: twin leader, CPU and twin followers; worker 1: CPU leader.
  const std::string out =
      Launch(cfg, "local_ranks_twin", "cuda-twin,cpu,cuda-twin,cpu,cuda-twin,cuda-twin");
  ExpectReference(cfg, out, Reference(cfg));
  EXPECT_EQ(Field(ReadFile(out + "/summary.json"), "worker_devices"), "[\"cuda-twin\", \"cpu\"]");
}

// Local ranks all on devices of one kind add their gradients on the
// leader's device, mapping the followers' (CUDA IPC on GPUs; the twin's
// shared pages here), with MeanInOrder's bits; a host with a rank on the
// CPU meets in host memory, and says why.
TEST(LocalRanksDevice, TwinRanksAddTheirGradientsOnTheDeviceBitForBit) {
  const control::TrainingConfig cfg = Config("onebit-adam", 2, 3);
  // Worker 0: all three on the twin; worker 1: its local rank 1 on the CPU.
  std::string output;
  const std::string out = Launch(cfg, "local_ranks_twin_device",
                                 "cuda-twin,cuda-twin,cuda-twin,cuda-twin,cpu,cuda-twin", &output);
  ExpectReference(cfg, out, Reference(cfg));
  EXPECT_THAT(output, HasSubstr("worker 0: its 3 local ranks add their gradients on the device "
                                "(cuda-twin)"));
  EXPECT_THAT(output, HasSubstr("worker 1: its 3 local ranks add their gradients in host memory "
                                "(local rank 1 is on the CPU)"));
}

// The same on a GPU: two workers of two local ranks, all four processes
// on GPU 0, map each other's gradients by CUDA IPC. Skipped without a GPU
// (ONEBIT_REQUIRE_GPU makes that a failure).
TEST(LocalRanksDevice, GpuRanksAddTheirGradientsOnTheDeviceBitForBit) {
  std::string why;
  if (cuda::DeviceCount(&why) == 0) {
    if (std::getenv("ONEBIT_REQUIRE_GPU") != nullptr) FAIL() << "no GPU: " << why;
    GTEST_SKIP() << "no CUDA device is usable here: " << why;
  }
  const control::TrainingConfig cfg = Config("onebit-adam", 2, 2);
  std::string output;
  const std::string out =
      Launch(cfg, "local_ranks_gpu_device", "cuda:0,cuda:0,cuda:0,cuda:0", &output);
  ExpectReference(cfg, out, Reference(cfg));
  for (const char* worker : {"worker 0", "worker 1"}) {
    EXPECT_THAT(output,
                HasSubstr(absl::StrCat(
                    worker, ": its 2 local ranks add their gradients on the device (cuda:0)")));
  }
}

// A host's NIC carries 1/K of the bytes of K flat workers: N workers of
// K local ranks push and receive a third of what N * K workers do (the
// same payloads and headers per worker).
TEST(LocalRanksBytes, AWorkerPushesOnceForItsLocalRanks) {
  const std::string grouped =
      ReadFile(Launch(Config("onebit-adam", 2, 3), "bytes_local") + "/summary.json");
  const std::string flat =
      ReadFile(Launch(Config("onebit-adam", 6, 1), "bytes_flat") + "/summary.json");
  for (const char* key : {"bytes_up", "bytes_down"}) {
    const double ratio = NumberField(flat, key) / NumberField(grouped, key);
    EXPECT_GT(ratio, 2.99) << key;
    EXPECT_LT(ratio, 3.01) << key;
  }
}

// Launches `cfg` into dir/run with `flags` (logging to dir/launch.log) and,
// once the log shows `when`, kill -9s `victim`: worker 1's local rank 1
// ("follower"), its local rank 0 ("leader") or server 0 ("server");
// returns the launcher.
Subprocess LaunchAndKillALocalRank(const control::TrainingConfig& cfg, const std::string& dir,
                                   std::vector<std::string> flags, const std::string& when,
                                   const std::string& victim = "follower") {
  const std::string out = dir + "/run";
  std::vector<std::string> argv = {Bin("onebit-launch"), "--out=" + out, "--dump_params"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  for (const std::string& a : ConfigArgs(cfg)) argv.push_back(a);
  Subprocess launch = Start(argv, dir + "/launch.log");
  EXPECT_TRUE(WaitForText(dir + "/launch.log", when, absl::Seconds(60)))
      << ReadFile(dir + "/launch.log");
  std::vector<int> pids;
  if (victim == "server") {
    const std::string log = ReadFile(dir + "/launch.log");
    const size_t at = log.find("coordinator at ");
    const std::string target = log.substr(at + 15, log.find(' ', at + 15) - at - 15);
    for (int pid : ProcessesMentioning("--coordinator=" + target)) {
      if (ReadFile(absl::StrCat("/proc/", pid, "/cmdline")).find("--shard=0") != std::string::npos)
        pids.push_back(pid);
    }
  } else {
    pids = ProcessesMentioning(
        absl::StrCat("--dump_x=", out, "/replica_w1", victim == "leader" ? "" : "_local1", ".f32"));
  }
  EXPECT_EQ(pids.size(), 1u) << victim;
  if (pids.size() == 1) kill(pids[0], SIGKILL);
  return launch;
}

// kill -9 of a local rank: its worker's wait for it ends at once (its
// socket closes), and the job fails naming it.
TEST(LocalRanksFaults, AKilledLocalRankFailsTheJobNamingIt) {
  const std::string dir = TempDir("local_rank_killed");
  const std::string out = dir + "/run";
  control::TrainingConfig cfg = Config("adam", 2, 2);
  SetSetting(&cfg, "steps", "100000000");
  Subprocess launch = LaunchAndKillALocalRank(cfg, dir, {"--step_timeout=60s"}, "steps/s");
  const absl::Time killed = absl::Now();
  const std::optional<int> code = launch.Wait(absl::Seconds(60));
  ASSERT_TRUE(code.has_value()) << ReadFile(dir + "/launch.log");
  EXPECT_NE(*code, 0);
  // Well within the step timeout (60 s) and the heartbeat's.
  EXPECT_LT(absl::Now() - killed, absl::Seconds(20));
  const std::string log = ReadFile(dir + "/launch.log");
  // Found when its worker next waits for it (left) or answers it (gone).
  const std::string named = "worker 1 failed: worker 1: local rank 1 of this host ";
  EXPECT_THAT(log, HasSubstr(named));
  EXPECT_THAT(log, HasSubstr("presumed dead"));
  EXPECT_THAT(ReadFile(out + "/summary.json"), HasSubstr(named));
}

// Without live recovery (--rejoin_timeout=0), a killed local rank fails
// its worker, the launcher starts the whole job again, the followers learn
// the checkpoint's step from their leader, and the job ends where the
// uninterrupted one does, every process's replica included.
TEST(LocalRanksFaults, AKilledLocalRankRestartsTheJobWhichResumesBitForBit) {
  const std::string dir = TempDir("local_rank_resumed");
  const std::string out = dir + "/run";
  control::TrainingConfig cfg = Config("onebit-adam", 2, 2);
  SetSetting(&cfg, "steps", "20000");
  SetSetting(&cfg, "lr", "0.0001");
  // Killed once a checkpoint is complete, so that the job resumes from it.
  Subprocess launch =
      LaunchAndKillALocalRank(cfg, dir,
                              {"--checkpoint_dir=" + dir + "/ckpt", "--checkpoint_every=500",
                               "--max_restarts=1", "--rejoin_timeout=0"},
                              "checkpoint of step 500 complete");
  const std::optional<int> code = launch.Wait(absl::Seconds(240));
  ASSERT_TRUE(code.has_value()) << ReadFile(dir + "/launch.log");
  const std::string log = ReadFile(dir + "/launch.log");
  EXPECT_EQ(*code, 0) << log;
  EXPECT_THAT(log, HasSubstr("restart 1 of 1: starting the whole job again"));
  // From a checkpoint (one every 500 steps; the kill came after the first).
  EXPECT_GT(NumberField(ReadFile(out + "/summary.json"), "resumed_from_step"), 0);
  ExpectReference(cfg, out, Reference(cfg));
}

// Live recovery with local ranks: a killed follower or leader takes its
// host's other ranks with it, the launcher starts that host's ranks again
// (and nothing else), the other workers and their local ranks roll back in
// place, and the job ends bit for bit as the uninterrupted one, every
// process's replica included. A killed server alone comes back, and every
// host's ranks roll back in place.
class LocalRanksRecovery : public ::testing::TestWithParam<std::string> {};

TEST_P(LocalRanksRecovery, OnlyTheLostHostStartsAgainAndTheJobEndsBitForBit) {
  const std::string dir = TempDir("local_rank_live_" + GetParam());
  const std::string out = dir + "/run";
  control::TrainingConfig cfg = Config("onebit-adam", 2, 2);
  SetSetting(&cfg, "steps", "3000");
  SetSetting(&cfg, "freeze_step", "1000");
  SetSetting(&cfg, "lr", "0.0001");
  Subprocess launch =
      LaunchAndKillALocalRank(cfg, dir,
                              {"--checkpoint_dir=" + dir + "/ckpt", "--checkpoint_every=200",
                               "--max_restarts=1", "--heartbeat_timeout=3s"},
                              "checkpoint of step 1200 complete", GetParam());
  const std::optional<int> code = launch.Wait(absl::Seconds(240));
  ASSERT_TRUE(code.has_value()) << ReadFile(dir + "/launch.log");
  const std::string log = ReadFile(dir + "/launch.log");
  EXPECT_EQ(*code, 0) << log;
  EXPECT_THAT(log, Not(HasSubstr("starting the whole job again")));
  if (GetParam() == "server") {
    EXPECT_THAT(log, HasSubstr("server0 failed (signal 9 (Killed)); restart 1 of 1: starting it "
                               "again; the job rolls back"));
    EXPECT_THAT(log, HasSubstr("worker 1: server 0 registered again (restarted)"));
  } else {
    EXPECT_THAT(log, HasSubstr("; restart 1 of 1: starting its host's 2 local ranks again; the "
                               "job rolls back"));
    EXPECT_THAT(log, HasSubstr("worker 0: worker 1 registered again (restarted)"));
  }
  EXPECT_THAT(log, HasSubstr("worker 0: the job rolled back to the checkpoint of step"));
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "rollbacks"), "1") << summary;
  ExpectReference(cfg, out, Reference(cfg));
}

INSTANTIATE_TEST_SUITE_P(Victim, LocalRanksRecovery,
                         ::testing::Values("follower", "leader", "server"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace onebit::testing
