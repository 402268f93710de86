#include "optim/algorithm.h"

#include "absl/strings/str_cat.h"

namespace onebit {

size_t Algorithm::ReplyBytes(StepKind kind, size_t n, bool last_warmup) const {
  if (kind == StepKind::kLocal) return 0;
  size_t bytes = reply_codec(kind).EncodedSize(n);
  if (kind == StepKind::kFull && last_warmup && traits_.den_of_frozen_v) {
    bytes += 2 * fp32_->EncodedSize(n);
  }
  return bytes;
}

void Algorithm::EnterCompression(ServerShardState* s) const {
  s->frozen = true;
  s->e.assign(s->x.size(), 0.0f);
  s->v_check.clear();
  s->v_check.shrink_to_fit();
}

absl::Status Algorithm::StepShard(uint64_t step, float lr, bool last_warmup,
                                  const std::vector<ChunkSpan>& chunks, ServerShardState* s) const {
  for (const ChunkSpan& c : chunks) {
    if (absl::Status st = Step(step, lr, last_warmup, c.acc, c.off, c.n, s, c.reply); !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

absl::Status Algorithm::StepFromPushes(uint64_t step, float lr, bool last_warmup,
                                       const ChunkPushes& pushes, uint64_t off, ServerShardState* s,
                                       uint8_t* reply) const {
  // The mean summed whole, as a server's acc holds it.
  std::vector<float> acc(pushes.n);
  const size_t piece = pushes.codec->piece_elems();
  for (size_t b = 0; b < pushes.n; b += piece) {
    pushes.Mean(b, std::min(pushes.n, b + piece), acc.data() + b);
  }
  return Step(step, lr, last_warmup, acc.data(), off, pushes.n, s, reply);
}

WorkerArraySet Algorithm::WorkerArraysIn(Phase phase, bool hand_over) const {
  WorkerArraySet set;
  set.mbar = set.e = traits_.compression;
  set.den = traits_.den_of_frozen_v && (phase == Phase::kCompress || hand_over);
  return set;
}

absl::Status Algorithm::LocalStep(uint64_t step, float lr, const float* g, uint64_t b, size_t n,
                                  const ArrayOps& ops, WorkerView* s) const {
  (void)lr, (void)g, (void)b, (void)n, (void)ops, (void)s;
  return absl::FailedPreconditionError(
      absl::StrCat("step ", step, " synchronises: it is no local step"));
}

absl::StatusOr<std::unique_ptr<const Algorithm>> NewAlgorithm(const OptimizerOptions& o) {
  if (absl::Status st = ValidateOptimizerOptions(o); !st.ok()) return st;
  const AlgorithmRow& row = RowOf(o.kind);
  std::unique_ptr<Algorithm> a = row.make(row.traits, o);
  auto fp32 = NewCodec(CodecKind::kFp32, o.codec);
  auto warmup = NewCodec(o.warmup_codec, o.codec);
  auto w = NewCodec(o.worker_codec, o.codec);
  auto s = NewCodec(o.server_codec, o.codec);
  for (const auto* c : {&fp32, &warmup, &w, &s}) {
    if (!c->ok()) return c->status();
  }
  a->fp32_ = std::move(*fp32);
  a->warmup_codec_ = std::move(*warmup);
  a->worker_codec_ = std::move(*w);
  a->server_codec_ = std::move(*s);
  return std::unique_ptr<const Algorithm>(std::move(a));
}

}  // namespace onebit
