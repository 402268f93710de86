// Helpers of the GPU mlp tests: a small in-memory data set of random pixels
// and labels (no files needed), and the comparison of GPU and CPU gradients.
#ifndef ONEBIT_TESTS_CUDA_MLP_TEST_UTIL_H_
#define ONEBIT_TESTS_CUDA_MLP_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "models/dataset.h"
#include "models/mlp_model.h"

namespace onebit::cuda::testing {

// Random images (h x w pixels) and labels.
inline std::shared_ptr<const ImageDataset> Data(uint32_t h, uint32_t w, uint32_t train,
                                                uint32_t test, uint32_t seed) {
  std::mt19937 rng(seed);
  auto images = [&](uint32_t count) {
    IdxImages im;
    im.count = count;
    im.rows = h;
    im.cols = w;
    im.pixels.resize(size_t{count} * h * w);
    for (uint8_t& p : im.pixels) p = static_cast<uint8_t>(rng() % 256);
    return im;
  };
  auto labels = [&](uint32_t count) {
    std::vector<uint8_t> y(count);
    for (uint8_t& v : y) v = static_cast<uint8_t>(rng() % ImageDataset::kNumClasses);
    return y;
  };
  IdxImages tr = images(train), te = images(test);
  std::vector<uint8_t> ytr = labels(train), yte = labels(test);
  absl::StatusOr<std::shared_ptr<const ImageDataset>> d =
      ImageDataset::Create(std::move(tr), std::move(ytr), std::move(te), std::move(yte), "random");
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *d : nullptr;
}

// ||gpu - cpu|| / ||cpu|| < tol for each W_l and b_l of m's parameters, and
// each element within tol of the part's largest magnitude.
inline void ExpectGradientsClose(const MlpModel& m, double tol, const std::vector<float>& gpu,
                                 const std::vector<float>& cpu) {
  const std::vector<uint32_t>& layers = m.options().layers;
  for (size_t l = 0; l + 1 < layers.size(); ++l) {
    const uint64_t parts[2][2] = {{m.weight_offset(l), m.bias_offset(l)},
                                  {m.bias_offset(l), m.bias_offset(l) + layers[l + 1]}};
    for (int p = 0; p < 2; ++p) {
      SCOPED_TRACE(absl::StrCat(p == 0 ? "W" : "b", l));
      double diff2 = 0, ref2 = 0, amax = 0;
      for (uint64_t j = parts[p][0]; j < parts[p][1]; ++j) {
        diff2 += (double{gpu[j]} - cpu[j]) * (double{gpu[j]} - cpu[j]);
        ref2 += double{cpu[j]} * cpu[j];
        amax = std::max(amax, std::fabs(double{cpu[j]}));
      }
      ASSERT_GT(ref2, 0) << "a zero CPU gradient compares nothing";
      EXPECT_LT(std::sqrt(diff2 / ref2), tol);
      for (uint64_t j = parts[p][0]; j < parts[p][1]; ++j) {
        ASSERT_LE(std::fabs(double{gpu[j]} - cpu[j]), tol * amax)
            << "element " << j - parts[p][0] << ": gpu " << gpu[j] << " cpu " << cpu[j];
      }
    }
  }
}

}  // namespace onebit::cuda::testing

#endif  // ONEBIT_TESTS_CUDA_MLP_TEST_UTIL_H_
