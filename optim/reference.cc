#include "optim/reference.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "optim/update_kernels.h"
#include "util/memory.h"

namespace onebit {

uint64_t AutoFreezeStep(const FreezeOptions& freeze, uint64_t completed,
                        const std::vector<double>& changes) {
  const uint64_t step = completed + freeze.window;
  if (freeze.latest != kNever && step >= freeze.latest) return step;
  for (double c : changes) {
    if (!(c < freeze.tau)) return kNever;
  }
  return step;
}

StateSize ReferenceSize(const ReferenceOptions& o) {
  const uint64_t d = o.map.num_params();
  const StateSize worker = WorkerStateSize(o.optimizer, d);
  const StateSize shards = ServerShardSize(o.optimizer, d);
  StateSize s;
  const uint64_t local = o.local_ranks > 1 ? o.local_ranks : 0;  // their gradients
  s.bytes = (1 + local) * d * sizeof(float) + o.workers * worker.bytes + shards.bytes;
  s.arrays = absl::StrCat("x0, ", o.workers, " workers' ", worker.arrays, ", ", o.map.num_shards(),
                          " shards' ", shards.arrays,
                          local > 0 ? absl::StrCat(", ", local, " local ranks' g") : "");
  return s;
}

absl::StatusOr<ReferenceResult> RunReference(const ReferenceOptions& o,
                                             const std::vector<float>& x0,
                                             const GradientFn& gradient) {
  const StateSize size = ReferenceSize(o);
  if (absl::Status st = CheckMemory(
          absl::StrCat("the reference of d = ", o.map.num_params(), " (", size.arrays, ")"),
          size.bytes);
      !st.ok()) {
    return st;
  }
  auto server = ServerOptimizer::Create(o.optimizer);
  if (!server.ok()) return server.status();
  auto worker = WorkerOptimizer::Create(o.optimizer);
  if (!worker.ok()) return worker.status();
  const uint64_t d = o.map.num_params();
  if (x0.size() != d) return absl::InvalidArgumentError("reference: x0 size differs from the map");
  const uint32_t N = o.workers, S = o.map.num_shards();
  const bool warmup = HasWarmup(o.optimizer.kind) && HasCompressionPhase(o.optimizer.kind);

  ReferenceResult out;
  const bool own_freeze = TraitsOf(o.optimizer.kind).schedule_freeze;
  out.freeze_step = !HasCompressionPhase(o.optimizer.kind) ? kNever
                    : !warmup                              ? 0
                    : own_freeze                           ? o.optimizer.zero_one.var_freeze_step
                    : o.freeze.automatic                   ? kNever
                                                           : o.freeze.step;
  out.workers.resize(N);
  for (WorkerState& w : out.workers) {
    (*worker)->InitState(d, &w);
    w.x = x0;
    if (!w.x_sync.empty()) w.x_sync = x0;  // diloco: the master, as the workers' start
  }
  out.servers.resize(S);
  for (uint32_t k = 0; k < S; ++k) {
    const Range r = o.map.shard(k);
    (*server)->InitState(k, r.begin, r.size(), &out.servers[k]);
    std::copy(x0.begin() + r.begin, x0.begin() + r.end, out.servers[k].x.begin());
  }

  std::vector<std::vector<float>> g(N, std::vector<float>(d));
  const uint32_t K = std::max<uint32_t>(o.local_ranks, 1);
  std::vector<std::vector<float>> local_g(K > 1 ? K : 0, std::vector<float>(d));
  std::vector<const float*> local_ptrs;
  for (const std::vector<float>& l : local_g) local_ptrs.push_back(l.data());
  std::vector<uint8_t> push, reply;
  std::vector<float> acc;
  const float w = 1.0f / static_cast<float>(N);
  // Syncs merged at a later step (diloco's --sync_delay): shard, the step
  // pushed. Their replies are applied at once: Apply then changes only
  // x_sync, which the local steps in between do not read.
  std::vector<std::pair<uint32_t, uint64_t>> merges;
  for (uint64_t t = 0; t < o.steps; ++t) {
    double loss = 0;
    for (uint32_t r = 0; r < N; ++r) {
      if (K > 1) {
        double local = 0;
        for (uint32_t k = 0; k < K; ++k) {
          auto l = gradient(out.workers[r].x.data(), r * K + k, t, local_g[k].data());
          if (!l.ok()) return l.status();
          local += *l;
        }
        MeanInOrder(local_ptrs.data(), K, d, g[r].data());
        loss += local / K;
        continue;
      }
      auto l = gradient(out.workers[r].x.data(), r, t, g[r].data());
      if (!l.ok()) return l.status();
      loss += *l;
    }
    out.losses.push_back(loss / N);
    const bool last_warmup = warmup && out.freeze_step != kNever && t + 1 == out.freeze_step;
    const Phase phase = PhaseOf(out.workers[0]);
    const StepKind kind = (*worker)->KindOf(t, phase);
    const float lr = LearningRate(o.optimizer, t);
    for (WorkerState& ws : out.workers) (*worker)->BeginStep(t, lr, &ws);
    uint64_t up = 0, down = 0;
    if (kind == StepKind::kLocal) {
      for (uint32_t i = 0; i < N; ++i) {
        absl::Status st = (*worker)->LocalStep(t, lr, g[i].data(), 0, d, &out.workers[i]);
        if (!st.ok()) return st;
      }
      for (ServerShardState& s : out.servers) ++s.step;
    } else {
      ++out.rounds;
    }
    for (uint32_t k = 0; k < S && kind != StepKind::kLocal; ++k) {
      const Range r = o.map.shard(k);
      const size_t n = r.size();
      // A shard whose diloco fragment does not sync this step: its part of
      // the step is each worker's own update, as a local step's.
      if ((*worker)->KindAt(t, phase, r.begin) == StepKind::kLocal) {
        for (uint32_t i = 0; i < N; ++i) {
          absl::Status st = (*worker)->LocalStep(t, lr, g[i].data(), r.begin, n, &out.workers[i]);
          if (!st.ok()) return st;
        }
        ++out.servers[k].step;
        continue;
      }
      acc.assign(n, 0.0f);  // +0.0f, then the ranks in order
      push.resize((*worker)->push_codec(kind).EncodedSize(n));
      for (uint32_t i = 0; i < N; ++i) {
        absl::Status st =
            (*worker)->Push(t, lr, g[i].data(), r.begin, n, &out.workers[i], push.data());
        if (st.ok()) st = (*server)->push_codec(kind).DecodeAdd(push.data(), n, w, acc.data());
        if (!st.ok()) return st;
        up += push.size();
      }
      reply.resize((*server)->ReplyBytes(kind, r.begin, n, last_warmup));
      absl::Status st =
          (*server)->Step(t, last_warmup, acc.data(), 0, n, &out.servers[k], reply.data());
      if (!st.ok()) return st;
      for (uint32_t i = 0; i < N; ++i) {
        st = (*worker)->Apply(t, last_warmup, reply.data(), r.begin, n, &out.workers[i]);
        if (!st.ok()) return st;
        down += reply.size();
      }
      if ((*worker)->MergeStep(t) != t) merges.emplace_back(k, t);
      ++out.servers[k].step;
    }
    for (auto m = merges.begin(); m != merges.end();) {
      if ((*worker)->MergeStep(m->second) != t) {
        ++m;
        continue;
      }
      const Range r = o.map.shard(m->first);
      for (WorkerState& ws : out.workers) {
        absl::Status st = (*worker)->Merge(m->second, t, r.begin, r.size(), &ws);
        if (!st.ok()) return st;
      }
      m = merges.erase(m);
    }
    for (WorkerState& ws : out.workers) (*worker)->EndStep(t, &ws);
    out.push_bytes.push_back(up);
    out.reply_bytes.push_back(down);
    if (last_warmup) {
      for (ServerShardState& s : out.servers) (*server)->EnterCompression(&s);
      for (WorkerState& ws : out.workers) (*worker)->EnterCompression(&ws);
    }
    // The automatic freeze: every `window` steps, compare each shard's v with
    // the previous check.
    const uint64_t done = t + 1;
    if (warmup && o.freeze.automatic && out.freeze_step == kNever && done % o.freeze.window == 0) {
      std::vector<double> changes;
      for (ServerShardState& s : out.servers) {
        changes.push_back(FreezeCheckChange(o.optimizer, o.freeze.window, done, s.v, s.v_check));
        s.v_check = s.v;
      }
      out.freeze_step = AutoFreezeStep(o.freeze, done, changes);
    }
  }
  return out;
}

}  // namespace onebit
