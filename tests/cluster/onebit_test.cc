// 1-bit Adam on real clusters (onebit-launch on loopback): every optimizer ×
// worker codec × server codec × error feedback × server reply ends with every
// worker and every server equal to the single-process reference, bit for bit;
// the delta reply, the bytes of the compression phase, the automatic freeze,
// and the config checks.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cuda/device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "job/config.h"
#include "optim/optimizer.h"
#include "shard/shard_map.h"
#include "tests/cluster/test_util.h"

namespace onebit::testing {
namespace {

using ::testing::HasSubstr;

double NumberField(const std::string& summary, const std::string& key) {
  double v = NAN;
  EXPECT_TRUE(absl::SimpleAtod(Field(summary, key), &v)) << key << ": " << Field(summary, key);
  return v;
}

// Runs the job through onebit-launch with --dump_params; returns the run folder.
std::string Launch(const control::TrainingConfig& cfg, const std::string& name,
                   const std::string& worker_devices = "") {
  const std::string out = TempDir(name);
  std::vector<std::string> argv = {Bin("onebit-launch"), "--out=" + out, "--dump_params"};
  if (!worker_devices.empty()) argv.push_back("--worker_devices=" + worker_devices);
  for (const std::string& a : ConfigArgs(cfg)) argv.push_back(a);
  RunResult r = RunCommand(argv, absl::Seconds(120));
  EXPECT_EQ(r.code, 0) << absl::StrJoin(argv, " ") << "\n" << r.output;
  return out;
}

struct Combo {
  std::string optimizer, worker_codec, server_codec, error_feedback, server_reply;
};

// What gtest and ctest print for a case.
void PrintTo(const Combo& c, std::ostream* os) {
  *os << c.optimizer << " " << c.worker_codec << "/" << c.server_codec << " ef=" << c.error_feedback
      << " reply=" << c.server_reply;
}

std::vector<Combo> AllCombos() {
  std::vector<Combo> out;
  for (const char* opt : {"sgd", "adam", "onebit-adam", "naive-onebit-adam", "ef-sgd"}) {
    for (const char* wc : {"fp32", "fp16", "onebit"}) {
      for (const char* sc : {"fp32", "fp16", "onebit"}) {
        for (const char* ef : {"both", "worker", "server", "none"}) {
          for (const char* reply : {"momentum", "delta"}) {
            const OptimizerKind kind = *ParseOptimizerKind(opt);
            // Without a compression phase, feedback and reply mean nothing.
            if (!HasCompressionPhase(kind) &&
                (std::string(ef) != "both" || std::string(reply) != "momentum")) {
              continue;
            }
            OptimizerOptions o;
            o.kind = kind;
            o.worker_codec = wc;
            o.server_codec = sc;
            o.reply = *ParseReplyMode(reply);
            if (!ValidateOptimizerOptions(o).ok()) continue;
            out.push_back(Combo{opt, wc, sc, ef, reply});
          }
        }
      }
    }
  }
  return out;
}

control::TrainingConfig ComboConfig(const Combo& c) {
  // 3 workers, 2 servers, d = 1000 = 31.25 blocks of 32, chunks of 256: ragged
  // blocks, shards and chunks; the warm-up ends in the middle of the run.
  control::TrainingConfig cfg = MakeConfig(3, 2, 1000, 6, c.optimizer);
  cfg.mutable_optimizer()->set_lr(0.05f);
  cfg.mutable_optimizer()->set_weight_decay(0.01f);
  testing::SetSetting(&cfg, "worker_codec", c.worker_codec);
  testing::SetSetting(&cfg, "server_codec", c.server_codec);
  testing::SetSetting(&cfg, "error_feedback", c.error_feedback);
  testing::SetSetting(&cfg, "server_reply", c.server_reply);
  const OptimizerKind kind = *ParseOptimizerKind(c.optimizer);
  if (HasWarmup(kind) && HasCompressionPhase(kind)) cfg.mutable_optimizer()->set_freeze_step(3);
  // Quick heartbeats: these jobs take milliseconds; shutdown waits for one.
  cfg.mutable_timeouts()->set_heartbeat_ms(3000);
  return cfg;
}

// Every worker's replica, every master and every server error of the run in
// `out` (--dump_params) equal the reference's, bit for bit.
void ExpectEqualsReference(const std::string& out, const control::TrainingConfig& cfg,
                           const ReferenceResult& ref) {
  ASSERT_EQ(ref.workers.size(), cfg.cluster().workers());
  for (uint32_t w = 0; w < cfg.cluster().workers(); ++w) {
    EXPECT_EQ(
        FirstDifference(ReadFloats(absl::StrCat(out, "/replica_w", w, ".f32")), ref.workers[w]), "")
        << "worker " << w;
  }
  auto map = *ShardMapForConfig(cfg, *ModelLayerEnds(cfg));
  for (uint32_t s = 0; s < cfg.cluster().servers(); ++s) {
    const uint64_t begin = map.shard(s).begin;
    EXPECT_EQ(FirstDifference(ReadFloats(absl::StrCat(out, "/master_s", s, ".f32")),
                              ref.masters[s].x, begin),
              "")
        << "server " << s;
    EXPECT_EQ(FirstDifference(ReadFloats(absl::StrCat(out, "/error_s", s, ".f32")),
                              ref.masters[s].e, begin),
              "")
        << "server error " << s;
  }
}

class MatrixTest : public ::testing::TestWithParam<Combo> {};

// Worker 0 runs the GPU worker's code on the CPU twins of its kernels,
// worker 1 the CPU worker, worker 2 a GPU where one is usable (else the CPU):
// a mixed cluster, and with a GPU the whole matrix on it.
constexpr char kMixedDevices[] = "cuda-twin,cpu,auto";

// With ONEBIT_REQUIRE_GPU set (tools/gpu-check), no GPU is a failure.
bool GpuUsable() {
  static const bool usable = [] {
    std::string why;
    const bool have = cuda::DeviceCount(&why) > 0;
    if (!have && std::getenv("ONEBIT_REQUIRE_GPU") != nullptr) {
      ADD_FAILURE() << "ONEBIT_REQUIRE_GPU is set but no CUDA device is usable: " << why;
    }
    return have;
  }();
  return usable;
}

TEST_P(MatrixTest, EveryWorkerAndServerEqualsTheReference) {
  const Combo& c = GetParam();
  const control::TrainingConfig cfg = ComboConfig(c);
  const std::string out = Launch(cfg, "matrix", kMixedDevices);
  const ReferenceResult ref = Reference(cfg);
  ASSERT_EQ(ref.workers.size(), 3u);
  ExpectEqualsReference(out, cfg, ref);
  auto map = *ShardMapForConfig(cfg, *ModelLayerEnds(cfg));
  bool masters_equal_replicas = true;
  for (uint32_t s = 0; s < 2; ++s) {
    const uint64_t begin = map.shard(s).begin;
    for (size_t i = 0; i < ref.masters[s].x.size(); ++i) {
      masters_equal_replicas &= ref.masters[s].x[i] == ref.workers[0][begin + i];
    }
  }
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "replicas_equal"), masters_equal_replicas ? "true" : "false") << summary;
  EXPECT_EQ(Field(summary, "workers_agree"), "true") << summary;
  EXPECT_THAT(summary, HasSubstr(absl::StrCat("\"worker_devices\": [\"cuda-twin\", \"cpu\", \"",
                                              GpuUsable() ? "cuda:0" : "cpu", "\"]")));
  const OptimizerKind kind = *ParseOptimizerKind(c.optimizer);
  const std::string freeze = !HasCompressionPhase(kind) ? "null" : HasWarmup(kind) ? "3" : "0";
  EXPECT_EQ(Field(summary, "freeze_step"), freeze) << summary;
  // An optimizer that never compresses never freezes.
  EXPECT_EQ(Field(summary, "freeze") == "\"none\"", !HasCompressionPhase(kind)) << summary;
  EXPECT_EQ(Field(summary, "diverged"), "false");
  EXPECT_EQ(ref.freeze_step, !HasCompressionPhase(kind) ? kNever : HasWarmup(kind) ? 3u : 0u);
  // The phase column follows the freeze.
  std::vector<std::string> lines =
      absl::StrSplit(ReadFile(out + "/metrics.csv"), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 7u);
  for (uint64_t t = 0; t < 6; ++t) {
    const bool compress = HasCompressionPhase(kind) && (!HasWarmup(kind) || t >= 3);
    EXPECT_EQ(std::vector<std::string>(absl::StrSplit(lines[t + 1], ','))[1],
              compress ? "compress" : "warmup")
        << "step " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(AllCombinations, MatrixTest, ::testing::ValuesIn(AllCombos()),
                         [](const ::testing::TestParamInfo<Combo>& info) {
                           std::string name = absl::StrCat(
                               info.param.optimizer, "_", info.param.worker_codec, "_",
                               info.param.server_codec, "_ef_", info.param.error_feedback, "_",
                               info.param.server_reply);
                           for (char& ch : name) ch = ch == '-' ? '_' : ch;
                           return name;
                         });

// The run in `out` has one metrics.csv row per step of `steps`: those in
// `sending` sent bytes, the others (local steps) none; the phase column
// says warmup before step `freeze`, compress from it.
void ExpectStepsSend(const std::string& out, uint64_t steps, const std::set<uint64_t>& sending,
                     uint64_t freeze) {
  std::vector<std::string> lines =
      absl::StrSplit(ReadFile(out + "/metrics.csv"), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), steps + 1);
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  const size_t up = std::find(header.begin(), header.end(), "bytes_up") - header.begin();
  ASSERT_LT(up, header.size()) << lines[0];
  for (uint64_t t = 0; t < steps; ++t) {
    const std::vector<std::string> row = absl::StrSplit(lines[t + 1], ',');
    EXPECT_EQ(row[up] != "0", sending.count(t) > 0) << "step " << t << ": " << lines[t + 1];
    EXPECT_EQ(row[1], t >= freeze ? "compress" : "warmup") << "step " << t;
  }
}

// zero-one-adam on a mixed cluster (kMixedDevices). 13 steps of 3 workers
// and 2 servers: k = 1, 2, 4 refresh v, k = 3 compresses gradients; after
// the freeze at k = 4, k = 5, 6, 8 and 12 synchronise, 7, 9, 10 and 11 are
// local steps, and 13, the last, synchronises.
struct ZeroOneCombo {
  std::string worker_codec, server_codec, error_feedback;
};
void PrintTo(const ZeroOneCombo& c, std::ostream* os) {
  *os << "zero-one-adam " << c.worker_codec << "/" << c.server_codec << " ef=" << c.error_feedback;
}

// Every push codec x reply codec x error feedback (its reply is always the
// momentum).
std::vector<ZeroOneCombo> AllZeroOneCombos() {
  std::vector<ZeroOneCombo> out;
  for (const char* wc : {"fp32", "fp16", "onebit"}) {
    for (const char* sc : {"fp32", "fp16", "onebit"}) {
      for (const char* ef : {"both", "worker", "server", "none"}) out.push_back({wc, sc, ef});
    }
  }
  return out;
}

class ZeroOneTest : public ::testing::TestWithParam<ZeroOneCombo> {};

TEST_P(ZeroOneTest, EveryWorkerAndServerEqualsTheReference) {
  const ZeroOneCombo& c = GetParam();
  control::TrainingConfig cfg = MakeConfig(3, 2, 1000, 13, "zero-one-adam");
  cfg.mutable_optimizer()->set_lr(0.05f);
  cfg.mutable_optimizer()->set_weight_decay(0.01f);
  testing::SetSetting(&cfg, "worker_codec", c.worker_codec);
  testing::SetSetting(&cfg, "server_codec", c.server_codec);
  testing::SetSetting(&cfg, "error_feedback", c.error_feedback);
  cfg.mutable_optimizer()->set_var_freeze_step(4);
  cfg.mutable_optimizer()->set_var_update_scaler(1);
  cfg.mutable_optimizer()->set_local_step_scaler(2);
  cfg.mutable_optimizer()->set_local_step_clipper(4);
  cfg.mutable_timeouts()->set_heartbeat_ms(3000);
  const std::string out = Launch(cfg, "zero_one", kMixedDevices);
  ExpectEqualsReference(out, cfg, Reference(cfg));
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "replicas_equal"), "true") << summary;
  EXPECT_EQ(Field(summary, "workers_agree"), "true") << summary;
  EXPECT_EQ(Field(summary, "rounds"), "9") << summary;
  EXPECT_EQ(Field(summary, "freeze_step"), "4") << summary;
  EXPECT_EQ(Field(summary, "freeze"), "\"var_freeze_step:4\"") << summary;
  ExpectStepsSend(out, 13, {0, 1, 2, 3, 4, 5, 7, 11, 12}, 4);
}

