// Units of the runtime: data-plane header validation (each refusal names its
// problem), chunking, the update rules, the synthetic model, the config
// checks, and the coordinator's replica comparison.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "compress/codec.h"
#include "coordinator/coordinator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "job/config.h"
#include "job/loss_watch.h"
#include "job/run_folder.h"
#include "models/synthetic_model.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "net/liveness.h"
#include "tests/runtime/test_util.h"
#include "util/checksum.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

class DataHeader : public ::testing::Test {
 protected:
  void SetUp() override {
    fp32_ = *NewCodec("fp32", CodecOptions{64});
    fp16_ = *NewCodec("fp16", CodecOptions{64});
    job_.job_id = 0xabcdef;
    job_.workers = 3;
    job_.steps = 10;
    job_.map = *ShardMap::Create(1000, 2, 64);  // shards [0, 512), [512, 1000)
    job_.chunk_elems = 128;
    job_.push_codec = fp16_.get();
    job_.init_codec = fp32_.get();
  }
  // A valid push of chunk 1 of shard 1 ([640, 768)) from rank 2.
  data::Header Good() const {
    data::Header h;
    h.set_version(kProtocolVersion);
    h.set_job_id(job_.job_id);
    h.set_kind(data::PUSH);
    h.set_rank(2);
    h.set_step(4);
    h.set_shard(1);
    h.set_begin(640);
    h.set_count(128);
    h.set_codec(fp16_->name());
    h.set_block_size(64);
    h.set_payload_bytes(256);
    return h;
  }
  absl::Status Check(const data::Header& h, size_t frame = 256, uint32_t shard = 1) const {
    return ValidateRequest(h, job_, shard, WorkerIdentity(job_.job_id, h.rank()), frame);
  }
  std::unique_ptr<const Codec> fp32_, fp16_;
  DataPlaneJob job_;
};

TEST_F(DataHeader, AcceptsGoodPushesIncludingTheShortLastChunk) {
  EXPECT_TRUE(Check(Good()).ok()) << Check(Good());
  data::Header last = Good();
  last.set_begin(896);  // [896, 1000): 104 elements
  last.set_count(104);
  last.set_payload_bytes(208);
  EXPECT_TRUE(Check(last, 208).ok()) << Check(last, 208);
  data::Header init = Good();
  init.set_kind(data::INIT);
  init.set_rank(0);
  init.set_codec(fp32_->name());
  init.set_payload_bytes(512);
  EXPECT_TRUE(Check(init, 512).ok()) << Check(init, 512);
}

// Protobuf parses an int's worth of bytes: a frame of 2 GiB made it abort
// the server (seen while writing fuzz/data_header_fuzzer, whose inputs stay
// far smaller). The frame is mapped, not allocated: zero pages.
TEST_F(DataHeader, AFrameTooLargeForProtobufIsMalformed) {
  const size_t size = (size_t{1} << 31) + 16;
  void* frame = mmap(nullptr, size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(frame, MAP_FAILED);
  auto h = ParseHeader(frame, size);
  munmap(frame, size);
  ASSERT_FALSE(h.ok());
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("malformed header: 2147483664 bytes"));
  const std::string good = Good().SerializeAsString();
  EXPECT_TRUE(ParseHeader(good.data(), good.size()).ok());
}

