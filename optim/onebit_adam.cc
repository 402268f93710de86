// onebit-adam (docs/design.md §1.1-§1.4): Adam in fp32 for the warm-up; at its
// last step the server freezes v (floored) and hands m and v over; from then
// on every worker pushes its error-compensated 1-bit momentum, and the server
// replies the 1-bit averaged momentum (or delta) with its own error
// feedback, both sides preconditioning with the frozen den = sqrt(v) + eps.
#include <memory>

#include "optim/algorithms.h"
#include "optim/momentum_family.h"
#include "optim/step_parts.h"

namespace onebit {
namespace {

class OnebitAdam final : public MomentumFamily {
 public:
  OnebitAdam(const AlgorithmTraits& t, const OptimizerOptions& o) : MomentumFamily(t, o) {}
  void InitServer(ServerShardState* s) const override { SizeAdamMoments(s); }
  void EnterCompression(ServerShardState* s) const override {
    MomentumFamily::EnterCompression(s);
    s->m.clear();  // the server's momentum is now the synchronized one
    s->m.shrink_to_fit();
  }
  using MomentumFamily::EnterCompression;
};

}  // namespace

const AlgorithmRow& OnebitAdamRow() {
  static const AlgorithmRow* row = [] {
    auto* r = new AlgorithmRow;
    r->traits.kind = OptimizerKind::kOnebitAdam;
    r->traits.name = "onebit-adam";
    r->traits.compression = true;
    r->traits.worker_momentum = true;
    r->traits.den_of_frozen_v = true;
    r->traits.fp16_warmup = true;
    r->traits.adam_state_on_servers = true;
    r->traits.worker_arrays = {"mbar", "e_w", "den"};
    // e_s takes m's place at the freeze.
    r->traits.server_arrays = {"m or e_s", "v", "den"};
    r->make = MakeAlgorithm<OnebitAdam>;
    return r;
  }();
  return *row;
}

}  // namespace onebit