INSTANTIATE_TEST_SUITE_P(Combinations, ZeroOneTest, ::testing::ValuesIn(AllZeroOneCombos()),
                         [](const ::testing::TestParamInfo<ZeroOneCombo>& info) {
                           return absl::StrCat(info.param.worker_codec, "_",
                                               info.param.server_codec, "_ef_",
                                               info.param.error_feedback);
                         });

// diloco on a mixed cluster (kMixedDevices), every push codec x reply codec
// x error feedback: 11 steps of 3 workers and 2 servers with H = 3, so k =
// 3, 6 and 9 synchronise after their inner step, k = 11 (the job's last)
// too, and the other seven are inner AdamW steps alone (bias-corrected,
// with weight decay).
struct DilocoCombo : ZeroOneCombo {};
void PrintTo(const DilocoCombo& c, std::ostream* os) {
  *os << "diloco " << c.worker_codec << "/" << c.server_codec << " ef=" << c.error_feedback;
}
std::vector<DilocoCombo> AllDilocoCombos() {
  std::vector<DilocoCombo> out;
  for (const ZeroOneCombo& c : AllZeroOneCombos()) out.push_back(DilocoCombo{c});
  return out;
}

class DilocoTest : public ::testing::TestWithParam<DilocoCombo> {};

// diloco's matrix jobs: 3 workers, d = 1000, bias-corrected inner AdamW
// with weight decay, DiLoCo's outer step, the combination's codecs and
// error feedback.
control::TrainingConfig DilocoMatrixConfig(uint32_t servers, uint64_t steps, uint32_t H,
                                           const ZeroOneCombo& c) {
  control::TrainingConfig cfg = MakeConfig(3, servers, 1000, steps, "diloco");
  cfg.mutable_optimizer()->set_lr(0.02f);
  cfg.mutable_optimizer()->set_weight_decay(0.01f);
  cfg.mutable_optimizer()->set_bias_correction(true);
  cfg.mutable_optimizer()->set_sync_every(H);
  cfg.mutable_optimizer()->set_outer_lr(0.7f);
  cfg.mutable_optimizer()->set_outer_momentum(0.9f);
  testing::SetSetting(&cfg, "worker_codec", c.worker_codec);
  testing::SetSetting(&cfg, "server_codec", c.server_codec);
  testing::SetSetting(&cfg, "error_feedback", c.error_feedback);
  cfg.mutable_timeouts()->set_heartbeat_ms(3000);
  return cfg;
}

