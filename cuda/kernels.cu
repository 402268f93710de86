// CUDA kernels: each computes what its CPU twin computes (compress/
// kernels_scalar.cc, optim/update_kernels.cc), operation for operation.
// Compiled with -fmad=false -prec-div=true -prec-sqrt=true -ftz=false (see
// cuda/CMakeLists.txt), so every +, *, / and sqrtf rounds as on the CPU.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_status.h"
#include "cuda/kernels.h"

namespace onebit::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = 256;
constexpr unsigned long long kNone = ULLONG_MAX;
// Independent loads a thread issues before it uses the first: memory-level
// parallelism, which these bandwidth-bound kernels live on.
constexpr int kU = 8;

// ---------------------------------------------------------------- device code

__device__ __forceinline__ float Z(const float* y, const float* e, size_t i) {
  return e ? y[i] + e[i] : y[i];
}

// Finite test without isfinite's NaN subtleties: false for NaN and +-Inf.
__device__ __forceinline__ bool Finite(float z) { return fabsf(z) <= FLT_MAX; }

__device__ __forceinline__ float Term(float z, bool l2) { return l2 ? z * z : fabsf(z); }

// Warp-wide minimum of a 64-bit index.
__device__ __forceinline__ unsigned long long WarpMin(unsigned long long v) {
  for (int w = 16; w >= 1; w /= 2) {
    const unsigned long long o = __shfl_xor_sync(kFull, v, w);
    v = o < v ? o : v;
  }
  return v;
}

// i / d, in 32 bits when both fit (64-bit division is slow on the GPU).
__device__ __forceinline__ size_t Div(size_t i, size_t d) {
  return (i <= 0xffffffffu && d <= 0xffffffffu)
             ? static_cast<size_t>(static_cast<uint32_t>(i) / static_cast<uint32_t>(d))
             : i / d;
}

__device__ __forceinline__ size_t GlobalThread() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t GridThreads() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

// The canonical block sum (docs/design.md §1.3) of one block by one warp: lane l
// adds elements l, l+32, ... in order from +0.0f, then the halving tree
// w = 16 .. 1, t[l] += t[l+w]. Loads go kU at a time (all issued before the
// adds, which keep their order) so that enough bytes are in flight to fill
// the memory system. Returns lane 0's sum in every lane; *any_bad: some z of
// the block is not finite (all lanes agree).
__device__ __forceinline__ float BlockSum(const float* y, const float* e, size_t len, bool l2,
                                          bool* any_bad) {
  const unsigned lane = threadIdx.x & 31;
  float t = 0.0f;
  bool bad = false;
  size_t base = 0;
  for (; base + 32 * kU <= len; base += 32 * kU) {
    float z[kU];
#pragma unroll
    for (int j = 0; j < kU; ++j) z[j] = Z(y, e, base + 32 * j + lane);
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      bad |= !Finite(z[j]);
      t += Term(z[j], l2);
    }
  }
  for (size_t i = base + lane; i < len; i += 32) {
    const float z = Z(y, e, i);
    bad |= !Finite(z);
    t += Term(z, l2);
  }
  for (int w = 16; w >= 1; w /= 2) t = t + __shfl_down_sync(kFull, t, w);
  *any_bad = __any_sync(kFull, bad);
  return __shfl_sync(kFull, t, 0);
}

// First non-finite z of a block known to hold one (the rare error path).
__device__ unsigned long long FirstBad(const float* y, const float* e, size_t start, size_t len) {
  unsigned long long first = kNone;
  for (size_t i = threadIdx.x & 31; i < len; i += 32) {
    if (!Finite(Z(y, e, start + i))) {
      first = start + i;
      break;
    }
  }
  return WarpMin(first);
}

__device__ __forceinline__ float ScaleOf(float sum, size_t len, bool l2) {
  const float mean = sum / static_cast<float>(len);
  return l2 ? sqrtf(mean) : mean;
}

// One warp per block (grid-stride). bad[0]: first non-finite index.
__global__ void OnebitScalesKernel(const float* y, const float* e, size_t n, uint32_t block,
                                   bool l2, float* scales, unsigned long long* bad) {
  const size_t blocks = (n + block - 1) / block;
  for (size_t b = GlobalThread() / 32; b < blocks; b += GridThreads() / 32) {
    const size_t start = b * block;
    const size_t len = min(static_cast<size_t>(block), n - start);
    bool any_bad;
    const float sum = BlockSum(y + start, e ? e + start : nullptr, len, l2, &any_bad);
    if (any_bad) {
      const unsigned long long first = FirstBad(y, e, start, len);
      if ((threadIdx.x & 31) == 0) atomicMin(bad, first);
      continue;
    }
    if ((threadIdx.x & 31) == 0) scales[b] = ScaleOf(sum, len, l2);
  }
}

