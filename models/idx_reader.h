// Reader for gzipped IDX files (the MNIST / Fashion-MNIST format): a big-endian
// header {0, 0, type 0x08 = unsigned byte, ndims} followed by ndims uint32
// dimensions and the raw bytes. Images are idx3 (count, rows, cols), labels
// idx1 (count). Every error names the file and the problem.
//
// Images are kept as bytes (a quarter of the memory of floats: every worker
// process holds the whole training set); ToFloat gives the [0, 1] values x/255.
#ifndef ONEBIT_MODELS_IDX_READER_H_
#define ONEBIT_MODELS_IDX_READER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace onebit {

// Magic numbers (type 0x08 = unsigned byte, then the number of dimensions).
inline constexpr uint32_t kIdxImagesMagic = 0x00000803;
inline constexpr uint32_t kIdxLabelsMagic = 0x00000801;

struct IdxImages {
  uint32_t count = 0;
  uint32_t rows = 0;
  uint32_t cols = 0;
  std::vector<uint8_t> pixels;  // count * rows * cols, image after image, row-major

  size_t image_size() const { return size_t{rows} * cols; }
  const uint8_t* image(size_t i) const { return pixels.data() + i * image_size(); }
  // out[0, image_size()) = image i as x / 255 in [0, 1]. Requires i < count.
  void ToFloat(size_t i, float* out) const;
};

// Reads an idx3 ubyte file. max_count > 0 reads only the first max_count
// images (the rest of the file is not decompressed); 0 reads all and requires
// the file to end right after them.
absl::StatusOr<IdxImages> ReadIdxImages(const std::string& path, uint32_t max_count = 0);

// Reads an idx1 ubyte file; every label must be < num_classes (1..256).
// max_count as for ReadIdxImages.
absl::StatusOr<std::vector<uint8_t>> ReadIdxLabels(const std::string& path,
                                                   uint32_t num_classes = 10,
                                                   uint32_t max_count = 0);

// x / 255 exactly (correctly rounded), for byte x.
float PixelToFloat(uint8_t x);

}  // namespace onebit

#endif  // ONEBIT_MODELS_IDX_READER_H_
