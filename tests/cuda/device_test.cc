// Tests for GPU discovery (cuda/device.h): it never crashes, agrees with the
// build, and on a machine without a GPU says 0 and why.
#include "cuda/device.h"

#include <sys/stat.h>

#include <string>

#include "gtest/gtest.h"

namespace onebit::cuda {
namespace {

bool PathExists(const char* path) {
  struct stat st;
  return stat(path, &st) == 0;
}

// No NVIDIA kernel driver on this machine: no CUDA device can be usable.
bool NoNvidiaDriver() {
  return !PathExists("/dev/nvidiactl") && !PathExists("/proc/driver/nvidia/version");
}

TEST(CudaDeviceTest, BuiltWithCudaAgreesWithCompileDefinition) {
#if defined(ONEBIT_WITH_CUDA) && ONEBIT_WITH_CUDA
  EXPECT_TRUE(BuiltWithCuda());
#else
  EXPECT_FALSE(BuiltWithCuda());
#endif
}

TEST(CudaDeviceTest, DeviceCountNeverCrashesAndIsConsistent) {
  const int a = DeviceCount();
  const int b = DeviceCount(nullptr);
  std::string why;
  const int c = DeviceCount(&why);
  EXPECT_GE(a, 0);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
  if (c == 0) {
    EXPECT_FALSE(why.empty()) << "DeviceCount returned 0 without a reason";
  }
  if (!BuiltWithCuda()) {
    EXPECT_EQ(c, 0) << "a binary built without CUDA cannot see a device";
  }
}

TEST(CudaDeviceTest, NoGpuHereMeansZeroWithReason) {
  if (BuiltWithCuda() && !NoNvidiaDriver()) {
    GTEST_SKIP() << "this machine has an NVIDIA driver; the no-GPU path is not reachable";
  }
  std::string why = "";
  EXPECT_EQ(DeviceCount(&why), 0);
  EXPECT_FALSE(why.empty());
}

}  // namespace
}  // namespace onebit::cuda
