// The codecs of onebit-ps (docs/design.md §1.3): how a vector of fp32 values travels
// between workers and servers. A Codec is immutable and thread-safe; build one
// with NewCodec() and share it.
//
// Every call that writes is all-or-nothing: on error (non-finite input, a
// corrupt payload) it returns a Status naming the first bad index and leaves
// every output buffer untouched, so a caller can drop the step and go on.
// That takes a read of the whole input before the first write: callers encode
// in chunks of a few hundred thousand elements, so the writing pass finds the
// chunk in cache (see tools/bench/codec_bench.cc for what each costs).
#ifndef ONEBIT_COMPRESS_CODEC_H_
#define ONEBIT_COMPRESS_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace onebit {

enum class CodecKind : uint8_t { kFp32 = 1, kFp16 = 2, kOnebit = 3 };

// How a onebit block's scale is computed from the block y[0..n).
enum class ScaleRule : uint8_t {
  kL1 = 1,  // mean |y|: minimises the L2 error of sign quantisation (default)
  kL2 = 2,  // ||y||_2 / sqrt(n), as DeepSpeed's OneBitAdam
};

// Which instruction set the kernels use. Every path produces identical bytes.
enum class SimdPath : uint8_t { kAuto, kScalar, kAvx2, kAvx512 };

struct CodecOptions {
  // Elements per onebit block (one fp32 scale each). A multiple of 32 in
  // [32, 1 << 24]; the last block of a vector may be shorter.
  uint32_t block_size = 2048;
  ScaleRule scale = ScaleRule::kL1;
  // kAuto: the widest the CPU has (AVX-512F, AVX2+F16C, else scalar).
  // Naming a path the CPU lacks is an error from NewCodec.
  SimdPath simd = SimdPath::kAuto;
};

class Codec {
 public:
  virtual ~Codec() = default;

  virtual CodecKind kind() const = 0;
  // Changes whenever the encoding would, e.g. "onebit-l1-b2048", "fp16".
  virtual const std::string& name() const = 0;
  // The kernels in use ("scalar", "avx2" or "avx512"), for logs and
  // benchmarks.
  virtual absl::string_view simd_path() const = 0;

  // Bytes that n encoded elements occupy. Known before encoding.
  virtual size_t EncodedSize(size_t n) const = 0;

  // out[0, EncodedSize(n)) = C(x[0, n)).
  virtual absl::Status Encode(const float* x, size_t n, uint8_t* out) const = 0;

  // Error feedback, fused: with z = y + e (elementwise, fp32),
  // out = C(z) and e = z - D(C(z)). Two passes over y and e.
  virtual absl::Status EncodeWithFeedback(const float* y, float* e, size_t n,
                                          uint8_t* out) const = 0;

  // EncodeWithFeedback (e may be null: Encode) in one pass over memory, for
  // a caller that fails its step on any error. Piece by piece (a few
  // thousand elements, whole onebit blocks): `before(b, e)`, where given,
  // first writes y[b, e) (a momentum updated in place, say); the piece is
  // then checked and encoded while in cache; `after(b, e, d)`, where
  // given, gets d = D(out)[b, e) (the decoded piece, valid during the
  // call), and its error ends the call. Pieces start at multiples of
  // piece_elems(). Not all or nothing: on a non-finite or unencodable z the
  // error is EncodeWithFeedback's, and the pieces before the bad one are
  // encoded, with their e updated and their hooks run.
  // `source(b, e)`, where given instead of `before`, returns y[b, e) (valid
  // until the next piece), and y itself is not read (it may be null): for a
  // y that exists only piece by piece (a sum of payloads, a momentum held
  // encoded).
  struct PieceHooks {
    std::optional<absl::FunctionRef<void(size_t begin, size_t end)>> before;
    std::optional<absl::FunctionRef<absl::Status(size_t begin, size_t end, const float* decoded)>>
        after;
    std::optional<absl::FunctionRef<const float*(size_t begin, size_t end)>> source;
  };
  virtual absl::Status EncodeInPieces(const float* y, float* e, size_t n, uint8_t* out,
                                      const PieceHooks& hooks) const = 0;
  // The elements of one piece of EncodeInPieces and DecodeInPieces.
  virtual size_t piece_elems() const = 0;

  // out[0, n) = D(in). Requires in to hold EncodedSize(n) bytes; rejects a
  // payload whose values or scales are not finite (a corrupt or hostile peer).
  virtual absl::Status Decode(const uint8_t* in, size_t n, float* out) const = 0;

  // acc[i] += w * D(in)[i], so a server averages N pushes without temporaries.
  virtual absl::Status DecodeAdd(const uint8_t* in, size_t n, float w, float* acc) const = 0;
  // Decode, then `after(b, e, out + b)` for each piece while it is in cache
  // (x updated from the decoded momentum, say). The payload is checked
  // before anything is written (as Decode); an error of `after` ends the
  // call, with the pieces before it decoded.
  virtual absl::Status DecodeInPieces(
      const uint8_t* in, size_t n, float* out,
      absl::FunctionRef<absl::Status(size_t begin, size_t end, const float* decoded)> after)
      const = 0;

  // out[0, end - begin) = D(in)[begin, end), and acc[0, end - begin) +=
  // w * D(in)[begin, end): the same bits as those elements of Decode and
  // DecodeAdd, for a caller that walks a payload piece by piece beside other
  // arrays or payloads. Unchecked: requires a payload CheckPayload accepted
  // for n elements, begin a multiple of piece_elems() and begin <= end <= n.
  virtual void DecodeRange(const uint8_t* in, size_t n, size_t begin, size_t end,
                           float* out) const = 0;
  virtual void DecodeAddRange(const uint8_t* in, size_t n, size_t begin, size_t end, float w,
                              float* acc) const = 0;

  // OK when Decode would accept in[0, EncodedSize(n)), else the error it
  // would return; writes nothing. For callers that decode elsewhere (a GPU
  // worker checks on the host, where the bytes arrive, then decodes on the
  // device).
  virtual absl::Status CheckPayload(const uint8_t* in, size_t n) const = 0;
};

// out[i] = +0.0f + w * D(in)[i]: what codec.DecodeAdd gives on an acc of
// +0.0f (0 + v is v, but +0 for -0), without writing the zeros and reading
// them back: each piece is decoded, then scaled while in cache. All or
// nothing, as Decode.
absl::Status DecodeScaled(const Codec& codec, const uint8_t* in, size_t n, float w, float* out);
// The same for elements [begin, end) into out[0, end - begin), unchecked as
// Codec::DecodeRange (whose requirements it has).
void DecodeScaledRange(const Codec& codec, const uint8_t* in, size_t n, size_t begin, size_t end,
                       float w, float* out);

// kind is "fp32", "fp16" or "onebit". Errors name the bad option.
absl::StatusOr<std::unique_ptr<const Codec>> NewCodec(absl::string_view kind,
                                                      const CodecOptions& options = {});
absl::StatusOr<std::unique_ptr<const Codec>> NewCodec(CodecKind kind,
                                                      const CodecOptions& options = {});

absl::StatusOr<CodecKind> ParseCodecKind(absl::string_view name);
absl::string_view CodecKindName(CodecKind kind);
absl::StatusOr<ScaleRule> ParseScaleRule(absl::string_view name);
absl::string_view ScaleRuleName(ScaleRule rule);

// True when this CPU runs the AVX2+F16C kernels; the AVX-512F ones (which
// need AVX2+F16C too).
bool CpuHasAvx2();
bool CpuHasAvx512();

}  // namespace onebit

#endif  // ONEBIT_COMPRESS_CODEC_H_
