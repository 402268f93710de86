// ShardMap: how the flat parameter vector x[0, d) is cut into S contiguous
// shards, one per server shard (docs/design.md §1). Shard boundaries fall on codec
// block boundaries, so every shard (and every block-aligned chunk of one)
// encodes independently of its neighbours; shard sizes differ by at most one
// block. With more shards than blocks the trailing shards are empty.
//
// A ShardMap is a small immutable value; it is fully determined by
// (num_params, num_shards, block_size), which is what Serialize() writes.
#ifndef ONEBIT_SHARD_SHARD_MAP_H_
#define ONEBIT_SHARD_SHARD_MAP_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace onebit {

struct Range {
  uint64_t begin = 0;
  uint64_t end = 0;  // exclusive
  uint64_t size() const { return end - begin; }
  bool operator==(const Range& o) const { return begin == o.begin && end == o.end; }
};

class ShardMap {
 public:
  // Requires num_shards >= 1 and block_size >= 1; num_params may be 0.
  static absl::StatusOr<ShardMap> Create(uint64_t num_params, uint32_t num_shards,
                                         uint32_t block_size);

  uint64_t num_params() const { return num_params_; }
  uint32_t num_shards() const { return num_shards_; }
  uint32_t block_size() const { return block_size_; }

  // The elements of shard k; requires k < num_shards().
  Range shard(uint32_t k) const;

  struct Location {
    uint32_t shard;
    uint64_t offset;  // within the shard
  };
  // Requires global < num_params().
  Location Locate(uint64_t global) const;

  // Text form for configs and logs: "shardmap/1 params=D shards=S block=B".
  std::string Serialize() const;
  static absl::StatusOr<ShardMap> Deserialize(absl::string_view text);

  bool operator==(const ShardMap& o) const {
    return num_params_ == o.num_params_ && num_shards_ == o.num_shards_ &&
           block_size_ == o.block_size_;
  }

 private:
  ShardMap(uint64_t num_params, uint32_t num_shards, uint32_t block_size);
  uint64_t FirstBlock(uint32_t k) const;

  uint64_t num_params_;
  uint32_t num_shards_;
  uint32_t block_size_;
  uint64_t num_blocks_;
  uint64_t blocks_per_shard_;  // floor(num_blocks / num_shards)
  uint64_t extra_;             // the first `extra_` shards hold one more block
};

}  // namespace onebit

#endif  // ONEBIT_SHARD_SHARD_MAP_H_
