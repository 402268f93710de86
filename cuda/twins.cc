// CPU twins that compress/ and shard/ do not already have with the GPU
// signature: the fused error-feedback encode with separate error buffers,
// built on the onebit codec (which every GPU output must equal anyway).
#include <algorithm>
#include <vector>

#include "cuda/kernels.h"

namespace onebit::cuda {

absl::Status OnebitEncodeCpu(const float* y, const float* e_in, float* e_out, size_t n,
                             uint32_t block, ScaleRule rule, uint8_t* out) {
  CodecOptions o;
  o.block_size = block;
  o.scale = rule;
  auto codec = NewCodec(CodecKind::kOnebit, o);
  if (!codec.ok()) return codec.status();
  if (n == 0) return absl::OkStatus();
  if (e_in != nullptr) {
    // The codec updates e in place, all or nothing: work on a copy so that
    // e_in stays as it was, as on the GPU.
    std::vector<float> e(e_in, e_in + n);
    absl::Status st = (*codec)->EncodeWithFeedback(y, e.data(), n, out);
    if (st.ok() && e_out != nullptr) std::copy(e.begin(), e.end(), e_out);
    return st;
  }
  absl::Status st = (*codec)->Encode(y, n, out);
  if (!st.ok() || e_out == nullptr) return st;
  // e = y - D(C(y)); not EncodeWithFeedback with a zero e, which would turn
  // -0.0 into +0.0 in z = y + 0.
  st = (*codec)->Decode(out, n, e_out);
  if (!st.ok()) return st;
  for (size_t i = 0; i < n; ++i) e_out[i] = y[i] - e_out[i];
  return absl::OkStatus();
}

}  // namespace onebit::cuda