// The bits of 32 elements from `base` (lanes' ballot) as up to four bytes.
__device__ __forceinline__ void StoreWord(uint8_t* bits, size_t base, size_t n, unsigned word) {
  const unsigned lane = threadIdx.x & 31;
  if (lane < 4 && base + 8 * lane < n) bits[base / 8 + lane] = (word >> (8 * lane)) & 0xffu;
}

// One warp per 32 elements (a block size is a multiple of 32, so the 32
// share one scale).
__global__ void OnebitSignsKernel(const float* y, float* e, size_t n, uint32_t block,
                                  const float* scales, uint8_t* bits) {
  const unsigned lane = threadIdx.x & 31;
  const size_t words = (n + 31) / 32;
  for (size_t k = GlobalThread() / 32; k < words; k += GridThreads() / 32) {
    const size_t base = 32 * k, i = base + lane;
    const bool active = i < n;
    const float s = scales[Div(base, block)];
    const float z = active ? Z(y, e, i) : 0.0f;
    const bool neg = active && signbit(z);
    if (active && e) e[i] = z - (neg ? -s : s);
    StoreWord(bits, base, n, __ballot_sync(kFull, neg));
  }
}

// Fused error-feedback encode, one warp per block: the canonical sum, then
// (the block was just read: it comes from cache) bits and e_out. A block
// with a non-finite z or an overflowing scale writes nothing and reports to
// bad[0] (first index) or bad[1] (first block).
__global__ void OnebitEncodeKernel(const float* y, const float* e_in, float* e_out, size_t n,
                                   uint32_t block, bool l2, float* scales, uint8_t* bits,
                                   unsigned long long* bad) {
  const unsigned lane = threadIdx.x & 31;
  const size_t blocks = (n + block - 1) / block;
  for (size_t b = GlobalThread() / 32; b < blocks; b += GridThreads() / 32) {
    const size_t start = b * block;
    const size_t len = min(static_cast<size_t>(block), n - start);
    bool any_bad;
    const float sum = BlockSum(y + start, e_in ? e_in + start : nullptr, len, l2, &any_bad);
    if (any_bad) {
      const unsigned long long first = FirstBad(y, e_in, start, len);
      if (lane == 0) atomicMin(&bad[0], first);
      continue;
    }
    const float s = ScaleOf(sum, len, l2);
    if (!Finite(s)) {
      if (lane == 0) atomicMin(&bad[1], static_cast<unsigned long long>(b));
      continue;
    }
    if (lane == 0) scales[b] = s;
    // Bits and errors; the block was just read, so this comes from cache.
    // Each chunk's loads precede its stores, so e_out == e_in is safe.
    const size_t end = start + len;
    size_t base = start;
    for (; base + 32 * kU <= end; base += 32 * kU) {
      float z[kU];
#pragma unroll
      for (int j = 0; j < kU; ++j) z[j] = Z(y, e_in, base + 32 * j + lane);
#pragma unroll
      for (int j = 0; j < kU; ++j) {
        const bool neg = signbit(z[j]);
        if (e_out) e_out[base + 32 * j + lane] = z[j] - (neg ? -s : s);
        StoreWord(bits, base + 32 * j, n, __ballot_sync(kFull, neg));
      }
    }
    for (; base < end; base += 32) {
      const size_t i = base + lane;
      const bool active = i < end;
      const float z = active ? Z(y, e_in, i) : 0.0f;
      const bool neg = active && signbit(z);
      if (active && e_out) e_out[i] = z - (neg ? -s : s);
      StoreWord(bits, base, n, __ballot_sync(kFull, neg));
    }
  }
}

