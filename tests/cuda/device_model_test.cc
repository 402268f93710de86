// The GPU models (worker/device_model.h, worker/cuda_models.cc) against the
// host ones: the synthetic gradient bit for bit (the same per-coordinate code,
// no FMA) and its loss to 1e-12 relative (another summation order); the mlp's
// gradient to 1e-4 relative and its losses to 1e-5 (cuBLAS sums in another
// order than OpenBLAS, as tests/cuda/mlp_test.cc allows). The work runs on a
// non-blocking stream of its own, as in the worker. Skipped where no GPU is
// usable, except the tests that need none (unsupported models, the error a
// GPU-less machine gets, benchmark mode).
#include "worker/device_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/backend.h"
#include "cuda/device.h"
#include "gmock/gmock.h"
#include "models/dataset.h"
#include "models/mlp_model.h"
#include "models/synthetic_model.h"
#include "tests/cuda/mlp_test_util.h"
#include "tests/cuda/test_util.h"

namespace onebit {
namespace {

using cuda::DeviceBuffer;
using cuda::testing::Data;
using cuda::testing::Download;
using cuda::testing::ExpectGradientsClose;
using cuda::testing::SameBits;
using cuda::testing::Upload;
using ::testing::HasSubstr;

constexpr double kSyntheticLossTol = 1e-12;
constexpr double kGradTol = 1e-4;
constexpr double kLossTol = 1e-5;

// A non-blocking stream of the CUDA backend, destroyed with the object.
class TestStream {
 public:
  TestStream() {
    absl::StatusOr<cuda::Stream> s = cuda::CudaBackend()->create_stream();
    EXPECT_TRUE(s.ok()) << s.status();
    if (s.ok()) stream_ = *s;
  }
  ~TestStream() { cuda::CudaBackend()->destroy_stream(stream_); }
  cuda::Stream get() const { return stream_; }

 private:
  cuda::Stream stream_ = nullptr;
};

// Uploads for a non-blocking stream: a synchronous cudaMemcpy from pageable
// memory may return before its DMA is done, and such a stream does not wait
// for the legacy one; waiting for the legacy stream makes the data visible.
DeviceBuffer UploadAndWait(const std::vector<float>& host) {
  DeviceBuffer b = Upload(host);
  EXPECT_TRUE(cuda::Synchronize(nullptr).ok());
  return b;
}

DeviceBuffer Floats(size_t n, float fill) { return UploadAndWait(std::vector<float>(n, fill)); }

// ---------------------------------------------------------------- synthetic

TEST(CudaDeviceModel, SyntheticGradientIsBitwiseTheCpus) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  TestStream stream;
  for (uint64_t d : {uint64_t{1}, uint64_t{31}, uint64_t{1000}, (uint64_t{1} << 20) + 3}) {
    for (float spread : {0.0f, 1.0f}) {
      SCOPED_TRACE(absl::StrCat("d ", d, " spread ", spread));
      SyntheticOptions o;
      o.dim = d;
      o.seed = 7 + d;
      o.noise = 0.1f;
      o.curvature_spread = spread;
      SyntheticModel cpu(o);
      absl::StatusOr<std::unique_ptr<DeviceModel>> gpu = NewCudaDeviceModel(&cpu, stream.get());
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      EXPECT_FALSE((*gpu)->can_evaluate());

      std::vector<float> x(d), g_cpu(d);
      cpu.Init(x.data());
      DeviceBuffer d_g = Floats(d, std::numeric_limits<float>::quiet_NaN());
      for (uint32_t rank : {0u, 2u}) {
        // Two steps, the second at x moved along the first's gradient.
        std::vector<float> xs = x;
        for (uint64_t step : {uint64_t{0}, uint64_t{1}}) {
          SCOPED_TRACE(absl::StrCat("rank ", rank, " step ", step));
          absl::StatusOr<double> loss_cpu = cpu.Gradient(xs.data(), rank, step, g_cpu.data());
          ASSERT_TRUE(loss_cpu.ok()) << loss_cpu.status();
          DeviceBuffer d_x = UploadAndWait(xs);
          absl::StatusOr<double> loss_gpu =
              (*gpu)->Gradient(d_x.as<float>(), rank, step, d_g.as<float>());
          ASSERT_TRUE(loss_gpu.ok()) << loss_gpu.status();
          EXPECT_LE(std::fabs(*loss_gpu - *loss_cpu), kSyntheticLossTol * *loss_cpu)
              << "gpu " << *loss_gpu << " cpu " << *loss_cpu;
          EXPECT_TRUE(SameBits(Download<float>(d_g, d), g_cpu));
          for (uint64_t j = 0; j < d; ++j) xs[j] -= 0.25f * g_cpu[j];
        }
      }
    }
  }
}

// The other ranks' noise differs, and the loss does not depend on the noise.
TEST(CudaDeviceModel, SyntheticNoiseIsPerRank) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  TestStream stream;
  SyntheticOptions o;
  o.dim = 4099;
  o.noise = 0.5f;
  SyntheticModel cpu(o);
  absl::StatusOr<std::unique_ptr<DeviceModel>> gpu = NewCudaDeviceModel(&cpu, stream.get());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::vector<float> x(o.dim);
  cpu.Init(x.data());
  DeviceBuffer d_x = UploadAndWait(x), d_g0 = Floats(o.dim, 0), d_g1 = Floats(o.dim, 0);
  absl::StatusOr<double> l0 = (*gpu)->Gradient(d_x.as<float>(), 0, 3, d_g0.as<float>());
  absl::StatusOr<double> l1 = (*gpu)->Gradient(d_x.as<float>(), 1, 3, d_g1.as<float>());
  ASSERT_TRUE(l0.ok() && l1.ok());
  EXPECT_EQ(*l0, *l1);
  EXPECT_FALSE(SameBits(Download<float>(d_g0, o.dim), Download<float>(d_g1, o.dim)));
}

