// --data_connections: a secured job whose workers reach each server over
// several connections, started through the launcher, ends bit for bit where
// the single-process reference does, and every connection carried requests;
// under either --data_cipher (CURVE, or sealed with AES-256-GCM).
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster/test_util.h"

namespace onebit::testing {
namespace {

class DataConnections : public ::testing::TestWithParam<const char*> {};

TEST_P(DataConnections, ASecuredJobOnThreeConnectionsEqualsTheReferenceBitForBit) {
  constexpr uint32_t kWorkers = 2, kServers = 2, kConnections = 3;
  control::TrainingConfig cfg = MakeConfig(kWorkers, kServers, 6007, 12, "onebit-adam");
  SetSetting(&cfg, "block_size", "64");
  // Several chunks per shard in both phases, so every connection has some.
  SetSetting(&cfg, "chunk_elems", "512");
  SetSetting(&cfg, "compressed_chunk_elems", "512");
  SetSetting(&cfg, "freeze_step", "5");
  SetSetting(&cfg, "data_connections", absl::StrCat(kConnections));
  SetSetting(&cfg, "data_cipher", GetParam());
  const std::string out = TempDir(absl::StrCat("data_connections_", GetParam()));
  // No --insecure: the launcher makes a job secret.
  std::vector<std::string> argv = {Bin("onebit-launch"), "--out=" + out, "--dump_params"};
  for (const std::string& a : ConfigArgs(cfg)) argv.push_back(a);
  RunResult r = RunCommand(argv, absl::Seconds(180));
  ASSERT_EQ(r.code, 0) << absl::StrJoin(argv, " ") << "\n" << r.output;

  const ReferenceResult ref = Reference(cfg);
  for (uint32_t w = 0; w < kWorkers; ++w) {
    const std::string file = absl::StrCat(out, "/replica_w", w, ".f32");
    EXPECT_EQ(FirstDifference(ReadFloats(file), ref.workers[w]), "") << file;
  }
  for (uint32_t s = 0; s < kServers; ++s) {
    EXPECT_EQ(FirstDifference(ReadFloats(absl::StrCat(out, "/master_s", s, ".f32")),
                              ref.masters[s].x, ref.masters[s].begin),
              "")
        << "shard " << s;
    EXPECT_EQ(absl::StrContains(r.output, absl::StrCat("server ", s, ": shard [")) &&
                  absl::StrContains(r.output, "data plane sealed with AES-256-GCM"),
              std::string(GetParam()) == "aes-gcm")
        << r.output;
    // Each server heard from every connection of every worker.
    EXPECT_THAT(r.output, ::testing::HasSubstr(
                              absl::StrCat("server ", s, ": done after 12 steps; requests came on ",
                                           kWorkers * kConnections, " connections")));
  }
}

INSTANTIATE_TEST_SUITE_P(Ciphers, DataConnections, ::testing::Values("curve", "aes-gcm"),
                         [](const auto& info) {
                           return std::string(info.param) == "curve" ? "curve" : "aes_gcm";
                         });

}  // namespace
}  // namespace onebit::testing
