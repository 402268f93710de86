// The CPU twin backend (cuda/backend.h): host memory and the CPU twins of the
// kernels, run at once (there are no streams). Always built, so that the GPU
// worker's code is compiled and tested everywhere.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "compress/kernels.h"
#include "cuda/backend.h"
#include "optim/update_kernels.h"

namespace onebit::cuda {
namespace {

using compress_internal::Kernels;

// Every SIMD path gives the same bytes (compress/codec.h): take the fast one.
const Kernels& K() {
  static const Kernels& k =
      CpuHasAvx2() ? compress_internal::Avx2Kernels() : compress_internal::ScalarKernels();
  return k;
}

absl::StatusOr<void*> Alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  // 64-byte aligned like the device's allocations (at least 256 there).
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  return p;
}
// The twin's shared memory: a memfd's pages, mapped. Another process maps
// them through /proc/<pid>/fd/<fd> (same user: /proc grants it), so the
// handle is "<pid> <fd>".
struct SharedMapping {
  int fd = -1;
  size_t bytes = 0;
};
absl::Mutex g_shared_mu;
absl::flat_hash_map<void*, SharedMapping>& Shared() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_shared_mu) {
  static auto* m = new absl::flat_hash_map<void*, SharedMapping>;
  return *m;
}

absl::StatusOr<void*> AllocShared(size_t bytes) {
  if (bytes == 0) return nullptr;
  const int fd = memfd_create("onebit-twin-shared", MFD_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, "memfd_create");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("sizing shared memory to ", bytes, " bytes"));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("mapping ", bytes, " bytes of shared memory"));
  }
  absl::MutexLock l(&g_shared_mu);
  Shared()[p] = SharedMapping{fd, bytes};
  return p;
}

void Free(void* p) {
  if (p == nullptr) return;
  {
    absl::MutexLock l(&g_shared_mu);
    auto it = Shared().find(p);
    if (it != Shared().end()) {
      munmap(p, it->second.bytes);
      close(it->second.fd);
      Shared().erase(it);
      return;
    }
  }
  std::free(p);
}

absl::StatusOr<std::string> ExportMemory(void* p, size_t bytes) {
  absl::MutexLock l(&g_shared_mu);
  auto it = Shared().find(p);
  if (it == Shared().end() || it->second.bytes < bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("exporting ", bytes, " bytes: not memory of alloc_shared"));
  }
  return absl::StrCat(getpid(), " ", it->second.fd);
}

absl::StatusOr<void*> ImportMemory(const std::string& handle, size_t bytes) {
  int pid = 0, fd = -1;
  const std::vector<std::string> parts = absl::StrSplit(handle, ' ');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &pid) || !absl::SimpleAtoi(parts[1], &fd) ||
      pid <= 0 || fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", absl::CHexEscape(handle), "' is not a handle of the twin's memory"));
  }
  const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
  const int own = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (own < 0) return absl::ErrnoToStatus(errno, absl::StrCat("opening ", path));
  struct stat st = {};
  if (fstat(own, &st) != 0 || st.st_size < static_cast<off_t>(bytes)) {
    close(own);
    return absl::InvalidArgumentError(
        absl::StrCat(path, " holds ", st.st_size, " bytes, fewer than the ", bytes, " asked for"));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, own, 0);
  const int err = errno;
  close(own);  // the mapping keeps the pages
  if (p == MAP_FAILED) return absl::ErrnoToStatus(err, absl::StrCat("mapping ", path));
  return p;
}

void CloseImported(void* p, size_t bytes) {
  if (p != nullptr) munmap(p, bytes);
}

absl::StatusOr<Stream> CreateStream() { return nullptr; }
void DestroyStream(Stream) {}

absl::Status Copy(void* dst, const void* src, size_t bytes, Stream) {
  if (bytes > 0) std::memmove(dst, src, bytes);
  return absl::OkStatus();
}
absl::Status SetZero(void* dst, size_t bytes, Stream) {
  if (bytes > 0) std::memset(dst, 0, bytes);
  return absl::OkStatus();
}
absl::Status Synchronize(Stream) { return absl::OkStatus(); }

