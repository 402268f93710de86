#include "tests/common/scratch.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace onebit {
namespace {

std::mutex mu;
std::vector<std::string>* test_dirs = nullptr;     // the running test's; guarded by mu
std::vector<std::string>* process_dirs = nullptr;  // guarded by mu

void Remove(const std::vector<std::string>& dirs) {
  for (const std::string& d : dirs) {
    std::error_code ec;  // a folder a stopped process still held: left, not fatal
    std::filesystem::remove_all(d, ec);
  }
}

// Ends each test by removing its folders, or naming them if it failed.
class Cleaner : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    std::vector<std::string> dirs;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (test_dirs != nullptr) dirs.swap(*test_dirs);
    }
    if (info.result() == nullptr || !info.result()->Failed()) {
      Remove(dirs);
      return;
    }
    for (const std::string& d : dirs) {
      std::fprintf(stderr, "%s.%s failed; its scratch folder is kept: %s\n", info.test_suite_name(),
                   info.name(), d.c_str());
    }
  }
};

void RemoveProcessDirs() {
  std::vector<std::string> dirs;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (process_dirs != nullptr) dirs.swap(*process_dirs);
  }
  Remove(dirs);
}

std::string Make(const std::string& prefix, const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(base != nullptr && *base != '\0' ? base : "/tmp", "/",
                                       prefix, "-", getpid(), "-", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

void Register(const std::string& dir, bool per_test) {
  static std::once_flag once;
  std::call_once(once, [] {
    // Owned by gtest once appended.
    ::testing::UnitTest::GetInstance()->listeners().Append(new Cleaner);
    std::atexit(RemoveProcessDirs);
  });
  std::lock_guard<std::mutex> lock(mu);
  std::vector<std::string>*& list = per_test ? test_dirs : process_dirs;
  if (list == nullptr) list = new std::vector<std::string>;  // outlives static destructors
  list->push_back(dir);
}

}  // namespace

std::string ScratchDir(const std::string& prefix, const std::string& name) {
  const std::string dir = Make(prefix, name);
  Register(dir, ::testing::UnitTest::GetInstance()->current_test_info() != nullptr);
  return dir;
}

std::string ScratchDirForProcess(const std::string& prefix, const std::string& name) {
  const std::string dir = Make(prefix, name);
  Register(dir, false);
  return dir;
}

}  // namespace onebit
