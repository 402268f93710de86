// naive-onebit-adam, the baseline 1-bit Adam exists to beat (docs/design.md
// §1.4): after the warm-up the workers push 1-bit gradients and the server
// runs Adam on their average, v included, replying the 1-bit delta.
#include <memory>

#include "optim/algorithms.h"
#include "optim/momentum_family.h"
#include "optim/step_parts.h"

namespace onebit {
namespace {

class NaiveOnebitAdam final : public MomentumFamily {
 public:
  NaiveOnebitAdam(const AlgorithmTraits& t, const OptimizerOptions& o) : MomentumFamily(t, o) {}
  void InitServer(ServerShardState* s) const override { SizeAdamMoments(s); }

 private:
  absl::Status MasterUpdate(uint64_t step, float lr, float* a, uint64_t off, size_t n,
                            ServerShardState* s) const override {
    return AdamStepOnShard(o_, step, lr, a, off, n, s);
  }
};

absl::Status Validate(const OptimizerOptions& o) {
  if (o.reply != ReplyMode::kDelta) {
    return SettingError("server_reply",
                        "naive-onebit-adam replies deltas: its v changes every step, so workers "
                        "cannot expand a momentum reply");
  }
  return absl::OkStatus();
}

}  // namespace

const AlgorithmRow& NaiveOnebitAdamRow() {
  static const AlgorithmRow* row = [] {
    auto* r = new AlgorithmRow;
    r->traits.kind = OptimizerKind::kNaiveOnebitAdam;
    r->traits.name = "naive-onebit-adam";
    r->traits.compression = true;
    r->traits.fp16_warmup = true;
    r->traits.adam_state_on_servers = true;
    r->traits.default_reply = ReplyMode::kDelta;
    r->traits.worker_arrays = {"mbar", "e_w"};
    r->traits.server_arrays = {"m", "v", "e_s"};
    r->validate = Validate;
    r->make = MakeAlgorithm<NaiveOnebitAdam>;
    return r;
  }();
  return *row;
}

}  // namespace onebit
