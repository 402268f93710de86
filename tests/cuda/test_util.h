// Helpers of the GPU tests: device round trips and bitwise comparisons.
#ifndef ONEBIT_TESTS_CUDA_TEST_UTIL_H_
#define ONEBIT_TESTS_CUDA_TEST_UTIL_H_

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cuda/device.h"
#include "cuda/memory.h"
#include "gtest/gtest.h"

// Skips the test (with the reason) where no GPU is usable; fails instead
// when ONEBIT_REQUIRE_GPU is set, as tools/gpu-check sets it.
#define ONEBIT_REQUIRE_GPU_OR_SKIP()                                                      \
  do {                                                                                    \
    std::string why_;                                                                     \
    if (::onebit::cuda::DeviceCount(&why_) == 0) {                                        \
      if (std::getenv("ONEBIT_REQUIRE_GPU") != nullptr) {                                 \
        FAIL() << "ONEBIT_REQUIRE_GPU is set but no CUDA device is usable: " << why_;     \
      }                                                                                   \
      GTEST_SKIP() << "no CUDA device (" << why_ << "): the GPU kernels cannot run here"; \
    }                                                                                     \
  } while (0)

namespace onebit::cuda::testing {

template <typename T>
DeviceBuffer Upload(const std::vector<T>& host) {
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Create(host.size() * sizeof(T));
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return DeviceBuffer();
  absl::Status st = CopyToDevice(b->data(), host.data(), host.size() * sizeof(T));
  EXPECT_TRUE(st.ok()) << st;
  return std::move(*b);
}

template <typename T>
std::vector<T> Download(const DeviceBuffer& b, size_t n) {
  std::vector<T> host(n);
  absl::Status st = Synchronize(nullptr);
  if (st.ok()) st = CopyToHost(host.data(), b.data(), n * sizeof(T));
  EXPECT_TRUE(st.ok()) << st;
  return host;
}

template <typename T>
std::string Show(T v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, float>) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    os << std::hexfloat << v << " (0x" << std::hex << u << ")";
  } else {
    os << "0x" << std::hex << static_cast<uint64_t>(v);
  }
  return os.str();
}

// Every element of gpu equals cpu bit for bit (-0.0 != +0.0, NaN payloads count).
template <typename T>
::testing::AssertionResult SameBits(const std::vector<T>& gpu, const std::vector<T>& cpu) {
  if (gpu.size() != cpu.size()) {
    return ::testing::AssertionFailure() << "sizes differ: " << gpu.size() << " vs " << cpu.size();
  }
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (std::memcmp(&gpu[i], &cpu[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure()
             << "first difference at element " << i << " of " << gpu.size() << ": gpu "
             << Show(gpu[i]) << ", cpu " << Show(cpu[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace onebit::cuda::testing

#endif  // ONEBIT_TESTS_CUDA_TEST_UTIL_H_
