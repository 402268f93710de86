#include "compress/codec.h"

#include <cpuid.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "compress/codec_impl.h"
#include "compress/kernels.h"

namespace onebit {

bool CpuHasAvx2() {
  // F16C from CPUID leaf 1 (ECX): clang has no __builtin_cpu_supports("f16c").
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  }();
  return has;
}

bool CpuHasAvx512() {
  static const bool has = CpuHasAvx2() && __builtin_cpu_supports("avx512f");
  return has;
}

void DecodeScaledRange(const Codec& codec, const uint8_t* in, size_t n, size_t begin, size_t end,
                       float w, float* out) {
  codec.DecodeRange(in, n, begin, end, out);
  // w * (+-s) is +-(w * s): the same float DecodeAdd's kernels add.
  for (size_t i = 0; i < end - begin; ++i) out[i] = 0.0f + w * out[i];
}

absl::Status DecodeScaled(const Codec& codec, const uint8_t* in, size_t n, float w, float* out) {
  if (absl::Status st = codec.CheckPayload(in, n); !st.ok()) return st;
  // Each piece scaled while in cache.
  for (size_t b = 0; b < n; b += codec.piece_elems()) {
    DecodeScaledRange(codec, in, n, b, std::min(n, b + codec.piece_elems()), w, out + b);
  }
  return absl::OkStatus();
}

absl::StatusOr<CodecKind> ParseCodecKind(absl::string_view name) {
  if (name == "fp32") return CodecKind::kFp32;
  if (name == "fp16") return CodecKind::kFp16;
  if (name == "onebit") return CodecKind::kOnebit;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown codec \"", name, "\" (expected fp32, fp16 or onebit)"));
}

absl::string_view CodecKindName(CodecKind kind) {
  switch (kind) {
    case CodecKind::kFp32:
      return "fp32";
    case CodecKind::kFp16:
      return "fp16";
    case CodecKind::kOnebit:
      return "onebit";
  }
  return "unknown";
}

absl::StatusOr<ScaleRule> ParseScaleRule(absl::string_view name) {
  if (name == "l1") return ScaleRule::kL1;
  if (name == "l2") return ScaleRule::kL2;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown scale rule \"", name, "\" (expected l1 or l2)"));
}

absl::string_view ScaleRuleName(ScaleRule rule) { return rule == ScaleRule::kL2 ? "l2" : "l1"; }

absl::StatusOr<std::unique_ptr<const Codec>> NewCodec(absl::string_view kind,
                                                      const CodecOptions& options) {
  absl::StatusOr<CodecKind> k = ParseCodecKind(kind);
  if (!k.ok()) return k.status();
  return NewCodec(*k, options);
}

absl::StatusOr<std::unique_ptr<const Codec>> NewCodec(CodecKind kind, const CodecOptions& options) {
  using compress_internal::Kernels;
  const Kernels* kernels = nullptr;
  switch (options.simd) {
    case SimdPath::kScalar:
      kernels = &compress_internal::ScalarKernels();
      break;
    case SimdPath::kAvx2:
      if (!CpuHasAvx2()) {
        return absl::FailedPreconditionError(
            "codec: AVX2 kernels requested but this CPU lacks "
            "AVX2/F16C");
      }
      kernels = &compress_internal::Avx2Kernels();
      break;
    case SimdPath::kAvx512:
      if (!CpuHasAvx512()) {
        return absl::FailedPreconditionError(
            "codec: AVX-512 kernels requested but this CPU lacks AVX-512F (or AVX2/F16C)");
      }
      kernels = &compress_internal::Avx512Kernels();
      break;
    case SimdPath::kAuto:
      kernels = CpuHasAvx512() ? &compress_internal::Avx512Kernels()
                : CpuHasAvx2() ? &compress_internal::Avx2Kernels()
                               : &compress_internal::ScalarKernels();
      break;
  }
  switch (kind) {
    case CodecKind::kFp32:
      return compress_internal::NewFp32Codec(*kernels);
    case CodecKind::kFp16:
      return compress_internal::NewFp16Codec(*kernels);
    case CodecKind::kOnebit:
      if (options.block_size < 32 || options.block_size % 32 != 0 ||
          options.block_size > (1u << 24)) {
        return absl::InvalidArgumentError(
            absl::StrCat("codec: block size ", options.block_size,
                         " must be a multiple of 32 in [32, 16777216]"));
      }
      if (options.scale != ScaleRule::kL1 && options.scale != ScaleRule::kL2) {
        return absl::InvalidArgumentError("codec: unknown scale rule");
      }
      return compress_internal::NewOnebitCodec(*kernels, options);
  }
  return absl::InvalidArgumentError("codec: unknown codec kind");
}

namespace compress_internal {

absl::Status NonFiniteInput(const float* y, const float* e, size_t i, size_t done) {
  const std::string after =
      done == 0 ? (e == nullptr ? "nothing was encoded" : "nothing was encoded or changed")
                : absl::StrCat("the elements before ", done, " were encoded");
  if (e == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("non-finite input at index ", done + i, " (", y[i], "); ", after));
  }
  return absl::InvalidArgumentError(absl::StrCat("non-finite input at index ", done + i,
                                                 " (y=", y[i], ", e=", e[i], ", y+e=", y[i] + e[i],
                                                 "); ", after));
}

}  // namespace compress_internal
}  // namespace onebit
