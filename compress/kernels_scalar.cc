// Portable kernels: the definition every other path must match byte for byte.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "compress/kernels.h"

namespace onebit::compress_internal {
namespace {

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float Z(const float* y, const float* e, size_t i) { return e ? y[i] + e[i] : y[i]; }

// The canonical block reduction (docs/design.md §1.3): lane l sums elements l,
// l+32, ... in order, then the lanes meet in a halving tree.
inline float CanonicalSum(const float* y, const float* e, size_t len, ScaleRule rule) {
  float t[32] = {};
  for (size_t i = 0; i < len; ++i) {
    const float z = Z(y, e, i);
    t[i % 32] += rule == ScaleRule::kL1 ? std::fabs(z) : z * z;
  }
  for (int w = 16; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) t[l] += t[l + w];
  }
  return t[0];
}

size_t OnebitScales(const float* y, const float* e, size_t n, uint32_t block, ScaleRule rule,
                    float* scales) {
  for (size_t start = 0, b = 0; start < n; start += block, ++b) {
    const size_t len = std::min<size_t>(block, n - start);
    for (size_t i = start; i < start + len; ++i) {
      if (!std::isfinite(Z(y, e, i))) return i;
    }
    const float sum = CanonicalSum(y + start, e ? e + start : nullptr, len, rule);
    const float mean = sum / static_cast<float>(len);
    scales[b] = rule == ScaleRule::kL1 ? mean : std::sqrt(mean);
  }
  return n;
}

void OnebitSigns(const float* y, float* e, size_t n, uint32_t block, const float* scales,
                 uint8_t* bits) {
  if (n == 0) return;  // bits may be null then (an empty vector's data()): memset would be UB
  std::memset(bits, 0, (n + 7) / 8);
  for (size_t i = 0; i < n; ++i) {
    const float z = Z(y, e, i);
    const float s = scales[i / block];
    const bool neg = std::signbit(z);
    bits[i / 8] |= static_cast<uint8_t>(neg) << (i % 8);
    if (e) e[i] = z - (neg ? -s : s);
  }
}

inline float OnebitValue(const float* scales, const uint8_t* bits, size_t i, uint32_t block) {
  const float s = scales[i / block];
  return (bits[i / 8] >> (i % 8)) & 1 ? -s : s;
}

void OnebitDecode(const float* scales, const uint8_t* bits, size_t n, uint32_t block, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = OnebitValue(scales, bits, i, block);
}

void OnebitDecodeAdd(const float* scales, const uint8_t* bits, size_t n, uint32_t block, float w,
                     float* acc) {
  for (size_t i = 0; i < n; ++i) acc[i] += w * OnebitValue(scales, bits, i, block);
}

// |z| >= 65520 rounds to Inf in half precision (65504 is the largest half and
// 65520 the midpoint to 2^16, where ties go to the even, infinite, neighbour).
constexpr float kHalfOverflow = 65520.0f;

size_t Fp16Check(const float* y, const float* e, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!(std::fabs(Z(y, e, i)) < kHalfOverflow)) return i;  // also catches NaN
  }
  return n;
}

void Fp16Encode(const float* y, float* e, size_t n, uint16_t* out) {
  for (size_t i = 0; i < n; ++i) {
    const float z = Z(y, e, i);
    out[i] = FloatToHalf(z);
    if (e) e[i] = z - HalfToFloat(out[i]);
  }
}

size_t Fp16CheckPayload(const uint16_t* in, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if ((in[i] & 0x7c00) == 0x7c00) return i;
  }
  return n;
}

void Fp16Decode(const uint16_t* in, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

void Fp16DecodeAdd(const uint16_t* in, size_t n, float w, float* acc) {
  for (size_t i = 0; i < n; ++i) acc[i] += w * HalfToFloat(in[i]);
}

size_t FirstNonFinite(const float* y, const float* e, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(Z(y, e, i))) return i;
  }
  return n;
}

void Axpy(const float* x, size_t n, float w, float* acc) {
  for (size_t i = 0; i < n; ++i) acc[i] += w * x[i];
}

}  // namespace

uint16_t FloatToHalf(float f) {
  const uint32_t x = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  uint32_t ax = x & 0x7fffffff;
  if (ax > 0x7f800000) return sign | 0x7e00;   // NaN (quiet)
  if (ax >= 0x477ff000) return sign | 0x7c00;  // >= 65520: Inf
  if (ax < 0x38800000) {
    // Below 2^-14: a half subnormal, a multiple of 2^-24. Adding 0.5f (whose
    // ulp is 2^-24) lets the FPU do the round-to-nearest-even for us.
    const float r = FromBits(ax) + 0.5f;
    return sign | static_cast<uint16_t>(Bits(r) - Bits(0.5f));
  }
  // Normal: rebias the exponent (127 -> 15) and round 23 mantissa bits to 10,
  // to nearest even; a carry correctly bumps the exponent.
  ax += 0xc8000fffu + ((ax >> 13) & 1);
  return sign | static_cast<uint16_t>(ax >> 13);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float mag = static_cast<float>(mant) * 0x1p-24f;
    return FromBits(Bits(mag) | sign);
  }
  if (exp == 31) return FromBits(sign | 0x7f800000 | (mant << 13));
  return FromBits(sign | ((exp + 112) << 23) | (mant << 13));
}

const Kernels& ScalarKernels() {
  static const Kernels k = {
      "scalar",   OnebitScales,     OnebitSigns, OnebitDecode,  OnebitDecodeAdd, Fp16Check,
      Fp16Encode, Fp16CheckPayload, Fp16Decode,  Fp16DecodeAdd, FirstNonFinite,  Axpy,
  };
  return k;
}

}  // namespace onebit::compress_internal
