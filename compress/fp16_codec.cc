// fp16: IEEE half precision, round to nearest even (F16C where present).
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "compress/codec_impl.h"
#include "compress/payload.h"

namespace onebit::compress_internal {
namespace {

class Fp16Codec final : public Codec {
 public:
  explicit Fp16Codec(const Kernels& k) : k_(k) {}

  CodecKind kind() const override { return CodecKind::kFp16; }
  const std::string& name() const override { return name_; }
  absl::string_view simd_path() const override { return k_.name; }
  size_t EncodedSize(size_t n) const override { return 2 * n; }

  absl::Status Encode(const float* x, size_t n, uint8_t* out) const override {
    if (size_t bad = k_.fp16_check(x, nullptr, n); bad < n) return Unrepresentable(x, nullptr, bad);
    k_.fp16_encode(x, nullptr, n, Halves(out));
    return absl::OkStatus();
  }

  absl::Status EncodeWithFeedback(const float* y, float* e, size_t n, uint8_t* out) const override {
    if (size_t bad = k_.fp16_check(y, e, n); bad < n) return Unrepresentable(y, e, bad);
    k_.fp16_encode(y, e, n, Halves(out));
    return absl::OkStatus();
  }

  absl::Status Decode(const uint8_t* in, size_t n, float* out) const override {
    AlignedPayload<uint16_t> p(in, n);
    if (size_t bad = k_.fp16_check_payload(p.data(), n); bad < n) return BadValue(bad);
    k_.fp16_decode(p.data(), n, out);
    return absl::OkStatus();
  }

  absl::Status DecodeAdd(const uint8_t* in, size_t n, float w, float* acc) const override {
    AlignedPayload<uint16_t> p(in, n);
    if (size_t bad = k_.fp16_check_payload(p.data(), n); bad < n) return BadValue(bad);
    k_.fp16_decode_add(p.data(), n, w, acc);
    return absl::OkStatus();
  }

 private:
  static uint16_t* Halves(uint8_t* out) {
    if (reinterpret_cast<uintptr_t>(out) % 2 != 0) {
      std::fprintf(stderr, "fp16 codec: output buffer must be 2-byte aligned\n");
      std::abort();
    }
    return reinterpret_cast<uint16_t*>(out);
  }

  static absl::Status Unrepresentable(const float* y, const float* e, size_t i) {
    const float z = e ? y[i] + e[i] : y[i];
    if (!std::isfinite(z)) return NonFiniteInput(y, e, i);
    return absl::InvalidArgumentError(absl::StrCat("value ", z, " at index ", i,
                                                   " overflows fp16 (largest is 65504); "
                                                   "nothing was encoded or changed"));
  }

  static absl::Status BadValue(size_t i) {
    return absl::InvalidArgumentError(absl::StrCat("fp16 payload: non-finite value at index ", i));
  }

  const Kernels& k_;
  const std::string name_ = "fp16";
};

}  // namespace

std::unique_ptr<const Codec> NewFp16Codec(const Kernels& k) {
  return std::make_unique<Fp16Codec>(k);
}

}  // namespace onebit::compress_internal
