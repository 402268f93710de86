// The job settings: the table, the command line, --config files (ours and
// DeepSpeed's), and which binary takes which flags.
#include "job/config.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "job/settings.h"
#include "net/control.h"
#include "security/curve.h"
#include "security/job_secret.h"
#include "tests/cluster/test_util.h"
#include "util/memory.h"

namespace onebit::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

std::string WriteConfig(const std::string& name, const std::string& json) {
  const std::string path = TempDir("config-" + name) + "/" + name + ".json";
  std::ofstream(path) << json;
  return path;
}

// What ConfigFromFlags refuses: the error's message.
std::string ErrorOf(const std::vector<std::string>& args) {
  auto c = ConfigFromFlags(args);
  return c.ok() ? "<accepted>" : std::string(c.status().message());
}

std::string ConfigError(const std::string& json) {
  return ErrorOf({"--config=" + WriteConfig("bad", json)});
}

// A DeepSpeed config as DeepSpeed's users write it, with a 1-bit Adam
// optimizer and an "onebit" section of our own settings.
constexpr char kDeepSpeed[] = R"({
  "train_batch_size": 256,
  "train_micro_batch_size_per_gpu": 64,
  "gradient_accumulation_steps": 1,
  "steps_per_print": 100,
  "wall_clock_breakdown": false,
  "fp16": {"enabled": false, "loss_scale": 0, "initial_scale_power": 16},
  "bf16": {"enabled": false},
  "gradient_clipping": 0.0,
  "zero_optimization": {"stage": 0},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
  "optimizer": {
    "type": "OneBitAdam",
    "params": {"lr": 0.002, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.01,
               "freeze_step": 3, "cuda_aware": false, "comm_backend_name": "nccl"}
  },
  "onebit": {"workers": 2, "servers": 2, "dim": 4000, "steps": 6, "block_size": 32,
             "chunk_elems": 1024}
})";

TEST(DeepSpeedConfig, MapsTheOptimizerAndListsWhatItIgnores) {
  std::vector<std::string> ignored;
  auto c = ConfigFromFlags({"--config=" + WriteConfig("ds", kDeepSpeed)}, &ignored);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optimizer().algorithm(), control::OPTIMIZER_ONEBIT_ADAM);
  EXPECT_EQ(c->optimizer().lr(), 0.002f);
  EXPECT_EQ(c->optimizer().beta1(), 0.8f);
  EXPECT_EQ(c->optimizer().beta2(), 0.99f);
  EXPECT_EQ(c->optimizer().eps(), 1e-7f);
  EXPECT_EQ(c->optimizer().weight_decay(), 0.01f);
  EXPECT_EQ(c->optimizer().freeze_step(), 3u);
  EXPECT_EQ(c->optimizer().freeze(), "");  // a fixed freeze step: no automatic freeze
  EXPECT_FALSE(c->optimizer().bias_correction());
  EXPECT_EQ(c->cluster().workers(), 2u);
  EXPECT_EQ(c->model().dim(), 4000u);
  EXPECT_EQ(c->compression().worker_codec(), control::CODEC_ONEBIT);  // resolved for onebit-adam
  EXPECT_THAT(ignored, ElementsAre("bf16", "fp16", "gradient_accumulation_steps",
                                   "gradient_clipping", "optimizer.params.comm_backend_name",
                                   "optimizer.params.cuda_aware", "scheduler", "steps_per_print",
                                   "train_batch_size", "train_micro_batch_size_per_gpu",
                                   "wall_clock_breakdown", "zero_optimization"));
}

TEST(DeepSpeedConfig, AdamTypesAndBiasCorrectionMap) {
  for (const char* type : {"Adam", "AdamW", "adam"}) {
    const std::string json = absl::StrCat(R"({"optimizer": {"type": ")", type,
                                          R"(", "params": {"lr": 0.003, "bias_correction": true,
                                          "adam_w_mode": true}}})");
    auto c = ConfigFromFlags({"--config=" + WriteConfig("adam", json)});
    ASSERT_TRUE(c.ok()) << type << ": " << c.status();
    EXPECT_EQ(c->optimizer().algorithm(), control::OPTIMIZER_ADAM) << type;
    EXPECT_EQ(c->optimizer().lr(), 0.003f);
    EXPECT_TRUE(c->optimizer().bias_correction());
  }
}

// onebit-ps's own "DiLoCo" type, in a DeepSpeed-style section: its outer
// loop's params and the inner AdamW's.
TEST(DeepSpeedConfig, DilocoMapsItsParams) {
  const std::string json = R"({"optimizer": {"type": "DiLoCo", "params": {
      "lr": 0.002, "betas": [0.9, 0.95], "weight_decay": 0.1, "bias_correction": true,
      "sync_every": 64, "outer_lr": 0.5, "outer_momentum": 0.8, "fragments": 2,
      "sync_delay": 8, "sync_mix": 0.25}},
    "onebit": {"model": "synthetic", "steps": 256, "servers": 3, "dim": 30000}})";
  auto c = ConfigFromFlags({"--config=" + WriteConfig("diloco", json)});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optimizer().algorithm(), control::OPTIMIZER_DILOCO);
  auto options = OptimizerOptionsFromConfig(*c);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->kind, OptimizerKind::kDiloco);
  EXPECT_EQ(options->lr, 0.002f);
  EXPECT_EQ(options->beta2, 0.95f);
  EXPECT_TRUE(options->bias_correction);
  EXPECT_EQ(options->diloco.sync_every, 64u);
  EXPECT_EQ(options->diloco.outer_lr, 0.5f);
  EXPECT_EQ(options->diloco.outer_momentum, 0.8f);
  EXPECT_EQ(options->diloco.steps, 256u);
  EXPECT_EQ(options->diloco.fragments, 2u);
  EXPECT_EQ(options->diloco.sync_delay, 8u);
  EXPECT_EQ(options->diloco.sync_mix, 0.25f);
  // The fragments' shards: the job's shard map, 3 shards of d = 30000.
  ASSERT_EQ(options->shard_begins.size(), 3u);
  EXPECT_EQ(options->shard_begins[0], 0u);
  EXPECT_LT(options->shard_begins[1], options->shard_begins[2]);
  EXPECT_LT(options->shard_begins[2], 30000u);
  // Resolved for diloco: 1-bit both ways, no warm-up to freeze, no error
  // feedback.
  EXPECT_EQ(ErrorFeedbackName(*options), "none");
  EXPECT_EQ(c->compression().worker_codec(), control::CODEC_ONEBIT);
  EXPECT_EQ(c->compression().server_codec(), control::CODEC_ONEBIT);
  EXPECT_EQ(c->optimizer().freeze(), "");
  // A value out of range is refused naming its key's flag.
  const std::string bad = R"({"optimizer": {"type": "DiLoCo", "params": {"outer_momentum": 1.5}},
    "onebit": {"model": "synthetic", "steps": 10}})";
  auto refused = ConfigFromFlags({"--config=" + WriteConfig("diloco_bad", bad)});
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--outer_momentum"));
  // More fragments than shards (servers) is refused naming the flag.
  const std::string too_many = R"({"optimizer": {"type": "DiLoCo", "params": {"fragments": 3}},
    "onebit": {"model": "synthetic", "steps": 10, "servers": 2}})";
  refused = ConfigFromFlags({"--config=" + WriteConfig("diloco_fragments", too_many)});
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("--fragments: 3: fragments are groups of whole shards; there are 2"));
  // A sync that would still travel when the next fragment's is due.
  const std::string too_late =
      R"({"optimizer": {"type": "DiLoCo", "params": {"sync_every": 8, "fragments": 2,
      "sync_delay": 4}}, "onebit": {"model": "synthetic", "steps": 10, "servers": 2,
      "dim": 30000}})";
  refused = ConfigFromFlags({"--config=" + WriteConfig("diloco_delay", too_late)});
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("--sync_delay: 4: must be below H / F (8 / 2)"));
}

