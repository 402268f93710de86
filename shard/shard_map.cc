#include "shard/shard_map.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace onebit {

absl::StatusOr<ShardMap> ShardMap::Create(uint64_t num_params, uint32_t num_shards,
                                          uint32_t block_size) {
  if (num_shards == 0) return absl::InvalidArgumentError("ShardMap: num_shards must be >= 1");
  if (block_size == 0) return absl::InvalidArgumentError("ShardMap: block_size must be >= 1");
  return ShardMap(num_params, num_shards, block_size);
}

ShardMap::ShardMap(uint64_t num_params, uint32_t num_shards, uint32_t block_size)
    : num_params_(num_params),
      num_shards_(num_shards),
      block_size_(block_size),
      num_blocks_((num_params + block_size - 1) / block_size),
      blocks_per_shard_(num_blocks_ / num_shards),
      extra_(num_blocks_ % num_shards) {}

uint64_t ShardMap::FirstBlock(uint32_t k) const {
  return k * blocks_per_shard_ + std::min<uint64_t>(k, extra_);
}

Range ShardMap::shard(uint32_t k) const {
  if (k >= num_shards_) {
    std::fprintf(stderr, "ShardMap::shard(%u) with %u shards\n", k, num_shards_);
    std::abort();
  }
  Range r;
  r.begin = std::min(FirstBlock(k) * block_size_, num_params_);
  r.end = std::min(FirstBlock(k + 1) * block_size_, num_params_);
  return r;
}

ShardMap::Location ShardMap::Locate(uint64_t global) const {
  if (global >= num_params_) {
    std::fprintf(stderr, "ShardMap::Locate(%llu) with %llu params\n",
                 static_cast<unsigned long long>(global),
                 static_cast<unsigned long long>(num_params_));
    std::abort();
  }
  const uint64_t block = global / block_size_;
  const uint64_t big = extra_ * (blocks_per_shard_ + 1);  // blocks in the larger shards
  uint32_t k;
  if (block < big) {
    k = static_cast<uint32_t>(block / (blocks_per_shard_ + 1));
  } else {
    k = static_cast<uint32_t>(extra_ + (block - big) / blocks_per_shard_);
  }
  return Location{k, global - shard(k).begin};
}

std::string ShardMap::Serialize() const {
  return absl::StrCat("shardmap/1 params=", num_params_, " shards=", num_shards_,
                      " block=", block_size_);
}

absl::StatusOr<ShardMap> ShardMap::Deserialize(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ' ');
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("bad shard map \"", text, "\": ", why));
  };
  if (parts.size() != 4 || parts[0] != "shardmap/1") {
    return bad("expected \"shardmap/1 params=D shards=S block=B\"");
  }
  uint64_t d = 0;
  uint32_t s = 0, b = 0;
  auto field = [&](absl::string_view part, absl::string_view key, auto* value) {
    return absl::ConsumePrefix(&part, key) && absl::SimpleAtoi(part, value);
  };
  if (!field(parts[1], "params=", &d)) return bad("params");
  if (!field(parts[2], "shards=", &s)) return bad("shards");
  if (!field(parts[3], "block=", &b)) return bad("block");
  return Create(d, s, b);
}

}  // namespace onebit
