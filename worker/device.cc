#include "worker/device.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cuda/backend.h"
#include "cuda/device.h"
#include "worker/device_model.h"
#include "worker/device_replica.h"

namespace onebit {

absl::StatusOr<DeviceChoice> ChooseDevice(absl::string_view flag) {
  DeviceChoice c;
  if (flag == "cpu") return c;
  if (flag == "cuda-twin") {
    c.kind = DeviceChoice::Kind::kCudaTwin;
    return c;
  }
  std::string why;
  if (flag == "auto") {
    if (!cuda::BuiltWithCuda()) return c;  // nothing to tell: the CPU is all there is
    if (cuda::DeviceCount(&why) > 0) {
      c.kind = DeviceChoice::Kind::kCuda;
      return c;
    }
    c.notice =
        absl::StrCat("built with CUDA, but no GPU is usable (", why, "): training on the CPU");
    return c;
  }
  if (flag == "cuda" || absl::StartsWith(flag, "cuda:")) {
    c.kind = DeviceChoice::Kind::kCuda;
    if (flag != "cuda" && (!absl::SimpleAtoi(flag.substr(5), &c.index) || c.index < 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device: bad GPU index in '", flag, "' (cuda:N, N >= 0)"));
    }
    if (!cuda::BuiltWithCuda()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--device ", flag, ": this binary was built without CUDA (use --device cpu)"));
    }
    const int count = cuda::DeviceCount(&why);
    if (count == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("--device ", flag, ": no GPU is usable (", why, ")"));
    }
    if (c.index >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device ", flag, ": no GPU ", c.index, " (", count, " usable here)"));
    }
    return c;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device: unknown device '", flag, "' (cpu, cuda, cuda:N, auto or cuda-twin)"));
}

std::string DeviceName(const DeviceChoice& choice) {
  switch (choice.kind) {
    case DeviceChoice::Kind::kCpu:
      return "cpu";
    case DeviceChoice::Kind::kCuda:
      return absl::StrCat("cuda:", choice.index);
    case DeviceChoice::Kind::kCudaTwin:
      return "cuda-twin";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<Replica>> NewReplica(const DeviceChoice& choice, uint64_t d,
                                                    const Model* model,
                                                    const WorkerOptimizer* optimizer) {
  if (model != nullptr && model->num_params() != d) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model has ", model->num_params(), " parameters, not ", d));
  }
  switch (choice.kind) {
    case DeviceChoice::Kind::kCpu:
      return NewCpuReplica(d, model, optimizer);
    case DeviceChoice::Kind::kCudaTwin: {
      DeviceModelFactory make;
      if (model != nullptr) {
        make = [model](cuda::Stream) -> absl::StatusOr<std::unique_ptr<DeviceModel>> {
          return NewHostDeviceModel(model);
        };
      }
      return NewDeviceReplica(&cuda::TwinBackend(), "cuda-twin", d, model, optimizer, make);
    }
    case DeviceChoice::Kind::kCuda: {
      if (cuda::CudaBackend() == nullptr) {
        return absl::FailedPreconditionError("this binary was built without CUDA");
      }
      auto name = cuda::SelectDevice(choice.index);
      if (!name.ok()) return name.status();
      DeviceModelFactory make;
      if (model != nullptr) {
        make = [model](cuda::Stream s) { return NewCudaDeviceModel(model, s); };
      }
      return NewDeviceReplica(cuda::CudaBackend(),
                              absl::StrCat("cuda:", choice.index, " (", *name, ")"), d, model,
                              optimizer, make);
    }
  }
  return absl::InternalError("unknown device kind");
}

}  // namespace onebit
