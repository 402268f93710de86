// Internal to compress/: constructors of the concrete codecs and the error
// messages they share.
#ifndef ONEBIT_COMPRESS_CODEC_IMPL_H_
#define ONEBIT_COMPRESS_CODEC_IMPL_H_

#include <memory>

#include "absl/status/status.h"
#include "compress/codec.h"
#include "compress/kernels.h"

namespace onebit::compress_internal {

std::unique_ptr<const Codec> NewFp32Codec(const Kernels& k);
std::unique_ptr<const Codec> NewFp16Codec(const Kernels& k);
std::unique_ptr<const Codec> NewOnebitCodec(const Kernels& k, const CodecOptions& options);

// "non-finite input at index i (y=..., e=...)"; e may be null.
absl::Status NonFiniteInput(const float* y, const float* e, size_t i);

}  // namespace onebit::compress_internal

#endif  // ONEBIT_COMPRESS_CODEC_IMPL_H_
