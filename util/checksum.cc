#include "util/checksum.h"

#include <zlib.h>

namespace onebit {

uint32_t Crc32OfFloats(const float* x, size_t n) {
  uLong crc = crc32_z(0L, Z_NULL, 0);
  return static_cast<uint32_t>(
      crc32_z(crc, reinterpret_cast<const Bytef*>(x), static_cast<z_size_t>(n * sizeof(float))));
}

}  // namespace onebit
