// Integration: whole jobs through onebit-launch on loopback. After T steps
// every worker's replica must equal the server masters bitwise, and both must
// equal the single-process reference of the same update on the same
// synthetic gradients.
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "compress/codec.h"
#include "gtest/gtest.h"
#include "models/model.h"
#include "net/data_plane.h"
#include "optim/optimizer.h"
#include "shard/shard_map.h"
#include "tests/cluster/test_util.h"

namespace onebit::testing {
namespace {

struct Case {
  std::string name;
  uint32_t workers, servers;
  uint64_t dim, steps;
  std::string optimizer;
  std::string worker_codec;
  std::string compressed_chunk_elems = "0";  // 0: auto
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class ClusterTest : public ::testing::TestWithParam<Case> {};

TEST_P(ClusterTest, ReplicasEqualMastersEqualReference) {
  const Case& k = GetParam();
  control::TrainingConfig cfg = MakeConfig(k.workers, k.servers, k.dim, k.steps, k.optimizer);
  testing::SetSetting(&cfg, "worker_codec", k.worker_codec);
  testing::SetSetting(&cfg, "compressed_chunk_elems", k.compressed_chunk_elems);
  const OptimizerKind kind = *ParseOptimizerKind(k.optimizer);
  if (HasWarmup(kind) && HasCompressionPhase(kind))
    cfg.mutable_optimizer()->set_freeze_step(k.steps / 2);
  const std::string out = TempDir(k.name);
  std::vector<std::string> argv = {Bin("onebit-launch"), "--out=" + out, "--dump_params"};
  for (const std::string& a : ConfigArgs(cfg)) argv.push_back(a);
  RunResult r = RunCommand(argv, absl::Seconds(60));
  ASSERT_EQ(r.code, 0) << r.output;

  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_NE(summary.find("\"replicas_equal\": true"), std::string::npos) << summary;
  EXPECT_NE(summary.find(absl::StrCat("\"workers\": ", k.workers)), std::string::npos);
  EXPECT_NE(summary.find(absl::StrCat("\"params\": ", k.dim)), std::string::npos);
  const uint64_t fp32_bytes = k.dim * 4 * k.workers * k.steps;
  EXPECT_NE(summary.find(absl::StrCat("\"bytes_up_fp32\": ", fp32_bytes)), std::string::npos)
      << summary;

  ReferenceResult ref = Reference(cfg);
  for (uint32_t w = 0; w < k.workers; ++w) {
    std::vector<float> x = ReadFloats(absl::StrCat(out, "/replica_w", w, ".f32"));
    EXPECT_EQ(FirstDifference(x, ref.x), "") << "worker " << w;
  }
  auto map = ShardMap::Create(k.dim, k.servers, cfg.compression().block_size());
  ASSERT_TRUE(map.ok());
  for (uint32_t s = 0; s < k.servers; ++s) {
    std::vector<float> master = ReadFloats(absl::StrCat(out, "/master_s", s, ".f32"));
    EXPECT_EQ(FirstDifference(master, ref.masters[s].x, map->shard(s).begin), "") << "server " << s;
  }
  // The replicas moved: a run that applied nothing would also "agree".
  std::vector<float> x0(k.dim);
  (*NewModel(cfg))->Init(x0.data());
  EXPECT_NE(FirstDifference(ReadFloats(out + "/replica_w0.f32"), x0), "");

  // Messages one worker sends (and receives) per step: one per chunk, of
  // the warm-up's grid or the compression phase's. Each carries a header of
  // a few dozen bytes besides its payload.
  auto codec = NewCodec(k.worker_codec, CodecOptions{cfg.compression().block_size()});
  ASSERT_TRUE(codec.ok()) << codec.status();
  const uint64_t fine = cfg.compression().chunk_elems();
  const uint64_t coarse =
      CompressedChunkElemsFor(cfg.compression().compressed_chunk_elems(), fine, *map, **codec);
  uint64_t warmup_messages = 0, compress_messages = 0;
  for (uint32_t s = 0; s < k.servers; ++s) {
    warmup_messages += NumChunks(map->shard(s).size(), fine);
    compress_messages += NumChunks(map->shard(s).size(), coarse);
  }
  constexpr uint64_t kMaxHeader = 96;

  // metrics.csv: one row per step with the reference's loss.
  std::vector<std::string> lines =
      absl::StrSplit(ReadFile(out + "/metrics.csv"), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), k.steps + 1);
  EXPECT_EQ(lines[0].rfind("step,phase,loss,wall_s,bytes_up,bytes_down", 0), 0u);
  for (uint64_t t = 0; t < k.steps; ++t) {
    std::vector<std::string> f = absl::StrSplit(lines[t + 1], ',');
    ASSERT_GE(f.size(), 6u);
    EXPECT_EQ(f[0], absl::StrCat(t));
    const uint64_t messages = f[1] == "compress" ? compress_messages : warmup_messages;
    double loss = 0;
    ASSERT_TRUE(absl::SimpleAtod(f[2], &loss));
    // Workers report fp32 losses; the mean is taken in double.
    EXPECT_NEAR(loss, ref.losses[t], 1e-6 * ref.losses[t]) << "step " << t;
    // Payload bytes are the reference's (chunking adds none: chunks are
    // block-aligned); headers add at most kMaxHeader per message.
    uint64_t up = 0, down = 0;
    ASSERT_TRUE(absl::SimpleAtoi(f[4], &up) && absl::SimpleAtoi(f[5], &down));
    EXPECT_GE(up, ref.push_bytes[t]) << "bytes_up of step " << t;
    EXPECT_LE(up, ref.push_bytes[t] + messages * k.workers * kMaxHeader) << "step " << t;
    EXPECT_GE(down, ref.reply_bytes[t]) << "bytes_down of step " << t;
    EXPECT_LE(down, ref.reply_bytes[t] + messages * k.workers * kMaxHeader) << "step " << t;
    if (!HasCompressionPhase(*ParseOptimizerKind(k.optimizer))) {
      EXPECT_EQ(ref.push_bytes[t], k.dim * 4 * k.workers);
      EXPECT_EQ(ref.reply_bytes[t], k.dim * 4 * k.workers);
    }
  }
}

// summary.json says what the job ran as it was given: the learning rate as
// typed (not 0.0020000000949949026), "none" for the freeze of an optimizer
// that never compresses. And a launch logs no gRPC error: each server
// registers the health service once.
TEST(Summary, SaysWhatTheJobRanAsGiven) {
  const std::string out = TempDir("summary_fields");
  RunResult r = RunCommand({Bin("onebit-launch"), "--workers=1", "--servers=1", "--dim=100",
                            "--steps=3", "--optimizer=adam", "--lr=2e-3", "--v_floor=1e-8",
                            "--block_size=32", "--chunk_elems=64", "--out=" + out},
                           absl::Seconds(30));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "lr"), "0.002") << summary;
  EXPECT_EQ(Field(summary, "v_floor"), "1e-08") << summary;
  EXPECT_EQ(Field(summary, "freeze"), "\"none\"") << summary;
  EXPECT_EQ(Field(summary, "freeze_step"), "null") << summary;
  EXPECT_EQ(Field(summary, "diverged"), "false") << summary;
  EXPECT_EQ(r.output.find("duplicate registration"), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(
    Loopback, ClusterTest,
    ::testing::Values(Case{"w1s1_sgd", 1, 1, 5000, 6, "sgd", "fp32"},
                      Case{"w2s3_adam", 2, 3, 20000, 6, "adam", "fp32"},
                      Case{"w4s2_onebit_fp16", 4, 2, 12000, 5, "onebit-adam", "fp16"},
                      // d divisible by nothing convenient: 9973 is prime, so
                      // shards, chunks and the last block are all ragged.
                      Case{"w3s1_prime_d", 3, 1, 9973, 7, "adam", "fp32"},
                      // The compression phase's own grid: by default 3 chunks
                      // per shard of about 10 000 (4096, the most a
                      // 256-element fp32 frame holds in 1 bit, twice, and a
                      // ragged rest); here 96 elements, finer than the
                      // warm-up's 256 and across its boundaries.
                      Case{"w2s2_onebit_auto_grid", 2, 2, 20000, 8, "onebit-adam", "onebit"},
                      Case{"w3s2_onebit_ragged_grid", 3, 2, 9973, 8, "onebit-adam", "onebit", "96"},
                      // 2 blocks over 3 servers: server 2's shard is empty.
                      Case{"w2s3_empty_shard", 2, 3, 40, 3, "sgd", "fp32"}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace onebit::testing