// An optimizer that compresses from step 0 has no warm-up for a freeze to
// end: the flag is refused naming it, not ignored.
TEST(Config, AFreezeForAnOptimizerWithoutAWarmupIsRefused) {
  for (const char* opt : {"diloco", "ef-sgd"}) {
    for (const char* freeze : {"--freeze_step=5", "--freeze=auto"}) {
      auto c = ConfigFromFlags({absl::StrCat("--optimizer=", opt), "--steps=10", freeze});
      ASSERT_FALSE(c.ok()) << opt << " " << freeze;
      EXPECT_THAT(
          std::string(c.status().message()),
          HasSubstr(absl::StrCat(std::string(freeze).substr(0, std::string(freeze).find('=')), ": ",
                                 opt, " has no warm-up to end")));
    }
  }
  EXPECT_TRUE(ConfigFromFlags({"--optimizer=diloco", "--steps=10"}).ok());
}

// A setting only one optimizer reads (diloco's, zero-one-adam's,
// onebit-lamb's), given for another, is refused naming the setting and both
// optimizers, not silently ignored: on the command line, in a DeepSpeed
// config and as a worker's declaration; for its own optimizer it is taken.
TEST(Config, AnotherOptimizersSettingIsRefusedNamingIt) {
  const struct {
    const char* flag;
    const char* owner;
  } cases[] = {{"--sync_every=8", "diloco"},
               {"--outer_lr=1", "diloco"},
               {"--outer_momentum=0.7", "diloco"},
               {"--fragments=2", "diloco"},
               {"--sync_delay=1", "diloco"},
               {"--sync_mix=0.2", "diloco"},
               {"--var_freeze_step=5", "zero-one-adam"},
               {"--local_step_clipper=4", "zero-one-adam"},
               {"--max_coeff=3", "onebit-lamb"},
               {"--factor_threshold=0.2", "onebit-lamb"}};
  for (const auto& k : cases) {
    const std::string name = std::string(k.flag).substr(0, std::string(k.flag).find('='));
    for (const char* opt : {"onebit-adam", "adam", "diloco", "zero-one-adam", "onebit-lamb"}) {
      auto c = ConfigFromFlags(
          {absl::StrCat("--optimizer=", opt), "--steps=64", "--servers=2", "--dim=100000", k.flag});
      if (std::string(opt) == k.owner) {
        EXPECT_TRUE(c.ok()) << opt << " " << k.flag << ": " << c.status();
        continue;
      }
      ASSERT_FALSE(c.ok()) << opt << " " << k.flag;
      EXPECT_THAT(std::string(c.status().message()),
                  HasSubstr(absl::StrCat(name, ": a ", k.owner, " setting, but --optimizer is ",
                                         opt, ": it would change nothing")));
    }
  }
  // The same key in a DeepSpeed section of another type.
  const std::string json = R"({"optimizer": {"type": "OneBitAdam", "params": {
      "lr": 0.001, "freeze_step": 10, "sync_every": 8}},
    "onebit": {"model": "synthetic", "steps": 64}})";
  auto c = ConfigFromFlags({"--config=" + WriteConfig("onebit-adam-sync-every", json)});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("sync_every"));
  // A worker's declaration (what a front's constructor sends) too.
  control::TrainingConfig job = DefaultJobConfig();
  ASSERT_TRUE(SetJobSetting(*FindJobSetting("optimizer"), "onebit-adam", &job).ok());
  std::set<std::string> given = {"optimizer"};
  ASSERT_TRUE(ResolveConfig(given, &job).ok());
  absl::Status st = ApplyDeclaredSettings({{"outer_lr", "1"}}, &given, &job);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("--outer_lr: a diloco setting, but --optimizer is onebit-adam"));
}

// DeepSpeed's OnebitLamb section as its tutorial gives it (bias_correction
// false: ours has none), on the mlp.
TEST(DeepSpeedConfig, OneBitLambMapsItsParams) {
  const std::string json = R"({"optimizer": {"type": "OneBitLamb", "params": {
      "lr": 0.011, "weight_decay": 0.01, "bias_correction": false, "max_coeff": 0.3,
      "min_coeff": 0.02, "freeze_step": 40, "cuda_aware": false, "comm_backend_name": "nccl",
      "coeff_beta": 0.8, "factor_max": 3.0, "factor_min": 0.6, "factor_threshold": 0.2}},
    "onebit": {"model": "mlp", "steps": 100}})";
  auto c = ConfigFromFlags({"--config=" + WriteConfig("lamb", json)});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optimizer().algorithm(), control::OPTIMIZER_ONEBIT_LAMB);
  EXPECT_EQ(c->optimizer().lr(), 0.011f);
  EXPECT_EQ(c->optimizer().freeze_step(), 40u);
  EXPECT_EQ(c->optimizer().max_coeff(), 0.3f);
  EXPECT_EQ(c->optimizer().min_coeff(), 0.02f);
  EXPECT_EQ(c->optimizer().coeff_beta(), 0.8f);
  EXPECT_EQ(c->optimizer().factor_max(), 3.0f);
  EXPECT_EQ(c->optimizer().factor_min(), 0.6f);
  EXPECT_EQ(c->optimizer().factor_threshold(), 0.2f);
  EXPECT_EQ(c->compression().server_reply(),
            control::SERVER_REPLY_MOMENTUM);  // resolved for onebit-lamb
  auto options = OptimizerOptionsFromConfig(*c);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->lamb.factor_threshold, 0.2f);
  // The mlp's tensors, W0 b0 W1 b1 W2 b2, and the shard map cut at them.
  auto ends = ModelLayerEnds(*c);
  ASSERT_TRUE(ends.ok()) << ends.status();
  EXPECT_EQ(*ends, (std::vector<uint64_t>{200704, 200960, 233728, 233856, 235136, 235146}));
  c->mutable_cluster()->set_servers(2);
  auto map = ShardMapForConfig(*c, *ends);
  ASSERT_TRUE(map.ok()) << map.status();
  EXPECT_EQ(map->shard(0).end, 200704u);
  auto none = ShardMapForConfig(*c, {});
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("the model declares no layers"));
}

