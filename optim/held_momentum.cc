#include "optim/held_momentum.h"

#include <iterator>

namespace onebit {

void HeldMomentum::Hold(const Codec& codec, uint64_t b, size_t n, const uint8_t* payload) {
  auto it = held_.find(b);
  // The same chunk as the last step's keeps its buffer (no allocation).
  if (it == held_.end() || it->second.n != n) {
    // Drop the ranges that overlap [b, b + n): the first one starting
    // before b that reaches into it, and those starting within it.
    it = held_.lower_bound(b);
    if (it != held_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second.n > b) it = prev;
    }
    while (it != held_.end() && it->first < b + n) it = held_.erase(it);
    it = held_.emplace(b, Range{n, nullptr, {}}).first;
  }
  it->second.codec = &codec;
  it->second.payload.assign(payload, payload + codec.EncodedSize(n));
}

const HeldMomentum::Range* HeldMomentum::Find(uint64_t b, size_t n) const {
  auto it = held_.find(b);
  return it == held_.end() || it->second.n != n ? nullptr : &it->second;
}

void HeldMomentum::Release(float* mbar) {
  for (const auto& [b, r] : held_) r.codec->DecodeRange(r.payload.data(), r.n, 0, r.n, mbar + b);
  held_.clear();
}

}  // namespace onebit
