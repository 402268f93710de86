// onebit: per block of B elements one fp32 scale and one sign bit per element
// (docs/design.md §1.3). Wire layout: all block scales (fp32, little endian), then
// the bits, element j in byte j/8 at bit j%8.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/codec_impl.h"
#include "compress/payload.h"

namespace onebit::compress_internal {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little endian");

class OnebitCodec final : public Codec {
 public:
  OnebitCodec(const Kernels& k, const CodecOptions& options)
      : k_(k),
        block_(options.block_size),
        rule_(options.scale),
        name_(absl::StrCat("onebit-", ScaleRuleName(rule_), "-b", block_)) {}

  CodecKind kind() const override { return CodecKind::kOnebit; }
  const std::string& name() const override { return name_; }
  absl::string_view simd_path() const override { return k_.name; }
  size_t EncodedSize(size_t n) const override { return 4 * NumBlocks(n) + (n + 7) / 8; }

  absl::Status Encode(const float* x, size_t n, uint8_t* out) const override {
    return EncodeImpl(x, nullptr, n, out);
  }

  absl::Status EncodeWithFeedback(const float* y, float* e, size_t n, uint8_t* out) const override {
    return EncodeImpl(y, e, n, out);
  }

  absl::Status EncodeInPieces(const float* y, float* e, size_t n, uint8_t* out,
                              const PieceHooks& hooks) const override {
    const size_t blocks = NumBlocks(n);
    const size_t per_piece = piece_elems() / block_;
    thread_local std::vector<float> scales, decoded;
    if (scales.size() < per_piece) scales.resize(per_piece);
    if (hooks.after && decoded.size() < piece_elems()) decoded.resize(piece_elems());
    uint8_t* bits = out + 4 * blocks;
    for (size_t b0 = 0; b0 < blocks; b0 += per_piece) {
      const size_t begin = b0 * block_;
      const size_t len = std::min(n, begin + piece_elems()) - begin;
      float* ep = e == nullptr ? nullptr : e + begin;
      if (hooks.before) (*hooks.before)(begin, begin + len);
      const float* yp = hooks.source ? (*hooks.source)(begin, begin + len) : y + begin;
      const size_t bad = k_.onebit_scales(yp, ep, len, block_, rule_, scales.data());
      if (absl::Status st = CheckNewScales(scales.data(), bad, len, b0, begin); !st.ok()) return st;
      if (bad < len) return NonFiniteInput(yp, ep, bad, begin);
      const size_t nb = NumBlocks(len);
      std::memcpy(out + 4 * b0, scales.data(), 4 * nb);
      uint8_t* piece_bits = bits + begin / 8;  // blocks are multiples of 32 elements
      k_.onebit_signs(yp, ep, len, block_, scales.data(), piece_bits);
      if (hooks.after) {
        k_.onebit_decode(scales.data(), piece_bits, len, block_, decoded.data());
        if (absl::Status st = (*hooks.after)(begin, begin + len, decoded.data()); !st.ok()) {
          return st;
        }
      }
    }
    return absl::OkStatus();
  }

  // At least 4096 elements, whole blocks.
  size_t piece_elems() const override {
    return block_ * ((kElementwisePiece + block_ - 1) / block_);
  }

  absl::Status DecodeInPieces(
      const uint8_t* in, size_t n, float* out,
      absl::FunctionRef<absl::Status(size_t, size_t, const float*)> after) const override {
    const size_t blocks = NumBlocks(n);
    AlignedPayload<float> scales(in, blocks);
    if (absl::Status s = CheckScales(scales.data(), n); !s.ok()) return s;
    const size_t per_piece = piece_elems() / block_;
    for (size_t b0 = 0; b0 < blocks; b0 += per_piece) {
      const size_t begin = b0 * block_;
      const size_t len = std::min(n, begin + piece_elems()) - begin;
      k_.onebit_decode(scales.data() + b0, in + 4 * blocks + begin / 8, len, block_, out + begin);
      if (absl::Status st = after(begin, begin + len, out + begin); !st.ok()) return st;
    }
    return absl::OkStatus();
  }

  absl::Status Decode(const uint8_t* in, size_t n, float* out) const override {
    AlignedPayload<float> scales(in, NumBlocks(n));
    if (absl::Status s = CheckScales(scales.data(), n); !s.ok()) return s;
    k_.onebit_decode(scales.data(), in + 4 * NumBlocks(n), n, block_, out);
    return absl::OkStatus();
  }

