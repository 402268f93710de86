// The tests scratch_test runs in a process of their own (not registered
// with ctest: one of them fails on purpose).
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/common/scratch.h"

namespace onebit {
namespace {

TEST(ScratchChild, Passes) {
  const std::string dir = ScratchDir("onebit-scratch", "passes");
  std::ofstream(dir + "/data") << "x";
  EXPECT_TRUE(std::filesystem::exists(dir + "/data"));
}

TEST(ScratchChild, Fails) {
  const std::string dir = ScratchDir("onebit-scratch", "fails");
  std::ofstream(dir + "/data") << "x";
  ADD_FAILURE() << "failing on purpose";
}

TEST(ScratchChild, Shares) {
  const std::string dir = ScratchDirForProcess("onebit-scratch", "shared");
  std::ofstream(dir + "/data") << "x";
}

}  // namespace
}  // namespace onebit