// Benchmark mode computes nothing: no device memory, g untouched, loss 0.
// Needs no GPU (nothing reaches the device, so host pointers do).
TEST(CudaDeviceModel, SyntheticSkipLeavesGradientAlone) {
  SyntheticOptions o;
  o.dim = 100;
  o.skip = true;
  SyntheticModel cpu(o);
  absl::StatusOr<std::unique_ptr<DeviceModel>> gpu = NewCudaDeviceModel(&cpu, nullptr);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::vector<float> x(o.dim, 1.0f), g(o.dim, 3.0f);
  absl::StatusOr<double> loss = (*gpu)->Gradient(x.data(), 0, 0, g.data());
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_EQ(*loss, 0.0);
  EXPECT_EQ(g, std::vector<float>(o.dim, 3.0f));
  EXPECT_FALSE((*gpu)->can_evaluate());
  EXPECT_EQ((*gpu)->Evaluate(x.data()).status().code(), absl::StatusCode::kFailedPrecondition);
}

// A non-finite x gives a non-finite loss: an error, as on the CPU.
TEST(CudaDeviceModel, SyntheticNonFiniteLossIsAnError) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  TestStream stream;
  SyntheticOptions o;
  o.dim = 33;
  SyntheticModel cpu(o);
  absl::StatusOr<std::unique_ptr<DeviceModel>> gpu = NewCudaDeviceModel(&cpu, stream.get());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::vector<float> x(o.dim, 0.0f), g(o.dim);
  x[17] = std::numeric_limits<float>::infinity();
  const absl::Status want = cpu.Gradient(x.data(), 0, 4, g.data()).status();
  DeviceBuffer d_x = UploadAndWait(x), d_g = Floats(o.dim, 0);
  const absl::Status got = (*gpu)->Gradient(d_x.as<float>(), 0, 4, d_g.as<float>()).status();
  EXPECT_EQ(got.code(), absl::StatusCode::kInternal) << got;
  EXPECT_EQ(got, want);
}

// ---------------------------------------------------------------------- mlp

std::unique_ptr<MlpModel> Mlp(const std::vector<uint32_t>& layers, uint32_t h, uint32_t w,
                              uint32_t batch, uint32_t workers, uint32_t eval_batch,
                              uint32_t num_test, uint32_t seed) {
  MlpOptions o;
  o.layers = layers;
  o.seed = seed;
  o.batch = batch;
  o.workers = workers;
  o.eval_batch = eval_batch;
  absl::StatusOr<std::unique_ptr<MlpModel>> m =
      MlpModel::Create(o, Data(h, w, 2000, num_test, seed));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
}

// The model's initial x with non-zero biases, so that the bias add counts.
std::vector<float> Params(const MlpModel& m, uint32_t seed) {
  std::vector<float> x(m.num_params());
  m.Init(x.data());
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  for (size_t l = 0; l < m.num_layers(); ++l) {
    for (uint64_t j = m.bias_offset(l); j < m.bias_offset(l) + m.options().layers[l + 1]; ++j) {
      x[j] = normal(rng);
    }
  }
  return x;
}

