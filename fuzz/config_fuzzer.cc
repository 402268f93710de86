// The --config JSON parser (job/config_file.h) and what a binary does with
// its result (job/config_flags.cc): LoadConfigJson over the defaults, then
// ResolveConfig and ValidateConfig. A config that passes must also survive
// forwarding (ConfigFlagArgs(): onebit-launch hands every setting the job
// gave to the other binaries as --name=value with its resolved value): the
// values read back, resolve and validate, and give the same config, so that
// every process of a job sees one config.
//
// Input: the JSON text.
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "fuzz/fuzz_target.h"
#include "job/config.h"
#include "job/config_file.h"
#include "job/settings.h"

namespace onebit {

std::vector<fuzz::Seed> Seeds() {
  std::vector<fuzz::Seed> seeds = {
      {"deepspeed-onebitadam", R"({
  "train_batch_size": 256, "train_micro_batch_size_per_gpu": 64,
  "gradient_accumulation_steps": 1, "steps_per_print": 100, "wall_clock_breakdown": false,
  "fp16": {"enabled": false, "loss_scale": 0}, "bf16": {"enabled": false},
  "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
  "optimizer": {"type": "OneBitAdam", "legacy_fusion": false,
                "params": {"lr": 0.002, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.01,
                           "freeze_step": 3, "cuda_aware": false, "comm_backend_name": "nccl",
                           "adam_w_mode": true, "amsgrad": false, "max_grad_norm": 0}},
  "onebit": {"workers": 2, "servers": 2, "dim": 4000, "steps": 6, "block_size": 32,
             "chunk_elems": 1024}
})"},
      {"deepspeed-adam", R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.003,
  "bias_correction": true, "adam_w_mode": false, "weight_decay": 0, "torch_adam": true}},
  "zero_optimization": false})"},
      {"deepspeed-zero2", R"({"zero_optimization": {"stage": 2, "overlap_comm": true}})"},
      {"deepspeed-fp16-on", R"({"fp16": {"enabled": true}, "amp": {"enabled": false}})"},
      {"deepspeed-clipping", R"({"gradient_clipping": 1.0, "gradient_accumulation_steps": 4})"},
      {"ours-deploy", R"({"workers": 2, "servers": 2, "model": "synthetic", "dim": 1000000,
  "steps": 100, "optimizer": "onebit-adam", "lr": 0.001, "step_timeout": "60s",
  "heartbeat_timeout": "30s", "freeze_step": 20, "checkpoint_dir": "/checkpoints",
  "checkpoint_every": 20, "rejoin_timeout": "10m"})"},
      {"ours-dashes", R"({"step-timeout": "2s", "lr-schedule": "warmup:10", "weight-decay": 0.1,
  "freeze": "auto:0.05:50", "worker-codec": "fp16", "server-codec": "fp32",
  "error-feedback": "worker", "server-reply": "delta", "scale": "l2", "v-floor": 1e-6})"},
      {"softmax-options", R"({"model": "softmax", "epochs": 2, "eval_every": 0,
  "model_options": {"batch": 32, "max_train": 600, "max_test": 100, "data_dir": "/tmp"}})"},
      {"mlp", R"({"model": "mlp", "layers": "784-64-10", "batch": 16, "epochs": 1,
  "max_train": 1000, "max_test": 100, "blas_threads": 1})"},
      {"external", R"({"model": "external", "optimizer": "adam", "bias_correction": true})"},
      {"options-text", R"({"model": "softmax", "model_options": "batch=8,max_train=64"})"},
      {"not-object", R"([1, 2, 3])"},
      {"nested-onebit", R"({"onebit": {"onebit": {}}})"},
  };
  // Every setting at its default, top-level (dashes) and in the section, so
  // that each key is in the corpus.
  std::vector<std::string> top, section;
  for (const JobSetting& s : JobSettings()) {
    const bool text = s.type == SettingType::kString || s.type == SettingType::kDuration ||
                      s.type == SettingType::kStringMap;
    const std::string v = text ? absl::StrCat("\"", s.default_value, "\"") : s.default_value;
    top.push_back(absl::StrCat("\"", absl::StrReplaceAll(s.name, {{"_", "-"}}), "\": ", v));
    section.push_back(absl::StrCat("\"", s.name, "\": ", v));
  }
  seeds.push_back({"every-setting", absl::StrCat("{", absl::StrJoin(top, ",\n"), "}")});
  seeds.push_back({"every-setting-section",
                   absl::StrCat("{\"onebit\": {", absl::StrJoin(section, ", "), "}}")});
  return seeds;
}

}  // namespace onebit

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  return onebit::fuzz::Initialize(argc, argv, onebit::Seeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace onebit;
  const std::string json(reinterpret_cast<const char*>(data), size);
  control::TrainingConfig config = DefaultJobConfig();
  std::set<std::string> given;
  std::vector<std::string> ignored;
  absl::Status st = LoadConfigJson(json, "fuzz.json", &config, &given, &ignored);
  if (st.ok()) st = ResolveConfig(given, &config);
  if (st.ok()) st = ValidateConfig(config);
  if (!st.ok()) {
    // Every refusal names the key or the setting.
    FUZZ_CHECK(absl::StartsWith(st.message(), "--"));
    return 0;
  }
  FUZZ_CHECK(ConfigDifferences(config, config).empty());
  // What another binary builds from the forwarded settings.
  control::TrainingConfig forwarded = DefaultJobConfig();
  for (const JobSetting& s : JobSettings()) {
    if (!given.count(s.name)) continue;
    FUZZ_CHECK(SetJobSetting(s, JobSettingText(s, config), &forwarded).ok());
  }
  FUZZ_CHECK(ResolveConfig(given, &forwarded).ok());
  FUZZ_CHECK(ValidateConfig(forwarded).ok());
  const std::vector<std::string> diff = ConfigDifferences(config, forwarded);
  if (!diff.empty()) {
    std::fprintf(stderr, "forwarded config differs: %s\n", absl::StrJoin(diff, "; ").c_str());
    FUZZ_CHECK(diff.empty());
  }
  return 0;
}
