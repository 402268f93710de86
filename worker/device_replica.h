// A worker's replica on a device (cuda/backend.h): x, the gradient, the
// momentum, both error buffers and the frozen preconditioner live in device
// memory; the gradient comes from a DeviceModel on the device; only payloads
// cross to the host. Two streams, one per direction: the push stream runs
// the model, the momentum update, the encode and the copy of each payload
// into pinned memory; the reply stream copies each reply from pinned memory
// and applies it, while the host goes on receiving the next.
//
// The arithmetic is CpuReplica's (optim/optimizer.h, WorkerOptimizer), kernel
// for kernel through the CPU twins' GPU versions, so a GPU replica equals a
// CPU replica of the same job bit for bit (docs/design.md §1.3). Replies are
// checked on the host, where they arrive (Codec::CheckPayload), before
// anything is copied; a push that fails (a non-finite value) leaves the error
// buffers as they were, as the codecs do.
//
// Memory: device 4 floats per parameter (x, g, 2 error buffers) plus m̄ and
// v's denominator where the optimizer has them; pinned host memory of one
// fp32 copy of x (a slot per reply chunk, so copies need not wait for each
// other) and one push chunk.
#ifndef ONEBIT_WORKER_DEVICE_REPLICA_H_
#define ONEBIT_WORKER_DEVICE_REPLICA_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cuda/backend.h"
#include "worker/device_model.h"
#include "worker/replica.h"

namespace onebit {

// Makes the model's device version, working on the given stream.
using DeviceModelFactory =
    std::function<absl::StatusOr<std::unique_ptr<DeviceModel>>(cuda::Stream stream)>;

// `device`: its name for logs. `model` (the host model of d parameters:
// initial x) and `optimizer` must outlive the replica. Without a model
// (`model` null, `make_model` empty) x starts at zero and the caller writes
// the gradient into grads(). For the CUDA backend the device must be
// selected (cuda::SelectDevice) on the calling thread.
absl::StatusOr<std::unique_ptr<Replica>> NewDeviceReplica(const cuda::Backend* backend,
                                                          std::string device, uint64_t d,
                                                          const Model* model,
                                                          const WorkerOptimizer* optimizer,
                                                          const DeviceModelFactory& make_model);

}  // namespace onebit

#endif  // ONEBIT_WORKER_DEVICE_REPLICA_H_
