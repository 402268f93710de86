// The library's Worker (include/onebit/worker.h) driven by a user's program
// (tests/cluster/api_worker.cc) on real clusters through onebit-launch
// --worker_cmd: the broadcast of rank 0's parameters, declared parameter
// counts, gradients released in pieces, and the per-step learning rate.
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster/test_util.h"

namespace onebit::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Job {
  RunResult run;
  std::string dir;
  std::string summary;
  std::vector<std::vector<float>> replicas;
  std::vector<std::vector<float>> masters;
};

// A job of `workers` x `servers` running api_worker with `args`.
Job RunApiJob(const std::string& name, uint32_t workers, uint32_t servers,
              const std::vector<std::string>& job_flags, const std::string& args) {
  Job j;
  j.dir = TempDir(name);
  std::vector<std::string> argv = {Bin("onebit-launch"),
                                   absl::StrCat("--workers=", workers),
                                   absl::StrCat("--servers=", servers),
                                   "--model=external",
                                   "--out=" + j.dir,
                                   "--dump_params",
                                   "--launch_register_timeout=20s",
                                   "--worker_cmd=" + std::string(ONEBIT_API_WORKER) + " " + args};
  argv.insert(argv.end(), job_flags.begin(), job_flags.end());
  j.run = RunCommand(argv, absl::Seconds(120));
  j.summary = ReadFile(j.dir + "/summary.json");
  if (j.run.code == 0) {
    for (uint32_t i = 0; i < workers; ++i) {
      j.replicas.push_back(ReadFloats(absl::StrCat(j.dir, "/replica_w", i, ".f32")));
    }
    for (uint32_t k = 0; k < servers; ++k) {
      j.masters.push_back(ReadFloats(absl::StrCat(j.dir, "/master_s", k, ".f32")));
    }
  }
  return j;
}

std::vector<float> Concat(const std::vector<std::vector<float>>& parts) {
  std::vector<float> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

const std::vector<std::string> kOnebitAdam = {"--optimizer=onebit-adam", "--freeze_step=3",
                                              "--lr=0.01", "--block_size=32", "--chunk_elems=64"};

TEST(WorkerApi, RanksInitialisedDifferentlyEndEqualToRankZerosStart) {
  // Each rank starts from its own x; the broadcast makes rank 0's win, so
  // the run equals one where every rank started from rank 0's values.
  Job own = RunApiJob("own", 3, 2, kOnebitAdam, "--init rank --steps 6");
  ASSERT_EQ(own.run.code, 0) << own.run.output;
  EXPECT_EQ(Field(own.summary, "replicas_equal"), "true");
  EXPECT_EQ(Field(own.summary, "params"), "1000");
  EXPECT_EQ(Field(own.summary, "steps"), "6");  // the program decided
  Job same = RunApiJob("same", 3, 2, kOnebitAdam, "--init same --steps 6");
  ASSERT_EQ(same.run.code, 0) << same.run.output;
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(FirstDifference(own.replicas[i], same.replicas[0]), "") << "worker " << i;
  }
  EXPECT_EQ(FirstDifference(Concat(own.masters), own.replicas[0]), "");
}

TEST(WorkerApi, ARankDeclaringAnotherParameterCountIsRefusedNamingBoth) {
  Job j = RunApiJob("bad_d", 3, 1, kOnebitAdam, "--bad_d_rank 1 --steps 2");
  EXPECT_NE(j.run.code, 0);
  // Whichever registers first sets d; the error names both ranks and values.
  EXPECT_THAT(j.run.output,
              ::testing::ContainsRegex("worker [0-9] declares d = 100[01], but worker [0-9] "
                                       "declared d = 100[01]"));
  EXPECT_THAT(j.run.output, HasSubstr("d = 1001"));
  EXPECT_THAT(j.run.output, HasSubstr("d = 1000"));
  EXPECT_THAT(j.run.output, HasSubstr("worker 1 declare"));
  EXPECT_THAT(j.summary, HasSubstr("declares d = "));
}

