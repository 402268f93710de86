// Tests for the twin's shared device memory (cuda/backend.h: alloc_shared,
// export_memory, import_memory, close_imported), the way a host's local
// ranks add their gradients on the devices: another process maps what one
// exported and each sees the other's writes; bad handles are refused by
// name.
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "cuda/backend.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace onebit::cuda {
namespace {

using ::testing::HasSubstr;

TEST(TwinSharedMemory, AnotherProcessMapsItAndEachSeesTheOthersWrites) {
  const Backend& b = TwinBackend();
  constexpr size_t kN = 100000;
  auto p = b.alloc_shared(4 * kN);
  ASSERT_TRUE(p.ok()) << p.status();
  float* x = static_cast<float*>(*p);
  for (size_t i = 0; i < kN; ++i) x[i] = static_cast<float>(i) * 0.5f;
  auto handle = b.export_memory(x, 4 * kN);
  ASSERT_TRUE(handle.ok()) << handle.status();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Only async-signal-safe work would be strictly allowed here; the test
    // process has no other threads, so the backend's calls are fine.
    auto q = b.import_memory(*handle, 4 * kN);
    if (!q.ok()) _exit(2);
    float* y = static_cast<float*>(*q);
    for (size_t i = 0; i < kN; ++i) {
      if (y[i] != static_cast<float>(i) * 0.5f) _exit(3);
      y[i] = -y[i];
    }
    b.close_imported(y, 4 * kN);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: import failed; 3: the values differed";
  for (size_t i = 0; i < kN; i += 997) EXPECT_EQ(x[i], -static_cast<float>(i) * 0.5f) << i;
  b.free(x);
}

TEST(TwinSharedMemory, BadHandlesAndOtherMemoryAreRefusedByName) {
  const Backend& b = TwinBackend();
  auto p = b.alloc_shared(4096);
  ASSERT_TRUE(p.ok()) << p.status();
  auto handle = b.export_memory(*p, 4096);
  ASSERT_TRUE(handle.ok()) << handle.status();
  // More than was shared.
  auto big = b.import_memory(*handle, 8192);
  ASSERT_FALSE(big.ok());
  EXPECT_THAT(big.status().message(), HasSubstr("fewer than the 8192 asked for"));
  auto junk = b.import_memory("not a handle", 4096);
  ASSERT_FALSE(junk.ok());
  EXPECT_THAT(junk.status().message(), HasSubstr("is not a handle of the twin's memory"));
  auto gone = b.import_memory(std::to_string(getpid()) + " 100000", 4096);
  ASSERT_FALSE(gone.ok());
  EXPECT_THAT(gone.status().message(), HasSubstr("/fd/100000"));
  // Memory of alloc, not alloc_shared, has no handle.
  auto plain = b.alloc(4096);
  ASSERT_TRUE(plain.ok());
  auto none = b.export_memory(*plain, 4096);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(), HasSubstr("not memory of alloc_shared"));
  b.free(*plain);
  b.free(*p);
}

}  // namespace
}  // namespace onebit::cuda
