// adam: plain Adam in fp32 throughout (a warm-up that never ends: no
// compression phase); the server keeps m and v.
#include <memory>

#include "optim/algorithms.h"
#include "optim/momentum_family.h"
#include "optim/step_parts.h"

namespace onebit {
namespace {

class Adam final : public MomentumFamily {
 public:
  Adam(const AlgorithmTraits& t, const OptimizerOptions& o) : MomentumFamily(t, o) {}
  void InitServer(ServerShardState* s) const override { SizeAdamMoments(s); }
};

}  // namespace

const AlgorithmRow& AdamRow() {
  static const AlgorithmRow* row = [] {
    auto* r = new AlgorithmRow;
    r->traits.kind = OptimizerKind::kAdam;
    r->traits.name = "adam";
    r->traits.fp16_warmup = true;
    r->traits.adam_state_on_servers = true;
    r->traits.server_arrays = {"m", "v"};
    r->make = MakeAlgorithm<Adam>;
    return r;
  }();
  return *row;
}

}  // namespace onebit
