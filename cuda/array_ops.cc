#include "cuda/array_ops.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace onebit::cuda {
namespace {

class BackendOps final : public ArrayOps {
 public:
  BackendOps(const Backend& b, Stream s, const CodecOptions& codec)
      : b_(b), s_(s), block_(codec.block_size), rule_(codec.scale) {}
  ~BackendOps() override {
    // Work still queued may use the scratch.
    if (scratch_ != nullptr) {
      b_.synchronize(s_).IgnoreError();
      b_.free(scratch_);
    }
  }

  absl::Status Encode(const Codec& codec, const float* y, float* e, size_t n,
                      uint8_t* out) const override {
    if (n == 0) return absl::OkStatus();
    switch (codec.kind()) {
      case CodecKind::kOnebit: {
        // The fused kernel writes no error where it refuses a block, but does
        // where it accepts one: encode without writing e, then e in place
        // from the payload's scales and bits (a second pass over y and e), so
        // a refused push leaves e as it was.
        absl::Status st = b_.onebit_encode(y, e, nullptr, n, block_, rule_, out, s_);
        if (!st.ok() || e == nullptr) return st;
        const size_t blocks = (n + block_ - 1) / block_;
        return b_.onebit_signs(y, e, n, block_, reinterpret_cast<const float*>(out),
                               out + 4 * blocks, s_);
      }
      case CodecKind::kFp16: {
        absl::StatusOr<size_t> bad = b_.fp16_check(y, e, n, s_);
        if (!bad.ok()) return bad.status();
        if (*bad < n) return Unencodable(y, e, *bad, /*fp16=*/true);
        return b_.fp16_encode(y, e, n, reinterpret_cast<uint16_t*>(out), s_);
      }
      case CodecKind::kFp32: {
        absl::StatusOr<size_t> bad = b_.first_nonfinite(y, e, n, s_);
        if (!bad.ok()) return bad.status();
        if (*bad < n) return Unencodable(y, e, *bad, /*fp16=*/false);
        if (e == nullptr) return b_.copy_on_device(out, y, 4 * n, s_);
        // z = e + 1 * y (= y + e exactly) is the payload; the new error is
        // z - z = +0, as the CPU codec writes it.
        absl::Status st = b_.axpy(y, n, 1.0f, e, s_);
        if (st.ok()) st = b_.copy_on_device(out, e, 4 * n, s_);
        if (st.ok()) st = b_.set_zero(e, 4 * n, s_);
        return st;
      }
    }
    return absl::InternalError("unknown codec kind");
  }

  absl::Status Decode(const Codec& codec, Payload in, size_t n, float* out) const override {
    if (absl::Status st = codec.CheckPayload(in.host, n); !st.ok() || n == 0) return st;
    switch (codec.kind()) {
      case CodecKind::kOnebit: {
        if (absl::Status st = Aligned(in.local, 4); !st.ok()) return st;
        const float* scales = reinterpret_cast<const float*>(in.local);
        return b_.onebit_decode(scales, in.local + 4 * Blocks(n), n, block_, out, s_);
      }
      case CodecKind::kFp16:
        if (absl::Status st = Aligned(in.local, 2); !st.ok()) return st;
        return b_.fp16_decode(reinterpret_cast<const uint16_t*>(in.local), n, out, s_);
      case CodecKind::kFp32:
        return b_.copy_on_device(out, in.local, 4 * n, s_);
    }
    return absl::InternalError("unknown codec kind");
  }

  absl::Status DecodeAdd(const Codec& codec, Payload in, size_t n, float* acc) const override {
    if (absl::Status st = codec.CheckPayload(in.host, n); !st.ok() || n == 0) return st;
    if (absl::Status st = Aligned(in.local, codec.kind() == CodecKind::kFp16 ? 2 : 4); !st.ok()) {
      return st;
    }
    switch (codec.kind()) {
      case CodecKind::kOnebit: {
        const float* scales = reinterpret_cast<const float*>(in.local);
        return b_.onebit_decode_add(scales, in.local + 4 * Blocks(n), n, block_, 1.0f, acc, s_);
      }
      case CodecKind::kFp16:
        return b_.fp16_decode_add(reinterpret_cast<const uint16_t*>(in.local), n, 1.0f, acc, s_);
      case CodecKind::kFp32:
        return b_.axpy(reinterpret_cast<const float*>(in.local), n, 1.0f, acc, s_);
    }
    return absl::InternalError("unknown codec kind");
  }