TEST(DeepSpeedConfig, WhatContradictsTheJobIsRefusedNamingTheKey) {
  struct Case {
    std::string json;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_comm": true}})",
       {"zero_optimization.stage", "2", "does not support ZeRO"}},
      {R"({"zero_optimization": {"stage": 1}})", {"zero_optimization.stage", "1"}},
      {R"({"fp16": {"enabled": true, "loss_scale": 0}})", {"fp16.enabled", "fp32"}},
      {R"({"bf16": {"enabled": true}})", {"bf16.enabled", "fp32"}},
      {R"({"fp16": {"enabled": "auto"}})", {"fp16.enabled", "true or false"}},
      {R"({"gradient_clipping": 1.0})", {"gradient_clipping", "not implemented"}},
      {R"({"gradient_accumulation_steps": 4})", {"gradient_accumulation_steps", "4"}},
      {R"({"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}})",
       {"optimizer.type", "'Lamb'", "OneBitAdam"}},
      {R"({"optimizer": {"type": "OneBitAdam", "params": {"amsgrad": true}}})",
       {"optimizer.params.amsgrad"}},
      {R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false, "weight_decay": 0.1}}})",
       {"optimizer.params.adam_w_mode", "decoupled"}},
  };
  for (const Case& c : cases) {
    const std::string error = ConfigError(c.json);
    EXPECT_THAT(error, HasSubstr("--config: ")) << c.json;
    for (const std::string& e : c.expect) EXPECT_THAT(error, HasSubstr(e)) << c.json;
  }
}

TEST(DeepSpeedConfig, UnknownKeysAreRefusedNamingThem) {
  EXPECT_THAT(ConfigError(R"({"train_batch_size": 8, "learning_rate": 0.1})"),
              HasSubstr("unknown key 'learning_rate'"));
  EXPECT_THAT(ConfigError(R"({"optimizer": {"type": "OneBitAdam", "params": {"momentum": 0.9}}})"),
              HasSubstr("unknown key 'momentum'"));
  EXPECT_THAT(ConfigError(R"({"onebit": {"workers": 2, "colour": "red"}})"),
              HasSubstr("unknown key 'onebit.colour'"));
  EXPECT_THAT(ConfigError(R"({"optimizer": {"type": "Adam", "parameters": {}}})"),
              HasSubstr("unknown key 'parameters'"));
  // A value of the wrong kind names the setting and where it was.
  EXPECT_THAT(ConfigError(R"({"optimizer": {"type": "Adam", "params": {"lr": "auto"}}})"),
              HasSubstr("--lr: invalid value 'auto'"));
  // ...as data too, for whoever reports it; an unknown key is the file's.
  auto bad = ConfigFromFlags(
      {"--config=" +
       WriteConfig("bad", R"({"optimizer": {"type": "Adam", "params": {"lr": "auto"}}})")});
  EXPECT_EQ(SettingOfError(bad.status()), "lr");
  bad = ConfigFromFlags({"--config=" + WriteConfig("bad", R"({"onebit": {"colour": "red"}})")});
  EXPECT_EQ(SettingOfError(bad.status()), "config");
  bad = ConfigFromFlags({"--dim=-5"});
  EXPECT_EQ(SettingOfError(bad.status()), "dim");
}

TEST(ConfigFile, TheCommandLineWinsOverTheFileAndOursOverDeepSpeed) {
  const std::string path = WriteConfig("wins", R"({
    "steps": 7, "seed": 5, "step-timeout": "2s",
    "optimizer": {"type": "Adam", "params": {"lr": 0.1, "eps": 1e-6, "betas": [0.5, 0.6]}},
    "onebit": {"beta1": 0.7}
  })");
  auto c = ConfigFromFlags({"--lr", "0.25", "--config=" + path, "--steps=9"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optimizer().lr(), 0.25f);    // command line over the DeepSpeed section
  EXPECT_EQ(c->model().steps(), 9u);        // command line over a key of ours
  EXPECT_EQ(c->model().seed(), 5u);         // the file's
  EXPECT_EQ(c->optimizer().eps(), 1e-6f);   // the DeepSpeed section's
  EXPECT_EQ(c->optimizer().beta1(), 0.7f);  // "onebit" over the DeepSpeed section
  EXPECT_EQ(c->optimizer().beta2(), 0.6f);  // the DeepSpeed section's
  EXPECT_EQ(c->timeouts().step_ms(), 2000u);
  EXPECT_EQ(c->optimizer().algorithm(), control::OPTIMIZER_ADAM);
}

// Every field of every group of TrainingConfig is one row's, and every row
// names a field that exists (a setting that reads back what it set).
TEST(JobSettings, TheTableCoversEveryTrainingConfigField) {
  std::map<std::string, const JobSetting*> by_field;
  for (const JobSetting& s : JobSettings()) {
    EXPECT_TRUE(by_field.emplace(s.field, &s).second) << s.field << " has two rows";
  }
  const google::protobuf::Descriptor* d = control::TrainingConfig::descriptor();
  size_t leaves = 0;
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::Descriptor* group = d->field(i)->message_type();
    ASSERT_NE(group, nullptr) << "TrainingConfig." << d->field(i)->name() << " is no group";
    for (int k = 0; k < group->field_count(); ++k) {
      const std::string path = absl::StrCat(d->field(i)->name(), ".", group->field(k)->name());
      EXPECT_TRUE(by_field.count(path))
          << "TrainingConfig." << path << " has no row in job/settings.cc";
      ++leaves;
    }
  }
  EXPECT_EQ(JobSettings().size(), leaves);
  for (const JobSetting& s : JobSettings()) {
    control::TrainingConfig c;
    ASSERT_TRUE(SetJobSetting(s, s.default_value, &c).ok()) << s.name;
    EXPECT_EQ(JobSettingText(s, c), JobSettingText(s, DefaultJobConfig())) << s.name;
  }
}

// An enum setting takes its values' names in lower case with dashes, and
// a wrong one is refused listing the values.
TEST(JobSettings, EnumSettingsReadAndWriteTheirValuesNames) {
  control::TrainingConfig c;
  ASSERT_TRUE(SetJobSetting(*FindJobSetting("optimizer"), "naive-onebit-adam", &c).ok());
  EXPECT_EQ(c.optimizer().algorithm(), control::OPTIMIZER_NAIVE_ONEBIT_ADAM);
  EXPECT_EQ(JobSettingText(*FindJobSetting("optimizer"), c), "naive-onebit-adam");
  ASSERT_TRUE(SetJobSetting(*FindJobSetting("server_reply"), "Delta", &c).ok());
  EXPECT_EQ(c.compression().server_reply(), control::SERVER_REPLY_DELTA);
  EXPECT_EQ(EnumText(control::ERROR_FEEDBACK_NONE), "none");
  EXPECT_EQ(EnumText(control::CODEC_UNSPECIFIED), "");
  const absl::Status bad = SetJobSetting(*FindJobSetting("worker_codec"), "int8", &c);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("want one of fp32 | fp16 | onebit"));
  auto e = ConfigFromFlags({"--optimizer=lamb"});
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("--optimizer"));
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("onebit-lamb"));
}

TEST(JobSettings, DefaultsParseAndAreTheDocumentedOnes) {
  for (const JobSetting& s : JobSettings()) {
    control::TrainingConfig c;
    EXPECT_TRUE(SetJobSetting(s, s.default_value, &c).ok()) << s.name << ": " << s.default_value;
  }
  const control::TrainingConfig c = DefaultJobConfig();
  EXPECT_EQ(c.cluster().workers(), 1u);
  EXPECT_EQ(c.model().name(), "synthetic");
  EXPECT_EQ(c.optimizer().lr(), 0.01f);
  EXPECT_EQ(c.optimizer().eps(), 1e-8f);
  EXPECT_EQ(c.compression().block_size(), 2048u);
  EXPECT_EQ(c.compression().chunk_elems(), uint64_t{0});
  EXPECT_EQ(c.timeouts().step_ms(), 30000u);
  EXPECT_EQ(c.timeouts().heartbeat_ms(), 10000u);
  EXPECT_EQ(c.model().layers(), "784-256-128-10");
  EXPECT_EQ(c.compression().error_feedback(), control::ERROR_FEEDBACK_BOTH);
}