TEST_P(DilocoTest, EveryWorkerAndServerEqualsTheReference) {
  const control::TrainingConfig cfg = DilocoMatrixConfig(2, 11, 3, GetParam());
  const std::string out = Launch(cfg, "diloco", kMixedDevices);
  const ReferenceResult ref = Reference(cfg);
  ExpectEqualsReference(out, cfg, ref);
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "status"), "\"ok\"") << summary;
  EXPECT_EQ(Field(summary, "replicas_equal"), "true") << summary;
  EXPECT_EQ(Field(summary, "workers_agree"), "true") << summary;
  EXPECT_EQ(Field(summary, "rounds"), "4") << summary;
  EXPECT_EQ(Field(summary, "freeze_step"), "0") << summary;
  ExpectStepsSend(out, 11, {2, 5, 8, 10}, 0);
}

INSTANTIATE_TEST_SUITE_P(Combinations, DilocoTest, ::testing::ValuesIn(AllDilocoCombos()),
                         [](const ::testing::TestParamInfo<DilocoCombo>& info) {
                           return absl::StrCat(info.param.worker_codec, "_",
                                               info.param.server_codec, "_ef_",
                                               info.param.error_feedback);
                         });

// Streaming diloco (--fragments F) on the mixed cluster: 3 workers, 3
// servers, H = 4, 14 steps. F = 3: shard k is fragment k, at offsets 0, 1,
// 2 (4 k / 3), so shard 0 syncs at t = 3, 7, 11, shard 1 at 2, 6, 10,
// shard 2 at 1, 5, 9, and all at 13, the last: 10 steps send. F = 2:
// shards 0 and 1 are fragment 0 (k F / S), shard 2 fragment 1 (offset 2):
// t = 3, 7, 11 and 1, 5, 9, and 13: 7 steps send. F = 1: t = 3, 7, 11 and
// 13. Every replica, master and error equals the reference's bit for bit.
// Overlapped (--sync_delay tau): a sync's replies are received tau steps
// later (by step 12, the second-to-last), when the workers merge them; the
// last step's at once.
struct FragmentCombo {
  ZeroOneCombo codecs;
  uint32_t fragments;
  uint32_t delay = 0;
};
void PrintTo(const FragmentCombo& c, std::ostream* os) {
  *os << "diloco F=" << c.fragments << " " << c.codecs.worker_codec << "/" << c.codecs.server_codec
      << " ef=" << c.codecs.error_feedback << " tau=" << c.delay;
}

// The steps whose metrics.csv row has bytes_down != 0.
std::set<uint64_t> StepsReceiving(const std::string& out) {
  std::vector<std::string> lines =
      absl::StrSplit(ReadFile(out + "/metrics.csv"), '\n', absl::SkipEmpty());
  std::set<uint64_t> steps;
  if (lines.empty()) return steps;
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  const size_t down = std::find(header.begin(), header.end(), "bytes_down") - header.begin();
  EXPECT_LT(down, header.size()) << lines[0];
  for (size_t i = 1; i < lines.size() && down < header.size(); ++i) {
    const std::vector<std::string> row = absl::StrSplit(lines[i], ',');
    if (row[down] != "0") steps.insert(i - 1);
  }
  return steps;
}
class DilocoFragmentsTest : public ::testing::TestWithParam<FragmentCombo> {};

TEST_P(DilocoFragmentsTest, EveryWorkerAndServerEqualsTheReference) {
  const FragmentCombo& c = GetParam();
  control::TrainingConfig cfg = DilocoMatrixConfig(3, 14, 4, c.codecs);
  cfg.mutable_optimizer()->set_fragments(c.fragments);
  cfg.mutable_optimizer()->set_sync_delay(c.delay);
  const std::string out =
      Launch(cfg, absl::StrCat("diloco-f", c.fragments, "-tau", c.delay), kMixedDevices);
  const ReferenceResult ref = Reference(cfg);
  ExpectEqualsReference(out, cfg, ref);
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "status"), "\"ok\"") << summary;
  EXPECT_EQ(Field(summary, "replicas_equal"), "true") << summary;
  const std::set<uint64_t> sending = c.fragments == 3
                                         ? std::set<uint64_t>{1, 2, 3, 5, 6, 7, 9, 10, 11, 13}
                                     : c.fragments == 2 ? std::set<uint64_t>{1, 3, 5, 7, 9, 11, 13}
                                                        : std::set<uint64_t>{3, 7, 11, 13};
  EXPECT_EQ(Field(summary, "rounds"), absl::StrCat(sending.size())) << summary;
  ExpectStepsSend(out, 14, sending, 0);
  std::set<uint64_t> receiving;
  for (uint64_t t : sending) receiving.insert(t == 13 ? 13 : std::min<uint64_t>(t + c.delay, 12));
  EXPECT_EQ(StepsReceiving(out), receiving);
}