// The fused encode with the block staged in shared memory, for blocks up to
// kMaxStagedBlock: every warp of the CTA loads its share of z = y + e once
// (kU loads in flight per thread); warp 0 forms the canonical sum from shared
// memory (its order is lane-sequential, so one warp must do the adds); then
// every warp writes its words' bits and e_out. The warp-per-block kernel
// above reads each block twice, and at large blocks the second read misses
// the cache; here global memory is read once. Same results, same reports.
__global__ void OnebitEncodeStagedKernel(const float* y, const float* e_in, float* e_out, size_t n,
                                         uint32_t block, bool l2, float* scales, uint8_t* bits,
                                         unsigned long long* bad) {
  extern __shared__ float zs[];
  __shared__ float scale;
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const size_t blocks = (n + block - 1) / block;
  for (size_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const size_t start = b * block;
    const uint32_t len = static_cast<uint32_t>(min(static_cast<size_t>(block), n - start));
    const float* yb = y + start;
    const float* eb = e_in ? e_in + start : nullptr;
    bool bad_z = false;
    uint32_t i0 = 0;
    for (; i0 + blockDim.x * kU <= len; i0 += blockDim.x * kU) {
      float z[kU];
#pragma unroll
      for (int j = 0; j < kU; ++j) z[j] = Z(yb, eb, i0 + blockDim.x * j + threadIdx.x);
#pragma unroll
      for (int j = 0; j < kU; ++j) {
        bad_z |= !Finite(z[j]);
        zs[i0 + blockDim.x * j + threadIdx.x] = z[j];
      }
    }
    for (uint32_t i = i0 + threadIdx.x; i < len; i += blockDim.x) {
      const float z = Z(yb, eb, i);
      bad_z |= !Finite(z);
      zs[i] = z;
    }
    if (__syncthreads_or(bad_z)) {
      if (warp == 0) {
        unsigned long long first = kNone;
        for (uint32_t i = lane; i < len; i += 32) {
          if (!Finite(zs[i])) {
            first = start + i;
            break;
          }
        }
        first = WarpMin(first);
        if (lane == 0) atomicMin(&bad[0], first);
      }
      __syncthreads();  // zs is refilled by the next block
      continue;
    }
    if (warp == 0) {
      float t = 0.0f;
      for (uint32_t i = lane; i < len; i += 32) t += Term(zs[i], l2);
      for (int w = 16; w >= 1; w /= 2) t = t + __shfl_down_sync(kFull, t, w);
      if (lane == 0) scale = ScaleOf(t, len, l2);
    }
    __syncthreads();
    const float s = scale;
    if (!Finite(s)) {
      if (threadIdx.x == 0) atomicMin(&bad[1], static_cast<unsigned long long>(b));
      __syncthreads();
      continue;
    }
    if (threadIdx.x == 0) scales[b] = s;
    // Every element was loaded before the barrier, so e_out == e_in is safe.
    for (uint32_t w = warp; 32 * w < len; w += warps) {
      const uint32_t i = 32 * w + lane;
      const bool active = i < len;
      const float z = active ? zs[i] : 0.0f;
      const bool neg = active && signbit(z);
      if (active && e_out) e_out[start + i] = z - (neg ? -s : s);
      StoreWord(bits, start + 32 * w, n, __ballot_sync(kFull, neg));
    }
    __syncthreads();  // zs and scale are refilled by the next block
  }
}

template <bool kAdd>
__global__ void OnebitExpandKernel(const float* scales, const uint8_t* bits, size_t n,
                                   uint32_t block, float w, float* out) {
  const unsigned lane = threadIdx.x & 31;
  const size_t words = (n + 31) / 32, warps = GridThreads() / 32;
  for (size_t k0 = GlobalThread() / 32; k0 < words; k0 += kU * warps) {
    float s[kU], a[kU];
    unsigned byte[kU];
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      const size_t k = k0 + j * warps, i = 32 * k + lane;
      if (k < words && i < n) {
        s[j] = scales[Div(32 * k, block)];
        byte[j] = bits[i / 8];
        if (kAdd) a[j] = out[i];
      }
    }
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      const size_t k = k0 + j * warps, i = 32 * k + lane;
      if (k < words && i < n) {
        const float v = (byte[j] >> (lane % 8)) & 1 ? -s[j] : s[j];
        out[i] = kAdd ? a[j] + w * v : v;
      }
    }
  }
}

// IEEE half conversions, bit for bit those of compress/kernels_scalar.cc
// (the hardware conversion rounds to nearest even too; NaN is made quiet
// with the CPU's payload).
__device__ __forceinline__ uint16_t ToHalf(float f) {
  if (isnan(f)) return static_cast<uint16_t>((signbit(f) ? 0x8000u : 0u) | 0x7e00u);
  return __half_as_ushort(__float2half_rn(f));
}

