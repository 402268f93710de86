#include "worker/device_replica.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/state_file.h"
#include "cuda/array_ops.h"

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

// The arrays of both phases are allocated up front; phase by phase, the
// view the rule gets (WorkerView) names those the optimizer holds.
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
    for (const auto& [handle, p] : peers_) b_.close_imported(p, 4 * d_);
    push_ops_.reset();
    reply_ops_.reset();
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
    push_ops_ = cuda::NewArrayOps(b_, push_, o_.codec);
    reply_ops_ = cuda::NewArrayOps(b_, reply_, o_.codec);
    // Every array either phase holds. v and x_sync share one buffer where no
    // phase holds both (zero-one-adam drops v as x_sync appears).
    const WorkerArraySet warm = opt_->WorkerArraysIn(Phase::kWarmup, /*hand_over=*/true);
    const WorkerArraySet comp = opt_->WorkerArraysIn(Phase::kCompress, false);
    const bool shared = !(warm.v && warm.x_sync) && !(comp.v && comp.x_sync);
    const bool v = warm.v || comp.v, x_sync = warm.x_sync || comp.x_sync;
    const std::pair<bool, Buffer*> arrays[] = {
        {true, &x_},
        {true, &g_},
        {warm.mbar || comp.mbar, &mbar_},
        {warm.e || comp.e, &e_},
        {warm.den || comp.den, &den_},
        {v || (x_sync && shared), &v_},
        {x_sync && !shared, &x_sync_},
    };
    for (const auto& [held, buf] : arrays) {
      if (!held) continue;
      // g in memory another process can map: a host's local ranks add
      // their gradients on the devices (ExportGrads).
      if (absl::Status st = Alloc(4 * d_, false, buf, /*shared=*/buf == &g_); !st.ok()) return st;
    }
    x_sync_at_ = x_sync ? (shared ? v_.f() : x_sync_.f()) : nullptr;
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
    absl::Status st = b_.copy_to_device(x_.f(), x.data(), 4 * d_, push_);
    for (const Buffer* buf : {&g_, &mbar_, &e_, &den_, &v_, &x_sync_}) {
      if (st.ok()) st = b_.set_zero(buf->u8(), buf->size(), push_);
    }
    if (st.ok()) st = b_.synchronize(push_);  // x (pageable) must be read before it goes
    frozen_ = !HasWarmup(o_.kind);
    lrs_ = 0.0f;
    step_.reset();
    lr_.reset();
    return st;
  }

  absl::StatusOr<WorkerState> SaveState(const Parts& parts) override {
    WorkerState s;
    s.frozen = frozen_;
    s.lrs = lrs_;
    const WorkerView a = View(opt_->WorkerArraysIn(phase(), false));
    absl::Status st = b_.synchronize(reply_);
    auto copy = [&](bool wanted, const float* from, std::vector<float>* to) {
      if (!wanted || from == nullptr) return;
      *to = parts.buffers != nullptr ? parts.buffers->Take(d_) : SnapshotZeros(d_);
      if (st.ok()) st = b_.copy_to_host(to->data(), from, 4 * d_, push_);
    };
    copy(parts.x, a.x, &s.x);
    copy(parts.mbar, a.mbar, &s.mbar);
    copy(true, a.e, &s.e);
    copy(parts.den, a.den, &s.den);
    copy(true, a.v, &s.v);
    copy(true, a.x_sync, &s.x_sync);
    if (st.ok()) st = b_.synchronize(push_);
    if (!st.ok()) return st;
    return s;
  }

  absl::Status RestoreState(const WorkerState& s) override {
    if (absl::Status st = CheckWorkerStateFits(opt_->options(), d_, s); !st.ok()) return st;
    const WorkerView a = View(opt_->WorkerArraysIn(PhaseOf(s), false));
    absl::Status st = b_.synchronize(reply_);
    auto copy = [&](const std::vector<float>& from, float* to) {
      if (!st.ok() || to == nullptr || from.empty()) return;
      if (from.size() != d_) {
        st = absl::InvalidArgumentError(
            absl::StrCat("a saved array of ", from.size(), " floats for d = ", d_));
        return;
      }
      st = b_.copy_to_device(to, from.data(), 4 * d_, push_);
    };
    copy(s.x, a.x);
    copy(s.mbar, a.mbar);
    copy(s.e, a.e);
    copy(s.den, a.den);
    copy(s.v, a.v);
    copy(s.x_sync, a.x_sync);
    if (st.ok()) st = b_.synchronize(push_);  // the host vectors are pageable
    if (!st.ok()) return st;
    frozen_ = s.frozen;
    lrs_ = s.lrs;
    return absl::OkStatus();
  }

  float* params() override { return x_.f(); }
  float* grads() override { return g_.f(); }

  absl::StatusOr<double> ComputeGradient(uint32_t rank, uint64_t step) override {
    if (dmodel_ == nullptr) return absl::FailedPreconditionError("the replica has no model");
    return dmodel_->Gradient(x_.f(), rank, step, g_.f());
  }

  absl::Status BeginStep(uint64_t step, float lr) override {
    step_ = step;
    lr_ = lr;
    WorkerView a = View(opt_->WorkerArraysIn(phase(), false));
    opt_->BeginStep(step, lr, &a);
    Keep(a);
    return absl::OkStatus();
  }

  // The push stream; the payload goes to the host through pinned memory.
  absl::Status Push(uint64_t step, uint64_t b, size_t n, uint8_t* out) override {
    if (absl::Status st = CheckRange(b, n); !st.ok()) return st;
    const size_t bytes = opt_->push_codec(opt_->KindOf(step, phase())).EncodedSize(n);
    if (staging_.size() < bytes) {
      if (absl::Status st = Alloc(bytes, true, &staging_); !st.ok()) return st;
    }
    if (staging_dev_.size() < bytes) {
      // Push waits for its stream before it returns: nothing queued reads it.
      if (absl::Status st = Alloc(bytes, false, &staging_dev_); !st.ok()) return st;
    }
    WorkerView a = View(opt_->WorkerArraysIn(phase(), false));
    absl::Status st =
        opt_->Push(step, StepLr(step), g_.f(), b, n, *push_ops_, &a, staging_dev_.u8());
    Keep(a);
    if (st.ok()) st = b_.copy_to_host(staging_.u8(), staging_dev_.u8(), bytes, push_);
    if (st.ok()) st = b_.synchronize(push_);
    if (!st.ok()) return st;
    std::memcpy(out, staging_.u8(), bytes);
    return absl::OkStatus();
  }

  // On the push stream, as the pushes it stands for.
  absl::Status LocalStep(uint64_t step, uint64_t b, size_t n) override {
    WorkerView a = View(opt_->WorkerArraysIn(phase(), false));
    absl::Status st = opt_->LocalStep(step, StepLr(step), g_.f(), b, n, *push_ops_, &a);
    Keep(a);
    return st;
  }

  // The reply stream: the reply goes to the device through this chunk's
  // pinned slot, and the rule decodes it there (it checks it on the host
  // first).
  absl::Status Apply(uint64_t step, float lr, bool last_warmup, const uint8_t* reply, uint64_t b,
                     size_t n) override {
    if (absl::Status st = CheckRange(b, n); !st.ok()) return st;
    const size_t bytes = opt_->ReplyBytes(opt_->KindOf(step, phase()), b, n, last_warmup);
    auto slot = Slot(b, n, bytes);
    if (!slot.ok()) return slot.status();
    if (reply_dev_.size() < bytes) {
      // Replies queued before may still be read from the old one.
      if (absl::Status st = b_.synchronize(reply_); !st.ok()) return st;
      if (absl::Status st = Alloc(bytes, false, &reply_dev_); !st.ok()) return st;
    }
    std::memcpy(*slot, reply, bytes);
    absl::Status st = b_.copy_to_device(reply_dev_.u8(), *slot, bytes, reply_);
    if (!st.ok()) return st;
    WorkerView a = View(opt_->WorkerArraysIn(phase(), last_warmup));
    st = opt_->Apply(step, lr, last_warmup, Payload{reply, reply_dev_.u8()}, b, n, *reply_ops_, &a);
    Keep(a);
    return st;
  }

  // On the push stream, once the reply stream has applied the replies (it
  // reads x_sync, which they change, and x, which local steps change).
  absl::Status Merge(uint64_t pushed, uint64_t step, uint64_t b, size_t n) override {
    if (absl::Status st = CheckRange(b, n); !st.ok()) return st;
    if (absl::Status st = b_.synchronize(reply_); !st.ok()) return st;
    WorkerView a = View(opt_->WorkerArraysIn(phase(), false));
    absl::Status st = opt_->Merge(pushed, step, b, n, *push_ops_, &a);
    Keep(a);
    return st;
  }

  absl::Status FinishStep(bool entered_compression) override {
    absl::Status st = b_.synchronize(reply_);
    if (st.ok()) st = b_.synchronize(push_);
    if (!st.ok()) return st;
    if (step_) {
      WorkerView a = View(opt_->WorkerArraysIn(phase(), false));
      opt_->EndStep(*step_, &a);
      Keep(a);
    }
    step_.reset();
    lr_.reset();
    if (!entered_compression) return absl::OkStatus();
    // With the arrays of both phases (x_sync may take v's buffer).
    WorkerArraySet both = opt_->WorkerArraysIn(Phase::kWarmup, false);
    const WorkerArraySet comp = opt_->WorkerArraysIn(Phase::kCompress, false);
    both.mbar |= comp.mbar;
    both.e |= comp.e;
    both.den |= comp.den;
    both.x_sync |= comp.x_sync;
    WorkerView a = View(both);
    st = opt_->EnterCompression(*push_ops_, &a);
    Keep(a);
    if (st.ok()) st = b_.synchronize(push_);
    return st;
  }

  absl::Status ReadX(float* x) override {
    absl::Status st = b_.synchronize(reply_);
    if (st.ok()) st = b_.copy_to_host(x, x_.f(), 4 * d_, push_);
    if (st.ok()) st = b_.synchronize(push_);
    return st;
  }

  // Apply may use g as scratch: its stream goes first.
  absl::Status ReadGrads(float* host) override {
    absl::Status st = b_.synchronize(reply_);
    if (st.ok()) st = b_.copy_to_host(host, g_.f(), 4 * d_, push_);
    if (st.ok()) st = b_.synchronize(push_);
    return st;
  }
  absl::Status WriteGrads(const float* host) override {
    absl::Status st = b_.synchronize(reply_);
    if (st.ok()) st = b_.copy_to_device(g_.f(), host, 4 * d_, push_);
    if (st.ok()) st = b_.synchronize(push_);  // host is pageable memory
    return st;
  }

  absl::StatusOr<std::string> ExportGrads() override {
    auto handle = b_.export_memory(g_.f(), 4 * d_);
    if (!handle.ok()) return handle.status();
    return absl::StrCat(b_.name, ":", *handle);
  }

  absl::Status SyncGrads() override {
    // Apply may use g as scratch, and the model writes it on push_.
    absl::Status st = b_.synchronize(reply_);
    if (st.ok()) st = b_.synchronize(push_);
    return st;
  }

  absl::Status MeanGradsWith(const std::vector<std::string>& peers) override {
    std::vector<const float*> g = {g_.f()};
    for (const std::string& handle : peers) {
      auto p = Peer(handle);
      if (!p.ok()) return p.status();
      g.push_back(*p);
    }
    if (sum_.size() == 0) {
      if (absl::Status st = Alloc(4 * d_, false, &sum_); !st.ok()) return st;
    }
    // MeanInOrder's arithmetic: ((0 + w g0) + w g1) + ..., element by
    // element, each step rounded (axpy: acc + w * x, no fused multiply-add).
    const float w = 1.0f / static_cast<float>(g.size());
    absl::Status st = b_.synchronize(reply_);  // Apply may use g as scratch
    if (st.ok()) st = b_.set_zero(sum_.u8(), 4 * d_, push_);
    for (const float* x : g) {
      if (st.ok()) st = b_.axpy(x, d_, w, sum_.f(), push_);
    }
    if (st.ok()) st = b_.copy_on_device(g_.f(), sum_.f(), 4 * d_, push_);
    // The peers' memory is theirs again once this returns.
    if (st.ok()) st = b_.synchronize(push_);
    return st;
  }

  absl::Status WriteX(uint64_t b, size_t n, const float* host, bool start) override {
    if (absl::Status st = CheckRange(b, n); !st.ok()) return st;
    // The master goes to the worker's copy of it, which is x_sync where the
    // worker trains a local model apart from it (as CpuReplica::WriteX).
    const WorkerView a = View(opt_->WorkerArraysIn(phase(), false));
    absl::Status st = b_.synchronize(reply_);
    if (st.ok() && a.x_sync != nullptr) st = b_.copy_to_device(a.x_sync + b, host, 4 * n, push_);
    if (st.ok() && (a.x_sync == nullptr || start)) {
      st = b_.copy_to_device(x_.f() + b, host, 4 * n, push_);
    }
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
  absl::Status Alloc(size_t bytes, bool pinned, Buffer* out, bool shared = false) {
    auto p = (pinned ? b_.alloc_pinned : shared ? b_.alloc_shared : b_.alloc)(bytes);
    if (!p.ok()) {
      return absl::Status(p.status().code(),
                          absl::StrCat(device_, ": allocating ", bytes, pinned ? " pinned" : "",
                                       " bytes: ", p.status().message()));
    }
    *out = Buffer(&b_, *p, bytes, pinned);
    return absl::OkStatus();
  }

  // A peer's gradient from its ExportGrads handle, mapped once.
  absl::StatusOr<const float*> Peer(const std::string& handle) {
    auto it = peers_.find(handle);
    if (it != peers_.end()) return static_cast<const float*>(it->second);
    const std::string prefix = absl::StrCat(b_.name, ":");
    if (!absl::StartsWith(handle, prefix)) {
      return absl::InvalidArgumentError(absl::StrCat("a gradient exported by another backend (",
                                                     handle.substr(0, handle.find(':')), "), not ",
                                                     b_.name));
    }
    auto p = b_.import_memory(handle.substr(prefix.size()), 4 * d_);
    if (!p.ok()) return p.status();
    peers_[handle] = *p;
    return static_cast<const float*>(*p);
  }

  absl::Status CheckRange(uint64_t b, size_t n) const {
    if (b > d_ || n > d_ - b) {
      return absl::OutOfRangeError(
          absl::StrCat("elements [", b, ", ", b + n, ") outside the ", d_, " parameters"));
    }
    return absl::OkStatus();
  }

  // A pinned slot of at least `bytes` for the replies of the chunk at b, n
  // elements (so copies need not wait for each other). The hand-over's
  // larger reply does not keep its slot: 4n bytes hold every other.
  absl::StatusOr<uint8_t*> Slot(uint64_t b, size_t n, size_t bytes) {
    Buffer& s = slots_[b];
    if (s.size() < bytes || s.size() > std::max(bytes, 4 * n)) {
      // A copy from the old slot may still be queued.
      if (absl::Status st = b_.synchronize(reply_); !st.ok()) return st;
      if (absl::Status st = Alloc(std::max(bytes, 4 * n), true, &s); !st.ok()) return st;
    }
    return s.u8();
  }

  // The arrays `set` names, and the scalars.
  WorkerView View(const WorkerArraySet& set) const {
    WorkerView a;
    a.d = d_;
    a.x = x_.f();
    a.mbar = set.mbar ? mbar_.f() : nullptr;
    a.e = set.e ? e_.f() : nullptr;
    a.den = set.den ? den_.f() : nullptr;
    a.v = set.v ? v_.f() : nullptr;
    a.x_sync = set.x_sync ? x_sync_at_ : nullptr;
    a.frozen = frozen_;
    a.lrs = lrs_;
    return a;
  }
  // The scalars a rule left in `a`.
  void Keep(const WorkerView& a) {
    frozen_ = a.frozen;
    lrs_ = a.lrs;
  }

  float StepLr(uint64_t step) const { return lr_ && step_ == step ? *lr_ : LearningRate(o_, step); }

  const Backend& b_;
  const std::string device_;
  const Model* model_;
  const WorkerOptimizer* opt_;
  const OptimizerOptions& o_;
  const uint64_t d_;
  Stream push_ = nullptr;
  Stream reply_ = nullptr;
  std::unique_ptr<ArrayOps> push_ops_, reply_ops_;  // on push_, reply_
  std::unique_ptr<DeviceModel> dmodel_;
  Buffer x_, g_, mbar_, e_, den_, v_, x_sync_;
  float* x_sync_at_ = nullptr;  // x_sync_, or v_ where they share
  Buffer staging_;              // pinned: the push payload on its way to the host
  Buffer staging_dev_;          // device: the encoded push payload
  Buffer reply_dev_;            // device: the reply being applied
  Buffer sum_;                  // device: MeanGradsWith's mean
  absl::flat_hash_map<std::string, void*> peers_;  // mapped peers' gradients, by handle
  absl::flat_hash_map<uint64_t, Buffer> slots_;    // pinned: reply payloads, by chunk
  bool frozen_ = false;
  float lrs_ = 0.0f;
  // The step BeginStep began, and its learning rate.
  std::optional<uint64_t> step_;
  std::optional<float> lr_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Replica>> NewDeviceReplica(const cuda::Backend* backend,
                                                          std::string device, uint64_t d,
                                                          const Model* model,
                                                          const WorkerOptimizer* optimizer,
                                                          const DeviceModelFactory& make_model) {
  auto r = std::make_unique<DeviceReplica>(backend, std::move(device), d, model, optimizer);
  if (absl::Status st = r->Create(make_model); !st.ok()) return st;
  return std::unique_ptr<Replica>(std::move(r));
}

}  // namespace onebit
