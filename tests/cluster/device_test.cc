// onebit-worker --device on real clusters: a CUDA build without a GPU trains
// on the CPU with a one-line notice, --device cuda without a GPU is a clear
// error before the job starts, and a mixed cluster (a GPU worker where one is
// usable, the GPU worker's code on its CPU twins, a CPU worker) trains the mlp
// with replicas equal. Expectations follow what this machine has: with a GPU
// the same tests run the GPU worker.
#include "cuda/device.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster/test_util.h"

namespace onebit::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

RunResult Synthetic(const std::string& out, const std::string& devices) {
  return RunCommand({Bin("onebit-launch"), "--workers=2", "--servers=1", "--model=synthetic",
                     "--dim=5000", "--steps=8", "--optimizer=onebit-adam", "--freeze_step=3",
                     "--heartbeat_timeout=3s", "--worker_devices=" + devices, "--out=" + out},
                    absl::Seconds(60));
}

// Whether a GPU is usable; with ONEBIT_REQUIRE_GPU set (tools/gpu-check) the
// lack of one is a failure, not a reason to check the CPU fallback.
bool HaveGpu() {
  std::string why;
  const bool have = cuda::DeviceCount(&why) > 0;
  if (!have && std::getenv("ONEBIT_REQUIRE_GPU") != nullptr) {
    ADD_FAILURE() << "ONEBIT_REQUIRE_GPU is set but no CUDA device is usable: " << why;
  }
  return have;
}

TEST(Device, AutoTrainsWhereItCanAndSaysWhy) {
  const std::string out = TempDir("auto");
  RunResult r = Synthetic(out, "auto");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "replicas_equal"), "true");
  if (HaveGpu()) {
    EXPECT_THAT(r.output, HasSubstr("worker 0: training on cuda:0 ("));
    EXPECT_EQ(Field(summary, "worker_devices"), "[\"cuda:0\", \"cuda:0\"]");
    return;
  }
  EXPECT_THAT(r.output, HasSubstr("worker 0: training on cpu"));
  EXPECT_THAT(r.output, HasSubstr("worker 1: training on cpu"));
  EXPECT_EQ(Field(summary, "worker_devices"), "[\"cpu\", \"cpu\"]");
  if (cuda::BuiltWithCuda()) {
    // One line per worker, saying why.
    EXPECT_THAT(r.output, HasSubstr("onebit-worker: built with CUDA, but no GPU is usable ("));
  } else {
    EXPECT_THAT(r.output, Not(HasSubstr("built with CUDA")));
  }
}

TEST(Device, CudaWithoutAGpuIsAClearError) {
  if (HaveGpu()) GTEST_SKIP() << "this machine has a GPU: --device cuda works here";
  RunResult r = Synthetic(TempDir("nogpu"), "cuda");
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr(cuda::BuiltWithCuda()
                                      ? "--device cuda: no GPU is usable ("
                                      : "--device cuda: this binary was built without CUDA"));
  EXPECT_THAT(r.output, Not(HasSubstr("training on")));  // refused before joining
}

TEST(Device, BadDeviceNamesAreErrors) {
  for (const char* bad : {"gpu", "cuda:x", "cuda:-1", "cuda:99"}) {
    SCOPED_TRACE(bad);
    RunResult r = Synthetic(TempDir("bad"), bad);
    EXPECT_NE(r.code, 0);
    if (std::string(bad) == "cuda:99" && HaveGpu()) {
      EXPECT_THAT(r.output, HasSubstr("--device cuda:99: no GPU 99"));
    } else if (std::string(bad) == "cuda:99") {
      EXPECT_THAT(r.output, HasSubstr("--device cuda:99: "));
    } else {
      EXPECT_THAT(r.output, HasSubstr("--device"));
      EXPECT_THAT(r.output, HasSubstr(bad));
    }
  }
}

TEST(Device, MoreDevicesThanWorkersIsAFlagError) {
  RunResult r = Synthetic(TempDir("many"), "cpu,cpu,cpu");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("--worker_devices: 3 devices for 2 workers"));
}

// The mlp on a mixed cluster: worker 0 on a GPU where one is usable (else the
// CPU), worker 1 the GPU code on its CPU twins, worker 2 the CPU. Gradients
// differ by device (cuBLAS sums in another order than OpenBLAS), replicas
// must not: every worker applies the same replies with the same arithmetic.
TEST(Device, MixedClusterTrainsTheMlpWithEqualReplicas) {
  const std::string out = TempDir("mixed");
  RunResult r =
      RunCommand({Bin("onebit-launch"), "--workers=3", "--servers=2", "--model=mlp",
                  "--layers=784-32-10", "--optimizer=onebit-adam", "--lr=2e-3", "--batch=32",
                  "--max_train=1536", "--max_test=500", "--epochs=3", "--freeze_step=16",
                  "--heartbeat_timeout=3s", "--worker_devices=auto,cuda-twin,cpu", "--out=" + out},
                 absl::Seconds(120));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "steps"), "48");  // 3 epochs of 1536 / (3 × 32)
  EXPECT_EQ(Field(summary, "replicas_equal"), "true");
  EXPECT_EQ(Field(summary, "workers_agree"), "true");
  EXPECT_EQ(Field(summary, "worker_devices"),
            absl::StrCat("[\"", HaveGpu() ? "cuda:0" : "cpu", "\", \"cuda-twin\", \"cpu\"]"));
  EXPECT_THAT(r.output, HasSubstr("worker 1: training on cuda-twin"));
  double acc = 0;
  ASSERT_TRUE(absl::SimpleAtod(Field(summary, "test_accuracy"), &acc)) << summary;
  EXPECT_GT(acc, 0.5);  // chance is 0.1
}

// A CUDA build on a machine without the CUDA libraries: the binaries load
// none of them at start (cuBLAS comes at the first GPU mlp, the runtime is
// static), so a job of CPU and CPU-twin workers trains with cuBLAS made
// unloadable.
TEST(Device, ACudaBuildTrainsOnTheCpuWithoutTheCudaLibraries) {
  if (!cuda::BuiltWithCuda()) GTEST_SKIP() << "built without CUDA: nothing to load lazily";
  for (const char* bin : {"onebit-worker", "onebit-server", "onebit-coordinator"}) {
    RunResult elf = RunCommand({"/usr/bin/readelf", "-d", Bin(bin)}, absl::Seconds(30));
    ASSERT_EQ(elf.code, 0) << elf.output;
    EXPECT_THAT(elf.output, HasSubstr("(NEEDED)")) << bin;
    EXPECT_THAT(elf.output, Not(HasSubstr("libcublas"))) << bin;
    EXPECT_THAT(elf.output, Not(HasSubstr("libcudart"))) << bin;
  }
  const std::string out = TempDir("no_cuda_libs");
  RunResult r = RunCommand({"/usr/bin/env", "ONEBIT_CUBLAS_LIBRARY=/nonexistent/libcublas.so",
                            "LD_LIBRARY_PATH=", Bin("onebit-launch"), "--workers=2", "--servers=1",
                            "--model=mlp", "--layers=784-16-10", "--optimizer=onebit-adam",
                            "--batch=32", "--max_train=640", "--max_test=200", "--epochs=1",
                            "--freeze_step=4", "--worker_devices=cpu,cuda-twin", "--out=" + out},
                           absl::Seconds(120));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(Field(ReadFile(out + "/summary.json"), "replicas_equal"), "true");
  EXPECT_THAT(r.output, Not(HasSubstr("cuBLAS")));
}

}  // namespace
}  // namespace onebit::testing