TEST(JobSettings, ConfigFlagArgsRoundTrip) {
  const std::vector<std::vector<std::string>> jobs = {
      {},
      {"--optimizer=onebit-adam", "--workers=3", "--lr=0.1", "--beta2=0.97", "--v_floor=3e-9",
       "--step_timeout=1500ms", "--bias_correction", "--noise=0.3333333",
       "--seed=18446744073709551615"},
      {"--optimizer=adam", "--model=mlp", "--layers=784-16-10", "--epochs=2", "--batch=32",
       "--max_train=1024", "--skip_model"},
      {"--model=external", "--optimizer=ef-sgd", "--block_size=64", "--chunk_elems=640"},
      {"--optimizer=naive-onebit-adam", "--freeze=auto:0.1:5", "--lr_schedule=warmup:10"},
      {"--optimizer=diloco", "--steps=64", "--sync_every=8", "--outer_lr=1", "--outer_momentum=0.7",
       "--sync_delay=2", "--sync_mix=0.25"},
  };
  for (const std::vector<std::string>& args : jobs) {
    auto c = ConfigFromFlags(args);
    ASSERT_TRUE(c.ok()) << absl::StrJoin(args, " ") << ": " << c.status();
    const std::vector<std::string> forwarded = ConfigFlagArgs(*c);
    size_t others = 0;  // the settings only another optimizer reads
    for (const JobSetting& s : JobSettings()) {
      others += s.only_for != nullptr && EnumText(c->optimizer().algorithm()) != s.only_for;
    }
    EXPECT_GT(others, 0u);
    EXPECT_EQ(forwarded.size(), JobSettings().size() - others);
    auto back = ConfigFromFlags(forwarded);
    ASSERT_TRUE(back.ok()) << absl::StrJoin(forwarded, " ") << ": " << back.status();
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*c, *back))
        << absl::StrJoin(args, " ") << "\nwant " << c->ShortDebugString() << "\ngot  "
        << back->ShortDebugString();
  }
  auto c = ConfigFromFlags(jobs[1]);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->cluster().workers(), 3u);
  EXPECT_EQ(c->timeouts().step_ms(), 1500u);
  EXPECT_TRUE(c->optimizer().bias_correction());
  EXPECT_EQ(c->model().seed(), UINT64_MAX);
  EXPECT_EQ(c->optimizer().freeze(), "auto");  // resolved: onebit-adam without a freeze step
  const std::vector<std::string> a = ConfigFlagArgs(*c);
  EXPECT_THAT(a, ::testing::Contains("--step_timeout=1.5s"));
  EXPECT_THAT(a, ::testing::Contains("--bias_correction=true"));
  // The fewest digits that read back to the same float (the round trip above
  // holds every value exact): 0.1f, not 0.100000001.
  EXPECT_THAT(a, ::testing::Contains("--lr=0.1"));
}

// What a worker's program declares (the PyTorch front's constructor) fills in
// what the job left at its default, and is re-resolved with it.
TEST(DeclaredSettings, ApplyWhereTheJobLeftTheDefault) {
  auto c = ConfigFromFlags({"--model=external", "--workers=2", "--servers=2"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->compression().worker_codec(), control::CODEC_FP32);  // sgd, the default optimizer
  c->mutable_model()->set_dim(804);                                 // as the workers declared it
  std::set<std::string> given = {"model", "workers", "servers"};
  ASSERT_TRUE(ApplyDeclaredSettings({{"optimizer", "onebit-adam"},
                                     {"lr", "0.001"},
                                     {"freeze-step", "50"},
                                     {"beta2", "0.99"},
                                     {"bias_correction", "true"}},
                                    &given, &*c)
                  .ok());
  EXPECT_EQ(c->optimizer().algorithm(), control::OPTIMIZER_ONEBIT_ADAM);
  EXPECT_EQ(c->optimizer().lr(), 0.001f);
  EXPECT_EQ(c->optimizer().beta2(), 0.99f);
  EXPECT_TRUE(c->optimizer().bias_correction());
  EXPECT_EQ(c->optimizer().freeze_step(), 50u);
  EXPECT_EQ(c->optimizer().freeze(), "");  // no auto freeze beside a fixed step
  EXPECT_EQ(c->compression().worker_codec(),
            control::CODEC_ONEBIT);  // what onebit-adam implies, derived again
  EXPECT_EQ(c->compression().server_codec(), control::CODEC_ONEBIT);
  EXPECT_EQ(c->model().dim(), 804u);
  EXPECT_EQ(c->cluster().workers(), 2u);
  EXPECT_TRUE(given.count("optimizer") && given.count("freeze_step") && given.count("beta2"));

  // Without a freeze step, onebit-adam's auto freeze follows as well.
  auto a = ConfigFromFlags({"--model=external"});
  ASSERT_TRUE(a.ok());
  std::set<std::string> g = {"model"};
  ASSERT_TRUE(ApplyDeclaredSettings({{"optimizer", "onebit-adam"}}, &g, &*a).ok());
  EXPECT_EQ(a->optimizer().freeze(), "auto");
}

TEST(DeclaredSettings, AContradictionOrAForeignSettingIsRefusedAndChangesNothing) {
  auto job = ConfigFromFlags({"--model=external", "--optimizer=adam", "--lr=0.01"});
  ASSERT_TRUE(job.ok());
  const std::set<std::string> job_given = {"model", "optimizer", "lr"};
  struct Case {
    std::map<std::string, std::string> declared;
    std::string error;
  };
  const std::vector<Case> cases = {
      {{{"optimizer", "onebit-adam"}},
       "--optimizer: the job sets adam and the workers declare onebit-adam; give it in one place"},
      {{{"lr", "0.001"}},
       "--lr: the job sets 0.01 and the workers declare 0.001; give it in one place"},
      {{{"workers", "3"}}, "--workers: a worker may declare only optimizer and compression"},
      {{{"steps", "3"}}, "--steps: a worker may declare only"},
      {{{"momentum_of_doom", "1"}}, "the workers declare 'momentum_of_doom', which is no job"},
      {{{"beta2", "high"}}, "--beta2: the workers declare 'high': "},
      {{{"block_size", "33"}}, "--block_size: "},
  };
  for (const Case& k : cases) {
    control::TrainingConfig c = *job;
    std::set<std::string> given = job_given;
    absl::Status st = ApplyDeclaredSettings(k.declared, &given, &c);
    EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr(k.error));
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(c, *job)) << k.error;
    EXPECT_EQ(given, job_given);
  }
  // The same value as the job's (the same float) is no contradiction.
  control::TrainingConfig c = *job;
  std::set<std::string> given = job_given;
  EXPECT_TRUE(
      ApplyDeclaredSettings({{"lr", "0.0100000000"}, {"optimizer", "adam"}}, &given, &c).ok());
  EXPECT_EQ(c.optimizer().lr(), 0.01f);
}

