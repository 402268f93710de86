// diloco, DiLoCo on parameter servers (docs/design.md §1.8): every worker
// takes inner AdamW steps on its own replica; at a sync step it pushes its
// outer gradient x_sync - x through the worker codec with error feedback,
// the servers average them and take an outer Nesterov step with momentum of
// their own, and reply the step through the server codec with error
// feedback. The master and every replica's x_sync take the decoded reply, so
// they stay equal bit for bit; each worker's local model starts again there.
// Streamed (--fragments F): the shards form F fragments that sync at
// staggered steps; a step's kind is then per shard (KindAt). Overlapped
// (--sync_delay tau): the worker goes on with tau inner steps while a sync
// travels, takes the reply into x_sync when it comes (Apply) and merges its
// local model with it at the end of those tau steps (Merge).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "optim/algorithm.h"
#include "optim/algorithms.h"
#include "optim/step_parts.h"
#include "optim/update_kernels.h"

namespace onebit {
namespace {

// Fragment f (of F) synchronises at the steps t (from 0) with
// (t + 1 + f H / F) mod H = 0, and every fragment at the job's last step,
// so that a job ends with every replica at the master. F = 1: every H steps.
bool IsSync(const DilocoOptions& d, uint32_t fragments, uint32_t fragment, uint64_t step) {
  const uint64_t k = step + 1;
  const uint64_t offset = static_cast<uint64_t>(fragment) * d.sync_every / fragments;
  return (k + offset) % d.sync_every == 0 || (d.steps > 0 && k == d.steps);
}

class Diloco final : public Algorithm {
 public:
  Diloco(const AlgorithmTraits& t, const OptimizerOptions& o) : Algorithm(t, o) {}

  // No warm-up: a step is kCompressed where a fragment syncs, else kLocal.
  StepKind KindOf(uint64_t step, Phase phase) const override {
    (void)phase;
    for (uint32_t f = 0; f < Fragments(); ++f) {
      if (IsSync(o_.diloco, Fragments(), f, step)) return StepKind::kCompressed;
    }
    return StepKind::kLocal;
  }
  StepKind KindAt(uint64_t step, Phase phase, uint64_t b) const override {
    (void)phase;
    return IsSync(o_.diloco, Fragments(), FragmentOf(b), step) ? StepKind::kCompressed
                                                               : StepKind::kLocal;
  }
  // tau steps on, but by the second-to-last step: the last step syncs every
  // fragment, so nothing is in flight then (Validate keeps tau below the
  // spacing of two fragments' syncs).
  uint64_t MergeStep(uint64_t step) const override {
    const uint64_t tau = o_.diloco.sync_delay, steps = o_.diloco.steps;
    if (tau == 0) return step;
    if (steps >= 2 && step + tau > steps - 2) return std::max(step, steps - 2);
    return step + tau;
  }

  // The outer momentum (m); the base's EnterCompression adds e_s.
  void InitServer(ServerShardState* s) const override { s->m.assign(s->x.size(), 0.0f); }
  absl::Status Step(uint64_t step, float lr, bool last_warmup, float* acc, uint64_t off, size_t n,
                    ServerShardState* s, uint8_t* reply) const override;

  // The inner AdamW's m (in mbar) and v, x_sync and the outer gradient's e.
  WorkerArraySet WorkerArraysIn(Phase phase, bool hand_over) const override {
    (void)phase, (void)hand_over;
    WorkerArraySet set;
    set.mbar = set.v = set.x_sync = set.e = true;
    return set;
  }
  absl::Status LocalStep(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                         const ArrayOps& ops, WorkerView* s) const override {
    if (KindAt(step, PhaseOf(*s), b) != StepKind::kLocal) {
      return Algorithm::LocalStep(step, lr, g, b, n, ops, s);
    }
    return InnerStep(step, lr, g, b, n, ops, s);
  }
  absl::Status Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                    const ArrayOps& ops, WorkerView* s, uint8_t* out) const override;
  absl::Status Apply(uint64_t step, float lr, bool last_warmup, Payload reply, uint64_t b, size_t n,
                     const ArrayOps& ops, WorkerView* s) const override;
  absl::Status Merge(uint64_t pushed, uint64_t step, uint64_t b, size_t n, const ArrayOps& ops,
                     WorkerView* s) const override;

