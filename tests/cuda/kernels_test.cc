// GPU kernels (cuda/kernels.h) against their CPU twins: the scalar codec
// kernels (compress/kernels_scalar.cc, the definition) and the update loops
// (optim/update_kernels.h). Every element must agree bit for bit, for sizes
// 0, 1, 31, 32, 33, B-1, B, B+1 and large. Skipped where no GPU is usable.
#include "compress/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/array_ops.h"
#include "cuda/backend.h"
#include "cuda/kernels.h"
#include "gmock/gmock.h"
#include "optim/update_kernels.h"
#include "tests/cuda/test_util.h"

namespace onebit::cuda {
namespace {

using compress_internal::ScalarKernels;
using testing::Download;
using testing::SameBits;
using testing::Upload;

// Block sizes: the smallest, one that is no power of two, the default and
// a larger one.
const uint32_t kBlocks[] = {32, 96, 2048, 4096};
const ScaleRule kRules[] = {ScaleRule::kL1, ScaleRule::kL2};
// Both fused-encode kernels, at every block above (all are staged-sized).
const EncodePath kPaths[] = {EncodePath::kWarp, EncodePath::kStaged};

const char* PathName(EncodePath path) {
  return path == EncodePath::kStaged ? "staged kernel" : "warp kernel";
}

std::vector<size_t> Sizes(uint32_t block) {
  std::vector<size_t> s = {
      0, 1, 31, 32, 33, block - 1, block, block + 1, std::max<size_t>(1 << 20, 5 * block) + 77};
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

// Normal values with the awkward ones mixed in: +-0.0, fp32 subnormals,
// large magnitudes.
std::vector<float> Values(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    float x = normal(rng) * scale;
    switch (i % 97) {
      case 5:
        x = 0.0f;
        break;
      case 11:
        x = -0.0f;
        break;
      case 23:
        x = 1e-40f;
        break;
      case 37:
        x = -3e-42f;
        break;
      case 41:
        x *= 1e3f;
        break;
      default:
        break;
    }
    v[i] = x;
  }
  return v;
}

size_t NumBlocks(size_t n, uint32_t block) { return (n + block - 1) / block; }

std::string Case(size_t n, uint32_t block, ScaleRule rule, bool with_e) {
  return absl::StrCat("n=", n, " B=", block, " ", ScaleRuleName(rule), with_e ? " with e" : "");
}

TEST(CudaOnebit, ScalesMatchCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  for (uint32_t block : kBlocks) {
    for (size_t n : Sizes(block)) {
      for (ScaleRule rule : kRules) {
        for (bool with_e : {false, true}) {
          SCOPED_TRACE(Case(n, block, rule, with_e));
          const std::vector<float> y = Values(n, 1), e = Values(n, 2, 0.1f);
          const size_t nb = NumBlocks(n, block);
          std::vector<float> cpu(nb);
          const size_t cpu_bad = ScalarKernels().onebit_scales(
              y.data(), with_e ? e.data() : nullptr, n, block, rule, cpu.data());
          DeviceBuffer dy = Upload(y), de = Upload(e), ds = Upload(std::vector<float>(nb));
          absl::StatusOr<size_t> bad =
              OnebitScales(dy.as<float>(), with_e ? de.as<float>() : nullptr, n, block, rule,
                           ds.as<float>(), nullptr);
          ASSERT_TRUE(bad.ok()) << bad.status();
          EXPECT_EQ(*bad, cpu_bad);
          EXPECT_TRUE(SameBits(Download<float>(ds, nb), cpu));
        }
      }
    }
  }
}

TEST(CudaOnebit, SignsAndErrorsMatchCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  for (uint32_t block : kBlocks) {
    for (size_t n : Sizes(block)) {
      for (ScaleRule rule : kRules) {
        for (bool with_e : {false, true}) {
          SCOPED_TRACE(Case(n, block, rule, with_e));
          const std::vector<float> y = Values(n, 3);
          std::vector<float> e = Values(n, 4, 0.1f);
          std::vector<float> scales(NumBlocks(n, block));
          ASSERT_EQ(ScalarKernels().onebit_scales(y.data(), with_e ? e.data() : nullptr, n, block,
                                                  rule, scales.data()),
                    n);
          DeviceBuffer dy = Upload(y), de = Upload(e), ds = Upload(scales);
          // Garbage in the bit buffer: the kernel must write every byte.
          DeviceBuffer db = Upload(std::vector<uint8_t>((n + 7) / 8, 0xa5));
          std::vector<uint8_t> bits((n + 7) / 8, 0x5a);
          ScalarKernels().onebit_signs(y.data(), with_e ? e.data() : nullptr, n, block,
                                       scales.data(), bits.data());
          absl::Status st = OnebitSigns(dy.as<float>(), with_e ? de.as<float>() : nullptr, n, block,
                                        ds.as<float>(), db.as<uint8_t>(), nullptr);
          ASSERT_TRUE(st.ok()) << st;
          EXPECT_TRUE(SameBits(Download<uint8_t>(db, bits.size()), bits)) << "bits";
          EXPECT_TRUE(SameBits(Download<float>(de, n), e)) << "errors";
        }
      }
    }
  }
}

// The fused encode equals its CPU twin and the scalar codec's payload.
TEST(CudaOnebit, FusedEncodeMatchesCpuTwinAndCodec) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  for (uint32_t block : kBlocks) {
    for (size_t n : Sizes(block)) {
      for (ScaleRule rule : kRules) {
        for (bool with_e : {false, true}) {
          SCOPED_TRACE(Case(n, block, rule, with_e));
          const std::vector<float> y = Values(n, 5), e_in = Values(n, 6, 0.1f);
          const size_t bytes = 4 * NumBlocks(n, block) + (n + 7) / 8;
          std::vector<uint8_t> cpu_out(bytes, 0x11);
          std::vector<float> cpu_e(n, 7.0f);
          absl::Status st = OnebitEncodeCpu(y.data(), with_e ? e_in.data() : nullptr, cpu_e.data(),
                                            n, block, rule, cpu_out.data());
          ASSERT_TRUE(st.ok()) << st;

          // The twin is the codec: same payload as EncodeWithFeedback / Encode.
          CodecOptions options;
          options.block_size = block;
          options.scale = rule;
          options.simd = SimdPath::kScalar;
          auto codec = NewCodec(CodecKind::kOnebit, options);
          ASSERT_TRUE(codec.ok()) << codec.status();
          std::vector<uint8_t> codec_out(bytes);
          std::vector<float> codec_e = e_in;
          st = with_e ? (*codec)->EncodeWithFeedback(y.data(), codec_e.data(), n, codec_out.data())
                      : (*codec)->Encode(y.data(), n, codec_out.data());
          ASSERT_TRUE(st.ok()) << st;
          EXPECT_TRUE(SameBits(cpu_out, codec_out)) << "twin vs codec payload";
          if (with_e) {
            EXPECT_TRUE(SameBits(cpu_e, codec_e)) << "twin vs codec errors";
          }

          for (EncodePath path : kPaths) {
            SCOPED_TRACE(PathName(path));
            DeviceBuffer dy = Upload(y), de_in = Upload(e_in);
            DeviceBuffer de_out = Upload(std::vector<float>(n, 7.0f));
            DeviceBuffer dout = Upload(std::vector<uint8_t>(bytes, 0x22));
            st = OnebitEncodeVia(path, dy.as<float>(), with_e ? de_in.as<float>() : nullptr,
                                 de_out.as<float>(), n, block, rule, dout.as<uint8_t>(), nullptr);
            ASSERT_TRUE(st.ok()) << st;
            EXPECT_TRUE(SameBits(Download<uint8_t>(dout, bytes), cpu_out)) << "payload";
            EXPECT_TRUE(SameBits(Download<float>(de_out, n), cpu_e)) << "e_out";
            EXPECT_TRUE(SameBits(Download<float>(de_in, n), e_in)) << "e_in must stay as it was";

            // In place (e_out == e_in), as a worker with one error buffer runs it.
            if (with_e) {
              st = OnebitEncodeVia(path, dy.as<float>(), de_in.as<float>(), de_in.as<float>(), n,
                                   block, rule, dout.as<uint8_t>(), nullptr);
              ASSERT_TRUE(st.ok()) << st;
              EXPECT_TRUE(SameBits(Download<float>(de_in, n), cpu_e)) << "in-place e";
            }
          }
        }
      }
    }
  }
}

TEST(CudaOnebit, DecodeAndDecodeAddMatchCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  for (uint32_t block : kBlocks) {
    for (size_t n : Sizes(block)) {
      SCOPED_TRACE(Case(n, block, ScaleRule::kL1, false));
      const std::vector<float> y = Values(n, 7);
      std::vector<float> scales(NumBlocks(n, block));
      std::vector<uint8_t> bits((n + 7) / 8);
      ASSERT_EQ(
          ScalarKernels().onebit_scales(y.data(), nullptr, n, block, ScaleRule::kL1, scales.data()),
          n);
      ScalarKernels().onebit_signs(y.data(), nullptr, n, block, scales.data(), bits.data());
      DeviceBuffer ds = Upload(scales), db = Upload(bits);

      std::vector<float> cpu(n);
      ScalarKernels().onebit_decode(scales.data(), bits.data(), n, block, cpu.data());
      DeviceBuffer dout = Upload(std::vector<float>(n, 3.0f));
      absl::Status st =
          OnebitDecode(ds.as<float>(), db.as<uint8_t>(), n, block, dout.as<float>(), nullptr);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(SameBits(Download<float>(dout, n), cpu)) << "decode";

      // Weights as a server averages with (1/3) and a negative one.
      for (float w : {1.0f, 1.0f / 3.0f, -0.7f}) {
        SCOPED_TRACE(absl::StrCat("w=", w));
        std::vector<float> acc = Values(n, 8);
        DeviceBuffer dacc = Upload(acc);
        ScalarKernels().onebit_decode_add(scales.data(), bits.data(), n, block, w, acc.data());
        st = OnebitDecodeAdd(ds.as<float>(), db.as<uint8_t>(), n, block, w, dacc.as<float>(),
                             nullptr);
        ASSERT_TRUE(st.ok()) << st;
        EXPECT_TRUE(SameBits(Download<float>(dacc, n), acc)) << "decode_add";
      }
    }
  }
}

// The first non-finite z, wherever it is (in y or only in e; NaN or Inf), is
// the index both sides report; the fused encode then changes neither y nor e_in.
void CheckFirstNonFinite(uint32_t block) {
  SCOPED_TRACE(absl::StrCat("B=", block));
  const size_t n = 20 * block + 17;
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Bad {
    size_t at;
    float value;
    bool in_e;
  };
  const std::vector<std::vector<Bad>> cases = {
      {{0, nan, false}},
      {{n - 1, inf, false}},
      {{5 * block + 40, -inf, true}},
      {{7 * block + 3, nan, false}, {7 * block + 1, inf, true}, {3 * block + 95, nan, false}},
      {{19 * block + 2, nan, true}, {11 * block, -inf, false}},
  };
  for (const auto& c : cases) {
    std::vector<float> y = Values(n, 9), e = Values(n, 10, 0.1f);
    for (const Bad& b : c) (b.in_e ? e : y)[b.at] = b.value;
    std::vector<float> scales(NumBlocks(n, block));
    const size_t cpu_bad =
        ScalarKernels().onebit_scales(y.data(), e.data(), n, block, ScaleRule::kL1, scales.data());
    SCOPED_TRACE(absl::StrCat("first bad at ", cpu_bad));
    ASSERT_LT(cpu_bad, n);
    DeviceBuffer dy = Upload(y), de = Upload(e), ds = Upload(std::vector<float>(scales.size()));
    absl::StatusOr<size_t> bad = OnebitScales(dy.as<float>(), de.as<float>(), n, block,
                                              ScaleRule::kL1, ds.as<float>(), nullptr);
    ASSERT_TRUE(bad.ok()) << bad.status();
    EXPECT_EQ(*bad, cpu_bad);
    // The scales before the bad block are written and equal.
    const size_t good = cpu_bad / block;
    std::vector<float> got = Download<float>(ds, scales.size());
    EXPECT_TRUE(SameBits(std::vector<float>(got.begin(), got.begin() + good),
                         std::vector<float>(scales.begin(), scales.begin() + good)));

    absl::StatusOr<size_t> nf = FirstNonFinite(dy.as<float>(), de.as<float>(), n, nullptr);
    ASSERT_TRUE(nf.ok()) << nf.status();
    EXPECT_EQ(*nf, ScalarKernels().first_nonfinite(y.data(), e.data(), n));

    for (EncodePath path : kPaths) {
      SCOPED_TRACE(PathName(path));
      DeviceBuffer dout = Upload(std::vector<uint8_t>(4 * scales.size() + (n + 7) / 8));
      DeviceBuffer de_out = Upload(std::vector<float>(n));
      absl::Status st = OnebitEncodeVia(path, dy.as<float>(), de.as<float>(), de_out.as<float>(), n,
                                        block, ScaleRule::kL1, dout.as<uint8_t>(), nullptr);
      EXPECT_FALSE(st.ok());
      EXPECT_NE(std::string(st.message()).find(absl::StrCat("index ", cpu_bad)), std::string::npos)
          << st;
      EXPECT_TRUE(SameBits(Download<float>(de, n), e)) << "e_in changed on error";
      EXPECT_TRUE(SameBits(Download<float>(dy, n), y)) << "y changed on error";
    }
  }
}

TEST(CudaOnebit, FirstNonFiniteIndexMatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  CheckFirstNonFinite(96);
  CheckFirstNonFinite(4096);
}

// Finite values whose l2 scale overflows: an error on both sides.
TEST(CudaOnebit, OverflowingScaleIsAnErrorOnBothSides) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  const uint32_t block = 32;
  const size_t n = 4 * block;
  std::vector<float> y = Values(n, 11);
  y[2 * block + 7] = 3e38f;
  const size_t bytes = 4 * NumBlocks(n, block) + n / 8;
  std::vector<uint8_t> out(bytes);
  std::vector<float> e(n);
  EXPECT_FALSE(
      OnebitEncodeCpu(y.data(), nullptr, e.data(), n, block, ScaleRule::kL2, out.data()).ok());
  // l1 of the same values is finite: both encode, identically.
  ASSERT_TRUE(
      OnebitEncodeCpu(y.data(), nullptr, e.data(), n, block, ScaleRule::kL1, out.data()).ok());
  for (EncodePath path : kPaths) {
    SCOPED_TRACE(PathName(path));
    DeviceBuffer dy = Upload(y), dout = Upload(out), de = Upload(e);
    absl::Status st = OnebitEncodeVia(path, dy.as<float>(), nullptr, de.as<float>(), n, block,
                                      ScaleRule::kL2, dout.as<uint8_t>(), nullptr);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(std::string(st.message()).find("block 2"), std::string::npos) << st;
    st = OnebitEncodeVia(path, dy.as<float>(), nullptr, de.as<float>(), n, block, ScaleRule::kL1,
                         dout.as<uint8_t>(), nullptr);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_TRUE(SameBits(Download<uint8_t>(dout, bytes), out));
    EXPECT_TRUE(SameBits(Download<float>(de, n), e));
  }
}

