#include "shard/update_rule.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace onebit {
namespace {

// Δ = -lr * ḡ.
class SgdRule final : public UpdateRule {
 public:
  explicit SgdRule(const UpdateOptions& o) : o_(o) {}
  absl::string_view name() const override { return "sgd"; }
  void InitState(ShardState* s) const override {
    s->m.clear();
    s->v.clear();
  }
  void Apply(const float* g, uint64_t offset, size_t n, ShardState* s,
             float* delta) const override {
    float* x = s->x.data() + offset;
    const float neg_lr = -o_.lr;
    for (size_t i = 0; i < n; ++i) {
      const float d = neg_lr * g[i];
      delta[i] = d;
      x[i] += d;
    }
  }

 private:
  const UpdateOptions o_;
};

// m = b1*m + (1-b1)*ḡ; v = b2*v + (1-b2)*ḡ*ḡ; Δ = -lr*(m/(sqrt(v)+eps) + wd*x).
// No bias correction (as DeepSpeed's OneBitAdam, DESIGN.md §1).
class AdamRule final : public UpdateRule {
 public:
  explicit AdamRule(const UpdateOptions& o) : o_(o) {}
  absl::string_view name() const override { return "adam"; }
  void InitState(ShardState* s) const override {
    s->m.assign(s->x.size(), 0.0f);
    s->v.assign(s->x.size(), 0.0f);
  }
  void Apply(const float* g, uint64_t offset, size_t n, ShardState* s,
             float* delta) const override {
    float* x = s->x.data() + offset;
    float* m = s->m.data() + offset;
    float* v = s->v.data() + offset;
    const float b1 = o_.beta1, b2 = o_.beta2, eps = o_.eps, wd = o_.weight_decay;
    const float c1 = 1.0f - b1, c2 = 1.0f - b2, neg_lr = -o_.lr;
    for (size_t i = 0; i < n; ++i) {
      const float gi = g[i];
      const float mi = b1 * m[i] + c1 * gi;
      const float vi = b2 * v[i] + c2 * gi * gi;
      const float d = neg_lr * (mi / (std::sqrt(vi) + eps) + wd * x[i]);
      m[i] = mi;
      v[i] = vi;
      delta[i] = d;
      x[i] += d;
    }
  }

 private:
  const UpdateOptions o_;
};

}  // namespace

absl::StatusOr<UpdateKind> ParseUpdateKind(absl::string_view name) {
  if (name == "sgd") return UpdateKind::kSgd;
  if (name == "adam") return UpdateKind::kAdam;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer '", name, "' (want sgd or adam)"));
}

absl::StatusOr<std::unique_ptr<const UpdateRule>> NewUpdateRule(const UpdateOptions& o) {
  if (!std::isfinite(o.lr) || o.lr < 0) {
    return absl::InvalidArgumentError(absl::StrCat("lr must be finite and >= 0, got ", o.lr));
  }
  switch (o.kind) {
    case UpdateKind::kSgd:
      return std::unique_ptr<const UpdateRule>(new SgdRule(o));
    case UpdateKind::kAdam:
      if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1)) {
        return absl::InvalidArgumentError("beta1 and beta2 must lie in [0, 1)");
      }
      if (!(o.eps > 0) || !std::isfinite(o.eps) || !std::isfinite(o.weight_decay)) {
        return absl::InvalidArgumentError("eps must be > 0 and weight_decay finite");
      }
      return std::unique_ptr<const UpdateRule>(new AdamRule(o));
  }
  return absl::InvalidArgumentError("unknown update kind");
}

}  // namespace onebit
