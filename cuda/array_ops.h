// A worker's operations (optim/array_ops.h) on a backend's memory
// (cuda/backend.h): the GPU's kernels, or their CPU twins, enqueued on one
// stream, so that the GPU worker runs the optimizers' worker rules as
// written, and the twin runs them on the CPU to test that code without a GPU.
//
// Codecs go to the backend's kernels by their kind, with the job's codec
// options (block size and scale rule; every codec of a job shares them).
// Payload checks run on the host, before anything is enqueued. Errors found
// on the device (a non-finite push) wait for the stream and read the bad
// value back to name it as compress/ does.
//
// One thread at a time, as the stream. The backend and the stream must
// outlive the operations; destroying them waits for the stream.
#ifndef ONEBIT_CUDA_ARRAY_OPS_H_
#define ONEBIT_CUDA_ARRAY_OPS_H_

#include <memory>

#include "compress/codec.h"
#include "cuda/backend.h"
#include "optim/array_ops.h"

namespace onebit::cuda {

std::unique_ptr<ArrayOps> NewArrayOps(const Backend& backend, Stream stream,
                                      const CodecOptions& codec);

}  // namespace onebit::cuda

#endif  // ONEBIT_CUDA_ARRAY_OPS_H_