  absl::Status DecodeAdd(const uint8_t* in, size_t n, float w, float* acc) const override {
    AlignedPayload<float> scales(in, NumBlocks(n));
    if (absl::Status s = CheckScales(scales.data(), n); !s.ok()) return s;
    k_.onebit_decode_add(scales.data(), in + 4 * NumBlocks(n), n, block_, w, acc);
    return absl::OkStatus();
  }

  void DecodeRange(const uint8_t* in, size_t n, size_t begin, size_t end,
                   float* out) const override {
    const size_t b0 = begin / block_;
    AlignedPayload<float> scales(in + 4 * b0, NumBlocks(end) - b0);
    k_.onebit_decode(scales.data(), in + 4 * NumBlocks(n) + begin / 8, end - begin, block_, out);
  }
  void DecodeAddRange(const uint8_t* in, size_t n, size_t begin, size_t end, float w,
                      float* acc) const override {
    const size_t b0 = begin / block_;
    AlignedPayload<float> scales(in + 4 * b0, NumBlocks(end) - b0);
    k_.onebit_decode_add(scales.data(), in + 4 * NumBlocks(n) + begin / 8, end - begin, block_, w,
                         acc);
  }

  absl::Status CheckPayload(const uint8_t* in, size_t n) const override {
    AlignedPayload<float> scales(in, NumBlocks(n));
    return CheckScales(scales.data(), n);
  }

 private:
  size_t NumBlocks(size_t n) const { return (n + block_ - 1) / block_; }

  // Pass 1 computes every scale (and finds any non-finite z) before pass 2
  // writes anything, so a bad input leaves e and out untouched.
  absl::Status EncodeImpl(const float* y, float* e, size_t n, uint8_t* out) const {
    const size_t blocks = NumBlocks(n);
    thread_local std::vector<float> scales;
    if (scales.size() < blocks) scales.resize(blocks);
    const size_t bad = k_.onebit_scales(y, e, n, block_, rule_, scales.data());
    if (absl::Status st = CheckNewScales(scales.data(), bad, n, 0, 0); !st.ok()) return st;
    if (bad < n) return NonFiniteInput(y, e, bad);
    if (blocks > 0) std::memcpy(out, scales.data(), 4 * blocks);
    k_.onebit_signs(y, e, n, block_, scales.data(), out + 4 * blocks);
    return absl::OkStatus();
  }

  // The scales pass 1 wrote for the n elements from `first` (block
  // `first_block`): a scale can overflow even when every z is finite (huge
  // values); the blocks before the first non-finite z (`bad`) are the ones
  // pass 1 completed. `first` elements were encoded before these.
  absl::Status CheckNewScales(const float* scales, size_t bad, size_t n, size_t first_block,
                              size_t first) const {
    for (size_t b = 0; b * block_ < std::min(bad, n); ++b) {
      if (!std::isfinite(scales[b])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "onebit: the ", ScaleRuleName(rule_), " scale of block ", first_block + b,
            " (elements from ", first + b * block_,
            ") overflows fp32; values too large to encode; ",
            first == 0 ? std::string("nothing was changed")
                       : absl::StrCat("the elements before ", first, " were encoded")));
      }
    }
    return absl::OkStatus();
  }

  // A scale from our encoder is finite and never has its sign bit set.
  absl::Status CheckScales(const float* scales, size_t n) const {
    for (size_t b = 0, blocks = NumBlocks(n); b < blocks; ++b) {
      if (!std::isfinite(scales[b]) || std::signbit(scales[b])) {
        return absl::InvalidArgumentError(absl::StrCat("onebit payload: bad scale ", scales[b],
                                                       " for block ", b, " (elements from ",
                                                       b * block_, "); nothing was changed"));
      }
    }
    return absl::OkStatus();
  }

  const Kernels& k_;
  const uint32_t block_;
  const ScaleRule rule_;
  const std::string name_;
};

}  // namespace

std::unique_ptr<const Codec> NewOnebitCodec(const Kernels& k, const CodecOptions& options) {
  return std::make_unique<OnebitCodec>(k, options);
}

}  // namespace onebit::compress_internal