TEST(WorkerApi, GradientReleasedInReverseInPiecesEqualsOneStep) {
  // 1000 parameters in chunks of 64 over 2 shards: 7 uneven pieces that
  // start and end inside chunks, released last first.
  Job whole = RunApiJob("whole", 2, 2, kOnebitAdam, "--steps 8");
  Job pieces = RunApiJob("pieces", 2, 2, kOnebitAdam, "--steps 8 --release 7");
  ASSERT_EQ(whole.run.code, 0) << whole.run.output;
  ASSERT_EQ(pieces.run.code, 0) << pieces.run.output;
  EXPECT_EQ(Field(pieces.summary, "replicas_equal"), "true");
  EXPECT_EQ(Field(pieces.summary, "compress_steps"), "5");
  EXPECT_EQ(FirstDifference(pieces.replicas[0], whole.replicas[0]), "");
  EXPECT_EQ(FirstDifference(Concat(pieces.masters), Concat(whole.masters)), "");
  EXPECT_EQ(Field(pieces.summary, "bytes_up"), Field(whole.summary, "bytes_up"));
}

TEST(WorkerApi, TheStepsLearningRateReplacesTheSchedule) {
  for (const char* opt : {"adam", "onebit-adam"}) {
    SCOPED_TRACE(opt);
    std::vector<std::string> fast = {absl::StrCat("--optimizer=", opt), "--freeze_step=3",
                                     "--lr=0.05", "--block_size=32", "--chunk_elems=64"};
    std::vector<std::string> slow = fast;
    slow[2] = "--lr=0.01";
    // The job says 0.01, the program 0.05: the same as a job of 0.05.
    Job by_job = RunApiJob("by_job", 2, 2, fast, "--steps 6");
    Job by_program = RunApiJob("by_program", 2, 2, slow, "--steps 6 --lr 0.05");
    Job schedule = RunApiJob("schedule", 2, 2, slow, "--steps 6");
    ASSERT_EQ(by_job.run.code, 0) << by_job.run.output;
    ASSERT_EQ(by_program.run.code, 0) << by_program.run.output;
    ASSERT_EQ(schedule.run.code, 0) << schedule.run.output;
    EXPECT_EQ(FirstDifference(by_program.replicas[0], by_job.replicas[0]), "");
    EXPECT_EQ(FirstDifference(Concat(by_program.masters), Concat(by_job.masters)), "");
    EXPECT_NE(FirstDifference(schedule.replicas[0], by_job.replicas[0]), "");
  }
}

TEST(WorkerApi, RanksDisagreeingOnTheLearningRateFailTheStepNamingThem) {
  Job j = RunApiJob("lr_mismatch", 3, 2, kOnebitAdam,
                    "--steps 4 --lr 0.05 --lr_rank 2 --lr_value 0.02");
  EXPECT_NE(j.run.code, 0);
  EXPECT_THAT(j.run.output, HasSubstr("disagree on the learning rate"));
  EXPECT_THAT(j.run.output, HasSubstr("rank 2 sends 0.02"));
  EXPECT_THAT(j.run.output, HasSubstr("nothing was applied"));
  EXPECT_THAT(j.summary, HasSubstr("learning rate"));
}

// A job with a range [0, cut) of its own setting: its elements there equal
// job `inside`'s (that setting everywhere), the rest job `outside`'s (the
// job's own), and the setting made a difference.
void ExpectRangedEqualsEachSide(const Job& ranged, const Job& inside, const Job& outside,
                                size_t cut) {
  for (const Job* j : {&ranged, &inside, &outside}) {
    ASSERT_EQ(j->run.code, 0) << j->run.output;
    ASSERT_EQ(j->replicas.size(), 2u);
  }
  EXPECT_EQ(Field(ranged.summary, "replicas_equal"), "true");
  const std::vector<float>& r = ranged.replicas[1];
  const std::vector<float>& in = inside.replicas[1];
  const std::vector<float>& out = outside.replicas[1];
  EXPECT_EQ(FirstDifference({r.begin(), r.begin() + cut}, {in.begin(), in.begin() + cut}), "");
  EXPECT_EQ(FirstDifference({r.begin() + cut, r.end()}, {out.begin() + cut, out.end()}, cut), "");
  EXPECT_NE(FirstDifference(r, out), "");
}

TEST(WorkerApi, WeightDecayRangesReplaceTheJobsOnTheirParameters) {
  // Adam is elementwise here (the gradient of x_i depends on x_i alone), so
  // with [0, 500) at weight decay 0 those elements must equal a job without
  // weight decay, and the rest a job with it.
  const std::vector<std::string> decay = {"--optimizer=adam", "--lr=0.01", "--weight_decay=0.1",
                                          "--block_size=32", "--chunk_elems=64"};
  std::vector<std::string> none = decay;
  none[2] = "--weight_decay=0";
  ExpectRangedEqualsEachSide(RunApiJob("ranged", 2, 2, decay, "--steps 5 --wd 0:500:0"),
                             RunApiJob("without", 2, 2, none, "--steps 5"),
                             RunApiJob("with", 2, 2, decay, "--steps 5"), 500);
}

