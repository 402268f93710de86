// The GPU twin of the mlp's arithmetic (models/mlp_model.h): forward and
// backward of the same network on device buffers, with cuBLAS for the GEMMs
// and small kernels for the bias, the ReLU and softmax cross-entropy.
//
// Same parameter layout as MlpModel: one flat fp32 vector, for each layer l
// W_l (row-major layers[l+1] x layers[l]) then b_l. Images are row-major
// batch x layers[0] floats (pixel / 255, as ImageDataset::GatherTrain writes
// them), labels one byte per image.
//
// Agreement with the CPU: the elementwise kernels (bias add, ReLU and its
// mask, bias gradients as column sums in row order) are exact twins of the
// CPU loops; the GEMMs are not (cuBLAS sums in another order than OpenBLAS),
// so gradients and losses agree to rounding only (tests/cuda/mlp_test.cc:
// gradients to 1e-4 relative, losses to 1e-5). Softmax cross-entropy uses the
// CPU's double-precision formula; CUDA's exp/log may differ from glibc's in
// the last bit. cuBLAS runs without TF32 and without atomics, so a given GPU
// and toolkit give bitwise the same results on every call.
//
// Requires a build with ONEBIT_WITH_CUDA (target onebit_cuda_mlp). Without a
// usable GPU, Create returns an error Status carrying the CUDA error text.
#ifndef ONEBIT_CUDA_MLP_H_
#define ONEBIT_CUDA_MLP_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cuda/kernels.h"
#include "cuda/memory.h"
#include "models/evaluator.h"

namespace onebit::cuda {

struct CublasApi;  // cuda/cublas_loader.h

// Not thread-safe: one workspace and one cuBLAS handle per object; use one
// object per thread (or per stream). Every pointer argument is a device
// pointer; calls enqueue on the object's stream and wait for it before they
// return (they return a loss or an accuracy).
class MlpDevice {
 public:
  // layers: widths from input to output, at least two, each in [1, 2^20]
  // (the last is the number of classes, at most 256 like the CPU model).
  // max_batch: the most rows of one Gradient call or one Evaluate chunk, > 0.
  // stream: where the work runs (nullptr: the legacy default stream).
  static absl::StatusOr<std::unique_ptr<MlpDevice>> Create(const std::vector<uint32_t>& layers,
                                                           size_t max_batch,
                                                           Stream stream = nullptr);
  ~MlpDevice();
  MlpDevice(const MlpDevice&) = delete;
  MlpDevice& operator=(const MlpDevice&) = delete;

  const std::vector<uint32_t>& layers() const { return layers_; }
  size_t max_batch() const { return max_batch_; }
  uint64_t num_params() const { return num_params_; }
  uint64_t weight_offset(size_t l) const { return w_off_[l]; }
  uint64_t bias_offset(size_t l) const { return b_off_[l]; }

  // g[0, num_params) = the mean gradient of the loss over the batch at
  // parameters x; returns the mean loss. Requires 1 <= batch <= max_batch,
  // labels < the number of classes. Errors: a bad batch or label
  // (InvalidArgument), a non-finite loss or gradient (Internal, naming the
  // parameter, as MlpModel does), CUDA and cuBLAS failures.
  absl::StatusOr<double> Gradient(const float* x, const float* images, const uint8_t* labels,
                                  size_t batch, float* g);

  // Accuracy (arg-max, ties to the lowest class) and mean loss over n
  // examples, in chunks of max_batch. n == 0 gives an empty result.
  absl::StatusOr<EvalResult> Evaluate(const float* x, const float* images, const uint8_t* labels,
                                      size_t n);

  // The logits of `rows` examples (rows <= max_batch): device memory of
  // rows x classes floats owned by this object, valid until the next call.
  absl::StatusOr<const float*> Forward(const float* x, const float* images, size_t rows);

 private:
  MlpDevice() = default;
  absl::Status ForwardInternal(const float* x, const float* images, size_t rows);

  std::vector<uint32_t> layers_;
  size_t max_batch_ = 0;
  Stream stream_ = nullptr;
  void* blas_ = nullptr;                 // cublasHandle_t
  const CublasApi* blas_api_ = nullptr;  // cuda/cublas_loader.h
  std::vector<uint64_t> w_off_, b_off_;
  uint64_t num_params_ = 0;
  std::vector<DeviceBuffer> act_;  // act_[l]: max_batch x layers[l+1] (logits last)
  DeviceBuffer delta_[2];          // max_batch x widest: ping-pong gradients
  DeviceBuffer row_loss_;          // max_batch doubles
  DeviceBuffer row_flag_;          // max_batch bytes: correct / bad label
  std::vector<double> host_loss_;
  std::vector<uint8_t> host_flag_;
};

// The small kernels, exposed so that tests compare them with their CPU twins
// (the *Cpu functions: the loops of models/mlp_model.cc, same signatures
// without the stream). rows x n matrices are row-major.
namespace mlp_internal {

// out[i][k] += b[k]; then, if relu, negative values become 0 (NaN passes).
absl::Status BiasAct(float* out, const float* b, size_t rows, size_t n, bool relu, Stream stream);
void BiasActCpu(float* out, const float* b, size_t rows, size_t n, bool relu);

// da[i] = a[i] > 0 ? da[i] : 0 for i < count (the ReLU's backward).
absl::Status ReluMask(float* da, const float* a, size_t count, Stream stream);
void ReluMaskCpu(float* da, const float* a, size_t count);

// gb[k] = sum over i = 0, 1, ... rows-1 of dz[i][k], in float, in row order.
absl::Status BiasGrad(const float* dz, size_t rows, size_t n, float* gb, Stream stream);
void BiasGradCpu(const float* dz, size_t rows, size_t n, float* gb);

// For each row i of logits z (rows x classes) with label y[i]: loss[i] =
// max + log(sum exp(z - max)) - z[y] in double; if delta != nullptr,
// delta[i][k] = float(softmax(z)[k] - (k == y)) * scale. flag[i] (if not
// nullptr) = 1 when arg-max(z) == y (ties to the lowest class), 0 when not,
// 2 when y >= classes (then loss[i] is NaN and the row of delta untouched).
absl::Status SoftmaxXent(const float* z, const uint8_t* y, size_t rows, size_t classes, float scale,
                         float* delta, double* loss, uint8_t* flag, Stream stream);
void SoftmaxXentCpu(const float* z, const uint8_t* y, size_t rows, size_t classes, float scale,
                    float* delta, double* loss, uint8_t* flag);

}  // namespace mlp_internal
}  // namespace onebit::cuda

#endif  // ONEBIT_CUDA_MLP_H_