  absl::Status Copy(const float* from, size_t n, float* to) const override {
    return b_.copy_on_device(to, from, 4 * n, s_);
  }
  absl::Status Zero(size_t n, float* out) const override { return b_.set_zero(out, 4 * n, s_); }
  absl::Status UpdateMomentum(const float* g, float b1, float c1, size_t n,
                              float* m) const override {
    return b_.update_momentum(g, b1, c1, n, m, s_);
  }
  absl::Status UpdateMoments(const float* g, float b1, float c1, float b2, float c2, size_t n,
                             float* m, float* v) const override {
    return b_.update_moments(g, b1, c1, b2, c2, n, m, v, s_);
  }
  absl::Status ApplyMomentum(const float* mbar, const float* den, float lr, float wd, size_t n,
                             float* x) const override {
    return b_.apply_momentum(mbar, den, lr, wd, n, x, s_);
  }
  absl::Status FrozenDenominators(const float* v, float eps, size_t n, float* den) const override {
    return b_.frozen_denominators(v, eps, n, den, s_);
  }
  absl::Status VarianceDenominators(const float* v, float c, float floor, float eps, size_t n,
                                    float* den) const override {
    return b_.variance_denominators(v, c, floor, eps, n, den, s_);
  }
  absl::Status UpdateSinceSync(const float* x, const float* x_sync, const float* den, size_t n,
                               float* u) const override {
    return b_.update_since_sync(x, x_sync, den, n, u, s_);
  }
  absl::Status ApplySync(const float* a, const float* den, float lrs, size_t n, float* x_sync,
                         float* m, float* x) const override {
    return b_.apply_sync(a, den, lrs, n, x_sync, m, x, s_);
  }
  absl::Status LambApply(const float* mbar, const float* den, float k, float wd, size_t n,
                         float* x) const override {
    return b_.lamb_apply(mbar, den, k, wd, n, x, s_);
  }

  absl::Status Axpy(const float* x, size_t n, float w, float* acc) const override {
    return b_.axpy(x, n, w, acc, s_);
  }
  absl::Status AdamUpdate(const AdamCoefficients& c, size_t n, float* g, float* m, float* v,
                          float* x) const override {
    return b_.adam_update(c, n, g, m, v, x, s_);
  }
  absl::StatusOr<size_t> FirstNonFinite(const float* y, size_t n) const override {
    return b_.first_nonfinite(y, nullptr, n, s_);
  }

  absl::StatusOr<float*> Scratch(size_t n) const override {
    if (n <= scratch_n_) return static_cast<float*>(scratch_);
    // The old scratch may still be read by queued work.
    if (absl::Status st = b_.synchronize(s_); !st.ok()) return st;
    b_.free(scratch_);
    scratch_ = nullptr;
    scratch_n_ = 0;
    absl::StatusOr<void*> p = b_.alloc(4 * n);
    if (!p.ok()) return p.status();
    scratch_ = *p;
    scratch_n_ = n;
    return static_cast<float*>(scratch_);
  }

 private:
  size_t Blocks(size_t n) const { return (n + block_ - 1) / block_; }

  static absl::Status Aligned(const uint8_t* p, size_t to) {
    if (reinterpret_cast<uintptr_t>(p) % to == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("a payload in device memory must be ", to, "-byte aligned here"));
  }

  // The error compress/ gives for z = y[i] (+ e[i]), which the device found
  // non-finite (or, for fp16, too large).
  absl::Status Unencodable(const float* y, const float* e, size_t i, bool fp16) const {
    float yv = 0, ev = 0;
    absl::Status st = b_.copy_to_host(&yv, y + i, 4, s_);
    if (st.ok() && e != nullptr) st = b_.copy_to_host(&ev, e + i, 4, s_);
    if (st.ok()) st = b_.synchronize(s_);
    if (!st.ok()) return st;
    const float z = e != nullptr ? yv + ev : yv;
    if (fp16 && std::isfinite(z)) {
      return absl::InvalidArgumentError(absl::StrCat("value ", z, " at index ", i,
                                                     " overflows fp16 (largest is 65504); "
                                                     "nothing was encoded or changed"));
    }
    if (e == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("non-finite input at index ", i, " (", yv, "); nothing was encoded"));
    }
    return absl::InvalidArgumentError(absl::StrCat("non-finite input at index ", i, " (y=", yv,
                                                   ", e=", ev, ", y+e=", z,
                                                   "); nothing was encoded or changed"));
  }

  const Backend& b_;
  const Stream s_;
  const uint32_t block_;
  const ScaleRule rule_;
  mutable void* scratch_ = nullptr;  // scratch_n_ floats of device memory
  mutable size_t scratch_n_ = 0;
};

}  // namespace

std::unique_ptr<ArrayOps> NewArrayOps(const Backend& backend, Stream stream,
                                      const CodecOptions& codec) {
  return std::make_unique<BackendOps>(backend, stream, codec);
}

}  // namespace onebit::cuda