TEST(WorkerApi, WorkersDeclaringOtherWeightDecayRangesAreRefused) {
  Job j = RunApiJob("wd_mismatch", 3, 1, kOnebitAdam, "--steps 2 --wd 0:500:0 --wd_rank 2");
  EXPECT_NE(j.run.code, 0);
  EXPECT_THAT(j.run.output, HasSubstr("weight-decay ranges"));
  EXPECT_THAT(j.run.output, HasSubstr("[0, 500): 0"));
  EXPECT_THAT(j.run.output, ::testing::ContainsRegex("worker 2 declare|but worker 2 declared"));
}

TEST(WorkerApi, LrScaleRangesStepTheirParametersAtTheirOwnLr) {
  // Adam, elementwise: with [0, 500) at x0.5 of lr 0.02, those elements
  // must equal a job at lr 0.01, and the rest a job at 0.02 (0.5 scales
  // exactly).
  auto at = [](const char* lr) {
    return std::vector<std::string>{"--optimizer=adam", lr, "--weight_decay=0.1", "--block_size=32",
                                    "--chunk_elems=64"};
  };
  ExpectRangedEqualsEachSide(
      RunApiJob("lr_ranged", 2, 2, at("--lr=0.02"), "--steps 5 --lr_scale 0:500:0.5"),
      RunApiJob("lr_half", 2, 2, at("--lr=0.01"), "--steps 5"),
      RunApiJob("lr_whole", 2, 2, at("--lr=0.02"), "--steps 5"), 500);
}

TEST(WorkerApi, WorkersDeclaringOtherLrScaleRangesAreRefused) {
  Job j = RunApiJob("lr_scale_mismatch", 3, 1, kOnebitAdam,
                    "--steps 2 --lr_scale 0:500:0.25 --lr_scale_rank 2");
  EXPECT_NE(j.run.code, 0);
  EXPECT_THAT(j.run.output, HasSubstr("lr-scale ranges"));
  EXPECT_THAT(j.run.output, HasSubstr("[0, 500): x0.25"));
  EXPECT_THAT(j.run.output, HasSubstr("[0, 500): x0.5"));
}

TEST(WorkerApi, GatherOptimizerStateBetweenStepsOnly) {
  // onebit-adam past its freeze: the servers hold the frozen v, its den and
  // their error feedback (m went to the workers at the freeze); the servers'
  // x is every replica's (momentum replies). Mid-step the call is refused.
  Job j = RunApiJob("gather", 2, 2, kOnebitAdam, "--steps 6 --release 2 --gather");
  ASSERT_EQ(j.run.code, 0) << j.run.output;
  for (int r : {0, 1}) {
    EXPECT_THAT(j.run.output, HasSubstr(absl::StrCat("api_worker: rank ", r,
                                                     " state step 6 frozen 1 server den,e,v,x "
                                                     "worker den,e,mbar")));
  }
  EXPECT_THAT(j.run.output, HasSubstr("api_worker: gather mid-step refused: "
                                      "GatherOptimizerState() in the middle of step 0"));
}

// diloco with --sync_delay: the sync of step 3 (H = 4) is merged at step
// 5, and a gather between steps 3 and 4 finds its replies on their way;
// they are kept for step 5, and the job ends bit for bit as without the
// gather.
TEST(WorkerApi, AGatherWhileASyncTravelsChangesNothing) {
  const std::vector<std::string> diloco = {"--optimizer=diloco", "--sync_every=4",
                                           "--sync_delay=2",     "--lr=0.01",
                                           "--block_size=32",    "--steps=9"};
  Job plain = RunApiJob("delay_plain", 2, 2, diloco, "--steps 9");
  Job gathered = RunApiJob("delay_gather", 2, 2, diloco, "--steps 9 --gather_after 3");
  ASSERT_EQ(plain.run.code, 0) << plain.run.output;
  ASSERT_EQ(gathered.run.code, 0) << gathered.run.output;
  EXPECT_THAT(gathered.run.output, HasSubstr("api_worker: rank 1 gathered after step 3"));
  for (int r : {0, 1}) EXPECT_EQ(FirstDifference(gathered.replicas[r], plain.replicas[r]), "");
  EXPECT_EQ(FirstDifference(Concat(gathered.masters), Concat(plain.masters)), "");
  EXPECT_EQ(Field(gathered.summary, "rounds"), "3");  // t = 3, 7 and 8
}

