// GPU discovery. A binary built with CUDA runs on a machine without a GPU: it
// asks here, is told there is none, and takes the CPU path.
#ifndef ONEBIT_CUDA_DEVICE_H_
#define ONEBIT_CUDA_DEVICE_H_

#include <string>

namespace onebit::cuda {

// True when this binary was built with the CUDA kernels.
bool BuiltWithCuda();

// Number of usable CUDA devices: 0 when built without CUDA, when no driver or
// GPU is present, or when the driver refuses (the reason goes to *why).
int DeviceCount(std::string* why = nullptr);

}  // namespace onebit::cuda

#endif  // ONEBIT_CUDA_DEVICE_H_
