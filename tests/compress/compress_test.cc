// Tests for the codecs of compress/codec.h, written from docs/design.md §1.3 and the
// header alone. The file carries its own scalar reference of every codec (the
// onebit canonical reduction, IEEE half rounding) and compares the library's
// bytes and floats to it bit for bit.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "compress/codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr size_t kGuard = 16;  // poisoned bytes / floats after every output buffer
constexpr uint8_t kPoison = 0xA5;
constexpr size_t kLarge = (size_t{1} << 20) + 13;

// ---------------------------------------------------------------------------
// Bits and messages.

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

std::string Hex(uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", u);
  return buf;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Every maximal run of decimal digits in msg, as a number.
std::vector<uint64_t> NumbersIn(absl::string_view msg) {
  std::vector<uint64_t> out;
  size_t i = 0;
  while (i < msg.size()) {
    if (!std::isdigit(static_cast<unsigned char>(msg[i]))) {
      ++i;
      continue;
    }
    uint64_t v = 0;
    while (i < msg.size() && std::isdigit(static_cast<unsigned char>(msg[i]))) {
      v = v * 10 + static_cast<uint64_t>(msg[i] - '0');
      ++i;
    }
    out.push_back(v);
  }
  return out;
}

bool MentionsNumber(const absl::Status& s, uint64_t n) {
  const std::vector<uint64_t> nums = NumbersIn(s.message());
  return std::find(nums.begin(), nums.end(), n) != nums.end();
}

::testing::AssertionResult SameBytes(const uint8_t* got, const uint8_t* want, size_t n) {
  size_t bad = 0, first = n;
  for (size_t i = 0; i < n; ++i) {
    if (got[i] != want[i]) {
      if (first == n) first = i;
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << n << " bytes differ; first at byte " << first << ": got 0x" << std::hex
         << int{got[first]} << ", want 0x" << int{want[first]} << std::dec;
}

::testing::AssertionResult SameBytes(const std::vector<uint8_t>& got,
                                     const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "sizes " << got.size() << " vs " << want.size();
  }
  return SameBytes(got.data(), want.data(), got.size());
}

::testing::AssertionResult SameFloats(const float* got, const float* want, size_t n) {
  size_t bad = 0, first = n;
  for (size_t i = 0; i < n; ++i) {
    if (Bits(got[i]) != Bits(want[i])) {
      if (first == n) first = i;
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << n << " floats differ bitwise; first at " << first << ": got "
         << got[first] << " (" << Hex(Bits(got[first])) << "), want " << want[first] << " ("
         << Hex(Bits(want[first])) << ")";
}

::testing::AssertionResult AllPoison(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != kPoison) {
      return ::testing::AssertionFailure() << "byte " << i << " past the end was written";
    }
  }
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------
// Reference IEEE half conversion (round to nearest, ties to even).

uint16_t RefFloatToHalf(float f) {
  const uint32_t x = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;  // NaN (the codec must refuse it)
  if (a == 0x7F800000u) return sign | 0x7C00u;
  if (a < 0x00800000u) return sign;  // fp32 zero or subnormal: far below half's 2^-25
  const int exp = static_cast<int>(a >> 23) - 127;
  const uint32_t mant = a & 0x7FFFFFu;
  if (exp > 15) return sign | 0x7C00u;  // overflow
  if (exp >= -14) {                     // half normal: keep 10 of 23 mantissa bits
    uint32_t h = (static_cast<uint32_t>(exp + 15) << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may reach inf: correct
    return static_cast<uint16_t>(sign | h);
  }
  if (exp < -25) return sign;  // below half of the smallest subnormal 2^-24
  // Half subnormal: value / 2^-24 = (1.mant * 2^23) * 2^(exp + 1).
  const uint32_t full = mant | 0x800000u;
  const int shift = -(exp + 1);  // 14 .. 24
  uint32_t q = full >> shift;
  const uint32_t rem = full & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;  // may become the smallest normal
  return static_cast<uint16_t>(sign | q);
}

float RefHalfToFloat(uint16_t h) {
  const float sign = (h & 0x8000u) ? -1.0f : 1.0f;
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -24);
  if (e == 31) return m ? kNaN : sign * kInf;
  return sign * std::ldexp(static_cast<float>(m | 0x400), e - 25);
}

// ---------------------------------------------------------------------------
// Reference onebit (docs/design.md §1.3).

// The canonical block reduction: 32 lanes, lane l sums elements l, l+32, ...
// in order from 0.0f; then for w = 16, 8, 4, 2, 1: t[l] += t[l+w] for l < w.
float CanonicalSum(const float* y, size_t n, ScaleRule rule) {
  float t[32] = {0};
  for (size_t i = 0; i < n; ++i) {
    const float v = rule == ScaleRule::kL1 ? std::fabs(y[i]) : y[i] * y[i];
    t[i % 32] += v;
  }
  for (int w = 16; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) t[l] += t[l + w];
  }
  return t[0];
}

float RefScale(const float* y, size_t n, ScaleRule rule) {
  const float mean = CanonicalSum(y, n, rule) / static_cast<float>(n);
  return rule == ScaleRule::kL1 ? mean : std::sqrt(mean);
}

struct Config {
  CodecKind kind;
  uint32_t block = 2048;
  ScaleRule rule = ScaleRule::kL1;
};

std::string Label(const Config& c) {
  switch (c.kind) {
    case CodecKind::kFp32:
      return "fp32";
    case CodecKind::kFp16:
      return "fp16";
    case CodecKind::kOnebit:
      return std::string("onebit/") + (c.rule == ScaleRule::kL1 ? "l1" : "l2") +
             "/B=" + std::to_string(c.block);
  }
  return "?";
}

std::string PathLabel(SimdPath p) {
  switch (p) {
    case SimdPath::kAuto:
      return "auto";
    case SimdPath::kScalar:
      return "scalar";
    case SimdPath::kAvx2:
      return "avx2";
    case SimdPath::kAvx512:
      return "avx512";
  }
  return "?";
}

std::vector<Config> AllConfigs() {
  std::vector<Config> out = {{CodecKind::kFp32}, {CodecKind::kFp16}};
  for (ScaleRule rule : {ScaleRule::kL1, ScaleRule::kL2}) {
    // 96: a block size that is a multiple of 32 but not a power of two.
    for (uint32_t b : {32u, 64u, 96u, 2048u}) out.push_back({CodecKind::kOnebit, b, rule});
  }
  return out;
}

std::vector<Config> OnebitConfigs() {
  std::vector<Config> out;
  for (const Config& c : AllConfigs()) {
    if (c.kind == CodecKind::kOnebit) out.push_back(c);
  }
  return out;
}

std::vector<SimdPath> Paths() {
  std::vector<SimdPath> out = {SimdPath::kScalar, SimdPath::kAuto};
  if (CpuHasAvx2()) out.push_back(SimdPath::kAvx2);
  if (CpuHasAvx512()) out.push_back(SimdPath::kAvx512);
  return out;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

// The independent scalar reference of one codec configuration.
class RefCodec {
 public:
  explicit RefCodec(const Config& c) : c_(c) {}

  size_t EncodedSize(size_t n) const {
    switch (c_.kind) {
      case CodecKind::kFp32:
        return 4 * n;
      case CodecKind::kFp16:
        return 2 * n;
      case CodecKind::kOnebit:
        return 4 * CeilDiv(n, c_.block) + CeilDiv(n, 8);
    }
    return 0;
  }

  std::vector<uint8_t> Encode(const float* x, size_t n) const {
    std::vector<uint8_t> out(EncodedSize(n), 0);
    switch (c_.kind) {
      case CodecKind::kFp32:
        for (size_t i = 0; i < n; ++i) PutU32(&out[4 * i], Bits(x[i]));
        break;
      case CodecKind::kFp16:
        for (size_t i = 0; i < n; ++i) {
          const uint16_t h = RefFloatToHalf(x[i]);
          out[2 * i] = static_cast<uint8_t>(h & 0xFF);
          out[2 * i + 1] = static_cast<uint8_t>(h >> 8);
        }
        break;
      case CodecKind::kOnebit: {
        const size_t blocks = CeilDiv(n, c_.block);
        for (size_t b = 0; b < blocks; ++b) {
          const size_t begin = b * c_.block;
          const size_t len = std::min<size_t>(c_.block, n - begin);
          PutU32(&out[4 * b], Bits(RefScale(x + begin, len, c_.rule)));
        }
        uint8_t* bits = out.data() + 4 * blocks;
        for (size_t j = 0; j < n; ++j) {
          if (std::signbit(x[j])) bits[j / 8] |= static_cast<uint8_t>(1u << (j % 8));
        }
        break;
      }
    }
    return out;
  }

  std::vector<float> Decode(const uint8_t* in, size_t n) const {
    std::vector<float> out(n);
    switch (c_.kind) {
      case CodecKind::kFp32:
        for (size_t i = 0; i < n; ++i) out[i] = FromBits(GetU32(in + 4 * i));
        break;
      case CodecKind::kFp16:
        for (size_t i = 0; i < n; ++i) {
          out[i] = RefHalfToFloat(static_cast<uint16_t>(in[2 * i] | (in[2 * i + 1] << 8)));
        }
        break;
      case CodecKind::kOnebit: {
        const size_t blocks = CeilDiv(n, c_.block);
        const uint8_t* bits = in + 4 * blocks;
        for (size_t j = 0; j < n; ++j) {
          const float s = FromBits(GetU32(in + 4 * (j / c_.block)));
          out[j] = ((bits[j / 8] >> (j % 8)) & 1u) ? -s : +s;
        }
        break;
      }
    }
    return out;
  }

  // z = y + e; out = C(z); e = z - D(C(z)).
  std::vector<uint8_t> EncodeWithFeedback(const float* y, float* e, size_t n) const {
    std::vector<float> z(n);
    for (size_t i = 0; i < n; ++i) z[i] = y[i] + e[i];
    std::vector<uint8_t> out = Encode(z.data(), n);
    const std::vector<float> d = Decode(out.data(), n);
    for (size_t i = 0; i < n; ++i) e[i] = z[i] - d[i];
    return out;
  }

 private:
  static void PutU32(uint8_t* p, uint32_t v) {
    for (int k = 0; k < 4; ++k) p[k] = static_cast<uint8_t>(v >> (8 * k));
  }
  static uint32_t GetU32(const uint8_t* p) {
    return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
  }
  Config c_;
};

// ---------------------------------------------------------------------------
// Inputs (fixed seeds).

std::vector<float> Gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Magnitudes over 2^-40 .. 2^41, with zeros, -0.0 and fp32 subnormals, so that
// the order of a block sum changes its rounding.
std::vector<float> WideRange(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> exp(-40, 40);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> pick(0, 999);
  std::vector<float> v(n);
  for (float& x : v) {
    const int p = pick(rng);
    const float sign = (rng() & 1u) ? -1.0f : 1.0f;
    if (p < 10) {
      x = 0.0f;
    } else if (p < 20) {
      x = -0.0f;
    } else if (p < 25) {
      x = sign * std::ldexp(mant(rng), -135);  // fp32 subnormal
    } else {
      x = sign * std::ldexp(mant(rng), exp(rng));
    }
  }
  return v;
}

// Values inside half's range: normals, half subnormals, values that underflow
// to zero, and exact ties between two neighbouring halves.
std::vector<float> HalfRange(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> exp(-27, 14);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> pick(0, 999);
  std::uniform_int_distribution<int> half(0, 0x7BFE);
  std::vector<float> v(n);
  for (float& x : v) {
    const int p = pick(rng);
    const float sign = (rng() & 1u) ? -1.0f : 1.0f;
    if (p < 10) {
      x = sign * 0.0f;
    } else if (p < 20) {
      x = sign * std::ldexp(mant(rng), -40);  // rounds to a signed zero
    } else if (p < 200) {
      const uint16_t h = static_cast<uint16_t>(half(rng));
      const double mid = (double{RefHalfToFloat(h)} + double{RefHalfToFloat(h + 1)}) / 2;
      x = sign * static_cast<float>(mid);  // exact: 12 significant bits
    } else {
      x = sign * std::ldexp(mant(rng), exp(rng));
    }
  }
  return v;
}

std::vector<float> Input(const Config& c, size_t n, uint32_t seed) {
  if (c.kind == CodecKind::kFp16) return HalfRange(n, seed);
  return (seed & 1u) ? WideRange(n, seed) : Gaussian(n, seed);
}

std::unique_ptr<const Codec> Make(const Config& c, SimdPath path = SimdPath::kAuto) {
  CodecOptions o;
  o.block_size = c.block;
  o.scale = c.rule;
  o.simd = path;
  auto codec = NewCodec(c.kind, o);
  EXPECT_TRUE(codec.ok()) << Label(c) << ": " << codec.status();
  if (!codec.ok()) return nullptr;
  return std::move(*codec);
}

std::vector<size_t> SizesFor(const Config& c, bool large) {
  const size_t b = c.kind == CodecKind::kOnebit ? c.block : 2048;
  std::vector<size_t> s = {0, 1, 7, 31, 32, 33, b - 1, b, b + 1, 2 * b + 5, 3 * b + 31};
  if (large) s.push_back(kLarge);
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

// ---------------------------------------------------------------------------
// The reference itself (so that a wrong oracle cannot pass silently).

TEST(ReferenceSelfCheck, HalfConversionKnownValues) {
  EXPECT_EQ(RefFloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(RefFloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(RefFloatToHalf(0.1f), 0x2E66);
  EXPECT_EQ(RefFloatToHalf(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(RefFloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(RefFloatToHalf(65519.0f), 0x7BFF);
  EXPECT_EQ(RefFloatToHalf(65520.0f), 0x7C00);  // the tie above the max rounds to inf
  EXPECT_EQ(RefFloatToHalf(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(RefFloatToHalf(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(RefFloatToHalf(std::ldexp(1.0f, -25)), 0x0000);         // tie -> even 0
  EXPECT_EQ(RefFloatToHalf(std::ldexp(1.5f, -25)), 0x0001);         // above the tie
  EXPECT_EQ(RefFloatToHalf(std::ldexp(3.0f, -25)), 0x0002);         // 1.5 units: tie -> 2
  EXPECT_EQ(RefFloatToHalf(std::ldexp(1023.5f, -24)), 0x0400);      // tie -> first normal
  EXPECT_EQ(RefFloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie -> even
  EXPECT_EQ(RefFloatToHalf(1.0f + std::ldexp(3.0f, -11)), 0x3C02);  // tie -> even
  EXPECT_EQ(RefFloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(RefFloatToHalf(-1e-30f), 0x8000);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00u) == 0x7C00u) continue;
    EXPECT_EQ(RefFloatToHalf(RefHalfToFloat(static_cast<uint16_t>(h))), h);
  }
  // Nearest, ties to even, on random values inside the range.
  const std::vector<float> v = HalfRange(20000, 99);
  for (float f : v) {
    const uint16_t h = RefFloatToHalf(f);
    const double err = std::fabs(double{f} - double{RefHalfToFloat(h)});
    const uint16_t mag = h & 0x7FFFu;
    for (int d : {-1, 1}) {
      if ((mag == 0 && d < 0) || mag + d > 0x7BFF) continue;
      const uint16_t other = static_cast<uint16_t>((h & 0x8000u) | (mag + d));
      const double other_err = std::fabs(double{f} - double{RefHalfToFloat(other)});
      ASSERT_LE(err, other_err) << f;
      if (err == other_err) {
        ASSERT_EQ(h & 1u, 0u) << f;
      }
    }
  }
}

TEST(ReferenceSelfCheck, CanonicalSumByHand) {
  // 64 elements: y[0] = 2^24, every other element 1.
  // Lane 0: 0 + 2^24 + 1 = 2^24 (tie, to even). Lanes 1..31: 1 + 1 = 2.
  // Tree: w=16: t0 = 2^24 + 2; w=8: + 4; w=4: + 8; w=2: + 16; w=1: + 32.
  // -> 16777216 + 62 = 16777278.
  std::vector<float> y(64, 1.0f);
  y[0] = 16777216.0f;
  EXPECT_EQ(CanonicalSum(y.data(), 64, ScaleRule::kL1), 16777278.0f);
}

// ---------------------------------------------------------------------------
// Wire format pinned by hand.

// n = 72, B = 32: blocks [0,32) [32,64) (all zeros) [64,72) (short).
std::vector<float> HandVector() {
  std::vector<float> y = {
      // Block 0. 16 x (+-1), 7 x (+-4), 9 x (+-0).
      1,  -1,    -1, 1,  1,     1,     -1, 1,      // negative: 1, 2, 6          -> byte 0 = 0x46
      -1, -1,    -1, -1, 1,     1,     1,  1,      // negative: 8..11            -> byte 1 = 0x0F
      4,  -4,    4,  -4, -4,    4,     4,  -0.0f,  // negative: 17, 19, 20, 23  -> byte 2 = 0x9A
      0,  -0.0f, 0,  0,  -0.0f, -0.0f, 0,  0,      // negative: 25, 28, 29 -> byte 3 = 0x32
  };
  // Block 1: all zeros; -0.0 at 33, 36, 39 (byte 4 = 0x92) and 63 (byte 7 = 0x80).
  for (int j = 32; j < 64; ++j) y.push_back(0.0f);
  y[33] = y[36] = y[39] = y[63] = -0.0f;
  // Block 2 (8 elements): negative at 65, 67, 69, 71 -> byte 8 = 0xAA.
  for (float v : {0.5f, -0.25f, 0.25f, -0.5f, 1.5f, -1.0f, 0.75f, -0.25f}) y.push_back(v);
  return y;
}

TEST(OnebitWireFormat, HandComputedBytesL1) {
  const std::vector<float> y = HandVector();
  ASSERT_EQ(y.size(), 72u);
  // Block 0: sum|y| = 16*1 + 7*4 = 44; 44/32 = 1.375 = 0x3FB00000.
  // Block 1: 0/32 = 0.
  // Block 2: sum|y| = .5+.25+.25+.5+1.5+1+.75+.25 = 5; 5/8 (not /32) = 0.625 = 0x3F200000.
  // Size: 4 * 3 + ceil(72 / 8) = 21 bytes.
  const std::vector<uint8_t> want = {
      0x00, 0x00, 0xB0, 0x3F,                                // scale 0, little endian
      0x00, 0x00, 0x00, 0x00,                                // scale 1
      0x00, 0x00, 0x20, 0x3F,                                // scale 2
      0x46, 0x0F, 0x9A, 0x32, 0x92, 0x00, 0x00, 0x80, 0xAA,  // sign bits
  };
  const Config cfg{CodecKind::kOnebit, 32, ScaleRule::kL1};
  EXPECT_TRUE(SameBytes(RefCodec(cfg).Encode(y.data(), 72), want)) << "reference disagrees";
  for (SimdPath path : Paths()) {
    SCOPED_TRACE(PathLabel(path));
    auto codec = Make(cfg, path);
    ASSERT_NE(codec, nullptr);
    ASSERT_EQ(codec->EncodedSize(72), 21u);
    std::vector<uint8_t> out(21 + kGuard, kPoison);
    ASSERT_TRUE(codec->Encode(y.data(), 72, out.data()).ok());
    EXPECT_TRUE(SameBytes(out.data(), want.data(), 21));
    EXPECT_TRUE(AllPoison(out.data() + 21, kGuard));

    std::vector<float> dec(72);
    ASSERT_TRUE(codec->Decode(want.data(), 72, dec.data()).ok());
    for (size_t j = 0; j < 72; ++j) {
      const float s = j < 32 ? 1.375f : j < 64 ? 0.0f : 0.625f;
      const float expect = std::signbit(y[j]) ? -s : s;
      EXPECT_EQ(Bits(dec[j]), Bits(expect)) << "element " << j;
    }
  }
}

TEST(OnebitWireFormat, HandComputedBytesL2) {
  const std::vector<float> y = HandVector();
  // Block 0: sum y^2 = 16*1 + 7*16 = 128; sqrt(128/32) = 2 = 0x40000000.
  // Block 2: sum y^2 = .25+.0625+.0625+.25+2.25+1+.5625+.0625 = 4.5; sqrt(4.5/8) = 0.75
  //          = 0x3F400000.
  const std::vector<uint8_t> want = {
      0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x40,
      0x3F, 0x46, 0x0F, 0x9A, 0x32, 0x92, 0x00, 0x00, 0x80, 0xAA,
  };
  const Config cfg{CodecKind::kOnebit, 32, ScaleRule::kL2};
  EXPECT_TRUE(SameBytes(RefCodec(cfg).Encode(y.data(), 72), want)) << "reference disagrees";
  for (SimdPath path : Paths()) {
    SCOPED_TRACE(PathLabel(path));
    auto codec = Make(cfg, path);
    ASSERT_NE(codec, nullptr);
    std::vector<uint8_t> out(21 + kGuard, kPoison);
    ASSERT_TRUE(codec->Encode(y.data(), 72, out.data()).ok());
    EXPECT_TRUE(SameBytes(out.data(), want.data(), 21));
    EXPECT_TRUE(AllPoison(out.data() + 21, kGuard));
  }
}

TEST(OnebitWireFormat, HandComputedBytesBlock64) {
  const std::vector<float> y = HandVector();
  // B = 64: blocks [0,64) and [64,72).
  // l1: 44/64 = 0.6875 = 0x3F300000, then 0.625 = 0x3F200000.
  // l2: sqrt(128/64) = sqrtf(2) = 0x3FB504F3 (correctly rounded), then 0.75 = 0x3F400000.
  // Size: 4 * 2 + 9 = 17 bytes.
  const std::vector<uint8_t> bits = {0x46, 0x0F, 0x9A, 0x32, 0x92, 0x00, 0x00, 0x80, 0xAA};
  std::vector<uint8_t> want_l1 = {0x00, 0x00, 0x30, 0x3F, 0x00, 0x00, 0x20, 0x3F};
  std::vector<uint8_t> want_l2 = {0xF3, 0x04, 0xB5, 0x3F, 0x00, 0x00, 0x40, 0x3F};
  want_l1.insert(want_l1.end(), bits.begin(), bits.end());
  want_l2.insert(want_l2.end(), bits.begin(), bits.end());
  for (ScaleRule rule : {ScaleRule::kL1, ScaleRule::kL2}) {
    const Config cfg{CodecKind::kOnebit, 64, rule};
    const std::vector<uint8_t>& want = rule == ScaleRule::kL1 ? want_l1 : want_l2;
    EXPECT_TRUE(SameBytes(RefCodec(cfg).Encode(y.data(), 72), want)) << "reference disagrees";
    for (SimdPath path : Paths()) {
      SCOPED_TRACE(Label(cfg) + " " + PathLabel(path));
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      ASSERT_EQ(codec->EncodedSize(72), 17u);
      std::vector<uint8_t> out(17 + kGuard, kPoison);
      ASSERT_TRUE(codec->Encode(y.data(), 72, out.data()).ok());
      EXPECT_TRUE(SameBytes(out.data(), want.data(), 17));
      EXPECT_TRUE(AllPoison(out.data() + 17, kGuard));
    }
  }
}

TEST(OnebitWireFormat, CanonicalReductionOrderByHand) {
  // The block of ReferenceSelfCheck.CanonicalSumByHand: canonical sum 16777278,
  // l1 scale 16777278 / 64 = 262144.96875 = 0x4880001F.
  // A sequential sum gives 2^24 / 64 = 0x48800000; an exact (double) sum gives
  // 16777279 / 64 -> 0x48800020; 8 lanes give 0x48800000. Only the canonical
  // order gives 1F 00 80 48.
  std::vector<float> y(64, 1.0f);
  y[0] = 16777216.0f;
  const std::vector<uint8_t> want = {0x1F, 0x00, 0x80, 0x48, 0, 0, 0, 0, 0, 0, 0, 0};
  for (uint32_t b : {64u, 2048u}) {
    const Config cfg{CodecKind::kOnebit, b, ScaleRule::kL1};
    for (SimdPath path : Paths()) {
      SCOPED_TRACE(Label(cfg) + " " + PathLabel(path));
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      std::vector<uint8_t> out(12 + kGuard, kPoison);
      ASSERT_TRUE(codec->Encode(y.data(), 64, out.data()).ok());
      EXPECT_TRUE(SameBytes(out.data(), want.data(), 12));
      EXPECT_TRUE(AllPoison(out.data() + 12, kGuard));
    }
  }
}

TEST(Fp16WireFormat, HandComputedBytes) {
  // value -> half (little endian bytes)
  const std::vector<std::pair<float, uint16_t>> table = {
      {1.0f, 0x3C00},
      {-2.0f, 0xC000},
      {0.1f, 0x2E66},         // 0x2E66 + 0.4 ulp -> down
      {1.0f / 3.0f, 0x3555},  // 0x3555 + 0.33 ulp -> down
      {65504.0f, 0x7BFF},     // the largest half
      {65519.0f, 0x7BFF},     // below the tie at 65520: rounds to the max
      {-65519.0f, 0xFBFF},
      {std::ldexp(1.0f, -24), 0x0001},         // the smallest subnormal
      {std::ldexp(1.0f, -25), 0x0000},         // tie -> even (+0)
      {std::ldexp(3.0f, -25), 0x0002},         // 1.5 units: tie -> even (2)
      {std::ldexp(1023.5f, -24), 0x0400},      // tie -> the smallest normal
      {1.0f + std::ldexp(1.0f, -11), 0x3C00},  // tie -> even (down)
      {1.0f + std::ldexp(3.0f, -11), 0x3C02},  // tie -> even (up)
      {1.0f + std::ldexp(3.0f, -12), 0x3C01},  // 0.75 ulp -> up
      {-(1.0f + std::ldexp(3.0f, -12)), 0xBC01},
      {-0.0f, 0x8000},
      {-1e-30f, 0x8000},  // underflows to -0
      {1e-40f, 0x0000},   // fp32 subnormal
  };
  // Every value at every position of an 8- or 16-wide vector: pad = 0..16.
  for (size_t pad = 0; pad <= 16; ++pad) {
    std::vector<float> x(pad, 1.0f);
    std::vector<uint8_t> want;
    for (size_t k = 0; k < pad; ++k) {
      want.push_back(0x00);
      want.push_back(0x3C);
    }
    for (const auto& [f, h] : table) {
      x.push_back(f);
      want.push_back(static_cast<uint8_t>(h & 0xFF));
      want.push_back(static_cast<uint8_t>(h >> 8));
    }
    const size_t n = x.size();
    for (SimdPath path : Paths()) {
      SCOPED_TRACE(PathLabel(path) + " pad=" + std::to_string(pad));
      auto codec = Make({CodecKind::kFp16}, path);
      ASSERT_NE(codec, nullptr);
      ASSERT_EQ(codec->EncodedSize(n), 2 * n);
      std::vector<uint8_t> out(2 * n + kGuard, kPoison);
      ASSERT_TRUE(codec->Encode(x.data(), n, out.data()).ok());
      EXPECT_TRUE(SameBytes(out.data(), want.data(), 2 * n));
      EXPECT_TRUE(AllPoison(out.data() + 2 * n, kGuard));
      std::vector<float> dec(n);
      ASSERT_TRUE(codec->Decode(want.data(), n, dec.data()).ok());
      for (size_t k = 0; k < table.size(); ++k) {
        EXPECT_EQ(Bits(dec[pad + k]), Bits(RefHalfToFloat(table[k].second))) << k;
      }
    }
  }
}

TEST(Fp32WireFormat, LittleEndianBitCopy) {
  const std::vector<float> x = {1.0f, -0.0f, 1e-40f, -3.5f};
  const std::vector<uint8_t> want = {0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0x80,
                                     0xC2, 0x16, 0x01, 0x00, 0x00, 0x00, 0x60, 0xC0};
  ASSERT_EQ(Bits(1e-40f), 0x000116C2u);
  for (SimdPath path : Paths()) {
    auto codec = Make({CodecKind::kFp32}, path);
    ASSERT_NE(codec, nullptr);
    std::vector<uint8_t> out(16 + kGuard, kPoison);
    ASSERT_TRUE(codec->Encode(x.data(), 4, out.data()).ok());
    EXPECT_TRUE(SameBytes(out.data(), want.data(), 16)) << PathLabel(path);
    EXPECT_TRUE(AllPoison(out.data() + 16, kGuard));
  }
}

// ---------------------------------------------------------------------------
// Round trip and agreement with the reference on random inputs.

TEST(CodecRoundTrip, EveryCodecEveryPathEqualsReference) {
  for (const Config& cfg : AllConfigs()) {
    const RefCodec ref(cfg);
    for (size_t n : SizesFor(cfg, /*large=*/true)) {
      const std::vector<float> x = Input(cfg, n, static_cast<uint32_t>(n * 7 + 1));
      const std::vector<uint8_t> want = ref.Encode(x.data(), n);
      const std::vector<float> want_dec = ref.Decode(want.data(), n);
      for (SimdPath path : Paths()) {
        SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " n=" + std::to_string(n));
        auto codec = Make(cfg, path);
        ASSERT_NE(codec, nullptr);
        ASSERT_EQ(codec->EncodedSize(n), want.size());
        std::vector<uint8_t> out(want.size() + kGuard, kPoison);
        const absl::Status st = codec->Encode(x.data(), n, out.data());
        ASSERT_TRUE(st.ok()) << st;
        ASSERT_TRUE(SameBytes(out.data(), want.data(), want.size()));
        ASSERT_TRUE(AllPoison(out.data() + want.size(), kGuard));

        std::vector<float> dec(n + kGuard, 7.0f);
        ASSERT_TRUE(codec->Decode(out.data(), n, dec.data()).ok());
        ASSERT_TRUE(SameFloats(dec.data(), want_dec.data(), n));
        for (size_t i = n; i < n + kGuard; ++i) ASSERT_EQ(dec[i], 7.0f) << "wrote past n";
        if (cfg.kind == CodecKind::kFp32) {
          ASSERT_TRUE(SameFloats(dec.data(), x.data(), n)) << "fp32 must be exact";
        }
        if (cfg.kind == CodecKind::kFp16) {
          for (size_t i = 0; i < n; ++i) {
            ASSERT_EQ(Bits(dec[i]), Bits(RefHalfToFloat(RefFloatToHalf(x[i])))) << i;
          }
        }
      }
    }
  }
}

TEST(CodecRoundTrip, LargestBlockSizeWithShortBlock) {
  // B = 2^24, n far below it: one short block, scale divides by n, not by B.
  for (ScaleRule rule : {ScaleRule::kL1, ScaleRule::kL2}) {
    const Config cfg{CodecKind::kOnebit, 1u << 24, rule};
    const size_t n = 100003;
    const std::vector<float> x = Gaussian(n, 5);
    const std::vector<uint8_t> want = RefCodec(cfg).Encode(x.data(), n);
    auto codec = Make(cfg);
    ASSERT_NE(codec, nullptr);
    ASSERT_EQ(codec->EncodedSize(n), 4 + CeilDiv(n, 8));
    std::vector<uint8_t> out(want.size());
    ASSERT_TRUE(codec->Encode(x.data(), n, out.data()).ok());
    EXPECT_TRUE(SameBytes(out, want)) << Label(cfg);
  }
}

TEST(CodecRoundTrip, CanonicalOrderOnWideDynamicRange) {
  // Random blocks whose sums depend on the order of addition; the scales must
  // equal the canonical ones bit for bit. The test first checks that the input
  // really discriminates between the canonical order and plausible others.
  for (const Config& cfg : OnebitConfigs()) {
    const size_t n = 64 * cfg.block + 17;
    const std::vector<float> x = WideRange(n, 4242 + cfg.block);
    const size_t blocks = CeilDiv(n, cfg.block);
    size_t differs_seq = 0, differs_double = 0;
    for (size_t b = 0; b < blocks; ++b) {
      const size_t begin = b * cfg.block, len = std::min<size_t>(cfg.block, n - begin);
      const float canon = CanonicalSum(x.data() + begin, len, cfg.rule);
      float seq = 0.0f;
      double exact = 0;
      for (size_t i = 0; i < len; ++i) {
        const float y = x[begin + i];
        const float v = cfg.rule == ScaleRule::kL1 ? std::fabs(y) : y * y;
        seq += v;
        exact += v;
      }
      differs_seq += Bits(seq) != Bits(canon);
      differs_double += Bits(static_cast<float>(exact)) != Bits(canon);
    }
    SCOPED_TRACE(Label(cfg));
    ASSERT_GT(differs_seq, 0u) << "input does not discriminate the summation order";
    ASSERT_GT(differs_double, 0u) << "input does not discriminate the summation order";

    const std::vector<uint8_t> want = RefCodec(cfg).Encode(x.data(), n);
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      std::vector<uint8_t> out(want.size());
      ASSERT_TRUE(codec->Encode(x.data(), n, out.data()).ok());
      // Scales first: report a scale mismatch as such.
      EXPECT_TRUE(SameBytes(out.data(), want.data(), 4 * blocks))
          << "block scales differ from the canonical reduction, " << PathLabel(path);
      EXPECT_TRUE(SameBytes(out, want)) << PathLabel(path);
    }
  }
}

TEST(OnebitScale, L1HasLowerSquaredErrorThanL2) {
  const size_t n = 1 << 20;
  const std::vector<float> x = Gaussian(n, 2024);
  for (uint32_t b : {32u, 256u, 2048u}) {
    double err[2] = {0, 0};
    for (int r = 0; r < 2; ++r) {
      const Config cfg{CodecKind::kOnebit, b, r == 0 ? ScaleRule::kL1 : ScaleRule::kL2};
      auto codec = Make(cfg);
      ASSERT_NE(codec, nullptr);
      std::vector<uint8_t> enc(codec->EncodedSize(n));
      std::vector<float> dec(n);
      ASSERT_TRUE(codec->Encode(x.data(), n, enc.data()).ok());
      ASSERT_TRUE(codec->Decode(enc.data(), n, dec.data()).ok());
      for (size_t i = 0; i < n; ++i) {
        const double d = double{x[i]} - double{dec[i]};
        err[r] += d * d;
      }
      err[r] /= n;
    }
    SCOPED_TRACE("B=" + std::to_string(b));
    EXPECT_LT(err[0], err[1]);
    // Unit Gaussian, large blocks: l1 error -> 1 - 2/pi = 0.363, l2 -> 2 - 2 sqrt(2/pi) = 0.404.
    if (b >= 2048) {
      EXPECT_NEAR(err[0], 1.0 - 2.0 / M_PI, 0.01);
      EXPECT_NEAR(err[1], 2.0 - 2.0 * std::sqrt(2.0 / M_PI), 0.01);
    }
  }
}

// ---------------------------------------------------------------------------
// Error feedback.

TEST(ErrorFeedback, EveryStepEqualsReference) {
  for (const Config& cfg : AllConfigs()) {
    const RefCodec ref(cfg);
    const size_t b = cfg.kind == CodecKind::kOnebit ? cfg.block : 2048;
    for (size_t n : {size_t{1}, size_t{7}, size_t{33}, b + 1, 3 * b + 17, size_t{100003}}) {
      for (SimdPath path : Paths()) {
        SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " n=" + std::to_string(n));
        auto codec = Make(cfg, path);
        ASSERT_NE(codec, nullptr);
        std::vector<float> e(n + kGuard, 0.0f), e_ref(n, 0.0f);
        for (size_t i = n; i < n + kGuard; ++i) e[i] = 9.0f;
        for (int t = 0; t < 8; ++t) {
          const float sigma = std::ldexp(1.0f, (t % 5) * 3 - 6);
          const std::vector<float> y = Gaussian(n, 100 * t + 3, sigma);
          const std::vector<uint8_t> want = ref.EncodeWithFeedback(y.data(), e_ref.data(), n);
          std::vector<uint8_t> out(want.size() + kGuard, kPoison);
          const absl::Status st = codec->EncodeWithFeedback(y.data(), e.data(), n, out.data());
          ASSERT_TRUE(st.ok()) << st << " step " << t;
          ASSERT_TRUE(SameBytes(out.data(), want.data(), want.size())) << "step " << t;
          ASSERT_TRUE(AllPoison(out.data() + want.size(), kGuard));
          ASSERT_TRUE(SameFloats(e.data(), e_ref.data(), n)) << "error after step " << t;
          for (size_t i = n; i < n + kGuard; ++i) ASSERT_EQ(e[i], 9.0f) << "e written past n";
        }
      }
    }
  }
}

TEST(ErrorFeedback, DecodedSumEqualsInputSumMinusFinalError) {
  // sum_t D(C(y_t + e_{t-1})) = sum_t y_t - e_T (e_0 = 0) holds exactly in real
  // arithmetic. In fp32 each step rounds z_t = y_t + e_{t-1} and e_t = z_t - D_t
  // once each, so per element the difference is bounded by
  // 2^-24 * sum_t (|z_t| + |e_t|); the test allows twice that (sums in double).
  const size_t n = 10007;
  const int steps = 50;
  std::vector<Config> cfgs = OnebitConfigs();
  cfgs.push_back({CodecKind::kFp16});
  for (const Config& cfg : cfgs) {
    SCOPED_TRACE(Label(cfg));
    auto codec = Make(cfg);
    ASSERT_NE(codec, nullptr);
    std::vector<float> e(n, 0.0f), dec(n);
    std::vector<double> sum_d(n, 0), sum_y(n, 0), bound(n, 0);
    std::vector<uint8_t> out(codec->EncodedSize(n));
    for (int t = 0; t < steps; ++t) {
      const std::vector<float> y = Gaussian(n, 7000 + t, 1.0f + 0.1f * (t % 7));
      std::vector<float> z(n);
      for (size_t i = 0; i < n; ++i) z[i] = y[i] + e[i];
      ASSERT_TRUE(codec->EncodeWithFeedback(y.data(), e.data(), n, out.data()).ok());
      ASSERT_TRUE(codec->Decode(out.data(), n, dec.data()).ok());
      for (size_t i = 0; i < n; ++i) {
        sum_d[i] += dec[i];
        sum_y[i] += y[i];
        bound[i] += std::fabs(double{z[i]}) + std::fabs(double{e[i]});
      }
    }
    size_t bad = 0;
    double worst = 0;
    for (size_t i = 0; i < n; ++i) {
      const double diff = std::fabs(sum_d[i] - (sum_y[i] - double{e[i]}));
      const double tol = 2.0 * std::ldexp(bound[i], -24) + 1e-30;
      worst = std::max(worst, diff / tol);
      bad += diff > tol;
    }
    EXPECT_EQ(bad, 0u) << "worst |diff| / tolerance = " << worst;
  }
}

// acc[i] = acc[i] + w * D(in)[i] for every size and weight (negative ones too);
// stops at the first mismatch of one (codec, path), then goes on with the next.
void CheckDecodeAdd(const Config& cfg, SimdPath path) {
  const RefCodec ref(cfg);
  auto codec = Make(cfg, path);
  ASSERT_NE(codec, nullptr);
  for (size_t n : SizesFor(cfg, /*large=*/false)) {
    const std::vector<float> x = Input(cfg, n, static_cast<uint32_t>(n + 11));
    const std::vector<uint8_t> payload = ref.Encode(x.data(), n);
    const std::vector<float> d = ref.Decode(payload.data(), n);
    const std::vector<float> acc0 = Gaussian(n, static_cast<uint32_t>(n + 12));
    for (float w : {1.0f / 3.0f, 1.0f, -2.5f, -1.0f / 3.0f}) {
      SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " n=" + std::to_string(n) +
                   " w=" + std::to_string(w));
      std::vector<float> want(n);
      for (size_t i = 0; i < n; ++i) {
        const float wd = w * d[i];
        want[i] = acc0[i] + wd;
      }
      std::vector<float> acc(acc0);
      acc.resize(n + kGuard, 5.0f);
      const absl::Status st = codec->DecodeAdd(payload.data(), n, w, acc.data());
      ASSERT_TRUE(st.ok()) << st;
      ASSERT_TRUE(SameFloats(acc.data(), want.data(), n));
      for (size_t i = n; i < n + kGuard; ++i) ASSERT_EQ(acc[i], 5.0f) << "acc written past n";
    }
  }
}

TEST(DecodeAdd, EqualsAccPlusWeightTimesDecode) {
  for (const Config& cfg : AllConfigs()) {
    for (SimdPath path : Paths()) CheckDecodeAdd(cfg, path);
  }
}

TEST(DecodeAdd, AveragesSeveralPushesInOrder) {
  // A server averaging 5 pushes: acc = 0; acc += (1/5) D(c_i) for i = 0..4.
  const size_t n = 3 * 2048 + 77;
  const float w = 1.0f / 5.0f;
  for (const Config& cfg : AllConfigs()) {
    const RefCodec ref(cfg);
    std::vector<float> want(n, 0.0f);
    std::vector<std::vector<uint8_t>> pushes;
    for (int r = 0; r < 5; ++r) {
      const std::vector<float> x = Input(cfg, n, 300 + r);
      pushes.push_back(ref.Encode(x.data(), n));
      const std::vector<float> d = ref.Decode(pushes.back().data(), n);
      for (size_t i = 0; i < n; ++i) {
        const float wd = w * d[i];
        want[i] = want[i] + wd;
      }
    }
    for (SimdPath path : Paths()) {
      SCOPED_TRACE(Label(cfg) + " " + PathLabel(path));
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      std::vector<float> acc(n, 0.0f);
      for (const auto& p : pushes) ASSERT_TRUE(codec->DecodeAdd(p.data(), n, w, acc.data()).ok());
      EXPECT_TRUE(SameFloats(acc.data(), want.data(), n));
    }
  }
}

// ---------------------------------------------------------------------------
// Every SIMD path produces the bytes of the scalar path.

// Runs every operation on the scalar codec and the one of `path` for cfg and
// n and requires identical bytes and floats. off = 1 moves every float buffer
// 4 bytes and every byte buffer 1 byte off the allocation (odd addresses).
void CompareToScalar(const Config& cfg, SimdPath path, const std::vector<size_t>& sizes,
                     size_t off) {
  auto scalar = Make(cfg, SimdPath::kScalar);
  auto avx2 = Make(cfg, path);
  ASSERT_NE(scalar, nullptr);
  ASSERT_NE(avx2, nullptr);
  EXPECT_EQ(scalar->simd_path(), "scalar");
  EXPECT_EQ(avx2->simd_path(), PathLabel(path));
  for (size_t n : sizes) {
    SCOPED_TRACE(Label(cfg) + " n=" + std::to_string(n) + " offset=" + std::to_string(off));
    const size_t size = scalar->EncodedSize(n);
    ASSERT_EQ(avx2->EncodedSize(n), size);
    std::vector<float> xbuf(n + 1);
    const std::vector<float> x = Input(cfg, n, static_cast<uint32_t>(3 * n + off));
    std::copy(x.begin(), x.end(), xbuf.begin() + off);
    const float* xp = xbuf.data() + off;

    // Encode.
    std::vector<uint8_t> o1(size + 1 + kGuard, kPoison), o2(size + 1 + kGuard, kPoison);
    ASSERT_TRUE(scalar->Encode(xp, n, o1.data() + off).ok());
    ASSERT_TRUE(avx2->Encode(xp, n, o2.data() + off).ok());
    ASSERT_TRUE(SameBytes(o2, o1)) << "Encode";

    // EncodeWithFeedback, output and updated e.
    const std::vector<float> e0 = cfg.kind == CodecKind::kFp16
                                      ? Gaussian(n, static_cast<uint32_t>(n + 1), 0.01f)
                                      : Input(cfg, n, static_cast<uint32_t>(n + 1));
    std::vector<float> e1(n + 1 + kGuard, 3.0f), e2(n + 1 + kGuard, 3.0f);
    std::copy(e0.begin(), e0.end(), e1.begin() + off);
    std::copy(e0.begin(), e0.end(), e2.begin() + off);
    std::vector<uint8_t> f1(size + 1 + kGuard, kPoison), f2(size + 1 + kGuard, kPoison);
    ASSERT_TRUE(scalar->EncodeWithFeedback(xp, e1.data() + off, n, f1.data() + off).ok());
    ASSERT_TRUE(avx2->EncodeWithFeedback(xp, e2.data() + off, n, f2.data() + off).ok());
    ASSERT_TRUE(SameBytes(f2, f1)) << "EncodeWithFeedback output";
    ASSERT_TRUE(SameFloats(e2.data(), e1.data(), e1.size())) << "EncodeWithFeedback e";

    // Decode.
    std::vector<float> d1(n + 1 + kGuard, 1.0f), d2(n + 1 + kGuard, 1.0f);
    ASSERT_TRUE(scalar->Decode(o1.data() + off, n, d1.data() + off).ok());
    ASSERT_TRUE(avx2->Decode(o1.data() + off, n, d2.data() + off).ok());
    ASSERT_TRUE(SameFloats(d2.data(), d1.data(), d1.size())) << "Decode";

    // DecodeAdd.
    const std::vector<float> acc0 = Gaussian(n, static_cast<uint32_t>(n + 2));
    for (float w : {1.0f / 3.0f, -1.0f, -2.5f}) {
      std::vector<float> a1(n + 1 + kGuard, 2.0f), a2(n + 1 + kGuard, 2.0f);
      std::copy(acc0.begin(), acc0.end(), a1.begin() + off);
      std::copy(acc0.begin(), acc0.end(), a2.begin() + off);
      ASSERT_TRUE(scalar->DecodeAdd(f1.data() + off, n, w, a1.data() + off).ok());
      ASSERT_TRUE(avx2->DecodeAdd(f1.data() + off, n, w, a2.data() + off).ok());
      ASSERT_TRUE(SameFloats(a2.data(), a1.data(), a1.size())) << "DecodeAdd w=" << w;
    }
  }
}

std::vector<size_t> SimdSizes() {
  std::vector<size_t> sizes;
  for (size_t n = 0; n <= 130; ++n) sizes.push_back(n);
  for (size_t n : {255, 256, 257, 1000, 2047, 2048, 2049, 4095, 6151, 65537, 100003}) {
    sizes.push_back(n);
  }
  return sizes;
}

TEST(SimdPaths, Avx2ByteIdenticalToScalar) {
  if (!CpuHasAvx2()) GTEST_SKIP() << "this CPU has no AVX2+F16C: only the scalar path runs";
  for (const Config& cfg : AllConfigs()) CompareToScalar(cfg, SimdPath::kAvx2, SimdSizes(), 0);
}

TEST(SimdPaths, Avx2ByteIdenticalToScalarAtOddAddresses) {
  // The header puts no alignment requirement on any buffer: payloads arrive at
  // arbitrary offsets inside network frames.
  if (!CpuHasAvx2()) GTEST_SKIP() << "this CPU has no AVX2+F16C: only the scalar path runs";
  for (const Config& cfg : AllConfigs()) CompareToScalar(cfg, SimdPath::kAvx2, SimdSizes(), 1);
}

TEST(SimdPaths, Avx512ByteIdenticalToScalar) {
  if (!CpuHasAvx512()) GTEST_SKIP() << "this CPU has no AVX-512F: its kernels cannot run here";
  for (const Config& cfg : AllConfigs()) {
    CompareToScalar(cfg, SimdPath::kAvx512, SimdSizes(), 0);
    CompareToScalar(cfg, SimdPath::kAvx512, SimdSizes(), 1);
  }
}

TEST(SimdPaths, TheWidestPathIsChosenAndALackingOneIsRefusedByName) {
  auto codec = Make({CodecKind::kOnebit, 64});
  ASSERT_NE(codec, nullptr);
  EXPECT_EQ(codec->simd_path(), CpuHasAvx512() ? "avx512" : CpuHasAvx2() ? "avx2" : "scalar");
  CodecOptions o;
  o.simd = SimdPath::kAvx512;
  auto avx512 = NewCodec("onebit", o);
  EXPECT_EQ(avx512.ok(), CpuHasAvx512());
  if (!avx512.ok()) {
    EXPECT_THAT(std::string(avx512.status().message()), HasSubstr("lacks AVX-512F"));
  }
}

TEST(SimdPaths, UnalignedBuffersEqualReference) {
  // Every path, with buffers off any vector alignment (floats +12 bytes, bytes +4),
  // equals the reference.
  for (const Config& cfg : AllConfigs()) {
    const RefCodec ref(cfg);
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      for (size_t n : {size_t{13}, size_t{2049}, size_t{10001}}) {
        SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " n=" + std::to_string(n));
        const std::vector<float> x = Input(cfg, n, static_cast<uint32_t>(n));
        std::vector<float> xbuf(n + 3);
        std::copy(x.begin(), x.end(), xbuf.begin() + 3);
        const std::vector<uint8_t> want = ref.Encode(x.data(), n);
        std::vector<uint8_t> out(want.size() + 4);
        ASSERT_TRUE(codec->Encode(xbuf.data() + 3, n, out.data() + 4).ok());
        EXPECT_TRUE(SameBytes(out.data() + 4, want.data(), want.size()));
        std::vector<float> dec(n + 3);
        ASSERT_TRUE(codec->Decode(out.data() + 4, n, dec.data() + 3).ok());
        const std::vector<float> want_dec = ref.Decode(want.data(), n);
        EXPECT_TRUE(SameFloats(dec.data() + 3, want_dec.data(), n));
      }
    }
  }
}

TEST(SimdPaths, ConcurrentUseOfOneCodec) {
  // A Codec is immutable and thread-safe: 4 threads encode at once.
  const Config cfg{CodecKind::kOnebit, 2048, ScaleRule::kL1};
  auto codec = Make(cfg);
  ASSERT_NE(codec, nullptr);
  const RefCodec ref(cfg);
  const size_t n = 50000;
  std::vector<std::vector<float>> xs;
  std::vector<std::vector<uint8_t>> outs(4), wants;
  for (int k = 0; k < 4; ++k) {
    xs.push_back(Gaussian(n, 900 + k));
    wants.push_back(ref.Encode(xs.back().data(), n));
    outs[k].resize(wants.back().size());
  }
  std::vector<std::thread> threads;
  bool ok[4] = {false, false, false, false};
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      bool good = true;
      for (int rep = 0; rep < 10; ++rep) {
        good = good && codec->Encode(xs[k].data(), n, outs[k].data()).ok();
      }
      ok[k] = good;
    });
  }
  for (auto& t : threads) t.join();
  for (int k = 0; k < 4; ++k) {
    EXPECT_TRUE(ok[k]);
    EXPECT_TRUE(SameBytes(outs[k], wants[k])) << "thread " << k;
  }
}

// ---------------------------------------------------------------------------
// Non-finite input: an error naming the first bad index, nothing written.

// n = 5000 elements, bad values at 3001 (block 1 for B = 2048, a late block for
// B = 32), and a second bad value at 4500 that must not be the one reported.
constexpr size_t kN = 5000;
constexpr size_t kBad = 3001;
constexpr size_t kBadLater = 4500;

void ExpectNamesIndex(const absl::Status& st, size_t index, size_t not_index) {
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(MentionsNumber(st, index))
      << "message does not name index " << index << ": " << st.message();
  EXPECT_FALSE(MentionsNumber(st, not_index))
      << "message names a later index " << not_index << ": " << st.message();
}

TEST(NonFinite, EncodeRejectsAndWritesNothing) {
  for (const Config& cfg : AllConfigs()) {
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      for (float bad : {kNaN, kInf, -kInf}) {
        SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " bad=" + std::to_string(bad));
        std::vector<float> x = Input(cfg, kN, 17);
        x[kBad] = bad;
        x[kBadLater] = kNaN;
        std::vector<uint8_t> out(codec->EncodedSize(kN) + kGuard, kPoison);
        ExpectNamesIndex(codec->Encode(x.data(), kN, out.data()), kBad, kBadLater);
        EXPECT_TRUE(AllPoison(out.data(), out.size())) << "output written on error";
      }
    }
  }
}

TEST(NonFinite, EncodeWithFeedbackRejectsBadYOrEAndWritesNothing) {
  struct Case {
    const char* what;
    size_t y_bad, e_bad;  // kN: none
    float value;
    size_t want;
  };
  const std::vector<Case> cases = {
      {"NaN in y", kBad, kN, kNaN, kBad},     {"+Inf in y", kBad, kN, kInf, kBad},
      {"-Inf in y", kBad, kN, -kInf, kBad},   {"NaN in e", kN, kBad, kNaN, kBad},
      {"+Inf in e", kN, kBad, kInf, kBad},    {"-Inf in e", kN, kBad, -kInf, kBad},
      {"e before y", kBad, 2500, kNaN, 2500},  // the first bad index of z = y + e
  };
  for (const Config& cfg : AllConfigs()) {
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      for (const Case& c : cases) {
        SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " " + c.what);
        std::vector<float> y = Gaussian(kN, 21);
        std::vector<float> e = Gaussian(kN, 22, 0.1f);
        if (c.y_bad < kN) y[c.y_bad] = c.value;
        if (c.e_bad < kN) e[c.e_bad] = c.value;
        y[kBadLater] = kInf;
        const std::vector<float> e_before = e;
        std::vector<uint8_t> out(codec->EncodedSize(kN) + kGuard, kPoison);
        ExpectNamesIndex(codec->EncodeWithFeedback(y.data(), e.data(), kN, out.data()), c.want,
                         kBadLater);
        EXPECT_TRUE(AllPoison(out.data(), out.size())) << "output written on error";
        EXPECT_TRUE(SameFloats(e.data(), e_before.data(), kN)) << "e changed on error";
      }
    }
  }
}

