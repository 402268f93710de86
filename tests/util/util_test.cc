// The small utilities (util/).
#include "gtest/gtest.h"
#include "util/checksum.h"

namespace onebit {
namespace {

TEST(ReplicaChecksum, IsZlibCrc32OfTheBytes) {
  // crc32 of the 4 bytes 00 00 80 3f (1.0f), from Python's zlib.crc32.
  const float one = 1.0f;
  EXPECT_EQ(Crc32OfFloats(&one, 1), 0xaca16a6au);
  EXPECT_EQ(Crc32OfFloats(nullptr, 0), 0u);
}

}  // namespace
}  // namespace onebit
