// The layout of a fuzz input, shared by the targets (which read it) and the
// seed generator (which writes it): single bytes that pick a variant, and
// length-prefixed byte strings (a little-endian uint16 length, then the
// bytes). A short input reads as zeros and empty strings, never as an error,
// so that every input runs the code under test.
#ifndef ONEBIT_FUZZ_FUZZ_INPUT_H_
#define ONEBIT_FUZZ_FUZZ_INPUT_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

namespace onebit::fuzz {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : p_(data), left_(size) {}

  bool empty() const { return left_ == 0; }

  uint8_t Byte() { return left_ == 0 ? 0 : (--left_, *p_++); }

  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{Byte()} << (8 * i);
    return v;
  }

  // A length-prefixed string (shorter when the input ends first).
  std::string Bytes() {
    size_t n = Byte();
    n |= size_t{Byte()} << 8;
    return Take(n);
  }

  // Everything not read yet.
  std::string Rest() { return Take(left_); }

 private:
  std::string Take(size_t n) {
    n = std::min(n, left_);
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    left_ -= n;
    return s;
  }

  const uint8_t* p_;
  size_t left_;
};

// The writer of the same layout, for seeds.
class Output {
 public:
  Output& Byte(uint8_t b) {
    data_.push_back(static_cast<char>(b));
    return *this;
  }
  Output& U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) Byte(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  // Requires s.size() < 65536.
  Output& Bytes(const std::string& s) {
    Byte(static_cast<uint8_t>(s.size()));
    Byte(static_cast<uint8_t>(s.size() >> 8));
    return Rest(s);
  }
  Output& Rest(const std::string& s) {
    data_ += s;
    return *this;
  }
  const std::string& data() const { return data_; }

 private:
  std::string data_;
};

}  // namespace onebit::fuzz

#endif  // ONEBIT_FUZZ_FUZZ_INPUT_H_
