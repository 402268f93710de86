// AVX2 + F16C kernels. Compiled with -mavx2 -mf16c (and never -mfma: fused
// multiply-add would round differently from the scalar twins). Each function
// computes exactly what its twin in kernels_scalar.cc computes, in the same
// order, 8 lanes at a time; the canonical 32-lane reduction maps onto four
// accumulators (lanes 0-7, 8-15, 16-23, 24-31).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "compress/kernels.h"

namespace onebit::compress_internal {
namespace {

const __m256 kSignMask = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
const __m256 kFltMax = _mm256_set1_ps(3.40282347e+38f);

// Lanes [0, count) set, for masked loads and stores of a tail.
inline __m256i TailMask(size_t count) {
  alignas(32) static const int32_t kTable[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                                 0,  0,  0,  0,  0,  0,  0,  0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kTable + 8 - count));
}

inline __m256 LoadZ(const float* y, const float* e, size_t i) {
  const __m256 v = _mm256_loadu_ps(y + i);
  return e ? _mm256_add_ps(v, _mm256_loadu_ps(e + i)) : v;
}

inline __m256 LoadZMasked(const float* y, const float* e, size_t i, __m256i mask) {
  const __m256 v = _mm256_maskload_ps(y + i, mask);
  return e ? _mm256_add_ps(v, _mm256_maskload_ps(e + i, mask)) : v;
}

// Accumulates |z| or z*z into acc. A NaN or +-Inf z makes the block's sum
// non-finite (the terms are never negative, so nothing cancels), which is
// how the caller finds bad input without a test per element.
inline void Accumulate(__m256 z, ScaleRule rule, __m256* acc) {
  *acc = _mm256_add_ps(
      *acc, rule == ScaleRule::kL1 ? _mm256_andnot_ps(kSignMask, z) : _mm256_mul_ps(z, z));
}

size_t OnebitScales(const float* y, const float* e, size_t n, uint32_t block, ScaleRule rule,
                    float* scales) {
  for (size_t start = 0, b = 0; start < n; start += block, ++b) {
    const size_t len = std::min<size_t>(block, n - start);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    const size_t end = start + len;
    size_t i = start;
    for (; i + 32 <= end; i += 32) {
      for (int k = 0; k < 4; ++k) Accumulate(LoadZ(y, e, i + 8 * k), rule, &acc[k]);
    }
    // Short last block: masked-off lanes load as 0 and add +0 to a
    // non-negative sum, which leaves it unchanged, as in the scalar loop.
    for (int k = 0; i < end; i += 8, ++k) {
      const __m256 z = LoadZMasked(y, e, i, TailMask(std::min<size_t>(8, end - i)));
      Accumulate(z, rule, &acc[k]);
    }
    // The halving tree: w = 16, 8, then 4, 2, 1 inside one register.
    const __m256 h0 = _mm256_add_ps(acc[0], acc[2]);
    const __m256 h1 = _mm256_add_ps(acc[1], acc[3]);
    const __m256 h = _mm256_add_ps(h0, h1);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    const size_t done = FinishBlockScale(_mm_cvtss_f32(q), y, e, start, end, rule, &scales[b]);
    if (done < end) return done;
  }
  return n;
}

// Eight elements: their sign bits, and e = z - (+-s) when e != nullptr.
inline uint32_t SignsOf8(__m256 z, __m256 s, float* e_out) {
  if (e_out) {
    const __m256 d = _mm256_or_ps(s, _mm256_and_ps(z, kSignMask));
    _mm256_storeu_ps(e_out, _mm256_sub_ps(z, d));
  }
  return static_cast<uint32_t>(_mm256_movemask_ps(z));
}

void OnebitSigns(const float* y, float* e, size_t n, uint32_t block, const float* scales,
                 uint8_t* bits) {
  for (size_t start = 0, b = 0; start < n; start += block, ++b) {
    const size_t end = start + std::min<size_t>(block, n - start);
    const __m256 s = _mm256_set1_ps(scales[b]);
    size_t i = start;
    for (; i + 32 <= end; i += 32) {
      uint32_t word = 0;
      for (int k = 0; k < 4; ++k) {
        word |= SignsOf8(LoadZ(y, e, i + 8 * k), s, e ? e + i + 8 * k : nullptr) << (8 * k);
      }
      std::memcpy(bits + i / 8, &word, 4);
    }
    for (; i < end; i += 8) {
      const size_t count = std::min<size_t>(8, end - i);
      const __m256i mask = TailMask(count);
      const __m256 z = LoadZMasked(y, e, i, mask);
      const __m256 d = _mm256_or_ps(s, _mm256_and_ps(z, kSignMask));
      if (e) _mm256_maskstore_ps(e + i, mask, _mm256_sub_ps(z, d));
      bits[i / 8] = static_cast<uint8_t>(_mm256_movemask_ps(z) & ((1u << count) - 1));
    }
  }
}

// Lane k of the result is -0.0f when bit k of `byte` is set, else +0.0f.
inline __m256 SignsFromByte(uint32_t byte) {
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i hit =
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(byte)), lanes), lanes);
  return _mm256_and_ps(_mm256_castsi256_ps(hit), kSignMask);
}

