// A model of our own, as a user of onebit-ps writes it: softmax regression
// on Fashion-MNIST (784 pixels -> 10 classes), parameters as one flat
// vector [W (10 x 784), b (10)], the mean cross-entropy's gradient in plain
// loops. Nothing here knows about onebit-ps.
#ifndef ONEBIT_EXAMPLES_CPP_SOFTMAX_H_
#define ONEBIT_EXAMPLES_CPP_SOFTMAX_H_

#include <zlib.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace softmax {

constexpr int kPixels = 784, kClasses = 10;
constexpr uint64_t kParams = kClasses * kPixels + kClasses;

struct Data {
  std::vector<float> images;  // n x 784, scaled to [0, 1]
  std::vector<uint8_t> labels;
  size_t n = 0;
};

// Reads the first `max` images and labels of a gzipped IDX pair ("" on
// success, else what went wrong).
inline std::string Load(const std::string& images, const std::string& labels, size_t max,
                        Data* out) {
  auto read = [](const std::string& path, size_t header, size_t item, size_t max,
                 std::vector<uint8_t>* bytes) -> std::string {
    gzFile f = gzopen(path.c_str(), "rb");
    if (f == nullptr) return "cannot open " + path;
    std::vector<uint8_t> head(header);
    bool ok = gzread(f, head.data(), header) == static_cast<int>(header);
    const size_t count = ok ? (size_t{head[4]} << 24 | head[5] << 16 | head[6] << 8 | head[7]) : 0;
    bytes->resize(std::min(count, max) * item);
    ok = ok && gzread(f, bytes->data(), bytes->size()) == static_cast<int>(bytes->size());
    gzclose(f);
    return ok ? "" : path + " is not an IDX file";
  };
  std::vector<uint8_t> pixels;
  std::string err = read(images, 16, kPixels, max, &pixels);
  if (err.empty()) err = read(labels, 8, 1, max, &out->labels);
  if (!err.empty()) return err;
  out->n = out->labels.size();
  out->images.resize(pixels.size());
  for (size_t i = 0; i < pixels.size(); ++i) out->images[i] = pixels[i] / 255.0f;
  return "";
}

// Small random weights, zero biases; `seed` picks them.
inline void Init(uint64_t seed, float* x) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.01f);
  for (uint64_t i = 0; i < kParams; ++i) x[i] = i < kClasses * kPixels ? normal(rng) : 0.0f;
}

// Mean cross-entropy of samples first, first+1, ... (count of them, cycling
// through the data) at x; writes its gradient to g.
inline double Gradient(const Data& d, const float* x, uint64_t first, size_t count, float* g) {
  const float* W = x;
  const float* b = x + kClasses * kPixels;
  for (uint64_t i = 0; i < kParams; ++i) g[i] = 0.0f;
  double loss = 0;
  for (size_t s = 0; s < count; ++s) {
    const size_t k = (first + s) % d.n;
    const float* img = &d.images[k * kPixels];
    double z[kClasses], zmax = -1e30, sum = 0;
    for (int c = 0; c < kClasses; ++c) {
      double a = b[c];
      for (int p = 0; p < kPixels; ++p) a += double{W[c * kPixels + p]} * img[p];
      z[c] = a;
      zmax = std::max(zmax, a);
    }
    for (int c = 0; c < kClasses; ++c) sum += std::exp(z[c] - zmax);
    loss += std::log(sum) + zmax - z[d.labels[k]];
    for (int c = 0; c < kClasses; ++c) {
      const float delta = static_cast<float>(
          (std::exp(z[c] - zmax) / sum - (c == d.labels[k] ? 1.0 : 0.0)) / count);
      for (int p = 0; p < kPixels; ++p) g[c * kPixels + p] += delta * img[p];
      g[kClasses * kPixels + c] += delta;
    }
  }
  return loss / count;
}

// Fraction of the data classified right at x.
inline double Accuracy(const Data& d, const float* x) {
  size_t right = 0;
  for (size_t k = 0; k < d.n; ++k) {
    int best = 0;
    double best_z = -1e30;
    for (int c = 0; c < kClasses; ++c) {
      double a = x[kClasses * kPixels + c];
      for (int p = 0; p < kPixels; ++p) a += double{x[c * kPixels + p]} * d.images[k * kPixels + p];
      if (a > best_z) best_z = a, best = c;
    }
    right += best == d.labels[k];
  }
  return d.n == 0 ? 0 : static_cast<double>(right) / d.n;
}

}  // namespace softmax

#endif  // ONEBIT_EXAMPLES_CPP_SOFTMAX_H_