TEST(JobSettings, ConfigDifferencesNameEverySettingThatDiffers) {
  auto a = ConfigFromFlags({"--optimizer=onebit-adam", "--lr=0.01", "--steps=100"});
  auto b = ConfigFromFlags({"--optimizer=onebit-adam", "--lr=0.001", "--steps=200",
                            "--block_size=64", "--chunk_elems=64"});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_THAT(ConfigDifferences(*a, *a), ::testing::IsEmpty());
  EXPECT_THAT(ConfigDifferences(*a, *b),
              ::testing::ElementsAre("--steps: 100 (here) vs 200 (there)",
                                     "--lr: 0.01 (here) vs 0.001 (there)",
                                     "--block_size: 2048 (here) vs 64 (there)",
                                     "--chunk_elems: 0 (here) vs 64 (there)"));
  EXPECT_THAT(ConfigDifferences(*a, *b, {"steps", "chunk_elems"}),
              ::testing::ElementsAre("--lr: 0.01 (here) vs 0.001 (there)",
                                     "--block_size: 2048 (here) vs 64 (there)"));
}

// A model's own options: "k=v,..." on the command line or an object in
// --config, checked against what the model declares, defaults filled in.
TEST(JobSettings, ModelOptionsFromTheCommandLineAndTheFile) {
  auto c = ConfigFromFlags({"--model=softmax", "--workers=2", "--epochs=2", "--model_options",
                            "batch=16, max-train=640"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model().options().at("batch"), "16");
  EXPECT_EQ(c->model().options().at("max_train"), "640");
  EXPECT_EQ(c->model().options().at("max_test"), "0");  // the default, filled in
  EXPECT_EQ(c->model().dim(), 7850u);
  EXPECT_EQ(c->model().steps(), 40u);       // 2 epochs of 640 / (2 × 16)
  EXPECT_EQ(c->model().eval_every(), 20u);  // once an epoch
  EXPECT_THAT(ConfigFlagArgs(*c),
              ::testing::Contains("--model_options=batch=16,data_dir=/usr/share/datasets/"
                                  "fashion-mnist,max_test=0,max_train=640"));
  auto back = ConfigFromFlags(ConfigFlagArgs(*c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*c, *back));

  auto f = ConfigFromFlags({"--config=" + WriteConfig("options", R"({"model": "softmax",
      "workers": 2, "epochs": 2, "model_options": {"batch": 16, "max_train": "640"}})")});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*c, *f))
      << c->ShortDebugString() << "\n"
      << f->ShortDebugString();
  auto s = ConfigFromFlags({"--config=" + WriteConfig("options-text", R"({"model": "softmax",
      "onebit": {"model_options": "batch=16,max_train=640", "workers": 2, "epochs": 2}})")});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*c, *s));

  EXPECT_THAT(ErrorOf({"--model=softmax", "--model_options=batch"}),
              HasSubstr("--model_options: invalid value 'batch'"));
  EXPECT_THAT(ErrorOf({"--model=softmax", "--model_options=batch=1,batch=2"}),
              HasSubstr("--model_options: invalid value"));
  EXPECT_THAT(ErrorOf({"--model=softmax", "--model_options=colour=red"}),
              HasSubstr("--model_options: model softmax has no option 'colour'"));
  EXPECT_THAT(ErrorOf({"--model=mlp", "--model_options=batch=3"}),
              HasSubstr("--model_options: model mlp has no option 'batch'"));
  EXPECT_THAT(ErrorOf({"--model=softmax", "--model_options=batch=0"}),
              HasSubstr("--model_options: softmax: batch: "));
  EXPECT_THAT(ErrorOf({"--model=resnet"}),
              HasSubstr("--model: unknown model 'resnet' (want synthetic, mlp, softmax or "
                        "external)"));
  EXPECT_THAT(ConfigError(R"({"model": "softmax", "model_options": {"batch": [1]}})"),
              HasSubstr("model_options.batch must be a string, number or bool"));
  EXPECT_THAT(ConfigError(R"({"model": "softmax", "model_options": {"data_dir": "a,b"}})"),
              HasSubstr("no ',' or '=' allowed"));
}

TEST(JobSettings, CommandLineSpellings) {
  auto on = [](const std::vector<std::string>& args) {
    auto c = ConfigFromFlags(args);
    EXPECT_TRUE(c.ok()) << absl::StrJoin(args, " ") << ": " << c.status();
    return c.ok() && c->optimizer().bias_correction();
  };
  EXPECT_TRUE(on({"--bias_correction"}));
  EXPECT_TRUE(on({"--bias-correction=true"}));
  EXPECT_FALSE(on({"--bias_correction", "--nobias-correction"}));
  EXPECT_FALSE(on({"--bias_correction", "--bias_correction=false"}));
  auto c = ConfigFromFlags({"--weight-decay", "0.5", "-dim=77", "--lr_schedule", "cosine"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optimizer().weight_decay(), 0.5f);
  EXPECT_EQ(c->model().dim(), 77u);
  EXPECT_EQ(c->optimizer().lr_schedule(), "cosine");
  EXPECT_THAT(ErrorOf({"--dim=-5"}), HasSubstr("--dim: invalid value '-5'"));
  EXPECT_THAT(ErrorOf({"--step-timeout=soon"}), HasSubstr("--step_timeout: invalid value 'soon'"));
  EXPECT_THAT(ErrorOf({"--lr"}), HasSubstr("--lr: missing value"));
  EXPECT_THAT(ErrorOf({"--bogus=1"}), HasSubstr("--bogus: unknown flag"));
  EXPECT_THAT(ErrorOf({"--workers=0"}), HasSubstr("--workers: must be in [1, 4096]"));
  EXPECT_THAT(ErrorOf({"stray"}), HasSubstr("unexpected argument 'stray'"));
}

// A duration setting is a uint32 of milliseconds: a negative one, or one
// past 2^32 ms, is refused rather than wrapped (-5s would be 49.7 days, and
// a stopped worker would hold up the job that long); zero only where it
// means something (rejoin_timeout: fail at once).
TEST(JobSettings, DurationsOutOfRangeAreRefusedNamingTheSetting) {
  for (const std::string name : {"step_timeout", "heartbeat_timeout", "rejoin_timeout"}) {
    for (const std::string value : {"-5s", "-1ms", "1194h", "100000h", "inf", "-inf"}) {
      EXPECT_THAT(
          ErrorOf({"--" + name + "=" + value}),
          HasSubstr("--" + name + ": invalid value '" + value + "': out of range (0 to 49 days)"))
          << value;
      EXPECT_THAT(ConfigError(absl::StrCat(R"({")", name, R"(": ")", value, R"("})")),
                  HasSubstr("--" + name + ": invalid value '" + value + "'"))
          << value;
    }
    EXPECT_THAT(ConfigError(absl::StrCat(R"({")", name, R"(": -5})")), HasSubstr("--" + name))
        << "a number without a unit";
  }
  // 1193 hours still fit in 2^32 ms; rejoin_timeout 0 means "fail at once".
  auto ok = ConfigFromFlags({"--heartbeat_timeout=1193h", "--rejoin_timeout=0"});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->timeouts().heartbeat_ms(), 4294800000u);
  EXPECT_EQ(ok->timeouts().rejoin_ms(), 0u);
  EXPECT_THAT(ErrorOf({"--step_timeout=0"}), HasSubstr("--step_timeout: must be >= 1ms"));
  EXPECT_THAT(ErrorOf({"--heartbeat_timeout=0s"}),
              HasSubstr("--heartbeat_timeout: must be >= 100ms"));
}

// Every binary the build ships answers --help (and --helpfull, or -h where
// it has its own parser) with its usage and exit status 0 (the example's
// softmax_train: example_test).
TEST(Binaries, HelpExitsZeroOnEveryBinary) {
  const std::vector<std::pair<std::string, std::string>> bins = {
      {"onebit-coordinator", "onebit-coordinator --workers N"},
      {"onebit-server", "onebit-server --coordinator HOST:PORT"},
      {"onebit-worker", "onebit-worker --coordinator HOST:PORT"},
      {"onebit-launch", "onebit-launch --workers N"},
      {"onebit-reference", "onebit-reference --workers N"},
      {"onebit-bench-pushpull", "onebit-bench-pushpull [--params"},
      {"onebit-bench-codec", "usage: onebit-bench-codec [--elements N]"},
      {"onebit-bench-gpu-codec", "usage: onebit-bench-gpu-codec [--elements N]"},
  };
  for (const auto& [bin, usage] : bins) {
    const std::string path = Bin(bin);
    if (bin == "onebit-bench-gpu-codec" && access(path.c_str(), X_OK) != 0) continue;  // CUDA only
    // The codec benchmarks parse their own few flags; the rest are absl's.
    const bool own_parser = absl::StartsWith(bin, "onebit-bench-") && absl::EndsWith(bin, "codec");
    const std::vector<std::string> helps = {"--help", own_parser ? "-h" : "--helpfull"};
    for (const std::string& help : helps) {
      RunResult r = RunCommand({path, help}, absl::Seconds(10));
      EXPECT_EQ(r.code, 0) << bin << " " << help << ": " << r.output;
      EXPECT_THAT(r.output, HasSubstr(usage)) << bin << " " << help;
    }
  }
}

// Duration flags: a negative or endless one is a flag error (exit 2)
// naming the flag, as is a zero timeout, which could bound no wait.
TEST(Binaries, BadDurationsAndCountsAreFlagErrors) {
  const std::string c = "--coordinator=127.0.0.1:1";
  struct Case {
    std::vector<std::string> argv;
    std::string error;
  };
  const std::vector<Case> cases = {
      {{"onebit-coordinator", "--register_timeout=-5s"},
       "onebit-coordinator: --register_timeout: invalid value '-5s': must not be negative"},
      {{"onebit-coordinator", "--register_timeout=0"},
       "onebit-coordinator: --register_timeout: must be > 0"},
      {{"onebit-coordinator", "--heartbeat_timeout", "-5s"},
       "onebit-coordinator: --heartbeat_timeout: invalid value '-5s': out of range"},
      {{"onebit-coordinator", "--rejoin_timeout=1200h"},
       "onebit-coordinator: --rejoin_timeout: invalid value '1200h': out of range"},
      {{"onebit-server", c, "--register-timeout=-1ms"},
       "onebit-server: --register_timeout: invalid value '-1ms': must not be negative"},
      {{"onebit-server", c, "--register_timeout=0s"},
       "onebit-server: --register_timeout: must be > 0"},
      {{"onebit-server", c, "--register_timeout=inf"},
       "onebit-server: --register_timeout: invalid value 'inf': must be finite"},
      {{"onebit-worker", c, "--register_timeout=-5s"},
       "onebit-worker: --register_timeout: invalid value '-5s': must not be negative"},
      {{"onebit-worker", c, "--register_timeout=0"},
       "onebit-worker: --register_timeout: must be > 0"},
      {{"onebit-worker", c, "--progress_interval=-1s"},
       "onebit-worker: --progress_interval: invalid value '-1s': must not be negative"},
      {{"onebit-launch", "--grace=-1s"},
       "onebit-launch: --grace: invalid value '-1s': must not be negative"},
      {{"onebit-launch", "--launch_register_timeout=-5s"},
       "onebit-launch: --launch_register_timeout: invalid value '-5s': must not be negative"},
      {{"onebit-launch", "--launch_register_timeout=0"},
       "onebit-launch: --launch_register_timeout: must be > 0"},
      {{"onebit-launch", "--heartbeat_timeout=-5s"},
       "onebit-launch: --heartbeat_timeout: invalid value '-5s': out of range"},
      {{"onebit-launch", "--step_timeout=0"}, "onebit-launch: --step_timeout: must be >= 1ms"},
      {{"onebit-reference", "--step_timeout=-30s"},
       "onebit-reference: --step_timeout: invalid value '-30s': out of range"},
      // Not durations, but as wrong: an exit status wraps mod 256 (256 would
      // be success), and a negative rank or restart count means nothing.
      {{"onebit-coordinator", "--exit_code_when_stopped=256"},
       "onebit-coordinator: --exit_code_when_stopped: must be in [0, 255]"},
      {{"onebit-server", c, "--exit_code_when_stopped=-1"},
       "onebit-server: --exit_code_when_stopped: must be in [0, 255]"},
      {{"onebit-worker", c, "--exit_code_when_stopped=300"},
       "onebit-worker: --exit_code_when_stopped: must be in [0, 255]"},
      {{"onebit-server", c, "--shard=-2"}, "onebit-server: --shard: must be -1 (any) or a shard"},
      {{"onebit-worker", c, "--rank=-2"}, "onebit-worker: --rank: must be -1 (any) or a rank"},
      {{"onebit-launch", "--max_restarts=-1"}, "onebit-launch: --max_restarts: must be >= 0"},
      {{"onebit-launch", "--servers_per_worker_host=-1"},
       "onebit-launch: --servers_per_worker_host: must be >= 0"},
      {{"onebit-launch", "--workers=3", "--servers=4", "--servers_per_worker_host=2"},
       "onebit-launch: --servers_per_worker_host: 2 x 3 workers is 6 servers, but --servers is 4"},
      {{"onebit-launch", "--model=external", "--dim=10", "--worker_cmd=/bin/true",
        "--overlap=false"},
       "onebit-launch: --overlap: works with onebit-worker only"},
  };
  for (const Case& k : cases) {
    std::vector<std::string> argv = k.argv;
    argv[0] = Bin(argv[0]);
    RunResult r = RunCommand(argv, absl::Seconds(10));
    EXPECT_EQ(r.code, 2) << absl::StrJoin(k.argv, " ") << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(k.error)) << absl::StrJoin(k.argv, " ");
  }
}

// argv under an address-space limit (ulimit -v) of `gib` GiB, which the
// memory check counts (util/memory.h): the same refusal on any machine.
std::vector<std::string> WithAddressLimit(int gib, const std::vector<std::string>& argv) {
  std::vector<std::string> sh = {"/bin/sh", "-c",
                                 absl::StrCat("ulimit -v ", gib << 20, " && exec \"$0\" \"$@\"")};
  sh.insert(sh.end(), argv.begin(), argv.end());
  return sh;
}

bool UnderAddressSanitizer() {
#if defined(__SANITIZE_ADDRESS__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  return true;
#endif
#endif
  return false;
}

constexpr uint64_t kHugeDim = uint64_t{1} << 34;  // 64 GiB an fp32 array

// A job of d = kHugeDim, 1 server and 1 worker: the test registers as the
// process of role `stand_in` and `argv` (with --coordinator, under ulimit -v
// 16 GiB) is the other; it must exit 1 printing `error`, and the job fail
// with it.
void RunBesideAStandIn(control::Role stand_in, std::vector<std::string> argv,
                       const std::string& error) {
  const std::string dir = TempDir(stand_in == control::SERVER ? "huge-worker" : "huge-server");
  Subprocess coord = Start(
      {Bin("onebit-coordinator"), SecretFlag(), "--bind_host=127.0.0.1", "--port=0",
       "--port_file=" + dir + "/port", "--register_timeout=30s", absl::StrCat("--dim=", kHugeDim),
       "--workers=1", "--servers=1", "--optimizer=adam", "--steps=3", "--heartbeat_timeout=3s"},
      dir + "/coordinator.log");
  ASSERT_TRUE(WaitForText(dir + "/port", "\n", absl::Seconds(20)))
      << ReadFile(dir + "/coordinator.log");
  const std::string target =
      absl::StrCat("127.0.0.1:", absl::StripAsciiWhitespace(ReadFile(dir + "/port")));
  argv.push_back("--coordinator=" + target);
  argv.push_back(SecretFlag());
  Subprocess process = Start(WithAddressLimit(16, argv), dir + "/process.log");
  auto security = ResolveSecurity(SecretFile(), false, "secret");
  ASSERT_TRUE(security.ok()) << security.status();
  auto stub = control::Coordinator::NewStub(MakeChannel(target, *security));
  control::RegisterRequest req;
  req.set_role(stand_in);
  req.set_curve_public_key(NewCurveKeys().public_key);
  req.set_requested_rank(0);
  req.set_data_endpoint("tcp://127.0.0.1:1");  // never reached: the job ends first
  // Its reply: OK, or the job's failure when the other's refusal came first.
  RegisterWithCoordinator(stub.get(), target, req, absl::Seconds(20)).status().IgnoreError();
  EXPECT_EQ(process.Wait(absl::Seconds(30)), std::optional<int>(1))
      << ReadFile(dir + "/process.log");
  EXPECT_THAT(ReadFile(dir + "/process.log"), HasSubstr(error));
  EXPECT_EQ(coord.Wait(absl::Seconds(30)), std::optional<int>(1));
  EXPECT_THAT(ReadFile(dir + "/coordinator.log"), HasSubstr("needs at least"));
}

// A job whose state cannot fit in memory: the reference, the server (its
// shard) and the worker (its replica) each refuse before allocating it,
// naming the bytes it needs and the limit, instead of dying of bad_alloc or
// the OOM killer.
TEST(Binaries, AJobTooLargeForMemoryIsRefusedNamingTheBytes) {
  if (UnderAddressSanitizer())
    GTEST_SKIP() << "ASan needs more address space than ulimit -v leaves";
  // The limit the children see: 16 GiB of address space, or less memory.
  const MemoryLimit here = ProcessMemoryLimit();
  const std::string limit =
      here.bytes > 0 && here.bytes < (uint64_t{16} << 30)
          ? absl::StrCat(here.what, " is ", BytesText(here.bytes))
          : "this process's address-space limit (ulimit -v) is 17179869184 bytes (16 GiB)";
  // x0, 2 workers' x, g, mbar, e_w, den, and 2 half-shards' x,
  // accumulators, m or e_s, v, den: 16 arrays of d.
  RunResult ref =
      RunCommand(WithAddressLimit(16, {Bin("onebit-reference"), absl::StrCat("--dim=", kHugeDim),
                                       "--workers=2", "--servers=2", "--optimizer=onebit-adam",
                                       "--freeze_step=2", "--steps=3"}),
                 absl::Seconds(20));
  EXPECT_EQ(ref.code, 2) << ref.output;
  EXPECT_THAT(ref.output, HasSubstr("onebit-reference: the reference of this job (d = 17179869184, "
                                    "x0, 2 workers' x, g, mbar, e_w, den, 2 shards' x, the "
                                    "accumulators, m or e_s, v, den) needs at least "
                                    "1099511627776 bytes (1 TiB) of memory; " +
                                    limit));

  // The server and the worker, each in a job whose other process the test
  // plays (registered, then silent), so that each one's own refusal is what
  // ends the job. adam: the shard's x, accumulators, m, v; the replica's x, g.
  RunBesideAStandIn(control::WORKER,
                    {Bin("onebit-server"), "--bind_host=127.0.0.1", "--advertise_host=127.0.0.1"},
                    "onebit-server: server 0: shard 0 of 17179869184 parameters (x, the "
                    "accumulators, m, v) needs at least 274877906944 bytes (256 GiB) of memory; " +
                        limit);
  RunBesideAStandIn(control::SERVER,
                    {Bin("onebit-worker"), "--bind_host=127.0.0.1", "--device=cpu"},
                    "onebit-worker: a replica of d = 17179869184 (x, g) needs at least "
                    "137438953472 bytes (128 GiB) of memory; " +
                        limit);
}

// The binaries: each --help lists its own flags, and the ones that do not
// take the job settings name the ones that do.
TEST(Binaries, WorkerAndServerHelpListOnlyTheirOwnFlags) {
  for (const auto& [bin, own] : std::vector<std::pair<std::string, std::string>>{
           {"onebit-worker", "--rank"}, {"onebit-server", "--data_port"}}) {
    RunResult r = RunCommand({Bin(bin), "--help"}, absl::Seconds(10));
    EXPECT_EQ(r.code, 0) << bin << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("    --coordinator (")) << bin;
    EXPECT_THAT(r.output, HasSubstr("    " + own + " (")) << bin;
    EXPECT_THAT(r.output, Not(HasSubstr("--lr"))) << bin;
    EXPECT_THAT(r.output, Not(HasSubstr("--optimizer"))) << bin;
    EXPECT_THAT(r.output, Not(HasSubstr("--config"))) << bin;
    EXPECT_THAT(r.output, Not(HasSubstr("/work"))) << bin;
    EXPECT_THAT(r.output, Not(HasSubstr(".cc"))) << bin;
    EXPECT_THAT(r.output, Not(HasSubstr("--flagfile"))) << bin;  // absl's own
  }
}

// What a scheduler must not retry exits 78 (EX_CONFIG), apart from a failed
// job (1) and a refused command line or config (2): a finished run folder
// and --resume without a checkpoint (deploy/k8s's podFailurePolicy fails the
// Job on it); onebit-launch passes the code on.
TEST(Binaries, ARefusedRunFolderOrResumeExits78) {
  const std::string dir = TempDir("refused");
  ASSERT_TRUE(std::filesystem::create_directories(dir + "/run"));
  std::ofstream(dir + "/run/summary.json") << "{\"status\": \"ok\"}\n";
  const std::vector<std::string> coordinator = {Bin("onebit-coordinator"),
                                                "--insecure",
                                                "--port=0",
                                                "--workers=1",
                                                "--servers=1",
                                                "--dim=64"};
  auto with = [](std::vector<std::string> argv, std::vector<std::string> more) {
    argv.insert(argv.end(), more.begin(), more.end());
    return argv;
  };
  RunResult finished = RunCommand(with(coordinator, {"--out=" + dir + "/run"}), absl::Seconds(20));
  EXPECT_EQ(finished.code, 78) << finished.output;
  EXPECT_THAT(finished.output,
              HasSubstr(dir + "/run/summary.json is a finished job's (status ok)"));
  RunResult none = RunCommand(with(coordinator, {"--checkpoint_dir=" + dir + "/ck", "--resume"}),
                              absl::Seconds(20));
  EXPECT_EQ(none.code, 78) << none.output;
  EXPECT_THAT(none.output, HasSubstr("--resume: no complete checkpoint under " + dir + "/ck"));
  RunResult launched = RunCommand({Bin("onebit-launch"), "--workers=1", "--servers=1", "--dim=64",
                                   "--steps=1", "--out=" + dir + "/run"},
                                  absl::Seconds(30));
  EXPECT_EQ(launched.code, 78) << launched.output;
  // A refused flag stays 2.
  RunResult flag = RunCommand(with(coordinator, {"--bogus"}), absl::Seconds(10));
  EXPECT_EQ(flag.code, 2) << flag.output;
}

TEST(Binaries, AJobSettingGivenToWorkerOrServerNamesWhoTakesIt) {
  for (const std::string bin : {"onebit-worker", "onebit-server"}) {
    for (const std::vector<std::string>& flag :
         std::vector<std::vector<std::string>>{{"--lr", "0.1"},
                                               {"--bias-correction"},
                                               {"--nobias_correction"},
                                               {"--config=x.json"}}) {
      std::vector<std::string> argv = {Bin(bin), "--coordinator", "127.0.0.1:1"};
      argv.insert(argv.end(), flag.begin(), flag.end());
      RunResult r = RunCommand(argv, absl::Seconds(10));
      const std::string name = flag[0] == "--config=x.json" ? "--config"
                               : flag[0] == "--lr"          ? "--lr"
                                                            : "--bias_correction";
      EXPECT_EQ(r.code, 2) << absl::StrJoin(argv, " ") << ": " << r.output;
      EXPECT_THAT(r.output, HasSubstr(absl::StrCat(bin, ": ", name,
                                                   " is a job setting: give it to "
                                                   "onebit-coordinator or onebit-launch")))
          << absl::StrJoin(argv, " ");
    }
    RunResult u = RunCommand({Bin(bin), "--coordinator=127.0.0.1:1", "--bogus"}, absl::Seconds(10));
    EXPECT_EQ(u.code, 2) << u.output;
    EXPECT_THAT(u.output, HasSubstr("--bogus: unknown flag"));
  }
}

TEST(Binaries, LaunchCoordinatorAndReferenceHelpListTheJobSettings) {
  for (const auto& [bin, own] :
       std::vector<std::pair<std::string, std::string>>{{"onebit-launch", "--bin_dir"},
                                                        {"onebit-coordinator", "--port_file"},
                                                        {"onebit-reference", "--out"}}) {
    RunResult r = RunCommand({Bin(bin), "--helpfull"}, absl::Seconds(10));
    EXPECT_EQ(r.code, 0) << bin << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("    " + own + " (")) << bin;
    EXPECT_THAT(r.output, HasSubstr("    --lr (learning rate); default: 0.01;\n")) << bin;
    EXPECT_THAT(r.output, HasSubstr("    --step_timeout (")) << bin;
    EXPECT_THAT(r.output, HasSubstr("    --config (")) << bin;
    EXPECT_THAT(r.output, HasSubstr("\n  optimizer:\n")) << bin;
    EXPECT_THAT(r.output, Not(HasSubstr("/work"))) << bin;
    EXPECT_THAT(r.output, Not(HasSubstr(".cc"))) << bin;
  }
}

