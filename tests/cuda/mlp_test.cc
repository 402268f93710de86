// The GPU mlp (cuda/mlp.h) against the CPU one (models/mlp_model.h).
// Elementwise kernels (bias add, ReLU, its mask, bias gradients) must equal
// their CPU twins bit for bit; softmax cross-entropy uses the same double
// formula, but CUDA's exp/log need not round as glibc's, so its outputs may
// differ by an ulp. GEMMs sum in another order than OpenBLAS: gradients must
// agree to 1e-4 relative (2-norm of each W_l and b_l, and each element
// against the part's largest), losses to 1e-5 relative. Skipped where no GPU
// is usable, except the tests that need none.
#include "cuda/mlp.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/device.h"
#include "models/dataset.h"
#include "models/mlp_model.h"
#include "tests/cuda/mlp_test_util.h"
#include "tests/cuda/test_util.h"

namespace onebit::cuda {
namespace {

using testing::Data;
using testing::Download;
using testing::ExpectGradientsClose;
using testing::SameBits;
using testing::Upload;

constexpr double kGradTol = 1e-4;
constexpr double kLossTol = 1e-5;

std::vector<float> Normal(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng) * scale;
  return v;
}

// Distance in units in the last place (same sign assumed; 0 for equal bits).
int64_t UlpDistance(double a, double b) {
  int64_t ia, ib;
  std::memcpy(&ia, &a, 8);
  std::memcpy(&ib, &b, 8);
  return ia > ib ? ia - ib : ib - ia;
}
int64_t UlpDistance(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return ia > ib ? int64_t{ia} - ib : int64_t{ib} - ia;
}

TEST(CudaMlpKernels, BiasActMatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  const size_t shapes[][2] = {{1, 1}, {3, 33}, {64, 256}, {1000, 10}, {7, 4099}};
  for (const auto& sh : shapes) {
    for (bool relu : {false, true}) {
      const size_t rows = sh[0], n = sh[1];
      SCOPED_TRACE(absl::StrCat(rows, "x", n, relu ? " relu" : ""));
      std::vector<float> out = Normal(rows * n, 1 + rows + n), b = Normal(n, 2 + n);
      out[0] = std::numeric_limits<float>::quiet_NaN();
      if (out.size() > 5) out[5] = -0.0f;
      if (n > 2) b[2] = -0.0f;
      DeviceBuffer d_out = Upload(out), d_b = Upload(b);
      ASSERT_TRUE(
          mlp_internal::BiasAct(d_out.as<float>(), d_b.as<float>(), rows, n, relu, nullptr).ok());
      mlp_internal::BiasActCpu(out.data(), b.data(), rows, n, relu);
      EXPECT_TRUE(SameBits(Download<float>(d_out, out.size()), out));
    }
  }
}

TEST(CudaMlpKernels, ReluMaskMatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  for (size_t n : {size_t{0}, size_t{1}, size_t{31}, size_t{33}, (size_t{1} << 20) + 7}) {
    SCOPED_TRACE(n);
    std::vector<float> da = Normal(n, 3), a = Normal(n, 4);
    for (size_t i = 0; i < n; i += 13) a[i] = i % 2 ? 0.0f : -0.0f;
    if (n > 0) a[n - 1] = std::numeric_limits<float>::quiet_NaN();
    DeviceBuffer d_da = Upload(da), d_a = Upload(a);
    ASSERT_TRUE(mlp_internal::ReluMask(d_da.as<float>(), d_a.as<float>(), n, nullptr).ok());
    mlp_internal::ReluMaskCpu(da.data(), a.data(), n);
    EXPECT_TRUE(SameBits(Download<float>(d_da, n), da));
  }
}

TEST(CudaMlpKernels, BiasGradMatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  const size_t shapes[][2] = {{1, 1}, {64, 256}, {1000, 10}, {33, 1025}, {4097, 3}, {0, 5}};
  for (const auto& sh : shapes) {
    const size_t rows = sh[0], n = sh[1];
    SCOPED_TRACE(absl::StrCat(rows, "x", n));
    std::vector<float> dz = Normal(rows * n, 5 + rows, 1e-2f), gb(n, 7.0f);
    DeviceBuffer d_dz = Upload(dz), d_gb = Upload(gb);
    ASSERT_TRUE(mlp_internal::BiasGrad(d_dz.as<float>(), rows, n, d_gb.as<float>(), nullptr).ok());
    mlp_internal::BiasGradCpu(dz.data(), rows, n, gb.data());
    EXPECT_TRUE(SameBits(Download<float>(d_gb, n), gb));
  }
}

TEST(CudaMlpKernels, SoftmaxXentMatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  const size_t shapes[][2] = {{1, 10}, {64, 10}, {1000, 10}, {5, 1}, {33, 256}};
  size_t exact_delta = 0, all_delta = 0, exact_loss = 0, all_loss = 0;
  for (const auto& sh : shapes) {
    const size_t rows = sh[0], classes = sh[1];
    SCOPED_TRACE(absl::StrCat(rows, "x", classes));
    std::vector<float> z = Normal(rows * classes, 6 + rows, 3.0f);
    std::vector<uint8_t> y(rows);
    for (size_t i = 0; i < rows; ++i) y[i] = static_cast<uint8_t>((i * 7) % classes);
    // Large logits (log-sum-exp must not overflow) and ties (lowest class wins).
    z[0] = 1e4f;
    if (rows > 2 && classes > 3) {
      z[2 * classes + 1] = z[2 * classes + 3] = 50.0f;
      y[2] = 3;
    }
    const float scale = 1.0f / static_cast<float>(rows);
    std::vector<float> delta(rows * classes, -1.0f);
    std::vector<double> loss(rows);
    std::vector<uint8_t> flag(rows);
    DeviceBuffer d_z = Upload(z), d_y = Upload(y), d_delta = Upload(delta), d_loss = Upload(loss),
                 d_flag = Upload(flag);
    ASSERT_TRUE(mlp_internal::SoftmaxXent(d_z.as<float>(), d_y.as<uint8_t>(), rows, classes, scale,
                                          d_delta.as<float>(), d_loss.as<double>(),
                                          d_flag.as<uint8_t>(), nullptr)
                    .ok());
    mlp_internal::SoftmaxXentCpu(z.data(), y.data(), rows, classes, scale, delta.data(),
                                 loss.data(), flag.data());
    const std::vector<float> g_delta = Download<float>(d_delta, delta.size());
    const std::vector<double> g_loss = Download<double>(d_loss, rows);
    EXPECT_EQ(Download<uint8_t>(d_flag, rows), flag);
    if (rows > 2 && classes > 3) {
      EXPECT_EQ(flag[2], 0) << "a tie goes to the lowest class";
    }
    // An ulp of exp or log in double becomes at most an ulp of the float
    // gradient, except where p - 1 cancels (p near 1): there the double
    // error, a few 1e-16, stays absolute. The row loss adds logits of up to
    // 1e4, so its error is relative to those.
    for (size_t i = 0; i < delta.size(); ++i) {
      const double diff = std::fabs(double{g_delta[i]} - delta[i]);
      ASSERT_TRUE(UlpDistance(g_delta[i], delta[i]) <= 1 || diff <= 1e-15 * scale)
          << "delta " << i << ": gpu " << g_delta[i] << " cpu " << delta[i];
      exact_delta += g_delta[i] == delta[i];
    }
    for (size_t i = 0; i < rows; ++i) {
      double zmax = 1;
      for (size_t k = 0; k < classes; ++k)
        zmax = std::max(zmax, std::fabs(double{z[i * classes + k]}));
      const double diff = std::fabs(g_loss[i] - loss[i]);
      ASSERT_TRUE(UlpDistance(g_loss[i], loss[i]) <= 8 || diff <= 1e-15 * zmax)
          << "loss of row " << i << ": gpu " << g_loss[i] << " cpu " << loss[i];
      exact_loss += g_loss[i] == loss[i];
    }
    all_delta += delta.size();
    all_loss += rows;
  }
  std::printf("softmax: %zu of %zu gradients and %zu of %zu row losses bitwise equal to the CPU\n",
              exact_delta, all_delta, exact_loss, all_loss);
}

TEST(CudaMlpKernels, SoftmaxXentFlagsBadLabels) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  std::vector<float> z = Normal(30, 7);
  std::vector<uint8_t> y = {1, 10, 9};
  std::vector<double> loss(3);
  std::vector<uint8_t> flag(3);
  DeviceBuffer d_z = Upload(z), d_y = Upload(y), d_loss = Upload(loss), d_flag = Upload(flag);
  ASSERT_TRUE(mlp_internal::SoftmaxXent(d_z.as<float>(), d_y.as<uint8_t>(), 3, 10, 1.0f, nullptr,
                                        d_loss.as<double>(), d_flag.as<uint8_t>(), nullptr)
                  .ok());
  const std::vector<uint8_t> g_flag = Download<uint8_t>(d_flag, 3);
  EXPECT_EQ(g_flag[1], 2);
  EXPECT_TRUE(std::isnan(Download<double>(d_loss, 3)[1]));
}

