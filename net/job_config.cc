#include "net/job_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "compress/codec.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "net/flags.h"
#include "shard/optimizer.h"

ABSL_FLAG(uint32_t, workers, 1, "number of workers N");
ABSL_FLAG(uint32_t, servers, 1, "number of servers S (one shard each)");
ABSL_FLAG(std::string, model, "synthetic",
          "model: synthetic (a noisy quadratic) | mlp (Fashion-MNIST)");
ABSL_FLAG(uint64_t, dim, 1000, "parameters d (synthetic model)");
ABSL_FLAG(uint64_t, steps, 10, "training steps (see --epochs)");
ABSL_FLAG(uint32_t, epochs, 0,
          "mlp: train this many epochs (sets --steps: an epoch is 60000 / (N * batch) steps, or "
          "--max_train / (N * batch))");
ABSL_FLAG(std::string, layers, "784-256-128-10", "mlp: layer widths");
ABSL_FLAG(uint32_t, batch, 64, "mlp: local batch per worker");
ABSL_FLAG(std::string, data_dir, "/usr/share/datasets/fashion-mnist",
          "mlp: folder of the Fashion-MNIST IDX files (.gz)");
ABSL_FLAG(uint64_t, eval_every, 0,
          "mlp: evaluate the test set every this many steps (0: once an epoch) and at the end");
ABSL_FLAG(uint32_t, max_train, 0, "mlp: use only the first N training images (0: all)");
ABSL_FLAG(uint32_t, max_test, 0, "mlp: use only the first N test images (0: all)");
ABSL_FLAG(uint32_t, blas_threads, 1, "mlp: OpenBLAS threads per worker");
ABSL_FLAG(uint64_t, seed, 1, "seed of the model, its data and its noise");
ABSL_FLAG(std::string, optimizer, "sgd",
          "sgd | adam | onebit-adam | naive-onebit-adam | ef-sgd (DESIGN.md §1.4)");
ABSL_FLAG(float, lr, 0.01f, "learning rate");
ABSL_FLAG(float, beta1, 0.9f, "Adam beta1");
ABSL_FLAG(float, beta2, 0.999f, "Adam beta2");
ABSL_FLAG(float, eps, 1e-8f, "Adam epsilon");
ABSL_FLAG(float, weight_decay, 0.0f, "decoupled weight decay");
ABSL_FLAG(std::string, lr_schedule, "constant",
          "learning rate schedule: constant | warmup:N | cosine");
ABSL_FLAG(bool, bias_correction, false, "Adam bias correction (off, as DeepSpeed's OneBitAdam)");
ABSL_FLAG(uint64_t, freeze_step, 0,
          "first compression step (the warm-up is steps 0..N-1); 0: use --freeze");
ABSL_FLAG(std::string, freeze, "",
          "auto[:tau[:window]]: freeze once ||v_t - v_{t-K}||_1 / ||v_t||_1 < tau on every "
          "shard, checked every K steps (default auto:0.05:50 when --freeze_step is not given)");
ABSL_FLAG(float, v_floor, 1e-8f, "floor of the frozen variance: v = max(v, v_floor)");
ABSL_FLAG(std::string, worker_codec, "",
          "compression-phase push codec: fp32 | fp16 | onebit (default: onebit for the "
          "compressing optimizers, fp32 otherwise)");
ABSL_FLAG(std::string, server_codec, "",
          "compression-phase reply codec (default as --worker_codec)");
ABSL_FLAG(std::string, error_feedback, "both", "error feedback: both | worker | server | none");
ABSL_FLAG(std::string, server_reply, "",
          "compression-phase reply: momentum (replicas equal the master) | delta (C(Δ + e_s)); "
          "default momentum, delta for naive-onebit-adam");
ABSL_FLAG(std::string, scale, "l1", "onebit block scale: l1 (mean |y|) | l2 (||y||/sqrt(n))");
ABSL_FLAG(uint32_t, block_size, 2048, "codec block size B (multiple of 32)");
ABSL_FLAG(uint64_t, chunk_elems, 1 << 20,
          "elements per data-plane chunk (multiple of --block-size; 1M fp32 = 4 MB)");
