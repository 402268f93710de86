// A job's settings and run folder (job/): validation that names the flag,
// summary.json and metrics.csv written and read back, the loss watch.
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "job/config.h"
#include "job/loss_watch.h"
#include "job/run_folder.h"
#include "job/settings.h"
#include "optim/options.h"
#include "optim/registry.h"
#include "tests/cluster/test_util.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

// The --optimizer setting's values (proto enum Optimizer) are the
// registry's optimizers, one to one, by name.
TEST(JobConfig, TheOptimizerSettingsValuesAreTheRegistrysOptimizers) {
  for (const AlgorithmRow* row : AlgorithmRows()) {
    control::Optimizer value{};
    EXPECT_TRUE(EnumFromText(row->traits.name, &value)) << row->traits.name;
    EXPECT_EQ(EnumText(value), row->traits.name);
  }
  const google::protobuf::EnumDescriptor* e = control::Optimizer_descriptor();
  EXPECT_EQ(static_cast<size_t>(e->value_count()), AlgorithmRows().size() + 1);  // + UNSPECIFIED
  for (int i = 0; i < e->value_count(); ++i) {
    if (e->value(i)->number() == 0) continue;
    EXPECT_TRUE(ParseOptimizerKind(EnumText(e->value(i))).ok()) << e->value(i)->name();
  }
}

TEST(JobConfig, ValidationNamesTheFlag) {
  control::TrainingConfig c = testing::MakeConfig(2, 2, 100, 3, "sgd");
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  c.mutable_compression()->set_chunk_elems(100);
  EXPECT_THAT(std::string(ValidateConfig(c).message()), HasSubstr("--chunk_elems:"));
  c = testing::MakeConfig(2, 2, 100, 3, "sgd");  // blocks of 32
  c.mutable_compression()->set_compressed_chunk_elems(100);
  EXPECT_THAT(std::string(ValidateConfig(c).message()),
              HasSubstr("--compressed_chunk_elems: must be 0 (auto) or a positive multiple of "
                        "--block_size, at most 2^24"));
  c.mutable_compression()->set_compressed_chunk_elems(uint64_t{1} << 25);
  EXPECT_THAT(std::string(ValidateConfig(c).message()), HasSubstr("--compressed_chunk_elems:"));
  c.mutable_compression()->set_compressed_chunk_elems(96);  // finer than the warm-up's 256: fine
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  c.mutable_compression()->set_data_connections(16);
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  c.mutable_compression()->set_data_connections(17);
  EXPECT_THAT(std::string(ValidateConfig(c).message()),
              HasSubstr("--data_connections: must be 1 to 16"));
  c = testing::MakeConfig(2, 2, 100, 3, "sgd");
  c.mutable_compression()->set_block_size(48);
  EXPECT_THAT(std::string(ValidateConfig(c).message()), HasSubstr("--block_size:"));
  c = testing::MakeConfig(2, 2, 100, 3, "sgd");
  testing::SetSetting(&c, "server_codec", "onebit");
  EXPECT_THAT(std::string(ValidateConfig(c).message()), HasSubstr("--server_codec:"));
  EXPECT_EQ(SettingOfError(ValidateConfig(c)), "server_codec");
  c = testing::MakeConfig(2, 2, 100, 3, "sgd");
  c.mutable_checkpoint()->set_every(5);
  EXPECT_THAT(std::string(ValidateConfig(c).message()),
              HasSubstr("--checkpoint_every: needs --checkpoint_dir"));
}