TEST(NonFinite, FeedbackSumThatOverflowsIsRejected) {
  // y and e are finite but z = y + e = 3e38 + 3e38 overflows to +Inf: C(z) would
  // encode a non-finite value, which docs/design.md §1.3 forbids.
  for (const Config& cfg : AllConfigs()) {
    for (SimdPath path : Paths()) {
      SCOPED_TRACE(Label(cfg) + " " + PathLabel(path));
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      std::vector<float> y = Gaussian(kN, 23);
      std::vector<float> e = Gaussian(kN, 24, 0.1f);
      y[kBad] = 3e38f;
      e[kBad] = 3e38f;
      const std::vector<float> e_before = e;
      std::vector<uint8_t> out(codec->EncodedSize(kN) + kGuard, kPoison);
      ExpectNamesIndex(codec->EncodeWithFeedback(y.data(), e.data(), kN, out.data()), kBad,
                       kBadLater);
      EXPECT_TRUE(AllPoison(out.data(), out.size()));
      EXPECT_TRUE(SameFloats(e.data(), e_before.data(), kN));
    }
  }
}

TEST(NonFinite, Fp16OverflowIsAnError) {
  for (SimdPath path : Paths()) {
    SCOPED_TRACE(PathLabel(path));
    auto codec = Make({CodecKind::kFp16}, path);
    ASSERT_NE(codec, nullptr);
    // 1e5 and 65520 (the tie above 65504, which rounds to inf) overflow half.
    for (float big : {1e5f, -1e5f, 65520.0f, -65520.0f, 3e38f}) {
      std::vector<float> x = HalfRange(kN, 31);
      x[kBad] = big;
      x[kBadLater] = 1e6f;
      std::vector<uint8_t> out(codec->EncodedSize(kN) + kGuard, kPoison);
      ExpectNamesIndex(codec->Encode(x.data(), kN, out.data()), kBad, kBadLater);
      EXPECT_TRUE(AllPoison(out.data(), out.size())) << big;
    }
    // Feedback: y = 60000, e = 10000 -> z = 70000 overflows half.
    std::vector<float> y = Gaussian(kN, 32), e(kN, 0.0f);
    y[kBad] = 60000.0f;
    e[kBad] = 10000.0f;
    const std::vector<float> e_before = e;
    std::vector<uint8_t> out(codec->EncodedSize(kN) + kGuard, kPoison);
    ExpectNamesIndex(codec->EncodeWithFeedback(y.data(), e.data(), kN, out.data()), kBad,
                     kBadLater);
    EXPECT_TRUE(AllPoison(out.data(), out.size()));
    EXPECT_TRUE(SameFloats(e.data(), e_before.data(), kN));
  }
}

