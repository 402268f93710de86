#include "optim/registry.h"

#include <cmath>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "optim/algorithms.h"
#include "optim/step_parts.h"

namespace onebit {
namespace {

// "a, b or c".
std::string NamesWhere(bool (*pick)(const AlgorithmTraits&)) {
  std::vector<std::string> names;
  for (const AlgorithmRow* row : AlgorithmRows()) {
    if (pick(row->traits)) names.emplace_back(row->traits.name);
  }
  if (names.size() < 2) return absl::StrJoin(names, "");
  const std::string last = names.back();
  names.pop_back();
  return absl::StrCat(absl::StrJoin(names, ", "), " or ", last);
}

StateSize SizeOf(std::vector<const char*> arrays, uint64_t n) {
  StateSize s;
  s.bytes = arrays.size() * n * sizeof(float);  // n <= 2^34: no overflow
  s.arrays = absl::StrJoin(arrays, ", ");
  return s;
}

}  // namespace

const std::vector<const AlgorithmRow*>& AlgorithmRows() {
  // In OptimizerKind's order (RowOf checks it).
  static const auto* rows = new std::vector<const AlgorithmRow*>{
      &SgdRow(),   &AdamRow(),        &OnebitAdamRow(), &NaiveOnebitAdamRow(),
      &EfSgdRow(), &ZeroOneAdamRow(), &OnebitLambRow(), &DilocoRow(),
  };
  return *rows;
}

const AlgorithmRow& RowOf(OptimizerKind kind) {
  const auto& rows = AlgorithmRows();
  const size_t i = static_cast<size_t>(kind);
  // A row out of order is a build mistake, found by every test.
  if (i >= rows.size() || rows[i]->traits.kind != kind) std::abort();
  return *rows[i];
}

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name) {
  for (const AlgorithmRow* row : AlgorithmRows()) {
    if (row->traits.name == name) return row->traits.kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer '", name, "' (want ",
                   NamesWhere([](const AlgorithmTraits&) { return true; }), ")"));
}

absl::string_view OptimizerKindName(OptimizerKind kind) { return TraitsOf(kind).name; }

absl::string_view DefaultCodec(OptimizerKind kind) {
  return HasCompressionPhase(kind) ? "onebit" : "fp32";
}

uint32_t DefaultBlockSize(OptimizerKind kind) {
  const uint32_t own = TraitsOf(kind).default_block_size;
  return own != 0 ? own : CodecOptions{}.block_size;
}

std::string DivergenceRemedy(const OptimizerOptions& o) {
  if (const auto remedy = RowOf(o.kind).remedy; remedy != nullptr) return remedy(o);
  return "a lower --lr, a learning-rate warm-up (--lr_schedule warmup:N) or a larger --v_floor";
}

StateSize WorkerStateSize(const OptimizerOptions& o, uint64_t d) {
  std::vector<const char*> arrays = {"x", "g"};
  const auto& own = TraitsOf(o.kind).worker_arrays;
  arrays.insert(arrays.end(), own.begin(), own.end());
  return SizeOf(arrays, d);
}

StateSize ServerShardSize(const OptimizerOptions& o, uint64_t n) {
  std::vector<const char*> arrays = {"x", "the accumulators"};
  const auto& own = TraitsOf(o.kind).server_arrays;
  arrays.insert(arrays.end(), own.begin(), own.end());
  if (o.reply == ReplyMode::kDelta) arrays.push_back("the replica");
  return SizeOf(arrays, n);
}

absl::Status ValidateOptimizerOptions(const OptimizerOptions& o) {
  const AlgorithmRow& row = RowOf(o.kind);
  const AlgorithmTraits& t = row.traits;
  if (!std::isfinite(o.lr) || o.lr < 0) return SettingError("lr", "must be finite and >= 0");
  if (!(o.beta1 >= 0 && o.beta1 < 1)) return SettingError("beta1", "must lie in [0, 1)");
  if (!(o.beta2 >= 0 && o.beta2 < 1)) return SettingError("beta2", "must lie in [0, 1)");
  if (!(o.eps > 0) || !std::isfinite(o.eps)) return SettingError("eps", "must be finite and > 0");
  if (!std::isfinite(o.weight_decay)) return SettingError("weight_decay", "must be finite");
  if (absl::Status st = ValidateDecayRanges(o.weight_decay_ranges, kNever); !st.ok()) return st;
  if (absl::Status st = ValidateLrScaleRanges(o.lr_scale_ranges, kNever); !st.ok()) return st;
  if (!(o.v_floor >= 0) || !std::isfinite(o.v_floor)) {
    return SettingError("v_floor", "must be finite and >= 0");
  }
  for (const auto& [flag, name] :
       {std::pair<const char*, std::string>{"worker_codec", o.worker_codec},
        std::pair<const char*, std::string>{"server_codec", o.server_codec}}) {
    if (!ParseCodecKind(name).ok()) {
      return SettingError(flag,
                          absl::StrCat("unknown codec '", name, "' (want fp32, fp16 or onebit)"));
    }
    if (!t.compression && name != "fp32") {
      return SettingError(
          flag, absl::StrCat(t.name,
                             " communicates in fp32 throughout (it has no compression phase); "
                             "compress with ",
                             NamesWhere([](const AlgorithmTraits& a) { return a.compression; })));
    }
  }
  if (o.warmup_codec != "fp32") {
    if (o.warmup_codec != "fp16") {
      return SettingError("warmup_codec",
                          absl::StrCat("'", o.warmup_codec, "': want fp32 or fp16"));
    }
    if (!t.fp16_warmup) {
      return SettingError("warmup_codec", absl::StrCat(t.name, " has no warm-up to send in fp16"));
    }
  }
  for (size_t i = 0; i < o.layer_ends.size(); ++i) {
    if (o.layer_ends[i] == 0 || (i > 0 && o.layer_ends[i] <= o.layer_ends[i - 1])) {
      return SettingError("layer_ends", absl::StrCat("must be strictly increasing and > 0; end ", i,
                                                     " is ", o.layer_ends[i]));
    }
  }
  if (o.schedule == LrScheduleKind::kWarmup && o.schedule_steps < 1) {
    return SettingError("lr_schedule", "warmup:N needs N >= 1");
  }
  return row.validate != nullptr ? row.validate(o) : absl::OkStatus();
}

}  // namespace onebit
