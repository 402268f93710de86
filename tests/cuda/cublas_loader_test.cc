// cuBLAS loaded at first use (cuda/cublas_loader.h): the toolkit's library
// with every function the GPU mlp calls, and a missing one as an error that
// names it. No GPU is needed for either.
#include "cuda/cublas_loader.h"

#include <cstdio>
#include <cstdlib>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace onebit::cuda {
namespace {

TEST(CublasLoader, TheToolkitsLibraryLoadsWithEveryFunction) {
  // A CUDA build has the toolkit, and with it cuBLAS.
  absl::StatusOr<const CublasApi*> api = Cublas();
  ASSERT_TRUE(api.ok()) << api.status();
  const CublasApi& b = **api;
  for (const void* fn :
       {reinterpret_cast<const void*>(b.create), reinterpret_cast<const void*>(b.destroy),
        reinterpret_cast<const void*>(b.set_stream), reinterpret_cast<const void*>(b.set_math_mode),
        reinterpret_cast<const void*>(b.set_atomics_mode),
        reinterpret_cast<const void*>(b.sgemm)}) {
    EXPECT_NE(fn, nullptr);
  }
  EXPECT_STREQ(b.status_name(CUBLAS_STATUS_ALLOC_FAILED), "CUBLAS_STATUS_ALLOC_FAILED");
  EXPECT_EQ(Cublas().value(), *api);  // loaded once
}

// In a process of its own: the first outcome is kept for the process's life.
TEST(CublasLoader, AMissingLibraryIsAnErrorNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("ONEBIT_CUBLAS_LIBRARY", "/nonexistent/libcublas.so.13", 1);
        absl::StatusOr<const CublasApi*> api = Cublas();
        std::fprintf(stderr, "%s\n", api.status().ToString().c_str());
        std::exit(api.ok() ? 1 : 0);
      },
      ::testing::ExitedWithCode(0),
      "FAILED_PRECONDITION: the GPU mlp needs cuBLAS, and /nonexistent/libcublas.so.13 cannot be "
      "loaded .*ONEBIT_CUBLAS_LIBRARY");
}

}  // namespace
}  // namespace onebit::cuda