struct Fixture {
  std::shared_ptr<const ImageDataset> data;
  std::unique_ptr<MlpModel> cpu;
  std::unique_ptr<MlpDevice> gpu;
  std::vector<float> x;
};

Fixture Make(const std::vector<uint32_t>& layers, uint32_t h, uint32_t w, uint32_t batch,
             size_t gpu_batch, uint32_t seed) {
  Fixture s;
  s.data = Data(h, w, 2000, 1000, seed);
  MlpOptions o;
  o.layers = layers;
  o.seed = seed;
  o.batch = batch;
  o.eval_batch = 250;
  absl::StatusOr<std::unique_ptr<MlpModel>> cpu = MlpModel::Create(o, s.data);
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  if (!cpu.ok()) return s;
  s.cpu = *std::move(cpu);
  absl::StatusOr<std::unique_ptr<MlpDevice>> gpu = MlpDevice::Create(layers, gpu_batch);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (!gpu.ok()) return s;
  s.gpu = *std::move(gpu);
  EXPECT_EQ(s.gpu->num_params(), s.cpu->num_params());
  s.x.resize(s.cpu->num_params());
  s.cpu->Init(s.x.data());
  // Non-zero biases, so that the bias add is exercised.
  std::vector<float> b = Normal(s.x.size(), seed + 1, 0.1f);
  for (size_t l = 0; l + 1 < layers.size(); ++l) {
    for (uint64_t j = s.cpu->bias_offset(l); j < s.cpu->bias_offset(l) + layers[l + 1]; ++j) {
      s.x[j] = b[j];
    }
  }
  return s;
}