TEST_F(DataHeader, EachProblemIsNamed) {
  struct C {
    std::function<void(data::Header&)> mutate;
    std::string text;
    size_t frame = 256;
  };
  const std::vector<C> cases = {
      {[](data::Header& h) { h.set_version(kProtocolVersion + 1); },
       absl::StrCat("unsupported protocol version ", kProtocolVersion + 1)},
      {[](data::Header& h) { h.set_version(1); }, "unsupported protocol version 1"},
      {[](data::Header& h) { h.set_version(0); }, "unsupported protocol version 0"},
      {[](data::Header& h) { h.set_job_id(1); }, "wrong job id 0000000000000001"},
      {[](data::Header& h) { h.set_kind(data::REPLY); }, "unexpected message kind REPLY"},
      {[](data::Header& h) { h.set_rank(3); }, "unknown worker rank 3 (job has 3 workers)"},
      {[](data::Header& h) { h.set_kind(data::INIT); }, "INIT from rank 2"},
      {[](data::Header& h) { h.set_shard(2); }, "shard 2 out of range (job has 2 shards)"},
      {[](data::Header& h) {
         h.set_shard(0);
         h.set_begin(0);
       },
       "shard 0 is not served here"},
      {[](data::Header& h) { h.set_begin(641); }, "not at a chunk of shard 1"},
      {[](data::Header& h) { h.set_begin(1000); }, "not at a chunk of shard 1"},
      {[](data::Header& h) { h.set_begin(0); }, "not at a chunk of shard 1"},
      {[](data::Header& h) { h.set_count(127); }, "wrong element count 127 for chunk 1"},
      {[](data::Header& h) { h.set_count(0); }, "wrong element count 0"},
      {[](data::Header& h) { h.set_codec("fp32"); }, "unknown codec 'fp32'"},
      {[](data::Header& h) { h.set_codec("\x01garbage"); }, "unknown codec '\\x01garbage'"},
      {[](data::Header& h) { h.set_block_size(32); }, "wrong block size 32 (job uses 64)"},
      {[](data::Header& h) { h.set_payload_bytes(512); }, "wrong payload length 512 in header"},
      {[](data::Header&) {}, "frame has 255", 255},
      {[](data::Header&) {}, "frame has 0", 0},
  };
  for (const C& c : cases) {
    data::Header h = Good();
    c.mutate(h);
    absl::Status st = Check(h, c.frame);
    EXPECT_FALSE(st.ok()) << c.text;
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.text));
  }
}

TEST_F(DataHeader, RoutingIdMustBeThatRanksOfThisJob) {
  data::Header h = Good();
  // Rank 2's identity from an earlier incarnation of the job.
  absl::Status st = ValidateRequest(h, job_, 1, WorkerIdentity(job_.job_id + 1, 2), 256);
  EXPECT_THAT(std::string(st.message()), HasSubstr("claimed by a socket"));
  st = ValidateRequest(h, job_, 1, WorkerIdentity(job_.job_id, 1), 256);
  EXPECT_THAT(std::string(st.message()), HasSubstr("claimed by a socket"));
  EXPECT_NE(WorkerIdentity(1, 0), WorkerIdentity(2, 0));
}

TEST(DataHeaderParse, RejectsTruncatedAndRandomBytes) {
  data::Header h;
  h.set_version(1);
  h.set_payload_bytes(300);  // a two-byte varint at the end
  std::string bytes = h.SerializeAsString();
  EXPECT_TRUE(ParseHeader(bytes.data(), bytes.size()).ok());
  bytes.pop_back();
  auto bad = ParseHeader(bytes.data(), bytes.size());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("malformed header"));
  const std::string ff(16, '\xff');
  EXPECT_FALSE(ParseHeader(ff.data(), ff.size()).ok());
  EXPECT_FALSE(ParseHeader(nullptr, 0).ok());
}

TEST(DataChunks, CoverEachShardExactlyOnce) {
  auto map = *ShardMap::Create(9973, 3, 32);
  for (uint64_t chunk : {32u, 96u, 4096u}) {
    for (uint32_t k = 0; k < 3; ++k) {
      const Range s = map.shard(k);
      uint64_t next = s.begin;
      for (uint64_t c = 0; c < NumChunks(s.size(), chunk); ++c) {
        Range r = ChunkRange(map, k, chunk, c);
        EXPECT_EQ(r.begin, next);
        EXPECT_GT(r.size(), 0u);
        EXPECT_LE(r.size(), chunk);
        next = r.end;
      }
      EXPECT_EQ(next, s.end);
    }
  }
  EXPECT_EQ(NumChunks(0, 64), 0u);
}

// --chunk_elems 0: an eighth of the largest shard, within [16 Ki, 1 Mi],
// a multiple of the block; a set value is kept.
TEST(DataChunks, AutoSizeIsAnEighthOfTheLargestShardWithinBounds) {
  // The mlp on 2 servers: shards of 118 784 and 116 362; an eighth is under 16 Ki.
  EXPECT_EQ(ChunkElemsFor(0, *ShardMap::Create(235146, 2, 2048)), 16384u);
  // 4 Mi on 4 servers: 1 Mi each, an eighth 128 Ki.
  EXPECT_EQ(ChunkElemsFor(0, *ShardMap::Create(4 << 20, 4, 2048)), 131072u);
  // 25 M on 2 servers: an eighth is 1.57 M, above the bound.
  EXPECT_EQ(ChunkElemsFor(0, *ShardMap::Create(25165824, 2, 2048)), 1048576u);
  // Rounded up to the block: 16 384 is not a multiple of 96, 16 416 is.
  EXPECT_EQ(ChunkElemsFor(0, *ShardMap::Create(9973, 3, 96)), 16416u);
  // 3 Mi + 96 on 3 servers: shards of 1 048 608; an eighth (131 076), up to the block.
  EXPECT_EQ(ChunkElemsFor(0, *ShardMap::Create((3 << 20) + 96, 3, 32)), 131104u);
  EXPECT_EQ(ChunkElemsFor(4096, *ShardMap::Create(25165824, 2, 2048)), 4096u);
}