TEST(CudaOnebit, StagedEncodeRefusesBlocksOverItsLimit) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  const uint32_t block = 2 * kMaxStagedBlock;
  const std::vector<float> y = Values(block, 12);
  DeviceBuffer dy = Upload(y), dout = Upload(std::vector<uint8_t>(4 + block / 8));
  absl::Status st = OnebitEncodeVia(EncodePath::kStaged, dy.as<float>(), nullptr, nullptr, block,
                                    block, ScaleRule::kL1, dout.as<uint8_t>(), nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(std::string(st.message()).find("at most"), std::string::npos) << st;
  // kAuto takes the warp kernel there, and agrees with the twin.
  std::vector<uint8_t> out(4 + block / 8);
  ASSERT_TRUE(
      OnebitEncodeCpu(y.data(), nullptr, nullptr, block, block, ScaleRule::kL1, out.data()).ok());
  st = OnebitEncode(dy.as<float>(), nullptr, nullptr, block, block, ScaleRule::kL1,
                    dout.as<uint8_t>(), nullptr);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(SameBits(Download<uint8_t>(dout, out.size()), out));
}

TEST(CudaOnebit, BadBlockSizeIsRejected) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  DeviceBuffer d = Upload(std::vector<float>(64));
  EXPECT_FALSE(OnebitSigns(d.as<float>(), nullptr, 64, 48, d.as<float>(),
                           reinterpret_cast<uint8_t*>(d.as<float>() + 32), nullptr)
                   .ok());
  EXPECT_FALSE(
      OnebitScales(d.as<float>(), nullptr, 64, 0, ScaleRule::kL1, d.as<float>(), nullptr).ok());
}

