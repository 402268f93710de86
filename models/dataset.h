// Fashion-MNIST in memory, and the per-epoch sharding of its training set
// across the N workers of a job.
//
// Step -> data (the same on every process and platform):
//   steps_per_epoch = floor(num_train / (N * b))      (b = local batch)
//   epoch e = step / steps_per_epoch,  j = step % steps_per_epoch
//   P_e = a Fisher-Yates permutation of [0, num_train) drawn with SplitMix64
//         seeded from (seed, e)
//   worker `rank` at `step` takes P_e[j*N*b + rank*b, j*N*b + (rank+1)*b).
// So the N local batches of a step are disjoint and together form the global
// batch of N*b examples that one process with batch N*b would take at that
// step; within an epoch no example is used twice; the last
// num_train - steps_per_epoch*N*b examples of each permutation are skipped
// (a different set each epoch).
#ifndef ONEBIT_MODELS_DATASET_H_
#define ONEBIT_MODELS_DATASET_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "models/idx_reader.h"

namespace onebit {

// Where Debian's dataset-fashion-mnist installs the files.
inline constexpr char kDefaultFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";

// Labelled images, train and test. Immutable after creation: thread-safe.
class ImageDataset {
 public:
  static constexpr uint32_t kNumClasses = 10;

  // Checks that the image and label counts agree and that train and test
  // images have the same size; `name` prefixes the error messages.
  static absl::StatusOr<std::shared_ptr<const ImageDataset>> Create(
      IdxImages train, std::vector<uint8_t> train_labels, IdxImages test,
      std::vector<uint8_t> test_labels, const std::string& name = "dataset");

  uint32_t num_train() const { return train_.count; }
  uint32_t num_test() const { return test_.count; }
  // Pixels per image (784 for Fashion-MNIST).
  uint32_t dim() const { return static_cast<uint32_t>(train_.image_size()); }
  const IdxImages& train() const { return train_; }
  const IdxImages& test() const { return test_; }
  const std::vector<uint8_t>& train_labels() const { return train_labels_; }
  const std::vector<uint8_t>& test_labels() const { return test_labels_; }

  // x[i*dim() + k] = pixel k of train (or test) image idx[i] as x/255, and
  // y[i] its label, for i < n. Requires every idx[i] < num_train() (num_test()).
  void GatherTrain(const uint32_t* idx, size_t n, float* x, uint8_t* y) const;
  // Test images [first, first + n); requires first + n <= num_test().
  void GatherTest(uint32_t first, size_t n, float* x, uint8_t* y) const;

 private:
  ImageDataset() = default;
  IdxImages train_, test_;
  std::vector<uint8_t> train_labels_, test_labels_;
};

struct DatasetOptions {
  std::string dir = kDefaultFashionMnistDir;
  // > 0: keep only the first max_train training / max_test test examples
  // (quick tests; the rest of the files is not even decompressed).
  uint32_t max_train = 0;
  uint32_t max_test = 0;
};

// Loads {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz from options.dir.
// A missing directory is a NotFound error naming it.
absl::StatusOr<std::shared_ptr<const ImageDataset>> LoadFashionMnist(const DatasetOptions& options);

// Fashion-MNIST's training images, before max_train.
inline constexpr uint32_t kFashionMnistTrain = 60000;

// The steps of one epoch over the first max_train (0: all) training images of
// Fashion-MNIST for N workers at local batch b, as the EpochSampler of the
// loaded set will have them (known before loading it); 0 when not one step
// fits.
uint64_t FashionMnistEpochSteps(uint32_t max_train, uint32_t workers, uint32_t batch);

// The permutation P_epoch of [0, n) (see the top of this file): Fisher-Yates
// with SplitMix64, so every process on every platform gets the same one.
std::vector<uint32_t> EpochPermutation(uint32_t n, uint64_t seed, uint64_t epoch);

struct SamplerOptions {
  uint64_t seed = 1;     // the shuffle seed, shared by all workers
  uint32_t workers = 1;  // N
  uint32_t batch = 64;   // b, the local batch per worker
};

// Which training examples worker `rank` uses at `step` (the mapping at the
// top of this file). Thread-safe: it caches the current epoch's permutation
// under a mutex (workers move through steps in order, so one shuffle of
// 60 000 indices per epoch, not per step).
class EpochSampler {
 public:
  // Error when N or b is 0 or num_examples < N*b (no full step per epoch).
  static absl::StatusOr<std::unique_ptr<EpochSampler>> Create(uint32_t num_examples,
                                                              const SamplerOptions& options);

  uint32_t num_examples() const { return n_; }
  const SamplerOptions& options() const { return o_; }
  uint64_t steps_per_epoch() const { return steps_per_epoch_; }
  uint64_t EpochOf(uint64_t step) const { return step / steps_per_epoch_; }

  // idx[0, b) = the examples of (rank, step). Error when rank >= N.
  absl::Status BatchIndices(uint32_t rank, uint64_t step, uint32_t* idx) const;

 private:
  EpochSampler(uint32_t n, const SamplerOptions& o);

  const uint32_t n_;
  const SamplerOptions o_;
  const uint64_t steps_per_epoch_;
  mutable absl::Mutex mu_;
  mutable uint64_t cached_epoch_ ABSL_GUARDED_BY(mu_) = UINT64_MAX;
  mutable std::vector<uint32_t> cached_ ABSL_GUARDED_BY(mu_);
};

}  // namespace onebit

#endif  // ONEBIT_MODELS_DATASET_H_