TEST(SyntheticModel, DeterministicPerSeedRankStep) {
  SyntheticModel m({1000, 3, 0.5f, false});
  std::vector<float> x(1000), g1(1000), g2(1000), g3(1000);
  m.Init(x.data());
  auto l1 = m.Gradient(x.data(), 1, 5, g1.data());
  auto l2 = m.Gradient(x.data(), 1, 5, g2.data());
  m.Gradient(x.data(), 2, 5, g3.data()).IgnoreError();
  ASSERT_TRUE(l1.ok() && l2.ok());
  EXPECT_EQ(*l1, *l2);
  EXPECT_EQ(std::memcmp(g1.data(), g2.data(), 4000), 0);
  EXPECT_NE(std::memcmp(g1.data(), g3.data(), 4000), 0);  // per-rank noise
  for (float v : x) {
    EXPECT_GE(v, -1.0f);
    EXPECT_LT(v, 1.0f);
  }
  // Without noise, the gradient is a (x - c) with a in [0.5, 1.5): descending
  // along it lowers the loss.
  SyntheticModel quiet({1000, 3, 0.0f, false});
  std::vector<float> g(1000);
  const double before = *quiet.Gradient(x.data(), 0, 0, g.data());
  for (size_t i = 0; i < x.size(); ++i) x[i] -= 0.5f * g[i];
  EXPECT_LT(*quiet.Gradient(x.data(), 0, 1, g.data()), 0.5 * before);
}

TEST(ReplicaChecksum, IsZlibCrc32OfTheBytes) {
  // crc32 of the 4 bytes 00 00 80 3f (1.0f), from Python's zlib.crc32.
  const float one = 1.0f;
  EXPECT_EQ(Crc32OfFloats(&one, 1), 0xaca16a6au);
  EXPECT_EQ(Crc32OfFloats(nullptr, 0), 0u);
}

TEST(JobConfig, ValidationNamesTheFlag) {
  control::TrainingConfig c = testing::MakeConfig(2, 2, 100, 3, "sgd");
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  c.set_chunk_elems(100);
  EXPECT_THAT(std::string(ValidateConfig(c).message()), HasSubstr("--chunk_elems:"));
  c = testing::MakeConfig(2, 2, 100, 3, "sgd");
  c.set_block_size(48);
  EXPECT_THAT(std::string(ValidateConfig(c).message()), HasSubstr("--block_size:"));
  c = testing::MakeConfig(2, 2, 100, 3, "sgd");
  c.set_server_codec("onebit");
  EXPECT_THAT(std::string(ValidateConfig(c).message()), HasSubstr("--server_codec:"));
  EXPECT_EQ(SettingOfError(ValidateConfig(c)), "server_codec");
  c = testing::MakeConfig(2, 2, 100, 3, "sgd");
  c.set_checkpoint_every(5);
  EXPECT_THAT(std::string(ValidateConfig(c).message()),
              HasSubstr("--checkpoint_every: needs --checkpoint_dir"));
}