// fp16 inputs: normal values, values near the fp16 limits (subnormal halves,
// just under 65504 and 65520), ties between two halves.
std::vector<float> HalfValues(size_t n, uint32_t seed) {
  std::vector<float> v = Values(n, seed);
  const float specials[] = {65504.0f, 65519.996f, -65519.0f,       6e-8f,           -3e-8f,
                            2.98e-8f, 1e-5f,      1.0f + 0x1p-11f, 1.0f + 0x3p-11f, 2049.0f};
  for (size_t i = 0; i < n; i += 13) v[i] = specials[(i / 13) % 10];
  return v;
}

TEST(CudaFp16, CheckEncodeDecodeMatchCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  for (size_t n : Sizes(2048)) {
    for (bool with_e : {false, true}) {
      SCOPED_TRACE(absl::StrCat("n=", n, with_e ? " with e" : ""));
      const std::vector<float> y = HalfValues(n, 12);
      std::vector<float> e = Values(n, 13, 0.01f);
      for (size_t i = 0; i < n; i += 13) e[i] = 0.0f;  // keep the specials where they are
      const float* ce = with_e ? e.data() : nullptr;
      DeviceBuffer dy = Upload(y), de = Upload(e);
      const float* ge = with_e ? de.as<float>() : nullptr;

      absl::StatusOr<size_t> check = Fp16Check(dy.as<float>(), ge, n, nullptr);
      ASSERT_TRUE(check.ok()) << check.status();
      ASSERT_EQ(*check, ScalarKernels().fp16_check(y.data(), ce, n));
      ASSERT_EQ(*check, n);

      std::vector<uint16_t> half(n);
      ScalarKernels().fp16_encode(y.data(), with_e ? e.data() : nullptr, n, half.data());
      DeviceBuffer dh = Upload(std::vector<uint16_t>(n, 0xffff));
      absl::Status st = Fp16Encode(dy.as<float>(), with_e ? de.as<float>() : nullptr, n,
                                   dh.as<uint16_t>(), nullptr);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(SameBits(Download<uint16_t>(dh, n), half)) << "halves";
      EXPECT_TRUE(SameBits(Download<float>(de, n), e)) << "errors";

      absl::StatusOr<size_t> pc = Fp16CheckPayload(dh.as<uint16_t>(), n, nullptr);
      ASSERT_TRUE(pc.ok()) << pc.status();
      EXPECT_EQ(*pc, n);

      std::vector<float> out(n);
      ScalarKernels().fp16_decode(half.data(), n, out.data());
      DeviceBuffer dout = Upload(std::vector<float>(n, 5.0f));
      st = Fp16Decode(dh.as<uint16_t>(), n, dout.as<float>(), nullptr);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(SameBits(Download<float>(dout, n), out)) << "decode";

      for (float w : {0.25f, -1.0f / 3.0f}) {
        std::vector<float> acc = Values(n, 14);
        DeviceBuffer dacc = Upload(acc);
        ScalarKernels().fp16_decode_add(half.data(), n, w, acc.data());
        st = Fp16DecodeAdd(dh.as<uint16_t>(), n, w, dacc.as<float>(), nullptr);
        ASSERT_TRUE(st.ok()) << st;
        EXPECT_TRUE(SameBits(Download<float>(dacc, n), acc)) << "decode_add w=" << w;
      }
    }
  }
}

