// The small utilities (util/).
#include "gtest/gtest.h"
#include "util/checksum.h"
#include "util/phase_medians.h"

namespace onebit {
namespace {

TEST(ReplicaChecksum, IsZlibCrc32OfTheBytes) {
  // crc32 of the 4 bytes 00 00 80 3f (1.0f), from Python's zlib.crc32.
  const float one = 1.0f;
  EXPECT_EQ(Crc32OfFloats(&one, 1), 0xaca16a6au);
  EXPECT_EQ(Crc32OfFloats(nullptr, 0), 0u);
}

// The medians by phase: the middle of the sorted durations (the upper one
// of an even count), each part on its own, a phase without steps left out
// of the line, and no more than kMaxSteps kept.
TEST(PhaseMedians, EachPartsMedianByPhase) {
  PhaseMedians m({"gradient", "wait"});
  EXPECT_EQ(m.Summary(), "");
  for (double g : {0.005, 0.001, 0.003}) m.Add(false, {g, 2 * g});
  EXPECT_EQ(m.steps(false), 3u);
  EXPECT_EQ(m.steps(true), 0u);
  EXPECT_DOUBLE_EQ(m.Median(false, 0), 0.003);
  EXPECT_DOUBLE_EQ(m.Median(false, 1), 0.006);
  EXPECT_EQ(m.Summary(), "warm-up gradient 3.000, wait 6.000");
  m.Add(true, {0.010, 0.0});
  m.Add(true, {0.020});  // a missing part counts 0
  EXPECT_DOUBLE_EQ(m.Median(true, 0), 0.020);
  EXPECT_DOUBLE_EQ(m.Median(true, 1), 0.0);
  EXPECT_EQ(m.Summary(),
            "warm-up gradient 3.000, wait 6.000; compression gradient 20.000, wait 0.000");
  for (size_t i = 0; i < PhaseMedians::kMaxSteps + 10; ++i) m.Add(true, {1.0, 1.0});
  EXPECT_EQ(m.steps(true), PhaseMedians::kMaxSteps);
}

}  // namespace
}  // namespace onebit