// Drives the coordinator service in-process: one server, two workers.
TEST(RunFolder, SummaryIsValidJsonWhateverTheNumbers) {
  const std::string dir = testing::TempDir("summary_json");
  Summary s;
  s.final_loss = std::numeric_limits<double>::infinity();
  s.test_loss = std::nan("");
  s.wall_s = 1.5;
  s.status = "failed: \"quoted\"\n";
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
  s.status = "ok";
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
  Summary s;
  s.lr = 2e-3f;  // exactly 0.0020000000949949026
  s.v_floor = 1e-8f;
  ASSERT_TRUE(WriteSummaryJson(dir + "/summary.json", s).ok());
  std::string text = testing::ReadFile(dir + "/summary.json");
  EXPECT_EQ(testing::Field(text, "lr"), "0.002");
  EXPECT_EQ(testing::Field(text, "v_floor"), "1e-08");
  EXPECT_EQ(testing::Field(text, "diverged"), "false");
  s.lr = 0.1234567f;  // 7 digits needed
  s.v_floor = 0;
  s.diverged = true;
  ASSERT_TRUE(WriteSummaryJson(dir + "/summary.json", s).ok());
  text = testing::ReadFile(dir + "/summary.json");
  EXPECT_EQ(testing::Field(text, "lr"), "0.1234567");
  EXPECT_EQ(testing::Field(text, "v_floor"), "0");
  EXPECT_EQ(testing::Field(text, "diverged"), "true");
}

