#include "optim/array_ops.h"

#include <algorithm>
#include <vector>

#include "optim/step_parts.h"
#include "optim/update_kernels.h"

namespace onebit {

absl::Status ArrayOps::UpdateMomentumAndEncode(const Codec& codec, const float* g, float b1,
                                               float c1, size_t n, float* m, float* e,
                                               uint8_t* out) const {
  if (absl::Status st = UpdateMomentum(g, b1, c1, n, m); !st.ok()) return st;
  return Encode(codec, m, e, n, out);
}

absl::Status ArrayOps::DecodeThen(const Codec& codec, Payload in, size_t n, float* out,
                                  absl::FunctionRef<absl::Status(size_t, size_t)> then) const {
  if (absl::Status st = Decode(codec, in, n, out); !st.ok()) return st;
  return n == 0 ? absl::OkStatus() : then(0, n);
}

absl::Status ArrayOps::UpdateHeldMomentumAndEncode(const Codec&, const uint8_t*, const Codec&,
                                                   const float*, float, float, size_t, float*,
                                                   uint8_t*) const {
  return absl::UnimplementedError("a held momentum is in host memory");
}

absl::Status ArrayOps::DecodePiecesThen(
    const Codec& codec, Payload in, size_t n,
    absl::FunctionRef<absl::Status(size_t, size_t, const float*)> then) const {
  absl::StatusOr<float*> d = Scratch(n);
  if (!d.ok()) return d.status();
  if (absl::Status st = Decode(codec, in, n, *d); !st.ok()) return st;
  return n == 0 ? absl::OkStatus() : then(0, n, *d);
}

namespace {

// A piece of floats per thread, for the host's fused passes.
float* PieceBuffer(size_t n) {
  thread_local std::vector<float> piece;
  if (piece.size() < n) piece.resize(n);
  return piece.data();
}

class HostOps final : public ArrayOps {
 public:
  absl::Status UpdateHeldMomentumAndEncode(const Codec& held_codec, const uint8_t* held,
                                           const Codec& codec, const float* g, float b1, float c1,
                                           size_t n, float* e, uint8_t* out) const override {
    float* m = PieceBuffer(codec.piece_elems());
    auto momentum = [&](size_t b, size_t end) -> const float* {
      held_codec.DecodeRange(held, n, b, end, m);
      onebit::UpdateMomentum(g + b, b1, c1, end - b, m);
      return m;
    };
    return codec.EncodeInPieces(nullptr, e, n, out, {std::nullopt, std::nullopt, momentum});
  }
  absl::Status DecodePiecesThen(
      const Codec& codec, Payload in, size_t n,
      absl::FunctionRef<absl::Status(size_t, size_t, const float*)> then) const override {
    if (absl::Status st = codec.CheckPayload(in.host, n); !st.ok()) return st;
    const size_t piece = codec.piece_elems();
    float* d = PieceBuffer(piece);
    for (size_t b = 0; b < n; b += piece) {
      const size_t e = std::min(n, b + piece);
      codec.DecodeRange(in.host, n, b, e, d);
      if (absl::Status st = then(b, e, d); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  absl::Status UpdateMomentumAndEncode(const Codec& codec, const float* g, float b1, float c1,
                                       size_t n, float* m, float* e, uint8_t* out) const override {
    auto momentum = [&](size_t b, size_t end) {
      onebit::UpdateMomentum(g + b, b1, c1, end - b, m + b);
    };
    return codec.EncodeInPieces(m, e, n, out, {momentum, std::nullopt, std::nullopt});
  }
  absl::Status DecodeThen(const Codec& codec, Payload in, size_t n, float* out,
                          absl::FunctionRef<absl::Status(size_t, size_t)> then) const override {
    return codec.DecodeInPieces(in.host, n, out,
                                [&](size_t b, size_t e, const float*) { return then(b, e); });
  }
  absl::Status Encode(const Codec& codec, const float* y, float* e, size_t n,
                      uint8_t* out) const override {
    return e != nullptr ? codec.EncodeWithFeedback(y, e, n, out) : codec.Encode(y, n, out);
  }
  // The codecs check the payload as they decode it.
  absl::Status Decode(const Codec& codec, Payload in, size_t n, float* out) const override {
    return codec.Decode(in.host, n, out);
  }
  absl::Status DecodeAdd(const Codec& codec, Payload in, size_t n, float* acc) const override {
    return codec.DecodeAdd(in.host, n, 1.0f, acc);
  }
  absl::Status Copy(const float* from, size_t n, float* to) const override {
    std::copy(from, from + n, to);
    return absl::OkStatus();
  }
  absl::Status Zero(size_t n, float* out) const override {
    std::fill(out, out + n, 0.0f);
    return absl::OkStatus();
  }
  absl::Status UpdateMomentum(const float* g, float b1, float c1, size_t n,
                              float* m) const override {
    onebit::UpdateMomentum(g, b1, c1, n, m);
    return absl::OkStatus();
  }
  absl::Status UpdateMoments(const float* g, float b1, float c1, float b2, float c2, size_t n,
                             float* m, float* v) const override {
    onebit::UpdateMoments(g, b1, c1, b2, c2, n, m, v);
    return absl::OkStatus();
  }
  absl::Status ApplyMomentum(const float* mbar, const float* den, float lr, float wd, size_t n,
                             float* x) const override {
    onebit::ApplyMomentum(mbar, den, lr, wd, n, x);
    return absl::OkStatus();
  }
  absl::Status FrozenDenominators(const float* v, float eps, size_t n, float* den) const override {
    onebit::FrozenDenominators(v, eps, n, den);
    return absl::OkStatus();
  }
  absl::Status VarianceDenominators(const float* v, float c, float floor, float eps, size_t n,
                                    float* den) const override {
    onebit::VarianceDenominators(v, c, floor, eps, n, den);
    return absl::OkStatus();
  }
  absl::Status UpdateSinceSync(const float* x, const float* x_sync, const float* den, size_t n,
                               float* u) const override {
    onebit::UpdateSinceSync(x, x_sync, den, n, u);
    return absl::OkStatus();
  }
  absl::Status ApplySync(const float* a, const float* den, float lrs, size_t n, float* x_sync,
                         float* m, float* x) const override {
    onebit::ApplySync(a, den, lrs, n, x_sync, m, x);
    return absl::OkStatus();
  }
  absl::Status LambApply(const float* mbar, const float* den, float k, float wd, size_t n,
                         float* x) const override {
    onebit::LambApply(mbar, den, k, wd, n, x);
    return absl::OkStatus();
  }
  absl::Status Axpy(const float* x, size_t n, float w, float* acc) const override {
    onebit::Axpy(x, n, w, acc);
    return absl::OkStatus();
  }
  absl::Status AdamUpdate(const AdamCoefficients& c, size_t n, float* g, float* m, float* v,
                          float* x) const override {
    onebit::AdamUpdate(c, n, g, m, v, x);
    return absl::OkStatus();
  }
  absl::StatusOr<size_t> FirstNonFinite(const float* y, size_t n) const override {
    return onebit::FirstNonFinite(y, n);
  }
  absl::StatusOr<float*> Scratch(size_t n) const override { return onebit::Scratch(n); }
};

}  // namespace

const ArrayOps& HostArrayOps() {
  static const HostOps ops;
  return ops;
}

}  // namespace onebit
