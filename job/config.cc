#include "job/config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "models/registry.h"
#include "net/data_plane.h"
#include "optim/optimizer.h"

namespace onebit {

absl::Status ResolveConfig(const std::set<std::string>& given, control::TrainingConfig* config) {
  control::TrainingConfig& c = *config;
  if (const ModelEntry* m = FindModel(c.model()); m != nullptr) {
    if (absl::Status st = ResolveModelOptions(&c); !st.ok()) return st;
    // The shard map needs d before any worker has built the model.
    absl::StatusOr<uint64_t> d = m->num_params(c);
    if (!d.ok()) return d.status();
    c.set_dim(*d);
    if (m->epoch_steps != nullptr) {
      absl::StatusOr<uint64_t> per_epoch = m->epoch_steps(c);
      if (!per_epoch.ok()) return per_epoch.status();
      if (c.epochs() > 0) c.set_steps(c.epochs() * *per_epoch);
      if (c.eval_every() == 0) c.set_eval_every(*per_epoch);
    }
  }
  if (c.model() == kExternalModel) {
    // The workers declare d when they register; their program decides when
    // the job ends unless --steps fixes it.
    c.set_dim(0);
    if (!given.count("steps")) c.set_steps(0);
  }
  // Fill in the optimizer's defaults, so every process sees one resolved config.
  auto kind = ParseOptimizerKind(c.optimizer());
  if (kind.ok()) {
    if (c.worker_codec().empty()) c.set_worker_codec(std::string(DefaultCodec(*kind)));
    if (c.server_codec().empty()) c.set_server_codec(std::string(DefaultCodec(*kind)));
    if (!given.count("block_size")) c.set_block_size(DefaultBlockSize(*kind));
    if (c.server_reply().empty()) {
      c.set_server_reply(std::string(ReplyModeName(DefaultReplyMode(*kind))));
    }
    // (zero-one-adam's freeze is --var_freeze_step.)
    if (HasWarmup(*kind) && HasCompressionPhase(*kind) && !TraitsOf(*kind).schedule_freeze &&
        c.freeze_step() == 0 && c.freeze().empty()) {
      c.set_freeze("auto");
    }
  }
  return absl::OkStatus();
}

namespace {

// A value for an error message: floats in the fewest digits that still name
// that float (0.01, not 0.00999999978).
std::string Shown(const JobSetting& s, const control::TrainingConfig& c) {
  const std::string exact = JobSettingText(s, c);
  if (s.type != SettingType::kFloat) return exact;
  control::TrainingConfig back;
  for (int digits = 1; digits < 9; ++digits) {
    const std::string text = absl::StrFormat("%.*g", digits, std::stof(exact));
    if (SetJobSetting(s, text, &back).ok() && JobSettingText(s, back) == exact) return text;
  }
  return exact;
}

}  // namespace

absl::Status ApplyDeclaredSettings(const std::map<std::string, std::string>& declared,
                                   std::set<std::string>* given, control::TrainingConfig* config) {
  // Rebuilt from the defaults and the job's own settings, so that nothing
  // the first resolution derived (codecs, freeze) outlives what it came from.
  control::TrainingConfig c = DefaultJobConfig();
  for (const JobSetting& s : JobSettings()) {
    if (!given->count(s.name)) continue;
    if (absl::Status st = SetJobSetting(s, JobSettingText(s, *config), &c); !st.ok()) {
      return absl::InternalError(absl::StrCat("--", s.name, ": ", st.message()));
    }
  }
  std::set<std::string> now = *given;
  for (const auto& [name, value] : declared) {
    const JobSetting* s = FindJobSetting(name);
    if (s == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("the workers declare '", name, "', which is no job setting"));
    }
    const std::string group = s->group;
    if (group != "optimizer" && group != "compression") {
      return absl::InvalidArgumentError(
          absl::StrCat("--", s->name,
                       ": a worker may declare only optimizer and compression "
                       "settings; this one is the job's (onebit-launch / onebit-coordinator)"));
    }
    control::TrainingConfig mine = c;
    if (absl::Status st = SetJobSetting(*s, value, &mine); !st.ok()) {
      return SettingError(s->name,
                          absl::StrCat("the workers declare '", value, "': ", st.message()));
    }
    if (now.count(s->name) && JobSettingText(*s, mine) != JobSettingText(*s, c)) {
      return SettingError(s->name,
                          absl::StrCat("the job sets ", Shown(*s, c), " and the workers declare ",
                                       Shown(*s, mine), "; give it in one place"));
    }
    c = std::move(mine);
    now.insert(s->name);
  }
  // An external model's d is the workers' too.
  const uint64_t dim = config->dim();
  if (absl::Status st = ResolveConfig(now, &c); !st.ok()) return st;
  if (c.model() == kExternalModel) c.set_dim(dim);
  if (absl::Status st = ValidateConfig(c); !st.ok()) return st;
  *config = std::move(c);
  *given = std::move(now);
  return absl::OkStatus();
}

