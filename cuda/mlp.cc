// MlpDevice (cuda/mlp.h): cuBLAS GEMMs around the kernels of mlp_kernels.cu,
// and the CPU twins of those kernels (the loops of models/mlp_model.cc).
#include "cuda/mlp.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/cublas_loader.h"
#include "cuda/cuda_status.h"

namespace onebit::cuda {
namespace {

constexpr size_t kMaxClasses = 256;  // as the CPU model's p[256]

absl::Status BlasError(const CublasApi& api, cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const absl::StatusCode code = s == CUBLAS_STATUS_ALLOC_FAILED
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kFailedPrecondition;
  return absl::Status(
      code, absl::StrCat(what, ": cuBLAS error ", api.status_name(s), ": ", api.status_string(s)));
}

}  // namespace

namespace mlp_internal {

void BiasActCpu(float* out, const float* b, size_t rows, size_t n, bool relu) {
  for (size_t i = 0; i < rows; ++i) {
    float* row = out + i * n;
    for (size_t k = 0; k < n; ++k) {
      const float v = row[k] + b[k];
      row[k] = relu && v < 0.0f ? 0.0f : v;
    }
  }
}

void ReluMaskCpu(float* da, const float* a, size_t count) {
  for (size_t i = 0; i < count; ++i) da[i] = a[i] > 0.0f ? da[i] : 0.0f;
}

void BiasGradCpu(const float* dz, size_t rows, size_t n, float* gb) {
  std::fill(gb, gb + n, 0.0f);
  for (size_t i = 0; i < rows; ++i) {
    for (size_t k = 0; k < n; ++k) gb[k] += dz[i * n + k];
  }
}

void SoftmaxXentCpu(const float* z, const uint8_t* y, size_t rows, size_t classes, float scale,
                    float* delta, double* loss, uint8_t* flag) {
  for (size_t i = 0; i < rows; ++i) {
    const float* zi = z + i * classes;
    const size_t yi = y[i];
    if (yi >= classes) {
      loss[i] = std::numeric_limits<double>::quiet_NaN();
      if (flag != nullptr) flag[i] = 2;
      continue;
    }
    float mx = zi[0];
    for (size_t k = 1; k < classes; ++k) mx = std::max(mx, zi[k]);
    double p[kMaxClasses];
    double sum = 0;
    for (size_t k = 0; k < classes; ++k) {
      p[k] = std::exp(static_cast<double>(zi[k]) - mx);
      sum += p[k];
    }
    if (delta != nullptr) {
      for (size_t k = 0; k < classes; ++k) p[k] /= sum;
      p[yi] -= 1.0;
      for (size_t k = 0; k < classes; ++k)
        delta[i * classes + k] = static_cast<float>(p[k]) * scale;
    }
    loss[i] = static_cast<double>(mx) + std::log(sum) - static_cast<double>(zi[yi]);
    if (flag != nullptr) {
      flag[i] = static_cast<size_t>(std::max_element(zi, zi + classes) - zi) == yi ? 1 : 0;
    }
  }
}

}  // namespace mlp_internal

using mlp_internal::BiasAct;
using mlp_internal::BiasGrad;
using mlp_internal::ReluMask;
using mlp_internal::SoftmaxXent;

absl::StatusOr<std::unique_ptr<MlpDevice>> MlpDevice::Create(const std::vector<uint32_t>& layers,
                                                             size_t max_batch, Stream stream) {
  const std::string name = absl::StrJoin(layers, "-");
  if (layers.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu mlp: layers '", name, "' need an input and an output width"));
  }
  for (uint32_t w : layers) {
    if (w == 0 || w > (1u << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpu mlp: layers '", name, "': width ", w, " is not in [1, 1048576]"));
    }
  }
  if (layers.back() > kMaxClasses) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu mlp: layers '", name, "' end at ", layers.back(), " classes, at most ", kMaxClasses));
  }
  // cuBLAS takes int dimensions.
  if (max_batch == 0 || max_batch > (1u << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu mlp: max_batch ", max_batch, " is not in [1, 16777216]"));
  }
  std::unique_ptr<MlpDevice> m(new MlpDevice());
  m->layers_ = layers;
  m->max_batch_ = max_batch;
  m->stream_ = stream;
  uint64_t off = 0;
  size_t widest = 0;
  for (size_t l = 0; l + 1 < layers.size(); ++l) {
    m->w_off_.push_back(off);
    off += uint64_t{layers[l]} * layers[l + 1];
    m->b_off_.push_back(off);
    off += layers[l + 1];
    widest = std::max<size_t>(widest, layers[l + 1]);
  }
  m->num_params_ = off;
  // Device memory first: without a GPU this is the call that says so.
  for (size_t l = 0; l + 1 < layers.size(); ++l) {
    absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Create(max_batch * layers[l + 1] * 4);
    if (!b.ok()) return b.status();
    m->act_.push_back(*std::move(b));
  }
  for (DeviceBuffer& d : m->delta_) {
    absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Create(max_batch * widest * 4);
    if (!b.ok()) return b.status();
    d = *std::move(b);
  }
  absl::StatusOr<DeviceBuffer> loss = DeviceBuffer::Create(max_batch * sizeof(double));
  if (!loss.ok()) return loss.status();
  m->row_loss_ = *std::move(loss);
  absl::StatusOr<DeviceBuffer> flag = DeviceBuffer::Create(max_batch);
  if (!flag.ok()) return flag.status();
  m->row_flag_ = *std::move(flag);
  m->host_loss_.resize(max_batch);
  m->host_flag_.resize(max_batch);

  // Loaded here, at the first GPU mlp: CPU runs never need it.
  absl::StatusOr<const CublasApi*> api = Cublas();
  if (!api.ok()) return api.status();
  m->blas_api_ = *api;
  const CublasApi& blas = **api;
  cublasHandle_t h = nullptr;
  if (absl::Status s = BlasError(blas, blas.create(&h), "cublasCreate"); !s.ok()) return s;
  m->blas_ = h;
  if (absl::Status s = BlasError(blas, blas.set_stream(h, stream), "cublasSetStream"); !s.ok()) {
    return s;
  }
  // FP32 arithmetic (no TF32 tensor-core shortcut) and no atomics, so that
  // repeated calls give the same bits.
  if (absl::Status s =
          BlasError(blas, blas.set_math_mode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = BlasError(blas, blas.set_atomics_mode(h, CUBLAS_ATOMICS_NOT_ALLOWED),
                                 "cublasSetAtomicsMode");
      !s.ok()) {
    return s;
  }
  return m;
}

MlpDevice::~MlpDevice() {
  if (blas_ != nullptr) blas_api_->destroy(static_cast<cublasHandle_t>(blas_));
}

absl::Status MlpDevice::ForwardInternal(const float* x, const float* images, size_t rows) {
  cublasHandle_t h = static_cast<cublasHandle_t>(blas_);
  const CublasApi& blas = *blas_api_;
  const float one = 1.0f, zero = 0.0f;
  const size_t L = layers_.size() - 1;
  const float* in = images;
  for (size_t l = 0; l < L; ++l) {
    const int n_in = static_cast<int>(layers_[l]);
    const int n_out = static_cast<int>(layers_[l + 1]);
    float* out = act_[l].as<float>();
    // Row-major out = in · W^T is column-major out^T = W^T(cm) ^T · in^T:
    // W row-major n_out x n_in is column-major n_in x n_out.
    absl::Status s =
        BlasError(blas,
                  blas.sgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, n_out, static_cast<int>(rows), n_in, &one,
                             x + w_off_[l], n_in, in, n_in, &zero, out, n_out),
                  "cublasSgemm (forward)");
    if (s.ok()) s = BiasAct(out, x + b_off_[l], rows, layers_[l + 1], l + 1 < L, stream_);
    if (!s.ok()) return s;
    in = out;
  }
  return absl::OkStatus();
}

absl::StatusOr<const float*> MlpDevice::Forward(const float* x, const float* images, size_t rows) {
  if (rows == 0 || rows > max_batch_) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu mlp: ", rows, " rows, need 1 to ", max_batch_));
  }
  absl::Status s = ForwardInternal(x, images, rows);
  if (s.ok()) s = Synchronize(stream_);
  if (!s.ok()) return s;
  return act_.back().as<float>();
}

absl::StatusOr<double> MlpDevice::Gradient(const float* x, const float* images,
                                           const uint8_t* labels, size_t batch, float* g) {
  if (batch == 0 || batch > max_batch_) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu mlp: batch ", batch, ", need 1 to ", max_batch_));
  }
  cublasHandle_t h = static_cast<cublasHandle_t>(blas_);
  const CublasApi& blas = *blas_api_;
  const float one = 1.0f, zero = 0.0f;
  const size_t L = layers_.size() - 1;
  const size_t classes = layers_.back();
  const int m = static_cast<int>(batch);
  absl::Status s = ForwardInternal(x, images, batch);
  // dLoss/dlogits = (softmax - onehot) / batch.
  if (s.ok()) {
    s = SoftmaxXent(act_[L - 1].as<float>(), labels, batch, classes,
                    1.0f / static_cast<float>(batch), delta_[0].as<float>(), row_loss_.as<double>(),
                    row_flag_.as<uint8_t>(), stream_);
  }
  // Backward as on the CPU (models/mlp_model.cc), in column-major terms.
  int cur = 0;
  for (size_t l = L; s.ok() && l-- > 0;) {
    const int n_in = static_cast<int>(layers_[l]);
    const int n_out = static_cast<int>(layers_[l + 1]);
    const float* in = l == 0 ? images : act_[l - 1].as<float>();
    const float* dz = delta_[cur].as<float>();
    // dW = dZ^T · in (row-major n_out x n_in) = column-major in^T · dZ.
    s = BlasError(blas,
                  blas.sgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, n_in, n_out, m, &one, in, n_in, dz, n_out,
                             &zero, g + w_off_[l], n_in),
                  "cublasSgemm (weight gradient)");
    if (s.ok()) s = BiasGrad(dz, batch, n_out, g + b_off_[l], stream_);
    if (!s.ok() || l == 0) break;
    // dA = dZ · W (row-major batch x n_in) = column-major W(cm) · dZ^T.
    float* da = delta_[1 - cur].as<float>();
    s = BlasError(blas,
                  blas.sgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n_in, m, n_out, &one, x + w_off_[l], n_in,
                             dz, n_out, &zero, da, n_in),
                  "cublasSgemm (activation gradient)");
    if (s.ok()) s = ReluMask(da, act_[l - 1].as<float>(), batch * layers_[l], stream_);
    cur = 1 - cur;
  }
  if (s.ok()) {
    s = CudaError(cudaMemcpyAsync(host_loss_.data(), row_loss_.data(), batch * sizeof(double),
                                  cudaMemcpyDeviceToHost, stream_),
                  "cudaMemcpyAsync (row losses)");
  }
  if (s.ok()) {
    s = CudaError(cudaMemcpyAsync(host_flag_.data(), row_flag_.data(), batch,
                                  cudaMemcpyDeviceToHost, stream_),
                  "cudaMemcpyAsync (row flags)");
  }
  if (s.ok()) s = Synchronize(stream_);
  if (!s.ok()) return s;
  double loss = 0;
  for (size_t i = 0; i < batch; ++i) {
    if (host_flag_[i] == 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpu mlp: the label of row ", i, " is not below ", classes, " classes"));
    }
    loss += host_loss_[i];
  }
  loss /= static_cast<double>(batch);
  if (!std::isfinite(loss)) {
    return absl::InternalError(absl::StrCat("gpu mlp: loss is not finite (", loss, ")"));
  }
  absl::StatusOr<size_t> bad = FirstNonFinite(g, nullptr, num_params_, stream_);
  if (!bad.ok()) return bad.status();
  if (*bad < num_params_) {
    const uint64_t j = *bad;
    float v = 0;
    if (absl::Status c = CopyToHost(&v, g + j, sizeof(float)); !c.ok()) return c;
    std::string where = absl::StrCat("index ", j);
    for (size_t l = 0; l < L; ++l) {
      if (j < b_off_[l]) {
        where = absl::StrCat("W", l, "[", j - w_off_[l], "]");
        break;
      }
      if (j < b_off_[l] + layers_[l + 1]) {
        where = absl::StrCat("b", l, "[", j - b_off_[l], "]");
        break;
      }
    }
    return absl::InternalError(
        absl::StrCat("gpu mlp: gradient ", where, " is not finite (", v, ")"));
  }
  return loss;
}

