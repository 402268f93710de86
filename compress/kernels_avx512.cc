// AVX-512F kernels for the onebit codec (the fp16, fp32 and axpy kernels are
// the AVX2 ones: they stream memory, where 16 lanes buy nothing). Compiled
// with -mavx512f, never with FMA. Each function computes exactly what its
// twin in kernels_scalar.cc computes, in the same order, 16 lanes at a time:
// the canonical 32-lane reduction maps onto two accumulators (lanes 0-15
// and 16-31), whose sum is the halving tree's first level (w = 16).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "compress/kernels.h"

namespace onebit::compress_internal {
namespace {

const __m512i kSignBit = _mm512_set1_epi32(INT32_MIN);

inline __mmask16 TailMask(size_t count) { return static_cast<__mmask16>((1u << count) - 1); }

inline __m512 LoadZ(const float* y, const float* e, size_t i) {
  const __m512 v = _mm512_loadu_ps(y + i);
  return e ? _mm512_add_ps(v, _mm512_loadu_ps(e + i)) : v;
}

// Masked-off lanes load as +0.
inline __m512 LoadZMasked(const float* y, const float* e, size_t i, __mmask16 mask) {
  const __m512 v = _mm512_maskz_loadu_ps(mask, y + i);
  return e ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, e + i)) : v;
}

inline __m512 Abs(__m512 z) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32(INT32_MAX)));
}

// |z| or z*z added into acc; a NaN or +-Inf z makes the sum non-finite.
inline void Accumulate(__m512 z, ScaleRule rule, __m512* acc) {
  *acc = _mm512_add_ps(*acc, rule == ScaleRule::kL1 ? Abs(z) : _mm512_mul_ps(z, z));
}

size_t OnebitScales(const float* y, const float* e, size_t n, uint32_t block, ScaleRule rule,
                    float* scales) {
  for (size_t start = 0, b = 0; start < n; start += block, ++b) {
    const size_t len = std::min<size_t>(block, n - start);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const size_t end = start + len;
    size_t i = start;
    for (; i + 32 <= end; i += 32) {
      Accumulate(LoadZ(y, e, i), rule, &acc[0]);
      Accumulate(LoadZ(y, e, i + 16), rule, &acc[1]);
    }
    // Short last block: masked-off lanes add +0 to a non-negative sum.
    for (int k = 0; i < end; i += 16, ++k) {
      Accumulate(LoadZMasked(y, e, i, TailMask(std::min<size_t>(16, end - i))), rule, &acc[k]);
    }
    // The halving tree: w = 16 across the two accumulators, w = 8 across
    // the halves of the result, then 4, 2, 1 inside one 128-bit register.
    // (Through memory: GCC 12's extract intrinsics warn of an undefined
    // source they never read.)
    alignas(64) float h16[16];
    _mm512_store_ps(h16, _mm512_add_ps(acc[0], acc[1]));
    const __m256 h8 = _mm256_add_ps(_mm256_load_ps(h16), _mm256_load_ps(h16 + 8));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    const size_t done = FinishBlockScale(_mm_cvtss_f32(q), y, e, start, end, rule, &scales[b]);
    if (done < end) return done;
  }
  return n;
}

// D(C(z)) of 16 elements: +-s with z's sign.
inline __m512 Decoded(__m512 z, __m512 s) {
  return _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(s), _mm512_and_si512(_mm512_castps_si512(z), kSignBit)));
}

// The sign bits of 16 elements (set where z's sign bit is).
inline __mmask16 SignsOf16(__m512 z) {
  return _mm512_cmplt_epi32_mask(_mm512_castps_si512(z), _mm512_setzero_si512());
}

void OnebitSigns(const float* y, float* e, size_t n, uint32_t block, const float* scales,
                 uint8_t* bits) {
  for (size_t start = 0, b = 0; start < n; start += block, ++b) {
    const size_t end = start + std::min<size_t>(block, n - start);
    const __m512 s = _mm512_set1_ps(scales[b]);
    size_t i = start;
    for (; i + 32 <= end; i += 32) {
      const __m512 z0 = LoadZ(y, e, i), z1 = LoadZ(y, e, i + 16);
      if (e) {
        _mm512_storeu_ps(e + i, _mm512_sub_ps(z0, Decoded(z0, s)));
        _mm512_storeu_ps(e + i + 16, _mm512_sub_ps(z1, Decoded(z1, s)));
      }
      const uint32_t word =
          static_cast<uint32_t>(SignsOf16(z0)) | (static_cast<uint32_t>(SignsOf16(z1)) << 16);
      std::memcpy(bits + i / 8, &word, 4);
    }
    for (; i < end; i += 16) {
      const size_t count = std::min<size_t>(16, end - i);
      const __mmask16 mask = TailMask(count);
      const __m512 z = LoadZMasked(y, e, i, mask);
      if (e) _mm512_mask_storeu_ps(e + i, mask, _mm512_sub_ps(z, Decoded(z, s)));
      const uint32_t signs = SignsOf16(z) & mask;
      bits[i / 8] = static_cast<uint8_t>(signs);
      if (count > 8) bits[i / 8 + 1] = static_cast<uint8_t>(signs >> 8);
    }
  }
}

template <bool kAdd>
void OnebitExpand(const float* scales, const uint8_t* bits, size_t n, uint32_t block, float w,
                  float* out) {
  for (size_t start = 0, b = 0; start < n; start += block, ++b) {
    const size_t end = start + std::min<size_t>(block, n - start);
    // w * (+-s) == +-(w * s) exactly; a set bit flips the sign.
    const __m512i s = _mm512_castps_si512(_mm512_set1_ps(kAdd ? w * scales[b] : scales[b]));
    for (size_t i = start; i < end; i += 16) {
      uint16_t k = bits[i / 8];
      if (i + 8 < end) k |= static_cast<uint16_t>(bits[i / 8 + 1]) << 8;
      const __m512 v = _mm512_castsi512_ps(_mm512_mask_xor_epi32(s, k, s, kSignBit));
      if (i + 16 <= end) {
        _mm512_storeu_ps(out + i, kAdd ? _mm512_add_ps(_mm512_loadu_ps(out + i), v) : v);
      } else {
        const __mmask16 mask = TailMask(end - i);
        const __m512 r = kAdd ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out + i), v) : v;
        _mm512_mask_storeu_ps(out + i, mask, r);
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

}  // namespace

const Kernels& Avx512Kernels() {
  static const Kernels k = [] {
    Kernels k = Avx2Kernels();
    k.name = "avx512";
    k.onebit_scales = OnebitScales;
    k.onebit_signs = OnebitSigns;
    k.onebit_decode = OnebitDecode;
    k.onebit_decode_add = OnebitDecodeAdd;
    return k;
  }();
  return k;
}

}  // namespace onebit::compress_internal