__device__ __forceinline__ float FromHalf(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return __uint_as_float(__float_as_uint(mag) | sign);
  }
  if (exp == 31) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
  return __uint_as_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// |z| >= 65520 rounds to Inf in half precision.
constexpr float kHalfOverflow = 65520.0f;

// What a check kernel looks for at element i.
enum class CheckKind { kNonFinite, kHalfOverflow, kHalfPayload };

template <CheckKind kKind>
__global__ void CheckKernel(const void* in, const float* e, size_t n, unsigned long long* bad) {
  const size_t stride = GridThreads();
  for (size_t i0 = GlobalThread(); i0 < n; i0 += kU * stride) {
    bool hit[kU];
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      const size_t i = i0 + j * stride;
      hit[j] = false;
      if (i >= n) continue;
      if (kKind == CheckKind::kHalfPayload) {
        hit[j] = (static_cast<const uint16_t*>(in)[i] & 0x7c00) == 0x7c00;
      } else {
        const float z = Z(static_cast<const float*>(in), e, i);
        hit[j] = kKind == CheckKind::kNonFinite ? !Finite(z) : !(fabsf(z) < kHalfOverflow);
      }
    }
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      if (hit[j]) {
        atomicMin(bad, static_cast<unsigned long long>(i0 + j * stride));
        return;  // this thread's later elements have larger indices
      }
    }
  }
}

__global__ void Fp16EncodeKernel(const float* y, float* e, size_t n, uint16_t* out) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float z = Z(y, e, i);
    const uint16_t h = ToHalf(z);
    out[i] = h;
    if (e) e[i] = z - FromHalf(h);
  }
}

template <bool kAdd>
__global__ void Fp16ExpandKernel(const uint16_t* in, size_t n, float w, float* out) {
  const size_t stride = GridThreads();
  for (size_t i0 = GlobalThread(); i0 < n; i0 += kU * stride) {
    uint16_t h[kU];
    float a[kU];
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      const size_t i = i0 + j * stride;
      if (i < n) {
        h[j] = in[i];
        if (kAdd) a[j] = out[i];
      }
    }
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      const size_t i = i0 + j * stride;
      if (i < n) out[i] = kAdd ? a[j] + w * FromHalf(h[j]) : FromHalf(h[j]);
    }
  }
}

__global__ void AxpyKernel(const float* x, size_t n, float w, float* acc) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) acc[i] += w * x[i];
}

__global__ void UpdateMomentumKernel(const float* g, float b1, float c1, size_t n, float* m) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) m[i] = b1 * m[i] + c1 * g[i];
}

__global__ void ApplyMomentumKernel(const float* mbar, const float* den, float lr, float wd,
                                    size_t n, float* x) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    x[i] = den ? x[i] - lr * (mbar[i] / den[i] + wd * x[i]) : x[i] - lr * (mbar[i] + wd * x[i]);
  }
}

__global__ void AdamKernel(AdamCoefficients c, size_t n, float* g, float* m, float* v, float* x) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float gi = g[i];
    const float mi = c.b1 * m[i] + c.c1 * gi;
    const float vi = c.b2 * v[i] + c.c2 * gi * gi;
    const float mh = c.bias_correction ? mi / c.k1 : mi;
    const float vh = c.bias_correction ? vi / c.k2 : vi;
    const float d = c.neg_lr * (mh / (sqrtf(vh) + c.eps) + c.wd * x[i]);
    m[i] = mi;
    v[i] = vi;
    g[i] = d;
    x[i] += d;
  }
}

__global__ void UpdateMomentsKernel(const float* g, float b1, float c1, float b2, float c2,
                                    size_t n, float* m, float* v) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float gi = g[i];
    m[i] = b1 * m[i] + c1 * gi;
    v[i] = b2 * v[i] + c2 * gi * gi;
  }
}

__global__ void FrozenDenominatorsKernel(const float* v, float eps, size_t n, float* den) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) den[i] = sqrtf(v[i]) + eps;
}

// max as std::max(q, floor): a NaN q stays NaN (fmaxf would drop it).
__global__ void VarianceDenominatorsKernel(const float* v, float c, float floor, float eps,
                                           size_t n, float* den) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float q = v[i] / c;
    den[i] = sqrtf(q < floor ? floor : q) + eps;
  }
}