absl::StatusOr<EvalResult> MlpDevice::Evaluate(const float* x, const float* images,
                                               const uint8_t* labels, size_t n) {
  const size_t L = layers_.size() - 1;
  const size_t classes = layers_.back();
  const size_t dim = layers_.front();
  double loss = 0;
  uint64_t correct = 0;
  for (size_t first = 0; first < n; first += max_batch_) {
    const size_t rows = std::min(max_batch_, n - first);
    absl::Status s = ForwardInternal(x, images + first * dim, rows);
    if (s.ok()) {
      s = SoftmaxXent(act_[L - 1].as<float>(), labels + first, rows, classes, 1.0f, nullptr,
                      row_loss_.as<double>(), row_flag_.as<uint8_t>(), stream_);
    }
    if (s.ok()) {
      s = CudaError(cudaMemcpyAsync(host_loss_.data(), row_loss_.data(), rows * sizeof(double),
                                    cudaMemcpyDeviceToHost, stream_),
                    "cudaMemcpyAsync (row losses)");
    }
    if (s.ok()) {
      s = CudaError(cudaMemcpyAsync(host_flag_.data(), row_flag_.data(), rows,
                                    cudaMemcpyDeviceToHost, stream_),
                    "cudaMemcpyAsync (row flags)");
    }
    if (s.ok()) s = Synchronize(stream_);
    if (!s.ok()) return s;
    for (size_t i = 0; i < rows; ++i) {
      if (host_flag_[i] == 2) {
        return absl::InvalidArgumentError(absl::StrCat("gpu mlp: the label of test example ",
                                                       first + i, " is not below ", classes,
                                                       " classes"));
      }
      loss += host_loss_[i];
      correct += host_flag_[i];
    }
  }
  EvalResult r;
  r.examples = n;
  if (n > 0) {
    r.accuracy = static_cast<double>(correct) / static_cast<double>(n);
    r.loss = loss / static_cast<double>(n);
  }
  if (!std::isfinite(r.loss)) {
    return absl::InternalError(absl::StrCat("gpu mlp: test loss is not finite (", r.loss, ")"));
  }
  return r;
}

}  // namespace onebit::cuda