absl::StatusOr<OptimizerOptions> OptimizerOptionsFromConfig(const control::TrainingConfig& c) {
  OptimizerOptions o;
  auto kind = ParseOptimizerKind(c.optimizer());
  if (!kind.ok()) return SettingError("optimizer", kind.status().message());
  o.kind = *kind;
  o.lr = c.lr();
  if (absl::Status st = ParseLrSchedule(c.lr_schedule(), c.steps(), &o); !st.ok()) return st;
  o.beta1 = c.beta1();
  o.beta2 = c.beta2();
  o.eps = c.eps();
  o.weight_decay = c.weight_decay();
  o.bias_correction = c.bias_correction();
  o.v_floor = c.v_floor();
  if (absl::Status st = ParseErrorFeedback(c.error_feedback(), &o); !st.ok()) return st;
  auto reply = ParseReplyMode(c.server_reply());
  if (!reply.ok()) return SettingError("server_reply", reply.status().message());
  o.reply = *reply;
  auto scale = ParseScaleRule(c.scale());
  if (!scale.ok()) return SettingError("scale", scale.status().message());
  o.codec.scale = *scale;
  o.codec.block_size = c.block_size();
  o.worker_codec = c.worker_codec();
  o.server_codec = c.server_codec();
  o.warmup_codec = c.warmup_codec().empty() ? "fp32" : c.warmup_codec();
  o.zero_one.var_freeze_step = c.var_freeze_step();
  o.zero_one.var_update_scaler = c.var_update_scaler();
  o.zero_one.local_step_scaler = c.local_step_scaler();
  o.zero_one.local_step_clipper = c.local_step_clipper();
  o.zero_one.steps = c.steps();
  o.lamb.max_coeff = c.max_coeff();
  o.lamb.min_coeff = c.min_coeff();
  o.lamb.coeff_beta = c.coeff_beta();
  o.lamb.factor_max = c.factor_max();
  o.lamb.factor_min = c.factor_min();
  o.lamb.factor_threshold = c.factor_threshold();
  if (absl::Status st = ValidateOptimizerOptions(o); !st.ok()) return st;
  return o;
}

absl::StatusOr<ShardMap> ShardMapForConfig(const control::TrainingConfig& c,
                                           const std::vector<uint64_t>& layer_ends) {
  auto kind = ParseOptimizerKind(c.optimizer());
  if (!kind.ok() || !IsLayerwise(*kind)) {
    return ShardMap::Create(c.dim(), c.servers(), c.block_size());
  }
  if (layer_ends.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--optimizer ", c.optimizer(),
        ": its trust ratios are per layer, and the model declares no layers (an external "
        "model's workers declare their tensors: WorkerOptions::layer_ends, which the PyTorch "
        "front fills in)"));
  }
  return ShardMap::CreateAligned(c.dim(), c.servers(), c.block_size(), layer_ends);
}

std::string FreezeText(const control::TrainingConfig& c) {
  const absl::StatusOr<OptimizerKind> kind = ParseOptimizerKind(c.optimizer());
  if (kind.ok() && !HasCompressionPhase(*kind)) return "none";
  if (kind.ok() && TraitsOf(*kind).schedule_freeze) {
    return absl::StrCat("var_freeze_step:", c.var_freeze_step());
  }
  return c.freeze().empty() ? absl::StrCat("step:", c.freeze_step()) : c.freeze();
}

