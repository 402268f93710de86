#include "worker/device_replica.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/state_file.h"
#include "optim/update_kernels.h"

namespace onebit {
namespace {

using cuda::Backend;
using cuda::Stream;

// An owned allocation of the backend: device memory, or pinned host memory.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Backend* b, void* p, size_t bytes, bool pinned)
      : b_(b), p_(p), bytes_(bytes), pinned_(pinned) {}
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(b_, o.b_);
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    std::swap(pinned_, o.pinned_);
    return *this;
  }
  ~Buffer() {
    if (p_ != nullptr) (pinned_ ? b_->free_pinned : b_->free)(p_);
  }
  float* f() const { return static_cast<float*>(p_); }
  uint8_t* u8() const { return static_cast<uint8_t*>(p_); }
  size_t size() const { return bytes_; }

 private:
  const Backend* b_ = nullptr;
  void* p_ = nullptr;
  size_t bytes_ = 0;
  bool pinned_ = false;
};

class DeviceReplica final : public Replica {
 public:
  DeviceReplica(const Backend* backend, std::string device, uint64_t d, const Model* model,
                const WorkerOptimizer* optimizer)
      : b_(*backend),
        device_(std::move(device)),
        model_(model),
        opt_(optimizer),
        o_(optimizer->options()),
        d_(d) {}

  ~DeviceReplica() override {
    // Work still queued may touch the buffers freed after this.
    if (push_ != nullptr || reply_ != nullptr) {
      b_.synchronize(push_).IgnoreError();
      b_.synchronize(reply_).IgnoreError();
    }
    dmodel_.reset();
    b_.destroy_stream(push_);
    b_.destroy_stream(reply_);
  }

  absl::Status Create(const DeviceModelFactory& make_model) {
    auto push = b_.create_stream();
    if (!push.ok()) return push.status();
    push_ = *push;
    auto reply = b_.create_stream();
    if (!reply.ok()) return reply.status();
    reply_ = *reply;
    const size_t bytes = 4 * d_;
    for (Buffer* buf : {&x_, &g_}) {
      if (absl::Status st = Alloc(bytes, false, buf); !st.ok()) return st;
    }
    if (HasCompressionPhase(o_.kind)) {
      for (Buffer* buf : {&mbar_, &e_[0], &e_[1]}) {
        if (absl::Status st = Alloc(bytes, false, buf); !st.ok()) return st;
      }
    }
    if (TraitsOf(o_.kind).den_of_frozen_v) {
      if (absl::Status st = Alloc(bytes, false, &den_); !st.ok()) return st;
    }
    if (!make_model) return absl::OkStatus();  // the caller computes the gradient
    auto m = make_model(push_);
    if (!m.ok()) return m.status();
    dmodel_ = std::move(*m);
    return absl::OkStatus();
  }

  const std::string& device() const override { return device_; }
  uint64_t num_params() const override { return d_; }
  Phase phase() const override { return frozen_ ? Phase::kCompress : Phase::kWarmup; }
  const WorkerOptimizer& optimizer() const override { return *opt_; }

  absl::Status Init() override {
    std::vector<float> x(d_);
    if (model_ != nullptr) model_->Init(x.data());
    const size_t bytes = 4 * d_;
    absl::Status st = b_.copy_to_device(x_.f(), x.data(), bytes, push_);
    for (const Buffer* buf : {&g_, &mbar_, &e_[0], &e_[1], &den_}) {
      if (st.ok()) st = b_.set_zero(buf->u8(), buf->size(), push_);
    }
    if (st.ok()) st = b_.synchronize(push_);  // x (pageable) must be read before it goes
    frozen_ = !HasWarmup(o_.kind);
    e_side_.clear();
    e_len_.clear();
    return st;
  }

