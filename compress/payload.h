// Internal to compress/: a view of received bytes as an array of T. Network
// frames are usually suitably aligned; small ones (kept inline by ZeroMQ) may
// not be, and are then copied once rather than read misaligned.
#ifndef ONEBIT_COMPRESS_PAYLOAD_H_
#define ONEBIT_COMPRESS_PAYLOAD_H_

#include <cstdint>
#include <cstring>
#include <vector>

namespace onebit::compress_internal {

template <typename T>
class AlignedPayload {
 public:
  AlignedPayload(const uint8_t* bytes, size_t count) {
    if (reinterpret_cast<uintptr_t>(bytes) % alignof(T) == 0) {
      data_ = reinterpret_cast<const T*>(bytes);
    } else {
      copy_.resize(count);
      if (count) std::memcpy(copy_.data(), bytes, count * sizeof(T));
      data_ = copy_.data();
    }
  }
  const T* data() const { return data_; }

 private:
  const T* data_;
  std::vector<T> copy_;
};

}  // namespace onebit::compress_internal

#endif  // ONEBIT_COMPRESS_PAYLOAD_H_
