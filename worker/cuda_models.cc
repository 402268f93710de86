// The GPU versions of the worker's models (worker/device_model.h): the
// synthetic gradient kernel (cuda/synthetic.h: g bit for bit as the CPU's, the
// loss to rounding, being summed in another order) and the mlp on cuBLAS
// (cuda/mlp.h: gradient and losses to rounding). Compiled only in CUDA builds.
#include <cuda_runtime_api.h>
#include <cxxabi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/cuda_status.h"
#include "cuda/memory.h"
#include "cuda/mlp.h"
#include "cuda/synthetic.h"
#include "models/mlp_model.h"
#include "models/synthetic_model.h"
#include "worker/device_model.h"

namespace onebit {
namespace {

using cuda::CudaError;
using cuda::DeviceBuffer;

// Pinned host memory: copies from it are truly asynchronous.
struct PinnedFree {
  void operator()(void* p) const {
    if (p != nullptr) cudaFreeHost(p);
  }
};
using Pinned = std::unique_ptr<void, PinnedFree>;

absl::StatusOr<Pinned> AllocPinned(size_t bytes) {
  void* p = nullptr;
  absl::Status st = CudaError(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocDefault),
                              "cudaHostAlloc");
  if (!st.ok()) return st;
  return Pinned(p);
}

// A host-to-device copy ordered on `stream` (a synchronous cudaMemcpy runs on
// the legacy stream, which a non-blocking stream does not wait for), then a
// wait, so that `src` may be freed on return.
absl::Status UploadAndWait(void* dst, const void* src, size_t bytes, cuda::Stream stream) {
  if (bytes > 0) {
    absl::Status st = CudaError(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream),
                                "cudaMemcpyAsync to device");
    if (!st.ok()) return st;
  }
  return cuda::Synchronize(stream);
}

// A readable name for an unsupported model's type.
std::string TypeName(const Model& model) {
  const char* mangled = typeid(model).name();
  int status = 0;
  char* plain = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && plain != nullptr ? plain : mangled;
  std::free(plain);
  return name;
}

class SyntheticGpu final : public DeviceModel {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceModel>> Create(const SyntheticModel& model,
                                                             cuda::Stream stream) {
    std::unique_ptr<SyntheticGpu> m(new SyntheticGpu(model, stream));
    // Benchmark mode computes nothing: no device memory either.
    if (model.options().skip) return m;
    absl::StatusOr<DeviceBuffer> scratch =
        DeviceBuffer::Create((cuda::kSyntheticPartials + 1) * sizeof(double));
    if (!scratch.ok()) return scratch.status();
    m->scratch_ = *std::move(scratch);
    absl::StatusOr<Pinned> host = AllocPinned(sizeof(double));
    if (!host.ok()) return host.status();
    m->host_loss_ = *std::move(host);
    // The spread table is computed on the host with pow() (the CPU's libm, so
    // both sides use the same factors) and uploaded once.
    const std::vector<float>& spread = model.spread();
    if (!spread.empty()) {
      absl::StatusOr<DeviceBuffer> table = DeviceBuffer::Create(spread.size() * sizeof(float));
      if (!table.ok()) return table.status();
      m->spread_ = *std::move(table);
      absl::Status st =
          UploadAndWait(m->spread_.data(), spread.data(), spread.size() * sizeof(float), stream);
      if (!st.ok()) return st;
    }
    return m;
  }

