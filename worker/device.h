// Where a worker trains (--device): which replica it builds (worker/replica.h).
#ifndef ONEBIT_WORKER_DEVICE_H_
#define ONEBIT_WORKER_DEVICE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/replica.h"

namespace onebit {

struct DeviceChoice {
  enum class Kind { kCpu, kCuda, kCudaTwin };
  Kind kind = Kind::kCpu;
  int index = 0;       // kCuda: the GPU
  std::string notice;  // one line to print, e.g. why auto chose the CPU
};

// flag: "cpu"; "cuda" or "cuda:N" (GPU N, default 0: an error when no GPU is
// usable or the binary lacks CUDA); "auto" (GPU 0 when one is usable, else
// the CPU, with a notice in a CUDA build); "cuda-twin" (the GPU worker's code
// on the CPU twins of its kernels: tests it without a GPU). Errors name the
// problem and start with "--device: ".
absl::StatusOr<DeviceChoice> ChooseDevice(absl::string_view flag);

// "cpu", "cuda:N" or "cuda-twin".
std::string DeviceName(const DeviceChoice& choice);

// The replica of d parameters for `choice`: selects the GPU and builds the
// model's device version for kCuda. `model` (null: the caller computes the
// gradient into Replica::grads()) and `optimizer` must outlive it.
absl::StatusOr<std::unique_ptr<Replica>> NewReplica(const DeviceChoice& choice, uint64_t d,
                                                    const Model* model,
                                                    const WorkerOptimizer* optimizer);

}  // namespace onebit

#endif  // ONEBIT_WORKER_DEVICE_H_