INSTANTIATE_TEST_SUITE_P(Streaming, DilocoFragmentsTest,
                         ::testing::Values(FragmentCombo{{"onebit", "onebit", "both"}, 3},
                                           FragmentCombo{{"onebit", "onebit", "none"}, 2},
                                           FragmentCombo{{"fp16", "onebit", "worker"}, 3},
                                           FragmentCombo{{"fp32", "fp32", "server"}, 2},
                                           FragmentCombo{{"onebit", "onebit", "none"}, 2, 1},
                                           FragmentCombo{{"onebit", "fp16", "both"}, 1, 3}),
                         [](const ::testing::TestParamInfo<FragmentCombo>& info) {
                           return absl::StrCat(
                               "F", info.param.fragments, "_", info.param.codecs.worker_codec, "_",
                               info.param.codecs.server_codec, "_ef_",
                               info.param.codecs.error_feedback,
                               info.param.delay > 0 ? absl::StrCat("_tau", info.param.delay) : "");
                         });

// onebit-lamb on the mlp (tensors W0 b0 W1 b1) through a real 3 x S
// cluster, workers 0 and 2 on the GPU worker's code on its CPU twins (a
// GPU's mlp gradient differs from the CPU's): shards of whole tensors (W0
// alone is cut into 13 chunks, which the server steps together), and every
// replica, master and server error equal to onebit-reference's, bit for bit.
struct LambCombo {
  std::string worker_codec, server_codec, error_feedback, extra;
  uint32_t servers = 2;
};
void PrintTo(const LambCombo& c, std::ostream* os) {
  *os << "onebit-lamb " << c.worker_codec << "/" << c.server_codec << " ef=" << c.error_feedback
      << " " << c.extra << " S=" << c.servers;
}

// Every push codec x reply codec x error feedback x reply mode, then the
// fp16 warm-up, the automatic freeze and an empty third shard.
std::vector<LambCombo> AllLambCombos() {
  std::vector<LambCombo> out;
  for (const char* wc : {"fp32", "fp16", "onebit"}) {
    for (const char* sc : {"fp32", "fp16", "onebit"}) {
      for (const char* ef : {"both", "worker", "server", "none"}) {
        for (const char* reply : {"", "--server_reply=delta"}) out.push_back({wc, sc, ef, reply});
      }
    }
  }
  out.push_back({"onebit", "onebit", "both", "--warmup_codec=fp16"});
  out.push_back({"onebit", "onebit", "both", "--freeze=auto:0.5:2"});
  out.push_back({"onebit", "onebit", "both", "", 3});
  return out;
}

class LambTest : public ::testing::TestWithParam<LambCombo> {};

TEST_P(LambTest, EveryWorkerAndServerEqualsTheReference) {
  const LambCombo& c = GetParam();
  std::vector<std::string> job = {"--workers=3",
                                  "--model=mlp",
                                  "--layers=784-16-10",
                                  "--optimizer=onebit-lamb",
                                  "--lr=5e-3",
                                  "--weight_decay=0.01",
                                  "--batch=16",
                                  "--max_train=480",
                                  "--max_test=200",
                                  "--steps=8",
                                  "--block_size=256",
                                  "--chunk_elems=1024",
                                  "--factor_threshold=0.05",
                                  absl::StrCat("--servers=", c.servers),
                                  "--worker_codec=" + c.worker_codec,
                                  "--server_codec=" + c.server_codec,
                                  "--error_feedback=" + c.error_feedback};
  if (c.extra.empty() || c.extra.rfind("--freeze=", 0) != 0) job.push_back("--freeze_step=3");
  if (!c.extra.empty()) job.push_back(c.extra);
  const std::string dir = TempDir("lamb");
  std::vector<std::string> argv = {Bin("onebit-launch"), "--out=" + dir, "--dump_params",
                                   "--heartbeat_timeout=3s",
                                   "--worker_devices=cuda-twin,cpu,cuda-twin"};
  argv.insert(argv.end(), job.begin(), job.end());
  RunResult r = RunCommand(argv, absl::Seconds(120));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string ref = TempDir("lamb-reference");
  std::vector<std::string> rargv = {Bin("onebit-reference"), "--out=" + ref};
  rargv.insert(rargv.end(), job.begin(), job.end());
  RunResult rr = RunCommand(rargv, absl::Seconds(120));
  ASSERT_EQ(rr.code, 0) << rr.output;
  std::vector<std::string> files = {"/replica_w0.f32", "/replica_w1.f32", "/replica_w2.f32"};
  for (uint32_t s = 0; s < c.servers; ++s) {
    files.push_back(absl::StrCat("/master_s", s, ".f32"));
    files.push_back(absl::StrCat("/error_s", s, ".f32"));
  }
  for (const std::string& f : files) {
    const std::vector<float> a = ReadFloats(ref + f), b = ReadFloats(dir + f);
    EXPECT_EQ(a.size(), b.size()) << f;
    EXPECT_EQ(FirstDifference(a, b), "") << f;
  }
  // The shards hold whole tensors: W0 (784·16) alone, then the rest.
  EXPECT_EQ(ReadFloats(dir + "/master_s0.f32").size(), 12544u);
  EXPECT_EQ(ReadFloats(dir + "/master_s1.f32").size(), 186u);
  if (c.servers > 2) {
    EXPECT_EQ(ReadFloats(dir + "/master_s2.f32").size(), 0u);
  }
  const std::string summary = ReadFile(dir + "/summary.json");
  EXPECT_EQ(Field(summary, "workers_agree"), "true") << summary;
  const bool delta = c.extra == "--server_reply=delta";
  EXPECT_EQ(Field(summary, "server_reply"), delta ? "\"delta\"" : "\"momentum\"") << summary;
  // The automatic freeze fires too (v of the mlp settles within 8 steps at
  // tau 0.5), at a check: a multiple of its window after the first.
  const std::string freeze = Field(summary, "freeze_step");
  if (c.extra == "--freeze=auto:0.5:2") {
    EXPECT_TRUE(freeze == "4" || freeze == "6") << summary;
  } else {
    EXPECT_EQ(freeze, "3") << summary;
  }
  // Momentum replies: every replica equals the master; delta replies trail
  // it by the server error, or by the codec's rounding (an fp32 reply is Δ
  // itself).
  const bool trail = delta && c.server_codec != "fp32";
  EXPECT_EQ(Field(summary, "replicas_equal"), trail ? "false" : "true") << summary;
}

