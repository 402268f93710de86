// fp32: the identity codec (the warm-up phase and the uncompressed baseline).
#include <cstring>

#include "absl/strings/str_cat.h"
#include "compress/codec_impl.h"
#include "compress/payload.h"

namespace onebit::compress_internal {
namespace {

class Fp32Codec final : public Codec {
 public:
  explicit Fp32Codec(const Kernels& k) : k_(k) {}

  CodecKind kind() const override { return CodecKind::kFp32; }
  const std::string& name() const override { return name_; }
  absl::string_view simd_path() const override { return k_.name; }
  size_t EncodedSize(size_t n) const override { return 4 * n; }

  absl::Status Encode(const float* x, size_t n, uint8_t* out) const override {
    if (size_t bad = k_.first_nonfinite(x, nullptr, n); bad < n) {
      return NonFiniteInput(x, nullptr, bad);
    }
    if (n > 0) std::memcpy(out, x, 4 * n);  // memcpy from null (n = 0) is undefined
    return absl::OkStatus();
  }

  absl::Status EncodeWithFeedback(const float* y, float* e, size_t n, uint8_t* out) const override {
    if (size_t bad = k_.first_nonfinite(y, e, n); bad < n) return NonFiniteInput(y, e, bad);
    CopyZ(y, e, n, out);
    return absl::OkStatus();
  }

  absl::Status EncodeInPieces(const float* y, float* e, size_t n, uint8_t* out,
                              const PieceHooks& hooks) const override {
    return ElementwiseInPieces(
        y, e, n, out, 4, hooks,
        [this](const float* py, const float* pe, size_t m) {
          return k_.first_nonfinite(py, pe, m);
        },
        [](const float* py, const float* pe, size_t i, size_t b) {
          return NonFiniteInput(py, pe, i, b);
        },
        [](const float* py, float* pe, size_t m, uint8_t* po) { CopyZ(py, pe, m, po); },
        [](const uint8_t* in, size_t m, float* po) { std::memcpy(po, in, 4 * m); });
  }

  size_t piece_elems() const override { return kElementwisePiece; }

  absl::Status DecodeInPieces(
      const uint8_t* in, size_t n, float* out,
      absl::FunctionRef<absl::Status(size_t, size_t, const float*)> after) const override {
    AlignedPayload<float> p(in, n);
    if (size_t bad = k_.first_nonfinite(p.data(), nullptr, n); bad < n) {
      return BadValue(p.data(), bad);
    }
    const auto* bytes = reinterpret_cast<const uint8_t*>(p.data());
    return DecodeElementwiseInPieces(
        bytes, n, out, 4, [](const uint8_t* b, size_t m, float* o) { std::memcpy(o, b, 4 * m); },
        after);
  }

  absl::Status Decode(const uint8_t* in, size_t n, float* out) const override {
    AlignedPayload<float> p(in, n);
    if (size_t bad = k_.first_nonfinite(p.data(), nullptr, n); bad < n) {
      return BadValue(p.data(), bad);
    }
    if (n > 0) std::memcpy(out, p.data(), 4 * n);
    return absl::OkStatus();
  }

  absl::Status DecodeAdd(const uint8_t* in, size_t n, float w, float* acc) const override {
    AlignedPayload<float> p(in, n);
    if (size_t bad = k_.first_nonfinite(p.data(), nullptr, n); bad < n) {
      return BadValue(p.data(), bad);
    }
    k_.axpy(p.data(), n, w, acc);
    return absl::OkStatus();
  }

  void DecodeRange(const uint8_t* in, size_t /*n*/, size_t begin, size_t end,
                   float* out) const override {
    if (end > begin) std::memcpy(out, in + 4 * begin, 4 * (end - begin));
  }
  void DecodeAddRange(const uint8_t* in, size_t /*n*/, size_t begin, size_t end, float w,
                      float* acc) const override {
    AlignedPayload<float> p(in + 4 * begin, end - begin);
    k_.axpy(p.data(), end - begin, w, acc);
  }

  absl::Status CheckPayload(const uint8_t* in, size_t n) const override {
    AlignedPayload<float> p(in, n);
    if (size_t bad = k_.first_nonfinite(p.data(), nullptr, n); bad < n) {
      return BadValue(p.data(), bad);
    }
    return absl::OkStatus();
  }

 private:
  // out = z = y + e (y without e); e = +0, since C is exact and the new
  // error is z - z.
  static void CopyZ(const float* y, float* e, size_t n, uint8_t* out) {
    if (e == nullptr) {
      if (n > 0) std::memcpy(out, y, 4 * n);  // memcpy from null (n = 0) is undefined
      return;
    }
    for (size_t i = 0; i < n; ++i) {
      const float z = y[i] + e[i];
      std::memcpy(out + 4 * i, &z, 4);
      e[i] = 0.0f;
    }
  }

  static absl::Status BadValue(const float* v, size_t i) {
    return absl::InvalidArgumentError(
        absl::StrCat("fp32 payload: non-finite value ", v[i], " at index ", i));
  }

  const Kernels& k_;
  const std::string name_ = "fp32";
};

}  // namespace

std::unique_ptr<const Codec> NewFp32Codec(const Kernels& k) {
  return std::make_unique<Fp32Codec>(k);
}

}  // namespace onebit::compress_internal
