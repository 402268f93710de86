#include "job/config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "models/registry.h"
#include "net/data_plane.h"
#include "optim/optimizer.h"

namespace onebit {

namespace {

// The config's optimizer, as the optimizer library names it.
absl::StatusOr<OptimizerKind> KindOf(const control::TrainingConfig& c) {
  return ParseOptimizerKind(EnumText(c.optimizer().algorithm()));
}

template <typename E>
E EnumOf(absl::string_view text) {
  E value{};
  EnumFromText(text, &value);  // the optimizer library's names are the settings' texts
  return value;
}

}  // namespace

absl::Status ResolveConfig(const std::set<std::string>& given, control::TrainingConfig* config) {
  control::TrainingConfig& c = *config;
  if (const ModelEntry* m = FindModel(c.model().name()); m != nullptr) {
    if (absl::Status st = ResolveModelOptions(&c); !st.ok()) return st;
    // The shard map needs d before any worker has built the model.
    absl::StatusOr<uint64_t> d = m->num_params(c);
    if (!d.ok()) return d.status();
    c.mutable_model()->set_dim(*d);
    if (m->epoch_steps != nullptr) {
      absl::StatusOr<uint64_t> per_epoch = m->epoch_steps(c);
      if (!per_epoch.ok()) return per_epoch.status();
      if (c.model().epochs() > 0) c.mutable_model()->set_steps(c.model().epochs() * *per_epoch);
      if (c.model().eval_every() == 0) c.mutable_model()->set_eval_every(*per_epoch);
    }
  }
  if (c.model().name() == kExternalModel) {
    // The workers declare d when they register; their program decides when
    // the job ends unless --steps fixes it.
    c.mutable_model()->set_dim(0);
    if (!given.count("steps")) c.mutable_model()->set_steps(0);
  }
  // Fill in the optimizer's defaults, so every process sees one resolved config.
  auto kind = KindOf(c);
  if (kind.ok()) {
    const std::string optimizer = EnumText(c.optimizer().algorithm());
    for (const JobSetting& s : JobSettings()) {
      if (s.only_for != nullptr && given.count(s.name) && optimizer != s.only_for) {
        const std::string why = absl::StrCat("a ", s.only_for, " setting, but --optimizer is ",
                                             optimizer, ": it would change nothing");
        return SettingError(
            s.name, absl::StrCat(why, " (give --optimizer ", s.only_for, ", or leave it out)"));
      }
    }
    control::CompressionConfig& z = *c.mutable_compression();
    const auto codec = EnumOf<control::Codec>(DefaultCodec(*kind));
    if (z.worker_codec() == control::CODEC_UNSPECIFIED) z.set_worker_codec(codec);
    if (z.server_codec() == control::CODEC_UNSPECIFIED) z.set_server_codec(codec);
    if (!given.count("block_size")) z.set_block_size(DefaultBlockSize(*kind));
    if (!given.count("error_feedback")) {
      z.set_error_feedback(EnumOf<control::ErrorFeedback>(DefaultErrorFeedback(*kind)));
    }
    if (z.server_reply() == control::SERVER_REPLY_UNSPECIFIED) {
      z.set_server_reply(EnumOf<control::ServerReply>(ReplyModeName(DefaultReplyMode(*kind))));
    }
    // (zero-one-adam's freeze is --var_freeze_step.)
    if (HasWarmup(*kind) && HasCompressionPhase(*kind) && !TraitsOf(*kind).schedule_freeze &&
        c.optimizer().freeze_step() == 0 && c.optimizer().freeze().empty()) {
      c.mutable_optimizer()->set_freeze("auto");
    }
  }
  return absl::OkStatus();
}

namespace {}  // namespace

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
      return SettingError(
          s->name, absl::StrCat("the job sets ", JobSettingText(*s, c), " and the workers declare ",
                                JobSettingText(*s, mine), "; give it in one place"));
    }
    c = std::move(mine);
    now.insert(s->name);
  }
  // An external model's d is the workers' too.
  const uint64_t dim = config->model().dim();
  if (absl::Status st = ResolveConfig(now, &c); !st.ok()) return st;
  if (c.model().name() == kExternalModel) c.mutable_model()->set_dim(dim);
  if (absl::Status st = ValidateConfig(c); !st.ok()) return st;
  *config = std::move(c);
  *given = std::move(now);
  return absl::OkStatus();
}