// Decode and DecodeAdd of a corrupt payload: error, out / acc untouched.
void ExpectDecodeRejects(const Codec& codec, const std::vector<uint8_t>& payload, size_t n,
                         const std::string& what, size_t index = SIZE_MAX) {
  SCOPED_TRACE(what);
  std::vector<float> out(n + kGuard, 12345.0f);
  const absl::Status st = codec.Decode(payload.data(), n, out.data());
  EXPECT_FALSE(st.ok()) << "Decode accepted it";
  if (index != SIZE_MAX && !st.ok()) {
    EXPECT_TRUE(MentionsNumber(st, index)) << "Decode message: " << st.message();
  }
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out[i], 12345.0f) << "Decode wrote element " << i << " on error";
  }
  const std::vector<float> acc0 = Gaussian(n + kGuard, 77);
  std::vector<float> acc(acc0);
  const absl::Status st2 = codec.DecodeAdd(payload.data(), n, 0.5f, acc.data());
  EXPECT_FALSE(st2.ok()) << "DecodeAdd accepted it";
  if (index != SIZE_MAX && !st2.ok()) {
    EXPECT_TRUE(MentionsNumber(st2, index)) << "DecodeAdd message: " << st2.message();
  }
  EXPECT_TRUE(SameFloats(acc.data(), acc0.data(), acc.size())) << "DecodeAdd changed acc on error";
  // CheckPayload (what a GPU worker calls before decoding on the device)
  // refuses it with Decode's very error.
  EXPECT_EQ(codec.CheckPayload(payload.data(), n), st);
}