  absl::StatusOr<WorkerState> SaveState(const Parts& parts) override {
    WorkerState s;
    s.frozen = frozen_;
    absl::Status st = b_.synchronize(reply_);
    auto copy = [&](const Buffer& from, std::vector<float>* to) {
      *to = parts.buffers != nullptr ? parts.buffers->Take(d_) : SnapshotZeros(d_);
      if (st.ok()) st = b_.copy_to_host(to->data(), from.f(), 4 * d_, push_);
    };
    if (parts.x) copy(x_, &s.x);
    if (HasCompressionPhase(o_.kind)) {
      if (parts.mbar) copy(mbar_, &s.mbar);
      copy(e_[0], &s.e);  // chunks whose error is in e_[1] are copied over below
    }
    const bool den = parts.den && TraitsOf(o_.kind).den_of_frozen_v && frozen_;
    if (den) copy(den_, &s.den);
    for (const auto& [b, side] : e_side_) {
      if (side == 1 && st.ok()) {
        st = b_.copy_to_host(s.e.data() + b, e_[1].f() + b, 4 * e_len_.at(b), push_);
      }
    }
    if (st.ok()) st = b_.synchronize(push_);
    if (!st.ok()) return st;
    return s;
  }

  absl::Status RestoreState(const WorkerState& s) override {
    if (absl::Status st = CheckStateFits(s, d_, *opt_); !st.ok()) return st;
    absl::Status st = b_.synchronize(reply_);
    auto copy = [&](const std::vector<float>& from, const Buffer& to) {
      if (st.ok() && !from.empty()) st = b_.copy_to_device(to.f(), from.data(), 4 * d_, push_);
    };
    copy(s.x, x_);
    copy(s.mbar, mbar_);
    copy(s.e, e_[0]);
    copy(s.den, den_);
    if (st.ok()) st = b_.synchronize(push_);  // the host vectors are pageable
    if (!st.ok()) return st;
    frozen_ = s.frozen;
    e_side_.clear();  // every chunk's error is in e_[0] now
    e_len_.clear();
    return absl::OkStatus();
  }

  float* params() override { return x_.f(); }
  float* grads() override { return g_.f(); }

  absl::StatusOr<double> ComputeGradient(uint32_t rank, uint64_t step) override {
    if (dmodel_ == nullptr) return absl::FailedPreconditionError("the replica has no model");
    return dmodel_->Gradient(x_.f(), rank, step, g_.f());
  }