absl::StatusOr<OptimizerOptions> OptimizerOptionsFromConfig(const control::TrainingConfig& c) {
  OptimizerOptions o;
  auto kind = KindOf(c);
  if (!kind.ok()) return SettingError("optimizer", kind.status().message());
  o.kind = *kind;
  o.lr = c.optimizer().lr();
  if (absl::Status st = ParseLrSchedule(c.optimizer().lr_schedule(), c.model().steps(), &o);
      !st.ok())
    return st;
  o.beta1 = c.optimizer().beta1();
  o.beta2 = c.optimizer().beta2();
  o.eps = c.optimizer().eps();
  o.weight_decay = c.optimizer().weight_decay();
  o.bias_correction = c.optimizer().bias_correction();
  o.v_floor = c.optimizer().v_floor();
  if (absl::Status st = ParseErrorFeedback(EnumText(c.compression().error_feedback()), &o);
      !st.ok())
    return st;
  auto reply = ParseReplyMode(EnumText(c.compression().server_reply()));
  if (!reply.ok()) return SettingError("server_reply", reply.status().message());
  o.reply = *reply;
  auto scale = ParseScaleRule(EnumText(c.compression().scale()));
  if (!scale.ok()) return SettingError("scale", scale.status().message());
  o.codec.scale = *scale;
  o.codec.block_size = c.compression().block_size();
  o.worker_codec = EnumText(c.compression().worker_codec());
  o.server_codec = EnumText(c.compression().server_codec());
  o.warmup_codec = EnumText(c.compression().warmup_codec());
  o.zero_one.var_freeze_step = c.optimizer().var_freeze_step();
  o.zero_one.var_update_scaler = c.optimizer().var_update_scaler();
  o.zero_one.local_step_scaler = c.optimizer().local_step_scaler();
  o.zero_one.local_step_clipper = c.optimizer().local_step_clipper();
  o.zero_one.steps = c.model().steps();
  o.lamb.max_coeff = c.optimizer().max_coeff();
  o.lamb.min_coeff = c.optimizer().min_coeff();
  o.lamb.coeff_beta = c.optimizer().coeff_beta();
  o.lamb.factor_max = c.optimizer().factor_max();
  o.lamb.factor_min = c.optimizer().factor_min();
  o.lamb.factor_threshold = c.optimizer().factor_threshold();
  o.diloco.sync_every = c.optimizer().sync_every();
  o.diloco.outer_lr = c.optimizer().outer_lr();
  o.diloco.outer_momentum = c.optimizer().outer_momentum();
  o.diloco.fragments = c.optimizer().fragments();
  o.diloco.sync_delay = c.optimizer().sync_delay();
  o.diloco.sync_mix = c.optimizer().sync_mix();
  o.diloco.steps = c.model().steps();
  // diloco's fragments are groups of shards: every process derives the
  // same map from the config (once d is known: an external model's
  // workers declare it).
  const uint32_t S = c.cluster().servers(), F = o.diloco.fragments;
  if (o.kind == OptimizerKind::kDiloco && F > S) {
    return SettingError("fragments", absl::StrCat(F,
                                                  ": fragments are groups of whole shards; "
                                                  "there are ",
                                                  S, " (--servers)"));
  }
  if (o.kind == OptimizerKind::kDiloco && F > 1 && c.model().dim() > 0) {
    absl::StatusOr<ShardMap> map = ShardMapForConfig(c, {});
    if (!map.ok()) return map.status();
    std::vector<uint64_t> held(F, 0);  // parameters per fragment
    uint32_t filled = 0;
    for (uint32_t k = 0; k < map->num_shards(); ++k) {
      o.shard_begins.push_back(map->shard(k).begin);
      filled += map->shard(k).size() > 0;
      held[static_cast<uint64_t>(k) * F / map->num_shards()] += map->shard(k).size();
    }
    // A fragment of empty shards would sync nothing: the model is too
    // small for the servers at this block size.
    for (uint32_t f = 0; f < F; ++f) {
      if (held[f] != 0) continue;
      return SettingError("fragments",
                          absl::StrCat(F, ": fragment ", f, " holds no parameters (d = ",
                                       c.model().dim(), " fills ", filled, " of ", S,
                                       " shards at --block_size ", c.compression().block_size(),
                                       "): give fewer fragments or a smaller --block_size"));
    }
  }
  if (absl::Status st = ValidateOptimizerOptions(o); !st.ok()) return st;
  return o;
}