TEST(NonFinite, DecodeRejectsBadOnebitScale) {
  for (const Config& cfg : OnebitConfigs()) {
    const RefCodec ref(cfg);
    const std::vector<float> x = Gaussian(kN, 41);
    const std::vector<uint8_t> good = ref.Encode(x.data(), kN);
    const size_t blocks = CeilDiv(kN, cfg.block);
    const size_t bad_block = blocks - 1;  // the last block: not the first one
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      for (float s : {kNaN, kInf, -kInf, -1.0f, -1e-30f}) {
        std::vector<uint8_t> p = good;
        const uint32_t u = Bits(s);
        for (int k = 0; k < 4; ++k) p[4 * bad_block + k] = static_cast<uint8_t>(u >> (8 * k));
        ExpectDecodeRejects(*codec, p, kN,
                            Label(cfg) + " " + PathLabel(path) + " scale=" + std::to_string(s));
      }
    }
  }
}

TEST(NonFinite, DecodeRejectsNonFiniteFp32AndFp16Payload) {
  for (SimdPath path : Paths()) {
    auto fp32 = Make({CodecKind::kFp32}, path);
    auto fp16 = Make({CodecKind::kFp16}, path);
    ASSERT_NE(fp32, nullptr);
    ASSERT_NE(fp16, nullptr);
    const std::vector<float> x = Gaussian(kN, 51);
    const std::vector<uint8_t> good32 = RefCodec({CodecKind::kFp32}).Encode(x.data(), kN);
    const std::vector<uint8_t> good16 = RefCodec({CodecKind::kFp16}).Encode(x.data(), kN);
    for (uint32_t bad : {0x7FC00000u, 0xFFC00001u, 0x7F800000u, 0xFF800000u}) {
      std::vector<uint8_t> p = good32;
      for (int k = 0; k < 4; ++k) p[4 * kBad + k] = static_cast<uint8_t>(bad >> (8 * k));
      for (int k = 0; k < 4; ++k) p[4 * kBadLater + k] = static_cast<uint8_t>(bad >> (8 * k));
      ExpectDecodeRejects(*fp32, p, kN, "fp32 " + PathLabel(path) + " " + Hex(bad), kBad);
    }
    for (uint16_t bad : {uint16_t{0x7E00}, uint16_t{0xFE01}, uint16_t{0x7C00}, uint16_t{0xFC00}}) {
      std::vector<uint8_t> p = good16;
      p[2 * kBad] = static_cast<uint8_t>(bad & 0xFF);
      p[2 * kBad + 1] = static_cast<uint8_t>(bad >> 8);
      p[2 * kBadLater] = static_cast<uint8_t>(bad & 0xFF);
      p[2 * kBadLater + 1] = static_cast<uint8_t>(bad >> 8);
      ExpectDecodeRejects(*fp16, p, kN, "fp16 " + PathLabel(path) + " " + Hex(bad), kBad);
    }
  }
}