__global__ void UpdateSinceSyncKernel(const float* x, const float* x_sync, const float* den,
                                      size_t n, float* u) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) u[i] = (x[i] - x_sync[i]) * den[i];
}

__global__ void ApplySyncKernel(const float* a, const float* den, float lrs, size_t n,
                                float* x_sync, float* m, float* x) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float xs = x_sync[i] + a[i] / den[i];
    x_sync[i] = xs;
    m[i] = lrs > 0.0f ? -(a[i] / lrs) : 0.0f;
    x[i] = xs;
  }
}

__global__ void LambApplyKernel(const float* mbar, const float* den, float k, float wd, size_t n,
                                float* x) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float p = mbar[i] / den[i];
    x[i] += k * (wd == 0.0f ? p : p + wd * x[i]);
  }
}

// ------------------------------------------------------------------ host side

absl::Status CheckBlock(uint32_t block) {
  if (block < 32 || block % 32 != 0 || block > (1u << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("block size ", block, " must be a multiple of 32 in [32, 2^24]"));
  }
  return absl::OkStatus();
}

// Blocks for `work` items of `per_block` threads' worth, capped at what fills
// the GPU a few times over (the kernels stride over the rest).
absl::StatusOr<unsigned> GridFor(size_t work, size_t per_block) {
  int dev = 0, sms = 0;
  if (cudaError_t err = cudaGetDevice(&dev); err != cudaSuccess)
    return CudaError(err, "cudaGetDevice");
  if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
      err != cudaSuccess) {
    return CudaError(err, "cudaDeviceGetAttribute");
  }
  const size_t want = (work + per_block - 1) / per_block;
  const size_t cap = static_cast<size_t>(std::max(sms, 1)) * (2048 / kThreads) * 4;
  return static_cast<unsigned>(std::max<size_t>(1, std::min(want, cap)));
}

absl::Status Launched(const char* what) { return CudaError(cudaGetLastError(), what); }

// Per thread and device, allocated once: the result flags on the device and
// a pinned host copy (a pageable copy back costs far more than the tiny
// kernel launch it follows). Reuse is safe: each user waits for its stream
// before it returns, and a thread runs one call at a time.
struct FlagScratch {
  unsigned long long* dev = nullptr;
  unsigned long long* host = nullptr;
  ~FlagScratch() {
    if (dev != nullptr) cudaFree(dev);
    if (host != nullptr) cudaFreeHost(host);
  }
};

// Two 64-bit flags (a first bad index, a first bad block), set to kNone on
// the stream, for kernels that report with atomicMin.
class BadFlags {
 public:
  explicit BadFlags(Stream stream) : stream_(stream) {}
  absl::Status Init() {
    thread_local std::vector<std::unique_ptr<FlagScratch>> per_device;
    int device = 0;
    if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
      return CudaError(err, "cudaGetDevice");
    }
    if (per_device.size() <= static_cast<size_t>(device)) per_device.resize(device + 1);
    if (per_device[device] == nullptr) {
      auto s = std::make_unique<FlagScratch>();
      if (cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&s->dev), kBytes);
          err != cudaSuccess) {
        s->dev = nullptr;
        return CudaError(err, "cudaMalloc");
      }
      if (cudaError_t err = cudaMallocHost(reinterpret_cast<void**>(&s->host), kBytes);
          err != cudaSuccess) {
        s->host = nullptr;
        return CudaError(err, "cudaMallocHost");
      }
      per_device[device] = std::move(s);
    }
    scratch_ = per_device[device].get();
    return CudaError(cudaMemsetAsync(scratch_->dev, 0xff, kBytes, stream_), "cudaMemsetAsync");
  }
  unsigned long long* dev() { return scratch_->dev; }
  // Copies the flags back and waits for the stream.
  absl::Status Read() {
    cudaError_t err =
        cudaMemcpyAsync(scratch_->host, scratch_->dev, kBytes, cudaMemcpyDeviceToHost, stream_);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
    if (err == cudaSuccess) std::memcpy(host_, scratch_->host, kBytes);
    return CudaError(err, "reading the kernel's result");
  }
  unsigned long long operator[](int i) const { return host_[i]; }

 private:
  static constexpr size_t kBytes = 2 * sizeof(unsigned long long);
  Stream stream_;
  FlagScratch* scratch_ = nullptr;
  unsigned long long host_[2] = {kNone, kNone};
};

