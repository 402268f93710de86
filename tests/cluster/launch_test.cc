// onebit-launch itself on real clusters: what a stop signal to it does (the
// first stops the job through the coordinator, a second kills every process,
// a terminal's Ctrl-C reaches only the launcher, and nothing starts again
// after one), and what --worker_cmd implies (an external model, and the
// launcher's own onebit_ps on PYTHONPATH).
#include <signal.h>
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "checkpoint/checkpoint_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster/test_util.h"

namespace onebit::testing {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

// A job that would run for hours: 2 workers and 2 servers on a small d.
std::vector<std::string> LongJob(const std::string& out, const std::vector<std::string>& more) {
  std::vector<std::string> argv = {
      Bin("onebit-launch"), "--workers=2",     "--servers=2",       "--dim=4000",
      "--steps=100000000",  "--block_size=32", "--chunk_elems=512", "--heartbeat_timeout=3s",
      "--out=" + out};
  argv.insert(argv.end(), more.begin(), more.end());
  return argv;
}

size_t Rows(const std::string& out) {
  const std::vector<std::string> lines =
      absl::StrSplit(ReadFile(out + "/metrics.csv"), '\n', absl::SkipEmpty());
  return lines.empty() ? 0 : lines.size() - 1;  // the header
}

// Whether the job at `out` has reported `n` steps within `timeout`.
bool WaitForRows(const std::string& out, size_t n, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (Rows(out) < n && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  return Rows(out) >= n;
}

// The job's processes still running: the coordinator (named by --out, as is
// the launcher) and the servers and workers (named by the coordinator's
// address, from the launcher's log).
size_t Alive(const std::string& log, const std::string& out) {
  size_t n = ProcessesMentioning("--out=" + out).size();
  const size_t at = log.find("coordinator at 127.0.0.1:");
  if (at != std::string::npos) {
    const std::string target = log.substr(at + 15, log.find(' ', at + 15) - at - 15);
    n += ProcessesMentioning("--coordinator=" + target).size();
  }
  return n;
}

TEST(LaunchSignals, CtrlCReachesOnlyTheLauncherAndStopsTheJobAfterACheckpoint) {
  const std::string dir = TempDir("ctrl_c");
  const std::string out = dir + "/run";
  const std::string log = dir + "/launch.log";
  Subprocess launch =
      Start(LongJob(out, {"--checkpoint_dir=" + dir + "/ckpt", "--checkpoint_every=100000"}), log);
  ASSERT_TRUE(WaitForRows(out, 20, absl::Seconds(30))) << ReadFile(log);
  // A terminal's Ctrl-C is SIGINT to its foreground process group, which the
  // launcher leads here as in a shell (Subprocess starts it in a session of
  // its own); its children are in groups of their own.
  ASSERT_EQ(getpgid(launch.pid()), launch.pid());
  kill(-launch.pid(), SIGINT);
  auto code = launch.Wait(absl::Seconds(20));
  ASSERT_TRUE(code.has_value()) << "hung: " << ReadFile(log);
  const std::string text = ReadFile(log);
  EXPECT_EQ(*code, 0) << text;
  EXPECT_THAT(text, HasSubstr("launch: SIGINT: stopping the job"));
  EXPECT_THAT(text, HasSubstr("launch: job stopped after a checkpoint (summary.json says why); "
                              "run it again to resume"));
  for (const char* child : {"SIGINT to the coordinator", "SIGINT to worker", "SIGINT to server"}) {
    EXPECT_THAT(text, Not(HasSubstr(child))) << "a child got the terminal's SIGINT";
  }
  const std::string summary = ReadFile(out + "/summary.json");
  uint64_t at = 0;
  ASSERT_TRUE(absl::SimpleAtoi(Field(summary, "stopped_at_step"), &at)) << summary;
  EXPECT_GE(at, 20u);
  EXPECT_THAT(summary, HasSubstr(absl::StrCat("\"status\": \"stopped: SIGINT to onebit-launch; "
                                              "the checkpoint of step ",
                                              at, " is complete")));
  EXPECT_TRUE(VerifyCheckpoint(StepDir(dir + "/ckpt", at)).ok());
  EXPECT_EQ(Alive(text, out), 0u);
}

// The stop cannot complete (worker 1 stalls, so no step boundary comes):
// the second SIGTERM kills every process at once.
TEST(LaunchSignals, ASecondSigtermKillsEveryProcessAtOnce) {
  const std::string dir = TempDir("second_sigterm");
  const std::string out = dir + "/run";
  const std::string log = dir + "/launch.log";
  Subprocess launch =
      Start(LongJob(out, {"--checkpoint_dir=" + dir + "/ckpt", "--checkpoint_every=10",
                          "--stall_worker=1", "--stall_at_step=30"}),
            log);
  ASSERT_TRUE(WaitForText(log, "stalling at step 30", absl::Seconds(30))) << ReadFile(log);
  kill(launch.pid(), SIGTERM);
  ASSERT_TRUE(WaitForText(log, "stopping at the next step boundary", absl::Seconds(10)))
      << ReadFile(log);
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_FALSE(launch.Poll().has_value()) << "the first SIGTERM ended it: " << ReadFile(log);
  const size_t running = Alive(ReadFile(log), out);
  EXPECT_EQ(running, 6u) << "the launcher, the coordinator, 2 servers and 2 workers";
  const absl::Time sent = absl::Now();
  kill(launch.pid(), SIGTERM);
  auto code = launch.Wait(absl::Seconds(5));
  ASSERT_TRUE(code.has_value()) << "hung: " << ReadFile(log);
  const absl::Duration took = absl::Now() - sent;
  std::cerr << "second SIGTERM: the launcher exited in " << took << "\n";
  EXPECT_LT(took, absl::Seconds(1));
  const std::string text = ReadFile(log);
  EXPECT_EQ(*code, 128 + SIGTERM) << text;
  EXPECT_THAT(text, HasSubstr("launch: a second stop signal (SIGTERM): killing every process"));
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (Alive(text, out) > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(Alive(text, out), 0u) << "a child outlived the launcher";
}

// Without --checkpoint_dir there is nowhere to save the job: it fails, the
// coordinator writing the run folder first, and --max_restarts starts
// nothing again.
TEST(LaunchSignals, WithoutACheckpointDirAStopFailsTheJobWritesTheRunFolderAndRestartsNothing) {
  const std::string dir = TempDir("stop_no_checkpoint");
  const std::string out = dir + "/run";
  const std::string log = dir + "/launch.log";
  Subprocess launch = Start(LongJob(out, {"--max_restarts=2"}), log);
  ASSERT_TRUE(WaitForRows(out, 20, absl::Seconds(30))) << ReadFile(log);
  const absl::Time sent = absl::Now();
  kill(launch.pid(), SIGTERM);
  auto code = launch.Wait(absl::Seconds(20));
  ASSERT_TRUE(code.has_value()) << "hung: " << ReadFile(log);
  std::cerr << "stop without a checkpoint: the launcher exited in " << absl::Now() - sent << "\n";
  const std::string text = ReadFile(log);
  EXPECT_EQ(*code, 1) << text;
  EXPECT_THAT(text, HasSubstr("passing SIGTERM on to the coordinator"));
  EXPECT_THAT(text, Not(HasSubstr("restart 1 of 2")));
  EXPECT_THAT(text, HasSubstr("launch: not starting the job again: stopped by SIGTERM"));
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_THAT(summary, HasSubstr("\"status\": \"failed: stopped by SIGTERM to onebit-launch\""));
  EXPECT_EQ(Alive(text, out), 0u);
}

// A process lost while the job stops is not started again (--max_restarts
// with live recovery would otherwise bring it back).
TEST(LaunchSignals, AProcessLostWhileStoppingIsNotStartedAgain) {
  const std::string dir = TempDir("lost_while_stopping");
  const std::string out = dir + "/run";
  const std::string log = dir + "/launch.log";
  Subprocess launch =
      Start(LongJob(out, {"--checkpoint_dir=" + dir + "/ckpt", "--checkpoint_every=10",
                          "--max_restarts=2", "--stall_worker=1", "--stall_at_step=30"}),
            log);
  ASSERT_TRUE(WaitForText(log, "stalling at step 30", absl::Seconds(30))) << ReadFile(log);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!VerifyCheckpoint(StepDir(dir + "/ckpt", 20)).ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(VerifyCheckpoint(StepDir(dir + "/ckpt", 20)).ok()) << ReadFile(log);
  kill(launch.pid(), SIGTERM);
  ASSERT_TRUE(WaitForText(log, "stopping at the next step boundary", absl::Seconds(10)))
      << ReadFile(log);
  std::vector<int> worker0;
  const std::string text = ReadFile(log);
  const size_t at = text.find("coordinator at 127.0.0.1:");
  ASSERT_NE(at, std::string::npos) << text;
  for (int pid : ProcessesMentioning("--coordinator=" +
                                     text.substr(at + 15, text.find(' ', at + 15) - at - 15))) {
    const std::string cmd = ReadFile(absl::StrCat("/proc/", pid, "/cmdline"));
    if (cmd.find("onebit-worker") != std::string::npos &&
        cmd.find(std::string("--rank=0") + '\0') != std::string::npos) {
      worker0.push_back(pid);
    }
  }
  ASSERT_EQ(worker0.size(), 1u);
  kill(worker0[0], SIGKILL);
  auto code = launch.Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value()) << "hung: " << ReadFile(log);
  const std::string done = ReadFile(log);
  EXPECT_NE(*code, 0) << done;
  EXPECT_THAT(done, HasSubstr("worker0 failed (signal 9"));
  EXPECT_THAT(done, Not(HasSubstr("restart 1 of 2")));
  // The coordinator fails the job: the lost worker cannot be waited for.
  const std::string status = Field(ReadFile(out + "/summary.json"), "status");
  EXPECT_THAT(status, HasSubstr("\"failed: "));
  EXPECT_THAT(status, HasSubstr("SIGTERM to onebit-launch"));
  EXPECT_EQ(Alive(done, out), 0u);
}

TEST(LaunchWorkerCmd, AWorkerCommandImpliesAnExternalModel) {
  const std::string out = TempDir("implied_external") + "/run";
  RunResult r = RunCommand(
      {Bin("onebit-launch"), "--workers=2", "--servers=1", "--out=" + out,
       "--optimizer=onebit-adam", "--freeze_step=2", "--block_size=32", "--chunk_elems=64",
       "--worker_cmd=" + std::string(ONEBIT_API_WORKER) + " --d 600 --steps 4"},
      absl::Seconds(60));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "status"), "\"ok\"");
  EXPECT_EQ(Field(summary, "params"), "600");  // the program's d, not the synthetic 1000
  EXPECT_EQ(Field(summary, "steps"), "4");     // the program decided
  EXPECT_EQ(Field(summary, "replicas_equal"), "true");
}