  // Every optimizer the device runs takes the learning rate from Apply.
  absl::Status BeginStep(uint64_t, float) override { return absl::OkStatus(); }
  absl::Status LocalStep(uint64_t step) override {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, ": a GPU replica takes no local steps"));
  }

  absl::Status Push(uint64_t step, uint64_t b, size_t n, uint8_t* out) override {
    (void)step;
    if (absl::Status st = CheckRange(b, n); !st.ok()) return st;
    const Codec& codec = opt_->push_codec(phase());
    const size_t bytes = codec.EncodedSize(n);
    if (staging_.size() < bytes) {
      if (absl::Status st = Alloc(bytes, true, &staging_); !st.ok()) return st;
    }
    // `from`: where the payload is on the device once encoded (nullptr: the
    // encode put it into staging_ itself).
    auto from = Encode(codec, b, n);
    if (!from.ok()) return from.status();
    absl::Status st = absl::OkStatus();
    if (*from != nullptr) st = b_.copy_to_host(staging_.u8(), *from, bytes, push_);
    if (st.ok()) st = b_.synchronize(push_);
    if (!st.ok()) return st;
    std::memcpy(out, staging_.u8(), bytes);
    return absl::OkStatus();
  }

  absl::Status Apply(uint64_t step, float lr, bool last_warmup, const uint8_t* reply, uint64_t b,
                     size_t n) override {
    (void)step;
    if (absl::Status st = CheckRange(b, n); !st.ok()) return st;
    const Phase ph = phase();
    const Codec& codec = opt_->reply_codec(ph);
    if (absl::Status st = codec.CheckPayload(reply, n); !st.ok()) return st;
    const bool hand_over = !frozen_ && last_warmup && TraitsOf(o_.kind).den_of_frozen_v;
    std::vector<float> den;
    if (hand_over) {
      // Checked and computed here, as WorkerOptimizer::Apply does, before
      // anything changes.
      const Codec& fp32 = opt_->fp32_codec();
      const uint8_t* tail = reply + 4 * n;
      absl::Status st = fp32.CheckPayload(tail, n);
      if (st.ok()) st = fp32.CheckPayload(tail + 4 * n, n);
      if (!st.ok()) return st;
      den.resize(n);
      std::memcpy(den.data(), tail + 4 * n, 4 * n);
      st = HandOverDenominators(den.data(), n, b, o_.eps, den.data());
      if (!st.ok()) return st;
    }
    // The payload goes through this chunk's own pinned slot into g[b, b+n),
    // free since the chunk was pushed (every payload fits in 4n bytes); an
    // fp32 momentum goes straight to m̄.
    const bool add = !frozen_ || o_.reply == ReplyMode::kDelta;
    const bool direct = !add && codec.kind() == CodecKind::kFp32;
    const size_t bytes = codec.EncodedSize(n);
    auto slot = Slot(b, n);
    if (!slot.ok()) return slot.status();
    std::memcpy(*slot, reply, bytes);
    float* x = x_.f() + b;
    float* mbar = direct || !add ? mbar_.f() + b : nullptr;
    uint8_t* p = direct ? reinterpret_cast<uint8_t*>(mbar) : reinterpret_cast<uint8_t*>(g_.f() + b);
    absl::Status st = b_.copy_to_device(p, *slot, bytes, reply_);
    if (!st.ok()) return st;
    if (!frozen_) {
      st = b_.axpy(reinterpret_cast<const float*>(p), n, 1.0f, x, reply_);
      if (st.ok() && hand_over) {
        // Once per run: pageable copies, waited for before den goes.
        st = b_.copy_to_device(mbar_.f() + b, reply + 4 * n, 4 * n, reply_);
        if (st.ok()) st = b_.copy_to_device(den_.f() + b, den.data(), 4 * n, reply_);
        if (st.ok()) st = b_.synchronize(reply_);
      }
      return st;
    }
    if (add) return DecodeTo(codec, p, n, /*add=*/true, x);
    if (!direct) st = DecodeTo(codec, p, n, /*add=*/false, mbar);
    if (!st.ok()) return st;
    const float* dn = TraitsOf(o_.kind).den_of_frozen_v ? den_.f() + b : nullptr;
    absl::Status result;
    ForEachWeightDecay(o_, b, n, [&](size_t p, size_t m, float wd) {
      if (!result.ok()) return;
      result =
          b_.apply_momentum(mbar + p, dn == nullptr ? nullptr : dn + p, lr, wd, m, x + p, reply_);
    });
    return result;
  }

  absl::Status FinishStep(bool entered_compression) override {
    absl::Status st = b_.synchronize(reply_);
    if (!st.ok()) return st;
    if (entered_compression) frozen_ = true;
    return absl::OkStatus();
  }

  absl::Status ReadX(float* x) override {
    absl::Status st = b_.synchronize(reply_);
    if (st.ok()) st = b_.copy_to_host(x, x_.f(), 4 * d_, push_);
    if (st.ok()) st = b_.synchronize(push_);
    return st;
  }

  absl::Status WriteX(uint64_t b, size_t n, const float* host) override {
    if (absl::Status st = CheckRange(b, n); !st.ok()) return st;
    absl::Status st = b_.synchronize(reply_);
    if (st.ok()) st = b_.copy_to_device(x_.f() + b, host, 4 * n, push_);
    if (st.ok()) st = b_.synchronize(push_);  // host is pageable memory
    return st;
  }

  bool can_evaluate() const override { return dmodel_ != nullptr && dmodel_->can_evaluate(); }
  absl::StatusOr<EvalResult> Evaluate() override {
    if (!can_evaluate()) return absl::FailedPreconditionError("the model has no test set");
    if (absl::Status st = b_.synchronize(reply_); !st.ok()) return st;
    return dmodel_->Evaluate(x_.f());
  }

 private:
  absl::Status Alloc(size_t bytes, bool pinned, Buffer* out) {
    auto p = (pinned ? b_.alloc_pinned : b_.alloc)(bytes);
    if (!p.ok()) {
      return absl::Status(p.status().code(),
                          absl::StrCat(device_, ": allocating ", bytes, pinned ? " pinned" : "",
                                       " bytes: ", p.status().message()));
    }
    *out = Buffer(&b_, *p, bytes, pinned);
    return absl::OkStatus();
  }

  absl::Status CheckRange(uint64_t b, size_t n) const {
    if (b > d_ || n > d_ - b) {
      return absl::OutOfRangeError(
          absl::StrCat("elements [", b, ", ", b + n, ") outside the ", d_, " parameters"));
    }
    return absl::OkStatus();
  }

  // A pinned slot of 4n bytes for the replies of the chunk at b.
  absl::StatusOr<uint8_t*> Slot(uint64_t b, size_t n) {
    Buffer& s = slots_[b];
    if (s.size() != 4 * n) {
      if (absl::Status st = Alloc(4 * n, true, &s); !st.ok()) return st;
    }
    return s.u8();
  }

  // "non-finite input at index i (...)", as the CPU codecs say it.
  absl::Status NonFinite(const float* y, const float* e, size_t i, const char* what) {
    float yv = 0, ev = 0;
    b_.copy_to_host(&yv, y + i, 4, push_).IgnoreError();
    if (e != nullptr) b_.copy_to_host(&ev, e + i, 4, push_).IgnoreError();
    b_.synchronize(push_).IgnoreError();
    return absl::InvalidArgumentError(
        e == nullptr ? absl::StrCat(what, " at index ", i, " (", yv, "); nothing was encoded")
                     : absl::StrCat(what, " at index ", i, " (y=", yv, ", e=", ev,
                                    "); nothing was encoded or changed"));
  }

  // Encodes the push of [b, b + n) on the push stream (WorkerOptimizer::Push)
  // and returns where the payload is.
  absl::StatusOr<const void*> Encode(const Codec& codec, uint64_t b, size_t n) {
    const float* y = g_.f() + b;
    if (!frozen_) {
      auto bad = b_.first_nonfinite(y, nullptr, n, push_);
      if (!bad.ok()) return bad.status();
      if (*bad < n) return NonFinite(y, nullptr, *bad, "non-finite input");
      return static_cast<const void*>(y);  // fp32: the gradient is the payload
    }
    if (TraitsOf(o_.kind).worker_momentum) {
      float* m = mbar_.f() + b;
      absl::Status st = b_.update_momentum(y, o_.beta1, 1.0f - o_.beta1, n, m, push_);
      if (!st.ok()) return st;
      y = m;
    }
    const bool ef = o_.worker_error_feedback;
    uint8_t& side = e_side_[b];
    e_len_[b] = n;
    float* e = ef ? e_[side].f() + b : nullptr;
    if (staging_dev_.size() < codec.EncodedSize(n)) {
      if (absl::Status st = Alloc(codec.EncodedSize(n), false, &staging_dev_); !st.ok()) return st;
    }
    uint8_t* out = staging_dev_.u8();
    switch (codec.kind()) {
      case CodecKind::kOnebit: {
        // Into the other error buffer: e changes only when the encode succeeds.
        float* e_out = ef ? e_[1 - side].f() + b : nullptr;
        absl::Status st =
            b_.onebit_encode(y, e, e_out, n, o_.codec.block_size, o_.codec.scale, out, push_);
        if (!st.ok()) return st;
        if (ef) side = 1 - side;
        return static_cast<const void*>(out);
      }
      case CodecKind::kFp16: {
        auto bad = b_.fp16_check(y, e, n, push_);
        if (!bad.ok()) return bad.status();
        if (*bad < n) return NonFinite(y, e, *bad, "non-finite input or fp16 overflow");
        absl::Status st = b_.fp16_encode(y, e, n, reinterpret_cast<uint16_t*>(out), push_);
        if (!st.ok()) return st;
        return static_cast<const void*>(out);
      }
      case CodecKind::kFp32: {
        auto bad = b_.first_nonfinite(y, e, n, push_);
        if (!bad.ok()) return bad.status();
        if (*bad < n) return NonFinite(y, e, *bad, "non-finite input");
        if (e == nullptr) return static_cast<const void*>(y);
        // z = e + 1*y (= y + e exactly); the payload is z; the new error is
        // z - z = +0, as the CPU codec writes it.
        absl::Status st = b_.axpy(y, n, 1.0f, e, push_);
        if (st.ok()) st = b_.copy_to_host(staging_.u8(), e, 4 * n, push_);
        if (st.ok()) st = b_.set_zero(e, 4 * n, push_);
        if (!st.ok()) return st;
        return static_cast<const void*>(nullptr);  // already in staging_
      }
    }
    return absl::InternalError("unknown codec kind");
  }

  // out = D(p), or out += D(p), on the reply stream; p on the device.
  absl::Status DecodeTo(const Codec& codec, const uint8_t* p, size_t n, bool add, float* out) {
    switch (codec.kind()) {
      case CodecKind::kOnebit: {
        const uint32_t block = o_.codec.block_size;
        const float* scales = reinterpret_cast<const float*>(p);
        const uint8_t* bits = p + 4 * ((n + block - 1) / block);
        return add ? b_.onebit_decode_add(scales, bits, n, block, 1.0f, out, reply_)
                   : b_.onebit_decode(scales, bits, n, block, out, reply_);
      }
      case CodecKind::kFp16: {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
        return add ? b_.fp16_decode_add(h, n, 1.0f, out, reply_)
                   : b_.fp16_decode(h, n, out, reply_);
      }
      case CodecKind::kFp32:
        if (!add) break;  // Apply copies an fp32 momentum to m̄ directly
        return b_.axpy(reinterpret_cast<const float*>(p), n, 1.0f, out, reply_);
    }
    return absl::InternalError(absl::StrCat("cannot decode ", codec.name(), " here"));
  }

  const Backend& b_;
  const std::string device_;
  const Model* model_;
  const WorkerOptimizer* opt_;
  const OptimizerOptions& o_;
  const uint64_t d_;
  Stream push_ = nullptr;
  Stream reply_ = nullptr;
  std::unique_ptr<DeviceModel> dmodel_;
  Buffer x_, g_, mbar_, e_[2], den_;
  Buffer staging_;                               // pinned: the push payload on its way to the host
  Buffer staging_dev_;                           // device: the encoded push payload
  absl::flat_hash_map<uint64_t, Buffer> slots_;  // pinned: reply payloads, by chunk
  absl::flat_hash_map<uint64_t, uint8_t> e_side_;  // chunk -> which e_ holds its error
  absl::flat_hash_map<uint64_t, size_t> e_len_;    // chunk -> its length
  bool frozen_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Replica>> NewDeviceReplica(const cuda::Backend* backend,
                                                          std::string device, uint64_t d,
                                                          const Model* model,
                                                          const WorkerOptimizer* optimizer,
                                                          const DeviceModelFactory& make_model) {
  if (optimizer->options().warmup_codec != "fp32") {
    return absl::UnimplementedError(
        "--warmup_codec fp16 runs on CPU workers only so far (--device cpu): the GPU worker "
        "adds fp32 warm-up replies");
  }
  if (optimizer->options().kind == OptimizerKind::kZeroOneAdam) {
    return absl::UnimplementedError(
        "zero-one-adam runs on CPU workers only so far (--device cpu): its local steps have no "
        "GPU kernels yet");
  }
  if (optimizer->options().kind == OptimizerKind::kOnebitLamb) {
    return absl::UnimplementedError(
        "onebit-lamb runs on CPU workers only so far (--device cpu): the GPU worker does not "
        "apply its layers' ratios yet");
  }
  auto r = std::make_unique<DeviceReplica>(backend, std::move(device), d, model, optimizer);
  if (absl::Status st = r->Create(make_model); !st.ok()) return st;
  return std::unique_ptr<Replica>(std::move(r));
}

}  // namespace onebit
