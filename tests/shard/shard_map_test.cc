// Tests for ShardMap (shard/shard_map.h), written against the header's contract:
// S contiguous ranges covering [0, d) exactly once, boundaries on block
// boundaries, block counts differing by at most one, empty shards trailing.
#include "shard/shard_map.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

// Checks every structural property of m for (d, S, B); returns nothing, reports
// through gtest with the parameters in the trace.
void CheckPartition(const ShardMap& m, uint64_t d, uint32_t S, uint32_t B) {
  SCOPED_TRACE("d=" + std::to_string(d) + " S=" + std::to_string(S) + " B=" + std::to_string(B));
  ASSERT_EQ(m.num_params(), d);
  ASSERT_EQ(m.num_shards(), S);
  ASSERT_EQ(m.block_size(), B);
  const uint64_t num_blocks = CeilDiv(d, B);

  // Contiguous and covering [0, d) exactly once.
  uint64_t next = 0;
  uint64_t total = 0;
  uint64_t min_blocks = UINT64_MAX, max_blocks = 0;
  bool seen_empty = false;
  for (uint32_t k = 0; k < S; ++k) {
    const Range r = m.shard(k);
    SCOPED_TRACE("shard " + std::to_string(k) + " = [" + std::to_string(r.begin) + ", " +
                 std::to_string(r.end) + ")");
    ASSERT_EQ(r.begin, next) << "not contiguous";
    ASSERT_LE(r.begin, r.end);
    ASSERT_LE(r.end, d);
    EXPECT_EQ(r.size(), r.end - r.begin);
    // Boundaries fall on block boundaries (or at d, which ends the short last block).
    EXPECT_TRUE(r.begin % B == 0 || r.begin == d);
    EXPECT_TRUE(r.end % B == 0 || r.end == d);
    // Empty shards only trail.
    if (r.size() == 0) {
      seen_empty = true;
    } else {
      EXPECT_FALSE(seen_empty) << "a non-empty shard follows an empty one";
    }
    const uint64_t blocks = CeilDiv(r.size(), B);
    min_blocks = std::min(min_blocks, blocks);
    max_blocks = std::max(max_blocks, blocks);
    next = r.end;
    total += r.size();
  }
  EXPECT_EQ(next, d);
  EXPECT_EQ(total, d);
  // Balanced: block counts differ by at most one, i.e. each is floor or ceil of
  // num_blocks / S.
  EXPECT_LE(max_blocks - min_blocks, 1u);
  EXPECT_EQ(max_blocks, CeilDiv(num_blocks, S));
  EXPECT_EQ(min_blocks, num_blocks / S);
  // With more shards than blocks: one block each, then empty shards.
  if (S >= num_blocks) {
    for (uint32_t k = 0; k < S; ++k) {
      EXPECT_EQ(CeilDiv(m.shard(k).size(), B), k < num_blocks ? 1u : 0u) << "shard " << k;
    }
  }
}

void CheckLocate(const ShardMap& m, uint64_t global) {
  const ShardMap::Location loc = m.Locate(global);
  ASSERT_LT(loc.shard, m.num_shards()) << "global " << global;
  const Range r = m.shard(loc.shard);
  EXPECT_LT(loc.offset, r.size()) << "global " << global << " shard " << loc.shard;
  EXPECT_EQ(r.begin + loc.offset, global) << "global " << global << " shard " << loc.shard;
  EXPECT_TRUE(r.begin <= global && global < r.end);
}

TEST(ShardMapTest, PartitionManySmallConfigsAndLocateEveryElement) {
  const std::vector<uint64_t> ds = {0, 1, 2, 5, 31, 32, 33, 63, 64, 65, 100, 127, 1000, 2049, 4097};
  const std::vector<uint32_t> ss = {1, 2, 3, 4, 5, 7, 8, 13, 64, 1000};
  const std::vector<uint32_t> bs = {1, 3, 32, 64, 2048};
  for (uint64_t d : ds) {
    for (uint32_t S : ss) {
      for (uint32_t B : bs) {
        auto m = ShardMap::Create(d, S, B);
        ASSERT_TRUE(m.ok()) << m.status() << " d=" << d << " S=" << S << " B=" << B;
        CheckPartition(*m, d, S, B);
        // Every element lands in exactly one shard, and Locate finds it.
        for (uint64_t g = 0; g < d; ++g) {
          const ShardMap::Location loc = m->Locate(g);
          ASSERT_LT(loc.shard, S);
          const Range r = m->shard(loc.shard);
          ASSERT_EQ(r.begin + loc.offset, g) << "d=" << d << " S=" << S << " B=" << B;
          ASSERT_LT(loc.offset, r.size());
        }
      }
    }
  }
}

