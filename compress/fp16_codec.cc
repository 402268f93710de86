// fp16: IEEE half precision, round to nearest even (F16C where present).
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

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
    EncodeTo(x, nullptr, n, out);
    return absl::OkStatus();
  }

  absl::Status EncodeWithFeedback(const float* y, float* e, size_t n, uint8_t* out) const override {
    if (size_t bad = k_.fp16_check(y, e, n); bad < n) return Unrepresentable(y, e, bad);
    EncodeTo(y, e, n, out);
    return absl::OkStatus();
  }

  absl::Status Decode(const uint8_t* in, size_t n, float* out) const override {
    AlignedPayload<uint16_t> p(in, n);
    if (size_t bad = k_.fp16_check_payload(p.data(), n); bad < n) return BadValue(bad);
    k_.fp16_decode(p.data(), n, out);
    return absl::OkStatus();
  }

  absl::Status EncodeInPieces(const float* y, float* e, size_t n, uint8_t* out,
                              const PieceHooks& hooks) const override {
    return ElementwiseInPieces(
        y, e, n, out, 2, hooks,
        [this](const float* py, const float* pe, size_t m) { return k_.fp16_check(py, pe, m); },
        [](const float* py, const float* pe, size_t i, size_t b) {
          return Unrepresentable(py, pe, i, b);
        },
        [this](const float* py, float* pe, size_t m, uint8_t* po) { EncodeTo(py, pe, m, po); },
        [this](const uint8_t* in, size_t m, float* po) {
          AlignedPayload<uint16_t> p(in, m);
          k_.fp16_decode(p.data(), m, po);
        });
  }

  size_t piece_elems() const override { return kElementwisePiece; }

  absl::Status DecodeInPieces(
      const uint8_t* in, size_t n, float* out,
      absl::FunctionRef<absl::Status(size_t, size_t, const float*)> after) const override {
    AlignedPayload<uint16_t> p(in, n);
    if (size_t bad = k_.fp16_check_payload(p.data(), n); bad < n) return BadValue(bad);
    return DecodeElementwiseInPieces(
        reinterpret_cast<const uint8_t*>(p.data()), n, out, 2,
        [this](const uint8_t* b, size_t m, float* o) {
          k_.fp16_decode(reinterpret_cast<const uint16_t*>(b), m, o);
        },
        after);
  }

  absl::Status DecodeAdd(const uint8_t* in, size_t n, float w, float* acc) const override {
    AlignedPayload<uint16_t> p(in, n);
    if (size_t bad = k_.fp16_check_payload(p.data(), n); bad < n) return BadValue(bad);
    k_.fp16_decode_add(p.data(), n, w, acc);
    return absl::OkStatus();
  }

  void DecodeRange(const uint8_t* in, size_t /*n*/, size_t begin, size_t end,
                   float* out) const override {
    AlignedPayload<uint16_t> p(in + 2 * begin, end - begin);
    k_.fp16_decode(p.data(), end - begin, out);
  }
  void DecodeAddRange(const uint8_t* in, size_t /*n*/, size_t begin, size_t end, float w,
                      float* acc) const override {
    AlignedPayload<uint16_t> p(in + 2 * begin, end - begin);
    k_.fp16_decode_add(p.data(), end - begin, w, acc);
  }

  absl::Status CheckPayload(const uint8_t* in, size_t n) const override {
    AlignedPayload<uint16_t> p(in, n);
    if (size_t bad = k_.fp16_check_payload(p.data(), n); bad < n) return BadValue(bad);
    return absl::OkStatus();
  }

 private:
  // Encodes into out at any address; an odd one (rare) goes through a copy.
  void EncodeTo(const float* y, float* e, size_t n, uint8_t* out) const {
    if (reinterpret_cast<uintptr_t>(out) % 2 == 0) {
      k_.fp16_encode(y, e, n, reinterpret_cast<uint16_t*>(out));
      return;
    }
    std::vector<uint16_t> halves(n);
    k_.fp16_encode(y, e, n, halves.data());
    if (n > 0) std::memcpy(out, halves.data(), 2 * n);
  }

  // done: where y and e start (NonFiniteInput).
  static absl::Status Unrepresentable(const float* y, const float* e, size_t i, size_t done = 0) {
    const float z = e ? y[i] + e[i] : y[i];
    if (!std::isfinite(z)) return NonFiniteInput(y, e, i, done);
    return absl::InvalidArgumentError(
        absl::StrCat("value ", z, " at index ", done + i, " overflows fp16 (largest is 65504); ",
                     done == 0 ? std::string("nothing was encoded or changed")
                               : absl::StrCat("the elements before ", done, " were encoded")));
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