ABSL_FLAG(absl::Duration, step_timeout, absl::Seconds(30),
          "how long a server waits for the missing pushes of a step, and a worker for "
          "its replies (worker waits twice this)");
ABSL_FLAG(absl::Duration, heartbeat_timeout, absl::Seconds(10),
          "a process silent this long is declared dead by the coordinator");
ABSL_FLAG(float, noise, 0.1f, "synthetic: gradient noise scale");
ABSL_FLAG(float, curvature_spread, 0.0f,
          "synthetic: spread the curvatures over 10^±spread (an ill-conditioned problem)");
ABSL_FLAG(bool, skip_model, false,
          "synthetic: skip the model arithmetic (zero gradients; data-plane benchmark)");
ABSL_FLAG(std::string, config, "", "JSON file of config values, keys are flag names");

namespace onebit {
namespace {

const char* const kConfigFlags[] = {"workers",      "servers",
                                    "model",        "dim",
                                    "steps",        "seed",
                                    "optimizer",    "lr",
                                    "lr_schedule",  "beta1",
                                    "beta2",        "eps",
                                    "weight_decay", "bias_correction",
                                    "freeze_step",  "freeze",
                                    "v_floor",      "worker_codec",
                                    "server_codec", "error_feedback",
                                    "server_reply", "scale",
                                    "block_size",   "chunk_elems",
                                    "step_timeout", "heartbeat_timeout",
                                    "noise",        "curvature_spread",
                                    "skip_model",   "epochs",
                                    "layers",       "batch",
                                    "data_dir",     "eval_every",
                                    "max_train",    "max_test",
                                    "blas_threads"};

bool IsConfigFlag(const std::string& name) {
  for (const char* f : kConfigFlags) {
    if (name == f) return true;
  }
  return false;
}

// Sets flag `name` from a JSON value, unless the command line gave it.
absl::Status SetFromJson(const std::string& name, const google::protobuf::Value& value,
                         const std::string& where, const std::set<std::string>& specified) {
  if (specified.count(name)) return absl::OkStatus();  // the command line wins
  std::string text;
  switch (value.kind_case()) {
    case google::protobuf::Value::kNumberValue:
      text = absl::StrFormat("%.17g", value.number_value());
      break;
    case google::protobuf::Value::kStringValue:
      text = value.string_value();
      break;
    case google::protobuf::Value::kBoolValue:
      text = value.bool_value() ? "true" : "false";
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": ", where, " must be a number, string or bool"));
  }
  std::string error;
  if (!absl::FindCommandLineFlag(name)->ParseFrom(text, &error)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": invalid value '", text, "' at ", where, ": ", error));
  }
  return absl::OkStatus();
}

// {"optimizer": {"type": ..., "params": {...}}}, as in a DeepSpeed config.
absl::Status LoadDeepSpeedOptimizer(const google::protobuf::Struct& section,
                                    const std::string& path,
                                    const std::set<std::string>& specified) {
  for (const auto& [key, value] : section.fields()) {
    const std::string where = absl::StrCat(path, ": optimizer.", key);
    if (key == "type") {
      const std::string& t = value.string_value();
      std::string ours;
      if (t == "OneBitAdam") ours = "onebit-adam";
      if (t == "Adam" || t == "AdamW") ours = "adam";
      if (ours.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--config: ", where, ": unknown optimizer type '", t, "' (want OneBitAdam, Adam)"));
      }
      google::protobuf::Value v;
      v.set_string_value(ours);
      if (absl::Status st = SetFromJson("optimizer", v, where, specified); !st.ok()) return st;
    } else if (key == "params") {
      for (const auto& [pk, pv] : value.struct_value().fields()) {
        const std::string pwhere = absl::StrCat(where, ".", pk);
        absl::Status st;
        if (pk == "betas") {
          const auto& list = pv.list_value().values();
          if (list.size() != 2) {
            return absl::InvalidArgumentError(
                absl::StrCat("--config: ", pwhere, ": want [beta1, beta2]"));
          }
          st = SetFromJson("beta1", list[0], pwhere, specified);
          if (st.ok()) st = SetFromJson("beta2", list[1], pwhere, specified);
        } else if (pk == "lr" || pk == "eps" || pk == "weight_decay" || pk == "freeze_step" ||
                   pk == "bias_correction") {
          st = SetFromJson(pk, pv, pwhere, specified);
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat("--config: unknown key '", pk, "' at ", pwhere,
                           " (want lr, betas, eps, weight_decay, freeze_step, bias_correction)"));
        }
        if (!st.ok()) return st;
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--config: unknown key '", key, "' at ", where, " (want type, params)"));
    }
  }
  return absl::OkStatus();
}