absl::StatusOr<ShardMap> ShardMapForConfig(const control::TrainingConfig& c,
                                           const std::vector<uint64_t>& layer_ends) {
  auto kind = KindOf(c);
  if (!kind.ok() || !IsLayerwise(*kind)) {
    return ShardMap::Create(c.model().dim(), c.cluster().servers(), c.compression().block_size());
  }
  if (layer_ends.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--optimizer ", EnumText(c.optimizer().algorithm()),
        ": its trust ratios are per layer, and the model declares no layers (an external "
        "model's workers declare their tensors: WorkerOptions::layer_ends, which the PyTorch "
        "front fills in)"));
  }
  return ShardMap::CreateAligned(c.model().dim(), c.cluster().servers(),
                                 c.compression().block_size(), layer_ends);
}

std::string FreezeText(const control::TrainingConfig& c) {
  const absl::StatusOr<OptimizerKind> kind = KindOf(c);
  if (kind.ok() && !HasCompressionPhase(*kind)) return "none";
  if (kind.ok() && TraitsOf(*kind).schedule_freeze) {
    return absl::StrCat("var_freeze_step:", c.optimizer().var_freeze_step());
  }
  return c.optimizer().freeze().empty() ? absl::StrCat("step:", c.optimizer().freeze_step())
                                        : c.optimizer().freeze();
}

absl::StatusOr<FreezeOptions> FreezeOptionsFromConfig(const control::TrainingConfig& c) {
  if (c.optimizer().freeze_step() > 0 && !c.optimizer().freeze().empty()) {
    return absl::InvalidArgumentError("--freeze: give either --freeze_step N or --freeze auto");
  }
  const absl::StatusOr<OptimizerKind> kind = KindOf(c);
  if (kind.ok() && !HasWarmup(*kind) &&
      (c.optimizer().freeze_step() > 0 || !c.optimizer().freeze().empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        c.optimizer().freeze_step() > 0 ? "--freeze_step: " : "--freeze: ",
        OptimizerKindName(*kind), " has no warm-up to end: it compresses from step 0"));
  }
  if (c.optimizer().algorithm() == control::OPTIMIZER_ZERO_ONE_ADAM) {
    if (c.optimizer().freeze_step() > 0 || !c.optimizer().freeze().empty()) {
      return absl::InvalidArgumentError(
          "--freeze: zero-one-adam freezes v after --var_freeze_step; give that instead of "
          "--freeze_step or --freeze");
    }
    FreezeOptions f;
    f.step = c.optimizer().var_freeze_step();  // the first step after it: counted from 0 here
    return f;
  }
  if (!c.optimizer().freeze().empty()) {
    absl::StatusOr<FreezeOptions> f = ParseAutoFreeze(c.optimizer().freeze());
    if (f.ok() && c.model().steps() > 0 && f->latest_fraction < 1) {
      f->latest = static_cast<uint64_t>(
          std::ceil(f->latest_fraction * static_cast<double>(c.model().steps())));
    }
    return f;
  }
  FreezeOptions f;
  f.step = c.optimizer().freeze_step() > 0 ? c.optimizer().freeze_step() : kNever;
  return f;
}