// Every one of the 65536 halves decodes as on the CPU (NaN payloads included).
TEST(CudaFp16, EveryHalfDecodesAsOnCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> cpu(all.size());
  ScalarKernels().fp16_decode(all.data(), all.size(), cpu.data());
  DeviceBuffer dh = Upload(all), dout = Upload(std::vector<float>(all.size()));
  absl::Status st = Fp16Decode(dh.as<uint16_t>(), all.size(), dout.as<float>(), nullptr);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(SameBits(Download<float>(dout, all.size()), cpu));
  absl::StatusOr<size_t> pc = Fp16CheckPayload(dh.as<uint16_t>(), all.size(), nullptr);
  ASSERT_TRUE(pc.ok()) << pc.status();
  EXPECT_EQ(*pc, ScalarKernels().fp16_check_payload(all.data(), all.size()));
}

// Rounding of every float in a sweep of bit patterns across the half range.
TEST(CudaFp16, EncodeRoundsEveryPatternAsCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  std::vector<float> y;
  for (uint32_t u = 0; u < 0x477ff000u; u += 4093) {  // every 4093rd pattern below 65520
    float f;
    std::memcpy(&f, &u, 4);
    y.push_back(f);
    y.push_back(-f);
  }
  const size_t n = y.size();
  std::vector<uint16_t> half(n);
  ScalarKernels().fp16_encode(y.data(), nullptr, n, half.data());
  DeviceBuffer dy = Upload(y), dh = Upload(std::vector<uint16_t>(n));
  absl::Status st = Fp16Encode(dy.as<float>(), nullptr, n, dh.as<uint16_t>(), nullptr);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(SameBits(Download<uint16_t>(dh, n), half));
}

