// Resuming real clusters from their checkpoints: a job is stopped mid-run (one
// worker stalls, then one process is killed with SIGKILL once the checkpoint
// before the stall is complete), started again on the same checkpoint
// folder, and must end bit for bit where the same job run without
// interruption ends: every worker's x, every master and every server error,
// and every metrics row's loss.
#include <signal.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/state_file.h"
#include "compress/codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "job/config.h"
#include "models/registry.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "tests/cluster/test_util.h"

namespace onebit::testing {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

struct Case {
  std::string name;
  std::vector<std::string> flags;  // the job, for onebit-launch
  uint64_t steps = 0;
  uint64_t every = 0;     // --checkpoint_every
  uint64_t stall_at = 0;  // worker 1 stops pushing at this step
  // Killed with SIGKILL: "coordinator", "server K" or "worker R".
  std::string victim;
  std::vector<std::string> resume_flags;  // e.g. another --servers
};

std::vector<std::string> Launch(const Case& c, const std::string& out,
                                const std::vector<std::string>& more) {
  std::vector<std::string> argv = {Bin("onebit-launch"), "--out=" + out};
  argv.insert(argv.end(), c.flags.begin(), c.flags.end());
  argv.insert(argv.end(), more.begin(), more.end());
  return argv;
}

// The pid of the case's victim in the job whose coordinator is `target`.
int VictimPid(const std::string& victim, const std::string& target, const std::string& out) {
  std::vector<int> pids;
  if (victim == "coordinator") {
    for (int pid : ProcessesMentioning("--out=" + out)) {
      if (ReadFile(absl::StrCat("/proc/", pid, "/cmdline")).find("onebit-coordinator") !=
          std::string::npos) {
        pids.push_back(pid);
      }
    }
  } else {
    const std::vector<std::string> role = absl::StrSplit(victim, ' ');
    const std::string bin = role[0] == "server" ? "onebit-server" : "onebit-worker";
    const std::string rank = absl::StrCat(role[0] == "server" ? "--shard=" : "--rank=", role[1]);
    for (int pid : ProcessesMentioning("--coordinator=" + target)) {
      std::string cmd = ReadFile(absl::StrCat("/proc/", pid, "/cmdline"));
      std::replace(cmd.begin(), cmd.end(), '\0', ' ');
      if (cmd.find(bin) != std::string::npos && cmd.find(rank + " ") != std::string::npos) {
        pids.push_back(pid);
      }
    }
  }
  EXPECT_EQ(pids.size(), 1u) << victim;
  return pids.empty() ? -1 : pids[0];
}

std::vector<std::string> Rows(const std::string& out) {
  std::vector<std::string> lines =
      absl::StrSplit(ReadFile(out + "/metrics.csv"), '\n', absl::SkipEmpty());
  if (!lines.empty()) lines.erase(lines.begin());  // the header
  return lines;
}

std::string Column(const std::string& row, int i) {
  const std::vector<std::string> f = absl::StrSplit(row, ',');
  return i < static_cast<int>(f.size()) ? f[i] : std::string();
}

// The chunks worker `rank` pushed in one start of a job, from onebit-worker's
// closing line ("worker R: A of B chunks ..."): what that start ran, not
// what the run folder says (-1: no such line).
int64_t ChunksPushed(const std::string& output, uint32_t rank) {
  const std::string key = absl::StrCat("] worker ", rank, ": ");
  for (size_t pos = output.find(key); pos != std::string::npos; pos = output.find(key, pos + 1)) {
    const size_t of = output.find(" of ", pos);
    const size_t chunks = output.find(" chunks", pos);
    const size_t eol = output.find('\n', pos);
    if (of == std::string::npos || chunks == std::string::npos || chunks > eol) continue;
    int64_t n = 0;
    if (absl::SimpleAtoi(output.substr(of + 4, chunks - of - 4), &n)) return n;
  }
  return -1;
}

// The chunks one worker pushes in a step of the job `flags` that sends
// fp32/fp16, and in one that sends the compression codecs: the two grids of
// net/data_plane.h.
void ChunksPerStep(const std::vector<std::string>& flags, int64_t* full, int64_t* compressed) {
  auto cfg = ConfigFromFlags(flags);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto map = ShardMapForConfig(*cfg, ModelLayerEnds(*cfg).value_or(std::vector<uint64_t>{}));
  ASSERT_TRUE(map.ok()) << map.status();
  auto options = OptimizerOptionsFromConfig(*cfg);
  ASSERT_TRUE(options.ok()) << options.status();
  options->codec.block_size = map->block_size();
  auto codec = NewCodec(options->worker_codec, options->codec);
  ASSERT_TRUE(codec.ok()) << codec.status();
  const uint64_t fine = ChunkElemsFor(cfg->compression().chunk_elems(), *map);
  const uint64_t coarse =
      CompressedChunkElemsFor(cfg->compression().compressed_chunk_elems(), fine, *map, **codec);
  *full = *compressed = 0;
  for (uint32_t k = 0; k < map->num_shards(); ++k) {
    *full += static_cast<int64_t>(NumChunks(map->shard(k).size(), fine));
    *compressed += static_cast<int64_t>(NumChunks(map->shard(k).size(), coarse));
  }
}

// A resumed start of the job `flags` ran the steps from `at` on: its
// workers pushed the chunks of those of them that push (every step but
// zero-one-adam's local steps, whose bytes_up is 0 in the metrics of the
// uninterrupted job, run in `plain_dir`), the same number each (a start
// that trained from scratch, ignoring the checkpoint, would push them all).
// A step that pushes fp32 or fp16 (4 or 2 bytes an element from each
// worker) sends the chunks of the warm-up's grid; one that pushes less,
// the compression phase's.
void ExpectRanOnlyTheRest(const std::vector<std::string>& flags, const std::string& resumed,
                          const std::string& plain, const std::string& plain_dir, uint32_t workers,
                          uint64_t at) {
  const std::string csv = ReadFile(plain_dir + "/metrics.csv");
  const std::vector<std::string> names = absl::StrSplit(csv.substr(0, csv.find('\n')), ',');
  const int up =
      static_cast<int>(std::find(names.begin(), names.end(), "bytes_up") - names.begin());
  ASSERT_LT(up, static_cast<int>(names.size())) << csv;
  uint64_t params = 0;
  ASSERT_TRUE(absl::SimpleAtoi(Field(ReadFile(plain_dir + "/summary.json"), "params"), &params));
  int64_t full = 0, compressed = 0;
  ChunksPerStep(flags, &full, &compressed);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const std::vector<std::string> rows = Rows(plain_dir);
  int64_t pushed = 0, pushed_after = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    uint64_t bytes = 0;
    ASSERT_TRUE(absl::SimpleAtoi(Column(rows[i], up), &bytes)) << rows[i];
    if (bytes == 0) continue;
    const int64_t chunks = bytes >= 2 * params * workers ? full : compressed;
    pushed += chunks;
    if (i >= at) pushed_after += chunks;
  }
  ASSERT_GT(pushed, 0) << csv;
  for (uint32_t w = 0; w < workers; ++w) {
    const int64_t got = ChunksPushed(resumed, w), all = ChunksPushed(plain, w);
    ASSERT_EQ(all, pushed) << "worker " << w << " of the uninterrupted job\n" << plain;
    EXPECT_EQ(got, pushed_after) << "worker " << w << " of the resumed start";
  }
}