TEST(ShardMapTest, ExactRangesOfAHandComputedMap) {
  // d = 100, B = 32: blocks [0,32) [32,64) [64,96) [96,100) -> 4 blocks.
  // S = 3: 4 = 2 + 1 + 1 blocks; element counts are whatever those blocks hold.
  auto m = ShardMap::Create(100, 3, 32);
  ASSERT_TRUE(m.ok()) << m.status();
  CheckPartition(*m, 100, 3, 32);
  uint64_t blocks[3];
  for (uint32_t k = 0; k < 3; ++k) blocks[k] = CeilDiv(m->shard(k).size(), 32);
  std::sort(blocks, blocks + 3);
  EXPECT_EQ(blocks[0], 1u);
  EXPECT_EQ(blocks[1], 1u);
  EXPECT_EQ(blocks[2], 2u);
  // The short block is the end of the last shard.
  EXPECT_EQ(m->shard(2).end, 100u);

  // Exactly divisible: d = 4096, S = 4, B = 256 -> 1024 each.
  auto even = ShardMap::Create(4096, 4, 256);
  ASSERT_TRUE(even.ok()) << even.status();
  for (uint32_t k = 0; k < 4; ++k) {
    EXPECT_EQ(even->shard(k), (Range{1024u * k, 1024u * (k + 1)})) << k;
  }
}

TEST(ShardMapTest, MoreShardsThanBlocks) {
  // 3 blocks (2048, 2048, 1), 10 shards -> shards 0..2 one block, 3..9 empty at d.
  const uint64_t d = 2 * 2048 + 1;
  auto m = ShardMap::Create(d, 10, 2048);
  ASSERT_TRUE(m.ok()) << m.status();
  CheckPartition(*m, d, 10, 2048);
  EXPECT_EQ(m->shard(0), (Range{0, 2048}));
  EXPECT_EQ(m->shard(1), (Range{2048, 4096}));
  EXPECT_EQ(m->shard(2), (Range{4096, d}));
  for (uint32_t k = 3; k < 10; ++k) {
    EXPECT_EQ(m->shard(k).size(), 0u) << k;
  }
  EXPECT_EQ(m->Locate(d - 1).shard, 2u);
  EXPECT_EQ(m->Locate(d - 1).offset, 0u);

  // d < B: one short block in shard 0, the rest empty.
  auto small = ShardMap::Create(7, 5, 2048);
  ASSERT_TRUE(small.ok()) << small.status();
  CheckPartition(*small, 7, 5, 2048);
  EXPECT_EQ(small->shard(0), (Range{0, 7}));

  // d = 0: every shard empty.
  auto zero = ShardMap::Create(0, 3, 32);
  ASSERT_TRUE(zero.ok()) << zero.status();
  for (uint32_t k = 0; k < 3; ++k) EXPECT_EQ(zero->shard(k).size(), 0u);
}

TEST(ShardMapTest, LargeMapsSampledLocate) {
  std::mt19937_64 rng(12345);
  const std::vector<std::tuple<uint64_t, uint32_t, uint32_t>> cases = {
      {1000003, 7, 2048},
      {uint64_t{1} << 32, 3, 2048},
      {(uint64_t{1} << 40) + 17, 1000, 1 << 24},
      {(uint64_t{1} << 40) + 17, 13, 32},
      {123456789012, 65535, 4096},
      {5000000000, 4096, 1},
      {uint64_t{1} << 50, 4294967295u, 2048},  // 2^39 blocks over 2^32 - 1 shards
      {1000, 4294967295u, 32},                 // far more shards than blocks
  };
  for (const auto& [d, S, B] : cases) {
    auto m = ShardMap::Create(d, S, B);
    ASSERT_TRUE(m.ok()) << m.status();
    // Walking every shard is cheap unless S is huge; sample shards then.
    if (S <= 100000) {
      CheckPartition(*m, d, S, B);
    } else {
      const uint64_t num_blocks = CeilDiv(d, B);
      EXPECT_EQ(m->shard(0).begin, 0u);
      EXPECT_EQ(m->shard(S - 1).end, d);
      std::uniform_int_distribution<uint32_t> pick(0, S - 2);
      for (int i = 0; i < 2000; ++i) {
        const uint32_t k = pick(rng);
        const Range a = m->shard(k), b = m->shard(k + 1);
        EXPECT_EQ(a.end, b.begin) << k;
        EXPECT_TRUE(a.begin % B == 0 || a.begin == d);
        const uint64_t blocks = CeilDiv(a.size(), B);
        EXPECT_TRUE(blocks == num_blocks / S || blocks == CeilDiv(num_blocks, S)) << k;
      }
    }
    // Sampled elements: shard boundaries and their neighbours, plus random ones.
    std::vector<uint64_t> samples = {0, d - 1, d / 2};
    for (uint32_t k = 0; k < std::min<uint32_t>(S, 2000); ++k) {
      const Range r = m->shard(k);
      if (r.size() == 0) continue;
      samples.push_back(r.begin);
      samples.push_back(r.end - 1);
      if (r.begin > 0) samples.push_back(r.begin - 1);
    }
    std::uniform_int_distribution<uint64_t> any(0, d - 1);
    for (int i = 0; i < 5000; ++i) samples.push_back(any(rng));
    for (uint64_t g : samples) CheckLocate(*m, g);
  }
}