absl::Status OnebitEncodeTwin(const float* y, const float* e_in, float* e_out, size_t n,
                              uint32_t block, ScaleRule rule, uint8_t* out, Stream) {
  return OnebitEncodeCpu(y, e_in, e_out, n, block, rule, out);
}
absl::Status OnebitSignsTwin(const float* y, float* e, size_t n, uint32_t block,
                             const float* scales, uint8_t* bits, Stream) {
  K().onebit_signs(y, e, n, block, scales, bits);
  return absl::OkStatus();
}
absl::Status OnebitDecodeTwin(const float* scales, const uint8_t* bits, size_t n, uint32_t block,
                              float* out, Stream) {
  K().onebit_decode(scales, bits, n, block, out);
  return absl::OkStatus();
}
absl::Status OnebitDecodeAddTwin(const float* scales, const uint8_t* bits, size_t n, uint32_t block,
                                 float w, float* acc, Stream) {
  K().onebit_decode_add(scales, bits, n, block, w, acc);
  return absl::OkStatus();
}
absl::StatusOr<size_t> Fp16CheckTwin(const float* y, const float* e, size_t n, Stream) {
  return K().fp16_check(y, e, n);
}
absl::Status Fp16EncodeTwin(const float* y, float* e, size_t n, uint16_t* out, Stream) {
  K().fp16_encode(y, e, n, out);
  return absl::OkStatus();
}
absl::Status Fp16DecodeTwin(const uint16_t* in, size_t n, float* out, Stream) {
  K().fp16_decode(in, n, out);
  return absl::OkStatus();
}
absl::Status Fp16DecodeAddTwin(const uint16_t* in, size_t n, float w, float* acc, Stream) {
  K().fp16_decode_add(in, n, w, acc);
  return absl::OkStatus();
}
absl::StatusOr<size_t> FirstNonFiniteTwin(const float* y, const float* e, size_t n, Stream) {
  return K().first_nonfinite(y, e, n);
}
absl::Status AxpyTwin(const float* x, size_t n, float w, float* acc, Stream) {
  K().axpy(x, n, w, acc);
  return absl::OkStatus();
}
absl::Status UpdateMomentumTwin(const float* g, float b1, float c1, size_t n, float* m, Stream) {
  onebit::UpdateMomentum(g, b1, c1, n, m);
  return absl::OkStatus();
}
absl::Status ApplyMomentumTwin(const float* mbar, const float* den, float lr, float wd, size_t n,
                               float* x, Stream) {
  onebit::ApplyMomentum(mbar, den, lr, wd, n, x);
  return absl::OkStatus();
}

absl::Status UpdateMomentsTwin(const float* g, float b1, float c1, float b2, float c2, size_t n,
                               float* m, float* v, Stream) {
  onebit::UpdateMoments(g, b1, c1, b2, c2, n, m, v);
  return absl::OkStatus();
}
absl::Status FrozenDenominatorsTwin(const float* v, float eps, size_t n, float* den, Stream) {
  onebit::FrozenDenominators(v, eps, n, den);
  return absl::OkStatus();
}
absl::Status VarianceDenominatorsTwin(const float* v, float c, float floor, float eps, size_t n,
                                      float* den, Stream) {
  onebit::VarianceDenominators(v, c, floor, eps, n, den);
  return absl::OkStatus();
}
absl::Status UpdateSinceSyncTwin(const float* x, const float* x_sync, const float* den, size_t n,
                                 float* u, Stream) {
  onebit::UpdateSinceSync(x, x_sync, den, n, u);
  return absl::OkStatus();
}
absl::Status ApplySyncTwin(const float* a, const float* den, float lrs, size_t n, float* x_sync,
                           float* m, float* x, Stream) {
  onebit::ApplySync(a, den, lrs, n, x_sync, m, x);
  return absl::OkStatus();
}
absl::Status LambApplyTwin(const float* mbar, const float* den, float k, float wd, size_t n,
                           float* x, Stream) {
  onebit::LambApply(mbar, den, k, wd, n, x);
  return absl::OkStatus();
}

absl::Status AdamUpdateTwin(const AdamCoefficients& c, size_t n, float* g, float* m, float* v,
                            float* x, Stream) {
  onebit::AdamUpdate(c, n, g, m, v, x);
  return absl::OkStatus();
}

const Backend kTwin = {
    "cuda-twin",
    Alloc,
    Free,
    Alloc,
    Free,
    CreateStream,
    DestroyStream,
    Copy,
    Copy,
    SetZero,
    Copy,
    Synchronize,
    AllocShared,
    ExportMemory,
    ImportMemory,
    CloseImported,
    OnebitEncodeTwin,
    OnebitSignsTwin,
    OnebitDecodeTwin,
    OnebitDecodeAddTwin,
    Fp16CheckTwin,
    Fp16EncodeTwin,
    Fp16DecodeTwin,
    Fp16DecodeAddTwin,
    FirstNonFiniteTwin,
    AxpyTwin,
    UpdateMomentumTwin,
    ApplyMomentumTwin,
    UpdateMomentsTwin,
    FrozenDenominatorsTwin,
    VarianceDenominatorsTwin,
    UpdateSinceSyncTwin,
    ApplySyncTwin,
    LambApplyTwin,
    AdamUpdateTwin,
};

}  // namespace

const Backend& TwinBackend() { return kTwin; }

#ifndef ONEBIT_WITH_CUDA
const Backend* CudaBackend() { return nullptr; }
absl::StatusOr<std::string> SelectDevice(int) {
  return absl::FailedPreconditionError("this binary was built without CUDA");
}
#endif

}  // namespace onebit::cuda