// The optimizer library's own defaults (OptimizerOptions, for programs that
// use optim/ directly) are the job settings' defaults: a job given nothing
// runs what the library runs by default.
TEST(JobConfig, TheOptimizerLibrarysDefaultsAreTheSettingsDefaults) {
  for (const char* optimizer :
       {"sgd", "adam", "onebit-adam", "zero-one-adam", "onebit-lamb", "diloco"}) {
    SCOPED_TRACE(optimizer);
    control::TrainingConfig c = DefaultJobConfig();
    ASSERT_TRUE(SetJobSetting(*FindJobSetting("optimizer"), optimizer, &c).ok());
    c.mutable_model()->set_steps(1000);
    ASSERT_TRUE(ResolveConfig({"optimizer", "steps"}, &c).ok());
    absl::StatusOr<OptimizerOptions> o = OptimizerOptionsFromConfig(c);
    ASSERT_TRUE(o.ok()) << o.status();
    const OptimizerOptions d;
    EXPECT_EQ(o->lr, d.lr);
    EXPECT_EQ(o->beta1, d.beta1);
    EXPECT_EQ(o->beta2, d.beta2);
    EXPECT_EQ(o->eps, d.eps);
    EXPECT_EQ(o->weight_decay, d.weight_decay);
    EXPECT_EQ(o->bias_correction, d.bias_correction);
    EXPECT_EQ(o->v_floor, d.v_floor);
    // The error feedback is the optimizer's own default: the library's
    // (both) except diloco's (none).
    if (std::string(optimizer) == "diloco") {
      EXPECT_FALSE(o->worker_error_feedback);
      EXPECT_FALSE(o->server_error_feedback);
    } else {
      EXPECT_EQ(o->worker_error_feedback, d.worker_error_feedback);
      EXPECT_EQ(o->server_error_feedback, d.server_error_feedback);
    }
    EXPECT_EQ(o->schedule, d.schedule);
    EXPECT_EQ(o->warmup_codec, d.warmup_codec);
    EXPECT_EQ(o->zero_one.var_freeze_step, d.zero_one.var_freeze_step);
    EXPECT_EQ(o->zero_one.var_update_scaler, d.zero_one.var_update_scaler);
    EXPECT_EQ(o->zero_one.local_step_scaler, d.zero_one.local_step_scaler);
    EXPECT_EQ(o->zero_one.local_step_clipper, d.zero_one.local_step_clipper);
    EXPECT_EQ(o->lamb.max_coeff, d.lamb.max_coeff);
    EXPECT_EQ(o->lamb.min_coeff, d.lamb.min_coeff);
    EXPECT_EQ(o->lamb.coeff_beta, d.lamb.coeff_beta);
    EXPECT_EQ(o->lamb.factor_max, d.lamb.factor_max);
    EXPECT_EQ(o->lamb.factor_min, d.lamb.factor_min);
    EXPECT_EQ(o->diloco.sync_every, d.diloco.sync_every);
    EXPECT_EQ(o->diloco.outer_lr, d.diloco.outer_lr);
    EXPECT_EQ(o->diloco.outer_momentum, d.diloco.outer_momentum);
    EXPECT_EQ(o->lamb.factor_threshold, d.lamb.factor_threshold);
  }
}

// diloco's default error feedback (none) gives way to one the job names.
TEST(JobConfig, DilocosErrorFeedbackIsNoneUnlessTheJobNamesOne) {
  for (const char* named : {"", "both", "worker", "server", "none"}) {
    SCOPED_TRACE(named);
    control::TrainingConfig c = DefaultJobConfig();
    std::set<std::string> given = {"optimizer", "steps"};
    ASSERT_TRUE(SetJobSetting(*FindJobSetting("optimizer"), "diloco", &c).ok());
    if (*named != 0) {
      ASSERT_TRUE(SetJobSetting(*FindJobSetting("error_feedback"), named, &c).ok());
      given.insert("error_feedback");
    }
    c.mutable_model()->set_steps(100);
    ASSERT_TRUE(ResolveConfig(given, &c).ok());
    absl::StatusOr<OptimizerOptions> o = OptimizerOptionsFromConfig(c);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(ErrorFeedbackName(*o), *named != 0 ? named : "none");
  }
}

// diloco's fragments are groups of the job's shards: each process finds
// their begins in the config, and a fragment of empty shards is refused.
TEST(JobConfig, DilocosFragmentsTakeTheShardMapAndRefuseAnEmptyOne) {
  control::TrainingConfig c = DefaultJobConfig();
  ASSERT_TRUE(SetJobSetting(*FindJobSetting("optimizer"), "diloco", &c).ok());
  ASSERT_TRUE(SetJobSetting(*FindJobSetting("fragments"), "2", &c).ok());
  c.mutable_model()->set_steps(100);
  c.mutable_cluster()->set_servers(3);
  c.mutable_compression()->set_block_size(256);
  c.mutable_model()->set_dim(3 * 256 * 4);  // 4 blocks per shard
  ASSERT_TRUE(
      ResolveConfig({"optimizer", "fragments", "steps", "servers", "block_size", "dim"}, &c).ok());
  absl::StatusOr<OptimizerOptions> o = OptimizerOptionsFromConfig(c);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->shard_begins, (std::vector<uint64_t>{0, 1024, 2048}));
  c.mutable_model()->set_dim(600);  // 3 blocks: one per shard; 2 shards at 2048
  c.mutable_compression()->set_block_size(2048);
  o = OptimizerOptionsFromConfig(c);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().message(),
            "--fragments: 2: fragment 1 holds no parameters (d = 600 fills 1 of 3 shards at "
            "--block_size 2048): give fewer fragments or a smaller --block_size");
  // More fragments than shards, and none, are refused naming the flag.
  c.mutable_optimizer()->set_fragments(4);
  EXPECT_EQ(OptimizerOptionsFromConfig(c).status().message(),
            "--fragments: 4: fragments are groups of whole shards; there are 3 (--servers)");
  c.mutable_optimizer()->set_fragments(0);
  EXPECT_EQ(OptimizerOptionsFromConfig(c).status().message(),
            "--fragments: 0: must be in [1, --sync_every (32)], so that each fragment syncs at "
            "an offset of its own");
}