INSTANTIATE_TEST_SUITE_P(Combinations, LambTest, ::testing::ValuesIn(AllLambCombos()),
                         [](const ::testing::TestParamInfo<LambCombo>& info) {
                           std::string extra =
                               info.param.extra.empty() ? "" : "_" + info.param.extra.substr(2);
                           for (char& ch : extra)
                             ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return absl::StrCat(
                               info.param.worker_codec, "_", info.param.server_codec, "_ef_",
                               info.param.error_feedback, extra, "_s", info.param.servers);
                         });

// onebit-lamb refuses bias correction and bad coefficients, naming the
// flag.
TEST(Lamb, RefusalsNameTheProblem) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--bias_correction"}, "--bias_correction: onebit-lamb has none"},
      {{"--factor_min=5"}, "--factor_min"},
  };
  for (const auto& [flags, want] : cases) {
    std::vector<std::string> argv = {Bin("onebit-launch"),
                                     "--out=" + TempDir("lamb-refused"),
                                     "--workers=1",
                                     "--servers=1",
                                     "--model=mlp",
                                     "--layers=784-16-10",
                                     "--optimizer=onebit-lamb",
                                     "--steps=2",
                                     "--max_train=64"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    RunResult r = RunCommand(argv, absl::Seconds(60));
    EXPECT_NE(r.code, 0) << flags[0];
    EXPECT_THAT(r.output, HasSubstr(want)) << flags[0];
  }
}

// --warmup_codec fp16 on a mixed cluster (kMixedDevices): every replica and
// master equal the reference, and the warm-up sends half of fp32's payload.
class Fp16WarmupTest : public ::testing::TestWithParam<std::string> {};

TEST_P(Fp16WarmupTest, EqualsTheReferenceWithHalfTheWarmupBytes) {
  control::TrainingConfig cfg = MakeConfig(3, 2, 1000, 6, GetParam());
  cfg.mutable_optimizer()->set_lr(0.05f);
  cfg.mutable_optimizer()->set_weight_decay(0.01f);
  testing::SetSetting(&cfg, "warmup_codec", "fp16");
  if (GetParam() == "onebit-adam") cfg.mutable_optimizer()->set_freeze_step(3);
  cfg.mutable_timeouts()->set_heartbeat_ms(3000);
  const std::string out = Launch(cfg, "fp16_warmup", kMixedDevices);
  const ReferenceResult ref = Reference(cfg);
  ExpectEqualsReference(out, cfg, ref);
  // The reference's payloads: 2 bytes a parameter each way in the warm-up
  // (the hand-over adds m and v in fp32).
  EXPECT_EQ(ref.push_bytes[0], 3u * 2 * 1000);
  EXPECT_EQ(ref.reply_bytes[0], 3u * 2 * 1000);
  if (GetParam() == "onebit-adam") {
    EXPECT_EQ(ref.reply_bytes[2], 3u * (2 + 8) * 1000);
  }
  // And the same run in fp32 differs: the rounding is real.
  testing::SetSetting(&cfg, "warmup_codec", "fp32");
  EXPECT_NE(FirstDifference(Reference(cfg).workers[0], ref.workers[0]), "");
  EXPECT_EQ(Field(ReadFile(out + "/summary.json"), "replicas_equal"), "true");
}

INSTANTIATE_TEST_SUITE_P(Optimizers, Fp16WarmupTest, ::testing::Values("adam", "onebit-adam"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           for (char& ch : name) ch = ch == '-' ? '_' : ch;
                           return name;
                         });

TEST(Fp16Warmup, OptimizersWithoutAWarmupRefuseIt) {
  control::TrainingConfig cfg = MakeConfig(1, 1, 100, 2, "ef-sgd");
  testing::SetSetting(&cfg, "warmup_codec", "fp16");
  std::vector<std::string> argv = {Bin("onebit-launch"), "--out=" + TempDir("fp16_refused")};
  for (const std::string& a : ConfigArgs(cfg)) argv.push_back(a);
  RunResult r = RunCommand(argv, absl::Seconds(60));
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("--warmup_codec: ef-sgd has no warm-up to send in fp16"));
}

TEST(MatrixSize, CoversEveryValidCombination) {
  // onebit-adam and ef-sgd: 3 × 3 codecs × 4 feedback modes × 2 replies each;
  // naive-onebit-adam replies deltas only; sgd and adam are fp32 throughout.
  EXPECT_EQ(AllCombos().size(), 72u + 72u + 36u + 1u + 1u);
}

// --server-reply delta: replicas trail the master by the server error.
TEST(DeltaReply, WorkerPlusServerErrorEqualsMaster) {
  control::TrainingConfig cfg = MakeConfig(3, 2, 5000, 10, "onebit-adam");
  testing::SetSetting(&cfg, "server_reply", "delta");
  cfg.mutable_optimizer()->set_freeze_step(4);
  cfg.mutable_optimizer()->set_lr(0.02f);
  const std::string out = Launch(cfg, "delta");
  auto map = *ShardMapForConfig(cfg, *ModelLayerEnds(cfg));
  double largest = 0;
  for (uint32_t s = 0; s < 2; ++s) {
    const std::vector<float> master = ReadFloats(absl::StrCat(out, "/master_s", s, ".f32"));
    const std::vector<float> error = ReadFloats(absl::StrCat(out, "/error_s", s, ".f32"));
    ASSERT_EQ(master.size(), map.shard(s).size());
    ASSERT_EQ(error.size(), master.size());
    for (uint32_t w = 0; w < 3; ++w) {
      const std::vector<float> x = ReadFloats(absl::StrCat(out, "/replica_w", w, ".f32"));
      for (size_t i = 0; i < master.size(); ++i) {
        const float replica = x[map.shard(s).begin + i];
        // Six compression steps of fp32 rounding on values of order 1.
        ASSERT_NEAR(replica + error[i], master[i], 1e-5) << "server " << s << " element " << i;
        largest = std::max(largest, std::fabs(static_cast<double>(master[i]) - replica));
      }
    }
  }
  ASSERT_GT(largest, 1e-3) << "the 1-bit reply must leave a visible difference";
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "replicas_equal"), "false") << summary;
  EXPECT_EQ(Field(summary, "workers_agree"), "true") << summary;
  EXPECT_NEAR(NumberField(summary, "max_replica_master_diff"), largest, 1e-7 * largest + 1e-12);
}

