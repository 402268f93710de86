#include "tests/common/scratch.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

struct Child {
  int code;
  std::string output;
};

// scratch_child (scratch_child.cc) with its scratch folders under tmp.
Child RunChild(const std::string& tmp, const std::string& filter) {
  const std::string out = tmp + "/child.log";
  const pid_t pid = fork();
  if (pid == 0) {
    setenv("TEST_TMPDIR", tmp.c_str(), 1);
    std::freopen(out.c_str(), "w", stderr);
    std::freopen(out.c_str(), "a", stdout);
    const std::string f = "--gtest_filter=" + filter;
    execl(ONEBIT_SCRATCH_CHILD, "scratch_child", f.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(out);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, text};
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  return names;
}

TEST(Scratch, APassedTestsFoldersGoAndAFailedTestsStayNamed) {
  char tmpl[] = "/tmp/onebit-scratch-test.XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string tmp = tmpl;

  Child pass = RunChild(tmp, "ScratchChild.Passes:ScratchChild.Shares");
  EXPECT_EQ(pass.code, 0) << pass.output;
  EXPECT_TRUE(Entries(tmp).empty()) << "left: " << ::testing::PrintToString(Entries(tmp));

  Child fail = RunChild(tmp, "ScratchChild.Fails");
  EXPECT_EQ(fail.code, 1) << fail.output;
  const std::vector<std::string> left = Entries(tmp);
  ASSERT_EQ(left.size(), 1u) << ::testing::PrintToString(left);
  EXPECT_THAT(left[0], HasSubstr("onebit-scratch-"));
  EXPECT_THAT(left[0], HasSubstr("-fails"));
  EXPECT_TRUE(std::filesystem::exists(tmp + "/" + left[0] + "/data"));
  EXPECT_THAT(fail.output, HasSubstr("ScratchChild.Fails failed; its scratch folder is "
                                     "kept: " +
                                     tmp + "/" + left[0]));
  std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace onebit
