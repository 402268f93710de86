#include "optim/optimizer.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "optim/algorithm.h"

namespace onebit {

OptimizerCodecs::OptimizerCodecs(std::unique_ptr<const Algorithm> algorithm)
    : algorithm_(std::move(algorithm)) {}

OptimizerCodecs::~OptimizerCodecs() = default;

const OptimizerOptions& OptimizerCodecs::options() const { return algorithm_->options(); }

const AlgorithmTraits& OptimizerCodecs::traits() const { return algorithm_->traits(); }

const Codec& OptimizerCodecs::fp32_codec() const { return algorithm_->fp32_codec(); }

StepKind OptimizerCodecs::KindOf(uint64_t step, Phase phase) const {
  return algorithm_->KindOf(step, phase);
}

StepKind OptimizerCodecs::KindAt(uint64_t step, Phase phase, uint64_t b) const {
  return algorithm_->KindAt(step, phase, b);
}

uint64_t OptimizerCodecs::MergeStep(uint64_t step) const { return algorithm_->MergeStep(step); }

const Codec& OptimizerCodecs::push_codec(StepKind kind) const {
  return algorithm_->push_codec(kind);
}

const Codec& OptimizerCodecs::reply_codec(StepKind kind) const {
  return algorithm_->reply_codec(kind);
}

size_t OptimizerCodecs::ReplyBytes(StepKind kind, size_t n, bool last_warmup) const {
  return algorithm_->ReplyBytes(kind, n, last_warmup);
}

size_t OptimizerCodecs::ReplyBytes(StepKind kind, uint64_t b, size_t n, bool last_warmup) const {
  return algorithm_->ChunkReplyBytes(kind, b, n, last_warmup);
}

// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<ServerOptimizer>> ServerOptimizer::Create(
    const OptimizerOptions& options) {
  auto algorithm = NewAlgorithm(options);
  if (!algorithm.ok()) return algorithm.status();
  return std::unique_ptr<ServerOptimizer>(new ServerOptimizer(*std::move(algorithm)));
}

void ServerOptimizer::InitState(uint32_t shard, uint64_t begin, uint64_t size,
                                ServerShardState* s) const {
  *s = ServerShardState{};
  s->shard = shard;
  s->begin = begin;
  s->x.assign(size, 0.0f);
  algorithm_->InitServer(s);
  if (!traits().warmup) algorithm_->EnterCompression(s);
}

void ServerOptimizer::EnterCompression(ServerShardState* s) const {
  algorithm_->EnterCompression(s);
}

absl::Status ServerOptimizer::Step(uint64_t step, bool last_warmup, float* acc, uint64_t off,
                                   size_t n, ServerShardState* s, uint8_t* reply) const {
  return Step(step, LearningRate(options(), step), last_warmup, acc, off, n, s, reply);
}

absl::Status ServerOptimizer::Step(uint64_t step, float lr, bool last_warmup, float* acc,
                                   uint64_t off, size_t n, ServerShardState* s,
                                   uint8_t* reply) const {
  return algorithm_->Step(step, lr, last_warmup, acc, off, n, s, reply);
}

bool ServerOptimizer::MeansInPieces(Phase phase) const { return algorithm_->MeansInPieces(phase); }

absl::Status ServerOptimizer::StepFromPushes(uint64_t step, float lr, bool last_warmup,
                                             const ChunkPushes& pushes, uint64_t off,
                                             ServerShardState* s, uint8_t* reply) const {
  return algorithm_->StepFromPushes(step, lr, last_warmup, pushes, off, s, reply);
}

absl::Status ServerOptimizer::StepShard(uint64_t step, float lr, bool last_warmup,
                                        const std::vector<ChunkSpan>& chunks,
                                        ServerShardState* s) const {
  return algorithm_->StepShard(step, lr, last_warmup, chunks, s);
}

// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<WorkerOptimizer>> WorkerOptimizer::Create(
    const OptimizerOptions& options) {
  auto algorithm = NewAlgorithm(options);
  if (!algorithm.ok()) return algorithm.status();
  return std::unique_ptr<WorkerOptimizer>(new WorkerOptimizer(*std::move(algorithm)));
}

namespace {

// Where a step is local only in part (diloco's fragments), which part.
std::string LocalWhere(const OptimizerCodecs& o, uint64_t step, uint64_t b) {
  if (o.KindOf(step, Phase::kCompress) == StepKind::kLocal) return "";
  return absl::StrCat(" for the shard of element ", b, " (its fragment does not sync then)");
}

// The state's arrays, nullptr where it holds none.
WorkerView ViewOf(WorkerState* s) {
  auto at = [](std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  WorkerView a;
  a.d = s->x.size();
  a.x = at(s->x);
  a.mbar = at(s->mbar);
  a.e = at(s->e);
  a.den = at(s->den);
  a.v = at(s->v);
  a.x_sync = at(s->x_sync);
  a.frozen = s->frozen;
  a.lrs = s->lrs;
  return a;
}

// fn(the WorkerArraySet member, the state's vector) for each array but x.
template <typename Fn>
void ForEachArray(WorkerState* s, Fn fn) {
  fn(&WorkerArraySet::mbar, &s->mbar);
  fn(&WorkerArraySet::e, &s->e);
  fn(&WorkerArraySet::den, &s->den);
  fn(&WorkerArraySet::v, &s->v);
  fn(&WorkerArraySet::x_sync, &s->x_sync);
}

// Sizes the arrays `set` names that the state lacks (zero); returns those.
WorkerArraySet Grow(const WorkerArraySet& set, WorkerState* s) {
  WorkerArraySet grown;
  ForEachArray(s, [&](bool WorkerArraySet::*which, std::vector<float>* v) {
    if (set.*which && v->size() != s->x.size()) {
      v->assign(s->x.size(), 0.0f);
      grown.*which = true;
    }
  });
  return grown;
}

// Drops the arrays `set` names.
void Drop(const WorkerArraySet& set, WorkerState* s) {
  ForEachArray(s, [&](bool WorkerArraySet::*which, std::vector<float>* v) {
    if (set.*which) {
      v->clear();
      v->shrink_to_fit();
    }
  });
}

WorkerArraySet Without(const WorkerArraySet& keep) {
  WorkerArraySet drop;
  drop.mbar = !keep.mbar;
  drop.e = !keep.e;
  drop.den = !keep.den;
  drop.v = !keep.v;
  drop.x_sync = !keep.x_sync;
  return drop;
}

}  // namespace

void WorkerOptimizer::InitState(uint64_t d, WorkerState* s) const {
  *s = WorkerState{};
  s->x.assign(d, 0.0f);
  s->frozen = !traits().warmup;
  Grow(WorkerArraysIn(PhaseOf(*s), false), s);
}

WorkerArraySet WorkerOptimizer::WorkerArraysIn(Phase phase, bool hand_over) const {
  return algorithm_->WorkerArraysIn(phase, hand_over);
}

void WorkerOptimizer::EnterCompression(WorkerState* s) const {
  Grow(WorkerArraysIn(Phase::kCompress, false), s);
  WorkerView a = ViewOf(s);
  // The host's operations do not fail.
  algorithm_->EnterCompression(HostArrayOps(), &a).IgnoreError();
  s->frozen = a.frozen;
  s->lrs = a.lrs;
  Drop(Without(WorkerArraysIn(Phase::kCompress, false)), s);
}

void WorkerOptimizer::BeginStep(uint64_t step, float lr, WorkerState* s) const {
  WorkerView a = ViewOf(s);
  BeginStep(step, lr, &a);
  s->lrs = a.lrs;
}

void WorkerOptimizer::EndStep(uint64_t step, WorkerState* s) const {
  WorkerView a = ViewOf(s);
  EndStep(step, &a);
  s->lrs = a.lrs;
}

absl::Status WorkerOptimizer::LocalStep(uint64_t step, float lr, const float* g, uint64_t b,
                                        size_t n, WorkerState* s) const {
  WorkerView a = ViewOf(s);
  return LocalStep(step, lr, g, b, n, HostArrayOps(), &a);
}

absl::Status WorkerOptimizer::Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                                   WorkerState* s, uint8_t* out, HeldMomentum* held) const {
  WorkerView a = ViewOf(s);
  a.held = held;
  return Push(step, lr, g, b, n, HostArrayOps(), &a, out);
}

