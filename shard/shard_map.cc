#include "shard/shard_map.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

absl::StatusOr<ShardMap> ShardMap::CreateAligned(uint64_t num_params, uint32_t num_shards,
                                                 uint32_t block_size,
                                                 const std::vector<uint64_t>& layer_ends) {
  auto map = Create(num_params, num_shards, block_size);
  if (!map.ok()) return map.status();
  if (layer_ends.empty() || layer_ends.back() != num_params) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ShardMap: the layers must end at d = ", num_params, " (the last of ", layer_ends.size(),
        " layer ends is ", layer_ends.empty() ? 0 : layer_ends.back(), ")"));
  }
  for (size_t i = 0; i < layer_ends.size(); ++i) {
    if (layer_ends[i] == 0 || (i > 0 && layer_ends[i] <= layer_ends[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("ShardMap: layer ends must be strictly increasing and > 0; end ", i, " is ",
                       layer_ends[i]));
    }
  }
  // The fewest shards whose runs of layers each hold at most `cap` elements
  // (greedily: a shard takes layers while they fit).
  auto shards_for = [&](uint64_t cap) {
    uint64_t shards = 1, begin = 0, prev = 0;
    for (uint64_t end : layer_ends) {
      if (end - prev > cap) return std::numeric_limits<uint64_t>::max();
      if (end - begin > cap) {
        ++shards;
        begin = prev;
      }
      prev = end;
    }
    return shards;
  };
  // The smallest cap that S shards can meet, by bisection.
  uint64_t lo = 1, hi = std::max<uint64_t>(num_params, 1);
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (shards_for(mid) <= num_shards) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  std::vector<uint64_t> ends;
  uint64_t begin = 0, prev = 0;
  for (uint64_t end : layer_ends) {
    if (end - begin > lo) {
      ends.push_back(prev);
      begin = prev;
    }
    prev = end;
  }
  ends.push_back(num_params);
  while (ends.size() < num_shards) ends.push_back(num_params);
  map->ends_ = std::move(ends);
  return map;
}

uint64_t ShardMap::FirstBlock(uint32_t k) const {
  return k * blocks_per_shard_ + std::min<uint64_t>(k, extra_);
}

Range ShardMap::shard(uint32_t k) const {
  if (k >= num_shards_) {
    std::fprintf(stderr, "ShardMap::shard(%u) with %u shards\n", k, num_shards_);
    std::abort();
  }
  Range r;
  if (aligned()) {
    r.begin = k == 0 ? 0 : ends_[k - 1];
    r.end = ends_[k];
    return r;
  }
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
  if (aligned()) {
    // The first shard that ends after `global` (empty shards end where
    // their predecessor does, so they are skipped).
    const auto it = std::upper_bound(ends_.begin(), ends_.end(), global);
    const uint32_t k = static_cast<uint32_t>(it - ends_.begin());
    return Location{k, global - shard(k).begin};
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
  if (aligned()) {
    return absl::StrCat("shardmap/2 params=", num_params_, " shards=", num_shards_,
                        " block=", block_size_, " ends=", absl::StrJoin(ends_, ","));
  }
  return absl::StrCat("shardmap/1 params=", num_params_, " shards=", num_shards_,
                      " block=", block_size_);
}

absl::StatusOr<ShardMap> ShardMap::Deserialize(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ' ');
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("bad shard map \"", text, "\": ", why));
  };
  const bool v2 = parts.size() == 5 && parts[0] == "shardmap/2";
  if (!v2 && (parts.size() != 4 || parts[0] != "shardmap/1")) {
    return bad(
        "expected \"shardmap/1 params=D shards=S block=B\" or \"shardmap/2 params=D shards=S "
        "block=B ends=E1,...,ES\"");
  }
  uint64_t d = 0;
  uint32_t s = 0, b = 0;
  auto field = [&](absl::string_view part, absl::string_view key, auto* value) {
    return absl::ConsumePrefix(&part, key) && absl::SimpleAtoi(part, value);
  };
  if (!field(parts[1], "params=", &d)) return bad("params");
  if (!field(parts[2], "shards=", &s)) return bad("shards");
  if (!field(parts[3], "block=", &b)) return bad("block");
  if (!v2) return Create(d, s, b);
  absl::string_view list = parts[4];
  if (!absl::ConsumePrefix(&list, "ends=")) return bad("ends");
  std::vector<uint64_t> ends;
  for (absl::string_view e : absl::StrSplit(list, ',')) {
    uint64_t v = 0;
    if (!absl::SimpleAtoi(e, &v)) return bad("ends");
    ends.push_back(v);
  }
  // Non-decreasing, S of them, the last d: what CreateAligned makes.
  if (s == 0 || ends.size() != s || ends.back() != d || !std::is_sorted(ends.begin(), ends.end())) {
    return bad("ends: want S non-decreasing ends, the last one d");
  }
  auto map = Create(d, s, b);
  if (!map.ok()) return map.status();
  map->ends_ = std::move(ends);
  return map;
}

}  // namespace onebit
