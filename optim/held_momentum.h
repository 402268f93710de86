// A worker's synchronized momentum m̄ held as the server's replies it came
// in, chunk by chunk, instead of as d floats. With momentum replies
// (onebit-adam and its family) m̄ = D(reply) exactly, and the next push
// reads it once: keeping the reply (1/32 of m̄'s bytes for 1-bit) saves
// writing m̄ at the reply and reading it back at the push, two of a
// compressed step's nine passes over memory (docs/design.md §2.2). The
// floats are the same as the dense m̄'s: the push decodes them piece by
// piece, bit for bit as the reply's decode would have written them.
//
// Host memory: a CPU replica's. Not thread-safe (the replica's thread).
#ifndef ONEBIT_OPTIM_HELD_MOMENTUM_H_
#define ONEBIT_OPTIM_HELD_MOMENTUM_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "compress/codec.h"

namespace onebit {

class HeldMomentum {
 public:
  struct Range {
    size_t n = 0;
    const Codec* codec = nullptr;  // the reply's; outlives this
    std::vector<uint8_t> payload;  // codec.EncodedSize(n) bytes, checked
  };

  // From now on m̄[b, b + n) = codec.D(payload), a payload Decode accepts
  // (copied); whatever was held for ranges overlapping it is dropped.
  void Hold(const Codec& codec, uint64_t b, size_t n, const uint8_t* payload);
  // What is held for exactly [b, b + n), or nullptr.
  const Range* Find(uint64_t b, size_t n) const;
  // Decodes every held range into mbar (d floats: the dense m̄) and holds
  // nothing; the dense m̄ is then whole again.
  void Release(float* mbar);
  // Holds nothing, writing nothing (the dense m̄ was replaced).
  void Clear() { held_.clear(); }
  bool empty() const { return held_.empty(); }

 private:
  std::map<uint64_t, Range> held_;  // by begin; ranges disjoint
};

}  // namespace onebit

#endif  // ONEBIT_OPTIM_HELD_MOMENTUM_H_