void CheckGradients(const std::vector<uint32_t>& layers, uint32_t h, uint32_t w, uint32_t batch,
                    size_t gpu_batch) {
  SCOPED_TRACE(absl::StrCat(absl::StrJoin(layers, "-"), " batch ", batch));
  Fixture s = Make(layers, h, w, batch, gpu_batch, 11 + batch);
  ASSERT_NE(s.gpu, nullptr);
  const uint32_t dim = layers[0];
  DeviceBuffer d_x = Upload(s.x);
  absl::StatusOr<DeviceBuffer> d_g = DeviceBuffer::Create(s.x.size() * 4);
  ASSERT_TRUE(d_g.ok()) << d_g.status();
  for (uint64_t step : {0, 1, 7}) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    std::vector<uint32_t> idx(batch);
    std::vector<float> images(size_t{batch} * dim);
    std::vector<uint8_t> labels(batch);
    ASSERT_TRUE(s.cpu->sampler().BatchIndices(0, step, idx.data()).ok());
    s.data->GatherTrain(idx.data(), batch, images.data(), labels.data());
    DeviceBuffer d_images = Upload(images), d_labels = Upload(labels);

    std::vector<float> g_cpu(s.x.size());
    absl::StatusOr<double> loss_cpu = s.cpu->Gradient(s.x.data(), 0, step, g_cpu.data());
    ASSERT_TRUE(loss_cpu.ok()) << loss_cpu.status();
    absl::StatusOr<double> loss_gpu = s.gpu->Gradient(
        d_x.as<float>(), d_images.as<float>(), d_labels.as<uint8_t>(), batch, d_g->as<float>());
    ASSERT_TRUE(loss_gpu.ok()) << loss_gpu.status();
    EXPECT_LE(std::fabs(*loss_gpu - *loss_cpu), kLossTol * std::fabs(*loss_cpu))
        << "gpu " << *loss_gpu << " cpu " << *loss_cpu;
    const std::vector<float> g_gpu = Download<float>(*d_g, s.x.size());
    ExpectGradientsClose(*s.cpu, kGradTol, g_gpu, g_cpu);

    // The same call again gives the same bits (no atomics, no TF32).
    absl::StatusOr<double> again = s.gpu->Gradient(d_x.as<float>(), d_images.as<float>(),
                                                   d_labels.as<uint8_t>(), batch, d_g->as<float>());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(*again, *loss_gpu);
    EXPECT_TRUE(SameBits(Download<float>(*d_g, s.x.size()), g_gpu));
  }
}

TEST(CudaMlp, GradientMatchesCpuDefaultShape) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  CheckGradients({784, 256, 128, 10}, 28, 28, 64, 64);
}

TEST(CudaMlp, GradientMatchesCpuOddShapes) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  CheckGradients({35, 10}, 5, 7, 1, 1);            // no hidden layer, one example
  CheckGradients({35, 33, 17, 10}, 5, 7, 33, 40);  // odd widths, batch below capacity
  CheckGradients({784, 300, 10}, 28, 28, 257, 1000);
}