TEST(CheckPayload, AcceptsWhatTheEncoderWrites) {
  const std::vector<float> x = Gaussian(kN, 52);
  std::vector<Config> configs = OnebitConfigs();
  configs.push_back({CodecKind::kFp32});
  configs.push_back({CodecKind::kFp16});
  for (const Config& cfg : configs) {
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      const std::vector<uint8_t> p = RefCodec(cfg).Encode(x.data(), kN);
      EXPECT_TRUE(codec->CheckPayload(p.data(), kN).ok()) << Label(cfg) << " " << PathLabel(path);
      // An odd address (a small ZeroMQ frame) is read through a copy.
      std::vector<uint8_t> odd(p.size() + 1);
      std::copy(p.begin(), p.end(), odd.begin() + 1);
      EXPECT_TRUE(codec->CheckPayload(odd.data() + 1, kN).ok()) << Label(cfg);
    }
  }
}

// ---------------------------------------------------------------------------
// Factory, names, sizes.

TEST(NewCodecTest, RejectsUnknownKind) {
  for (const char* kind : {"fp8", "", "onebit2", "int8"}) {
    auto c = NewCodec(kind);
    ASSERT_FALSE(c.ok()) << "accepted '" << kind << "'";
    if (*kind != '\0') {
      EXPECT_THAT(std::string(c.status().message()), HasSubstr(kind));
    }
  }
  EXPECT_FALSE(NewCodec(static_cast<CodecKind>(0)).ok());
  EXPECT_FALSE(NewCodec(static_cast<CodecKind>(99)).ok());
  EXPECT_FALSE(ParseCodecKind("fp8").ok());
}