// The servers and workers run at --child_nice, the coordinator at the
// launcher's own: a job's processes outnumbering the cores must not starve
// the one that answers every heartbeat. Where the kernel groups tasks by
// session (autogroup), each child's group runs at that niceness too: the
// groups share the CPU equally whatever their threads' niceness, and 256
// children at niceness 10 left the coordinator 1/257 of it.
TEST(LaunchWorkerCmd, ServersAndWorkersRunAtTheChildNiceness) {
  const std::string out = TempDir("child_nice") + "/run";
  // The worker's shell prints its niceness (field 19 of /proc/self/stat,
  // awk's own, inherited) and its autogroup ("/autogroup-N nice K"), then
  // becomes the worker.
  const std::string cmd =
      absl::StrCat("/bin/sh -c 'awk \"{ print \\\"niceness \\\" \\$19 }\" /proc/self/stat >&2; ",
                   "if [ -r /proc/self/autogroup ]; then cat /proc/self/autogroup >&2; fi; exec ",
                   ONEBIT_API_WORKER, " --d 600 --steps 2'");
  RunResult r =
      RunCommand({Bin("onebit-launch"), "--workers=2", "--servers=1", "--out=" + out,
                  "--block_size=32", "--chunk_elems=64", "--child_nice=7", "--worker_cmd=" + cmd},
                 absl::Seconds(60));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[worker0] niceness 7"));
  EXPECT_THAT(r.output, HasSubstr("[worker1] niceness 7"));
  if (access("/proc/self/autogroup", R_OK) == 0) {
    EXPECT_THAT(r.output, ContainsRegex("\\[worker0\\] /autogroup-[0-9]+ nice 7"));
    EXPECT_THAT(r.output, ContainsRegex("\\[worker1\\] /autogroup-[0-9]+ nice 7"));
  } else {
    std::cerr << "this kernel has no autogroups (/proc/self/autogroup): their niceness untested\n";
  }
  EXPECT_EQ(Field(ReadFile(out + "/summary.json"), "status"), "\"ok\"");
  RunResult bad = RunCommand({Bin("onebit-launch"), "--child_nice=20"}, absl::Seconds(10));
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.output, HasSubstr("--child_nice: must be -1 (auto) or in [0, 19]"));
}

