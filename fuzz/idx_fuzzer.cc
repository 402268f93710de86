// The IDX reader (models/idx_reader.h) on a file of fuzzed bytes: ReadIdxImages
// or ReadIdxLabels, with and without max_count. Accepted data must be what
// the file holds: the header's dimensions, the bytes after it, every label
// below num_classes. The file lives in memory (memfd), read by its
// /proc/self/fd path.
//
// Input: a byte of flags (bit 0: the rest is the IDX content, which the
// target gzips, else the file's raw bytes; bit 1: labels, else images;
// bits 2-3: max_count, kMaxCounts; bits 4-5: num_classes, kClasses), then
// the rest.
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "fuzz/fuzz_target.h"
#include "models/idx_reader.h"

namespace onebit {
namespace {

constexpr uint32_t kMaxCounts[] = {0, 1, 3, 60000};
constexpr uint32_t kClasses[] = {10, 1, 255, 256};

std::string Gzip(const std::string& content) {
  z_stream z{};
  FUZZ_CHECK(deflateInit2(&z, 1, Z_DEFLATED, 16 + 15, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  std::string out(deflateBound(&z, content.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(content.data()));
  z.avail_in = static_cast<uInt>(content.size());
  z.next_out = reinterpret_cast<Bytef*>(&out[0]);
  z.avail_out = static_cast<uInt>(out.size());
  FUZZ_CHECK(deflate(&z, Z_FINISH) == Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// One in-memory file for the whole run, rewritten for each input.
const std::string& WriteFile(const std::string& bytes) {
  static const int fd = memfd_create("idx", 0);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  FUZZ_CHECK(fd >= 0);
  FUZZ_CHECK(ftruncate(fd, 0) == 0);
  FUZZ_CHECK(pwrite(fd, bytes.data(), bytes.size(), 0) == static_cast<ssize_t>(bytes.size()));
  return path;
}

uint32_t BigEndian32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(s[at + i]);
  return v;
}

std::string BigEndian(std::vector<uint32_t> words) {
  std::string s;
  for (uint32_t w : words) {
    for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>(w >> (8 * i)));
  }
  return s;
}

}  // namespace

std::vector<fuzz::Seed> Seeds() {
  auto seed = [](uint8_t flags, const std::string& rest) {
    return fuzz::Output().Byte(flags).Rest(rest).data();
  };
  std::string pixels;
  for (int i = 0; i < 2 * 3 * 4; ++i) pixels.push_back(static_cast<char>(i * 11));
  const std::string images = BigEndian({kIdxImagesMagic, 2, 3, 4}) + pixels;
  const std::string labels =
      BigEndian({kIdxLabelsMagic, 5}) + std::string("\x00\x09\x03\x01\x07", 5);
  return {
      {"images", seed(1, images)},
      {"images-max1", seed(1 | 4, images)},
      {"images-extra-byte", seed(1, images + "x")},
      {"images-truncated", seed(1, images.substr(0, images.size() - 1))},
      {"images-empty-rows", seed(1, BigEndian({kIdxImagesMagic, 2, 0, 4}))},
      {"images-zero-count", seed(1, BigEndian({kIdxImagesMagic, 0, 28, 28}))},
      {"images-4gib", seed(1, BigEndian({kIdxImagesMagic, 65536, 256, 256}))},
      {"images-over-4gib", seed(1, BigEndian({kIdxImagesMagic, 65537, 256, 256}))},
      {"images-wrong-magic", seed(1, BigEndian({kIdxLabelsMagic, 2, 3, 4}) + pixels)},
      {"images-header-cut", seed(1, BigEndian({kIdxImagesMagic, 2}))},
      {"images-raw-gzip", seed(0, Gzip(images))},
      {"images-not-gzip", seed(0, images)},
      {"images-gzip-cut", seed(0, Gzip(images).substr(0, 30))},
      {"images-gzip-crc", seed(0, Gzip(images).substr(0, Gzip(images).size() - 5) + "xxxxx")},
      {"labels", seed(1 | 2, labels)},
      {"labels-max3", seed(1 | 2 | 8, labels)},
      {"labels-one-class", seed(1 | 2 | 16, labels)},
      {"labels-256", seed(1 | 2 | 48, BigEndian({kIdxLabelsMagic, 2}) + "\xff\x80")},
      {"labels-count-max", seed(1 | 2, BigEndian({kIdxLabelsMagic, 0xffffffff}))},
      {"labels-raw-gzip", seed(2, Gzip(labels))},
      {"empty", seed(0, "")},
  };
}

}  // namespace onebit

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  return onebit::fuzz::Initialize(argc, argv, onebit::Seeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace onebit;
  fuzz::Input in(data, size);
  const uint8_t flags = in.Byte();
  const bool content_known = flags & 1;
  const std::string content = in.Rest();
  const std::string& path = WriteFile(content_known ? Gzip(content) : content);
  const uint32_t max_count = kMaxCounts[(flags >> 2) & 3];
  if (flags & 2) {
    const uint32_t classes = kClasses[(flags >> 4) & 3];
    auto labels = ReadIdxLabels(path, classes, max_count);
    if (!labels.ok()) return 0;
    for (uint8_t l : *labels) FUZZ_CHECK(l < classes);
    if (content_known) {
      FUZZ_CHECK(content.size() >= 8 + labels->size() &&
                 BigEndian32(content, 0) == kIdxLabelsMagic);
      const uint32_t count = BigEndian32(content, 4);
      FUZZ_CHECK(labels->size() == (max_count > 0 ? std::min(max_count, count) : count));
      FUZZ_CHECK(labels->empty() || std::memcmp(labels->data(), &content[8], labels->size()) == 0);
      if (max_count == 0) FUZZ_CHECK(content.size() == 8 + labels->size());
    }
    return 0;
  }
  auto images = ReadIdxImages(path, max_count);
  if (!images.ok()) return 0;
  FUZZ_CHECK(images->rows > 0 && images->cols > 0);
  // In 128 bits: the size must not have wrapped.
  FUZZ_CHECK(images->pixels.size() ==
             static_cast<unsigned __int128>(images->count) * images->rows * images->cols);
  if (content_known) {
    FUZZ_CHECK(content.size() >= 16 + images->pixels.size());
    FUZZ_CHECK(BigEndian32(content, 0) == kIdxImagesMagic);
    const uint32_t count = BigEndian32(content, 4);
    FUZZ_CHECK(images->count == (max_count > 0 ? std::min(max_count, count) : count));
    FUZZ_CHECK(images->rows == BigEndian32(content, 8) && images->cols == BigEndian32(content, 12));
    FUZZ_CHECK(images->pixels.empty() ||
               std::memcmp(images->pixels.data(), &content[16], images->pixels.size()) == 0);
    if (max_count == 0) FUZZ_CHECK(content.size() == 16 + images->pixels.size());
  }
  if (images->count > 0) {
    std::vector<float> x(images->image_size());
    images->ToFloat(images->count - 1, x.data());
    for (size_t k = 0; k < x.size(); ++k) {
      FUZZ_CHECK(x[k] == PixelToFloat(images->image(images->count - 1)[k]));
    }
  }
  return 0;
}
