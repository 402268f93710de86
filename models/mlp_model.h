// The `mlp` model: a multi-layer perceptron on Fashion-MNIST with ReLU hidden
// layers and softmax cross-entropy, forward and backward on the CPU with
// OpenBLAS sgemm.
//
// Parameters: ONE flat fp32 vector x. For each layer l = 0 .. L-1 (L =
// layers.size() - 1), from input to output: W_l, a row-major
// layers[l+1] x layers[l] matrix (row o holds the weights into output unit o),
// then b_l, layers[l+1] biases. So 784-256-128-10 has
// 784*256+256 + 256*128+128 + 128*10+10 = 235 146 parameters.
// Init: W_l ~ U(-sqrt(6/fan_in), +sqrt(6/fan_in)) (He/Kaiming uniform) drawn
// with SplitMix64 from the seed in parameter order; b_l = 0.
//
// Gradient(x, rank, step) is the mean gradient over worker `rank`'s local
// batch at `step` (dataset.h says which examples), and returns the batch's
// mean loss. Deterministic per (seed, rank, step) on a given machine and BLAS
// thread count (OpenBLAS picks its kernels by CPU, so other CPUs may round
// differently in the last bits).
#ifndef ONEBIT_MODELS_MLP_MODEL_H_
#define ONEBIT_MODELS_MLP_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "models/dataset.h"
#include "models/evaluator.h"
#include "models/model.h"

namespace onebit {

struct BlasApi;  // models/blas_loader.h

struct MlpOptions {
  // Widths from input to output; the first must equal the image size (784),
  // the last the number of classes (10); at least two entries, all > 0.
  std::vector<uint32_t> layers = {784, 256, 128, 10};
  uint64_t seed = 1;  // initialisation and the shared data shuffle
  std::string data_dir = kDefaultFashionMnistDir;
  uint32_t batch = 64;   // local batch per worker
  uint32_t workers = 1;  // N: the training set is split among N ranks
  // OpenBLAS threads for this process (openblas_set_num_threads is
  // process-wide); 0 leaves OpenBLAS's setting alone.
  int blas_threads = 1;
  uint32_t eval_batch = 1000;  // test examples per forward pass in Evaluate
  // > 0: use only the first max_train / max_test examples (quick tests).
  uint32_t max_train = 0;
  uint32_t max_test = 0;
};

// Thread-compatible like Model: Gradient and Evaluate may run concurrently
// (each call borrows its own scratch buffers from a mutex-guarded pool).
class MlpModel final : public Model, public Evaluator {
 public:
  // Uses `data` as it is (options.data_dir, max_train, max_test and
  // blas_threads are ignored).
  static absl::StatusOr<std::unique_ptr<MlpModel>> Create(const MlpOptions& options,
                                                          std::shared_ptr<const ImageDataset> data);
  ~MlpModel() override;

  uint64_t num_params() const override { return num_params_; }
  void Init(float* x) const override;
  absl::StatusOr<double> Gradient(const float* x, uint32_t rank, uint64_t step,
                                  float* g) const override;
  // Releases each layer's W_l and b_l (adjacent in x) once both are
  // computed, from the output layer down.
  absl::StatusOr<double> GradientInParts(const float* x, uint32_t rank, uint64_t step, float* g,
                                         const ReleaseFn& release) const override;
  // Accuracy and mean cross-entropy over all test images, in batches of
  // options.eval_batch.
  absl::StatusOr<EvalResult> Evaluate(const float* x) const override;

  const MlpOptions& options() const { return o_; }
  const ImageDataset& dataset() const { return *data_; }
  const EpochSampler& sampler() const { return *sampler_; }
  uint64_t steps_per_epoch() const override { return sampler_->steps_per_epoch(); }
  size_t num_layers() const { return o_.layers.size() - 1; }
  // Where W_l and b_l start in x.
  uint64_t weight_offset(size_t l) const { return w_off_[l]; }
  uint64_t bias_offset(size_t l) const { return b_off_[l]; }

 private:
  struct Workspace;
  MlpModel(const MlpOptions& o, std::shared_ptr<const ImageDataset> data,
           std::unique_ptr<EpochSampler> sampler, const BlasApi* blas);
  std::unique_ptr<Workspace> Borrow() const;
  void Return(std::unique_ptr<Workspace> ws) const;
  // Activations of `rows` examples already in ws->x; the logits end up in the
  // last activation buffer.
  void Forward(const float* x, Workspace* ws, size_t rows) const;
  // Gradient, releasing layer by layer when `release` is not null.
  absl::StatusOr<double> Backward(const float* x, uint32_t rank, uint64_t step, float* g,
                                  const ReleaseFn* release) const;
  // Names the layer and the part (W or b) of parameter index j.
  std::string DescribeParam(uint64_t j) const;

  const MlpOptions o_;
  const std::shared_ptr<const ImageDataset> data_;
  const std::unique_ptr<EpochSampler> sampler_;
  const BlasApi* const blas_;  // loaded by Create
  std::vector<uint64_t> w_off_, b_off_;
  uint64_t num_params_ = 0;
  mutable absl::Mutex mu_;
  mutable std::vector<std::unique_ptr<Workspace>> pool_ ABSL_GUARDED_BY(mu_);
};

// Loads Fashion-MNIST from options.data_dir, sets the OpenBLAS thread count
// and builds the model. Errors: a missing or broken data directory (named),
// bad layer widths, workers * batch larger than the training set.
absl::StatusOr<std::unique_ptr<MlpModel>> NewMlpModel(const MlpOptions& options);

// "784-256-128-10" -> {784, 256, 128, 10} (for a --layers flag): at least two
// widths, each in [1, 2^20], separated by '-' (',' and 'x' are accepted too).
absl::StatusOr<std::vector<uint32_t>> ParseLayers(absl::string_view spec);

// Parameters of an mlp with these layer widths ("784-256-128-10"): each
// layer's weights and biases. Errors name --layers.
absl::StatusOr<uint64_t> MlpParamCount(absl::string_view layers);

}  // namespace onebit

#endif  // ONEBIT_MODELS_MLP_MODEL_H_