// summary.json parses as JSON whatever the numbers (NaN, infinities, huge).
TEST(RunFolder, SummaryIsValidJsonWhateverTheNumbers) {
  const std::string dir = testing::TempDir("summary_json");
  run::Summary s;
  s.set_final_loss(std::numeric_limits<double>::infinity());
  s.set_test_loss(std::nan(""));
  s.set_wall_s(1.5);
  s.set_status("failed: \"quoted\"\n");
  ASSERT_TRUE(WriteSummaryJson(dir + "/summary.json", s).ok());
  const std::string text = testing::ReadFile(dir + "/summary.json");
  EXPECT_THAT(text, HasSubstr("\"final_loss\": null,"));
  EXPECT_THAT(text, HasSubstr("\"test_loss\": null,"));
  EXPECT_THAT(text, HasSubstr("\"wall_s\": 1.5,"));
  EXPECT_THAT(text, HasSubstr("\"status\": \"failed: \\\"quoted\\\"\\n\""));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("inf")));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("nan")));
  // Not finished (status not ok): a new job may use the folder.
  EXPECT_TRUE(CheckNotFinished(dir).ok());
  s.set_status("ok");
  ASSERT_TRUE(WriteSummaryJson(dir + "/summary.json", s).ok());
  absl::Status st = CheckNotFinished(dir);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr(dir + "/summary.json is a finished job's (status ok): not overwriting"));
  EXPECT_TRUE(CheckNotFinished(dir + "/nothing-here").ok());
}

// fp32 settings are written as the user typed them: the shortest text that
// reads back as the same float, not its exact binary value.
TEST(RunFolder, FloatSettingsAreWrittenAsGiven) {
  const std::string dir = testing::TempDir("summary_floats");
  run::Summary s;
  s.set_lr(2e-3f);  // exactly 0.0020000000949949026
  s.set_v_floor(1e-8f);
  ASSERT_TRUE(WriteSummaryJson(dir + "/summary.json", s).ok());
  std::string text = testing::ReadFile(dir + "/summary.json");
  EXPECT_EQ(testing::Field(text, "lr"), "0.002");
  EXPECT_EQ(testing::Field(text, "v_floor"), "1e-08");
  EXPECT_EQ(testing::Field(text, "diverged"), "false");
  s.set_lr(0.1234567f);  // 7 digits needed
  s.set_v_floor(0);
  s.set_diverged(true);
  ASSERT_TRUE(WriteSummaryJson(dir + "/summary.json", s).ok());
  text = testing::ReadFile(dir + "/summary.json");
  EXPECT_EQ(testing::Field(text, "lr"), "0.1234567");
  EXPECT_EQ(testing::Field(text, "v_floor"), "0");
  EXPECT_EQ(testing::Field(text, "diverged"), "true");
}

