// GPU twins of the codec kernels (compress/kernels.h) and of the update loops
// (optim/update_kernels.h). Same arguments as the CPU twins, plus a stream;
// every pointer is a device pointer. Outputs equal the scalar CPU twins byte
// for byte (docs/design.md §1.3: canonical reduction order, no FMA, no fast-math),
// which tests/cuda/ checks element by element.
//
// Requires a build with ONEBIT_WITH_CUDA (target onebit_cuda_kernels). On a
// machine without a usable GPU every call with n > 0 returns an error Status
// carrying the CUDA error text; nothing crashes. Calls with n == 0 do nothing.
//
// Work is enqueued on `stream` (nullptr: the legacy default stream). Calls
// that return an index or can reject their input (the *Check functions,
// OnebitScales, OnebitEncode) wait for the stream before they return; the
// others return once the work is enqueued, so a later launch error may be
// reported by the next call or by Synchronize (cuda/memory.h).
//
// Thread-safe: no shared state; concurrent calls on different streams are fine.
#ifndef ONEBIT_CUDA_KERNELS_H_
#define ONEBIT_CUDA_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "compress/codec.h"
#include "optim/update_kernels.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; no CUDA header needed here

namespace onebit::cuda {

using Stream = CUstream_st*;

// Block sizes (`block`) must be multiples of 32 in [32, 1 << 24], as for the
// CPU codecs; z = y + e elementwise when e != nullptr, else z = y.

// Scales of every block of z (canonical order). Returns the index of the
// first non-finite z, or n; the scales of the blocks before it are written
// (a scale may still overflow to +Inf: callers check, as compress/ does).
absl::StatusOr<size_t> OnebitScales(const float* y, const float* e, size_t n, uint32_t block,
                                    ScaleRule rule, float* scales, Stream stream);
// Sign bits of z (element j in byte j/8, bit j%8; unused bits of the last
// byte zero) and, when e != nullptr, e = z - (bit ? -s : s), in place.
// Requires finite z and the scales of OnebitScales.
absl::Status OnebitSigns(const float* y, float* e, size_t n, uint32_t block, const float* scales,
                         uint8_t* bits, Stream stream);
// out = D(scales, bits); acc += w * D(scales, bits) (w may be negative).
absl::Status OnebitDecode(const float* scales, const uint8_t* bits, size_t n, uint32_t block,
                          float* out, Stream stream);
absl::Status OnebitDecodeAdd(const float* scales, const uint8_t* bits, size_t n, uint32_t block,
                             float w, float* acc, Stream stream);

// The fused error-feedback encode a GPU worker uses: one pass reads y and
// e_in, writes the wire payload out[0, 4*ceil(n/B) + ceil(n/8)) (scales, then
// bits; out 4-byte aligned) and e_out = z - D(C(z)). e_in == nullptr: z = y;
// e_out == nullptr: no error written. Returns the same errors as the CPU
// codec (first non-finite index, overflowing scale). On error y and e_in are
// untouched but out and e_out are unspecified, so a worker that keeps two
// error buffers and swaps them on success keeps the all-or-nothing contract
// of compress/codec.h. e_out == e_in is allowed (then e is unspecified on error).
absl::Status OnebitEncode(const float* y, const float* e_in, float* e_out, size_t n, uint32_t block,
                          ScaleRule rule, uint8_t* out, Stream stream);
// Which kernel OnebitEncode runs; both give the same bits. kWarp: a warp
// per block, reading the block twice (from cache the second time). kStaged:
// a thread block per block, staged once in shared memory (blocks of at most
// kMaxStagedBlock). kAuto: kStaged for blocks in [kStagedFromBlock,
// kMaxStagedBlock], else kWarp.
enum class EncodePath { kAuto, kWarp, kStaged };
constexpr uint32_t kStagedFromBlock = 512;
constexpr uint32_t kMaxStagedBlock = 8192;
absl::Status OnebitEncodeVia(EncodePath path, const float* y, const float* e_in, float* e_out,
                             size_t n, uint32_t block, ScaleRule rule, uint8_t* out, Stream stream);
// Its CPU twin (host pointers), built from the scalar codec kernels.
absl::Status OnebitEncodeCpu(const float* y, const float* e_in, float* e_out, size_t n,
                             uint32_t block, ScaleRule rule, uint8_t* out);

// First index where z is non-finite or rounds to +-Inf in fp16, or n.
absl::StatusOr<size_t> Fp16Check(const float* y, const float* e, size_t n, Stream stream);
// out = half(z), round to nearest even; e = z - float(out) when e != nullptr.
absl::Status Fp16Encode(const float* y, float* e, size_t n, uint16_t* out, Stream stream);
// First index of a non-finite half, or n.
absl::StatusOr<size_t> Fp16CheckPayload(const uint16_t* in, size_t n, Stream stream);
absl::Status Fp16Decode(const uint16_t* in, size_t n, float* out, Stream stream);
absl::Status Fp16DecodeAdd(const uint16_t* in, size_t n, float w, float* acc, Stream stream);

// First index where z is non-finite, or n.
absl::StatusOr<size_t> FirstNonFinite(const float* y, const float* e, size_t n, Stream stream);
// acc += w * x.
absl::Status Axpy(const float* x, size_t n, float w, float* acc, Stream stream);

// Twins of optim/update_kernels.h: a worker's momentum update, the
// compression-phase apply (den may be nullptr) and the warm-up Adam step (g
// becomes the delta).
absl::Status UpdateMomentum(const float* g, float b1, float c1, size_t n, float* m, Stream stream);
absl::Status ApplyMomentum(const float* mbar, const float* den, float lr, float wd, size_t n,
                           float* x, Stream stream);
absl::Status AdamUpdate(const AdamCoefficients& c, size_t n, float* g, float* m, float* v, float* x,
                        Stream stream);
// Twins of the other worker loops of optim/update_kernels.h: the hand-over's
// den, zero-one-adam's variance steps, sync pushes and syncs, and
// onebit-lamb's momentum replies. Elementwise, so no reduction order to keep.
absl::Status UpdateMoments(const float* g, float b1, float c1, float b2, float c2, size_t n,
                           float* m, float* v, Stream stream);
absl::Status FrozenDenominators(const float* v, float eps, size_t n, float* den, Stream stream);
absl::Status VarianceDenominators(const float* v, float c, float floor, float eps, size_t n,
                                  float* den, Stream stream);
absl::Status UpdateSinceSync(const float* x, const float* x_sync, const float* den, size_t n,
                             float* u, Stream stream);
absl::Status ApplySync(const float* a, const float* den, float lrs, size_t n, float* x_sync,
                       float* m, float* x, Stream stream);
absl::Status LambApply(const float* mbar, const float* den, float k, float wd, size_t n, float* x,
                       Stream stream);

}  // namespace onebit::cuda

#endif  // ONEBIT_CUDA_KERNELS_H_