TEST(NewCodecTest, RejectsBadBlockSize) {
  for (uint32_t b :
       {0u, 1u, 16u, 31u, 33u, 48u, 100u, 2047u, 2049u, (1u << 24) + 32, 1u << 25, 0xFFFFFFFFu}) {
    CodecOptions o;
    o.block_size = b;
    auto c = NewCodec("onebit", o);
    ASSERT_FALSE(c.ok()) << "accepted block_size " << b;
    EXPECT_THAT(Lower(std::string(c.status().message())), HasSubstr("block"))
        << "block_size " << b << ": " << c.status().message();
  }
  for (uint32_t b : {32u, 64u, 96u, 2048u, 4064u, 1u << 24}) {
    CodecOptions o;
    o.block_size = b;
    auto c = NewCodec("onebit", o);
    EXPECT_TRUE(c.ok()) << "block_size " << b << ": " << c.status();
  }
}

TEST(NewCodecTest, RejectsBadScaleRule) {
  CodecOptions o;
  o.scale = static_cast<ScaleRule>(7);
  auto c = NewCodec("onebit", o);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(Lower(std::string(c.status().message())), HasSubstr("scale"));
  EXPECT_FALSE(ParseScaleRule("l3").ok());
}

TEST(NewCodecTest, Avx2RequestOnlyWhereTheCpuHasIt) {
  CodecOptions o;
  o.simd = SimdPath::kAvx2;
  for (const char* kind : {"fp32", "fp16", "onebit"}) {
    auto c = NewCodec(kind, o);
    EXPECT_EQ(c.ok(), CpuHasAvx2()) << kind << ": " << c.status();
  }
}