TEST(LaunchWorkerCmd, ABuiltInModelWithAWorkerCommandIsRefusedNamingModel) {
  RunResult r =
      RunCommand({Bin("onebit-launch"), "--workers=1", "--model=mlp", "--worker_cmd=/bin/true"},
                 absl::Seconds(10));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("onebit-launch: --model: 'mlp' is a built-in model"));
  EXPECT_THAT(r.output, HasSubstr("--model external"));
}

// A PyTorch worker started with no PYTHONPATH imports the launcher's own
// onebit_ps (<build>/python), and the job is external without --model.
TEST(LaunchWorkerCmd, APythonWorkerImportsTheLaunchersOwnOnebitPs) {
#ifndef ONEBIT_PYTHONPATH_WORKER
  GTEST_SKIP() << "the onebit_ps Python package is not built";
#else
  const std::string out = TempDir("pythonpath") + "/run";
  RunResult r = RunCommand(
      {"/usr/bin/env", "-u", "PYTHONPATH", Bin("onebit-launch"), "--workers=2", "--servers=1",
       "--out=" + out, "--worker_cmd=/usr/bin/python3 " ONEBIT_PYTHONPATH_WORKER},
      absl::Seconds(120));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("pythonpath_worker: onebit_ps from " + Bin("python") +
                                  "/onebit_ps/__init__.py"));
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "status"), "\"ok\"");
  EXPECT_EQ(Field(summary, "params"), "4");  // Linear(3, 1)
  EXPECT_EQ(Field(summary, "steps"), "3");
#endif
}

}  // namespace
}  // namespace onebit::testing
