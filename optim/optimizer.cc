#include "optim/optimizer.h"

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

void WorkerOptimizer::InitState(uint64_t d, WorkerState* s) const {
  *s = WorkerState{};
  s->x.assign(d, 0.0f);
  if (traits().compression) {
    s->mbar.assign(d, 0.0f);
    s->e.assign(d, 0.0f);
  }
  algorithm_->InitWorker(s);
  if (!traits().warmup) s->frozen = true;
}

void WorkerOptimizer::EnterCompression(WorkerState* s) const { algorithm_->EnterCompression(s); }

void WorkerOptimizer::BeginStep(uint64_t step, float lr, WorkerState* s) const {
  algorithm_->BeginStep(step, lr, s);
}

void WorkerOptimizer::EndStep(uint64_t step, WorkerState* s) const { algorithm_->EndStep(step, s); }

absl::Status WorkerOptimizer::LocalStep(uint64_t step, float lr, const float* g, uint64_t b,
                                        size_t n, WorkerState* s) const {
  return algorithm_->LocalStep(step, lr, g, b, n, s);
}

absl::Status WorkerOptimizer::Push(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                                   WorkerState* s, uint8_t* out) const {
  if (KindOf(step, PhaseOf(*s)) == StepKind::kLocal) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is a local step: it sends nothing"));
  }
  return algorithm_->Push(step, lr, g, b, n, s, out);
}

absl::Status WorkerOptimizer::Apply(uint64_t step, bool last_warmup, const uint8_t* reply,
                                    uint64_t b, size_t n, WorkerState* s) const {
  return Apply(step, LearningRate(options(), step), last_warmup, reply, b, n, s);
}

absl::Status WorkerOptimizer::Apply(uint64_t step, float lr, bool last_warmup, const uint8_t* reply,
                                    uint64_t b, size_t n, WorkerState* s) const {
  if (KindOf(step, PhaseOf(*s)) == StepKind::kLocal) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is a local step: there is no reply to apply"));
  }
  return algorithm_->Apply(step, lr, last_warmup, reply, b, n, s);
}

}  // namespace onebit
