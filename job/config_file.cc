#include "job/config_file.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/types/span.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "job/settings.h"
#include "optim/options.h"

namespace onebit {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// Top-level DeepSpeed keys that change nothing this job computes: batch
// sizes (the models have their own), logging, profiling, checkpointing,
// and features of the DeepSpeed engine that a parameter server has no use for.
constexpr absl::string_view kIgnoredDeepSpeedKeys[] = {
    "activation_checkpointing",
    "aio",
    "autotuning",
    "checkpoint",
    "communication_data_type",
    "comms_logger",
    "compression_training",
    "csv_monitor",
    "curriculum_learning",
    "data_efficiency",
    "data_types",
    "dataloader_drop_last",
    "dump_state",
    "eigenvalue",
    "elasticity",
    "flops_profiler",
    "gradient_predivide_factor",
    "memory_breakdown",
    "pipeline",
    "prescale_gradients",
    "progressive_layer_drop",
    "scheduler",
    "sparse_attention",
    "sparse_gradients",
    "steps_per_print",
    "tensorboard",
    "timers",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "wall_clock_breakdown",
    "wandb",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
};

// optimizer.params keys of DeepSpeed's OneBitAdam and Adam that concern
// only how DeepSpeed runs them.
constexpr absl::string_view kIgnoredParams[] = {"comm_backend_name", "cuda_aware", "set_grad_none",
                                                "torch_adam"};

bool In(absl::string_view key, absl::Span<const absl::string_view> list) {
  return std::find(list.begin(), list.end(), key) != list.end();
}

std::string Normalize(absl::string_view name) { return absl::StrReplaceAll(name, {{"-", "_"}}); }

// Keys in a fixed order (a protobuf map has none).
std::vector<std::string> SortedKeys(const Struct& s) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : s.fields()) keys.push_back(k);
  std::sort(keys.begin(), keys.end());
  return keys;
}

// The shortest text that reads back as exactly this double.
std::string NumberText(double d) {
  std::string t = absl::StrFormat("%.15g", d);
  if (std::strtod(t.c_str(), nullptr) != d) t = absl::StrFormat("%.17g", d);
  return t;
}

class Loader {
 public:
  Loader(std::string path, control::TrainingConfig* config, std::set<std::string>* given,
         std::vector<std::string>* ignored)
      : path_(std::move(path)), config_(config), given_(given), ignored_(ignored) {}

  absl::Status Load() {
    std::ifstream in(path_);
    if (!in) return absl::NotFoundError(absl::StrCat("--config: cannot read ", path_));
    std::stringstream ss;
    ss << in.rdbuf();
    return LoadText(ss.str());
  }