  absl::StatusOr<double> Gradient(const float* x, uint32_t rank, uint64_t step, float* g) override {
    const SyntheticOptions& o = model_.options();
    if (o.skip) return 0.0;
    cuda::SyntheticProblem p;
    p.dim = o.dim;
    p.seed = o.seed;
    p.noise = o.noise;
    p.spread = spread_.as<float>();
    double* sum = scratch_.as<double>() + cuda::kSyntheticPartials;
    absl::Status st =
        cuda::SyntheticGradient(p, x, rank, step, g, scratch_.as<double>(), sum, stream_);
    if (st.ok()) {
      st = CudaError(
          cudaMemcpyAsync(host_loss_.get(), sum, sizeof(double), cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpyAsync (synthetic loss)");
    }
    if (st.ok()) st = cuda::Synchronize(stream_);
    if (!st.ok()) return st;
    const double loss = *static_cast<const double*>(host_loss_.get()) / static_cast<double>(o.dim);
    if (!std::isfinite(loss)) {
      return absl::InternalError(absl::StrCat("synthetic: loss is not finite (", loss, ") at rank ",
                                              rank, " step ", step));
    }
    return loss;
  }

  bool can_evaluate() const override { return false; }
  absl::StatusOr<EvalResult> Evaluate(const float*) override {
    return absl::FailedPreconditionError("the synthetic model has no test set");
  }

 private:
  SyntheticGpu(const SyntheticModel& model, cuda::Stream stream) : model_(model), stream_(stream) {}

  const SyntheticModel& model_;
  const cuda::Stream stream_;
  DeviceBuffer scratch_;  // kSyntheticPartials partial losses, then their sum
  DeviceBuffer spread_;   // empty without a curvature spread
  Pinned host_loss_;
};

class MlpGpu final : public DeviceModel {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceModel>> Create(const MlpModel& model,
                                                             cuda::Stream stream) {
    const MlpOptions& o = model.options();
    // Evaluate's chunks as large as the host model's: the result does not
    // depend on them (losses are summed row by row in order), memory does.
    absl::StatusOr<std::unique_ptr<cuda::MlpDevice>> mlp =
        cuda::MlpDevice::Create(o.layers, std::max(o.batch, o.eval_batch), stream);
    if (!mlp.ok()) return mlp.status();
    std::unique_ptr<MlpGpu> m(new MlpGpu(model, stream, *std::move(mlp)));
    const size_t batch = o.batch;
    const size_t image_bytes = batch * model.dataset().dim() * sizeof(float);
    m->idx_.resize(batch);
    absl::StatusOr<Pinned> images = AllocPinned(image_bytes);
    if (!images.ok()) return images.status();
    m->host_images_ = *std::move(images);
    absl::StatusOr<Pinned> labels = AllocPinned(batch);
    if (!labels.ok()) return labels.status();
    m->host_labels_ = *std::move(labels);
    absl::StatusOr<DeviceBuffer> d_images = DeviceBuffer::Create(image_bytes);
    if (!d_images.ok()) return d_images.status();
    m->images_ = *std::move(d_images);
    absl::StatusOr<DeviceBuffer> d_labels = DeviceBuffer::Create(batch);
    if (!d_labels.ok()) return d_labels.status();
    m->labels_ = *std::move(d_labels);
    return m;
  }

  absl::StatusOr<double> Gradient(const float* x, uint32_t rank, uint64_t step, float* g) override {
    const size_t batch = model_.options().batch;
    const size_t image_bytes = batch * model_.dataset().dim() * sizeof(float);
    if (absl::Status st = model_.sampler().BatchIndices(rank, step, idx_.data()); !st.ok()) {
      return st;
    }
    // The previous call waited for its copies, so the pinned buffers are free;
    // the gather overlaps whatever else is still queued on the stream.
    float* images = static_cast<float*>(host_images_.get());
    uint8_t* labels = static_cast<uint8_t*>(host_labels_.get());
    model_.dataset().GatherTrain(idx_.data(), batch, images, labels);
    absl::Status st = CudaError(
        cudaMemcpyAsync(images_.data(), images, image_bytes, cudaMemcpyHostToDevice, stream_),
        "cudaMemcpyAsync (images)");
    if (st.ok()) {
      st =
          CudaError(cudaMemcpyAsync(labels_.data(), labels, batch, cudaMemcpyHostToDevice, stream_),
                    "cudaMemcpyAsync (labels)");
    }
    if (st.ok()) {
      absl::StatusOr<double> loss =
          mlp_->Gradient(x, images_.as<float>(), labels_.as<uint8_t>(), batch, g);
      if (loss.ok()) return loss;
      st = loss.status();
    }
    // On error a copy may still be reading the pinned buffers: wait, so that
    // the next call may overwrite them.
    st.Update(cuda::Synchronize(stream_));
    return absl::Status(st.code(), absl::StrCat(st.message(), " at rank ", rank, " step ", step));
  }

  bool can_evaluate() const override { return true; }

  absl::StatusOr<EvalResult> Evaluate(const float* x) override {
    if (!test_uploaded_) {
      if (absl::Status st = UploadTestSet(); !st.ok()) return st;
    }
    return mlp_->Evaluate(x, test_images_.as<float>(), test_labels_.as<uint8_t>(),
                          model_.dataset().num_test());
  }

 private:
  MlpGpu(const MlpModel& model, cuda::Stream stream, std::unique_ptr<cuda::MlpDevice> mlp)
      : model_(model), stream_(stream), mlp_(std::move(mlp)) {}

  // The whole test set as GatherTest writes it (the dataset already holds
  // only max_test examples where that option is set), once.
  absl::Status UploadTestSet() {
    const ImageDataset& data = model_.dataset();
    const size_t n = data.num_test();
    std::vector<float> images(n * data.dim());
    std::vector<uint8_t> labels(n);
    data.GatherTest(0, n, images.data(), labels.data());
    absl::StatusOr<DeviceBuffer> d_images = DeviceBuffer::Create(images.size() * sizeof(float));
    if (!d_images.ok()) return d_images.status();
    absl::StatusOr<DeviceBuffer> d_labels = DeviceBuffer::Create(labels.size());
    if (!d_labels.ok()) return d_labels.status();
    absl::Status st =
        UploadAndWait(d_images->data(), images.data(), images.size() * sizeof(float), stream_);
    if (st.ok()) st = UploadAndWait(d_labels->data(), labels.data(), labels.size(), stream_);
    if (!st.ok()) return st;
    test_images_ = *std::move(d_images);
    test_labels_ = *std::move(d_labels);
    test_uploaded_ = true;
    return absl::OkStatus();
  }

  const MlpModel& model_;
  const cuda::Stream stream_;
  const std::unique_ptr<cuda::MlpDevice> mlp_;
  std::vector<uint32_t> idx_;
  Pinned host_images_, host_labels_;  // one batch, gathered on the host
  DeviceBuffer images_, labels_;      // the same batch on the device
  bool test_uploaded_ = false;
  DeviceBuffer test_images_, test_labels_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceModel>> NewCudaDeviceModel(const Model* model,
                                                                cuda::Stream stream) {
  if (model == nullptr) return absl::InvalidArgumentError("no model to put on the GPU");
  if (const auto* s = dynamic_cast<const SyntheticModel*>(model); s != nullptr) {
    return SyntheticGpu::Create(*s, stream);
  }
  if (const auto* m = dynamic_cast<const MlpModel*>(model); m != nullptr) {
    return MlpGpu::Create(*m, stream);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no GPU version of model ", TypeName(*model), " (only synthetic and mlp)"));
}

}  // namespace onebit