void CheckMlpGradients(const std::vector<uint32_t>& layers, uint32_t h, uint32_t w, uint32_t batch,
                       uint32_t workers) {
  SCOPED_TRACE(
      absl::StrCat(layers.front(), "-...-", layers.back(), " batch ", batch, " workers ", workers));
  TestStream stream;
  std::unique_ptr<MlpModel> cpu = Mlp(layers, h, w, batch, workers, 250, 1000, 11 + batch);
  ASSERT_NE(cpu, nullptr);
  absl::StatusOr<std::unique_ptr<DeviceModel>> gpu = NewCudaDeviceModel(cpu.get(), stream.get());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_TRUE((*gpu)->can_evaluate());
  const std::vector<float> x = Params(*cpu, 3 + batch);
  const size_t d = x.size();
  DeviceBuffer d_x = UploadAndWait(x), d_g = Floats(d, std::numeric_limits<float>::quiet_NaN());
  // Steps in the first epoch and in the next one (another shuffle).
  for (uint32_t rank : {0u, workers - 1}) {
    for (uint64_t step : {uint64_t{0}, uint64_t{1}, cpu->steps_per_epoch() + 2}) {
      SCOPED_TRACE(absl::StrCat("rank ", rank, " step ", step));
      std::vector<float> g_cpu(d);
      absl::StatusOr<double> loss_cpu = cpu->Gradient(x.data(), rank, step, g_cpu.data());
      ASSERT_TRUE(loss_cpu.ok()) << loss_cpu.status();
      absl::StatusOr<double> loss_gpu =
          (*gpu)->Gradient(d_x.as<float>(), rank, step, d_g.as<float>());
      ASSERT_TRUE(loss_gpu.ok()) << loss_gpu.status();
      EXPECT_LE(std::fabs(*loss_gpu - *loss_cpu), kLossTol * std::fabs(*loss_cpu))
          << "gpu " << *loss_gpu << " cpu " << *loss_cpu;
      const std::vector<float> g_gpu = Download<float>(d_g, d);
      ExpectGradientsClose(*cpu, kGradTol, g_gpu, g_cpu);
      // The same (rank, step) again: the same batch, so the same bits.
      absl::StatusOr<double> again = (*gpu)->Gradient(d_x.as<float>(), rank, step, d_g.as<float>());
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_EQ(*again, *loss_gpu);
      EXPECT_TRUE(SameBits(Download<float>(d_g, d), g_gpu));
    }
  }
}

TEST(CudaDeviceModel, MlpGradientMatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  CheckMlpGradients({784, 256, 128, 10}, 28, 28, 64, 4);
  CheckMlpGradients({35, 33, 17, 10}, 5, 7, 33, 3);  // odd widths, 3 workers
  CheckMlpGradients({35, 10}, 5, 7, 1, 1);           // no hidden layer, one example
}

TEST(CudaDeviceModel, MlpEvaluateMatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  TestStream stream;
  // 1000 test examples; the host scores them in chunks of 64 (15 full, one
  // of 40); an odd test set of 777 in chunks of 250.
  for (uint32_t num_test : {1000u, 777u}) {
    for (uint32_t eval_batch : {64u, 250u}) {
      SCOPED_TRACE(absl::StrCat(num_test, " examples in chunks of ", eval_batch));
      std::unique_ptr<MlpModel> cpu =
          Mlp({784, 256, 128, 10}, 28, 28, 32, 2, eval_batch, num_test, 5 + num_test);
      ASSERT_NE(cpu, nullptr);
      absl::StatusOr<std::unique_ptr<DeviceModel>> gpu =
          NewCudaDeviceModel(cpu.get(), stream.get());
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      ASSERT_TRUE((*gpu)->can_evaluate());
      const std::vector<float> x = Params(*cpu, 9);
      DeviceBuffer d_x = UploadAndWait(x);
      absl::StatusOr<EvalResult> want = cpu->Evaluate(x.data());
      ASSERT_TRUE(want.ok()) << want.status();
      absl::StatusOr<EvalResult> got = (*gpu)->Evaluate(d_x.as<float>());
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->examples, num_test);
      EXPECT_LE(std::fabs(got->loss - want->loss), kLossTol * want->loss)
          << "gpu " << got->loss << " cpu " << want->loss;
      // An arg-max can flip only where two logits are within rounding of
      // each other: at most one such example is allowed.
      EXPECT_LE(std::fabs(got->accuracy - want->accuracy) * num_test, 1.0 + 1e-9)
          << "gpu " << got->accuracy << " cpu " << want->accuracy;
      // The test set is uploaded once; a second call gives the same result.
      absl::StatusOr<EvalResult> again = (*gpu)->Evaluate(d_x.as<float>());
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_EQ(again->loss, got->loss);
      EXPECT_EQ(again->accuracy, got->accuracy);
      // Gradients between evaluations do not disturb them.
      DeviceBuffer d_g = Floats(x.size(), 0);
      ASSERT_TRUE((*gpu)->Gradient(d_x.as<float>(), 1, 0, d_g.as<float>()).ok());
      absl::StatusOr<EvalResult> third = (*gpu)->Evaluate(d_x.as<float>());
      ASSERT_TRUE(third.ok()) << third.status();
      EXPECT_EQ(third->loss, got->loss);
    }
  }
}

