// ShardMap: how the flat parameter vector x[0, d) is cut into S contiguous
// shards, one per server shard (docs/design.md §1). Shard boundaries fall on codec
// block boundaries, so every shard (and every block-aligned chunk of one)
// encodes independently of its neighbours; shard sizes differ by at most one
// block. With more shards than blocks the trailing shards are empty.
//
// A map may instead be aligned to layers (CreateAligned): every shard then
// holds whole layers, for optimizers whose update needs a layer's norms in
// one place (onebit-lamb). Its shards start wherever a layer starts, and
// their codec blocks count from there.
//
// A ShardMap is a small immutable value; it is fully determined by
// (num_params, num_shards, block_size) and, when aligned, the shards' ends,
// which is what Serialize() writes.
#ifndef ONEBIT_SHARD_SHARD_MAP_H_
#define ONEBIT_SHARD_SHARD_MAP_H_

#include <cstdint>
#include <string>
#include <vector>

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
  // Shards of whole layers: layer_ends are the layers' ends, strictly
  // increasing, the last one num_params. The shards are contiguous runs of
  // layers whose largest is as small as it can be; with fewer layers than
  // shards (or one dominant layer) trailing shards are empty. A layer is
  // never split, so one layer larger than d / S makes its shard the largest.
  static absl::StatusOr<ShardMap> CreateAligned(uint64_t num_params, uint32_t num_shards,
                                                uint32_t block_size,
                                                const std::vector<uint64_t>& layer_ends);

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

  // Whether the shards were cut at layer ends (CreateAligned).
  bool aligned() const { return !ends_.empty(); }

  // Text form for configs and logs: "shardmap/1 params=D shards=S block=B",
  // or for an aligned map "shardmap/2 params=D shards=S block=B
  // ends=E1,...,ES".
  std::string Serialize() const;
  static absl::StatusOr<ShardMap> Deserialize(absl::string_view text);

  bool operator==(const ShardMap& o) const {
    return num_params_ == o.num_params_ && num_shards_ == o.num_shards_ &&
           block_size_ == o.block_size_ && ends_ == o.ends_;
  }

 private:
  ShardMap(uint64_t num_params, uint32_t num_shards, uint32_t block_size);
  uint64_t FirstBlock(uint32_t k) const;

  uint64_t num_params_;
  uint32_t num_shards_;
  uint32_t block_size_;
  uint64_t num_blocks_;
  uint64_t blocks_per_shard_;   // floor(num_blocks / num_shards)
  uint64_t extra_;              // the first `extra_` shards hold one more block
  std::vector<uint64_t> ends_;  // aligned maps: shard k is [ends_[k-1], ends_[k])
};

}  // namespace onebit

#endif  // ONEBIT_SHARD_SHARD_MAP_H_