// Runs a check kernel over n elements and returns its first hit, or n.
template <CheckKind kKind>
absl::StatusOr<size_t> RunCheck(const void* in, const float* e, size_t n, Stream stream,
                                const char* what) {
  if (n == 0) return size_t{0};
  absl::StatusOr<unsigned> grid = GridFor(n, kThreads);
  if (!grid.ok()) return grid.status();
  BadFlags bad(stream);
  if (absl::Status st = bad.Init(); !st.ok()) return st;
  CheckKernel<kKind><<<*grid, kThreads, 0, stream>>>(in, e, n, bad.dev());
  if (absl::Status st = Launched(what); !st.ok()) return st;
  if (absl::Status st = bad.Read(); !st.ok()) return st;
  return static_cast<size_t>(std::min<unsigned long long>(bad[0], n));
}

}  // namespace

absl::StatusOr<size_t> OnebitScales(const float* y, const float* e, size_t n, uint32_t block,
                                    ScaleRule rule, float* scales, Stream stream) {
  if (absl::Status st = CheckBlock(block); !st.ok()) return st;
  if (n == 0) return size_t{0};
  const size_t blocks = (n + block - 1) / block;
  absl::StatusOr<unsigned> grid = GridFor(32 * blocks, kThreads);
  if (!grid.ok()) return grid.status();
  BadFlags bad(stream);
  if (absl::Status st = bad.Init(); !st.ok()) return st;
  OnebitScalesKernel<<<*grid, kThreads, 0, stream>>>(y, e, n, block, rule == ScaleRule::kL2, scales,
                                                     bad.dev());
  if (absl::Status st = Launched("onebit_scales"); !st.ok()) return st;
  if (absl::Status st = bad.Read(); !st.ok()) return st;
  return static_cast<size_t>(std::min<unsigned long long>(bad[0], n));
}

absl::Status OnebitSigns(const float* y, float* e, size_t n, uint32_t block, const float* scales,
                         uint8_t* bits, Stream stream) {
  if (absl::Status st = CheckBlock(block); !st.ok()) return st;
  if (n == 0) return absl::OkStatus();
  absl::StatusOr<unsigned> grid = GridFor(32 * ((n + 31) / 32), kThreads);
  if (!grid.ok()) return grid.status();
  OnebitSignsKernel<<<*grid, kThreads, 0, stream>>>(y, e, n, block, scales, bits);
  return Launched("onebit_signs");
}

absl::Status OnebitDecode(const float* scales, const uint8_t* bits, size_t n, uint32_t block,
                          float* out, Stream stream) {
  if (absl::Status st = CheckBlock(block); !st.ok()) return st;
  if (n == 0) return absl::OkStatus();
  absl::StatusOr<unsigned> grid = GridFor(n, kThreads);
  if (!grid.ok()) return grid.status();
  OnebitExpandKernel<false><<<*grid, kThreads, 0, stream>>>(scales, bits, n, block, 1.0f, out);
  return Launched("onebit_decode");
}

absl::Status OnebitDecodeAdd(const float* scales, const uint8_t* bits, size_t n, uint32_t block,
                             float w, float* acc, Stream stream) {
  if (absl::Status st = CheckBlock(block); !st.ok()) return st;
  if (n == 0) return absl::OkStatus();
  absl::StatusOr<unsigned> grid = GridFor(n, kThreads);
  if (!grid.ok()) return grid.status();
  OnebitExpandKernel<true><<<*grid, kThreads, 0, stream>>>(scales, bits, n, block, w, acc);
  return Launched("onebit_decode_add");
}

absl::Status OnebitEncode(const float* y, const float* e_in, float* e_out, size_t n, uint32_t block,
                          ScaleRule rule, uint8_t* out, Stream stream) {
  return OnebitEncodeVia(EncodePath::kAuto, y, e_in, e_out, n, block, rule, out, stream);
}

