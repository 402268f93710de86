#include "net/job_config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "compress/codec.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "shard/update_rule.h"

ABSL_FLAG(uint32_t, workers, 1, "number of workers N");
ABSL_FLAG(uint32_t, servers, 1, "number of servers S (one shard each)");
ABSL_FLAG(std::string, model, "synthetic", "model: synthetic");
ABSL_FLAG(uint64_t, dim, 1000, "parameters d (synthetic model)");
ABSL_FLAG(uint64_t, steps, 10, "training steps");
ABSL_FLAG(uint64_t, seed, 1, "seed of the model, its data and its noise");
ABSL_FLAG(std::string, optimizer, "sgd", "update rule on the servers: sgd | adam");
ABSL_FLAG(float, lr, 0.01f, "learning rate");
ABSL_FLAG(float, beta1, 0.9f, "Adam beta1");
ABSL_FLAG(float, beta2, 0.999f, "Adam beta2");
ABSL_FLAG(float, eps, 1e-8f, "Adam epsilon");
ABSL_FLAG(float, weight_decay, 0.0f, "decoupled weight decay (Adam)");
ABSL_FLAG(std::string, worker_codec, "fp32", "push codec: fp32 | fp16 | onebit");
ABSL_FLAG(std::string, server_codec, "fp32", "reply codec: fp32");
ABSL_FLAG(uint32_t, block_size, 2048, "codec block size B (multiple of 32)");
ABSL_FLAG(uint64_t, chunk_elems, 1 << 20,
          "elements per data-plane chunk (multiple of --block-size; 1M fp32 = 4 MB)");
ABSL_FLAG(absl::Duration, step_timeout, absl::Seconds(30),
          "how long a server waits for the missing pushes of a step, and a worker for "
          "its replies (worker waits twice this)");
ABSL_FLAG(absl::Duration, heartbeat_timeout, absl::Seconds(10),
          "a process silent this long is declared dead by the coordinator");
ABSL_FLAG(float, noise, 0.1f, "synthetic: gradient noise scale");
ABSL_FLAG(bool, skip_model, false,
          "synthetic: skip the model arithmetic (zero gradients; data-plane benchmark)");
ABSL_FLAG(std::string, config, "", "JSON file of config values, keys are flag names");

namespace onebit {
namespace {

const char* const kConfigFlags[] = {"workers",      "servers",      "model",
                                    "dim",          "steps",        "seed",
                                    "optimizer",    "lr",           "beta1",
                                    "beta2",        "eps",          "weight_decay",
                                    "worker_codec", "server_codec", "block_size",
                                    "chunk_elems",  "step_timeout", "heartbeat_timeout",
                                    "noise",        "skip_model"};

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
  for (const auto& [key, value] : root.fields()) {
    std::string name = key;
    for (char& c : name) c = c == '-' ? '_' : c;
    bool known = false;
    for (const char* f : kConfigFlags) known |= name == f;
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat("--config: unknown key '", key, "' in ", path));
    }
    if (specified.count(name)) continue;  // the command line wins
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
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": JSON value in ", path,
                                                       " must be a number, string or bool"));
    }
    std::string error;
    if (!absl::FindCommandLineFlag(name)->ParseFrom(text, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": invalid value '", text, "' in ", path, ": ", error));
    }
  }
  return absl::OkStatus();
}

}  // namespace

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
  c.set_worker_codec(absl::GetFlag(FLAGS_worker_codec));
  c.set_server_codec(absl::GetFlag(FLAGS_server_codec));
  c.set_block_size(absl::GetFlag(FLAGS_block_size));
  c.set_chunk_elems(absl::GetFlag(FLAGS_chunk_elems));
  c.set_step_timeout_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(absl::GetFlag(FLAGS_step_timeout))));
  c.set_heartbeat_timeout_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout))));
  c.set_noise(absl::GetFlag(FLAGS_noise));
  c.set_skip_model(absl::GetFlag(FLAGS_skip_model));
  absl::Status st = ValidateConfig(c);
  if (!st.ok()) return st;
  return c;
}

absl::Status ValidateConfig(const control::TrainingConfig& c) {
  auto bad = [](absl::string_view flag, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", why));
  };
  if (c.workers() < 1 || c.workers() > 4096) return bad("workers", "must be in [1, 4096]");
  if (c.servers() < 1 || c.servers() > 1024) return bad("servers", "must be in [1, 1024]");
  if (c.model() != "synthetic") return bad("model", "unknown model (want synthetic)");
  if (c.dim() < 1 || c.dim() > (uint64_t{1} << 34)) return bad("dim", "must be in [1, 2^34]");
  if (c.steps() < 1) return bad("steps", "must be >= 1");
  auto kind = ParseUpdateKind(c.optimizer());
  if (!kind.ok()) return bad("optimizer", kind.status().message());
  if (!std::isfinite(c.lr()) || c.lr() < 0) return bad("lr", "must be finite and >= 0");
  if (!(c.beta1() >= 0 && c.beta1() < 1)) return bad("beta1", "must lie in [0, 1)");
  if (!(c.beta2() >= 0 && c.beta2() < 1)) return bad("beta2", "must lie in [0, 1)");
  if (!(c.eps() > 0) || !std::isfinite(c.eps())) return bad("eps", "must be finite and > 0");
  if (!std::isfinite(c.weight_decay())) return bad("weight_decay", "must be finite");
  if (c.block_size() < 32 || c.block_size() % 32 != 0 || c.block_size() > (1u << 24)) {
    return bad("block_size", "must be a multiple of 32 in [32, 2^24]");
  }
  if (!ParseCodecKind(c.worker_codec()).ok()) {
    return bad("worker_codec", "unknown codec (want fp32, fp16 or onebit)");
  }
  if (c.server_codec() != "fp32") {
    return bad("server_codec", "sgd and adam reply the exact delta: only fp32");
  }
  if (c.chunk_elems() < c.block_size() || c.chunk_elems() % c.block_size() != 0) {
    return bad("chunk_elems", "must be a positive multiple of --block_size");
  }
  if (c.step_timeout_ms() < 1) return bad("step_timeout", "must be >= 1ms");
  if (c.heartbeat_timeout_ms() < 100) return bad("heartbeat_timeout", "must be >= 100ms");
  if (!std::isfinite(c.noise()) || c.noise() < 0) return bad("noise", "must be finite and >= 0");
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

}  // namespace onebit
