// sgd: plain SGD in fp32 throughout, x <- x - lr g (a warm-up that never
// ends: no compression phase).
#include <memory>

#include "optim/algorithms.h"
#include "optim/momentum_family.h"

namespace onebit {
namespace {

class Sgd final : public MomentumFamily {
 public:
  Sgd(const AlgorithmTraits& t, const OptimizerOptions& o) : MomentumFamily(t, o) {}

 private:
  absl::Status WarmupUpdate(uint64_t step, float lr, float* d, uint64_t off, size_t n,
                            ServerShardState* s) const override {
    (void)step;
    float* x = s->x.data() + off;
    ForEachRangeSetting(o_, s->begin + off, n, [&](size_t p, size_t m, float, float ls) {
      const float k = -(lr * ls);
      for (size_t i = p; i < p + m; ++i) {
        d[i] = k * d[i];
        x[i] += d[i];
      }
    });
    return absl::OkStatus();
  }
};

}  // namespace

const AlgorithmRow& SgdRow() {
  static const AlgorithmRow* row = [] {
    auto* r = new AlgorithmRow;
    r->traits.kind = OptimizerKind::kSgd;
    r->traits.name = "sgd";
    r->traits.fp16_warmup = true;
    r->make = MakeAlgorithm<Sgd>;
    return r;
  }();
  return *row;
}

}  // namespace onebit