TEST(ShardMapTest, SerializeFormatAndRoundTrip) {
  auto m = ShardMap::Create(1000, 3, 32);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->Serialize(), "shardmap/1 params=1000 shards=3 block=32");

  const std::vector<std::tuple<uint64_t, uint32_t, uint32_t>> cases = {
      {0, 1, 1},
      {1, 1, 1},
      {7, 5, 2048},
      {1000003, 7, 2048},
      {1u << 20, 8, 32},
      {12345678901234, 4294967295u, 4294967295u},
      {18446744073709551615u, 2, 32},
  };
  for (const auto& [d, S, B] : cases) {
    auto a = ShardMap::Create(d, S, B);
    ASSERT_TRUE(a.ok()) << a.status();
    const std::string text = a->Serialize();
    auto b = ShardMap::Deserialize(text);
    ASSERT_TRUE(b.ok()) << b.status() << " for " << text;
    EXPECT_EQ(*a, *b) << text;
    EXPECT_EQ(b->num_params(), d);
    EXPECT_EQ(b->num_shards(), S);
    EXPECT_EQ(b->block_size(), B);
    EXPECT_EQ(b->Serialize(), text);
    for (uint32_t k = 0; k < std::min<uint32_t>(S, 100); ++k) {
      EXPECT_EQ(a->shard(k), b->shard(k));
    }
  }
}

TEST(ShardMapTest, DeserializeRejectsGarbage) {
  const std::vector<std::string> bad = {
      "",
      "garbage",
      "shardmap/1",
      "shardmap/2 params=10 shards=1 block=1",
      "params=10 shards=1 block=1",
      "shardmap/1 params=10 shards=1",
      "shardmap/1 params=10 block=1",
      "shardmap/1 shards=1 block=1",
      "shardmap/1 params=abc shards=1 block=1",
      "shardmap/1 params=-5 shards=1 block=1",
      "shardmap/1 params=10 shards=0 block=1",
      "shardmap/1 params=10 shards=1 block=0",
      "shardmap/1 params=10 shards=1 block=1garbage",
      "shardmap/1 params=10 shards=4294967296 block=1",
      "shardmap/1 params=10 shards=1 block=4294967296",
      "shardmap/1 params=99999999999999999999999 shards=1 block=1",
      "shardmap/1 params= shards=1 block=1",
  };
  for (const std::string& text : bad) {
    auto m = ShardMap::Deserialize(text);
    EXPECT_FALSE(m.ok()) << "accepted '" << text << "' as " << m->Serialize();
    if (!m.ok()) {
      EXPECT_FALSE(m.status().message().empty()) << "'" << text << "'";
    }
  }
}

TEST(ShardMapTest, CreateRejectsZeroShardsAndZeroBlock) {
  auto no_shards = ShardMap::Create(100, 0, 32);
  ASSERT_FALSE(no_shards.ok());
  EXPECT_THAT(Lower(std::string(no_shards.status().message())), HasSubstr("shard"));

  auto no_block = ShardMap::Create(100, 4, 0);
  ASSERT_FALSE(no_block.ok());
  EXPECT_THAT(Lower(std::string(no_block.status().message())), HasSubstr("block"));

  EXPECT_FALSE(ShardMap::Create(0, 0, 0).ok());
}

// The smallest largest shard over every way to cut `sizes` into at most S
// contiguous runs, by trying them all (small inputs only).
uint64_t BestLargestShard(const std::vector<uint64_t>& sizes, size_t from, uint32_t S) {
  if (from == sizes.size()) return 0;
  if (S == 0) return UINT64_MAX;
  uint64_t best = UINT64_MAX, run = 0;
  for (size_t to = from; to < sizes.size(); ++to) {
    run += sizes[to];
    best = std::min(best, std::max(run, BestLargestShard(sizes, to + 1, S - 1)));
  }
  return best;
}

