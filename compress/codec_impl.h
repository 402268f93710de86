// Internal to compress/: constructors of the concrete codecs and the error
// messages they share.
#ifndef ONEBIT_COMPRESS_CODEC_IMPL_H_
#define ONEBIT_COMPRESS_CODEC_IMPL_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "compress/codec.h"
#include "compress/kernels.h"

namespace onebit::compress_internal {

std::unique_ptr<const Codec> NewFp32Codec(const Kernels& k);
std::unique_ptr<const Codec> NewFp16Codec(const Kernels& k);
std::unique_ptr<const Codec> NewOnebitCodec(const Kernels& k, const CodecOptions& options);

// "non-finite input at index done + i (y=..., e=...)", of y[i] and e[i]
// (e may be null). done: where y and e start, a piece of EncodeInPieces
// (the elements before it were encoded), else 0.
absl::Status NonFiniteInput(const float* y, const float* e, size_t i, size_t done = 0);

// Elements per piece of EncodeInPieces / DecodeInPieces where the encoding
// is element by element (fp32, fp16): 16 KB of floats, so that a piece's
// y, e and output stay in L1 between the passes over it.
inline constexpr size_t kElementwisePiece = 4096;

// EncodeInPieces of an encoding element by element, `bytes` per element:
// per piece, hooks.before (or hooks.source), then `first_bad(y, e, n)` (the
// first index that cannot be encoded, or n; pointers and result relative to
// the piece), `encode(y, e, n, out)` and, for hooks.after, `decode(in, n,
// out)` into a scratch piece. An element that cannot be encoded is
// `refuse(y, e, i, b)`'s error: y and e the piece's, i the index in it, b
// the piece's begin (the elements encoded before it).
template <typename FirstBad, typename Refuse, typename Encode, typename Decode>
absl::Status ElementwiseInPieces(const float* y, float* e, size_t n, uint8_t* out, size_t bytes,
                                 const Codec::PieceHooks& hooks, FirstBad first_bad, Refuse refuse,
                                 Encode encode, Decode decode) {
  thread_local std::vector<float> decoded;
  if (hooks.after && decoded.size() < kElementwisePiece) decoded.resize(kElementwisePiece);
  for (size_t b = 0; b < n; b += kElementwisePiece) {
    const size_t len = std::min(kElementwisePiece, n - b);
    float* ep = e == nullptr ? nullptr : e + b;
    if (hooks.before) (*hooks.before)(b, b + len);
    const float* yp = hooks.source ? (*hooks.source)(b, b + len) : y + b;
    if (const size_t bad = first_bad(yp, ep, len); bad < len) return refuse(yp, ep, bad, b);
    encode(yp, ep, len, out + bytes * b);
    if (hooks.after) {
      decode(out + bytes * b, len, decoded.data());
      if (absl::Status st = (*hooks.after)(b, b + len, decoded.data()); !st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

// DecodeInPieces of an encoding element by element, `bytes` per element,
// once the whole payload is checked: `decode(in, n, out)` per piece.
template <typename Decode>
absl::Status DecodeElementwiseInPieces(
    const uint8_t* in, size_t n, float* out, size_t bytes, Decode decode,
    absl::FunctionRef<absl::Status(size_t, size_t, const float*)> after) {
  for (size_t b = 0; b < n; b += kElementwisePiece) {
    const size_t len = std::min(kElementwisePiece, n - b);
    decode(in + bytes * b, len, out + b);
    if (absl::Status st = after(b, b + len, out + b); !st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace onebit::compress_internal

#endif  // ONEBIT_COMPRESS_CODEC_IMPL_H_