// Compression-phase bytes, headers included, against an fp32 run of the same job.
TEST(Bytes, OnebitBothWaysIsUnderOneThirtyFirstOfFp32) {
  control::TrainingConfig cfg = MakeConfig(2, 2, 1000000, 4, "onebit-adam");
  cfg.mutable_compression()->set_block_size(2048);
  cfg.mutable_compression()->set_chunk_elems(1 << 20);
  cfg.mutable_optimizer()->set_freeze_step(2);
  const std::string out = Launch(cfg, "bytes_onebit");
  control::TrainingConfig fp32 = cfg;
  testing::SetSetting(&fp32, "optimizer", "adam");
  testing::SetSetting(&fp32, "worker_codec", "fp32");
  testing::SetSetting(&fp32, "server_codec", "fp32");
  fp32.mutable_optimizer()->set_freeze_step(0);
  const std::string out32 = Launch(fp32, "bytes_fp32");

  auto rows = [](const std::string& dir) {
    std::vector<std::vector<std::string>> r;
    std::vector<std::string> lines =
        absl::StrSplit(ReadFile(dir + "/metrics.csv"), '\n', absl::SkipEmpty());
    for (size_t i = 1; i < lines.size(); ++i) r.push_back(absl::StrSplit(lines[i], ','));
    return r;
  };
  auto onebit_rows = rows(out), fp32_rows = rows(out32);
  ASSERT_EQ(onebit_rows.size(), 4u);
  ASSERT_EQ(fp32_rows.size(), 4u);
  for (size_t t = 2; t < 4; ++t) {
    ASSERT_EQ(onebit_rows[t][1], "compress");
    for (int col : {4, 5}) {  // bytes_up, bytes_down
      double compressed = 0, full = 0;
      ASSERT_TRUE(absl::SimpleAtod(onebit_rows[t][col], &compressed));
      ASSERT_TRUE(absl::SimpleAtod(fp32_rows[t][col], &full));
      EXPECT_GT(full, 2 * 4e6);  // 2 workers × 4 MB, plus headers
      EXPECT_LE(compressed * 31, full) << "step " << t << " column " << col;
    }
  }
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_LE(NumberField(summary, "compress_ratio_up"), 1.0 / 31);
  EXPECT_LE(NumberField(summary, "compress_ratio_down"), 1.0 / 31);
  EXPECT_EQ(Field(summary, "compress_steps"), "2");
}

// --freeze auto: the coordinator's decision equals the reference's, and the
// run equals the reference bit for bit.
TEST(AutoFreeze, CoordinatorFreezesWhereTheReferenceDoes) {
  control::TrainingConfig cfg = MakeConfig(2, 3, 3000, 40, "onebit-adam");
  cfg.mutable_optimizer()->set_freeze("auto:0.3:5:1");  // F 1: the measure alone decides
  cfg.mutable_timeouts()->set_heartbeat_ms(3000);
  const ReferenceResult ref = Reference(cfg);
  ASSERT_LT(ref.freeze_step, 30u) << "pick tau so that the freeze happens mid-run";
  ASSERT_GT(ref.freeze_step, 10u);
  const std::string out = Launch(cfg, "auto_freeze");
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "freeze_step"), absl::StrCat(ref.freeze_step)) << summary;
  EXPECT_EQ(Field(summary, "freeze"), "\"auto:0.3:5:1\"");
  EXPECT_EQ(Field(summary, "freeze_warning"), "null");
  for (uint32_t w = 0; w < 2; ++w) {
    EXPECT_EQ(
        FirstDifference(ReadFloats(absl::StrCat(out, "/replica_w", w, ".f32")), ref.workers[w]),
        "");
  }
  EXPECT_EQ(Field(summary, "replicas_equal"), "true");
}

// --freeze auto on a job too short for v to settle (tau so small that no
// measure meets it): with the latest point F = 0.25 of 40 steps the job
// freezes at step 10, decided by the check after 5 steps (5 + 5 >= 10), as
// the reference does; without one (F = 1) it never freezes, and
// summary.json says so and gives the last check's measure.
TEST(AutoFreeze, AShortJobFreezesByTheLatestPointOrSaysWhyNot) {
  control::TrainingConfig cfg = MakeConfig(2, 2, 3000, 40, "onebit-adam");
  cfg.mutable_optimizer()->set_freeze("auto:1e-12:5:0.25");
  cfg.mutable_timeouts()->set_heartbeat_ms(3000);
  const ReferenceResult ref = Reference(cfg);
  EXPECT_EQ(ref.freeze_step, 10u);
  std::string summary = ReadFile(Launch(cfg, "latest_freeze") + "/summary.json");
  EXPECT_EQ(Field(summary, "freeze_step"), "10") << summary;
  EXPECT_EQ(Field(summary, "compress_steps"), "30");
  EXPECT_EQ(Field(summary, "freeze_warning"), "null");
  EXPECT_THAT(Field(summary, "freeze_checks"), ::testing::StartsWith("[[5, ")) << summary;

  cfg.mutable_optimizer()->set_freeze("auto:1e-12:5:1");
  summary = ReadFile(Launch(cfg, "never_froze") + "/summary.json");
  EXPECT_EQ(Field(summary, "freeze_step"), "null") << summary;
  EXPECT_EQ(Field(summary, "compress_steps"), "0");
  EXPECT_THAT(Field(summary, "freeze_warning"),
              HasSubstr("the automatic freeze never fired: the last check, after "));
  EXPECT_THAT(Field(summary, "freeze_warning"), HasSubstr("against tau 1e-12"));
}

// onebit-reference, given the same flags, writes what the cluster ends with.
TEST(ReferenceCommand, WritesWhatTheClusterEndsWith) {
  const control::TrainingConfig cfg =
      ComboConfig(Combo{"onebit-adam", "onebit", "fp16", "both", "delta"});
  const std::string cluster = Launch(cfg, "cluster");
  const std::string ref = TempDir("reference");
  std::vector<std::string> argv = {Bin("onebit-reference"), "--out=" + ref};
  for (const std::string& a : ConfigArgs(cfg)) argv.push_back(a);
  RunResult r = RunCommand(argv, absl::Seconds(60));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("freeze step 3"));
  std::vector<std::string> files;
  for (int w = 0; w < 3; ++w) files.push_back(absl::StrCat("/replica_w", w, ".f32"));
  for (int k = 0; k < 2; ++k) {
    files.push_back(absl::StrCat("/master_s", k, ".f32"));
    files.push_back(absl::StrCat("/error_s", k, ".f32"));
  }
  for (const std::string& f : files) {
    EXPECT_EQ(FirstDifference(ReadFloats(ref + f), ReadFloats(cluster + f)), "") << f;
  }
  const std::string a = ReadFile(ref + "/summary.json"), b = ReadFile(cluster + "/summary.json");
  for (const char* key : {"freeze_step", "replicas_equal", "v_floored"}) {
    EXPECT_EQ(Field(a, key), Field(b, key)) << key;
  }
  // Workers report their losses in fp32.
  EXPECT_NEAR(NumberField(a, "final_loss"), NumberField(b, "final_loss"),
              1e-6 * NumberField(a, "final_loss"));
}

