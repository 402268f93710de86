// The C++ example (examples/cpp): a model onebit-ps does not know, trained
// on a 4 x 2 cluster through onebit-launch --worker_cmd, equals the
// single-process reference fed the same gradients, bit for bit.
#include <string>
#include <vector>

#include "examples/cpp/softmax.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "job/config.h"
#include "optim/reference.h"
#include "tests/cluster/test_util.h"

namespace onebit::testing {
namespace {

constexpr uint32_t kWorkers = 4, kServers = 2, kSteps = 12, kBatch = 16, kTrain = 1000;

TEST(CppExample, HelpExitsZero) {
  for (const std::string help : {"--help", "-h"}) {
    RunResult r = RunCommand({ONEBIT_SOFTMAX_TRAIN, help}, absl::Seconds(10));
    EXPECT_EQ(r.code, 0) << help << ": " << r.output;
    EXPECT_THAT(r.output, ::testing::HasSubstr("usage: softmax_train [--data DIR]")) << help;
  }
}

TEST(CppExample, SoftmaxOnAFourByTwoClusterEqualsTheReference) {
  const std::string dir = TempDir("softmax");
  const std::string data = "/usr/share/datasets/fashion-mnist";
  // One config for the cluster and the reference.
  control::TrainingConfig cfg =
      MakeConfig(kWorkers, kServers, softmax::kParams, kSteps, "onebit-adam");
  cfg.mutable_model()->set_name("external");
  cfg.mutable_optimizer()->set_lr(0.005f);
  cfg.mutable_optimizer()->set_freeze_step(4);
  cfg.mutable_optimizer()->set_freeze("");
  cfg.mutable_compression()->set_block_size(256);
  cfg.mutable_compression()->set_chunk_elems(1024);
  std::vector<std::string> argv = ConfigArgs(cfg);
  argv.insert(argv.begin(), Bin("onebit-launch"));
  for (std::string a : {"--out=" + dir, std::string("--dump_params"),
                        std::string("--launch_register_timeout=20s")}) {
    argv.push_back(a);
  }
  argv.push_back(absl::StrCat("--worker_cmd=", ONEBIT_SOFTMAX_TRAIN, " --steps ", kSteps,
                              " --batch ", kBatch, " --max_train ", kTrain, " --data ", data));
  RunResult run = RunCommand(argv, absl::Seconds(120));
  ASSERT_EQ(run.code, 0) << run.output;
  const std::string summary = ReadFile(dir + "/summary.json");
  EXPECT_EQ(Field(summary, "replicas_equal"), "true");
  EXPECT_EQ(Field(summary, "params"), absl::StrCat(softmax::kParams));
  EXPECT_EQ(Field(summary, "steps"), absl::StrCat(kSteps));
  EXPECT_EQ(Field(summary, "compress_steps"), absl::StrCat(kSteps - 4));
  EXPECT_THAT(run.output, ::testing::HasSubstr("test accuracy"));

  softmax::Data train;
  ASSERT_EQ(softmax::Load(data + "/train-images-idx3-ubyte.gz",
                          data + "/train-labels-idx1-ubyte.gz", kTrain, &train),
            "");
  ReferenceOptions o;
  o.workers = kWorkers;
  o.map = *ShardMap::Create(softmax::kParams, kServers, cfg.compression().block_size());
  o.steps = kSteps;
  o.optimizer = *OptimizerOptionsFromConfig(cfg);
  o.freeze = *FreezeOptionsFromConfig(cfg);
  std::vector<float> x0(softmax::kParams);
  softmax::Init(1, x0.data());  // rank 0's start (seed rank + 1)
  auto ref = RunReference(o, x0, [&](const float* x, uint32_t rank, uint64_t step, float* g) {
    return softmax::Gradient(train, x, (step * kWorkers + rank) * kBatch, kBatch, g);
  });
  ASSERT_TRUE(ref.ok()) << ref.status();
  for (uint32_t i = 0; i < kWorkers; ++i) {
    EXPECT_EQ(
        FirstDifference(ReadFloats(absl::StrCat(dir, "/replica_w", i, ".f32")), ref->workers[i].x),
        "")
        << "worker " << i;
  }
  for (uint32_t k = 0; k < kServers; ++k) {
    EXPECT_EQ(
        FirstDifference(ReadFloats(absl::StrCat(dir, "/master_s", k, ".f32")), ref->servers[k].x),
        "")
        << "server " << k;
  }
}

}  // namespace
}  // namespace onebit::testing