absl::StatusOr<FreezeOptions> FreezeOptionsFromConfig(const control::TrainingConfig& c) {
  if (c.freeze_step() > 0 && !c.freeze().empty()) {
    return absl::InvalidArgumentError("--freeze: give either --freeze_step N or --freeze auto");
  }
  if (c.optimizer() == "zero-one-adam") {
    if (c.freeze_step() > 0 || !c.freeze().empty()) {
      return absl::InvalidArgumentError(
          "--freeze: zero-one-adam freezes v after --var_freeze_step; give that instead of "
          "--freeze_step or --freeze");
    }
    FreezeOptions f;
    f.step = c.var_freeze_step();  // the first step after it: counted from 0 here
    return f;
  }
  if (!c.freeze().empty()) {
    absl::StatusOr<FreezeOptions> f = ParseAutoFreeze(c.freeze());
    if (f.ok() && c.steps() > 0 && f->latest_fraction < 1) {
      f->latest =
          static_cast<uint64_t>(std::ceil(f->latest_fraction * static_cast<double>(c.steps())));
    }
    return f;
  }
  FreezeOptions f;
  f.step = c.freeze_step() > 0 ? c.freeze_step() : kNever;
  return f;
}

absl::Status ValidateConfig(const control::TrainingConfig& c) {
  if (c.workers() < 1 || c.workers() > 4096) return SettingError("workers", "must be in [1, 4096]");
  if (c.servers() < 1 || c.servers() > 1024) return SettingError("servers", "must be in [1, 1024]");
  if (absl::Status st = ValidateModelConfig(c); !st.ok()) return st;
  const bool external = c.model() == kExternalModel;
  // An external model's d is 0 until the workers have declared it.
  if ((!external || c.dim() > 0) && (c.dim() < 1 || c.dim() > kMaxParams)) {
    return SettingError("dim", "must be in [1, 2^34]");
  }
  if (c.steps() < 1 && !external) return SettingError("steps", "must be >= 1");
  if (c.block_size() < 32 || c.block_size() % 32 != 0 || c.block_size() > (1u << 24)) {
    return SettingError("block_size", "must be a multiple of 32 in [32, 2^24]");
  }
  auto options = OptimizerOptionsFromConfig(c);
  if (!options.ok()) return options.status();
  auto freeze = FreezeOptionsFromConfig(c);
  if (!freeze.ok()) return freeze.status();
  const AlgorithmTraits& traits = TraitsOf(options->kind);
  if (traits.needs_job_length && c.steps() < 1) {
    return SettingError(
        "steps", absl::StrCat(traits.name, " needs the job's length: its last step synchronises"));
  }
  if (c.chunk_elems() != 0 &&
      (c.chunk_elems() < c.block_size() || c.chunk_elems() % c.block_size() != 0 ||
       c.chunk_elems() > kMaxChunkElems)) {
    return SettingError("chunk_elems",
                        "must be 0 (auto) or a positive multiple of --block_size, at most 2^24");
  }
  if (c.step_timeout_ms() < 1) return SettingError("step_timeout", "must be >= 1ms");
  if (c.heartbeat_timeout_ms() < 100) return SettingError("heartbeat_timeout", "must be >= 100ms");
  if (c.checkpoint_every() > 0 && c.checkpoint_dir().empty()) {
    return SettingError("checkpoint_every", "needs --checkpoint_dir");
  }
  if (c.resume() && c.checkpoint_dir().empty())
    return SettingError("resume", "needs --checkpoint_dir");
  // Empty: a config made before the setting was (an old manifest's).
  if (!c.checkpoint_failure().empty() && c.checkpoint_failure() != "continue" &&
      c.checkpoint_failure() != "fail") {
    return SettingError("checkpoint_failure", "must be continue or fail");
  }
  return absl::OkStatus();
}

std::vector<std::string> ConfigDifferences(const control::TrainingConfig& here,
                                           const control::TrainingConfig& there,
                                           const std::set<std::string>& ignore) {
  std::vector<std::string> out;
  for (const JobSetting& s : JobSettings()) {
    if (ignore.count(s.name)) continue;
    const std::string a = JobSettingText(s, here), b = JobSettingText(s, there);
    if (a != b) {
      out.push_back(absl::StrCat("--", s.name, ": ", Shown(s, here), " (here) vs ", Shown(s, there),
                                 " (there)"));
    }
  }
  return out;
}

std::vector<std::string> ConfigFlagArgs(const control::TrainingConfig& config) {
  std::vector<std::string> out;
  for (const JobSetting& s : JobSettings()) {
    out.push_back(absl::StrCat("--", s.name, "=", JobSettingText(s, config)));
  }
  return out;
}

}  // namespace onebit