// Bad configs exit 2 with a message naming the flag or key.
TEST(Config, BadValuesAndKeysExitTwoNamingThem) {
  struct Bad {
    std::vector<std::string> args;
    std::string json;  // written to a --config file when not empty
    std::string expect;
  };
  const std::vector<Bad> cases = {
      {{"--optimizer=lamb"}, "", "--optimizer"},
      {{"--optimizer=adam", "--worker_codec=onebit"}, "", "--worker_codec"},
      {{"--optimizer=naive-onebit-adam", "--server_reply=momentum"}, "", "--server_reply"},
      {{"--optimizer=onebit-adam", "--freeze=auto:zero"}, "", "--freeze"},
      {{"--optimizer=onebit-adam", "--freeze=auto", "--freeze_step=5"}, "", "--freeze"},
      {{"--error_feedback=sometimes"}, "", "--error_feedback"},
      {{"--lr_schedule=warmup:0"}, "", "--lr_schedule"},
      {{"--v_floor=-1"}, "", "--v_floor"},
      {{"--scale=l3"}, "", "--scale"},
      {{},
       R"({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "momentum": 0.9}}})",
       "momentum"},
      {{}, R"({"optimizer": {"type": "Lamb"}})", "Lamb"},
      {{}, R"({"onebit": {"worker_codec": "onebit", "colour": "red"}})", "colour"},
      {{}, R"({"workers": 2, "learning_rate": 0.1})", "learning_rate"},
  };
  for (const Bad& b : cases) {
    std::vector<std::string> argv = {Bin("onebit-launch"), "--steps=1", "--dim=100"};
    for (const std::string& a : b.args) argv.push_back(a);
    if (!b.json.empty()) {
      const std::string path = TempDir("config") + "/c.json";
      std::ofstream(path) << b.json;
      argv.push_back("--config=" + path);
    }
    RunResult r = RunCommand(argv, absl::Seconds(30));
    EXPECT_EQ(r.code, 2) << absl::StrJoin(argv, " ") << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(b.expect)) << absl::StrJoin(argv, " ");
  }
}

// A DeepSpeed-style config trains: its optimizer section sets our flags.
TEST(Config, DeepSpeedOptimizerSectionIsUnderstood) {
  const std::string dir = TempDir("deepspeed");
  std::ofstream(dir + "/ds.json") << R"({
    "optimizer": {"type": "OneBitAdam",
                  "params": {"lr": 0.002, "betas": [0.8, 0.99], "eps": 1e-7,
                             "weight_decay": 0.01, "freeze_step": 3}},
    "onebit": {"workers": 2, "servers": 2, "worker_codec": "onebit", "server_codec": "fp16"},
    "steps": 6, "dim": 4000
  })";
  RunResult r = RunCommand({Bin("onebit-launch"), "--config=" + dir + "/ds.json",
                            "--out=" + dir + "/run", "--heartbeat_timeout=3s"},
                           absl::Seconds(60));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string summary = ReadFile(dir + "/run/summary.json");
  EXPECT_EQ(Field(summary, "optimizer"), "\"onebit-adam\"");
  EXPECT_EQ(Field(summary, "freeze_step"), "3");
  EXPECT_EQ(Field(summary, "workers"), "2");
  EXPECT_EQ(Field(summary, "server_codec"), "\"fp16\"");
  EXPECT_EQ(Field(summary, "replicas_equal"), "true");
}

// The mlp on a slice of Fashion-MNIST through a real cluster: the loss falls,
// the test set is scored every epoch, and replicas stay equal.
TEST(Mlp, ShortClusterRunLearns) {
  const std::string dir = TempDir("mlp");
  RunResult r = RunCommand(
      {Bin("onebit-launch"), "--workers=2", "--servers=2", "--model=mlp", "--layers=784-32-10",
       "--optimizer=onebit-adam", "--lr=2e-3", "--batch=32", "--max_train=2048", "--max_test=1000",
       "--epochs=6", "--freeze_step=64", "--heartbeat_timeout=3s", "--out=" + dir},
      absl::Seconds(120));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string summary = ReadFile(dir + "/summary.json");
  EXPECT_EQ(Field(summary, "steps"), "192");     // 6 epochs of 2048 / (2 × 32)
  EXPECT_EQ(Field(summary, "params"), "25450");  // 784·32 + 32 + 32·10 + 10
  EXPECT_EQ(Field(summary, "replicas_equal"), "true");
  EXPECT_GT(NumberField(summary, "test_accuracy"), 0.7);  // chance is 0.1
  std::vector<std::string> lines =
      absl::StrSplit(ReadFile(dir + "/metrics.csv"), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 193u);
  auto loss = [&](size_t row) {
    double v = 0;
    EXPECT_TRUE(absl::SimpleAtod(std::vector<std::string>(absl::StrSplit(lines[row], ','))[2], &v));
    return v;
  };
  double first = 0, last = 0;
  for (size_t i = 1; i <= 10; ++i) first += loss(i) / 10;
  for (size_t i = 183; i <= 192; ++i) last += loss(i) / 10;
  EXPECT_LT(last, 0.5 * first) << "training loss must fall";
  int evaluations = 0;
  for (size_t i = 1; i < lines.size(); ++i) {
    evaluations += std::vector<std::string>(absl::StrSplit(lines[i], ',')).back() != "";
  }
  EXPECT_EQ(evaluations, 6);  // once an epoch (the last one is also the end)
}

// zero-one-adam with its defaults trains the mlp as well as onebit-adam
// with its own (the issue's command at 6 epochs, 384 steps, lr 0.01). The
// seeds are those on which DeepSpeed's defaults (blocks of 2048, κ = 16)
// ended at 0.67, 0.49 and 0.33, the last two after the loss grew to 1e7;
// measured with ours 0.808, 0.818, 0.808 against onebit-adam's 0.691,
// 0.752, 0.731.
TEST(Mlp, ZeroOneAdamDefaultsTrainAsWellAsOnebitAdam) {
  for (const char* seed : {"2", "4", "6"}) {
    double accuracy[2] = {0, 0};
    const char* optimizers[2] = {"zero-one-adam", "onebit-adam"};
    for (int i = 0; i < 2; ++i) {
      const std::string dir = TempDir(absl::StrCat("zo-defaults-", seed, "-", i));
      RunResult r = RunCommand(
          {Bin("onebit-launch"), "--workers=3", "--servers=2", "--model=mlp", "--epochs=6",
           "--max_train=12288", "--eval_every=1000", absl::StrCat("--seed=", seed),
           absl::StrCat("--optimizer=", optimizers[i]), "--out=" + dir},
          absl::Seconds(180));
      ASSERT_EQ(r.code, 0) << optimizers[i] << " seed " << seed << ": " << r.output;
      const std::string summary = ReadFile(dir + "/summary.json");
      EXPECT_EQ(Field(summary, "diverged"), "false") << optimizers[i] << " seed " << seed;
      accuracy[i] = NumberField(summary, "test_accuracy");
    }
    std::printf("seed %s: zero-one-adam %.4f, onebit-adam %.4f\n", seed, accuracy[0], accuracy[1]);
    EXPECT_GE(accuracy[0], accuracy[1] - 0.01) << "seed " << seed;
  }
}