TEST(CudaDeviceModel, MlpErrorsAsTheCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  TestStream stream;
  std::unique_ptr<MlpModel> cpu = Mlp({35, 16, 10}, 5, 7, 8, 2, 100, 100, 3);
  ASSERT_NE(cpu, nullptr);
  absl::StatusOr<std::unique_ptr<DeviceModel>> gpu = NewCudaDeviceModel(cpu.get(), stream.get());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::vector<float> x = Params(*cpu, 1);
  DeviceBuffer d_x = UploadAndWait(x), d_g = Floats(x.size(), 0);
  // A rank the job does not have.
  std::vector<float> g(x.size());
  const absl::Status want = cpu->Gradient(x.data(), 2, 0, g.data()).status();
  ASSERT_FALSE(want.ok());
  EXPECT_EQ((*gpu)->Gradient(d_x.as<float>(), 2, 0, d_g.as<float>()).status(), want);
  // A non-finite weight: an error naming the parameter, rank and step.
  x[cpu->weight_offset(1) + 3] = std::numeric_limits<float>::infinity();
  DeviceBuffer d_inf = UploadAndWait(x);
  const absl::Status got = (*gpu)->Gradient(d_inf.as<float>(), 1, 5, d_g.as<float>()).status();
  EXPECT_EQ(got.code(), absl::StatusCode::kInternal) << got;
  EXPECT_THAT(std::string(got.message()), HasSubstr("not finite"));
  EXPECT_THAT(std::string(got.message()), HasSubstr("at rank 1 step 5"));
  // The model still works after the error.
  EXPECT_TRUE((*gpu)->Gradient(d_x.as<float>(), 1, 5, d_g.as<float>()).ok());
}

// ----------------------------------------------------------- without a GPU

class FakeModel final : public Model {
 public:
  uint64_t num_params() const override { return 3; }
  void Init(float* x) const override { std::fill(x, x + 3, 0.0f); }
  absl::StatusOr<double> Gradient(const float*, uint32_t, uint64_t, float* g) const override {
    std::fill(g, g + 3, 1.0f);
    return 0.0;
  }
};

// Needs no GPU: the model is rejected before any device call.
TEST(CudaDeviceModel, UnsupportedModelIsInvalidArgument) {
  FakeModel fake;
  absl::StatusOr<std::unique_ptr<DeviceModel>> m = NewCudaDeviceModel(&fake, nullptr);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("no GPU version of model"));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("FakeModel"));
  absl::StatusOr<std::unique_ptr<DeviceModel>> none = NewCudaDeviceModel(nullptr, nullptr);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument) << none.status();
}

// A CUDA build on a machine without a GPU: both models fail to build with the
// CUDA error text, nothing crashes.
TEST(CudaDeviceModel, WithoutGpuCreateFailsWithCudaText) {
  if (cuda::DeviceCount() > 0) GTEST_SKIP() << "a GPU is usable here: no GPU-less path";
  SyntheticOptions so;
  so.dim = 1000;
  so.curvature_spread = 1.0f;
  SyntheticModel synthetic(so);
  std::unique_ptr<MlpModel> mlp = Mlp({35, 16, 10}, 5, 7, 8, 2, 100, 100, 3);
  ASSERT_NE(mlp, nullptr);
  for (const Model* model :
       {static_cast<const Model*>(&synthetic), static_cast<const Model*>(mlp.get())}) {
    absl::StatusOr<std::unique_ptr<DeviceModel>> m = NewCudaDeviceModel(model, nullptr);
    ASSERT_FALSE(m.ok());
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("CUDA error")) << m.status();
  }
}

}  // namespace
}  // namespace onebit