TEST(CudaFp16, ChecksFindTheFirstBadIndex) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  const size_t n = 100003;
  std::vector<float> y = Values(n, 15);
  y[70001] = 65520.0f;  // rounds to Inf
  y[90000] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> e(n, 0.0f);
  e[50000] = -70000.0f;  // z = y + e overflows
  DeviceBuffer dy = Upload(y), de = Upload(e);
  for (bool with_e : {false, true}) {
    absl::StatusOr<size_t> got =
        Fp16Check(dy.as<float>(), with_e ? de.as<float>() : nullptr, n, nullptr);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, ScalarKernels().fp16_check(y.data(), with_e ? e.data() : nullptr, n));
    EXPECT_EQ(*got, with_e ? 50000u : 70001u);
  }
  std::vector<uint16_t> h(n, 0x3c00);
  h[4242] = 0x7c00;
  h[9999] = 0xfe00;
  DeviceBuffer dh = Upload(h);
  absl::StatusOr<size_t> pc = Fp16CheckPayload(dh.as<uint16_t>(), n, nullptr);
  ASSERT_TRUE(pc.ok()) << pc.status();
  EXPECT_EQ(*pc, 4242u);
}

TEST(CudaAxpy, MatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  for (size_t n : Sizes(2048)) {
    const std::vector<float> x = Values(n, 16);
    std::vector<float> acc = Values(n, 17);
    DeviceBuffer dx = Upload(x), dacc = Upload(acc);
    ScalarKernels().axpy(x.data(), n, -0.3f, acc.data());
    absl::Status st = Axpy(dx.as<float>(), n, -0.3f, dacc.as<float>(), nullptr);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_TRUE(SameBits(Download<float>(dacc, n), acc)) << "n=" << n;
  }
}