// Both dumps hold d floats and are equal: two missing or empty dumps would
// "agree" too.
void ExpectSameDump(const std::string& got, const std::string& want) {
  const std::vector<float> a = ReadFloats(got), b = ReadFloats(want);
  EXPECT_FALSE(b.empty()) << want;
  EXPECT_EQ(a.size(), b.size()) << got;
  EXPECT_EQ(FirstDifference(a, b), "") << got;
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class Resume : public ::testing::TestWithParam<Case> {};

// Runs the case's job with checkpoints until worker 1 stalls at stall_at
// and the checkpoint before it is complete, then kills the victim; returns
// that checkpoint's step.
uint64_t Interrupt(const Case& c, const std::string& dir, const std::string& root,
                   const std::vector<std::string>& ckpt, const std::string& out) {
  // Interrupted: worker 1 stalls, so the job cannot pass stall_at; the last
  // checkpoint before it completes, and then the victim dies.
  const uint64_t at = c.stall_at / c.every * c.every;
  std::vector<std::string> stalled = ckpt;
  stalled.push_back("--stall_worker=1");
  stalled.push_back(absl::StrCat("--stall_at_step=", c.stall_at));
  Subprocess first = Start(Launch(c, out, stalled), dir + "/first.log");
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!VerifyCheckpoint(StepDir(root, at)).ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (!VerifyCheckpoint(StepDir(root, at)).ok()) {
    ADD_FAILURE() << ReadFile(dir + "/first.log");
    return 0;
  }
  // Every step up to the stall but the last is reported (a worker sends a
  // step's metrics with its next step, so that an evaluation may join them).
  while (Rows(out).size() < c.stall_at - 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const std::string log = ReadFile(dir + "/first.log");
  const size_t pos = log.find("coordinator at 127.0.0.1:");
  if (pos == std::string::npos) {
    ADD_FAILURE() << log;
    return 0;
  }
  const std::string target = log.substr(pos + 15, log.find(' ', pos + 15) - pos - 15);
  const int victim = VictimPid(c.victim, target, out);
  if (victim <= 0) {
    ADD_FAILURE() << log;
    return 0;
  }
  kill(victim, SIGKILL);
  auto code = first.Wait(absl::Seconds(20));
  if (!code.has_value()) {
    ADD_FAILURE() << "hung: " << ReadFile(dir + "/first.log");
    return 0;
  }
  EXPECT_NE(*code, 0);
  // ... and on disk after the kill, whichever process it was.
  EXPECT_GE(Rows(out).size(), c.stall_at - 1);
  return at;
}

TEST_P(Resume, EndsBitForBitWhereTheUninterruptedJobEnds) {
  const Case& c = GetParam();
  const std::string dir = TempDir("resume_" + c.name);
  const std::string root = dir + "/ckpt";
  const std::vector<std::string> ckpt = {"--checkpoint_dir=" + root,
                                         absl::StrCat("--checkpoint_every=", c.every)};

  RunResult plain = RunCommand(Launch(c, dir + "/plain", {"--dump_params"}), absl::Seconds(60));
  ASSERT_EQ(plain.code, 0) << plain.output;

  const std::string out = dir + "/run";
  const uint64_t at = Interrupt(c, dir, root, ckpt, out);
  ASSERT_FALSE(::testing::Test::HasFailure());

  std::vector<std::string> again = ckpt;
  again.push_back("--resume");
  again.push_back("--dump_params");
  again.insert(again.end(), c.resume_flags.begin(), c.resume_flags.end());
  RunResult resumed = RunCommand(Launch(c, out, again), absl::Seconds(60));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_THAT(resumed.output,
              HasSubstr(absl::StrCat("resuming from the checkpoint of step ", at, " in ")));

  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "status"), "\"ok\"");
  EXPECT_EQ(Field(summary, "resumed_from_step"), absl::StrCat(at));
  EXPECT_EQ(Field(summary, "workers_agree"), "true");
  const std::string want = ReadFile(dir + "/plain/summary.json");
  // replicas_equal: false by design under --server-reply delta.
  for (const char* key :
       {"steps", "freeze_step", "final_loss", "test_accuracy", "replicas_equal"}) {
    EXPECT_EQ(Field(summary, key), Field(want, key)) << key;
  }
  if (c.resume_flags.empty()) {  // headers are per server
    for (const char* key : {"bytes_up", "bytes_down"}) {
      EXPECT_EQ(Field(summary, key), Field(want, key)) << key;
    }
  }
  uint32_t workers = 0, servers = 0;
  ASSERT_TRUE(absl::SimpleAtoi(Field(want, "workers"), &workers));
  ASSERT_TRUE(absl::SimpleAtoi(Field(summary, "servers"), &servers));
  if (c.resume_flags.empty()) {  // another server count, another chunk grid
    ExpectRanOnlyTheRest(c.flags, resumed.output, plain.output, dir + "/plain", workers, at);
  }
  for (uint32_t w = 0; w < workers; ++w) {
    const std::string f = absl::StrCat("/replica_w", w, ".f32");
    ExpectSameDump(out + f, dir + "/plain" + f);
  }
  // The masters and server errors, joined over the shards (a resumed job
  // may have another number of servers).
  for (const char* kind : {"master", "error"}) {
    std::vector<float> got, expect;
    for (uint32_t k = 0; k < servers; ++k) {
      std::vector<float> v = ReadFloats(absl::StrCat(out, "/", kind, "_s", k, ".f32"));
      got.insert(got.end(), v.begin(), v.end());
    }
    uint32_t plain_servers = 0;
    ASSERT_TRUE(absl::SimpleAtoi(Field(want, "servers"), &plain_servers));
    for (uint32_t k = 0; k < plain_servers; ++k) {
      std::vector<float> v = ReadFloats(absl::StrCat(dir, "/plain/", kind, "_s", k, ".f32"));
      expect.insert(expect.end(), v.begin(), v.end());
    }
    // (adam keeps no server error: its dumps are empty.)
    if (std::string(kind) == "master") {
      EXPECT_FALSE(expect.empty());
    }
    EXPECT_EQ(got.size(), expect.size()) << kind;
    EXPECT_EQ(FirstDifference(got, expect), "") << kind;
  }
  // metrics.csv: each step once, in order, the same losses (the rows before
  // the checkpoint kept from the first run, the rest from the second).
  const std::vector<std::string> rows = Rows(out), plain_rows = Rows(dir + "/plain");
  ASSERT_EQ(rows.size(), c.steps);
  ASSERT_EQ(plain_rows.size(), c.steps);
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(Column(rows[i], 0), absl::StrCat(i)) << rows[i];
    EXPECT_EQ(Column(rows[i], 1), Column(plain_rows[i], 1)) << "phase of step " << i;
    EXPECT_EQ(Column(rows[i], 2), Column(plain_rows[i], 2)) << "loss of step " << i;
  }
}

std::vector<std::string> Synthetic(const std::string& optimizer, uint32_t servers, uint64_t steps,
                                   std::vector<std::string> more) {
  std::vector<std::string> f = {"--workers=3",
                                absl::StrCat("--servers=", servers),
                                "--dim=6007",
                                absl::StrCat("--steps=", steps),
                                "--optimizer=" + optimizer,
                                "--block_size=32",
                                "--chunk_elems=1024",
                                "--heartbeat_timeout=3s"};
  f.insert(f.end(), more.begin(), more.end());
  return f;
}

// zero-one-adam's schedule of 13 steps (onebit_test's ZeroOneTest): steps
// 0, 1 and 3 refresh v, 2 compresses gradients; the freeze comes after 4;
// steps 4, 5, 7, 11 and 12 synchronise, 6, 8, 9 and 10 are local.
std::vector<std::string> ZeroOneSchedule() {
  return {"--var_freeze_step=4",
          "--var_update_scaler=1",
          "--local_step_scaler=2",
          "--local_step_clipper=4",
          "--lr=0.05",
          "--weight_decay=0.01"};
}

// onebit-lamb on the mlp's four tensors, 3 workers on 2 aligned shards.
std::vector<std::string> LambJob(std::vector<std::string> more) {
  std::vector<std::string> f = {"--workers=3",
                                "--servers=2",
                                "--model=mlp",
                                "--layers=784-16-10",
                                "--optimizer=onebit-lamb",
                                "--lr=5e-3",
                                "--weight_decay=0.01",
                                "--batch=16",
                                "--max_train=480",
                                "--max_test=200",
                                "--steps=12",
                                "--freeze_step=3",
                                "--block_size=256",
                                "--chunk_elems=1024",
                                "--factor_threshold=0.05",
                                "--heartbeat_timeout=3s"};
  f.insert(f.end(), more.begin(), more.end());
  return f;
}