template <bool kAdd>
void OnebitExpand(const float* scales, const uint8_t* bits, size_t n, uint32_t block, float w,
                  float* out) {
  for (size_t start = 0, b = 0; start < n; start += block, ++b) {
    const size_t end = start + std::min<size_t>(block, n - start);
    // w * (+-s) == +-(w * s) exactly: IEEE rounding is symmetric in sign. A
    // set bit flips the sign (xor: w, and so w * s, may be negative).
    const __m256 s = _mm256_set1_ps(kAdd ? w * scales[b] : scales[b]);
    for (size_t i = start; i < end; i += 8) {
      const __m256 v = _mm256_xor_ps(s, SignsFromByte(bits[i / 8]));
      if (i + 8 <= end) {
        _mm256_storeu_ps(out + i, kAdd ? _mm256_add_ps(_mm256_loadu_ps(out + i), v) : v);
      } else {
        const __m256i mask = TailMask(end - i);
        const __m256 r = kAdd ? _mm256_add_ps(_mm256_maskload_ps(out + i, mask), v) : v;
        _mm256_maskstore_ps(out + i, mask, r);
      }
    }
  }
}

void OnebitDecode(const float* scales, const uint8_t* bits, size_t n, uint32_t block, float* out) {
  OnebitExpand<false>(scales, bits, n, block, 1.0f, out);
}

void OnebitDecodeAdd(const float* scales, const uint8_t* bits, size_t n, uint32_t block, float w,
                     float* acc) {
  OnebitExpand<true>(scales, bits, n, block, w, acc);
}

size_t Fp16Check(const float* y, const float* e, size_t n) {
  const __m256 limit = _mm256_set1_ps(65520.0f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_andnot_ps(kSignMask, LoadZ(y, e, i));
    if (_mm256_movemask_ps(_mm256_cmp_ps(a, limit, _CMP_NLT_UQ))) break;
  }
  for (; i < n; ++i) {
    if (!(std::fabs(e ? y[i] + e[i] : y[i]) < 65520.0f)) return i;
  }
  return n;
}

void Fp16Encode(const float* y, float* e, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 z = LoadZ(y, e, i);
    const __m128i h = _mm256_cvtps_ph(z, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
    if (e) _mm256_storeu_ps(e + i, _mm256_sub_ps(z, _mm256_cvtph_ps(h)));
  }
  for (; i < n; ++i) {
    const float z = e ? y[i] + e[i] : y[i];
    out[i] = FloatToHalf(z);
    if (e) e[i] = z - HalfToFloat(out[i]);
  }
}

size_t Fp16CheckPayload(const uint16_t* in, size_t n) {
  const __m256i exp = _mm256_set1_epi16(0x7c00);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i v =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)), exp);
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi16(v, exp))) break;
  }
  for (; i < n; ++i) {
    if ((in[i] & 0x7c00) == 0x7c00) return i;
  }
  return n;
}

template <bool kAdd>
void Fp16Expand(const uint16_t* in, size_t n, float w, float* out) {
  const __m256 wv = _mm256_set1_ps(w);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(out + i,
                     kAdd ? _mm256_add_ps(_mm256_loadu_ps(out + i), _mm256_mul_ps(wv, v)) : v);
  }
  for (; i < n; ++i) {
    const float v = HalfToFloat(in[i]);
    out[i] = kAdd ? out[i] + w * v : v;
  }
}

void Fp16Decode(const uint16_t* in, size_t n, float* out) { Fp16Expand<false>(in, n, 1.0f, out); }

void Fp16DecodeAdd(const uint16_t* in, size_t n, float w, float* acc) {
  Fp16Expand<true>(in, n, w, acc);
}

size_t FirstNonFinite(const float* y, const float* e, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_andnot_ps(kSignMask, LoadZ(y, e, i));
    if (_mm256_movemask_ps(_mm256_cmp_ps(a, kFltMax, _CMP_NLE_UQ))) break;
  }
  for (; i < n; ++i) {
    if (!std::isfinite(e ? y[i] + e[i] : y[i])) return i;
  }
  return n;
}

void Axpy(const float* x, size_t n, float w, float* acc) {
  const __m256 wv = _mm256_set1_ps(w);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i),
                                            _mm256_mul_ps(wv, _mm256_loadu_ps(x + i))));
  }
  for (; i < n; ++i) acc[i] += w * x[i];
}

}  // namespace

const Kernels& Avx2Kernels() {
  static const Kernels k = {
      "avx2",     OnebitScales,     OnebitSigns, OnebitDecode,  OnebitDecodeAdd, Fp16Check,
      Fp16Encode, Fp16CheckPayload, Fp16Decode,  Fp16DecodeAdd, FirstNonFinite,  Axpy,
  };
  return k;
}

}  // namespace onebit::compress_internal