absl::Status OnebitEncodeVia(EncodePath path, const float* y, const float* e_in, float* e_out,
                             size_t n, uint32_t block, ScaleRule rule, uint8_t* out,
                             Stream stream) {
  if (absl::Status st = CheckBlock(block); !st.ok()) return st;
  if (n == 0) return absl::OkStatus();
  if (reinterpret_cast<uintptr_t>(out) % 4 != 0) {
    return absl::InvalidArgumentError("onebit encode: the payload must be 4-byte aligned");
  }
  if (path == EncodePath::kStaged && block > kMaxStagedBlock) {
    return absl::InvalidArgumentError(
        absl::StrCat("onebit encode: the staged kernel takes blocks of at most ", kMaxStagedBlock,
                     " elements, not ", block));
  }
  if (path == EncodePath::kAuto) {
    path = block >= kStagedFromBlock && block <= kMaxStagedBlock ? EncodePath::kStaged
                                                                 : EncodePath::kWarp;
  }
  const size_t blocks = (n + block - 1) / block;
  BadFlags bad(stream);
  if (absl::Status st = bad.Init(); !st.ok()) return st;
  float* scales = reinterpret_cast<float*>(out);
  uint8_t* bits = out + 4 * blocks;
  const bool l2 = rule == ScaleRule::kL2;
  if (path == EncodePath::kStaged) {
    // A CTA per codec block (as many threads as the block has, up to kThreads).
    const unsigned threads = std::min<unsigned>(kThreads, block);
    absl::StatusOr<unsigned> grid = GridFor(blocks * threads, threads);
    if (!grid.ok()) return grid.status();
    OnebitEncodeStagedKernel<<<*grid, threads, 4 * block, stream>>>(y, e_in, e_out, n, block, l2,
                                                                    scales, bits, bad.dev());
  } else {
    absl::StatusOr<unsigned> grid = GridFor(32 * blocks, kThreads);
    if (!grid.ok()) return grid.status();
    OnebitEncodeKernel<<<*grid, kThreads, 0, stream>>>(y, e_in, e_out, n, block, l2, scales, bits,
                                                       bad.dev());
  }
  if (absl::Status st = Launched("onebit_encode"); !st.ok()) return st;
  if (absl::Status st = bad.Read(); !st.ok()) return st;
  // As the CPU codec: an overflowing scale before the first non-finite z
  // wins; then the non-finite z.
  const size_t first = static_cast<size_t>(std::min<unsigned long long>(bad[0], n));
  if (bad[1] != kNone && bad[1] * block < first) {
    return absl::InvalidArgumentError(absl::StrCat(
        "onebit: the ", ScaleRuleName(rule), " scale of block ", bad[1], " (elements from ",
        bad[1] * block, ") overflows fp32; values too large to encode"));
  }
  if (first < n) {
    float yv = 0, ev = 0;
    cudaMemcpy(&yv, y + first, 4, cudaMemcpyDeviceToHost);
    if (e_in) cudaMemcpy(&ev, e_in + first, 4, cudaMemcpyDeviceToHost);
    return absl::InvalidArgumentError(absl::StrCat("non-finite input at index ", first, " (y=", yv,
                                                   ", e=", ev, "); nothing was encoded"));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> Fp16Check(const float* y, const float* e, size_t n, Stream stream) {
  return RunCheck<CheckKind::kHalfOverflow>(y, e, n, stream, "fp16_check");
}

absl::Status Fp16Encode(const float* y, float* e, size_t n, uint16_t* out, Stream stream) {
  if (n == 0) return absl::OkStatus();
  absl::StatusOr<unsigned> grid = GridFor(n, kThreads);
  if (!grid.ok()) return grid.status();
  Fp16EncodeKernel<<<*grid, kThreads, 0, stream>>>(y, e, n, out);
  return Launched("fp16_encode");
}

absl::StatusOr<size_t> Fp16CheckPayload(const uint16_t* in, size_t n, Stream stream) {
  return RunCheck<CheckKind::kHalfPayload>(in, nullptr, n, stream, "fp16_check_payload");
}

absl::Status Fp16Decode(const uint16_t* in, size_t n, float* out, Stream stream) {
  if (n == 0) return absl::OkStatus();
  absl::StatusOr<unsigned> grid = GridFor(n, kThreads);
  if (!grid.ok()) return grid.status();
  Fp16ExpandKernel<false><<<*grid, kThreads, 0, stream>>>(in, n, 1.0f, out);
  return Launched("fp16_decode");
}

absl::Status Fp16DecodeAdd(const uint16_t* in, size_t n, float w, float* acc, Stream stream) {
  if (n == 0) return absl::OkStatus();
  absl::StatusOr<unsigned> grid = GridFor(n, kThreads);
  if (!grid.ok()) return grid.status();
  Fp16ExpandKernel<true><<<*grid, kThreads, 0, stream>>>(in, n, w, acc);
  return Launched("fp16_decode_add");
}

absl::StatusOr<size_t> FirstNonFinite(const float* y, const float* e, size_t n, Stream stream) {
  return RunCheck<CheckKind::kNonFinite>(y, e, n, stream, "first_nonfinite");
}

absl::Status Axpy(const float* x, size_t n, float w, float* acc, Stream stream) {
  if (n == 0) return absl::OkStatus();
  absl::StatusOr<unsigned> grid = GridFor(n, kThreads);
  if (!grid.ok()) return grid.status();
  AxpyKernel<<<*grid, kThreads, 0, stream>>>(x, n, w, acc);
  return Launched("axpy");
}

absl::Status UpdateMomentum(const float* g, float b1, float c1, size_t n, float* m, Stream stream) {
  if (n == 0) return absl::OkStatus();
  absl::StatusOr<unsigned> grid = GridFor(n, kThreads);
  if (!grid.ok()) return grid.status();
  UpdateMomentumKernel<<<*grid, kThreads, 0, stream>>>(g, b1, c1, n, m);
  return Launched("update_momentum");
}

absl::Status ApplyMomentum(const float* mbar, const float* den, float lr, float wd, size_t n,
                           float* x, Stream stream) {
  if (n == 0) return absl::OkStatus();
  absl::StatusOr<unsigned> grid = GridFor(n, kThreads);
  if (!grid.ok()) return grid.status();
  ApplyMomentumKernel<<<*grid, kThreads, 0, stream>>>(mbar, den, lr, wd, n, x);
  return Launched("apply_momentum");
}

absl::Status AdamUpdate(const AdamCoefficients& c, size_t n, float* g, float* m, float* v, float* x,
                        Stream stream) {
  if (n == 0) return absl::OkStatus();
  absl::StatusOr<unsigned> grid = GridFor(n, kThreads);
  if (!grid.ok()) return grid.status();
  AdamKernel<<<*grid, kThreads, 0, stream>>>(c, n, g, m, v, x);
  return Launched("adam_update");
}

namespace {

// Launches an elementwise kernel over n elements.
template <typename... Params, typename... Args>
absl::Status LaunchElementwise(void (*kernel)(Params...), const char* what, size_t n, Stream stream,
                               Args... args) {
  if (n == 0) return absl::OkStatus();
  absl::StatusOr<unsigned> grid = GridFor(n, kThreads);
  if (!grid.ok()) return grid.status();
  kernel<<<*grid, kThreads, 0, stream>>>(args...);
  return Launched(what);
}

}  // namespace

absl::Status UpdateMoments(const float* g, float b1, float c1, float b2, float c2, size_t n,
                           float* m, float* v, Stream stream) {
  return LaunchElementwise(UpdateMomentsKernel, "update_moments", n, stream, g, b1, c1, b2, c2, n,
                           m, v);
}

absl::Status FrozenDenominators(const float* v, float eps, size_t n, float* den, Stream stream) {
  return LaunchElementwise(FrozenDenominatorsKernel, "frozen_denominators", n, stream, v, eps, n,
                           den);
}

absl::Status VarianceDenominators(const float* v, float c, float floor, float eps, size_t n,
                                  float* den, Stream stream) {
  return LaunchElementwise(VarianceDenominatorsKernel, "variance_denominators", n, stream, v, c,
                           floor, eps, n, den);
}

absl::Status UpdateSinceSync(const float* x, const float* x_sync, const float* den, size_t n,
                             float* u, Stream stream) {
  return LaunchElementwise(UpdateSinceSyncKernel, "update_since_sync", n, stream, x, x_sync, den, n,
                           u);
}

absl::Status ApplySync(const float* a, const float* den, float lrs, size_t n, float* x_sync,
                       float* m, float* x, Stream stream) {
  return LaunchElementwise(ApplySyncKernel, "apply_sync", n, stream, a, den, lrs, n, x_sync, m, x);
}

absl::Status LambApply(const float* mbar, const float* den, float k, float wd, size_t n, float* x,
                       Stream stream) {
  return LaunchElementwise(LambApplyKernel, "lamb_apply", n, stream, mbar, den, k, wd, n, x);
}

}  // namespace onebit::cuda