TEST(NewCodecTest, KindsNamesAndPaths) {
  for (const char* kind : {"fp32", "fp16", "onebit"}) {
    auto parsed = ParseCodecKind(kind);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(CodecKindName(*parsed), kind);
    auto c = NewCodec(kind);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ((*c)->kind(), *parsed);
    auto c2 = NewCodec(*parsed);
    ASSERT_TRUE(c2.ok()) << c2.status();
    EXPECT_EQ((*c2)->name(), (*c)->name());
    EXPECT_EQ((*c)->simd_path(), CpuHasAvx512() ? "avx512" : CpuHasAvx2() ? "avx2" : "scalar");
  }
  for (const char* rule : {"l1", "l2"}) {
    auto parsed = ParseScaleRule(rule);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(ScaleRuleName(*parsed), rule);
  }
  EXPECT_EQ(*ParseScaleRule("l1"), ScaleRule::kL1);
  EXPECT_EQ(*ParseScaleRule("l2"), ScaleRule::kL2);
  EXPECT_EQ(*ParseCodecKind("onebit"), CodecKind::kOnebit);
}

TEST(NewCodecTest, NamesChangeWithTheEncoding) {
  auto name = [](const Config& c, SimdPath p = SimdPath::kAuto) {
    auto codec = Make(c, p);
    return codec ? codec->name() : std::string("<error>");
  };
  EXPECT_EQ(name({CodecKind::kOnebit}), "onebit-l1-b2048");
  EXPECT_EQ(name({CodecKind::kFp32}), "fp32");
  EXPECT_EQ(name({CodecKind::kFp16}), "fp16");
  const std::vector<std::string> names = {
      name({CodecKind::kFp32}),
      name({CodecKind::kFp16}),
      name({CodecKind::kOnebit, 2048, ScaleRule::kL1}),
      name({CodecKind::kOnebit, 2048, ScaleRule::kL2}),
      name({CodecKind::kOnebit, 32, ScaleRule::kL1}),
      name({CodecKind::kOnebit, 32, ScaleRule::kL2}),
      name({CodecKind::kOnebit, 4096, ScaleRule::kL1}),
  };
  for (size_t i = 0; i < names.size(); ++i) {
    for (size_t j = i + 1; j < names.size(); ++j) {
      EXPECT_NE(names[i], names[j]) << i << " vs " << j;
    }
  }
  // The SIMD path does not change the bytes, so not the name either.
  for (const Config& c : AllConfigs()) {
    EXPECT_EQ(name(c, SimdPath::kScalar), name(c, SimdPath::kAuto)) << Label(c);
  }
}

TEST(NewCodecTest, EncodedSizeMatchesFormula) {
  const std::vector<uint64_t> ns = {0,
                                    1,
                                    7,
                                    8,
                                    9,
                                    31,
                                    32,
                                    33,
                                    63,
                                    64,
                                    65,
                                    2047,
                                    2048,
                                    2049,
                                    4096,
                                    4097,
                                    kLarge,
                                    1000000007,
                                    uint64_t{1} << 40};
  for (const Config& cfg : AllConfigs()) {
    auto codec = Make(cfg);
    ASSERT_NE(codec, nullptr);
    for (uint64_t n : ns) {
      uint64_t want = 0;
      switch (cfg.kind) {
        case CodecKind::kFp32:
          want = 4 * n;
          break;
        case CodecKind::kFp16:
          want = 2 * n;
          break;
        case CodecKind::kOnebit:
          want = 4 * CeilDiv(n, cfg.block) + CeilDiv(n, 8);
          break;
      }
      EXPECT_EQ(codec->EncodedSize(n), want) << Label(cfg) << " n=" << n;
    }
  }
}

TEST(EmptyInput, ZeroElementsIsANoOp) {
  for (const Config& cfg : AllConfigs()) {
    for (SimdPath path : Paths()) {
      SCOPED_TRACE(Label(cfg) + " " + PathLabel(path));
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      EXPECT_EQ(codec->EncodedSize(0), 0u);
      float f[4] = {1, 2, 3, 4}, e[4] = {5, 6, 7, 8};
      uint8_t b[4] = {kPoison, kPoison, kPoison, kPoison};
      EXPECT_TRUE(codec->Encode(f, 0, b).ok());
      EXPECT_TRUE(codec->EncodeWithFeedback(f, e, 0, b).ok());
      EXPECT_TRUE(codec->Decode(b, 0, f).ok());
      EXPECT_TRUE(codec->DecodeAdd(b, 0, 0.5f, f).ok());
      EXPECT_TRUE(AllPoison(b, 4));
      EXPECT_EQ(f[0], 1.0f);
      EXPECT_EQ(e[0], 5.0f);
    }
  }
}

// What an empty std::vector's data() gives (found by fuzz/codec_fuzzer: the
// scalar onebit encoder passed it to memset, undefined even for 0 bytes).
TEST(EmptyInput, NullBuffersForZeroElements) {
  for (const Config& cfg : AllConfigs()) {
    for (SimdPath path : Paths()) {
      SCOPED_TRACE(Label(cfg) + " " + PathLabel(path));
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      EXPECT_TRUE(codec->Encode(nullptr, 0, nullptr).ok());
      EXPECT_TRUE(codec->EncodeWithFeedback(nullptr, nullptr, 0, nullptr).ok());
      EXPECT_TRUE(codec->CheckPayload(nullptr, 0).ok());
      EXPECT_TRUE(codec->Decode(nullptr, 0, nullptr).ok());
      EXPECT_TRUE(codec->DecodeAdd(nullptr, 0, 0.5f, nullptr).ok());
    }
  }
}

// ---------------------------------------------------------------------------
// In pieces: the step's one pass over memory.

std::vector<Config> PieceConfigs() {
  std::vector<Config> out = AllConfigs();
  out.push_back({CodecKind::kOnebit, 6144, ScaleRule::kL1});  // a block larger than 4096
  return out;
}

TEST(EncodeInPieces, EqualsEncodeWithFeedbackAndRunsItsHooksPieceByPiece) {
  for (const Config& cfg : PieceConfigs()) {
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      const size_t p = codec->piece_elems();
      ASSERT_GE(p, 4096u);
      if (cfg.kind == CodecKind::kOnebit) {
        ASSERT_EQ(p % cfg.block, 0u);
      }
      for (size_t n : {size_t{1}, size_t{33}, p - 1, p, p + 1, 3 * p + 17, size_t{100003}}) {
        for (bool feedback : {true, false}) {
          SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " n=" + std::to_string(n) +
                       (feedback ? " with e" : " without e"));
          const std::vector<float> y = Input(cfg, n, static_cast<uint32_t>(n + 5));
          std::vector<float> e0 = Gaussian(n, 9, cfg.kind == CodecKind::kFp16 ? 0.01f : 0.3f);
          std::vector<float> e_want = e0;
          std::vector<uint8_t> want(codec->EncodedSize(n));
          ASSERT_TRUE((feedback ? codec->EncodeWithFeedback(y.data(), e_want.data(), n, want.data())
                                : codec->Encode(y.data(), n, want.data()))
                          .ok());
          std::vector<float> decoded_want(n);
          ASSERT_TRUE(codec->Decode(want.data(), n, decoded_want.data()).ok());

          // y starts as NaN: `before` writes each piece, so the encode must
          // come after it, piece by piece.
          std::vector<float> lazy(n, kNaN);
          std::vector<float> e = e0;
          std::vector<uint8_t> out(want.size() + kGuard, kPoison);
          std::vector<std::pair<size_t, size_t>> befores, afters;
          std::vector<float> seen(n, kNaN);
          auto before = [&](size_t b, size_t end) {
            befores.emplace_back(b, end);
            std::copy(y.begin() + b, y.begin() + end, lazy.begin() + b);
          };
          auto after = [&](size_t b, size_t end, const float* d) {
            afters.emplace_back(b, end);
            // The piece is encoded by now, the next one not yet.
            if (end < n && !std::isnan(lazy[end])) return absl::InternalError("ran ahead");
            std::copy(d, d + (end - b), seen.begin() + b);
            return absl::OkStatus();
          };
          const Codec::PieceHooks hooks{before, after, std::nullopt};
          const absl::Status st = codec->EncodeInPieces(lazy.data(), feedback ? e.data() : nullptr,
                                                        n, out.data(), hooks);
          ASSERT_TRUE(st.ok()) << st;
          ASSERT_TRUE(SameBytes(out.data(), want.data(), want.size()));
          ASSERT_TRUE(AllPoison(out.data() + want.size(), kGuard));
          ASSERT_TRUE(SameFloats(e.data(), (feedback ? e_want : e0).data(), n));
          ASSERT_TRUE(SameFloats(seen.data(), decoded_want.data(), n));
          std::vector<std::pair<size_t, size_t>> pieces;
          for (size_t b = 0; b < n; b += p) pieces.emplace_back(b, std::min(n, b + p));
          EXPECT_EQ(befores, pieces);
          EXPECT_EQ(afters, pieces);
        }
      }
    }
  }
}

TEST(EncodeInPieces, ANonFiniteValueStopsAtItsPieceNamingIt) {
  for (const Config& cfg : PieceConfigs()) {
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      const size_t p = codec->piece_elems();
      const size_t n = 4 * p;
      for (size_t bad : {size_t{5}, 2 * p + 3}) {
        SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " bad=" + std::to_string(bad));
        std::vector<float> y = Input(cfg, n, 4);
        y[bad] = kNaN;
        y[3 * p + 1] = kInf;  // in a later piece: not reached
        std::vector<float> e = Gaussian(n, 8, 0.01f);
        const std::vector<float> e0 = e;
        std::vector<uint8_t> out(codec->EncodedSize(n), kPoison);
        size_t befores = 0;
        auto before = [&](size_t, size_t) { ++befores; };
        const Codec::PieceHooks hooks{before, std::nullopt, std::nullopt};
        const absl::Status st = codec->EncodeInPieces(y.data(), e.data(), n, out.data(), hooks);
        ExpectNamesIndex(st, bad, 3 * p + 1);
        EXPECT_EQ(befores, bad / p + 1);
        const size_t done = bad / p * p;
        if (done == 0) {
          EXPECT_THAT(st.message(), HasSubstr("nothing was encoded or changed"));
        } else {
          EXPECT_THAT(st.message(),
                      HasSubstr("the elements before " + std::to_string(done) + " were encoded"));
        }
        // The pieces before the bad one carry their new errors; the bad
        // piece and those after it are as they were.
        std::vector<float> e_want(e0.begin(), e0.begin() + done);
        std::vector<uint8_t> scratch(codec->EncodedSize(done));
        ASSERT_TRUE(codec->EncodeWithFeedback(y.data(), e_want.data(), done, scratch.data()).ok());
        EXPECT_TRUE(SameFloats(e.data(), e_want.data(), done));
        EXPECT_TRUE(SameFloats(e.data() + done, e0.data() + done, n - done));
      }
    }
  }
}