TEST(CudaMlp, EvaluateMatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  // 1000 test examples in chunks of 64: 15 full ones and one of 40.
  Fixture s = Make({784, 256, 128, 10}, 28, 28, 64, 64, 5);
  ASSERT_NE(s.gpu, nullptr);
  const size_t n = s.data->num_test(), dim = s.data->dim();
  std::vector<float> images(n * dim);
  std::vector<uint8_t> labels(n);
  s.data->GatherTest(0, n, images.data(), labels.data());
  DeviceBuffer d_x = Upload(s.x), d_images = Upload(images), d_labels = Upload(labels);
  absl::StatusOr<EvalResult> cpu = s.cpu->Evaluate(s.x.data());
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  absl::StatusOr<EvalResult> gpu =
      s.gpu->Evaluate(d_x.as<float>(), d_images.as<float>(), d_labels.as<uint8_t>(), n);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ(gpu->examples, n);
  EXPECT_LE(std::fabs(gpu->loss - cpu->loss), kLossTol * cpu->loss)
      << "gpu " << gpu->loss << " cpu " << cpu->loss;
  // An arg-max can flip only where two logits are within rounding of each
  // other: at most one such example of 1000 is allowed.
  EXPECT_LE(std::fabs(gpu->accuracy - cpu->accuracy) * n, 1.0 + 1e-9)
      << "gpu " << gpu->accuracy << " cpu " << cpu->accuracy;
  absl::StatusOr<EvalResult> none =
      s.gpu->Evaluate(d_x.as<float>(), d_images.as<float>(), d_labels.as<uint8_t>(), 0);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->examples, 0u);

  // The logits of Forward give the same arg-max and loss as Evaluate's chunk.
  absl::StatusOr<const float*> logits = s.gpu->Forward(d_x.as<float>(), d_images.as<float>(), 64);
  ASSERT_TRUE(logits.ok()) << logits.status();
  std::vector<float> z(64 * 10);
  ASSERT_TRUE(CopyToHost(z.data(), *logits, z.size() * 4).ok());
  for (float v : z) ASSERT_TRUE(std::isfinite(v));
}

TEST(CudaMlp, BadInputsAreErrors) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  Fixture s = Make({35, 16, 10}, 5, 7, 8, 8, 3);
  ASSERT_NE(s.gpu, nullptr);
  std::vector<float> images(8 * 35, 0.5f);
  std::vector<uint8_t> labels(8, 3);
  DeviceBuffer d_x = Upload(s.x), d_images = Upload(images);
  absl::StatusOr<DeviceBuffer> d_g = DeviceBuffer::Create(s.x.size() * 4);
  ASSERT_TRUE(d_g.ok());
  for (size_t batch : {size_t{0}, size_t{9}}) {
    DeviceBuffer d_labels = Upload(labels);
    absl::StatusOr<double> r = s.gpu->Gradient(d_x.as<float>(), d_images.as<float>(),
                                               d_labels.as<uint8_t>(), batch, d_g->as<float>());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  }
  labels[5] = 10;
  DeviceBuffer d_bad = Upload(labels);
  absl::StatusOr<double> r = s.gpu->Gradient(d_x.as<float>(), d_images.as<float>(),
                                             d_bad.as<uint8_t>(), 8, d_g->as<float>());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("row 5"), std::string::npos) << r.status();
  absl::StatusOr<EvalResult> e =
      s.gpu->Evaluate(d_x.as<float>(), d_images.as<float>(), d_bad.as<uint8_t>(), 8);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();

  // A non-finite weight shows up as an error, not as a silent NaN gradient.
  labels[5] = 3;
  DeviceBuffer d_labels = Upload(labels);
  std::vector<float> x = s.x;
  x[s.gpu->weight_offset(1) + 3] = std::numeric_limits<float>::infinity();
  DeviceBuffer d_inf = Upload(x);
  r = s.gpu->Gradient(d_inf.as<float>(), d_images.as<float>(), d_labels.as<uint8_t>(), 8,
                      d_g->as<float>());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("not finite"), std::string::npos) << r.status();
}

// Needs no GPU: shapes are checked before any device call.
TEST(CudaMlpCreate, RejectsBadShapes) {
  const std::vector<std::vector<uint32_t>> bad = {{784}, {784, 0, 10}, {784, 300}, {}};
  for (const std::vector<uint32_t>& layers : bad) {
    absl::StatusOr<std::unique_ptr<MlpDevice>> m = MlpDevice::Create(layers, 64);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument)
        << absl::StrJoin(layers, "-") << ": " << m.status();
  }
  EXPECT_EQ(MlpDevice::Create({784, 10}, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// A CUDA build on a machine without a GPU: a clear error, no crash.
TEST(CudaMlpWithoutGpu, CreateFailsWithCudaText) {
  if (DeviceCount() > 0) GTEST_SKIP() << "a GPU is usable here: no CPU-only path";
  absl::StatusOr<std::unique_ptr<MlpDevice>> m = MlpDevice::Create({784, 256, 128, 10}, 64);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(std::string(m.status().message()).find("CUDA error"), std::string::npos) << m.status();
  std::printf("without a GPU: %s\n", m.status().ToString().c_str());
}

}  // namespace
}  // namespace onebit::cuda
