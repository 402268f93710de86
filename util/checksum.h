// A stable checksum of parameter bytes for replicas_equal: zlib's crc32, the
// same on every host and run (absl::Hash is seeded per process).
#ifndef ONEBIT_UTIL_CHECKSUM_H_
#define ONEBIT_UTIL_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

namespace onebit {

uint32_t Crc32OfFloats(const float* x, size_t n);

}  // namespace onebit

#endif  // ONEBIT_UTIL_CHECKSUM_H_
