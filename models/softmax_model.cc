// The `softmax` model: softmax regression on Fashion-MNIST, one linear layer
// 784 -> 10 with softmax cross-entropy (7 850 parameters). It is the mlp with
// no hidden layer (models/mlp_model.h), so it shares its arithmetic and its
// GPU version; what it adds is a registry entry whose options live only in
// --model_options, the way a new built-in model takes its settings.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "models/dataset.h"
#include "models/mlp_model.h"
#include "models/registry.h"

namespace onebit {
namespace {

constexpr ModelOption kOptions[] = {
    {"batch", "64", "local batch per worker"},
    {"data_dir", kDefaultFashionMnistDir, "folder of the Fashion-MNIST IDX files (.gz)"},
    {"max_train", "0", "use only the first N training images (0: all)"},
    {"max_test", "0", "use only the first N test images (0: all)"},
};

constexpr uint32_t kPixels = 784;

absl::StatusOr<uint64_t> SoftmaxParams(const control::TrainingConfig&) {
  return uint64_t{kPixels} * ImageDataset::kNumClasses + ImageDataset::kNumClasses;
}

absl::StatusOr<uint64_t> SoftmaxEpochSteps(const control::TrainingConfig& c) {
  absl::StatusOr<uint32_t> batch = ModelOptionUint32(c, "batch", 1, 1u << 16);
  if (!batch.ok()) return batch.status();
  absl::StatusOr<uint32_t> max_train = ModelOptionUint32(c, "max_train", 0, UINT32_MAX);
  if (!max_train.ok()) return max_train.status();
  const uint64_t steps = FashionMnistEpochSteps(*max_train, DataRanks(c), *batch);
  if (steps == 0) {
    const uint32_t train =
        *max_train > 0 ? std::min(*max_train, kFashionMnistTrain) : kFashionMnistTrain;
    return ModelOptionError(
        c, "batch",
        absl::StrCat(DataRanks(c), c.cluster().local_ranks() > 1 ? " ranks" : " workers",
                     " x batch ", *batch, " exceed the ", train, " training images"));
  }
  return steps;
}

absl::Status ValidateSoftmax(const control::TrainingConfig& c) {
  if (absl::StatusOr<uint64_t> s = SoftmaxEpochSteps(c); !s.ok()) return s.status();
  absl::StatusOr<uint32_t> max_test = ModelOptionUint32(c, "max_test", 0, UINT32_MAX);
  if (!max_test.ok()) return max_test.status();
  if (ModelOptionValue(c, "data_dir").empty()) return ModelOptionError(c, "data_dir", "empty");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Model>> MakeSoftmax(const control::TrainingConfig& c) {
  if (absl::Status st = ValidateSoftmax(c); !st.ok()) return st;
  MlpOptions o;
  o.layers = {kPixels, ImageDataset::kNumClasses};
  o.seed = c.model().seed();
  o.data_dir = ModelOptionValue(c, "data_dir");
  o.batch = *ModelOptionUint32(c, "batch", 1, 1u << 16);
  o.workers = DataRanks(c);
  o.blas_threads = 1;  // a 784 x 10 layer is too small to share out
  o.max_train = *ModelOptionUint32(c, "max_train", 0, UINT32_MAX);
  o.max_test = *ModelOptionUint32(c, "max_test", 0, UINT32_MAX);
  absl::StatusOr<std::unique_ptr<MlpModel>> m = NewMlpModel(o);
  if (!m.ok()) return m.status();
  return std::unique_ptr<Model>(*std::move(m));
}

}  // namespace

extern const ModelEntry kSoftmaxModel = {
    "softmax",
    "softmax regression on Fashion-MNIST (one linear layer 784-10)",
    "",
    kOptions,
    SoftmaxParams,
    ValidateSoftmax,
    SoftmaxEpochSteps,
    MakeSoftmax,
    // W, then b, as the one-layer MlpModel it builds keeps them.
    [](const control::TrainingConfig&) -> absl::StatusOr<std::vector<uint64_t>> {
      const uint64_t w = uint64_t{kPixels} * ImageDataset::kNumClasses;
      return std::vector<uint64_t>{w, w + ImageDataset::kNumClasses};
    },
};

}  // namespace onebit