// Positive denominators sqrt(v) + eps, with v floored as after the freeze.
std::vector<float> Denominators(size_t n, uint32_t seed) {
  std::vector<float> v = Values(n, seed, 1e-3f);
  for (float& d : v) d = std::sqrt(std::max(d * d, 1e-8f)) + 1e-8f;
  return v;
}

TEST(CudaUpdate, UpdateMomentumMatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  for (size_t n : Sizes(2048)) {
    SCOPED_TRACE(absl::StrCat("n=", n));
    const std::vector<float> g = Values(n, 40);
    std::vector<float> m = Values(n, 41, 1e-2f);
    DeviceBuffer dg = Upload(g), dm = Upload(m);
    for (int step = 0; step < 2; ++step) {  // the second from a non-zero m, as in training
      onebit::UpdateMomentum(g.data(), 0.9f, 1.0f - 0.9f, n, m.data());
      absl::Status st =
          UpdateMomentum(dg.as<float>(), 0.9f, 1.0f - 0.9f, n, dm.as<float>(), nullptr);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(SameBits(Download<float>(dm, n), m)) << "step " << step;
    }
  }
}

TEST(CudaUpdate, ApplyMomentumMatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  for (size_t n : Sizes(2048)) {
    for (bool with_den : {true, false}) {
      for (float wd : {0.0f, 0.01f}) {
        SCOPED_TRACE(absl::StrCat("n=", n, with_den ? " den" : " no den", " wd=", wd));
        const std::vector<float> mbar = Values(n, 18, 1e-2f), den = Denominators(n, 19);
        std::vector<float> x = Values(n, 20);
        DeviceBuffer dm = Upload(mbar), dd = Upload(den), dx = Upload(x);
        const float lr = 3e-4f;
        onebit::ApplyMomentum(mbar.data(), with_den ? den.data() : nullptr, lr, wd, n, x.data());
        absl::Status st = ApplyMomentum(dm.as<float>(), with_den ? dd.as<float>() : nullptr, lr, wd,
                                        n, dx.as<float>(), nullptr);
        ASSERT_TRUE(st.ok()) << st;
        EXPECT_TRUE(SameBits(Download<float>(dx, n), x));
      }
    }
  }
}

TEST(CudaUpdate, AdamMatchesCpuOverSeveralSteps) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  for (size_t n : Sizes(2048)) {
    for (bool bias_correction : {false, true}) {
      SCOPED_TRACE(absl::StrCat("n=", n, bias_correction ? " bias correction" : ""));
      std::vector<float> m = Values(n, 21, 1e-2f), v = Values(n, 22, 1e-2f), x = Values(n, 23);
      for (float& vi : v) vi = vi * vi;
      DeviceBuffer dm = Upload(m), dv = Upload(v), dx = Upload(x);
      for (uint64_t step = 0; step < 3; ++step) {
        std::vector<float> g = Values(n, 24 + static_cast<uint32_t>(step));
        DeviceBuffer dg = Upload(g);
        const AdamCoefficients c =
            MakeAdamCoefficients(0.9f, 0.999f, 1e-8f, 0.01f, 1e-3f, bias_correction, step);
        onebit::AdamUpdate(c, n, g.data(), m.data(), v.data(), x.data());
        absl::Status st = AdamUpdate(c, n, dg.as<float>(), dm.as<float>(), dv.as<float>(),
                                     dx.as<float>(), nullptr);
        ASSERT_TRUE(st.ok()) << st;
        EXPECT_TRUE(SameBits(Download<float>(dg, n), g)) << "delta, step " << step;
        EXPECT_TRUE(SameBits(Download<float>(dm, n), m)) << "m, step " << step;
        EXPECT_TRUE(SameBits(Download<float>(dv, n), v)) << "v, step " << step;
        EXPECT_TRUE(SameBits(Download<float>(dx, n), x)) << "x, step " << step;
      }
    }
  }
}

