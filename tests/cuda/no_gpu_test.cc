// A CUDA-enabled build on a machine without a GPU: discovery says 0 and why,
// every GPU call with work to do returns an error Status carrying the CUDA
// error text (no crash, no abort), and the CPU twins still do the job.
#include <string>
#include <vector>

#include "compress/codec.h"
#include "cuda/device.h"
#include "cuda/kernels.h"
#include "cuda/memory.h"
#include "gtest/gtest.h"

namespace onebit::cuda {
namespace {

#define ONEBIT_SKIP_IF_GPU()                                                         \
  do {                                                                               \
    if (DeviceCount() > 0) GTEST_SKIP() << "a GPU is usable here: no CPU-only path"; \
  } while (0)

TEST(CudaWithoutGpu, BuiltWithCudaButNoDevice) {
  EXPECT_TRUE(BuiltWithCuda());
  ONEBIT_SKIP_IF_GPU();
  std::string why;
  EXPECT_EQ(DeviceCount(&why), 0);
  EXPECT_FALSE(why.empty()) << "DeviceCount must say why there is no device";
}

TEST(CudaWithoutGpu, AllocationFailsWithCudaText) {
  ONEBIT_SKIP_IF_GPU();
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Create(1 << 20);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(std::string(b.status().message()).find("CUDA error"), std::string::npos) << b.status();
  // Empty work needs no device.
  absl::StatusOr<DeviceBuffer> empty = DeviceBuffer::Create(0);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->data(), nullptr);
}

// Host pointers stand in for device ones: no call may get as far as touching them.
TEST(CudaWithoutGpu, KernelCallsReturnErrorsNotCrashes) {
  ONEBIT_SKIP_IF_GPU();
  const size_t n = 1000;
  std::vector<float> y(n, 1.0f), e(n, 0.0f), acc(n, 0.0f), scales(1);
  std::vector<uint8_t> out(4 + n / 8);
  std::vector<uint16_t> half(n);
  const std::vector<absl::Status> errors = {
      OnebitScales(y.data(), e.data(), n, 2048, ScaleRule::kL1, scales.data(), nullptr).status(),
      OnebitSigns(y.data(), e.data(), n, 2048, scales.data(), out.data(), nullptr),
      OnebitDecode(scales.data(), out.data(), n, 2048, acc.data(), nullptr),
      OnebitDecodeAdd(scales.data(), out.data(), n, 2048, 0.5f, acc.data(), nullptr),
      OnebitEncode(y.data(), e.data(), e.data(), n, 2048, ScaleRule::kL1, out.data(), nullptr),
      Fp16Check(y.data(), nullptr, n, nullptr).status(),
      Fp16Encode(y.data(), nullptr, n, half.data(), nullptr),
      Fp16CheckPayload(half.data(), n, nullptr).status(),
      Fp16Decode(half.data(), n, acc.data(), nullptr),
      Fp16DecodeAdd(half.data(), n, 1.0f, acc.data(), nullptr),
      FirstNonFinite(y.data(), nullptr, n, nullptr).status(),
      Axpy(y.data(), n, 1.0f, acc.data(), nullptr),
      ApplyMomentum(y.data(), nullptr, 0.1f, 0.0f, n, acc.data(), nullptr),
      AdamUpdate(AdamCoefficients{}, n, e.data(), y.data(), y.data(), acc.data(), nullptr),
      Synchronize(nullptr),
  };
  for (size_t i = 0; i < errors.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_FALSE(errors[i].ok());
    EXPECT_NE(std::string(errors[i].message()).find("CUDA error"), std::string::npos) << errors[i];
  }
  // The host buffers were never written.
  EXPECT_EQ(acc, std::vector<float>(n, 0.0f));
  EXPECT_EQ(e, std::vector<float>(n, 0.0f));
  // Calls without work succeed without a device.
  EXPECT_TRUE(
      OnebitEncode(y.data(), e.data(), e.data(), 0, 2048, ScaleRule::kL1, out.data(), nullptr)
          .ok());
  absl::StatusOr<size_t> none = FirstNonFinite(y.data(), nullptr, 0, nullptr);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, 0u);
}

// The CPU path a GPU-less worker takes: the codec and the fused encode's twin.
TEST(CudaWithoutGpu, CpuTwinEncodesAsTheCodec) {
  const size_t n = 5000;
  std::vector<float> y(n), e_in(n), e_out(n), codec_e(n);
  for (size_t i = 0; i < n; ++i) {
    y[i] = static_cast<float>(static_cast<int>(i * 7919 % 201) - 100) / 37.0f;
    e_in[i] = static_cast<float>(static_cast<int>(i * 104729 % 17) - 8) / 1000.0f;
  }
  codec_e = e_in;
  const size_t bytes = 4 * 3 + (n + 7) / 8;
  std::vector<uint8_t> twin(bytes), codec_out(bytes);
  ASSERT_TRUE(
      OnebitEncodeCpu(y.data(), e_in.data(), e_out.data(), n, 2048, ScaleRule::kL1, twin.data())
          .ok());
  auto codec = NewCodec(CodecKind::kOnebit);
  ASSERT_TRUE(codec.ok()) << codec.status();
  ASSERT_TRUE((*codec)->EncodeWithFeedback(y.data(), codec_e.data(), n, codec_out.data()).ok());
  EXPECT_EQ(twin, codec_out);
  EXPECT_EQ(e_out, codec_e);
}

}  // namespace
}  // namespace onebit::cuda
