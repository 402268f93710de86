// The mlp's small kernels (cuda/mlp.h, mlp_internal); their CPU twins are in
// mlp.cc. Built with -fmad=false and IEEE division so that every float
// operation rounds as on the CPU.
#include <cuda_runtime_api.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_status.h"
#include "cuda/mlp.h"

namespace onebit::cuda {
namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 4096;  // grid-stride loops beyond this
constexpr size_t kMaxClasses = 256;  // as the CPU model's p[256]

unsigned Blocks(size_t n) {
  return static_cast<unsigned>(std::min(kMaxBlocks, (n + kThreads - 1) / kThreads));
}

absl::Status Launched(const char* what) { return CudaError(cudaGetLastError(), what); }

__global__ void BiasActKernel(float* out, const float* b, size_t rows, size_t n, bool relu) {
  const size_t total = rows * n;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total;
       i += size_t{gridDim.x} * blockDim.x) {
    const float v = out[i] + b[i % n];
    // NaN passes through (v < 0 is false), as on the CPU.
    out[i] = relu && v < 0.0f ? 0.0f : v;
  }
}

__global__ void ReluMaskKernel(float* da, const float* a, size_t count) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count;
       i += size_t{gridDim.x} * blockDim.x) {
    da[i] = a[i] > 0.0f ? da[i] : 0.0f;
  }
}

// One thread per column, rows in order: the CPU's float sum, bit for bit.
// Neighbouring threads read neighbouring columns, so the loads coalesce.
__global__ void BiasGradKernel(const float* dz, size_t rows, size_t n, float* gb) {
  for (size_t k = blockIdx.x * size_t{blockDim.x} + threadIdx.x; k < n;
       k += size_t{gridDim.x} * blockDim.x) {
    float s = 0.0f;
    for (size_t i = 0; i < rows; ++i) s += dz[i * n + k];
    gb[k] = s;
  }
}

// One thread per row (the output layer is narrow): the CPU's RowLoss and
// gradient loop, in the same order and precision.
__global__ void SoftmaxXentKernel(const float* z, const uint8_t* y, size_t rows, size_t classes,
                                  float scale, float* delta, double* loss, uint8_t* flag) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < rows;
       i += size_t{gridDim.x} * blockDim.x) {
    const float* zi = z + i * classes;
    const size_t yi = y[i];
    if (yi >= classes) {
      loss[i] = nan("");
      if (flag != nullptr) flag[i] = 2;
      continue;
    }
    float mx = zi[0];
    size_t best = 0;
    for (size_t k = 1; k < classes; ++k) {
      mx = mx < zi[k] ? zi[k] : mx;    // std::max(mx, z[k])
      if (zi[best] < zi[k]) best = k;  // std::max_element
    }
    const double dmx = static_cast<double>(mx);
    double sum = 0;
    for (size_t k = 0; k < classes; ++k) sum += exp(static_cast<double>(zi[k]) - dmx);
    if (delta != nullptr) {
      float* di = delta + i * classes;
      for (size_t k = 0; k < classes; ++k) {
        double p = exp(static_cast<double>(zi[k]) - dmx) / sum;
        if (k == yi) p -= 1.0;
        di[k] = static_cast<float>(p) * scale;
      }
    }
    loss[i] = dmx + log(sum) - static_cast<double>(zi[yi]);
    if (flag != nullptr) flag[i] = best == yi ? 1 : 0;
  }
}

}  // namespace

namespace mlp_internal {

absl::Status BiasAct(float* out, const float* b, size_t rows, size_t n, bool relu, Stream stream) {
  if (rows == 0 || n == 0) return absl::OkStatus();
  BiasActKernel<<<Blocks(rows * n), kThreads, 0, stream>>>(out, b, rows, n, relu);
  return Launched("BiasAct kernel launch");
}

absl::Status ReluMask(float* da, const float* a, size_t count, Stream stream) {
  if (count == 0) return absl::OkStatus();
  ReluMaskKernel<<<Blocks(count), kThreads, 0, stream>>>(da, a, count);
  return Launched("ReluMask kernel launch");
}

absl::Status BiasGrad(const float* dz, size_t rows, size_t n, float* gb, Stream stream) {
  if (n == 0) return absl::OkStatus();
  BiasGradKernel<<<Blocks(n), kThreads, 0, stream>>>(dz, rows, n, gb);
  return Launched("BiasGrad kernel launch");
}

absl::Status SoftmaxXent(const float* z, const uint8_t* y, size_t rows, size_t classes, float scale,
                         float* delta, double* loss, uint8_t* flag, Stream stream) {
  if (rows == 0) return absl::OkStatus();
  if (classes == 0 || classes > kMaxClasses) {
    return absl::InvalidArgumentError(
        absl::StrCat("SoftmaxXent: ", classes, " classes, need 1 to ", kMaxClasses));
  }
  SoftmaxXentKernel<<<Blocks(rows), kThreads, 0, stream>>>(z, y, rows, classes, scale, delta, loss,
                                                           flag);
  return Launched("SoftmaxXent kernel launch");
}

}  // namespace mlp_internal
}  // namespace onebit::cuda