// The models of the registry, with their settings and options, in --help.
TEST(Binaries, LaunchAndCoordinatorHelpListTheModels) {
  for (const std::string bin : {"onebit-launch", "onebit-coordinator"}) {
    RunResult r = RunCommand({Bin(bin), "--help"}, absl::Seconds(10));
    EXPECT_EQ(r.code, 0) << bin << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("\nModels (--model NAME;")) << bin;
    EXPECT_THAT(r.output, HasSubstr("\n    synthetic: ")) << bin;
    EXPECT_THAT(r.output, HasSubstr("settings --dim --noise")) << bin;
    EXPECT_THAT(r.output, HasSubstr("\n    mlp: ")) << bin;
    EXPECT_THAT(r.output, HasSubstr("\n    softmax: ")) << bin;
    EXPECT_THAT(r.output, HasSubstr("\n      batch (local batch per worker); default: \"64\"\n"))
        << bin;
    EXPECT_THAT(r.output, HasSubstr("\n    external: ")) << bin;
    EXPECT_THAT(r.output, HasSubstr("    --model_options (")) << bin;
  }
}

// onebit-launch reads the DeepSpeed file, says once what it ignored (the
// coordinator gets the settings, not the file), and trains with it.
TEST(Binaries, LaunchTrainsFromADeepSpeedConfigAndListsTheIgnoredKeysOnce) {
  const std::string path = WriteConfig("launch-ds", kDeepSpeed);
  const std::string out = TempDir("launch-ds-run");
  RunResult r =
      RunCommand({Bin("onebit-launch"), "--config", path, "--out=" + out, "--heartbeat_timeout=3s"},
                 absl::Seconds(60));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string line = absl::StrCat(
      "onebit-launch: --config ", path,
      ": ignored DeepSpeed keys: bf16, fp16, gradient_accumulation_steps, gradient_clipping, "
      "optimizer.params.comm_backend_name, optimizer.params.cuda_aware, scheduler, "
      "steps_per_print, train_batch_size, train_micro_batch_size_per_gpu, wall_clock_breakdown, "
      "zero_optimization\n");
  EXPECT_THAT(r.output, HasSubstr(line));
  EXPECT_EQ(r.output.find("ignored DeepSpeed keys"), r.output.rfind("ignored DeepSpeed keys"))
      << r.output;
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "optimizer"), "\"onebit-adam\"");
  EXPECT_EQ(Field(summary, "freeze_step"), "3");
  EXPECT_EQ(Field(summary, "workers"), "2");
  EXPECT_EQ(Field(summary, "replicas_equal"), "true");

  RunResult z = RunCommand({Bin("onebit-launch"), "--config=" + WriteConfig("zero", R"({
      "train_batch_size": 8, "zero_optimization": {"stage": 2}})")},
                           absl::Seconds(10));
  EXPECT_EQ(z.code, 2) << z.output;
  EXPECT_THAT(z.output, HasSubstr("zero_optimization.stage"));
}

// K servers per worker host: S = K x N servers, each a shard of its own,
// and the job as bit-exact as with --servers given.
TEST(Binaries, LaunchRunsKServersPerWorker) {
  const std::string out = TempDir("launch-colocated");
  RunResult r = RunCommand(
      {Bin("onebit-launch"), "--workers=3", "--servers_per_worker_host=2", "--model=synthetic",
       "--dim=6007", "--steps=20", "--out=" + out, "--heartbeat_timeout=3s"},
      absl::Seconds(60));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("starting 6 servers and 3 workers"));
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "servers"), "6");
  EXPECT_EQ(Field(summary, "replicas_equal"), "true");
}

}  // namespace
}  // namespace onebit::testing