// The mlp's layer-by-layer release (--overlap, the default) pushes its last
// layers while the first is computed, and changes nothing: the replicas,
// masters and server errors equal those of --overlap=false and of
// onebit-reference bit for bit, through the warm-up and the compression phase.
TEST(Mlp, OverlapPushesDuringTheBackwardAndChangesNothing) {
  const std::vector<std::string> job = {"--workers=2",        "--servers=2",
                                        "--model=mlp",        "--layers=784-64-32-10",
                                        "--batch=32",         "--max_train=1024",
                                        "--max_test=200",     "--epochs=2",
                                        "--freeze_step=12",   "--optimizer=onebit-adam",
                                        "--lr=2e-3",          "--block_size=256",
                                        "--chunk_elems=2048", "--compressed_chunk_elems=4096"};
  auto run = [&](bool overlap) {
    const std::string dir = TempDir(overlap ? "mlp-overlap" : "mlp-no-overlap");
    std::vector<std::string> argv = {Bin("onebit-launch"), "--out=" + dir, "--dump_params",
                                     "--heartbeat_timeout=3s",
                                     absl::StrCat("--overlap=", overlap ? "true" : "false")};
    argv.insert(argv.end(), job.begin(), job.end());
    RunResult r = RunCommand(argv, absl::Seconds(120));
    EXPECT_EQ(r.code, 0) << r.output;
    return std::make_pair(dir, r.output);
  };
  const auto [on, on_log] = run(true);
  const auto [off, off_log] = run(false);
  // 784-64-32-10: layers 1 and 2 (W1 b1 W2 b2) are [50240, 52650). The
  // shards are [0, 26368) and [26368, 52650): in the 12 warm-up steps 13
  // chunks of up to 2048 each; the last, [50944, 52650), lies in layers 1
  // and 2 and goes out before layer 0 is released. In the 20 compressed
  // steps 7 chunks of up to 4096 each, and again the last is [50944,
  // 52650). 12 x 26 + 20 x 14 chunks, one a step overlapped.
  EXPECT_THAT(on_log, HasSubstr("worker 0: 32 of 592 chunks (5.4 %) went out during the backward"));
  EXPECT_THAT(off_log, HasSubstr("worker 0: 0 of 592 chunks (0.0 %) went out during the backward "
                                 "(--overlap=false)"));
  const std::string ref = TempDir("mlp-overlap-reference");
  std::vector<std::string> rargv = {Bin("onebit-reference"), "--out=" + ref};
  rargv.insert(rargv.end(), job.begin(), job.end());
  RunResult rr = RunCommand(rargv, absl::Seconds(120));
  ASSERT_EQ(rr.code, 0) << rr.output;
  for (const char* f : {"/replica_w0.f32", "/replica_w1.f32", "/master_s0.f32", "/master_s1.f32",
                        "/error_s0.f32", "/error_s1.f32"}) {
    const std::vector<float> a = ReadFloats(on + f), b = ReadFloats(off + f);
    EXPECT_FALSE(a.empty()) << f;
    EXPECT_EQ(FirstDifference(a, b), "") << f;
    EXPECT_EQ(FirstDifference(a, ReadFloats(ref + f)), "") << f;
  }
  EXPECT_EQ(Field(ReadFile(on + "/summary.json"), "freeze_step"), "12");
}

// The softmax model, whose options come only through --model_options, on a
// 2 x 1 cluster: it learns, replicas stay equal, and onebit-reference given
// the same job (its options as a --config object) ends with the same x.
TEST(Softmax, ClusterEqualsTheReferenceBitForBit) {
  const std::vector<std::string> job = {
      "--workers=2", "--servers=1",      "--model=softmax",  "--optimizer=onebit-adam", "--lr=5e-3",
      "--epochs=3",  "--freeze_step=16", "--block_size=256", "--chunk_elems=1024"};
  const std::string dir = TempDir("softmax");
  std::vector<std::string> argv = {Bin("onebit-launch"), "--out=" + dir, "--dump_params",
                                   "--heartbeat_timeout=3s",
                                   "--model_options=batch=32,max_train=1024,max_test=500"};
  argv.insert(argv.end(), job.begin(), job.end());
  RunResult r = RunCommand(argv, absl::Seconds(120));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string summary = ReadFile(dir + "/summary.json");
  EXPECT_EQ(Field(summary, "steps"), "48");     // 3 epochs of 1024 / (2 × 32)
  EXPECT_EQ(Field(summary, "params"), "7850");  // 784·10 + 10
  EXPECT_EQ(Field(summary, "freeze_step"), "16");
  EXPECT_EQ(Field(summary, "replicas_equal"), "true");
  EXPECT_GT(NumberField(summary, "test_accuracy"), 0.6);  // chance is 0.1

  const std::string ref = TempDir("softmax-reference");
  std::ofstream(ref + "/job.json")
      << R"({"model_options": {"batch": 32, "max_train": "1024", "max_test": 500}})";
  std::vector<std::string> rargv = {Bin("onebit-reference"), "--out=" + ref,
                                    "--config=" + ref + "/job.json"};
  rargv.insert(rargv.end(), job.begin(), job.end());
  RunResult rr = RunCommand(rargv, absl::Seconds(120));
  ASSERT_EQ(rr.code, 0) << rr.output;
  for (const char* f : {"/replica_w0.f32", "/replica_w1.f32", "/master_s0.f32", "/error_s0.f32"}) {
    const std::vector<float> a = ReadFloats(ref + f), b = ReadFloats(dir + f);
    EXPECT_EQ(a.size(), 7850u) << f;
    EXPECT_EQ(FirstDifference(a, b), "") << f;
  }
}

TEST(Mlp, MissingDataFolderIsNamed) {
  RunResult r =
      RunCommand({Bin("onebit-launch"), "--workers=1", "--servers=1", "--model=mlp",
                  "--data_dir=/nonexistent/fmnist", "--steps=2", "--heartbeat_timeout=3s"},
                 absl::Seconds(60));
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("/nonexistent/fmnist"));
}

}  // namespace
}  // namespace onebit::testing
