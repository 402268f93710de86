#include "optim/held_momentum.h"

#include <iterator>

namespace onebit {

void HeldMomentum::Hold(const Codec& codec, uint64_t b, size_t n, const uint8_t* payload) {
  const size_t bytes = codec.EncodedSize(n);
  if (auto same = held_.find(b); same != held_.end() && same->second.n == n) {
    // The same chunk as the last step's: its buffer again (no allocation).
    same->second.codec = &codec;
    same->second.payload.assign(payload, payload + bytes);
    return;
  }
  // Drop the ranges that overlap [b, b + n): the first one starting before
  // b that reaches into it, and those starting within it.
  auto it = held_.lower_bound(b);
  if (it != held_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second.n > b) it = prev;
  }
  while (it != held_.end() && it->first < b + n) it = held_.erase(it);
  Range& r = held_[b];
  r.n = n;
  r.codec = &codec;
  r.payload.assign(payload, payload + bytes);
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