 private:
  // F, where the shard map is known (OptimizerOptionsFromConfig fills
  // shard_begins once d is); 1 without it, the same on every side.
  uint32_t Fragments() const { return o_.shard_begins.empty() ? 1 : o_.diloco.fragments; }
  // The fragment of element b: shard k (of S, by shard_begins) is in
  // fragment k F / S.
  uint32_t FragmentOf(uint64_t b) const {
    const std::vector<uint64_t>& begins = o_.shard_begins;
    if (Fragments() <= 1) return 0;
    const uint64_t k = std::upper_bound(begins.begin(), begins.end(), b) - begins.begin() - 1;
    return static_cast<uint32_t>(k * Fragments() / begins.size());
  }

  // One AdamW step of the worker's own replica on [b, b + n), each range
  // with its own weight decay and lr scale; g is left as it was.
  absl::Status InnerStep(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                         const ArrayOps& ops, WorkerView* s) const {
    if (absl::Status st = CheckLocalGradient(ops, step, g, b, n); !st.ok()) return st;
    absl::StatusOr<float*> d = ops.Scratch(n);
    if (!d.ok()) return d.status();
    absl::Status st = ops.Copy(g + b, n, *d);
    ForEachRangeSetting(o_, b, n, [&](size_t p, size_t c, float wd, float ls) {
      if (!st.ok()) return;
      const AdamCoefficients k =
          MakeAdamCoefficients(o_.beta1, o_.beta2, o_.eps, wd, lr * ls, o_.bias_correction, step);
      st = ops.AdamUpdate(k, c, *d + p, s->mbar + b + p, s->v + b + p, s->x + b + p);
    });
    return st;
  }
};

// acc: the mean outer gradient. With M the outer momentum and mu its
// coefficient (Nesterov, as torch.optim.SGD(nesterov=True)): M = mu M + acc,
// u = outer_lr (acc + mu M); the reply is c = C(u + e_s), e_s keeps the
// rest, and the master takes x -= D(c) as every worker's x_sync does.
absl::Status Diloco::Step(uint64_t step, float lr, bool last_warmup, float* acc, uint64_t off,
                          size_t n, ServerShardState* s, uint8_t* reply) const {
  (void)lr, (void)last_warmup;  // the inner learning rate is the workers'; no warm-up
  if (KindAt(step, PhaseOf(*s), s->begin + off) == StepKind::kLocal) {
    return absl::InternalError(absl::StrCat("step ", step, " is a local step",
                                            Fragments() > 1 ? " of this shard" : "",
                                            ": nothing to serve"));
  }
  const float mu = o_.diloco.outer_momentum;
  const float outer_lr = o_.diloco.outer_lr;
  float* m = s->m.data() + off;
  for (size_t i = 0; i < n; ++i) {
    m[i] = mu * m[i] + acc[i];
    acc[i] = outer_lr * (acc[i] + mu * m[i]);
  }
  absl::Status st = EncodeMaybeWithFeedback(*server_codec_, o_.server_error_feedback, acc,
                                            s->e.data() + off, n, reply);
  if (!st.ok()) return Diverged(o_, "the outer step", step, s->begin + off, st);
  if (st = server_codec_->Decode(reply, n, acc); !st.ok()) return st;
  float* x = s->x.data() + off;
  for (size_t i = 0; i < n; ++i) x[i] -= acc[i];
  return CheckFinite(o_, "the outer step's master", step, s->begin + off, x, n);
}

// A sync step takes its own inner step, then pushes C(x_sync - x + e_w).
absl::Status Diloco::Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                          const ArrayOps& ops, WorkerView* s, uint8_t* out) const {
  absl::Status st = InnerStep(step, lr, g, b, n, ops, s);
  if (!st.ok()) return st;
  absl::StatusOr<float*> delta = ops.Scratch(n);
  if (!delta.ok()) return delta.status();
  st = ops.Copy(s->x_sync + b, n, *delta);
  if (st.ok()) st = ops.Axpy(s->x + b, n, -1.0f, *delta);
  if (st.ok()) {
    st = ops.Encode(*worker_codec_, *delta, o_.worker_error_feedback ? s->e + b : nullptr, n, out);
    if (!st.ok()) return Diverged(o_, "the outer gradient x_sync - x", step, b, st);
  }
  return st;
}

// The reply is the outer step: x_sync -= D(c), as the master did; the local
// model starts again from it (the inner AdamW's m and v carry on). With
// --sync_delay the local model goes on meanwhile, and Merge joins them at
// MergeStep(step) (at once where that is the step itself: the job's end).
absl::Status Diloco::Apply(uint64_t step, float lr, bool last_warmup, Payload reply, uint64_t b,
                           size_t n, const ArrayOps& ops, WorkerView* s) const {
  (void)step, (void)lr, (void)last_warmup;
  absl::StatusOr<float*> a = ops.Scratch(n);
  if (!a.ok()) return a.status();
  absl::Status st = ops.Decode(*server_codec_, reply, n, *a);
  if (st.ok()) st = ops.Axpy(*a, n, -1.0f, s->x_sync + b);
  if (st.ok() && MergeStep(step) == step) st = ops.Copy(s->x_sync + b, n, s->x + b);
  return st;
}