  // `path_` names where the text came from, for errors.
  absl::Status LoadText(const std::string& text) {
    Struct root;
    auto st = google::protobuf::util::JsonStringToMessage(text, &root);
    if (!st.ok()) {
      return SettingError("config", absl::StrCat(path_, " is not a JSON object: ", st.ToString()));
    }
    const auto& fields = root.fields();
    // DeepSpeed's keys first, so that settings of our own win over them.
    for (const std::string& key : SortedKeys(root)) {
      const Value& v = fields.at(key);
      const std::string name = Normalize(key);
      absl::Status s;
      if (name == "optimizer" && v.kind_case() == Value::kStructValue) {
        s = Optimizer(v.struct_value());
      } else if (name == "onebit") {
        if (v.kind_case() != Value::kStructValue) s = Bad(key, "must be an object of job settings");
      } else if (FindJobSetting(name) == nullptr) {
        s = DeepSpeedKey(key, v);
      }
      if (!s.ok()) return s;
    }
    for (const std::string& key : SortedKeys(root)) {
      const std::string name = Normalize(key);
      const Value& v = fields.at(key);
      const JobSetting* setting = FindJobSetting(name);
      if (setting == nullptr || (name == "optimizer" && v.kind_case() == Value::kStructValue)) {
        continue;
      }
      if (absl::Status s = Set(*setting, v, key); !s.ok()) return s;
    }
    if (auto it = fields.find("onebit"); it != fields.end()) {
      const Struct& section = it->second.struct_value();
      for (const std::string& key : SortedKeys(section)) {
        const JobSetting* setting = FindJobSetting(key);
        if (setting == nullptr) {
          return SettingError("config", absl::StrCat(path_, ": unknown key 'onebit.", key,
                                                     "' (not a job setting)"));
        }
        absl::Status s = Set(*setting, section.fields().at(key), "onebit." + key);
        if (!s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Bad(absl::string_view key, absl::string_view why) const {
    return SettingError("config", absl::StrCat(path_, ": ", key, ": ", why));
  }

  // Sets `setting` from the JSON value at `key` (a dotted path).
  absl::Status Set(const JobSetting& setting, const Value& v, const std::string& key) {
    std::string text;
    switch (v.kind_case()) {
      case Value::kNumberValue:
        text = NumberText(v.number_value());
        break;
      case Value::kStringValue:
        text = v.string_value();
        break;
      case Value::kBoolValue:
        text = v.bool_value() ? "true" : "false";
        break;
      case Value::kStructValue: {
        // {"name": value, ...}: a map setting (model_options), as its text.
        if (setting.type != SettingType::kStringMap) {
          return SettingError(setting.name,
                              absl::StrCat(path_, ": ", key, " must be a number, string or bool"));
        }
        std::vector<std::string> items;
        for (const std::string& k : SortedKeys(v.struct_value())) {
          const Value& item = v.struct_value().fields().at(k);
          std::string t;
          if (item.kind_case() == Value::kStringValue) {
            t = item.string_value();
          } else if (item.kind_case() == Value::kNumberValue) {
            t = NumberText(item.number_value());
          } else if (item.kind_case() == Value::kBoolValue) {
            t = item.bool_value() ? "true" : "false";
          } else {
            return SettingError(setting.name, absl::StrCat(path_, ": ", key, ".", k,
                                                           " must be a string, number or bool"));
          }
          if (t.find(',') != t.npos || k.find_first_of(",=") != k.npos) {
            return SettingError(setting.name,
                                absl::StrCat(path_, ": ", key, ".", k, ": no ',' or '=' allowed"));
          }
          items.push_back(absl::StrCat(k, "=", t));
        }
        text = absl::StrJoin(items, ",");
        break;
      }
      default:
        return SettingError(setting.name,
                            absl::StrCat(path_, ": ", key, " must be a number, string or bool"));
    }
    if (absl::Status st = SetJobSetting(setting, text, config_); !st.ok()) {
      return SettingError(setting.name, absl::StrCat("invalid value '", text, "' at ", path_, ": ",
                                                     key, ": ", st.message()));
    }
    given_->insert(setting.name);
    return absl::OkStatus();
  }

  absl::Status Set(const char* setting, const Value& v, const std::string& key) {
    return Set(*FindJobSetting(setting), v, key);
  }

  void Ignore(const std::string& key) { ignored_->push_back(key); }

  // A number at `key`, or an error naming it.
  absl::Status Number(const std::string& key, const Value& v, double* out) const {
    if (v.kind_case() != Value::kNumberValue) return Bad(key, "must be a number");
    *out = v.number_value();
    return absl::OkStatus();
  }

  absl::Status Bool(const std::string& key, const Value& v, bool* out) const {
    if (v.kind_case() != Value::kBoolValue) return Bad(key, "must be true or false");
    *out = v.bool_value();
    return absl::OkStatus();
  }

  // A top-level key that is not one of our settings.
  absl::Status DeepSpeedKey(const std::string& key, const Value& v) {
    if (key == "fp16" || key == "bf16" || key == "bfloat16" || key == "amp") {
      if (v.kind_case() != Value::kStructValue) return Bad(key, "must be an object");
      const auto& f = v.struct_value().fields();
      if (auto it = f.find("enabled"); it != f.end()) {
        bool on = false;
        if (absl::Status s = Bool(key + ".enabled", it->second, &on); !s.ok()) return s;
        if (on) {
          return Bad(key + ".enabled",
                     absl::StrCat("true: onebit-ps trains in fp32 (set it to false or leave ", key,
                                  " out)"));
        }
      }
    } else if (key == "zero_optimization") {
      double stage = 0;
      if (v.kind_case() == Value::kBoolValue) {
        stage = v.bool_value() ? 1 : 0;  // DeepSpeed's old spelling of stage 1
      } else if (v.kind_case() == Value::kStructValue) {
        const auto& f = v.struct_value().fields();
        if (auto it = f.find("stage"); it != f.end()) {
          if (absl::Status s = Number(key + ".stage", it->second, &stage); !s.ok()) return s;
        }
      } else {
        return Bad(key, "must be an object");
      }
      if (stage > 0) {
        return Bad(key + ".stage",
                   absl::StrCat(NumberText(stage),
                                ": 1-bit Adam does not support ZeRO (give stage 0 or leave "
                                "zero_optimization out)"));
      }
    } else if (key == "gradient_clipping") {
      double clip = 0;
      if (absl::Status s = Number(key, v, &clip); !s.ok()) return s;
      if (clip > 0) {
        return Bad(key, absl::StrCat(NumberText(clip),
                                     ": gradient clipping is not implemented (give 0 or leave it "
                                     "out)"));
      }
    } else if (key == "gradient_accumulation_steps") {
      double steps = 0;
      if (absl::Status s = Number(key, v, &steps); !s.ok()) return s;
      if (steps != 1) {
        return Bad(key, absl::StrCat(NumberText(steps),
                                     ": gradient accumulation is not supported, every step "
                                     "pushes its gradient (give 1)"));
      }
    } else if (!In(key, kIgnoredDeepSpeedKeys)) {
      return SettingError("config", absl::StrCat(path_, ": unknown key '", key,
                                                 "' (neither a job setting nor a DeepSpeed key)"));
    }
    Ignore(key);
    return absl::OkStatus();
  }

  // {"type": ..., "params": {...}}, DeepSpeed's optimizer section.
  absl::Status Optimizer(const Struct& section) {
    for (const std::string& key : SortedKeys(section)) {
      const Value& v = section.fields().at(key);
      const std::string where = "optimizer." + key;
      if (key == "type") {
        if (v.kind_case() != Value::kStringValue) return Bad(where, "must be a string");
        const std::string t = absl::AsciiStrToLower(v.string_value());
        Value ours;
        if (t == "onebitadam") {
          ours.set_string_value("onebit-adam");
        } else if (t == "zerooneadam") {
          ours.set_string_value("zero-one-adam");
        } else if (t == "onebitlamb") {
          ours.set_string_value("onebit-lamb");
        } else if (t == "diloco") {
          ours.set_string_value("diloco");  // not DeepSpeed's: onebit-ps's own
        } else if (t == "adam" || t == "adamw") {
          ours.set_string_value("adam");  // our weight decay is decoupled, as AdamW's
        } else {
          return Bad(
              where,
              absl::StrCat("unknown optimizer type '", v.string_value(),
                           "' (want OneBitAdam, ZeroOneAdam, OneBitLamb, DiLoCo, Adam or AdamW)"));
        }
        if (absl::Status s = Set("optimizer", ours, where); !s.ok()) return s;
      } else if (key == "params") {
        if (v.kind_case() != Value::kStructValue) return Bad(where, "must be an object");
        if (absl::Status s = Params(v.struct_value()); !s.ok()) return s;
      } else if (key == "legacy_fusion") {
        Ignore(where);  // how DeepSpeed fuses its kernels
      } else {
        return Bad(where, absl::StrCat("unknown key '", key, "' (want type, params)"));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Params(const Struct& params) {
    bool l2_decay = false;  // adam_w_mode false: Adam's L2 decay, not ours
    double decay = 0;
    for (const std::string& key : SortedKeys(params)) {
      const Value& v = params.fields().at(key);
      const std::string where = "optimizer.params." + key;
      absl::Status s;
      bool on = false;
      double x = 0;
      if (key == "lr" || key == "eps" || key == "freeze_step" || key == "bias_correction" ||
          key == "var_freeze_step" || key == "var_update_scaler" || key == "local_step_scaler" ||
          key == "local_step_clipper" || key == "max_coeff" || key == "min_coeff" ||
          key == "coeff_beta" || key == "factor_max" || key == "factor_min" ||
          key == "factor_threshold" || key == "sync_every" || key == "outer_lr" ||
          key == "outer_momentum" || key == "fragments" || key == "sync_delay" ||
          key == "sync_mix") {
        s = Set(key.c_str(), v, where);
      } else if (key == "weight_decay") {
        s = Set(key.c_str(), v, where);
        if (v.kind_case() == Value::kNumberValue) decay = v.number_value();
      } else if (key == "betas") {
        if (v.kind_case() != Value::kListValue || v.list_value().values_size() != 2) {
          return Bad(where, "want [beta1, beta2]");
        }
        const auto& list = v.list_value().values();
        s = Set("beta1", list[0], where + "[0]");
        if (s.ok()) s = Set("beta2", list[1], where + "[1]");
      } else if (In(key, kIgnoredParams)) {
        Ignore(where);
      } else if (key == "adam_w_mode") {
        s = Bool(where, v, &on);
        l2_decay = s.ok() && !on;
        if (on) Ignore(where);
      } else if (key == "amsgrad" || key == "eps_inside_sqrt") {
        s = Bool(where, v, &on);
        if (s.ok() && on) return Bad(where, "true is not implemented (give false)");
        if (s.ok()) Ignore(where);
      } else if (key == "max_grad_norm") {
        s = Number(where, v, &x);
        if (s.ok() && x > 0) return Bad(where, "gradient clipping is not implemented (give 0)");
        if (s.ok()) Ignore(where);
      } else {
        return Bad(where, absl::StrCat("unknown key '", key,
                                       "' (want lr, betas, eps, weight_decay, freeze_step, "
                                       "bias_correction, var_freeze_step, var_update_scaler, "
                                       "local_step_scaler, local_step_clipper, max_coeff, "
                                       "min_coeff, coeff_beta, factor_max, factor_min, "
                                       "factor_threshold, sync_every, outer_lr, "
                                       "outer_momentum, fragments, sync_delay, sync_mix)"));
      }
      if (!s.ok()) return s;
    }
    if (l2_decay) {
      if (decay != 0) {
        return Bad("optimizer.params.adam_w_mode",
                   "false (L2 weight decay) is not implemented: weight decay here is decoupled, "
                   "as AdamW's");
      }
      Ignore("optimizer.params.adam_w_mode");
    }
    return absl::OkStatus();
  }

  const std::string path_;
  control::TrainingConfig* const config_;
  std::set<std::string>* const given_;
  std::vector<std::string>* const ignored_;
};

}  // namespace

absl::Status LoadConfigFile(const std::string& path, control::TrainingConfig* config,
                            std::set<std::string>* given, std::vector<std::string>* ignored) {
  return Loader(path, config, given, ignored).Load();
}

absl::Status LoadConfigJson(const std::string& json, const std::string& where,
                            control::TrainingConfig* config, std::set<std::string>* given,
                            std::vector<std::string>* ignored) {
  return Loader(where, config, given, ignored).LoadText(json);
}

}  // namespace onebit
