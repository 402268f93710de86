// ef-sgd: error-feedback 1-bit momentum SGD from step 0 (no warm-up, no
// preconditioner): the compression phase of onebit-adam with den = 1.
#include <memory>

#include "optim/algorithms.h"
#include "optim/momentum_family.h"

namespace onebit {
namespace {

class EfSgd final : public MomentumFamily {
 public:
  EfSgd(const AlgorithmTraits& t, const OptimizerOptions& o) : MomentumFamily(t, o) {}
};

}  // namespace

const AlgorithmRow& EfSgdRow() {
  static const AlgorithmRow* row = [] {
    auto* r = new AlgorithmRow;
    r->traits.kind = OptimizerKind::kEfSgd;
    r->traits.name = "ef-sgd";
    r->traits.warmup = false;
    r->traits.compression = true;
    r->traits.worker_momentum = true;
    r->traits.worker_arrays = {"mbar", "e_w"};
    r->traits.server_arrays = {"e_s"};
    r->make = MakeAlgorithm<EfSgd>;
    return r;
  }();
  return *row;
}

}  // namespace onebit
