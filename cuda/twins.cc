// CPU twins that compress/ and shard/ do not already have with the GPU
// signature: the fused error-feedback encode with separate error buffers.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/kernels.h"
#include "cuda/kernels.h"

namespace onebit::cuda {

absl::Status OnebitEncodeCpu(const float* y, const float* e_in, float* e_out, size_t n,
                             uint32_t block, ScaleRule rule, uint8_t* out) {
  if (block < 32 || block % 32 != 0 || block > (1u << 24)) {
    return absl::InvalidArgumentError("block size must be a multiple of 32 in [32, 2^24]");
  }
  if (n == 0) return absl::OkStatus();
  const compress_internal::Kernels& k = compress_internal::ScalarKernels();
  const size_t blocks = (n + block - 1) / block;
  std::vector<float> scales(blocks);
  const size_t bad = k.onebit_scales(y, e_in, n, block, rule, scales.data());
  for (size_t b = 0; b * block < std::min(bad, n) && b < blocks; ++b) {
    if (!std::isfinite(scales[b])) {
      return absl::InvalidArgumentError(absl::StrCat("onebit: the ", ScaleRuleName(rule),
                                                     " scale of block ", b, " (elements from ",
                                                     b * block, ") overflows fp32"));
    }
  }
  if (bad < n) return absl::InvalidArgumentError(absl::StrCat("non-finite input at index ", bad));
  std::memcpy(out, scales.data(), 4 * blocks);
  uint8_t* bits = out + 4 * blocks;
  if (e_in != nullptr) {
    std::vector<float> e(e_in, e_in + n);
    k.onebit_signs(y, e.data(), n, block, scales.data(), bits);
    if (e_out != nullptr) std::copy(e.begin(), e.end(), e_out);
    return absl::OkStatus();
  }
  k.onebit_signs(y, nullptr, n, block, scales.data(), bits);
  if (e_out != nullptr) {
    // z = y exactly (adding a zero error would turn -0.0 into +0.0).
    for (size_t i = 0; i < n; ++i) {
      const float s = scales[i / block];
      e_out[i] = y[i] - ((bits[i / 8] >> (i % 8)) & 1 ? -s : s);
    }
  }
  return absl::OkStatus();
}

}  // namespace onebit::cuda
