// What a worker's rule (optim/algorithm.h) computes with: the codecs and the
// update loops over arrays in one memory. HostArrayOps() works on host
// memory with compress/'s codecs (their AVX2 or AVX-512 kernels where the
// CPU has them) and optim/update_kernels.h's loops: the CPU worker's
// arithmetic. cuda/ supplies the same operations on a device's memory
// (cuda/array_ops.h), on the GPU or its CPU twin, with kernels that round
// as these do (docs/design.md §1.3), so one rule serves both and a GPU
// worker equals a CPU worker bit for bit.
//
// Every pointer an operation takes is in the operations' memory, except a
// Payload's `host` side. Operations run in order; a device's may still be
// running when they return (its replica waits before it reads results on the
// host). Errors are Status; an operation that fails writes nothing.
//
// HostArrayOps() is thread-safe (its scratch is per thread). A device's
// operations are bound to one stream: one thread at a time.
#ifndef ONEBIT_OPTIM_ARRAY_OPS_H_
#define ONEBIT_OPTIM_ARRAY_OPS_H_

#include <cstddef>
#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "compress/codec.h"
#include "optim/update_kernels.h"

namespace onebit {

// Bytes a worker received: as they arrived (host memory, where the rule
// checks them and reads scalars) and their copy in the operations' memory
// (what the operations decode). The same pointer twice for the host's.
struct Payload {
  const uint8_t* host = nullptr;
  const uint8_t* local = nullptr;
  Payload At(size_t offset) const { return {host + offset, local + offset}; }
};

class ArrayOps {
 public:
  virtual ~ArrayOps() = default;

  // out[0, codec.EncodedSize(n)) = C(y); with e != nullptr, C(y + e) and
  // e = y + e - D(out) (Codec::EncodeWithFeedback). All or nothing: a
  // non-finite or unencodable value is an error naming its index, and then
  // e and out are as they were.
  virtual absl::Status Encode(const Codec& codec, const float* y, float* e, size_t n,
                              uint8_t* out) const = 0;
  // out = D(in), acc += D(in), for a payload of n elements. The payload is
  // checked first (Codec::CheckPayload on in.host): a bad one is the codec's
  // error and changes nothing. in.local must be 4-byte aligned (fp32 Decode
  // excepted).
  virtual absl::Status Decode(const Codec& codec, Payload in, size_t n, float* out) const = 0;
  virtual absl::Status DecodeAdd(const Codec& codec, Payload in, size_t n, float* acc) const = 0;

  // The step's fused forms, one pass over memory where the operations can
  // (the host's, piece by piece: Codec::EncodeInPieces); by default (a
  // device's) the plain operations one after the other, which compute the
  // same bits.
  //
  // m = b1 m + c1 g (UpdateMomentum), then Encode(codec, m, e, n, out). Not
  // all or nothing: on a value that cannot be encoded, the error names its
  // index, and m and e may have changed (the caller fails its step).
  virtual absl::Status UpdateMomentumAndEncode(const Codec& codec, const float* g, float b1,
                                               float c1, size_t n, float* m, float* e,
                                               uint8_t* out) const;
  // Decode(codec, in, n, out), then `then(b, e)` over consecutive pieces
  // [b, e) of [0, n), each while out[b, e) is fresh (one piece after the
  // whole decode by default). A bad payload changes nothing; an error of
  // `then` ends the call.
  virtual absl::Status DecodeThen(const Codec& codec, Payload in, size_t n, float* out,
                                  absl::FunctionRef<absl::Status(size_t b, size_t e)> then) const;

  // Host memory only (a held momentum is a CPU replica's; a device's
  // operations return Unimplemented): UpdateMomentumAndEncode of the
  // momentum m = held_codec.D(held) of n elements, without writing m
  // anywhere (each piece is decoded, updated and encoded in cache).
  // Requires a held payload Decode accepts and codec.piece_elems() a
  // multiple of held_codec.piece_elems(). Not all or nothing, as
  // UpdateMomentumAndEncode.
  virtual absl::Status UpdateHeldMomentumAndEncode(const Codec& held_codec, const uint8_t* held,
                                                   const Codec& codec, const float* g, float b1,
                                                   float c1, size_t n, float* e,
                                                   uint8_t* out) const;
  // `then(b, e, d)` over consecutive pieces [b, e) of [0, n), d the piece
  // of D(in) (valid during the call), without writing D(in) to memory. A
  // bad payload is the codec's error and runs nothing; an error of `then`
  // ends the call. By default the whole payload is decoded into Scratch.
  virtual absl::Status DecodePiecesThen(
      const Codec& codec, Payload in, size_t n,
      absl::FunctionRef<absl::Status(size_t b, size_t e, const float* d)> then) const;

  // to = from; out = +0.
  virtual absl::Status Copy(const float* from, size_t n, float* to) const = 0;
  virtual absl::Status Zero(size_t n, float* out) const = 0;

  // The loops of optim/update_kernels.h, with their arguments.
  virtual absl::Status UpdateMomentum(const float* g, float b1, float c1, size_t n,
                                      float* m) const = 0;
  virtual absl::Status UpdateMoments(const float* g, float b1, float c1, float b2, float c2,
                                     size_t n, float* m, float* v) const = 0;
  virtual absl::Status ApplyMomentum(const float* mbar, const float* den, float lr, float wd,
                                     size_t n, float* x) const = 0;
  virtual absl::Status FrozenDenominators(const float* v, float eps, size_t n,
                                          float* den) const = 0;
  virtual absl::Status VarianceDenominators(const float* v, float c, float floor, float eps,
                                            size_t n, float* den) const = 0;
  virtual absl::Status UpdateSinceSync(const float* x, const float* x_sync, const float* den,
                                       size_t n, float* u) const = 0;
  virtual absl::Status ApplySync(const float* a, const float* den, float lrs, size_t n,
                                 float* x_sync, float* m, float* x) const = 0;
  virtual absl::Status LambApply(const float* mbar, const float* den, float k, float wd, size_t n,
                                 float* x) const = 0;
  // acc += w * x (one rounding per element: w = -1 subtracts exactly as the
  // host does).
  virtual absl::Status Axpy(const float* x, size_t n, float w, float* acc) const = 0;
  // The index of the first non-finite y[i], or n when all are finite.
  virtual absl::StatusOr<size_t> FirstNonFinite(const float* y, size_t n) const = 0;
  // One Adam(W) step with the host's coefficients; g becomes the delta.
  virtual absl::Status AdamUpdate(const AdamCoefficients& c, size_t n, float* g, float* m, float* v,
                                  float* x) const = 0;

  // n floats of the operations' memory, for a rule's temporaries; valid
  // until the next Scratch on these operations (the host's: on this thread).
  virtual absl::StatusOr<float*> Scratch(size_t n) const = 0;
};

// The host's operations: what CPU workers and the reference run.
const ArrayOps& HostArrayOps();

}  // namespace onebit

#endif  // ONEBIT_OPTIM_ARRAY_OPS_H_