absl::Status LoadJson(const std::string& path, const std::set<std::string>& specified) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--config: cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  google::protobuf::Struct root;
  auto st = google::protobuf::util::JsonStringToMessage(ss.str(), &root);
  if (!st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--config: ", path, " is not a JSON object: ", st.ToString()));
  }
  // Keys are flag names (dashes or underscores); "optimizer" may instead be
  // a DeepSpeed optimizer section, and "onebit" holds flags of our own, so a
  // DeepSpeed config gains one section rather than being rewritten.
  for (const auto& [key, value] : root.fields()) {
    std::string name = key;
    for (char& c : name) c = c == '-' ? '_' : c;
    if (name == "optimizer" && value.kind_case() == google::protobuf::Value::kStructValue) {
      absl::Status st = LoadDeepSpeedOptimizer(value.struct_value(), path, specified);
      if (!st.ok()) return st;
      continue;
    }
    if (name == "onebit" && value.kind_case() == google::protobuf::Value::kStructValue) {
      for (const auto& [k2, v2] : value.struct_value().fields()) {
        std::string n2 = k2;
        for (char& c : n2) c = c == '-' ? '_' : c;
        if (!IsConfigFlag(n2)) {
          return absl::InvalidArgumentError(
              absl::StrCat("--config: unknown key '", k2, "' at ", path, ": onebit.", k2));
        }
        absl::Status st = SetFromJson(n2, v2, absl::StrCat(path, ": onebit.", k2), specified);
        if (!st.ok()) return st;
      }
      continue;
    }
    if (!IsConfigFlag(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--config: unknown key '", key, "' in ", path));
    }
    absl::Status st = SetFromJson(name, value, absl::StrCat(path, ": ", key), specified);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> MlpParamCount(absl::string_view layers) {
  std::vector<uint64_t> widths;
  for (absl::string_view part : absl::StrSplit(layers, '-')) {
    uint64_t w = 0;
    if (!absl::SimpleAtoi(part, &w) || w == 0 || w > (1u << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--layers: '", layers, "' is not a list of widths like 784-256-128-10"));
    }
    widths.push_back(w);
  }
  if (widths.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat("--layers: '", layers, "' needs 2+ widths"));
  }
  uint64_t d = 0;
  for (size_t l = 0; l + 1 < widths.size(); ++l) d += widths[l] * widths[l + 1] + widths[l + 1];
  return d;
}

absl::StatusOr<control::TrainingConfig> ConfigFromFlags(const std::set<std::string>& specified) {
  const std::string path = absl::GetFlag(FLAGS_config);
  if (!path.empty()) {
    absl::Status st = LoadJson(path, specified);
    if (!st.ok()) return st;
  }
  control::TrainingConfig c;
  c.set_workers(absl::GetFlag(FLAGS_workers));
  c.set_servers(absl::GetFlag(FLAGS_servers));
  c.set_model(absl::GetFlag(FLAGS_model));
  c.set_dim(absl::GetFlag(FLAGS_dim));
  c.set_steps(absl::GetFlag(FLAGS_steps));
  c.set_seed(absl::GetFlag(FLAGS_seed));
  c.set_optimizer(absl::GetFlag(FLAGS_optimizer));
  c.set_lr(absl::GetFlag(FLAGS_lr));
  c.set_beta1(absl::GetFlag(FLAGS_beta1));
  c.set_beta2(absl::GetFlag(FLAGS_beta2));
  c.set_eps(absl::GetFlag(FLAGS_eps));
  c.set_weight_decay(absl::GetFlag(FLAGS_weight_decay));
  c.set_lr_schedule(absl::GetFlag(FLAGS_lr_schedule));
  c.set_bias_correction(absl::GetFlag(FLAGS_bias_correction));
  c.set_freeze_step(absl::GetFlag(FLAGS_freeze_step));
  c.set_freeze(absl::GetFlag(FLAGS_freeze));
  c.set_v_floor(absl::GetFlag(FLAGS_v_floor));
  c.set_worker_codec(absl::GetFlag(FLAGS_worker_codec));
  c.set_server_codec(absl::GetFlag(FLAGS_server_codec));
  c.set_error_feedback(absl::GetFlag(FLAGS_error_feedback));
  c.set_server_reply(absl::GetFlag(FLAGS_server_reply));
  c.set_scale(absl::GetFlag(FLAGS_scale));
  c.set_block_size(absl::GetFlag(FLAGS_block_size));
  c.set_chunk_elems(absl::GetFlag(FLAGS_chunk_elems));
  c.set_step_timeout_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(absl::GetFlag(FLAGS_step_timeout))));
  c.set_heartbeat_timeout_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout))));
  c.set_noise(absl::GetFlag(FLAGS_noise));
  c.set_skip_model(absl::GetFlag(FLAGS_skip_model));
  c.set_curvature_spread(absl::GetFlag(FLAGS_curvature_spread));
  c.set_epochs(absl::GetFlag(FLAGS_epochs));
  c.set_layers(absl::GetFlag(FLAGS_layers));
  c.set_batch(absl::GetFlag(FLAGS_batch));
  c.set_data_dir(absl::GetFlag(FLAGS_data_dir));
  c.set_eval_every(absl::GetFlag(FLAGS_eval_every));
  c.set_max_train(absl::GetFlag(FLAGS_max_train));
  c.set_max_test(absl::GetFlag(FLAGS_max_test));
  c.set_blas_threads(absl::GetFlag(FLAGS_blas_threads));
  if (c.model() == "mlp") {
    // The shard map needs d before any worker has built the model.
    auto d = MlpParamCount(c.layers());
    if (!d.ok()) return d.status();
    c.set_dim(*d);
    const uint64_t train = c.max_train() > 0 ? std::min<uint64_t>(c.max_train(), kFashionMnistTrain)
                                             : kFashionMnistTrain;
    const uint64_t per_epoch = train / (uint64_t{c.workers()} * std::max<uint32_t>(c.batch(), 1));
    if (per_epoch == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--batch: ", c.workers(), " workers x batch ",
                                                     c.batch(), " exceed the ", train,
                                                     " training images"));
    }
    if (c.epochs() > 0) c.set_steps(c.epochs() * per_epoch);
    if (c.eval_every() == 0) c.set_eval_every(per_epoch);
  }
  // Fill in the optimizer's defaults, so every process sees one resolved config.
  auto kind = ParseOptimizerKind(c.optimizer());
  if (kind.ok()) {
    if (c.worker_codec().empty()) c.set_worker_codec(std::string(DefaultCodec(*kind)));
    if (c.server_codec().empty()) c.set_server_codec(std::string(DefaultCodec(*kind)));
    if (c.server_reply().empty()) {
      c.set_server_reply(std::string(ReplyModeName(DefaultReplyMode(*kind))));
    }
    if (HasWarmup(*kind) && HasCompressionPhase(*kind) && c.freeze_step() == 0 &&
        c.freeze().empty()) {
      c.set_freeze("auto");
    }
  }
  absl::Status st = ValidateConfig(c);
  if (!st.ok()) return st;
  return c;
}

