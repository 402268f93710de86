// Inner loops of the codecs, one table per instruction set. Internal to
// compress/: the Codec classes validate and drive them. Every table produces
// identical bytes; tests/compress/compress_test.cc holds them to it. The CUDA twins in
// cuda/ follow the same signatures and the same canonical reduction order.
//
// Conventions: n elements; z = y + e elementwise when e != nullptr, else z = y;
// B (block size) is a multiple of 32, so every block's bits start on a byte.
#ifndef ONEBIT_COMPRESS_KERNELS_H_
#define ONEBIT_COMPRESS_KERNELS_H_

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "compress/codec.h"

namespace onebit::compress_internal {

struct Kernels {
  const char* name;

  // Onebit pass 1: scales[b] of every block of z, in the canonical order of
  // docs/design.md §1.3. Returns the index of the first non-finite z (scales of the
  // blocks before it are written), or n when all are finite.
  size_t (*onebit_scales)(const float* y, const float* e, size_t n, uint32_t block, ScaleRule rule,
                          float* scales);
  // Onebit pass 2: the sign bits of z and, when e != nullptr, e = z - D(C(z)).
  // Requires finite z and the scales of pass 1.
  void (*onebit_signs)(const float* y, float* e, size_t n, uint32_t block, const float* scales,
                       uint8_t* bits);
  // out = D, or acc += w * D. Requires finite, non-negative scales.
  void (*onebit_decode)(const float* scales, const uint8_t* bits, size_t n, uint32_t block,
                        float* out);
  void (*onebit_decode_add)(const float* scales, const uint8_t* bits, size_t n, uint32_t block,
                            float w, float* acc);

  // First index where z is non-finite or rounds to +-Inf in fp16, or n.
  size_t (*fp16_check)(const float* y, const float* e, size_t n);
  // out = half(z) (round to nearest even); e = z - float(out) when e != nullptr.
  void (*fp16_encode)(const float* y, float* e, size_t n, uint16_t* out);
  // First index of a non-finite half (exponent all ones), or n.
  size_t (*fp16_check_payload)(const uint16_t* in, size_t n);
  void (*fp16_decode)(const uint16_t* in, size_t n, float* out);
  void (*fp16_decode_add)(const uint16_t* in, size_t n, float w, float* acc);

  // First index where z is non-finite, or n (fp32 codec and payload checks).
  size_t (*first_nonfinite)(const float* y, const float* e, size_t n);
  // acc += w * x.
  void (*axpy)(const float* x, size_t n, float w, float* acc);
};

// The end of a SIMD kernel's block in onebit pass 1: from the block's sum
// of |z| or z*z over [start, end), *scale = the mean or its square root;
// when the sum is not finite, the first non-finite z (its index, returned
// instead, scale unwritten) or, all z finite, the overflowed scale (the
// caller reports it). Returns end when the block is done.
inline size_t FinishBlockScale(float sum, const float* y, const float* e, size_t start, size_t end,
                               ScaleRule rule, float* scale) {
  if (!std::isfinite(sum)) {
    for (size_t j = start; j < end; ++j) {
      if (!std::isfinite(e ? y[j] + e[j] : y[j])) return j;
    }
  }
  const float mean = sum / static_cast<float>(end - start);
  *scale = rule == ScaleRule::kL1 ? mean : std::sqrt(mean);
  return end;
}

const Kernels& ScalarKernels();
// Requires CpuHasAvx2().
const Kernels& Avx2Kernels();
// AVX-512F for the onebit kernels, the AVX2 ones for the rest. Requires
// CpuHasAvx512().
const Kernels& Avx512Kernels();

// Scalar IEEE half conversions (round to nearest even), shared by the scalar
// kernels and the AVX2 kernels' tails.
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);

}  // namespace onebit::compress_internal

#endif  // ONEBIT_COMPRESS_KERNELS_H_