void CheckAligned(const ShardMap& m, const std::vector<uint64_t>& ends, uint32_t S) {
  const uint64_t d = ends.back();
  SCOPED_TRACE(m.Serialize());
  ASSERT_TRUE(m.aligned());
  uint64_t next = 0, largest = 0;
  bool seen_empty = false;
  for (uint32_t k = 0; k < S; ++k) {
    const Range r = m.shard(k);
    ASSERT_EQ(r.begin, next) << "shard " << k;
    ASSERT_LE(r.begin, r.end);
    // Both ends are layer ends (or 0): no layer is cut.
    if (r.size() > 0) {
      EXPECT_TRUE(r.begin == 0 || std::count(ends.begin(), ends.end(), r.begin) == 1) << k;
      EXPECT_EQ(std::count(ends.begin(), ends.end(), r.end), 1) << k;
      EXPECT_FALSE(seen_empty) << "a non-empty shard follows an empty one";
    } else {
      seen_empty = true;
    }
    largest = std::max(largest, r.size());
    next = r.end;
  }
  EXPECT_EQ(next, d);
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < ends.size(); ++i) sizes.push_back(ends[i] - (i ? ends[i - 1] : 0));
  if (sizes.size() <= 9) {
    EXPECT_EQ(largest, BestLargestShard(sizes, 0, S));
  }
  for (uint64_t g = 0; g < d; g += 1 + d / 500) CheckLocate(m, g);
  CheckLocate(m, d - 1);
}

TEST(ShardMapTest, AlignedMapsHoldWholeLayersAndAreAsEvenAsThatAllows) {
  // The mlp 784-256-128-10 (W0 b0 W1 b1 W2 b2): W0 alone is most of it.
  const std::vector<uint64_t> mlp = {200704, 200960, 233728, 233856, 235136, 235146};
  auto two = ShardMap::CreateAligned(235146, 2, 2048, mlp);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->shard(0), (Range{0, 200704}));
  EXPECT_EQ(two->shard(1), (Range{200704, 235146}));
  CheckAligned(*two, mlp, 2);
  auto four = ShardMap::CreateAligned(235146, 4, 2048, mlp);
  ASSERT_TRUE(four.ok()) << four.status();
  CheckAligned(*four, mlp, 4);
  EXPECT_EQ(four->shard(3).size(), 0u);
  // Ten layers of 10 on 3 shards: runs of at most 40.
  std::vector<uint64_t> tens;
  for (uint64_t e = 10; e <= 100; e += 10) tens.push_back(e);
  auto three = ShardMap::CreateAligned(100, 3, 32, tens);
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ(three->shard(0), (Range{0, 40}));
  EXPECT_EQ(three->shard(1), (Range{40, 80}));
  EXPECT_EQ(three->shard(2), (Range{80, 100}));

  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<uint64_t> ends;
    uint64_t at = 0;
    const int layers = 1 + static_cast<int>(rng() % 9);
    for (int i = 0; i < layers; ++i) ends.push_back(at += 1 + rng() % (rng() % 2 ? 5 : 300));
    const uint32_t S = 1 + static_cast<uint32_t>(rng() % 6);
    auto m = ShardMap::CreateAligned(at, S, 32, ends);
    ASSERT_TRUE(m.ok()) << m.status();
    CheckAligned(*m, ends, S);
  }
}

TEST(ShardMapTest, AlignedMapsSerializeTheirEndsAndRefuseBadLayers) {
  auto m = ShardMap::CreateAligned(100, 3, 32, {10, 20, 30, 40, 50, 60, 70, 80, 90, 100});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->Serialize(), "shardmap/2 params=100 shards=3 block=32 ends=40,80,100");
  auto back = ShardMap::Deserialize(m->Serialize());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, *m);
  EXPECT_EQ(back->shard(1), (Range{40, 80}));
  EXPECT_FALSE(*back == *ShardMap::Create(100, 3, 32));
  for (const char* text : {"shardmap/2 params=100 shards=3 block=32 ends=40,80",
                           "shardmap/2 params=100 shards=3 block=32 ends=80,40,100",
                           "shardmap/2 params=100 shards=3 block=32 ends=40,80,99",
                           "shardmap/2 params=100 shards=3 block=32 ends=40,x,100",
                           "shardmap/2 params=100 shards=3 block=32 40,80,100"}) {
    EXPECT_FALSE(ShardMap::Deserialize(text).ok()) << text;
  }
  auto short_layers = ShardMap::CreateAligned(100, 2, 32, {10, 90});
  ASSERT_FALSE(short_layers.ok());
  EXPECT_THAT(std::string(short_layers.status().message()), HasSubstr("must end at d = 100"));
  auto unsorted = ShardMap::CreateAligned(100, 2, 32, {50, 50, 100});
  ASSERT_FALSE(unsorted.ok());
  EXPECT_THAT(std::string(unsorted.status().message()), HasSubstr("strictly increasing"));
}

}  // namespace
}  // namespace onebit
