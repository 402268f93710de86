#include "cuda/device.h"

#ifdef ONEBIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace onebit::cuda {

bool BuiltWithCuda() {
#ifdef ONEBIT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int DeviceCount(std::string* why) {
#ifdef ONEBIT_WITH_CUDA
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why) *why = cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  if (count == 0 && why) *why = "no CUDA device";
  return count;
#else
  if (why) *why = "built without CUDA";
  return 0;
#endif
}

}  // namespace onebit::cuda