absl::StatusOr<OptimizerOptions> OptimizerOptionsFromConfig(const control::TrainingConfig& c) {
  OptimizerOptions o;
  auto kind = ParseOptimizerKind(c.optimizer());
  if (!kind.ok())
    return absl::InvalidArgumentError(absl::StrCat("--optimizer: ", kind.status().message()));
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
  if (!reply.ok())
    return absl::InvalidArgumentError(absl::StrCat("--server_reply: ", reply.status().message()));
  o.reply = *reply;
  auto scale = ParseScaleRule(c.scale());
  if (!scale.ok())
    return absl::InvalidArgumentError(absl::StrCat("--scale: ", scale.status().message()));
  o.codec.scale = *scale;
  o.codec.block_size = c.block_size();
  o.worker_codec = c.worker_codec();
  o.server_codec = c.server_codec();
  if (absl::Status st = ValidateOptimizerOptions(o); !st.ok()) return st;
  return o;
}

absl::StatusOr<FreezeOptions> FreezeOptionsFromConfig(const control::TrainingConfig& c) {
  if (c.freeze_step() > 0 && !c.freeze().empty()) {
    return absl::InvalidArgumentError("--freeze: give either --freeze_step N or --freeze auto");
  }
  if (!c.freeze().empty()) return ParseAutoFreeze(c.freeze());
  FreezeOptions f;
  f.step = c.freeze_step() > 0 ? c.freeze_step() : kNever;
  return f;
}