TEST(EncodeInPieces, ASourceGivesEachPieceAndYIsNeverRead) {
  for (const Config& cfg : PieceConfigs()) {
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      const size_t p = codec->piece_elems();
      for (size_t n : {size_t{1}, p, 2 * p + 17}) {
        SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " n=" + std::to_string(n));
        const std::vector<float> y = Input(cfg, n, static_cast<uint32_t>(n + 3));
        const std::vector<float> e0 = Gaussian(n, 5, cfg.kind == CodecKind::kFp16 ? 0.01f : 0.3f);
        std::vector<float> e_want = e0;
        std::vector<uint8_t> want(codec->EncodedSize(n));
        ASSERT_TRUE(codec->EncodeWithFeedback(y.data(), e_want.data(), n, want.data()).ok());
        // One buffer for every piece, poisoned before each is written: the
        // codec must read the piece it was just given.
        std::vector<float> piece(p, kNaN);
        std::vector<std::pair<size_t, size_t>> sources;
        auto source = [&](size_t b, size_t end) -> const float* {
          sources.emplace_back(b, end);
          std::fill(piece.begin(), piece.end(), kNaN);
          std::copy(y.begin() + b, y.begin() + end, piece.begin());
          return piece.data();
        };
        std::vector<float> e = e0;
        std::vector<uint8_t> out(want.size() + kGuard, kPoison);
        const Codec::PieceHooks hooks{std::nullopt, std::nullopt, source};
        const absl::Status st = codec->EncodeInPieces(nullptr, e.data(), n, out.data(), hooks);
        ASSERT_TRUE(st.ok()) << st;
        EXPECT_TRUE(SameBytes(out.data(), want.data(), want.size()));
        EXPECT_TRUE(AllPoison(out.data() + want.size(), kGuard));
        EXPECT_TRUE(SameFloats(e.data(), e_want.data(), n));
        std::vector<std::pair<size_t, size_t>> pieces;
        for (size_t b = 0; b < n; b += p) pieces.emplace_back(b, std::min(n, b + p));
        EXPECT_EQ(sources, pieces);
      }
      // A non-finite value from the source is named by its index in y.
      const size_t n = 3 * p, bad = p + 7;
      std::vector<float> y = Input(cfg, n, 9);
      y[bad] = kInf;
      std::vector<float> piece(p);
      auto source = [&](size_t b, size_t end) -> const float* {
        std::copy(y.begin() + b, y.begin() + end, piece.begin());
        return piece.data();
      };
      std::vector<uint8_t> out(codec->EncodedSize(n));
      const absl::Status st = codec->EncodeInPieces(nullptr, nullptr, n, out.data(),
                                                    {std::nullopt, std::nullopt, source});
      ExpectNamesIndex(st, bad, 7);
      EXPECT_THAT(st.message(), HasSubstr("the elements before " + std::to_string(p)));
    }
  }
}

TEST(DecodeRange, IsThoseElementsOfDecodeAndDecodeAddAtAnyPayloadAddress) {
  for (const Config& cfg : PieceConfigs()) {
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      const size_t p = codec->piece_elems();
      const size_t n = 3 * p + 45;
      std::vector<float> y = Input(cfg, n, 31);
      for (size_t i = 0; i < n; i += 7) y[i] = (i % 2 == 0) ? -0.0f : 0.0f;
      std::vector<uint8_t> encoded(codec->EncodedSize(n));
      ASSERT_TRUE(codec->Encode(y.data(), n, encoded.data()).ok());
      // At an odd address too: a payload as it lies in a message.
      for (size_t shift : {size_t{0}, size_t{1}}) {
        std::vector<uint8_t> buffer(encoded.size() + shift);
        std::copy(encoded.begin(), encoded.end(), buffer.begin() + shift);
        const uint8_t* payload = buffer.data() + shift;
        std::vector<float> whole(n);
        ASSERT_TRUE(codec->Decode(payload, n, whole.data()).ok());
        const float w = -1.0f / 3.0f;
        std::vector<float> acc0 = Gaussian(n, 6);
        std::vector<float> added = acc0;
        ASSERT_TRUE(codec->DecodeAdd(payload, n, w, added.data()).ok());
        for (auto [b, e] :
             {std::pair<size_t, size_t>{0, p}, {p, 2 * p}, {3 * p, n}, {p, n}, {2 * p, 2 * p}}) {
          SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " shift=" + std::to_string(shift) +
                       " [" + std::to_string(b) + ", " + std::to_string(e) + ")");
          std::vector<float> out(e - b + kGuard, 7.0f);
          codec->DecodeRange(payload, n, b, e, out.data());
          EXPECT_TRUE(SameFloats(out.data(), whole.data() + b, e - b));
          for (size_t i = e - b; i < out.size(); ++i) ASSERT_EQ(out[i], 7.0f) << "wrote past e";
          std::vector<float> acc(acc0.begin() + b, acc0.begin() + e);
          acc.resize(e - b + kGuard, 7.0f);
          codec->DecodeAddRange(payload, n, b, e, w, acc.data());
          EXPECT_TRUE(SameFloats(acc.data(), added.data() + b, e - b));
          for (size_t i = e - b; i < acc.size(); ++i) ASSERT_EQ(acc[i], 7.0f) << "wrote past e";
        }
      }
    }
  }
}

TEST(EncodeInPieces, AnAfterHooksErrorEndsTheCall) {
  auto codec = Make({CodecKind::kOnebit, 64});
  ASSERT_NE(codec, nullptr);
  const size_t p = codec->piece_elems(), n = 3 * p;
  const std::vector<float> y = Gaussian(n, 2);
  std::vector<uint8_t> out(codec->EncodedSize(n));
  size_t befores = 0;
  auto before = [&](size_t, size_t) { ++befores; };
  auto after = [&](size_t b, size_t, const float*) {
    return b > 0 ? absl::DataLossError("x is not finite") : absl::OkStatus();
  };
  const Codec::PieceHooks hooks{before, after, std::nullopt};
  const absl::Status st = codec->EncodeInPieces(y.data(), nullptr, n, out.data(), hooks);
  EXPECT_EQ(st, absl::DataLossError("x is not finite"));
  EXPECT_EQ(befores, 2u);
}

TEST(DecodeInPieces, EqualsDecodeAndABadPayloadWritesNothing) {
  for (const Config& cfg : PieceConfigs()) {
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      const size_t p = codec->piece_elems();
      for (size_t n : {size_t{1}, p, 2 * p + 3}) {
        SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " n=" + std::to_string(n));
        const std::vector<float> y = Input(cfg, n, 12);
        std::vector<uint8_t> payload(codec->EncodedSize(n));
        ASSERT_TRUE(codec->Encode(y.data(), n, payload.data()).ok());
        std::vector<float> want(n);
        ASSERT_TRUE(codec->Decode(payload.data(), n, want.data()).ok());
        std::vector<float> out(n + kGuard, 7.0f);
        std::vector<std::pair<size_t, size_t>> afters;
        auto after = [&](size_t b, size_t end, const float* d) {
          afters.emplace_back(b, end);
          if (d != out.data() + b) return absl::InternalError("not the piece of out");
          return absl::OkStatus();
        };
        ASSERT_TRUE(codec->DecodeInPieces(payload.data(), n, out.data(), after).ok());
        EXPECT_TRUE(SameFloats(out.data(), want.data(), n));
        for (size_t i = n; i < n + kGuard; ++i) ASSERT_EQ(out[i], 7.0f) << "wrote past n";
        std::vector<std::pair<size_t, size_t>> pieces;
        for (size_t b = 0; b < n; b += p) pieces.emplace_back(b, std::min(n, b + p));
        EXPECT_EQ(afters, pieces);

        // The last element (onebit: the last block's scale) made bad: the
        // check comes first, so nothing is decoded and no hook runs.
        if (cfg.kind == CodecKind::kOnebit) {
          const float bad = -1.0f;
          std::memcpy(payload.data() + 4 * ((n - 1) / cfg.block), &bad, 4);
        } else if (cfg.kind == CodecKind::kFp32) {
          std::memcpy(payload.data() + 4 * (n - 1), &kNaN, 4);
        } else {
          const uint16_t nan_half = 0x7E00;
          std::memcpy(payload.data() + 2 * (n - 1), &nan_half, 2);
        }
        std::fill(out.begin(), out.end(), 7.0f);
        afters.clear();
        EXPECT_FALSE(codec->DecodeInPieces(payload.data(), n, out.data(), after).ok());
        EXPECT_TRUE(afters.empty());
        for (float v : out) ASSERT_EQ(v, 7.0f) << "written on error";
      }
    }
  }
}

TEST(DecodeScaled, IsDecodeAddOnZerosBitForBit) {
  for (const Config& cfg : PieceConfigs()) {
    for (SimdPath path : Paths()) {
      auto codec = Make(cfg, path);
      ASSERT_NE(codec, nullptr);
      for (size_t n : {size_t{1}, size_t{100}, 2 * codec->piece_elems() + 37}) {
        // Zeros (onebit: whole blocks of them, a zero scale) and negative
        // zeros, where 0 + v differs from v.
        std::vector<float> y = Input(cfg, n, 77);
        for (size_t i = 0; i < n / 2; ++i) y[i] = (i % 3 == 0) ? -0.0f : 0.0f;
        std::vector<uint8_t> payload(codec->EncodedSize(n));
        ASSERT_TRUE(codec->Encode(y.data(), n, payload.data()).ok());
        for (float w : {1.0f, 0.25f, -1.0f / 3.0f}) {
          SCOPED_TRACE(Label(cfg) + " " + PathLabel(path) + " n=" + std::to_string(n) +
                       " w=" + std::to_string(w));
          std::vector<float> want(n, 0.0f);
          ASSERT_TRUE(codec->DecodeAdd(payload.data(), n, w, want.data()).ok());
          std::vector<float> got(n + kGuard, 7.0f);
          ASSERT_TRUE(DecodeScaled(*codec, payload.data(), n, w, got.data()).ok());
          EXPECT_TRUE(SameFloats(got.data(), want.data(), n));
          for (size_t i = n; i < n + kGuard; ++i) ASSERT_EQ(got[i], 7.0f) << "wrote past n";
        }
        // A bad payload writes nothing.
        std::vector<uint8_t> bad = payload;
        if (cfg.kind == CodecKind::kOnebit) {
          std::memcpy(bad.data(), &kNaN, 4);
        } else if (cfg.kind == CodecKind::kFp32) {
          std::memcpy(bad.data() + 4 * (n - 1), &kNaN, 4);
        } else {
          const uint16_t inf_half = 0x7C00;
          std::memcpy(bad.data() + 2 * (n - 1), &inf_half, 2);
        }
        std::vector<float> got(n, 7.0f);
        EXPECT_FALSE(DecodeScaled(*codec, bad.data(), n, 0.5f, got.data()).ok());
        for (float v : got) ASSERT_EQ(v, 7.0f) << "written on error";
      }
    }
  }
}

}  // namespace
}  // namespace onebit
