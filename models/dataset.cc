#include "models/dataset.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "models/rng.h"

namespace onebit {
namespace {

// x/255 by a true division (x * (1/255.f) differs in the last bit for half of
// the bytes); written so that it vectorises.
void Expand(const uint8_t* p, size_t n, float* out) {
  for (size_t k = 0; k < n; ++k) out[k] = static_cast<float>(p[k]) / 255.0f;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const ImageDataset>> ImageDataset::Create(
    IdxImages train, std::vector<uint8_t> train_labels, IdxImages test,
    std::vector<uint8_t> test_labels, const std::string& name) {
  if (train.count != train_labels.size()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", train.count, " training images but ",
                                                   train_labels.size(), " training labels"));
  }
  if (test.count != test_labels.size()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", test.count, " test images but ",
                                                   test_labels.size(), " test labels"));
  }
  if (train.rows != test.rows || train.cols != test.cols) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": training images are ", train.rows, "x",
                                                   train.cols, " but test images ", test.rows, "x",
                                                   test.cols));
  }
  if (train.pixels.size() != size_t{train.count} * train.image_size() ||
      test.pixels.size() != size_t{test.count} * test.image_size()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": pixel buffer size mismatch"));
  }
  for (const std::vector<uint8_t>* labels : {&train_labels, &test_labels}) {
    for (size_t i = 0; i < labels->size(); ++i) {
      if ((*labels)[i] >= kNumClasses) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": label ", int{(*labels)[i]}, " at index ", i, " out of range"));
      }
    }
  }
  std::shared_ptr<ImageDataset> d(new ImageDataset());
  d->train_ = std::move(train);
  d->test_ = std::move(test);
  d->train_labels_ = std::move(train_labels);
  d->test_labels_ = std::move(test_labels);
  return std::shared_ptr<const ImageDataset>(std::move(d));
}

void ImageDataset::GatherTrain(const uint32_t* idx, size_t n, float* x, uint8_t* y) const {
  const size_t dim = train_.image_size();
  for (size_t i = 0; i < n; ++i) {
    Expand(train_.image(idx[i]), dim, x + i * dim);
    y[i] = train_labels_[idx[i]];
  }
}

void ImageDataset::GatherTest(uint32_t first, size_t n, float* x, uint8_t* y) const {
  Expand(test_.image(first), n * test_.image_size(), x);
  std::memcpy(y, test_labels_.data() + first, n);
}

absl::StatusOr<std::shared_ptr<const ImageDataset>> LoadFashionMnist(const DatasetOptions& o) {
  struct stat st;
  if (stat(o.dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat(
        "Fashion-MNIST data directory ", o.dir,
        " does not exist or is not a directory (Debian: apt-get install dataset-fashion-mnist)"));
  }
  const std::string base = o.dir + "/";
  absl::StatusOr<IdxImages> train = ReadIdxImages(base + "train-images-idx3-ubyte.gz", o.max_train);
  if (!train.ok()) return train.status();
  absl::StatusOr<std::vector<uint8_t>> train_labels =
      ReadIdxLabels(base + "train-labels-idx1-ubyte.gz", ImageDataset::kNumClasses, o.max_train);
  if (!train_labels.ok()) return train_labels.status();
  absl::StatusOr<IdxImages> test = ReadIdxImages(base + "t10k-images-idx3-ubyte.gz", o.max_test);
  if (!test.ok()) return test.status();
  absl::StatusOr<std::vector<uint8_t>> test_labels =
      ReadIdxLabels(base + "t10k-labels-idx1-ubyte.gz", ImageDataset::kNumClasses, o.max_test);
  if (!test_labels.ok()) return test_labels.status();
  return ImageDataset::Create(*std::move(train), *std::move(train_labels), *std::move(test),
                              *std::move(test_labels), "Fashion-MNIST in " + o.dir);
}

uint64_t FashionMnistEpochSteps(uint32_t max_train, uint32_t workers, uint32_t batch) {
  const uint64_t train =
      max_train > 0 ? std::min(max_train, kFashionMnistTrain) : kFashionMnistTrain;
  return train / (uint64_t{std::max<uint32_t>(workers, 1)} * std::max<uint32_t>(batch, 1));
}

std::vector<uint32_t> EpochPermutation(uint32_t n, uint64_t seed, uint64_t epoch) {
  std::vector<uint32_t> p(n);
  for (uint32_t i = 0; i < n; ++i) p[i] = i;
  SplitMix64 rng(SplitMix64Mix(seed ^ 0x3c6ef372fe94f82bULL) ^
                 SplitMix64Mix(epoch + 0xa54ff53a5f1d36f1ULL));
  for (uint32_t i = n; i > 1; --i) {
    const uint32_t j = static_cast<uint32_t>(rng.Uniform(i));  // j in [0, i)
    std::swap(p[i - 1], p[j]);
  }
  return p;
}

EpochSampler::EpochSampler(uint32_t n, const SamplerOptions& o)
    : n_(n), o_(o), steps_per_epoch_(n / (uint64_t{o.workers} * o.batch)) {}

absl::StatusOr<std::unique_ptr<EpochSampler>> EpochSampler::Create(uint32_t num_examples,
                                                                   const SamplerOptions& o) {
  if (o.workers == 0 || o.batch == 0) {
    return absl::InvalidArgumentError(absl::StrCat("EpochSampler: workers (", o.workers,
                                                   ") and batch (", o.batch, ") must be > 0"));
  }
  if (uint64_t{o.workers} * o.batch > num_examples) {
    return absl::InvalidArgumentError(
        absl::StrCat("EpochSampler: ", o.workers, " workers x local batch ", o.batch,
                     " exceed the ", num_examples, " training examples (no full step per epoch)"));
  }
  return std::unique_ptr<EpochSampler>(new EpochSampler(num_examples, o));
}

absl::Status EpochSampler::BatchIndices(uint32_t rank, uint64_t step, uint32_t* idx) const {
  if (rank >= o_.workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("EpochSampler: rank ", rank, " is not below the ", o_.workers, " workers"));
  }
  const uint64_t epoch = step / steps_per_epoch_;
  const uint64_t first =
      (step % steps_per_epoch_) * o_.workers * o_.batch + uint64_t{rank} * o_.batch;
  absl::MutexLock lock(&mu_);
  if (epoch != cached_epoch_) {
    cached_ = EpochPermutation(n_, o_.seed, epoch);
    cached_epoch_ = epoch;
  }
  std::memcpy(idx, cached_.data() + first, sizeof(uint32_t) * o_.batch);
  return absl::OkStatus();
}

}  // namespace onebit