absl::Status ValidateConfig(const control::TrainingConfig& c) {
  if (c.cluster().workers() < 1 || c.cluster().workers() > 4096)
    return SettingError("workers", "must be in [1, 4096]");
  if (c.cluster().servers() < 1 || c.cluster().servers() > 1024)
    return SettingError("servers", "must be in [1, 1024]");
  if (c.cluster().local_ranks() > 256) return SettingError("local_ranks", "must be in [1, 256]");
  if (absl::Status st = ValidateModelConfig(c); !st.ok()) return st;
  const bool external = c.model().name() == kExternalModel;
  // An external model's d is 0 until the workers have declared it.
  if ((!external || c.model().dim() > 0) && (c.model().dim() < 1 || c.model().dim() > kMaxParams)) {
    return SettingError("dim", "must be in [1, 2^34]");
  }
  if (c.model().steps() < 1 && !external) return SettingError("steps", "must be >= 1");
  if (c.compression().block_size() < 32 || c.compression().block_size() % 32 != 0 ||
      c.compression().block_size() > (1u << 24)) {
    return SettingError("block_size", "must be a multiple of 32 in [32, 2^24]");
  }
  auto options = OptimizerOptionsFromConfig(c);
  if (!options.ok()) return options.status();
  auto freeze = FreezeOptionsFromConfig(c);
  if (!freeze.ok()) return freeze.status();
  const AlgorithmTraits& traits = TraitsOf(options->kind);
  if (traits.needs_job_length && c.model().steps() < 1) {
    return SettingError(
        "steps", absl::StrCat(traits.name, " needs the job's length: its last step synchronises"));
  }
  if (c.compression().chunk_elems() != 0 &&
      (c.compression().chunk_elems() < c.compression().block_size() ||
       c.compression().chunk_elems() % c.compression().block_size() != 0 ||
       c.compression().chunk_elems() > kMaxChunkElems)) {
    return SettingError("chunk_elems",
                        "must be 0 (auto) or a positive multiple of --block_size, at most 2^24");
  }
  if (c.compression().compressed_chunk_elems() != 0 &&
      (c.compression().compressed_chunk_elems() % c.compression().block_size() != 0 ||
       c.compression().compressed_chunk_elems() > kMaxChunkElems)) {
    return SettingError("compressed_chunk_elems",
                        "must be 0 (auto) or a positive multiple of --block_size, at most 2^24");
  }
  if (c.compression().data_connections() > kMaxDataConnections) {
    return SettingError("data_connections", absl::StrCat("must be 1 to ", kMaxDataConnections));
  }
  if (c.timeouts().step_ms() < 1) return SettingError("step_timeout", "must be >= 1ms");
  if (c.timeouts().heartbeat_ms() < 100)
    return SettingError("heartbeat_timeout", "must be >= 100ms");
  if (c.checkpoint().every() > 0 && c.checkpoint().dir().empty()) {
    return SettingError("checkpoint_every", "needs --checkpoint_dir");
  }
  if (c.checkpoint().resume() && c.checkpoint().dir().empty())
    return SettingError("resume", "needs --checkpoint_dir");
  if (c.checkpoint().on_failure() == control::CHECKPOINT_FAILURE_UNSPECIFIED) {
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
      out.push_back(absl::StrCat("--", s.name, ": ", a, " (here) vs ", b, " (there)"));
    }
  }
  return out;
}

std::vector<std::string> ConfigFlagArgs(const control::TrainingConfig& config) {
  std::vector<std::string> out;
  const std::string optimizer = EnumText(config.optimizer().algorithm());
  for (const JobSetting& s : JobSettings()) {
    if (s.only_for != nullptr && optimizer != s.only_for) continue;
    out.push_back(absl::StrCat("--", s.name, "=", JobSettingText(s, config)));
  }
  return out;
}

}  // namespace onebit