// Every field round-trips through the file; 64-bit counts are JSON numbers
// (protobuf's own printer would quote them); unset optional fields are null;
// the compression ratios are filled in from the byte counts.
TEST(RunFolder, SummaryReadsBackWhatWasWritten) {
  const std::string dir = testing::TempDir("summary_round_trip");
  run::Summary s;
  s.set_optimizer("onebit-adam");
  s.set_steps(20);
  s.set_params(uint64_t{5} << 40);  // beyond 32 bits
  s.set_bytes_up_fp32(1000);
  s.set_bytes_up_compress(10);  // 2 compression steps of 5 bytes; fp32 moves 50 a step
  s.set_compress_steps(2);
  s.set_freeze_step(18);
  s.add_worker_devices("cpu");
  s.add_worker_devices("cuda:0 (NVIDIA H200)");
  google::protobuf::ListValue* check = s.add_freeze_checks();
  check->add_values()->set_number_value(50);
  check->add_values()->set_number_value(0.25);
  s.set_durable(false);
  s.set_status("ok");
  ASSERT_TRUE(WriteSummaryJson(dir + "/summary.json", s).ok());
  const std::string text = testing::ReadFile(dir + "/summary.json");
  EXPECT_EQ(testing::Field(text, "params"), "5497558138880");
  EXPECT_EQ(testing::Field(text, "steps"), "20");
  EXPECT_EQ(testing::Field(text, "freeze_checks"), "[[50, 0.25]]");
  EXPECT_EQ(testing::Field(text, "worker_devices"), "[\"cpu\", \"cuda:0 (NVIDIA H200)\"]");
  EXPECT_EQ(testing::Field(text, "final_loss"), "null");
  EXPECT_EQ(testing::Field(text, "resumed_from_step"), "null");
  EXPECT_EQ(testing::Field(text, "durable"), "false");
  EXPECT_EQ(testing::Field(text, "compress_ratio_up"), "0.1");
  EXPECT_EQ(testing::Field(text, "compress_ratio_down"), "0");  // nothing came down
  absl::StatusOr<run::Summary> back = ReadSummaryJson(dir + "/summary.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->params(), uint64_t{5} << 40);
  EXPECT_EQ(back->freeze_step(), 18u);
  EXPECT_FALSE(back->has_final_loss());
  EXPECT_TRUE(back->has_durable());
  EXPECT_FALSE(back->durable());
  EXPECT_DOUBLE_EQ(back->compress_ratio_up(), 0.1);
  ASSERT_EQ(back->freeze_checks_size(), 1);
  EXPECT_EQ(back->freeze_checks(0).values(1).number_value(), 0.25);
  EXPECT_EQ(back->worker_devices(1), "cuda:0 (NVIDIA H200)");
  // A damaged file is named, and a finished job's folder is not taken over
  // on the strength of a file nobody can read.
  std::ofstream(dir + "/summary.json") << "{\"status\": \"ok\", \"steps\": ";
  EXPECT_THAT(std::string(ReadSummaryJson(dir + "/summary.json").status().message()),
              HasSubstr(dir + "/summary.json is not a summary.json"));
  EXPECT_FALSE(CheckNotFinished(dir).ok());
  EXPECT_EQ(ReadSummaryJson(dir + "/none.json").status().code(), absl::StatusCode::kNotFound);
}

// The divergence rule (job/loss_watch.h) on hand-made losses.
TEST(LossWatch, DivergedOnceTheMedianOfFiveStepsPassesAHundredTimesTheFirst) {
  LossWatch w;
  EXPECT_FALSE(w.Add(0, 2.0));  // the baseline: 100x is 200
  // One spike, or two, leave the median of five below 200.
  for (uint64_t t = 1; t <= 5; ++t) EXPECT_FALSE(w.Add(t, t % 3 == 0 ? 1e9 : 1.0)) << t;
  EXPECT_FALSE(w.Add(6, 1e9));  // steps 2-6: 1, 1e9, 1, 1, 1e9
  EXPECT_FALSE(w.diverged());
  EXPECT_FALSE(w.Add(7, std::nan("")));  // no loss reported: skipped
  EXPECT_FALSE(w.Add(8, 200.0));         // steps 3-8: 1e9, 1, 1, 1e9, 200: median 200
  EXPECT_FALSE(w.Add(9, 300.0));         // 1, 1, 1e9, 200, 300: median 200, not above
  EXPECT_FALSE(w.diverged());
  const std::optional<std::string> warning = w.Add(10, 500.0);  // 1, 1e9, 200, 300, 500
  ASSERT_TRUE(warning.has_value());
  EXPECT_EQ(*warning,
            "the loss diverged: its median over steps 5-10 is 300, more than 100x step 0's 2 "
            "(summary.json will say \"diverged\": true)");
  EXPECT_TRUE(w.diverged());
  EXPECT_FALSE(w.Add(11, 1e12)) << "warned once";

  LossWatch from_start;  // too large a learning rate: no calm step after the first
  from_start.Add(0, 0.33);
  for (uint64_t t = 1; t < 5; ++t) EXPECT_FALSE(from_start.Add(t, 4e12));
  EXPECT_TRUE(from_start.Add(5, 248.0).has_value());  // median 4e12

  LossWatch not_positive;  // a first loss of 0 (or below) gives no scale
  not_positive.Add(0, 0.0);
  for (uint64_t t = 1; t < 10; ++t) EXPECT_FALSE(not_positive.Add(t, 1e30));
  EXPECT_FALSE(not_positive.diverged());
}

// A resumed job keeps the rows before its checkpoint: read back as written,
// a line a crash cut short dropped, another file refused by name.
TEST(RunFolder, MetricsCsvReadsBackWhatWasWritten) {
  const std::string dir = testing::TempDir("metrics_read");
  const std::string path = dir + "/metrics.csv";
  MetricsRow a;
  a.step = 0;
  a.phase = "warmup";
  a.loss = 2.5;
  a.wall_s = 0.125;
  a.bytes_up = 1234;
  a.bytes_down = 99;
  a.epoch = 0.5;
  MetricsRow b = a;
  b.step = 1;
  b.phase = "compress";
  b.test_loss = 0.75;
  b.test_accuracy = 0.875;
  auto log = MetricsLog::Open(path, {a});
  ASSERT_TRUE(log.ok()) << log.status();
  ASSERT_TRUE(log->Append({b}).ok());
  ASSERT_TRUE(log->Close().ok());
  {
    std::ofstream cut(path, std::ios::app);
    cut << "2,compress,0.1";  // no newline: the crash came mid-line
  }
  auto rows = ReadMetricsCsv(path);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 2u);
  EXPECT_EQ((*rows)[0].step, 0u);
  EXPECT_EQ((*rows)[0].phase, "warmup");
  EXPECT_EQ((*rows)[0].loss, 2.5);
  EXPECT_EQ((*rows)[0].wall_s, 0.125);
  EXPECT_EQ((*rows)[0].bytes_up, 1234u);
  EXPECT_EQ((*rows)[0].bytes_down, 99u);
  EXPECT_EQ((*rows)[0].epoch, 0.5);
  EXPECT_FALSE((*rows)[0].test_accuracy.has_value());
  EXPECT_EQ((*rows)[1].phase, "compress");
  EXPECT_EQ((*rows)[1].test_loss, 0.75);
  EXPECT_EQ((*rows)[1].test_accuracy, 0.875);

  EXPECT_TRUE(ReadMetricsCsv(dir + "/none.csv").value().empty());
  {
    std::ofstream other(dir + "/other.csv");
    other << "a,b,c\n1,2,3\n";
  }
  EXPECT_THAT(std::string(ReadMetricsCsv(dir + "/other.csv").status().message()),
              HasSubstr(dir + "/other.csv: not a metrics.csv of this version"));
  {
    std::ofstream bad(dir + "/bad.csv");
    bad << "step,phase,loss,wall_s,bytes_up,bytes_down,step_s,push_s,reply_s,epoch,test_loss,"
           "test_accuracy\n0,warmup,x,0,0,0,0,0,0,0,,\n";
  }
  EXPECT_THAT(std::string(ReadMetricsCsv(dir + "/bad.csv").status().message()),
              HasSubstr(dir + "/bad.csv line 2: not a metrics row"));
}

TEST(RunFolder, MetricsLogHasEveryRowAppendedBeforeItIsClosed) {
  const std::string path = testing::TempDir("metrics_log") + "/metrics.csv";
  auto log = MetricsLog::Open(path);
  ASSERT_TRUE(log.ok()) << log.status();
  MetricsRow a;
  a.step = 0;
  a.phase = "warmup";
  a.loss = 2.5;
  MetricsRow b = a;
  b.step = 1;
  b.test_accuracy = 0.25;
  ASSERT_TRUE(log->Append({a}).ok());
  // Readable as it grows, before Close(): what a crash would leave.
  std::string text = testing::ReadFile(path);
  EXPECT_EQ(text.rfind("step,phase,loss,", 0), 0u);
  EXPECT_THAT(text, HasSubstr("\n0,warmup,2.5,"));
  ASSERT_TRUE(log->Append({b}).ok());
  ASSERT_TRUE(log->Close().ok());
  text = testing::ReadFile(path);
  EXPECT_THAT(text, HasSubstr("\n1,warmup,2.5,"));
  EXPECT_EQ(text.substr(text.size() - 6), ",0.25\n");
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 3);
  EXPECT_FALSE(log->Append({a}).ok());
}

}  // namespace
}  // namespace onebit