INSTANTIATE_TEST_SUITE_P(
    Jobs, Resume,
    ::testing::Values(
        // The checkpoint exactly at the freeze step (the first compression
        // step is 4): v frozen, the errors still zero.
        Case{"at_the_freeze",
             Synthetic("onebit-adam", 2, 10, {"--freeze_step=4"}),
             10,
             4,
             6,
             "worker 1",
             {}},
        Case{"compression_phase_server_killed",
             Synthetic("onebit-adam", 2, 12, {"--freeze_step=3"}),
             12,
             3,
             7,
             "server 0",
             {}},
        Case{
            "warmup_coordinator_killed", Synthetic("adam", 2, 10, {}), 10, 2, 5, "coordinator", {}},
        Case{"delta_reply",
             Synthetic("onebit-adam", 2, 12,
                       {"--freeze_step=3", "--server_reply=delta", "--server_codec=fp16"}),
             12,
             4,
             9,
             "server 1",
             {}},
        Case{"naive_onebit_adam",
             Synthetic("naive-onebit-adam", 2, 10, {"--freeze_step=2"}),
             10,
             3,
             7,
             "worker 0",
             {}},
        Case{"ef_sgd", Synthetic("ef-sgd", 1, 8, {}), 8, 3, 4, "worker 2", {}},
        Case{"sgd", Synthetic("sgd", 2, 8, {}), 8, 2, 5, "server 1", {}},
        // --freeze auto: the coordinator's decisions up to the checkpoint
        // come from its manifest; the later ones are made again.
        Case{"auto_freeze",
             {"--workers=2", "--servers=3", "--dim=3000", "--steps=40", "--optimizer=onebit-adam",
              "--freeze=auto:0.3:5", "--block_size=32", "--chunk_elems=256", "--seed=7",
              "--heartbeat_timeout=3s"},
             40,
             5,
             12,
             "server 2",
             {}},
        // Saved by global range: two servers' files restore onto three.
        Case{"reshard_2_to_3",
             Synthetic("onebit-adam", 2, 10, {"--freeze_step=3"}),
             10,
             5,
             6,
             "worker 2",
             {"--servers=3"}},
        Case{"mlp",
             {"--workers=2", "--servers=2", "--model=mlp", "--layers=784-16-10",
              "--optimizer=onebit-adam", "--lr=2e-3", "--batch=32", "--max_train=512",
              "--max_test=200", "--epochs=3", "--freeze_step=8", "--heartbeat_timeout=3s"},
             24,
             8,
             13,
             "server 1",
             {}},
        // zero-one-adam (ZeroOneSchedule): after 9 steps the workers are
        // between the syncs of steps 7 and 11, their local x one local step
        // (8) away from x_sync, their m their own, lrs = lr(8).
        Case{"zero_one_adam_between_syncs",
             Synthetic("zero-one-adam", 2, 13, ZeroOneSchedule()),
             13,
             3,
             11,
             "worker 2",
             {}},
        // After 10: two local steps (8, 9) into the interval; a server dies.
        Case{"zero_one_adam_server_killed",
             Synthetic("zero-one-adam", 2, 13, ZeroOneSchedule()),
             13,
             5,
             11,
             "server 0",
             {}},
        // Before the freeze (after 3 steps, v refreshed at steps 0, 1 and
        // about to be at 3): every worker's own v and den.
        Case{"zero_one_adam_variance_phase",
             Synthetic("zero-one-adam", 1, 13, ZeroOneSchedule()),
             13,
             3,
             4,
             "worker 0",
             {}},
        // onebit-lamb after the freeze (the first compression step is 3): the
        // frozen ratios, the factors (0.92-1.0 by then: one reset to 1
        // changes the end) and the v that moved since, at 9.
        Case{"onebit_lamb_frozen_ratios", LambJob({}), 12, 3, 10, "server 1", {}},
        // Its layers' values by global position: 2 servers' files onto 3.
        Case{"onebit_lamb_reshard_2_to_3", LambJob({}), 12, 4, 9, "worker 0", {"--servers=3"}},
        Case{"onebit_lamb_delta_reply",
             LambJob({"--server_reply=delta"}),
             12,
             5,
             7,
             "worker 1",
             {}}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// What a resumed job runs comes from its checkpoint: one master element
// changed in a validly rewritten checkpoint (the section's, the file's and
// the manifest's checksums made anew) changes the job's end.
TEST(ResumeFromCheckpoint, AValidlyChangedCheckpointChangesTheResult) {
  const Case c{"tamper", Synthetic("adam", 2, 10, {}), 10, 2, 5, "worker 0", {}};
  const std::string dir = TempDir("resume_tamper");
  const std::string root = dir + "/ckpt";
  const std::vector<std::string> ckpt = {"--checkpoint_dir=" + root, "--checkpoint_every=2"};
  RunResult plain = RunCommand(Launch(c, dir + "/plain", {"--dump_params"}), absl::Seconds(60));
  ASSERT_EQ(plain.code, 0) << plain.output;
  const std::string out = dir + "/run";
  const uint64_t at = Interrupt(c, dir, root, ckpt, out);
  ASSERT_FALSE(HasFailure());

  // Server 0's x[0] += 1 in the checkpoint of step `at`.
  const std::string step_dir = StepDir(root, at);
  absl::StatusOr<checkpoint::Manifest> manifest = VerifyCheckpoint(step_dir);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  checkpoint::ManifestFile* file = nullptr;
  for (checkpoint::ManifestFile& f : *manifest->mutable_files()) {
    if (f.name() == "server-0.state") file = &f;
  }
  ASSERT_NE(file, nullptr) << manifest->DebugString();
  absl::StatusOr<StateReader> reader = StateReader::Open(step_dir + "/" + file->name());
  ASSERT_TRUE(reader.ok()) << reader.status();
  checkpoint::StateHeader header = reader->header();
  header.clear_sections();
  StateWriter writer(header);
  float x0 = 0;
  for (const checkpoint::Section& section : reader->header().sections()) {
    absl::StatusOr<std::string> bytes = reader->Bytes(section.name());
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    if (section.name() == "x") {
      ASSERT_GE(bytes->size(), sizeof(float));
      std::memcpy(&x0, bytes->data(), sizeof(float));
      const float changed = x0 + 1.0f;
      std::memcpy(bytes->data(), &changed, sizeof(float));
    }
    writer.AddBytes(section.name(), *bytes);
  }
  absl::StatusOr<WrittenFile> written = writer.WriteTo(step_dir, file->name());
  ASSERT_TRUE(written.ok()) << written.status();
  file->set_size(written->size);
  file->set_crc32(written->crc32);
  ASSERT_TRUE(WriteManifest(step_dir, *manifest).ok());
  ASSERT_TRUE(VerifyCheckpoint(step_dir).ok());

  RunResult resumed = RunCommand(Launch(c, out, {ckpt[0], ckpt[1], "--resume", "--dump_params"}),
                                 absl::Seconds(60));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_THAT(resumed.output,
              HasSubstr(absl::StrCat("resuming from the checkpoint of step ", at, " in ")));
  const std::vector<float> got = ReadFloats(out + "/master_s0.f32");
  const std::vector<float> want = ReadFloats(dir + "/plain/master_s0.f32");
  ASSERT_EQ(got.size(), want.size());
  ASSERT_FALSE(want.empty());
  // Adam moves x[0] by about lr (0.01) a step and the model pulls it back
  // slowly: most of the +1 is still there 8 steps later (0.66 here).
  EXPECT_GT(got[0] - want[0], 0.3f) << "x[0] at the checkpoint was " << x0;
  EXPECT_LT(got[0] - want[0], 1.1f);
  std::vector<float> replica = ReadFloats(out + "/replica_w0.f32");
  ASSERT_GE(replica.size(), got.size());
  replica.resize(got.size());
  EXPECT_EQ(FirstDifference(replica, got), "") << "the replicas follow the changed master";
}

// SIGTERM (what Kubernetes sends on preemption) to any one process, or to
// onebit-launch (which passes it on to the coordinator): the job checkpoints
// at the next step boundary, every process exits 0, and the job run again
// ends bit for bit where the uninterrupted one does.
// The job `flags` (3 workers, 2 servers, 3000 steps) stopped by SIGTERM to
// `victim` after 100 steps and run again; *stopped_at: the stop step.
void StopAndResume(const std::string& victim, const std::string& name,
                   const std::vector<std::string>& flags, uint64_t* stopped_at) {
  const std::string dir = TempDir("sigterm_" + name);
  Case c;
  c.flags = flags;
  const std::vector<std::string> ckpt = {"--checkpoint_dir=" + dir + "/ckpt",
                                         "--checkpoint_every=100000"};
  RunResult plain = RunCommand(Launch(c, dir + "/plain", {"--dump_params"}), absl::Seconds(60));
  ASSERT_EQ(plain.code, 0) << plain.output;

  const std::string out = dir + "/run";
  Subprocess first = Start(Launch(c, out, ckpt), dir + "/first.log");
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (Rows(out).size() < 100 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_GE(Rows(out).size(), 100u) << ReadFile(dir + "/first.log");
  const std::string log = ReadFile(dir + "/first.log");
  const size_t pos = log.find("coordinator at 127.0.0.1:");
  ASSERT_NE(pos, std::string::npos) << log;
  const std::string target = log.substr(pos + 15, log.find(' ', pos + 15) - pos - 15);
  const int pid = victim == "launcher" ? first.pid() : VictimPid(victim, target, out);
  ASSERT_GT(pid, 0);
  const absl::Time sent = absl::Now();
  kill(pid, SIGTERM);
  auto code = first.Wait(absl::Seconds(20));
  ASSERT_TRUE(code.has_value()) << "hung: " << ReadFile(dir + "/first.log");
  const absl::Duration took = absl::Now() - sent;
  const std::string stopped_log = ReadFile(dir + "/first.log");
  // onebit-launch exits 0 only when every process did.
  EXPECT_EQ(*code, 0) << stopped_log;
  EXPECT_THAT(stopped_log, HasSubstr("launch: job stopped after a checkpoint"));
  EXPECT_LT(took, absl::Seconds(10)) << "a Kubernetes grace period is 30 s";
  const std::string who = victim == "coordinator" ? "SIGTERM to the coordinator"
                          : victim == "launcher"  ? "SIGTERM to onebit-launch"
                                                  : "SIGTERM to " + victim;
  const std::string summary = ReadFile(out + "/summary.json");
  uint64_t at = 0;
  ASSERT_TRUE(absl::SimpleAtoi(Field(summary, "stopped_at_step"), &at)) << summary;
  EXPECT_GT(at, 0u);
  EXPECT_LT(at, 3000u) << "it stopped early";
  std::cerr << "SIGTERM to " << victim << ": stopped at step " << at << " in " << took << "\n";
  EXPECT_THAT(summary,
              HasSubstr(absl::StrCat("\"status\": \"stopped: ", who, "; the checkpoint of step ",
                                     at, " is complete: run the job again to resume it\"")));
  EXPECT_TRUE(VerifyCheckpoint(StepDir(dir + "/ckpt", at)).ok());
  EXPECT_EQ(Rows(out).size(), at);  // every step before the stop has its row

  std::vector<std::string> again = ckpt;
  again.push_back("--dump_params");
  RunResult resumed = RunCommand(Launch(c, out, again), absl::Seconds(60));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_THAT(resumed.output,
              HasSubstr(absl::StrCat("resuming from the checkpoint of step ", at, " in ")));
  ExpectRanOnlyTheRest(flags, resumed.output, plain.output, dir + "/plain", 3, at);
  for (const char* f : {"/replica_w0.f32", "/replica_w2.f32", "/master_s0.f32", "/master_s1.f32",
                        "/error_s0.f32"}) {
    ExpectSameDump(out + f, dir + "/plain" + f);
  }
  const std::string final_summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(final_summary, "status"), "\"ok\"");
  EXPECT_EQ(Field(final_summary, "resumed_from_step"), absl::StrCat(at));
  EXPECT_EQ(Field(final_summary, "final_loss"),
            Field(ReadFile(dir + "/plain/summary.json"), "final_loss"));
  *stopped_at = at;
}

class Sigterm : public ::testing::TestWithParam<std::string> {};

TEST_P(Sigterm, StopsAfterACheckpointAndResumesBitForBit) {
  std::string name = GetParam();
  std::replace(name.begin(), name.end(), ' ', '_');
  uint64_t at = 0;
  StopAndResume(GetParam(), name, Synthetic("onebit-adam", 2, 3000, {"--freeze_step=40"}), &at);
}

// zero-one-adam's servers skip the local steps between two syncs: a stop
// at one of them (after the first 100 steps, 63 of every 64) is saved by
// the servers too, and resumes bit for bit.
TEST(Sigterm, ZeroOneAdamStopsAtALocalStepAndResumesBitForBit) {
  uint64_t at = 0;
  StopAndResume("worker 1", "zero_one_adam",
                // (A larger model than the others': its local steps are fast.)
                Synthetic("zero-one-adam", 2, 1000,
                          {"--var_freeze_step=20", "--local_step_scaler=4",
                           "--local_step_clipper=64", "--dim=400000"}),
                &at);
  std::cerr << "zero-one-adam stopped at step " << at << " (a local step unless 64 divides "
            << at + 1 << ")\n";
}

INSTANTIATE_TEST_SUITE_P(AnyProcess, Sigterm,
                         ::testing::Values("worker 1", "server 0", "coordinator", "launcher"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           std::replace(n.begin(), n.end(), ' ', '_');
                           return n;
                         });

// kill -9 of a worker in the warm-up, of a server around the freeze step and
// of the coordinator in the compression phase, each under onebit-launch
// --max_restarts: the launcher starts the job again, it resumes from its
// last complete checkpoint, and ends bit for bit where the uninterrupted job
// ends; summary.json counts the restart and the steps run twice.
// The port in a launcher's log ("coordinator at 127.0.0.1:PORT").
std::string CoordinatorTarget(const std::string& log) {
  const size_t pos = log.find("coordinator at 127.0.0.1:");
  if (pos == std::string::npos) return "";
  return log.substr(pos + 15, log.find(' ', pos + 15) - pos - 15);
}

// The step of the last "checkpoint of step N complete" the coordinator
// logged; 0 when none.
uint64_t LastCompleteCheckpoint(const std::string& log) {
  uint64_t last = 0;
  const std::string tag = "checkpoint of step ";
  for (size_t at = log.find(tag); at != std::string::npos; at = log.find(tag, at + 1)) {
    const size_t begin = at + tag.size();
    const size_t end = log.find(' ', begin);
    uint64_t step = 0;
    if (end != std::string::npos && log.compare(end, 9, " complete") == 0 &&
        absl::SimpleAtoi(log.substr(begin, end - begin), &step)) {
      last = std::max(last, step);
    }
  }
  return last;
}

struct Kill {
  std::string victim;  // "worker 1", "server 0", "coordinator"
  size_t after_rows;   // killed once this many steps are in metrics.csv
};

// Kills `k.victim` of a job started by onebit-launch with `more` once
// k.after_rows rows are on disk; the launcher starts it again. Checks that
// the job ends bit for bit as `plain` (its run folder) did, with every row
// once, and returns the summary.
std::string KillAndCompare(const Case& c, const std::string& plain, const std::string& out,
                           const Kill& k, const std::vector<std::string>& more) {
  Subprocess job = Start(Launch(c, out, more), out + ".log");
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (Rows(out).size() < k.after_rows && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_GE(Rows(out).size(), k.after_rows) << ReadFile(out + ".log");
  const std::string target = CoordinatorTarget(ReadFile(out + ".log"));
  EXPECT_NE(target, "");
  const int pid = VictimPid(k.victim, target, out);
  // The newest checkpoint complete before the kill, from the log: a loaded
  // machine may run well past after_rows before the kill lands.
  const uint64_t complete_before = LastCompleteCheckpoint(ReadFile(out + ".log"));
  if (pid > 0) kill(pid, SIGKILL);
  auto code = job.Wait(absl::Seconds(90));
  EXPECT_TRUE(code.has_value()) << "hung: " << ReadFile(out + ".log");
  EXPECT_EQ(code.value_or(-1), 0) << ReadFile(out + ".log");
  const std::string summary = ReadFile(out + "/summary.json");
  const std::string want = ReadFile(plain + "/summary.json");
  EXPECT_EQ(Field(summary, "status"), "\"ok\"") << ReadFile(out + ".log");
  for (const char* key : {"final_loss", "freeze_step", "replicas_equal", "bytes_up"}) {
    EXPECT_EQ(Field(summary, key), Field(want, key)) << key;
  }
  uint64_t resumed = 0, rolled_back = 0;
  EXPECT_TRUE(absl::SimpleAtoi(Field(summary, "resumed_from_step"), &resumed)) << summary;
  EXPECT_TRUE(absl::SimpleAtoi(Field(summary, "rolled_back_steps"), &rolled_back));
  const uint64_t every = 200;
  EXPECT_EQ(resumed % every, 0u);
  EXPECT_GE(resumed + every, k.after_rows);  // not older than the kill's point...
  EXPECT_GE(resumed, complete_before);       // ...nor than one complete before it...
  EXPECT_LE(resumed, std::max<uint64_t>(complete_before, k.after_rows) + every);  // ...or one more
  // The steps after the checkpoint that were on disk were run again (a
  // kill may cut the last row short).
  EXPECT_GE(rolled_back, resumed + 1 < k.after_rows ? k.after_rows - resumed - 1 : 0);
  for (const char* f : {"/replica_w0.f32", "/replica_w1.f32", "/replica_w2.f32", "/master_s0.f32",
                        "/master_s1.f32", "/error_s0.f32", "/error_s1.f32"}) {
    EXPECT_EQ(FirstDifference(ReadFloats(out + f), ReadFloats(plain + f)), "") << f;
  }
  // Every step's row once, in order, with the uninterrupted run's loss.
  const std::vector<std::string> rows = Rows(out);
  const std::vector<std::string> plain_rows = Rows(plain);
  EXPECT_EQ(rows.size(), plain_rows.size());
  for (size_t i = 0; i < std::min(rows.size(), plain_rows.size()); ++i) {
    EXPECT_EQ(Column(rows[i], 0), absl::StrCat(i));
    EXPECT_EQ(Column(rows[i], 2), Column(plain_rows[i], 2)) << "loss of step " << i;
  }
  return summary;
}

// Live recovery: the killed process alone is started again, every other
// rolls back to the last complete checkpoint without restarting, and the
// job ends bit for bit as uninterrupted. Each role at each phase (the
// warm-up, just before the freeze step, the compression phase), and a
// second seed.
TEST(Recovery, AKilledProcessComesBackAndTheOthersRollBackBitForBit) {
  const std::string dir = TempDir("recovery");
  struct Seed {
    int seed;
    std::vector<Kill> kills;
  };
  const std::vector<Seed> seeds = {
      {1,
       {{"worker 1", 500},
        {"server 0", 500},
        {"coordinator", 500},
        {"worker 2", 1450},
        {"server 1", 1450},
        {"coordinator", 1450},
        {"worker 0", 2200},
        {"server 0", 2200},
        {"coordinator", 2200}}},
      {7, {{"server 1", 700}, {"coordinator", 1500}, {"worker 1", 2500}}},
  };
  for (const Seed& seed : seeds) {
    Case c;
    c.flags = Synthetic("onebit-adam", 2, 3000,
                        {"--freeze_step=1500", absl::StrCat("--seed=", seed.seed)});
    const std::string plain = absl::StrCat(dir, "/plain", seed.seed);
    RunResult r = RunCommand(Launch(c, plain, {"--dump_params"}), absl::Seconds(60));
    ASSERT_EQ(r.code, 0) << r.output;
    int n = 0;
    for (const Kill& k : seed.kills) {
      SCOPED_TRACE(absl::StrCat(k.victim, " after ", k.after_rows, " steps, seed ", seed.seed));
      const std::string out = absl::StrCat(dir, "/s", seed.seed, "-", n++);
      const std::string summary =
          KillAndCompare(c, plain, out, k,
                         {"--checkpoint_dir=" + out + "/ckpt", "--checkpoint_every=200",
                          "--max_restarts=2", "--dump_params"});
      const std::string log = ReadFile(out + ".log");
      EXPECT_THAT(log, HasSubstr("restart 1 of 2: starting it again")) << log;
      EXPECT_THAT(log, Not(HasSubstr("starting the whole job again")));
      // The others were not started again: they rolled back in place.
      for (const std::string other : {"worker 0", "worker 1", "worker 2", "server 0", "server 1"}) {
        if (other == k.victim) continue;
        EXPECT_THAT(log, HasSubstr(absl::StrCat(other, ": ",
                                                k.victim == "coordinator"
                                                    ? "the coordinator restarted"
                                                    : k.victim + " registered again")))
            << other;
      }
      EXPECT_EQ(Field(summary, "restarts"), "1");
      EXPECT_EQ(Field(summary, "rollbacks"), "1");
    }
  }
}

// The same over a sealed data plane (--data_cipher aes-gcm), whose
// passwords and keys are the incarnation's: a killed worker (new keys) and
// a killed server come back, the others roll back in place and connect
// again under the new incarnation's keys, and the job ends bit for bit.
TEST(Recovery, ASealedDataPlaneRollsBackBitForBit) {
  const std::string dir = TempDir("recovery_sealed");
  Case c;
  c.flags = Synthetic("onebit-adam", 2, 3000, {"--freeze_step=1500", "--data_cipher=aes-gcm"});
  const std::string plain = dir + "/plain";
  RunResult r = RunCommand(Launch(c, plain, {"--dump_params"}), absl::Seconds(60));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("data plane sealed with AES-256-GCM"));
  int n = 0;
  for (const Kill& k : {Kill{"worker 1", 500}, Kill{"server 0", 1450}}) {
    SCOPED_TRACE(absl::StrCat(k.victim, " after ", k.after_rows, " steps"));
    const std::string out = absl::StrCat(dir, "/k", n++);
    const std::string summary =
        KillAndCompare(c, plain, out, k,
                       {"--checkpoint_dir=" + out + "/ckpt", "--checkpoint_every=200",
                        "--max_restarts=2", "--dump_params"});
    const std::string log = ReadFile(out + ".log");
    EXPECT_THAT(log, HasSubstr("restart 1 of 2: starting it again")) << log;
    EXPECT_EQ(Field(summary, "rollbacks"), "1");
  }
}

// Without live recovery (--rejoin_timeout=0) the launcher starts the whole
// job again, which resumes from the checkpoint.
// zero-one-adam rolled back in place: a server killed after 500 steps comes
// back, and the others go back to the checkpoint of step 400 (or 600),
// between two syncs (each 64 steps by then, 447 and 511, or 639): the
// workers restore their local models and pull the master for step 400 from
// servers that skipped to 447.
TEST(Recovery, ZeroOneAdamRollsBackBetweenSyncsBitForBit) {
  const std::string dir = TempDir("recovery_zero_one");
  Case c;
  c.flags = Synthetic(
      "zero-one-adam", 2, 1200,
      {"--var_freeze_step=20", "--local_step_scaler=4", "--local_step_clipper=64", "--dim=400000"});
  RunResult r = RunCommand(Launch(c, dir + "/plain", {"--dump_params"}), absl::Seconds(120));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string out = dir + "/run";
  const std::string summary =
      KillAndCompare(c, dir + "/plain", out, {"server 0", 500},
                     {"--checkpoint_dir=" + out + "/ckpt", "--checkpoint_every=200",
                      "--max_restarts=2", "--dump_params"});
  EXPECT_EQ(Field(summary, "rollbacks"), "1");
  EXPECT_THAT(ReadFile(out + ".log"), HasSubstr("worker 1: server 0 registered again"));
}

// Streamed diloco rolled back in place: worker 1, killed after 500 steps,
// comes back and restores its own local model, inner AdamW state and error
// from its file of the checkpoint of step 400 (or 600), between two syncs of
// each fragment (every 64 steps: shard 0 at 447 and 511, or 639; shard 1,
// 32 steps earlier, at 415 and 479, or 607); the others roll back in place,
// each server to a state of its own shard's, and the job ends bit for bit
// as uninterrupted. (Error feedback both ways, not diloco's default none,
// so that both errors are restored too.) Overlapped (--sync_delay 20):
// shard 0's sync of step 383 is merged at 403, so the checkpoint of step 400
// is taken, and the job resumed, while it is due; every worker merges it at
// 403 as the uninterrupted job did.
class DilocoRecovery : public ::testing::TestWithParam<int> {};

TEST_P(DilocoRecovery, RollsBackBetweenSyncsBitForBit) {
  const std::string dir = TempDir(absl::StrCat("recovery_diloco_", GetParam()));
  Case c;
  c.flags = Synthetic(
      "diloco", 2, 1000,
      {"--sync_every=64", "--fragments=2", "--bias_correction", "--lr=0.001", "--dim=400000",
       "--error_feedback=both", absl::StrCat("--sync_delay=", GetParam())});
  RunResult r = RunCommand(Launch(c, dir + "/plain", {"--dump_params"}), absl::Seconds(120));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string out = dir + "/run";
  const std::string summary =
      KillAndCompare(c, dir + "/plain", out, {"worker 1", 500},
                     {"--checkpoint_dir=" + out + "/ckpt", "--checkpoint_every=200",
                      "--max_restarts=2", "--dump_params"});
  EXPECT_EQ(Field(summary, "rollbacks"), "1");
  // Shard 0 at k = 64, 128, ..., 960 and 1000; shard 1 at k = 32, 96, ..., 992.
  EXPECT_EQ(Field(summary, "rounds"), "32");
  EXPECT_THAT(ReadFile(out + ".log"), HasSubstr("server 0: worker 1 registered again"));
}

INSTANTIATE_TEST_SUITE_P(Diloco, DilocoRecovery, ::testing::Values(0, 20),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return absl::StrCat("sync_delay_", i.param);
                         });

TEST(Recovery, WithoutRejoinTheWholeJobStartsAgainAndResumes) {
  const std::string dir = TempDir("recovery_whole");
  Case c;
  c.flags = Synthetic("onebit-adam", 2, 3000, {"--freeze_step=1500"});
  RunResult r = RunCommand(Launch(c, dir + "/plain", {"--dump_params"}), absl::Seconds(60));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string out = dir + "/job";
  const std::string summary =
      KillAndCompare(c, dir + "/plain", out, {"worker 1", 1000},
                     {"--checkpoint_dir=" + out + "/ckpt", "--checkpoint_every=200",
                      "--rejoin_timeout=0", "--max_restarts=2", "--dump_params"});
  EXPECT_THAT(ReadFile(out + ".log"), HasSubstr("restart 1 of 2: starting the whole job again; it "
                                                "resumes from its last complete checkpoint"));
  EXPECT_EQ(Field(summary, "restarts"), "1");
  EXPECT_EQ(Field(summary, "rollbacks"), "0");
}

// rolled_back_steps counts the steps run again: those the furthest worker
// had completed beyond the checkpoint rolled back to. Worker 1 stalls at
// step 37 (every worker completes 37 steps, the others then wait in step
// 37 for its push), the checkpoint of step 30 is complete, and the victim
// is killed at once, well within a heartbeat (1 s) of the workers' last
// steps: 7 steps are run again, whatever the last heartbeat or metrics row
// said. The stalled worker, told to roll back, exits and is started again.
TEST(Recovery, RolledBackStepsAreExactlyTheStepsRunAgain) {
  const std::string dir = TempDir("rolled_back_steps");
  Case c;
  c.flags = {
      "--workers=3",      "--servers=2",     "--dim=6007",         "--steps=60",
      "--optimizer=adam", "--block_size=32", "--chunk_elems=1024", "--heartbeat_timeout=10s"};
  int n = 0;
  for (const std::string victim : {"worker 1", "server 0", "coordinator"}) {
    SCOPED_TRACE(victim);
    const std::string out = absl::StrCat(dir, "/run", n++);
    const std::string root = out + "/ckpt";
    Subprocess job = Start(Launch(c, out,
                                  {"--checkpoint_dir=" + root, "--checkpoint_every=10",
                                   "--max_restarts=3", "--stall_worker=1", "--stall_at_step=37"}),
                           out + ".log");
    ASSERT_TRUE(WaitForText(out + ".log", "stalling at step 37", absl::Seconds(30)))
        << ReadFile(out + ".log");
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!VerifyCheckpoint(StepDir(root, 30)).ok() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_TRUE(VerifyCheckpoint(StepDir(root, 30)).ok()) << ReadFile(out + ".log");
    const std::string target = CoordinatorTarget(ReadFile(out + ".log"));
    ASSERT_NE(target, "");
    const int pid = VictimPid(victim, target, out);
    ASSERT_GT(pid, 0);
    kill(pid, SIGKILL);
    auto code = job.Wait(absl::Seconds(90));
    ASSERT_TRUE(code.has_value()) << "hung: " << ReadFile(out + ".log");
    EXPECT_EQ(*code, 0) << ReadFile(out + ".log");
    const std::string summary = ReadFile(out + "/summary.json");
    EXPECT_EQ(Field(summary, "status"), "\"ok\"") << ReadFile(out + ".log");
    EXPECT_EQ(Field(summary, "resumed_from_step"), "30");
    EXPECT_EQ(Field(summary, "rolled_back_steps"), "7") << ReadFile(out + ".log");
    EXPECT_EQ(Field(summary, "restarts"), "1");
    EXPECT_EQ(Field(summary, "rollbacks"), "1");
    EXPECT_EQ(Rows(out).size(), 60u);
  }
}

// Another number of workers on resume (not bitwise: the data is split
// otherwise): every new worker starts with the mean of the old workers'
// errors and the momentum of old rank r mod N; the job goes on converging.
TEST(Resume, AnotherNumberOfWorkersGoesOnConverging) {
  const std::string dir = TempDir("resume_workers");
  const std::vector<std::string> job = {
      "--servers=2",       "--dim=6007",      "--steps=400",        "--optimizer=onebit-adam",
      "--freeze_step=100", "--block_size=32", "--chunk_elems=1024", "--heartbeat_timeout=3s"};
  auto launch = [&](uint32_t workers, const std::string& out, std::vector<std::string> more) {
    std::vector<std::string> argv = {Bin("onebit-launch"), absl::StrCat("--workers=", workers),
                                     "--out=" + out};
    argv.insert(argv.end(), job.begin(), job.end());
    argv.insert(argv.end(), more.begin(), more.end());
    return argv;
  };
  RunResult plain = RunCommand(launch(3, dir + "/plain", {}), absl::Seconds(60));
  ASSERT_EQ(plain.code, 0) << plain.output;
  double want = 0;
  ASSERT_TRUE(absl::SimpleAtod(Field(ReadFile(dir + "/plain/summary.json"), "final_loss"), &want));
  // A checkpoint after 200 steps, of 3 workers.
  Subprocess first = Start(launch(3, dir + "/first",
                                  {"--checkpoint_dir=" + dir + "/ck", "--checkpoint_every=200",
                                   "--stall_worker=1", "--stall_at_step=250"}),
                           dir + "/first.log");
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!VerifyCheckpoint(StepDir(dir + "/ck", 200)).ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(VerifyCheckpoint(StepDir(dir + "/ck", 200)).ok()) << ReadFile(dir + "/first.log");
  first.Stop(absl::Seconds(5));
  double at_checkpoint = 0;
  ASSERT_TRUE(absl::SimpleAtod(Column(Rows(dir + "/plain")[199], 2), &at_checkpoint));
  for (uint32_t workers : {2u, 4u}) {
    SCOPED_TRACE(workers);
    const std::string ck = absl::StrCat(dir, "/ck", workers);
    std::filesystem::copy(dir + "/ck", ck, std::filesystem::copy_options::recursive);
    const std::string out = absl::StrCat(dir, "/run", workers);
    RunResult r = RunCommand(launch(workers, out, {"--checkpoint_dir=" + ck}), absl::Seconds(60));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("resuming from the checkpoint of step 200"));
    const std::string summary = ReadFile(out + "/summary.json");
    EXPECT_EQ(Field(summary, "status"), "\"ok\"");
    EXPECT_EQ(Field(summary, "workers_agree"), "true");
    double final_loss = 0;
    ASSERT_TRUE(absl::SimpleAtod(Field(summary, "final_loss"), &final_loss));
    // Near where 3 workers end (the noise floor moves with N), and not
    // drifting up from the checkpoint's loss.
    EXPECT_LT(final_loss, 2.0 * want);
    EXPECT_GT(final_loss, 0.5 * want);
    EXPECT_LT(final_loss, 2.0 * at_checkpoint);
  }
}