absl::Status WorkerOptimizer::Apply(uint64_t step, bool last_warmup, const uint8_t* reply,
                                    uint64_t b, size_t n, WorkerState* s) const {
  return Apply(step, LearningRate(options(), step), last_warmup, reply, b, n, s);
}

absl::Status WorkerOptimizer::Apply(uint64_t step, float lr, bool last_warmup, const uint8_t* reply,
                                    uint64_t b, size_t n, WorkerState* s,
                                    HeldMomentum* held) const {
  // The hand-over's den appears with its first reply; a refused one leaves
  // the state as it was.
  const WorkerArraySet grown = Grow(WorkerArraysIn(PhaseOf(*s), last_warmup), s);
  WorkerView a = ViewOf(s);
  a.held = held;
  absl::Status st = Apply(step, lr, last_warmup, Payload{reply, reply}, b, n, HostArrayOps(), &a);
  if (!st.ok()) Drop(grown, s);
  return st;
}

absl::Status WorkerOptimizer::Merge(uint64_t pushed, uint64_t step, uint64_t b, size_t n,
                                    WorkerState* s) const {
  WorkerView a = ViewOf(s);
  return Merge(pushed, step, b, n, HostArrayOps(), &a);
}

void WorkerOptimizer::BeginStep(uint64_t step, float lr, WorkerView* s) const {
  algorithm_->BeginStep(step, lr, s);
}

void WorkerOptimizer::EndStep(uint64_t step, WorkerView* s) const { algorithm_->EndStep(step, s); }

absl::Status WorkerOptimizer::EnterCompression(const ArrayOps& ops, WorkerView* s) const {
  return algorithm_->EnterCompression(ops, s);
}

absl::Status WorkerOptimizer::LocalStep(uint64_t step, float lr, const float* g, uint64_t b,
                                        size_t n, const ArrayOps& ops, WorkerView* s) const {
  return algorithm_->LocalStep(step, lr, g, b, n, ops, s);
}

absl::Status WorkerOptimizer::Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                                   const ArrayOps& ops, WorkerView* s, uint8_t* out) const {
  if (KindAt(step, PhaseOf(*s), b) == StepKind::kLocal) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " is a local step", LocalWhere(*this, step, b), ": it sends nothing"));
  }
  return algorithm_->Push(step, lr, g, b, n, ops, s, out);
}

absl::Status WorkerOptimizer::Apply(uint64_t step, float lr, bool last_warmup, Payload reply,
                                    uint64_t b, size_t n, const ArrayOps& ops,
                                    WorkerView* s) const {
  if (KindAt(step, PhaseOf(*s), b) == StepKind::kLocal) {
    return absl::FailedPreconditionError(absl::StrCat("step ", step, " is a local step",
                                                      LocalWhere(*this, step, b),
                                                      ": there is no reply to apply"));
  }
  return algorithm_->Apply(step, lr, last_warmup, reply, b, n, ops, s);
}

absl::Status WorkerOptimizer::Merge(uint64_t pushed, uint64_t step, uint64_t b, size_t n,
                                    const ArrayOps& ops, WorkerView* s) const {
  if (step != MergeStep(pushed) || step == pushed) {
    return absl::FailedPreconditionError(absl::StrCat("the replies of step ", pushed,
                                                      " are merged at step ", MergeStep(pushed),
                                                      ", not at step ", step));
  }
  return algorithm_->Merge(pushed, step, b, n, ops, s);
}

}  // namespace onebit