// x = x_sync + alpha (x - x_sync): the inner steps taken while the sync
// travelled count at weight alpha.
absl::Status Diloco::Merge(uint64_t pushed, uint64_t step, uint64_t b, size_t n,
                           const ArrayOps& ops, WorkerView* s) const {
  (void)pushed, (void)step;
  absl::StatusOr<float*> a = ops.Scratch(n);
  if (!a.ok()) return a.status();
  absl::Status st = ops.Copy(s->x + b, n, *a);
  if (st.ok()) st = ops.Axpy(s->x_sync + b, n, -1.0f, *a);
  if (st.ok()) st = ops.Copy(s->x_sync + b, n, s->x + b);
  if (st.ok()) st = ops.Axpy(*a, n, o_.diloco.sync_mix, s->x + b);
  return st;
}

absl::Status Validate(const OptimizerOptions& o) {
  const DilocoOptions& d = o.diloco;
  if (d.sync_every < 1) return SettingError("sync_every", "must be >= 1");
  if (d.fragments < 1 || d.fragments > d.sync_every) {
    return SettingError("fragments",
                        absl::StrCat(d.fragments, ": must be in [1, --sync_every (", d.sync_every,
                                     ")], so that each fragment syncs at an offset of its own"));
  }
  // (Empty until d is known: an external model's, before its workers
  // declare it; no algorithm is made then.)
  if (!o.shard_begins.empty() &&
      (o.shard_begins[0] != 0 || !std::is_sorted(o.shard_begins.begin(), o.shard_begins.end()))) {
    return absl::InternalError("shard_begins: not the begins of a shard map");
  }
  if (d.fragments > 1 && !o.shard_begins.empty() && d.fragments > o.shard_begins.size()) {
    return SettingError("fragments", absl::StrCat(d.fragments,
                                                  ": fragments are groups of whole "
                                                  "shards; there are ",
                                                  o.shard_begins.size(), " (--servers)"));
  }
  if (d.sync_delay > 0 && d.sync_delay >= d.sync_every / d.fragments) {
    return SettingError("sync_delay", absl::StrCat(d.sync_delay, ": must be below H / F (",
                                                   d.sync_every, " / ", d.fragments,
                                                   "), so that a sync has arrived before the "
                                                   "next fragment's"));
  }
  if (!(d.sync_mix >= 0 && d.sync_mix < 1)) {
    return SettingError("sync_mix", "must lie in [0, 1) (the local model's weight in the merge)");
  }
  if (!std::isfinite(d.outer_lr) || !(d.outer_lr > 0)) {
    return SettingError("outer_lr", "must be finite and > 0");
  }
  if (!(d.outer_momentum >= 0 && d.outer_momentum < 1)) {
    return SettingError("outer_momentum", "must lie in [0, 1)");
  }
  if (o.reply != ReplyMode::kMomentum) {
    return SettingError("server_reply",
                        "diloco replies the outer step, which the master takes decoded as every "
                        "replica does; there is no delta reply to choose");
  }
  return absl::OkStatus();
}

std::string Remedy(const OptimizerOptions& o) {
  return absl::StrCat("diloco: a lower --lr (the inner AdamW's, ", o.lr,
                      ") or a learning-rate warm-up (--lr_schedule warmup:N), a lower --outer_lr (",
                      o.diloco.outer_lr, ") or a smaller --sync_every (", o.diloco.sync_every, ")");
}

}  // namespace

const AlgorithmRow& DilocoRow() {
  static const AlgorithmRow* row = [] {
    auto* r = new AlgorithmRow;
    r->traits.kind = OptimizerKind::kDiloco;
    r->traits.name = "diloco";
    r->traits.warmup = false;
    r->traits.compression = true;
    r->traits.needs_job_length = true;
    r->traits.local_model = true;
    // Measured (docs/design.md §1.8): the outer Nesterov momentum amplifies
    // what error feedback sends a sync late; without it the 1-bit outer
    // steps trained best on the mlp and the GPT, and never diverged.
    r->traits.default_error_feedback = "none";
    r->traits.worker_arrays = {"m", "v", "x_sync", "e_w"};
    r->traits.server_arrays = {"the outer momentum", "e_s"};
    r->validate = Validate;
    r->remedy = Remedy;
    r->make = MakeAlgorithm<Diloco>;
    return r;
  }();
  return *row;
}

}  // namespace onebit