// Kubernetes' view: each binary started on its own, as a pod is. After a
// SIGTERM every process exits with --exit_code_when_stopped (75), so that a
// Job with restartPolicy OnFailure starts it again; started again, the
// same processes resume the job and it ends bit for bit.
// A job started process by process, as pods are: a coordinator with `job`
// and `coordinator_flags`, one server and `workers` workers with
// `process_flags`, each dumping its final x into `dir`.
struct Pods {
  std::string target;             // "--coordinator=127.0.0.1:PORT"
  std::vector<Subprocess> procs;  // the coordinator, server 0, workers 0...
};

std::vector<std::string> WorkerPod(const std::string& target, int w, const std::string& dir,
                                   const std::vector<std::string>& process_flags) {
  std::vector<std::string> argv = {Bin("onebit-worker"),
                                   SecretFlag(),
                                   target,
                                   absl::StrCat("--rank=", w),
                                   "--bind_host=127.0.0.1",
                                   "--advertise_host=127.0.0.1",
                                   "--device=cpu",
                                   absl::StrCat("--dump_x=", dir, "/replica_w", w, ".f32")};
  argv.insert(argv.end(), process_flags.begin(), process_flags.end());
  return argv;
}

Pods StartPods(const std::string& dir, const std::string& name, const std::vector<std::string>& job,
               const std::vector<std::string>& coordinator_flags,
               const std::vector<std::string>& process_flags, int workers) {
  Pods pods;
  const std::string port_file = dir + "/" + name + ".port";
  std::vector<std::string> coord = {Bin("onebit-coordinator"), SecretFlag(), "--port=0",
                                    "--port_file=" + port_file, "--bind_host=127.0.0.1"};
  coord.insert(coord.end(), job.begin(), job.end());
  coord.insert(coord.end(), coordinator_flags.begin(), coordinator_flags.end());
  pods.procs.push_back(Start(coord, dir + "/" + name + ".coordinator.log"));
  int port = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (port == 0 && absl::Now() < deadline) {
    std::ifstream in(port_file);
    if (!(in >> port)) port = 0;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_GT(port, 0);
  pods.target = absl::StrCat("--coordinator=127.0.0.1:", port);
  std::vector<std::string> server = {Bin("onebit-server"),
                                     SecretFlag(),
                                     pods.target,
                                     "--shard=0",
                                     "--bind_host=127.0.0.1",
                                     "--advertise_host=127.0.0.1",
                                     "--dump_x=" + dir + "/master.f32"};
  server.insert(server.end(), process_flags.begin(), process_flags.end());
  pods.procs.push_back(Start(server, dir + "/" + name + ".server.log"));
  for (int w = 0; w < workers; ++w) {
    pods.procs.push_back(Start(WorkerPod(pods.target, w, dir, process_flags),
                               absl::StrCat(dir, "/", name, ".worker", w, ".log")));
  }
  return pods;
}

// Waits for every process; their exit codes (-1: still running after 60 s).
std::vector<int> WaitForAll(Pods& pods) {
  std::vector<int> codes;
  for (Subprocess& p : pods.procs) codes.push_back(p.Wait(absl::Seconds(60)).value_or(-1));
  return codes;
}

void WaitForRows(const std::string& out, size_t n) {
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (Rows(out).size() < n && absl::Now() < until) absl::SleepFor(absl::Milliseconds(2));
  EXPECT_GE(Rows(out).size(), n);
}

// The jobs of the pod tests: 2 workers, 1 server, d = 6007, 3000 steps of
// onebit-adam, and `more`.
std::vector<std::string> PodJob(const std::vector<std::string>& more) {
  std::vector<std::string> job = {"--workers=2",
                                  "--servers=1",
                                  "--dim=6007",
                                  "--steps=3000",
                                  "--optimizer=onebit-adam",
                                  "--block_size=32",
                                  "--chunk_elems=1024"};
  job.insert(job.end(), more.begin(), more.end());
  return job;
}

TEST(Preemption, PodsStartedAgainResumeTheJob) {
  const std::string dir = TempDir("sigterm_pods");
  const std::vector<std::string> job = PodJob({"--freeze_step=40", "--heartbeat_timeout=3s"});
  Case c;
  c.flags = job;
  RunResult plain = RunCommand(Launch(c, dir + "/plain", {"--dump_params"}), absl::Seconds(60));
  ASSERT_EQ(plain.code, 0) << plain.output;
  const std::vector<std::string> coordinator = {
      "--out=" + dir + "/run", "--checkpoint_dir=" + dir + "/ckpt", "--exit_code_when_stopped=75"};
  Pods first = StartPods(dir, "first", job, coordinator, {"--exit_code_when_stopped=75"}, 2);
  // Early in the run (the progress line comes only after a second).
  WaitForRows(dir + "/run", 50);
  kill(first.procs[3].pid(), SIGTERM);
  EXPECT_THAT(WaitForAll(first), ::testing::Each(75));
  const std::string stopped = ReadFile(dir + "/run/summary.json");
  EXPECT_THAT(Field(stopped, "status"), HasSubstr("stopped: SIGTERM to worker 1"));
  Pods again = StartPods(dir, "again", job, coordinator, {"--exit_code_when_stopped=75"}, 2);
  EXPECT_THAT(WaitForAll(again), ::testing::Each(0));
  const std::string summary = ReadFile(dir + "/run/summary.json");
  EXPECT_EQ(Field(summary, "status"), "\"ok\"");
  EXPECT_EQ(Field(summary, "resumed_from_step"), Field(stopped, "stopped_at_step"));
  EXPECT_EQ(Field(summary, "restarts"), "1");
  for (const char* f : {"/replica_w0.f32", "/replica_w1.f32"}) {
    EXPECT_EQ(FirstDifference(ReadFloats(dir + f), ReadFloats(dir + "/plain" + f)), "") << f;
  }
  EXPECT_EQ(
      FirstDifference(ReadFloats(dir + "/master.f32"), ReadFloats(dir + "/plain/master_s0.f32")),
      "");
}

// Processes started by hand: a worker killed and not started again is
// missed after the heartbeat timeout, the others roll back and wait for it
// up to --rejoin_timeout, then the job fails naming it; started again by
// hand in time, it rejoins and the job ends bit for bit. A lost
// coordinator is waited for as long, then named.
TEST(Recovery, ALostProcessIsWaitedForBoundedAndRejoinsWhenStartedAgain) {
  const std::string dir = TempDir("recovery_pods");
  const std::vector<std::string> job =
      PodJob({"--freeze_step=1000", "--heartbeat_timeout=1s", "--rejoin_timeout=4s"});
  Case c;
  c.flags = job;
  RunResult plain = RunCommand(Launch(c, dir + "/plain", {"--dump_params"}), absl::Seconds(60));
  ASSERT_EQ(plain.code, 0) << plain.output;
  auto coordinator = [&](const std::string& name) {
    return std::vector<std::string>{"--out=" + dir + "/" + name,
                                    "--checkpoint_dir=" + dir + "/" + name + "-ckpt",
                                    "--checkpoint_every=200"};
  };
  {
    SCOPED_TRACE("not started again");
    Pods pods = StartPods(dir, "lost", job, coordinator("lost"), {}, 2);
    WaitForRows(dir + "/lost", 500);
    kill(pods.procs[3].pid(), SIGKILL);
    const absl::Time killed = absl::Now();
    std::vector<int> codes = WaitForAll(pods);
    EXPECT_LT(absl::Now() - killed, absl::Seconds(20));
    EXPECT_NE(codes[0], 0);
    const std::string summary = ReadFile(dir + "/lost/summary.json");
    // ("worker 1 (<its host>) sent no heartbeat ..."; whether its server's
    // news of it outlasted its own last heartbeat is a matter of timing.)
    const std::string lost =
        absl::StrCat("worker 1 \\(", Hostname(),
                     "\\) sent no heartbeat(, nor did its servers hear from it,)? for 1s");
    EXPECT_THAT(Field(summary, "status"),
                ::testing::AllOf(ContainsRegex(lost),
                                 HasSubstr("but worker 1 did not register again within 4s")))
        << summary;
    // The verdict names what the probe found: the killed pod's health
    // endpoint refused the connection.
    EXPECT_THAT(ReadFile(dir + "/lost.worker0.log"),
                ContainsRegex(absl::StrCat("worker 0: ", lost,
                                           ", and its health endpoint [^ ]+ refused a connection "
                                           "\\(gone\\): presumed dead; rolling back to the "
                                           "checkpoint of step")));
    // Every row on disk before the kill is still there.
    EXPECT_GE(Rows(dir + "/lost").size(), 500u);
  }
  {
    SCOPED_TRACE("started again by hand");
    Pods pods = StartPods(dir, "back", job, coordinator("back"), {}, 2);
    WaitForRows(dir + "/back", 500);
    kill(pods.procs[3].pid(), SIGKILL);
    pods.procs[3].Wait(absl::Seconds(5));
    absl::SleepFor(absl::Seconds(2));  // missed by its heartbeat first
    pods.procs.push_back(
        Start(WorkerPod(pods.target, 1, dir, {}), dir + "/back.worker1-again.log"));
    pods.procs.erase(pods.procs.begin() + 3);
    EXPECT_THAT(WaitForAll(pods), ::testing::Each(0));
    const std::string summary = ReadFile(dir + "/back/summary.json");
    EXPECT_EQ(Field(summary, "status"), "\"ok\"") << summary;
    EXPECT_EQ(Field(summary, "rollbacks"), "1");
    EXPECT_EQ(Field(summary, "final_loss"),
              Field(ReadFile(dir + "/plain/summary.json"), "final_loss"));
    for (const char* f : {"/replica_w0.f32", "/replica_w1.f32"}) {
      EXPECT_EQ(FirstDifference(ReadFloats(dir + f), ReadFloats(dir + "/plain" + f)), "") << f;
    }
    EXPECT_EQ(
        FirstDifference(ReadFloats(dir + "/master.f32"), ReadFloats(dir + "/plain/master_s0.f32")),
        "");
  }
  {
    SCOPED_TRACE("the coordinator lost");
    Pods pods = StartPods(dir, "nocoord", job, coordinator("nocoord"), {}, 2);
    WaitForRows(dir + "/nocoord", 500);
    kill(pods.procs[0].pid(), SIGKILL);
    std::vector<int> codes = WaitForAll(pods);
    for (size_t i = 1; i < codes.size(); ++i) EXPECT_NE(codes[i], 0) << i;
    const std::string log = ReadFile(dir + "/nocoord.worker0.log");
    EXPECT_THAT(log, HasSubstr("worker 0: lost the coordinator at 127.0.0.1:"));
    EXPECT_THAT(log, HasSubstr("waiting up to 4s for it to come back"));
    EXPECT_THAT(log, HasSubstr("is unreachable (no heartbeat for 4s)"));
  }
}

// A finished job's checkpoints, then damaged as a disk or a user might: each
// kind is refused naming the file, and the job resumes from the one before.
TEST(Resume, ACorruptCheckpointIsRefusedNamingTheFileAndThePreviousOneIsUsed) {
  const std::string dir = TempDir("resume_corrupt");
  const std::vector<std::string> job = {
      Bin("onebit-launch"),   "--workers=2",         "--servers=2",
      "--dim=3001",           "--steps=9",           "--optimizer=onebit-adam",
      "--freeze_step=2",      "--block_size=32",     "--chunk_elems=512",
      "--checkpoint_every=3", "--checkpoint_keep=3", "--dump_params"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> argv = job;
    argv.insert(argv.end(), more.begin(), more.end());
    return argv;
  };
  RunResult plain = RunCommand(with({"--out=" + dir + "/plain", "--checkpoint_dir=" + dir + "/ck"}),
                               absl::Seconds(60));
  ASSERT_EQ(plain.code, 0) << plain.output;
  // Another job's file: the same job under another seed.
  RunResult other = RunCommand(
      with({"--out=" + dir + "/other", "--checkpoint_dir=" + dir + "/other_ck", "--seed=99"}),
      absl::Seconds(60));
  ASSERT_EQ(other.code, 0) << other.output;

  struct Damage {
    std::string name, file;
    std::function<void(const std::string& path)> apply;
    std::string says;
  };
  const std::vector<Damage> damages = {
      {"flipped", "server-0.state",
       [](const std::string& p) {
         std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(300);
         char c = 0;
         f.seekg(300);
         f.get(c);
         f.seekp(300);
         f.put(static_cast<char>(c ^ 0x10));
       },
       "does not match its checksum"},
      {"truncated", "worker-1.state",
       [](const std::string& p) {
         std::filesystem::resize_file(p, std::filesystem::file_size(p) / 2);
       },
       "(truncated?)"},
      {"missing", "worker-0.state", [](const std::string& p) { std::filesystem::remove(p); },
       "is missing"},
      {"another_jobs", "server-1.state",
       [&](const std::string& p) {
         std::filesystem::copy_file(StepDir(dir + "/other_ck", 9) + "/server-1.state", p,
                                    std::filesystem::copy_options::overwrite_existing);
       },
       "does not match its checksum"},
  };
  for (const Damage& d : damages) {
    SCOPED_TRACE(d.name);
    const std::string ck = dir + "/ck_" + d.name;
    std::filesystem::copy(dir + "/ck", ck, std::filesystem::copy_options::recursive);
    const std::string path = StepDir(ck, 9) + "/" + d.file;
    d.apply(path);
    RunResult r =
        RunCommand(with({"--out=" + dir + "/run_" + d.name, "--checkpoint_dir=" + ck, "--resume"}),
                   absl::Seconds(60));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_THAT(r.output,
                HasSubstr(absl::StrCat("not resuming from ", StepDir(ck, 9), ": ", path)));
    EXPECT_THAT(r.output, HasSubstr(d.says));
    EXPECT_THAT(r.output, HasSubstr("resuming from the checkpoint of step 6 in "));
    for (const char* f :
         {"/replica_w0.f32", "/replica_w1.f32", "/master_s0.f32", "/error_s1.f32"}) {
      EXPECT_EQ(
          FirstDifference(ReadFloats(dir + "/run_" + d.name + f), ReadFloats(dir + "/plain" + f)),
          "")
          << f;
    }
    // The checkpoint of step 9 is whole again.
    EXPECT_TRUE(VerifyCheckpoint(StepDir(ck, 9)).ok());
  }
}

// A checkpoint resumes only into the config that wrote it; --resume insists
// on one.
TEST(Resume, AnotherConfigOrNoCheckpointIsAClearError) {
  const std::string dir = TempDir("resume_config");
  const std::vector<std::string> job = {Bin("onebit-launch"),
                                        "--workers=1",
                                        "--servers=1",
                                        "--dim=500",
                                        "--steps=4",
                                        "--block_size=32",
                                        "--chunk_elems=256",
                                        "--checkpoint_every=2",
                                        "--checkpoint_dir=" + dir + "/ck"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> argv = job;
    argv.insert(argv.end(), more.begin(), more.end());
    return argv;
  };
  RunResult none = RunCommand(with({"--out=" + dir + "/none", "--resume"}), absl::Seconds(30));
  EXPECT_NE(none.code, 0);
  EXPECT_THAT(none.output, HasSubstr("--resume: no complete checkpoint under " + dir + "/ck"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/ck/step-000000000002"));

  RunResult first = RunCommand(with({"--out=" + dir + "/first", "--lr=0.02"}), absl::Seconds(30));
  ASSERT_EQ(first.code, 0) << first.output;
  RunResult other =
      RunCommand(with({"--out=" + dir + "/other", "--lr=0.03", "--seed=5"}), absl::Seconds(30));
  EXPECT_NE(other.code, 0);
  EXPECT_THAT(other.output,
              HasSubstr("cannot resume from " + StepDir(dir + "/ck", 4) +
                        ": it was written by a job with another config: --seed: 5 (here) vs 1 "
                        "(there); --lr: 0.03 (here) vs 0.02 (there)"));
  // Where checkpoints go and how often may change.
  RunResult same = RunCommand(
      with({"--out=" + dir + "/same", "--lr=0.02", "--checkpoint_every=1", "--step_timeout=20s"}),
      absl::Seconds(30));
  EXPECT_EQ(same.code, 0) << same.output;
  EXPECT_THAT(same.output, HasSubstr("resuming from the checkpoint of step 4"));
}

}  // namespace
}  // namespace onebit::testing