// onebit-lamb with the program's own tensors: the shards hold whole ones
// (on 2 servers: [0, 600), then [600, 1000)); without them the job cannot
// be sharded and says why; workers declaring other tensors are refused.
TEST(WorkerApi, OnebitLambTakesTheTensorsTheWorkersDeclare) {
  const std::vector<std::string> lamb = {"--optimizer=onebit-lamb", "--freeze_step=3", "--lr=0.01",
                                         "--block_size=32", "--chunk_elems=64"};
  Job j = RunApiJob("lamb_layers", 2, 2, lamb, "--steps 6 --layers 100,600,700,1000");
  ASSERT_EQ(j.run.code, 0) << j.run.output;
  ASSERT_EQ(j.masters.size(), 2u);
  EXPECT_EQ(j.masters[0].size(), 600u);
  EXPECT_EQ(j.masters[1].size(), 400u);
  EXPECT_EQ(FirstDifference(j.replicas[0], j.replicas[1]), "");
  Job none = RunApiJob("lamb_no_layers", 2, 2, lamb, "--steps 6");
  EXPECT_NE(none.run.code, 0);
  EXPECT_THAT(none.run.output, HasSubstr("its trust ratios are per layer, and the model "
                                         "declares no layers"));
  Job other = RunApiJob("lamb_other_layers", 2, 2, lamb,
                        "--steps 6 --layers 100,600,700,1000 --layers_rank 1");
  EXPECT_NE(other.run.code, 0);
  EXPECT_THAT(other.run.output, ::testing::ContainsRegex("worker [01] declares [34] tensors"));
}

// The program's own settings: onebit-adam with a fixed freeze where the job
// names no optimizer, bitwise the job that names them on the command line.
TEST(WorkerApi, SettingsTheProgramDeclaresRunTheJobTheyName) {
  const std::vector<std::string> rest = {"--block_size=32", "--chunk_elems=64"};
  Job flags = RunApiJob("set_flags", 2, 2, kOnebitAdam, "--steps 6");
  Job declared = RunApiJob("set_declared", 2, 2, rest,
                           "--steps 6 --set optimizer=onebit-adam --set freeze_step=3 --set "
                           "lr=0.01");
  ASSERT_EQ(flags.run.code, 0) << flags.run.output;
  ASSERT_EQ(declared.run.code, 0) << declared.run.output;
  EXPECT_THAT(declared.run.output,
              HasSubstr("the workers set --freeze_step=3 --lr=0.01 --optimizer=onebit-adam"));
  EXPECT_THAT(declared.summary, HasSubstr("\"optimizer\": \"onebit-adam\""));
  EXPECT_THAT(declared.summary, HasSubstr("\"compress_steps\": 3"));
  ASSERT_EQ(declared.replicas.size(), 2u);
  EXPECT_EQ(FirstDifference(declared.replicas[0], flags.replicas[0]), "");
  EXPECT_EQ(FirstDifference(Concat(declared.masters), Concat(flags.masters)), "");
}

// The rows of metrics.csv, header first.
std::vector<std::string> MetricsLines(const Job& j) {
  return absl::StrSplit(ReadFile(j.dir + "/metrics.csv"), '\n', absl::SkipEmpty());
}