// The divergence rule (job/loss_watch.h) on hand-made losses.
TEST(LossWatch, DivergedOnceTheMedianOfFiveStepsPassesAThousandTimesTheFirst) {
  LossWatch w;
  EXPECT_FALSE(w.Add(0, 2.0));  // the baseline: 1000x is 2000
  // One spike, or two, leave the median of five below 2000.
  for (uint64_t t = 1; t <= 5; ++t) EXPECT_FALSE(w.Add(t, t % 3 == 0 ? 1e9 : 1.0)) << t;
  EXPECT_FALSE(w.Add(6, 1e9));  // steps 2-6: 1, 1e9, 1, 1, 1e9
  EXPECT_FALSE(w.diverged());
  EXPECT_FALSE(w.Add(7, std::nan("")));  // no loss reported: skipped
  EXPECT_FALSE(w.Add(8, 2000.0));        // steps 3-8: 1e9, 1, 1, 1e9, 2000: median 2000
  EXPECT_FALSE(w.Add(9, 3000.0));        // 1, 1, 1e9, 2000, 3000: median 2000, not above
  EXPECT_FALSE(w.diverged());
  const std::optional<std::string> warning = w.Add(10, 5000.0);  // 1, 1e9, 2000, 3000, 5000
  ASSERT_TRUE(warning.has_value());
  EXPECT_EQ(*warning,
            "the loss diverged: its median over steps 5-10 is 3000, more than 1000x step 0's 2 "
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

// A job of 1 server and 1 worker on d = 100 (two shards' worth of checks
// come from one server's map), registered; the replies by role.
struct Formed {
  std::unique_ptr<CoordinatorService> svc;
  control::RegisterReply server, worker;
};
Formed FormOneByOne() {
  Formed f;
  f.svc = std::make_unique<CoordinatorService>(testing::MakeConfig(1, 1, 100, 10, "sgd"),
                                               std::set<std::string>{}, 42, absl::Seconds(10),
                                               Security{});
  std::thread t([&] {
    grpc::ServerContext ctx;
    control::RegisterRequest req;
    req.set_role(control::SERVER);
    req.set_requested_rank(0);
    req.set_data_endpoint("tcp://example:1");
    EXPECT_TRUE(f.svc->Register(&ctx, &req, &f.server).ok());
  });
  grpc::ServerContext ctx;
  control::RegisterRequest req;
  req.set_role(control::WORKER);
  req.set_requested_rank(0);
  EXPECT_TRUE(f.svc->Register(&ctx, &req, &f.worker).ok());
  t.join();
  return f;
}

TEST(CoordinatorService, MetricsOfStepsNotRunAreRefused) {
  Formed f = FormOneByOne();
  grpc::ServerContext ctx;
  control::HeartbeatRequest hb;
  hb.set_role(control::WORKER);
  hb.set_job_id(42);
  hb.set_credential(f.worker.credential());
  hb.set_step(2);  // steps 0 and 1 are done
  for (uint64_t step : {0, 1, 2, 3, 9, 500000}) {
    control::StepMetrics* m = hb.add_metrics();
    m->set_step(step);
    m->set_loss(1);
  }
  control::HeartbeatReply reply;
  ASSERT_TRUE(f.svc->Heartbeat(&ctx, &hb, &reply).ok());
  std::vector<uint64_t> steps;
  for (const MetricsRow& r : f.svc->MetricsRows()) steps.push_back(r.step);
  // Step 2's row may come with the count of 2 (sampled just before it); no later one.
  EXPECT_EQ(steps, (std::vector<uint64_t>{0, 1, 2}));
}

TEST(CoordinatorService, DoneMustCoverTheShardMapAndCarryItsCredential) {
  Formed f = FormOneByOne();
  auto done = [&](control::Role role, const std::string& credential,
                  const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
    grpc::ServerContext ctx;
    control::DoneRequest req;
    req.set_role(role);
    req.set_job_id(42);
    req.set_credential(credential);
    req.set_steps(10);
    for (auto [b, e] : ranges) {
      control::ShardChecksum* c = req.add_checksums();
      c->set_begin(b);
      c->set_end(e);
    }
    control::DoneReply reply;
    return f.svc->Done(&ctx, &req, &reply);
  };
  EXPECT_EQ(done(control::WORKER, "", {{0, 100}}).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(done(control::WORKER, f.server.credential(), {{0, 100}}).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);  // the server's, not the worker's
  for (const auto& ranges : std::vector<std::vector<std::pair<uint64_t, uint64_t>>>{
           {}, {{0, 50}}, {{0, 100}, {0, 100}}, {{0, 101}}}) {
    grpc::Status st = done(control::WORKER, f.worker.credential(), ranges);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << ranges.size();
    EXPECT_THAT(st.error_message(), HasSubstr("Done of worker 0: ")) << st.error_message();
  }
  EXPECT_EQ(f.svc->state(), CoordinatorService::State::kRunning);  // nothing counted
  EXPECT_TRUE(done(control::WORKER, f.worker.credential(), {{0, 100}}).ok());
  EXPECT_TRUE(done(control::SERVER, f.server.credential(), {{0, 100}}).ok());
  EXPECT_EQ(f.svc->state(), CoordinatorService::State::kFinished);
}

TEST(CoordinatorService, ReplicasEqualOnlyWhenEveryChecksumMatches) {
  for (bool corrupt : {false, true}) {
    control::TrainingConfig cfg = testing::MakeConfig(2, 1, 100, 1, "sgd");
    CoordinatorService svc(cfg, {}, 42, absl::Seconds(10), Security{});
    std::vector<std::thread> threads;
    std::vector<control::RegisterReply> replies(3);
    for (int i = 0; i < 3; ++i) {
      threads.emplace_back([&, i] {
        grpc::ServerContext ctx;
        control::RegisterRequest req;
        req.set_role(i == 0 ? control::SERVER : control::WORKER);
        req.set_requested_rank(i == 0 ? 0 : i - 1);
        req.set_data_endpoint("tcp://example:1");
        EXPECT_TRUE(svc.Register(&ctx, &req, &replies[i]).ok());
        EXPECT_EQ(replies[i].job_id(), 42u);
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(svc.state(), CoordinatorService::State::kRunning);
    for (int i = 0; i < 3; ++i) {
      grpc::ServerContext ctx;
      control::DoneRequest req;
      req.set_role(i == 0 ? control::SERVER : control::WORKER);
      req.set_rank(i == 0 ? 0 : i - 1);
      req.set_job_id(42);
      req.set_credential(replies[i].credential());
      auto* c = req.add_checksums();
      c->set_shard(0);
      c->set_end(100);
      c->set_crc32(corrupt && i == 2 ? 7 : 1234);
      control::DoneReply reply;
      EXPECT_TRUE(svc.Done(&ctx, &req, &reply).ok());
    }
    EXPECT_EQ(svc.state(), CoordinatorService::State::kFinished);
    EXPECT_EQ(svc.MakeSummary().replicas_equal, !corrupt);
  }
}

// Registers server 0 ("tcp://s0:5") and worker 0 (no data endpoint, its
// health endpoint `worker_health`), both of host w0host, at once (the
// cluster forms when both are in); returns their replies.
std::vector<control::RegisterReply> RegisterServerAndWorker(CoordinatorService* svc,
                                                            const std::string& worker_health) {
  std::vector<std::thread> threads;
  std::vector<control::RegisterReply> replies(2);
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      grpc::ServerContext ctx;
      control::RegisterRequest req;
      req.set_role(i == 0 ? control::SERVER : control::WORKER);
      req.set_requested_rank(0);
      req.set_data_endpoint(i == 0 ? "tcp://s0:5" : "");
      req.set_host("w0host");
      if (i == 1) req.set_health_endpoint(worker_health);
      EXPECT_TRUE(svc->Register(&ctx, &req, &replies[i]).ok());
    });
  }
  for (auto& t : threads) t.join();
  return replies;
}

// A heartbeat of server 0 (job 42) with `credential`; the reply.
control::HeartbeatReply BeatAsServer(CoordinatorService* svc, const std::string& credential) {
  grpc::ServerContext ctx;
  control::HeartbeatRequest hb;
  hb.set_role(control::SERVER);
  hb.set_job_id(42);
  hb.set_credential(credential);
  control::HeartbeatReply reply;
  EXPECT_TRUE(svc->Heartbeat(&ctx, &hb, &reply).ok());
  return reply;
}

// A socket listening on 127.0.0.1, and a port on which nothing listens
// (bound, then closed: nothing else on this machine takes it that fast).
struct Ports {
  int listening_fd = -1;
  std::string listening, gone;
  Ports() {
    auto bound = [](bool listen_too, int* port) {
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
      if (listen_too) EXPECT_EQ(listen(fd, 128), 0);  // never accepted: room for every probe
      socklen_t len = sizeof(a);
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
      *port = ntohs(a.sin_port);
      return fd;
    };
    int port = 0;
    listening_fd = bound(true, &port);
    listening = absl::StrCat("127.0.0.1:", port);
    close(bound(false, &port));
    gone = absl::StrCat("127.0.0.1:", port);
  }
  ~Ports() { close(listening_fd); }
};

TEST(Liveness, AProbeTellsAListeningProcessFromAGoneOne) {
  Ports ports;
  const std::vector<Liveness> answers = ProbeListening(
      {ports.listening, ports.gone, "", "no-port", "127.0.0.1:notaport", ports.listening},
      absl::Seconds(1));
  EXPECT_EQ(answers,
            (std::vector<Liveness>{Liveness::kListening, Liveness::kGone, Liveness::kUnknown,
                                   Liveness::kUnknown, Liveness::kUnknown, Liveness::kListening}));
}

// A worker that falls silent but still listens at its health endpoint (a
// starved process, a slow start) gets kSlowFactor (6) times the heartbeat
// timeout; one whose endpoint refuses connections is presumed dead at the
// timeout, as before the probe.
TEST(CoordinatorService, ASilentProcessThatStillListensIsSlowNotDead) {
  Ports ports;
  for (const bool listening : {true, false}) {
    SCOPED_TRACE(listening ? "still listening" : "gone");
    control::TrainingConfig cfg = testing::MakeConfig(1, 1, 100, 1, "sgd");
    cfg.set_heartbeat_timeout_ms(1000);
    CoordinatorService svc(cfg, {}, 42, absl::Seconds(10), Security{});
    const absl::Time start = absl::Now();  // no later than the worker was last seen
    const std::vector<control::RegisterReply> replies =
        RegisterServerAndWorker(&svc, listening ? ports.listening : ports.gone);
    absl::Duration failed_after = absl::InfiniteDuration();
    while (absl::Now() - start < absl::Seconds(20)) {
      absl::SleepFor(absl::Milliseconds(20));
      BeatAsServer(&svc, replies[0].credential());  // the server keeps beating
      svc.Tick();
      if (svc.state() == CoordinatorService::State::kFailed) {
        failed_after = absl::Now() - start;  // an upper bound on the worker's silence
        break;
      }
    }
    ASSERT_EQ(svc.state(), CoordinatorService::State::kFailed);
    if (listening) {
      EXPECT_GE(failed_after, absl::Seconds(6)) << "declared dead while it still listened";
      EXPECT_THAT(svc.reason(),
                  HasSubstr("worker 0 (w0host) sent no heartbeat for 6s, although it still "
                            "listens at its health endpoint (hung?): presumed dead"));
    } else {
      EXPECT_LT(failed_after, absl::Seconds(6)) << "a gone process waited for as a slow one";
      EXPECT_THAT(svc.reason(),
                  HasSubstr("worker 0 (w0host) sent no heartbeat for 1s: presumed dead"));
    }
  }
}

TEST(CoordinatorService, SilentProcessIsDeclaredDeadByName) {
  control::TrainingConfig cfg = testing::MakeConfig(1, 1, 100, 1, "sgd");
  cfg.set_heartbeat_timeout_ms(100);
  CoordinatorService svc(cfg, {}, 42, absl::Seconds(10), Security{});
  const std::vector<control::RegisterReply> replies = RegisterServerAndWorker(&svc, "");
  // The server keeps beating, each beat just before the coordinator's check
  // (so a loaded machine's pauses fall between a check and the next beat);
  // the worker falls silent. Until the 100 ms run out, at most 10 s.
  const absl::Time start = absl::Now();
  while (svc.state() != CoordinatorService::State::kFailed &&
         absl::Now() - start < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(30));
    BeatAsServer(&svc, replies[0].credential());
    svc.Tick();
  }
  EXPECT_EQ(svc.state(), CoordinatorService::State::kFailed);
  EXPECT_THAT(svc.reason(), HasSubstr("worker 0 (w0host) sent no heartbeat"));
  const control::HeartbeatReply reply = BeatAsServer(&svc, replies[0].credential());
  EXPECT_EQ(reply.command(), control::ABORT);
  EXPECT_THAT(reply.reason(), HasSubstr("worker 0"));
}

// A coordinator that answers heartbeats slowly and records, for Done, which
// metrics had been counted when it came.
class SlowCoordinator final : public control::Coordinator::Service {
 public:
  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest* req,
                         control::HeartbeatReply*) override {
    entered_ = true;
    absl::SleepFor(absl::Milliseconds(400));
    absl::MutexLock l(&mu_);
    for (const auto& m : req->metrics()) counted_.push_back(m.step());
    return grpc::Status::OK;
  }
  grpc::Status Done(grpc::ServerContext*, const control::DoneRequest* req,
                    control::DoneReply*) override {
    absl::MutexLock l(&mu_);
    before_done_ = counted_;
    for (const auto& m : req->metrics()) with_done_.push_back(m.step());
    return grpc::Status::OK;
  }
  std::atomic<bool> entered_{false};  // a heartbeat has reached it
  absl::Mutex mu_;
  std::vector<uint64_t> counted_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> before_done_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> with_done_ ABSL_GUARDED_BY(mu_);
};

// A coordinator service served on a free loopback port, and a stub to it
// (server null when it could not listen).
struct LocalCoordinator {
  std::unique_ptr<grpc::Server> server;
  std::string target;
  std::unique_ptr<control::Coordinator::Stub> stub;
};

LocalCoordinator ServeLocally(control::Coordinator::Service* svc) {
  LocalCoordinator local;
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(svc);
  local.server = b.BuildAndStart();
  if (port <= 0) local.server.reset();
  local.target = absl::StrCat("127.0.0.1:", port);
  local.stub = control::Coordinator::NewStub(
      grpc::CreateChannel(local.target, grpc::InsecureChannelCredentials()));
  return local;
}

// The coordinator may end the job on Done: metrics a heartbeat still
// carries must have been counted before Done comes, else they are lost.
TEST(Heartbeater, DoneComesAfterTheHeartbeatInFlightIsAnswered) {
  SlowCoordinator svc;
  const LocalCoordinator local = ServeLocally(&svc);
  ASSERT_NE(local.server, nullptr);
  const std::string& target = local.target;
  control::Coordinator::Stub* stub = local.stub.get();
  Heartbeater hb(stub, target, control::WORKER, 0, 42, absl::Seconds(30), absl::Seconds(10));
  hb.Start();
  for (uint64_t step = 0; step < 5; ++step) {
    control::StepMetrics m;
    m.set_step(step);
    hb.AddMetrics(m);
  }
  hb.Kick();
  // That heartbeat is being answered when Done goes out.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!svc.entered_ && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_TRUE(svc.entered_);
  control::StepMetrics last;
  last.set_step(5);
  hb.AddMetrics(last);
  EXPECT_TRUE(hb.Done({}, 6).ok());
  std::vector<uint64_t> before_done, with_done;
  {
    absl::MutexLock l(&svc.mu_);
    before_done = svc.before_done_;
    with_done = svc.with_done_;
  }
  EXPECT_EQ(before_done, (std::vector<uint64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(with_done, (std::vector<uint64_t>{5}));
  local.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// A coordinator whose heartbeats do not come back in time (a crowded host):
// each call waits until released, longer than the client's deadline.
class UnansweringCoordinator final : public control::Coordinator::Service {
 public:
  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest*,
                         control::HeartbeatReply*) override {
    absl::MutexLock l(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&released_), absl::Seconds(3));
    return grpc::Status::OK;
  }
  void Release() {
    absl::MutexLock l(&mu_);
    released_ = true;
  }
  absl::Mutex mu_;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
};

// A heartbeat that runs out of time means a slow coordinator, not a lost
// one: the process gives up after kSlowCoordinatorFactor (6) timeouts, not
// one (a refused connection: one, as the next test's lost coordinator).
TEST(Heartbeater, ACoordinatorThatAnswersTooLateIsSlowNotLost) {
  UnansweringCoordinator svc;
  const LocalCoordinator local = ServeLocally(&svc);
  ASSERT_NE(local.server, nullptr);
  const absl::Time start = absl::Now();
  Heartbeater hb(local.stub.get(), local.target, control::WORKER, 0, 42, absl::Milliseconds(50),
                 absl::Milliseconds(500));
  hb.Start();
  while (hb.command() == control::CONTINUE && absl::Now() - start < absl::Seconds(30)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const absl::Duration gave_up = absl::Now() - start;
  EXPECT_EQ(hb.command(), control::ABORT);
  EXPECT_GE(gave_up, absl::Seconds(3)) << "gave up on a slow coordinator after one timeout";
  EXPECT_THAT(hb.reason(), HasSubstr("is unreachable (no heartbeat for 3s): Deadline Exceeded"));
  svc.Release();
  local.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

TEST(Heartbeater, TheJobBeatsAtMostFiftyTimesASecondInAll) {
  control::TrainingConfig c = testing::MakeConfig(2, 1, 100, 1, "sgd");
  c.set_heartbeat_timeout_ms(10000);
  EXPECT_EQ(HeartbeatInterval(c), absl::Seconds(1));  // 3 processes: the timeout's tenth
  c.set_workers(128);
  c.set_servers(32);
  EXPECT_EQ(HeartbeatInterval(c), absl::Milliseconds(3200));  // 160 / 50 a second
  c.set_workers(1000);
  EXPECT_EQ(HeartbeatInterval(c), absl::Seconds(10) / 3);  // still three beats per timeout
  c.set_workers(2);
  c.set_servers(1);
  c.set_heartbeat_timeout_ms(1000);
  EXPECT_EQ(HeartbeatInterval(c), absl::Milliseconds(100));  // 3 / 50 s is less
  c.set_heartbeat_timeout_ms(100);  // 3 / 50 s is more than the tenth, 20 ms; a third at most
  EXPECT_EQ(HeartbeatInterval(c), absl::Milliseconds(100) / 3);
}

// A coordinator that records the heartbeats it is sent.
class RecordingCoordinator final : public control::Coordinator::Service {
 public:
  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest* req,
                         control::HeartbeatReply*) override {
    absl::MutexLock l(&mu_);
    seen_.push_back(*req);
    return grpc::Status::OK;
  }
  absl::Mutex mu_;
  std::vector<control::HeartbeatRequest> seen_ ABSL_GUARDED_BY(mu_);
};

// A failing process's report carries the metrics still queued, with the
// steps done (without which the coordinator takes no row): metrics.csv
// keeps every step completed before the failure.
TEST(Heartbeater, AnErrorReportCarriesTheQueuedMetricsAndTheStepsDone) {
  RecordingCoordinator svc;
  const LocalCoordinator local = ServeLocally(&svc);
  ASSERT_NE(local.server, nullptr);
  const std::string& target = local.target;
  control::Coordinator::Stub* stub = local.stub.get();
  // Not started: no periodic heartbeat carries the metrics first.
  Heartbeater hb(stub, target, control::WORKER, 1, 42, absl::Seconds(30), absl::Seconds(10));
  for (uint64_t step = 0; step < 3; ++step) {
    control::StepMetrics m;
    m.set_step(step);
    hb.AddMetrics(m);
  }
  hb.SetStep(3);
  hb.ReportError("worker 1: loss is not finite (nan) at rank 1 step 3");
  absl::MutexLock l(&svc.mu_);
  ASSERT_EQ(svc.seen_.size(), 1u);
  const control::HeartbeatRequest& req = svc.seen_[0];
  EXPECT_EQ(req.error(), "worker 1: loss is not finite (nan) at rank 1 step 3");
  EXPECT_EQ(req.step(), 3u);
  std::vector<uint64_t> steps;
  for (const auto& m : req.metrics()) steps.push_back(m.step());
  EXPECT_EQ(steps, (std::vector<uint64_t>{0, 1, 2}));
  local.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

}  // namespace
}  // namespace onebit
