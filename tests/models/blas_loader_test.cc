// OpenBLAS loaded at first use (models/blas_loader.h): not in a process
// until a model needs it, then with every function the CPU models call; a
// library that cannot be loaded is an error that names it.
#include "models/blas_loader.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace onebit {
namespace {

bool OpenBlasMapped() {
  std::ifstream maps("/proc/self/maps");
  std::stringstream text;
  text << maps.rdbuf();
  return text.str().find("libopenblas") != std::string::npos;
}

// Before and after, in this order, in one process: the first test that
// loads it is this one (the other loads nothing in this process).
TEST(BlasLoader, NotLoadedUntilAskedThenEveryFunctionIsThere) {
  EXPECT_FALSE(OpenBlasMapped()) << "OpenBLAS is linked, or loaded before it was needed";
  absl::StatusOr<const BlasApi*> api = Blas();
  ASSERT_TRUE(api.ok()) << api.status();
  EXPECT_TRUE(OpenBlasMapped());
  ASSERT_NE((*api)->sgemm, nullptr);
  ASSERT_NE((*api)->set_num_threads, nullptr);
  // [1 2; 3 4] · [5 6; 7 8] = [19 22; 43 50]
  const float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
  float c[4] = {};
  (*api)->sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 2, 2, 2, 1.0f, a, 2, b, 2, 0.0f, c, 2);
  EXPECT_THAT(c, ::testing::ElementsAre(19.0f, 22.0f, 43.0f, 50.0f));
  EXPECT_EQ(Blas().value(), *api);  // loaded once
}

// In a process of its own: the first outcome is kept for the process's life.
TEST(BlasLoader, AMissingLibraryIsAnErrorNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("ONEBIT_BLAS_LIBRARY", "/nonexistent/libopenblas.so.0", 1);
        absl::StatusOr<const BlasApi*> api = Blas();
        std::fprintf(stderr, "%s\n", api.status().ToString().c_str());
        std::exit(api.ok() ? 1 : 0);
      },
      ::testing::ExitedWithCode(0),
      "FAILED_PRECONDITION: the mlp and softmax models need OpenBLAS, and "
      "/nonexistent/libopenblas.so.0 cannot be loaded .*ONEBIT_BLAS_LIBRARY");
}

}  // namespace
}  // namespace onebit