// One compression-phase round as a GPU worker runs it, against the CPU: push
// (momentum, EF encode), server-side decode, then the apply with the decoded
// reply. Ends with the same x on both sides.
TEST(CudaUpdate, WorkerRoundMatchesCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  const uint32_t block = 2048;
  const size_t n = 3 * block + 555;
  const size_t bytes = 4 * NumBlocks(n, block) + (n + 7) / 8;
  std::vector<float> y = Values(n, 30, 1e-2f), e(n, 0.0f), x = Values(n, 31);
  const std::vector<float> den = Denominators(n, 32);
  DeviceBuffer dy = Upload(y), de = Upload(e), dx = Upload(x), dd = Upload(den);
  DeviceBuffer dout = Upload(std::vector<uint8_t>(bytes)), dm = Upload(std::vector<float>(n));
  std::vector<uint8_t> out(bytes);
  std::vector<float> mbar(n);
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(
        OnebitEncodeCpu(y.data(), e.data(), e.data(), n, block, ScaleRule::kL1, out.data()).ok());
    ScalarKernels().onebit_decode(reinterpret_cast<const float*>(out.data()),
                                  out.data() + 4 * NumBlocks(n, block), n, block, mbar.data());
    onebit::ApplyMomentum(mbar.data(), den.data(), 1e-3f, 0.01f, n, x.data());

    absl::Status st = OnebitEncode(dy.as<float>(), de.as<float>(), de.as<float>(), n, block,
                                   ScaleRule::kL1, dout.as<uint8_t>(), nullptr);
    ASSERT_TRUE(st.ok()) << st;
    st = OnebitDecode(dout.as<float>(), dout.as<uint8_t>() + 4 * NumBlocks(n, block), n, block,
                      dm.as<float>(), nullptr);
    ASSERT_TRUE(st.ok()) << st;
    st = ApplyMomentum(dm.as<float>(), dd.as<float>(), 1e-3f, 0.01f, n, dx.as<float>(), nullptr);
    ASSERT_TRUE(st.ok()) << st;
  }
  EXPECT_TRUE(SameBits(Download<uint8_t>(dout, bytes), out));
  EXPECT_TRUE(SameBits(Download<float>(de, n), e));
  EXPECT_TRUE(SameBits(Download<float>(dx, n), x));
}

