// A worker's replica on a device (cuda/backend.h): x, the gradient and the
// arrays of the optimizer's state live in device memory; the gradient comes
// from a DeviceModel on the device; only payloads cross to the host. Two
// streams, one per direction: the push stream runs the model, the worker
// rule's push (and local steps) and the copy of each payload into pinned
// memory; the reply stream copies each reply from pinned memory and applies
// it, while the host goes on receiving the next.
//
// The arithmetic is the optimizer's worker rule itself (optim/algorithm.h,
// through WorkerOptimizer), the one CpuReplica runs, on the backend's
// operations (cuda/array_ops.h) instead of the host's, so a GPU replica
// equals a CPU replica of the same job bit for bit (docs/design.md §1.3),
// for every optimizer and warm-up codec. Replies are checked on the host,
// where they arrive, before anything changes; a push that fails (a
// non-finite value) leaves the error buffer as it was, as the codecs do.
//
// Memory: device 2 floats per parameter (x, g; g where another process of
// the host can map it, Backend::alloc_shared) plus each array either phase
// of the optimizer holds (WorkerOptimizer::WorkerArraysIn; zero-one-adam's
// v and x_sync share one), a reply chunk and a push chunk, and on a local
// ranks' leader one more for their mean (MeanGradsWith); pinned host
// memory of one fp32 copy of x (a slot per reply chunk, so copies need not
// wait for each other) and one push chunk.
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