absl::Status ValidateConfig(const control::TrainingConfig& c) {
  auto bad = [](absl::string_view flag, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", why));
  };
  if (c.workers() < 1 || c.workers() > 4096) return bad("workers", "must be in [1, 4096]");
  if (c.servers() < 1 || c.servers() > 1024) return bad("servers", "must be in [1, 1024]");
  if (c.model() != "synthetic" && c.model() != "mlp") {
    return bad("model", absl::StrCat("unknown model '", c.model(), "' (want synthetic or mlp)"));
  }
  if (c.model() == "mlp") {
    if (!MlpParamCount(c.layers()).ok()) return MlpParamCount(c.layers()).status();
    if (c.batch() < 1) return bad("batch", "must be >= 1");
    if (c.blas_threads() > 256) return bad("blas_threads", "must be in [0, 256]");
  }
  if (c.dim() < 1 || c.dim() > (uint64_t{1} << 34)) return bad("dim", "must be in [1, 2^34]");
  if (c.steps() < 1) return bad("steps", "must be >= 1");
  if (c.block_size() < 32 || c.block_size() % 32 != 0 || c.block_size() > (1u << 24)) {
    return bad("block_size", "must be a multiple of 32 in [32, 2^24]");
  }
  auto options = OptimizerOptionsFromConfig(c);
  if (!options.ok()) return options.status();
  auto freeze = FreezeOptionsFromConfig(c);
  if (!freeze.ok()) return freeze.status();
  if (c.chunk_elems() < c.block_size() || c.chunk_elems() % c.block_size() != 0) {
    return bad("chunk_elems", "must be a positive multiple of --block_size");
  }
  if (c.step_timeout_ms() < 1) return bad("step_timeout", "must be >= 1ms");
  if (c.heartbeat_timeout_ms() < 100) return bad("heartbeat_timeout", "must be >= 100ms");
  if (!std::isfinite(c.noise()) || c.noise() < 0) return bad("noise", "must be finite and >= 0");
  if (!(c.curvature_spread() >= 0 && c.curvature_spread() <= 6)) {
    return bad("curvature_spread", "must lie in [0, 6]");
  }
  return absl::OkStatus();
}

std::vector<std::string> ConfigFlagArgs() {
  std::vector<std::string> out;
  for (const char* name : kConfigFlags) {
    out.push_back(absl::StrCat("--", name, "=", absl::FindCommandLineFlag(name)->CurrentValue()));
  }
  return out;
}

std::string FlagOfError(const absl::Status& status) {
  absl::string_view m = status.message();
  if (m.size() > 2 && m.substr(0, 2) == "--") {
    size_t colon = m.find(':');
    if (colon != m.npos) return std::string(m.substr(2, colon - 2));
  }
  return "config";
}

control::TrainingConfig ConfigFromCommandLineOrExit(int argc, char** argv,
                                                    absl::string_view usage) {
  auto cfg = ConfigFromFlags(ParseFlagsOrExit(argc, argv, usage));
  if (!cfg.ok()) ExitError(2, std::string(cfg.status().message()));
  return *std::move(cfg);
}

}  // namespace onebit