// The other worker loops: zero-one-adam's variance steps, sync pushes and
// syncs, the hand-over's den and onebit-lamb's momentum replies.
TEST(CudaUpdate, WorkerLoopsOfEveryOptimizerMatchCpu) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  for (size_t n : Sizes(2048)) {
    SCOPED_TRACE(absl::StrCat("n=", n));
    const std::vector<float> g = Values(n, 50, 1e-2f), den = Denominators(n, 51);
    std::vector<float> m = Values(n, 52, 1e-2f), v = Values(n, 53, 1e-3f);
    for (float& vi : v) vi = vi * vi;
    if (n > 3) v[3] = std::numeric_limits<float>::quiet_NaN();  // std::max keeps it
    DeviceBuffer dg = Upload(g), dden = Upload(den), dm = Upload(m), dv = Upload(v);
    onebit::UpdateMoments(g.data(), 0.9f, 0.1f, 0.999f, 1.0f - 0.999f, n, m.data(), v.data());
    ASSERT_TRUE(UpdateMoments(dg.as<float>(), 0.9f, 0.1f, 0.999f, 1.0f - 0.999f, n, dm.as<float>(),
                              dv.as<float>(), nullptr)
                    .ok());
    EXPECT_TRUE(SameBits(Download<float>(dm, n), m)) << "m";
    EXPECT_TRUE(SameBits(Download<float>(dv, n), v)) << "v";

    std::vector<float> out(n);
    DeviceBuffer dout = Upload(out);
    onebit::VarianceDenominators(v.data(), 0.03f, 1e-8f, 1e-8f, n, out.data());
    ASSERT_TRUE(
        VarianceDenominators(dv.as<float>(), 0.03f, 1e-8f, 1e-8f, n, dout.as<float>(), nullptr)
            .ok());
    EXPECT_TRUE(SameBits(Download<float>(dout, n), out)) << "variance den";
    for (float& vi : v) vi = std::abs(vi);
    dv = Upload(v);
    onebit::FrozenDenominators(v.data(), 1e-8f, n, out.data());
    ASSERT_TRUE(FrozenDenominators(dv.as<float>(), 1e-8f, n, dout.as<float>(), nullptr).ok());
    EXPECT_TRUE(SameBits(Download<float>(dout, n), out)) << "frozen den";

    std::vector<float> x = Values(n, 54), xs = Values(n, 55);
    DeviceBuffer dx = Upload(x), dxs = Upload(xs);
    onebit::UpdateSinceSync(x.data(), xs.data(), den.data(), n, out.data());
    ASSERT_TRUE(UpdateSinceSync(dx.as<float>(), dxs.as<float>(), dden.as<float>(), n,
                                dout.as<float>(), nullptr)
                    .ok());
    EXPECT_TRUE(SameBits(Download<float>(dout, n), out)) << "u";
    for (float lrs : {0.0f, 0.03f}) {
      onebit::ApplySync(g.data(), den.data(), lrs, n, xs.data(), m.data(), x.data());
      ASSERT_TRUE(ApplySync(dg.as<float>(), dden.as<float>(), lrs, n, dxs.as<float>(),
                            dm.as<float>(), dx.as<float>(), nullptr)
                      .ok());
      EXPECT_TRUE(SameBits(Download<float>(dxs, n), xs)) << "x_sync, lrs " << lrs;
      EXPECT_TRUE(SameBits(Download<float>(dm, n), m)) << "m, lrs " << lrs;
      EXPECT_TRUE(SameBits(Download<float>(dx, n), x)) << "x, lrs " << lrs;
    }
    for (float wd : {0.0f, 0.01f}) {
      onebit::LambApply(g.data(), den.data(), -3e-3f, wd, n, x.data());
      ASSERT_TRUE(
          LambApply(dg.as<float>(), dden.as<float>(), -3e-3f, wd, n, dx.as<float>(), nullptr).ok());
      EXPECT_TRUE(SameBits(Download<float>(dx, n), x)) << "lamb, wd " << wd;
    }
  }
}

// A GPU worker's encode with error feedback (cuda/array_ops.h) equals the
// codec's, and a refused one leaves e as it was, as the codec does.
TEST(CudaArrayOps, EncodeWithFeedbackIsTheCodecsAndAllOrNothing) {
  ONEBIT_REQUIRE_GPU_OR_SKIP();
  CodecOptions o;
  o.block_size = 256;
  const std::unique_ptr<ArrayOps> ops = NewArrayOps(*CudaBackend(), nullptr, o);
  for (const char* kind : {"onebit", "fp16", "fp32"}) {
    SCOPED_TRACE(kind);
    const std::unique_ptr<const Codec> codec = *NewCodec(kind, o);
    const size_t n = 5 * 256 + 33, bytes = codec->EncodedSize(n);
    std::vector<float> y = Values(n, 60, 1e-2f), e = Values(n, 61, 1e-3f);
    DeviceBuffer dy = Upload(y), de = Upload(e), dout = Upload(std::vector<uint8_t>(bytes));
    std::vector<uint8_t> out(bytes);
    ASSERT_TRUE(codec->EncodeWithFeedback(y.data(), e.data(), n, out.data()).ok());
    ASSERT_TRUE(ops->Encode(*codec, dy.as<float>(), de.as<float>(), n, dout.as<uint8_t>()).ok());
    EXPECT_TRUE(SameBits(Download<uint8_t>(dout, bytes), out));
    EXPECT_TRUE(SameBits(Download<float>(de, n), e));
    y[700] = std::numeric_limits<float>::infinity();
    dy = Upload(y);
    const absl::Status st =
        ops->Encode(*codec, dy.as<float>(), de.as<float>(), n, dout.as<uint8_t>());
    EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("at index 700")) << st;
    EXPECT_TRUE(SameBits(Download<float>(de, n), e)) << "a refused encode changed e";
  }
}

}  // namespace
}  // namespace onebit::cuda