// A loss the program reports that is not finite fails the job as the
// built-in models' do, naming the rank, the step and the value, and every
// step before it keeps its row: the rows still queued in the workers go
// with their failure reports.
TEST(WorkerApi, ANonFiniteLossFailsTheJobNamingItAndKeepsEveryRowBefore) {
  const std::vector<std::string> adam = {"--optimizer=adam", "--lr=0.01", "--block_size=32",
                                         "--chunk_elems=64"};
  Job nan = RunApiJob("nan_loss", 2, 1, adam, "--steps 40 --bad_loss 1:26:nan");
  EXPECT_NE(nan.run.code, 0) << nan.run.output;
  EXPECT_NE(nan.run.code, -1) << "hung: " << nan.run.output;
  EXPECT_THAT(nan.run.output, HasSubstr("worker 1: loss is not finite (nan) at rank 1 step 26"));
  EXPECT_THAT(Field(nan.summary, "status"),
              HasSubstr("failed: worker 1 failed: worker 1: loss is not finite (nan) at rank 1 "
                        "step 26"));
  std::vector<std::string> lines = MetricsLines(nan);
  ASSERT_EQ(lines.size(), 1u + 26u) << ReadFile(nan.dir + "/metrics.csv");
  for (size_t t = 0; t < 26; ++t) {
    EXPECT_EQ(lines[t + 1].rfind(absl::StrCat(t, ",warmup,0."), 0), 0u) << lines[t + 1];
  }
  Job inf = RunApiJob("inf_loss", 2, 1, adam, "--steps 10 --bad_loss 0:3:-inf");
  EXPECT_NE(inf.run.code, 0);
  EXPECT_THAT(inf.run.output, HasSubstr("loss is not finite (-inf) at rank 0 step 3"));
  EXPECT_EQ(MetricsLines(inf).size(), 1u + 3u) << ReadFile(inf.dir + "/metrics.csv");
  // Beyond fp32's range, in which metrics travel, a loss is not finite either.
  Job huge = RunApiJob("huge_loss", 2, 1, adam, "--steps 10 --bad_loss 1:0:1e39");
  EXPECT_THAT(huge.run.output,
              HasSubstr("loss is not finite (1e+39, beyond fp32's range) at rank 1 step 0"));
  EXPECT_EQ(MetricsLines(huge).size(), 1u) << ReadFile(huge.dir + "/metrics.csv");
}

// StepOptions' default NaN (without has_loss) reports no loss: the job runs.
TEST(WorkerApi, NoLossReportedIsNoFailure) {
  Job j = RunApiJob("no_loss", 2, 1, kOnebitAdam, "--steps 5 --no_loss");
  ASSERT_EQ(j.run.code, 0) << j.run.output;
  EXPECT_EQ(Field(j.summary, "status"), "\"ok\"");
  EXPECT_EQ(Field(j.summary, "final_loss"), "null");
  EXPECT_EQ(Field(j.summary, "diverged"), "false");
  std::vector<std::string> lines = MetricsLines(j);
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_EQ(lines[5].rfind("4,compress,nan,", 0), 0u) << lines[5];
}

// A process that crashes after the coordinator ended the job fails the
// launch, naming it, but nothing is started again: the job is over, its run
// folder complete (starting it again, the coordinator would refuse the
// finished folder).
TEST(WorkerApi, AProcessFailingAfterTheJobEndedIsNamedAndNothingStartsAgain) {
  // With checkpoints, live recovery would start a failed process alone again.
  std::vector<std::string> flags = kOnebitAdam;
  flags.insert(flags.end(), {"--max_restarts=2", "--checkpoint_every=2",
                             "--checkpoint_dir=" + TempDir("abort_after_job_ckpt")});
  Job j = RunApiJob("abort_after_job", 2, 1, flags, "--steps 5 --abort_after_job 1");
  EXPECT_NE(j.run.code, 0) << j.run.output;
  EXPECT_THAT(j.run.output, HasSubstr("api_worker: rank 1 aborting after the job"));
  EXPECT_THAT(j.run.output,
              HasSubstr("worker1 failed (signal 6 (Aborted)) after the coordinator had ended the "
                        "job; nothing is started again"));
  EXPECT_THAT(j.run.output, Not(HasSubstr("restart 1 of 2")));
  EXPECT_EQ(Field(j.summary, "status"), "\"ok\"") << j.summary;
  EXPECT_EQ(Field(j.summary, "replicas_equal"), "true");
}

TEST(WorkerApi, WorkersDeclaringOtherSettingsAreRefused) {
  Job j = RunApiJob("set_mismatch", 3, 1, {}, "--steps 2 --set beta2=0.99 --set_rank 1");
  EXPECT_NE(j.run.code, 0);
  EXPECT_THAT(j.run.output,
              ::testing::ContainsRegex("worker 1 declares the settings none, but worker [02] "
                                       "declared --beta2=0.99|worker [02] declares the settings "
                                       "--beta2=0.99, but worker 1 declared none"));
}

}  // namespace
}  // namespace onebit::testing
