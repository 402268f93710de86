// State files and checkpoint folders: what is written reads back bit for
// bit; every kind of damage is refused naming the file (and the section),
// and the newest complete checkpoint is the one found.
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "checkpoint/async_writer.h"
#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/state_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/scratch.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

std::string TempRoot(const std::string& name) { return ScratchDir("onebit-ckpt", name); }

std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void Write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::vector<float> Ramp(size_t n, float base) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = base + 0.25f * static_cast<float>(i);
  return v;
}

// A server's file: x and m over [100, 1100), a scalar.
WrittenFile WriteServerState(const std::string& dir, uint64_t step) {
  checkpoint::StateHeader h;
  h.set_step(step);
  h.set_role("server");
  h.set_rank(1);
  h.set_begin(100);
  h.set_end(1100);
  StateWriter w(h);
  std::vector<float> x = Ramp(1000, 1.0f);
  w.AddFloats("x", x);
  x[0] = -7.0f;  // the snapshot is a copy: later changes are not in it
  w.AddFloats("m", Ramp(1000, -3.0f));
  w.SetValue("phase", "compress");
  auto f = w.WriteTo(dir, "server-1.state");
  EXPECT_TRUE(f.ok()) << f.status();
  return f.value_or(WrittenFile{});
}

// The files' checksum is zlib's crc32 (the format says so), whatever computes it.
TEST(StateFile, TheChecksumIsZlibsCrc32) {
  std::string bytes(3 << 20, '\0');
  uint32_t seed = 12345;
  for (char& c : bytes) c = static_cast<char>((seed = seed * 1103515245u + 12345u) >> 24);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{64}, size_t{4097}, bytes.size()}) {
    const auto* p = reinterpret_cast<const Bytef*>(bytes.data());
    EXPECT_EQ(Crc32(absl::string_view(bytes.data(), n)), crc32(0, p, static_cast<uInt>(n))) << n;
  }
  // Continued from an earlier part's checksum, as zlib continues.
  const uint32_t first = Crc32(absl::string_view(bytes).substr(0, 1000));
  EXPECT_EQ(
      Crc32(absl::string_view(bytes).substr(1000), first),
      crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

// Files of every length around the direct writes' alignment and pieces
// read back as written, with no padding left and no temporary file.
TEST(StateFile, WritesAnyLengthExactly) {
  const std::string dir = TempRoot("lengths");
  std::string bytes((8 << 20) + 9000, '\0');
  uint32_t seed = 99;
  for (char& c : bytes) c = static_cast<char>((seed = seed * 1103515245u + 12345u) >> 24);
  const size_t piece = size_t{4} << 20;
  for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, piece - 1, piece,
                   piece + 1, piece + 4096 + 3, bytes.size()}) {
    SCOPED_TRACE(n);
    const absl::string_view all(bytes.data(), n);
    // In uneven parts, as a state file's header and sections come.
    const std::vector<absl::string_view> parts = {all.substr(0, n / 3), all.substr(n / 3, 5),
                                                  all.substr(std::min(n, n / 3 + 5))};
    auto f = WriteFileAtomically(dir, "f", parts);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->size, n);
    EXPECT_EQ(f->crc32, Crc32(all));
    EXPECT_TRUE(Read(dir + "/f") == all);
    EXPECT_FALSE(std::filesystem::exists(dir + "/f.tmp"));
  }
}

TEST(StateFile, ReadsBackBitForBit) {
  const std::string dir = TempRoot("roundtrip");
  const WrittenFile f = WriteServerState(dir, 40);
  EXPECT_EQ(f.name, "server-1.state");
  const std::string bytes = Read(dir + "/server-1.state");
  EXPECT_EQ(f.size, bytes.size());
  EXPECT_EQ(f.crc32, Crc32(bytes));
  EXPECT_EQ(bytes.substr(0, 8), "OBSTATE1");
  EXPECT_FALSE(std::filesystem::exists(dir + "/server-1.state.tmp"));

  auto r = StateReader::Open(dir + "/server-1.state");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->header().step(), 40u);
  EXPECT_EQ(r->header().role(), "server");
  EXPECT_EQ(r->header().begin(), 100u);
  EXPECT_EQ(r->header().end(), 1100u);
  auto x = r->Floats("x", 1000);
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(*x, Ramp(1000, 1.0f));
  EXPECT_EQ(r->Floats("m").value(), Ramp(1000, -3.0f));
  EXPECT_EQ(r->Value("phase").value(), "compress");
  EXPECT_THAT(std::string(r->Floats("v").status().message()),
              HasSubstr("server-1.state has no section 'v'"));
  EXPECT_THAT(std::string(r->Floats("x", 999).status().message()),
              HasSubstr("section 'x' holds 4000 bytes, not 999 floats"));
  EXPECT_THAT(std::string(r->Value("freeze").status().message()), HasSubstr("no value 'freeze'"));
}

TEST(StateFile, EveryKindOfDamageIsNamed) {
  const std::string dir = TempRoot("damage");
  WriteServerState(dir, 40);
  const std::string path = dir + "/server-1.state";
  const std::string good = Read(path);
  struct Case {
    std::string name;
    std::string bytes;
    std::string error;
  };
  std::string flip_m = good;
  flip_m[flip_m.size() - 10] ^= 0x04;  // inside the last section, m
  std::string flip_head = good;
  flip_head[14] ^= 0x01;  // inside the header
  const std::vector<Case> cases = {
      {"flipped payload byte", flip_m, "section 'm' does not match its checksum"},
      {"flipped header byte", flip_head, "the header's checksum does not match"},
      {"truncated", good.substr(0, good.size() - 100), "truncated: section 'm'"},
      {"truncated header", good.substr(0, 20), "truncated inside its header"},
      {"trailing bytes", good + "xx", "2 bytes after the last section"},
      {"not a state file", "hello, world, this is text", "no OBSTATE1 magic"},
  };
  for (const Case& c : cases) {
    Write(path, c.bytes);
    auto r = StateReader::Open(path);
    EXPECT_FALSE(r.ok()) << c.name;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("checkpoint file " + path + ": "))
        << c.name;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.error)) << c.name;
  }
  std::filesystem::remove(path);
  EXPECT_THAT(std::string(StateReader::Open(path).status().message()),
              HasSubstr(path + " is missing"));
}

// A complete checkpoint of `step` under root: one state file and a manifest.
std::string WriteCheckpoint(const std::string& root, uint64_t step,
                            uint32_t format = kCheckpointFormat) {
  const std::string dir = MakeStepDir(root, step).value();
  const WrittenFile f = WriteServerState(dir, step);
  checkpoint::Manifest m;
  m.set_format(format);
  m.set_step(step);
  m.set_job_id("00000000000000aa");
  m.mutable_config()->mutable_cluster()->set_workers(3);
  checkpoint::ManifestFile* e = m.add_files();
  e->set_name(f.name);
  e->set_size(f.size);
  e->set_crc32(f.crc32);
  EXPECT_TRUE(WriteManifest(dir, m).ok());
  return dir;
}

// A snapshot copies into the buffers of the one before (memory already
// mapped), which a written StateWriter hands back; at most max_held wait.
TEST(SnapshotBuffers, ASnapshotReusesTheLastOnesBuffersAndHoldsAtMostTheLimit) {
  auto buffers = std::make_shared<SnapshotBuffers>(2);
  const std::vector<float> a = Ramp(1000, 1.0f), b = Ramp(800, -5.0f);
  const float* first = nullptr;
  {
    StateWriter w(checkpoint::StateHeader{});
    std::vector<float> copy = buffers->Copy(a);
    EXPECT_EQ(copy, a);
    first = copy.data();
    w.AddFloats("a", std::move(copy));
    w.ReturnBuffersTo(buffers);
  }  // written and gone: its array is the buffers' again
  std::vector<float> again = buffers->Copy(b);
  EXPECT_EQ(again, b);
  EXPECT_EQ(again.data(), first);  // the same memory, not a new allocation
  std::vector<float> bigger = buffers->Copy(Ramp(2000, 0.0f));
  EXPECT_NE(bigger.data(), first);  // nothing kept fits: fresh
  EXPECT_EQ(bigger, Ramp(2000, 0.0f));
  // Three arrays given back while two may wait: one of them is freed.
  std::vector<std::vector<float>> out;
  for (int i = 0; i < 3; ++i) out.push_back(std::vector<float>(5, 1.0f));
  const float* kept0 = out[0].data();
  const float* kept1 = out[1].data();
  auto fresh = std::make_shared<SnapshotBuffers>(2);
  for (auto& v : out) fresh->Give(std::move(v));
  std::vector<float> t0 = fresh->Take(5), t1 = fresh->Take(5), t2 = fresh->Take(5);
  EXPECT_TRUE((t0.data() == kept0 || t0.data() == kept1) &&
              (t1.data() == kept0 || t1.data() == kept1) && t0.data() != t1.data());
  EXPECT_NE(t2.data(), kept0);
  EXPECT_NE(t2.data(), kept1);
}

TEST(CheckpointDir, TheNewestCompleteOneIsFoundAndTheDamagedOnesNamed) {
  const std::string root = TempRoot("latest");
  EXPECT_EQ(LatestCheckpoint(root, nullptr).status().code(), absl::StatusCode::kNotFound);
  WriteCheckpoint(root, 20);
  WriteCheckpoint(root, 40);
  const std::string d60 = WriteCheckpoint(root, 60);
  const std::string d80 = WriteCheckpoint(root, 80);
  const std::string d100 = WriteCheckpoint(root, 100);
  auto c = LatestCheckpoint(root, nullptr);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->manifest.step(), 100u);
  EXPECT_EQ(c->dir, root + "/step-000000000100");
  EXPECT_EQ(c->manifest.config().cluster().workers(), 3u);

  // 100: a flipped byte; 80: truncated; 60: no manifest (a crash mid-write).
  std::string bytes = Read(d100 + "/server-1.state");
  bytes[bytes.size() / 2] ^= 0x10;
  Write(d100 + "/server-1.state", bytes);
  bytes = Read(d80 + "/server-1.state");
  Write(d80 + "/server-1.state", bytes.substr(0, bytes.size() - 1));
  std::filesystem::remove(d60 + "/MANIFEST");
  std::vector<std::string> refused;
  c = LatestCheckpoint(root, &refused);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->manifest.step(), 40u);
  ASSERT_EQ(refused.size(), 3u);
  EXPECT_THAT(refused[0], HasSubstr(d100 + "/server-1.state: does not match its checksum"));
  EXPECT_THAT(refused[1], HasSubstr(d80 + "/server-1.state: "));
  EXPECT_THAT(refused[1], HasSubstr("the manifest says"));
  EXPECT_THAT(refused[2], HasSubstr(d60 + "/MANIFEST is missing: the checkpoint is incomplete"));

  // A damaged manifest is refused too.
  bytes = Read(root + "/step-000000000040/MANIFEST");
  bytes[bytes.size() - 1] ^= 0x01;
  Write(root + "/step-000000000040/MANIFEST", bytes);
  refused.clear();
  c = LatestCheckpoint(root, &refused);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->manifest.step(), 20u);
  EXPECT_THAT(refused.back(), HasSubstr("MANIFEST: does not match its checksum"));
}

// A checkpoint of another build's format is not damaged: the job refuses
// to start over it (it would begin afresh and prune it) instead of skipping
// to an older one.
TEST(CheckpointDir, AnotherFormatIsRefusedByNameNotSkipped) {
  const std::string root = TempRoot("format");
  WriteCheckpoint(root, 10);
  const std::string old = WriteCheckpoint(root, 20, kCheckpointFormat - 1);
  std::vector<std::string> refused;
  auto c = LatestCheckpoint(root, &refused);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_THAT(
      std::string(c.status().message()),
      HasSubstr(absl::StrCat(old, "/MANIFEST: checkpoint format ", kCheckpointFormat - 1,
                             " of another onebit-ps build; this build reads ", kCheckpointFormat)));
  EXPECT_TRUE(std::filesystem::exists(old + "/MANIFEST"));
}

TEST(CheckpointDir, PruningKeepsTheNewestCompleteAndWhatIsBeingWritten) {
  const std::string root = TempRoot("prune");
  for (uint64_t step : {10, 20, 30, 40}) WriteCheckpoint(root, step);
  // 25: an old incomplete one; 50: the one being written now.
  MakeStepDir(root, 25).value();
  const std::string d50 = MakeStepDir(root, 50).value();
  WriteServerState(d50, 50);
  ASSERT_TRUE(PruneCheckpoints(root, 2).ok());
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(root)) {
    left.push_back(e.path().filename().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"step-000000000030", "step-000000000040",
                                            "step-000000000050"}));
  EXPECT_FALSE(PruneCheckpoints(root, 0).ok());

  // Once nothing is being written (the job ended), 50 goes too; with no
  // complete checkpoint at all, every incomplete folder goes.
  ASSERT_TRUE(PruneCheckpoints(root, 2, /*nothing_in_making=*/true).ok());
  EXPECT_FALSE(std::filesystem::exists(root + "/step-000000000050"));
  EXPECT_TRUE(std::filesystem::exists(root + "/step-000000000040"));
  const std::string only = TempRoot("prune_incomplete");
  WriteServerState(MakeStepDir(only, 5).value(), 5);
  MakeStepDir(only, 10).value();
  ASSERT_TRUE(PruneCheckpoints(only, 2).ok());
  EXPECT_TRUE(std::filesystem::exists(only + "/step-000000000010"));  // maybe in the making
  ASSERT_TRUE(PruneCheckpoints(only, 2, /*nothing_in_making=*/true).ok());
  EXPECT_TRUE(std::filesystem::is_empty(only));
}

TEST(CheckpointDir, AFailedCheckpointIsRemovedAndACompleteOneNever) {
  const std::string root = TempRoot("remove_failed");
  const std::string d10 = MakeStepDir(root, 10).value();
  WriteServerState(d10, 10);  // what one process wrote before another failed
  ASSERT_TRUE(RemoveIncompleteCheckpoint(root, 10).ok());
  EXPECT_FALSE(std::filesystem::exists(d10));
  EXPECT_TRUE(RemoveIncompleteCheckpoint(root, 10).ok());  // gone already: nothing to do
  WriteCheckpoint(root, 20);
  ASSERT_TRUE(RemoveIncompleteCheckpoint(root, 20).ok());
  EXPECT_TRUE(VerifyCheckpoint(StepDir(root, 20)).ok());
}

// A shard with every array, distinct values per array and element.
ServerShardState Shard(uint32_t shard, uint64_t begin, uint64_t n, uint64_t step) {
  ServerShardState s;
  s.shard = shard;
  s.begin = begin;
  s.step = step;
  s.frozen = true;
  s.floored = 7 + shard;
  float base = static_cast<float>(begin);
  for (auto* v : {&s.x, &s.m, &s.v, &s.den, &s.e, &s.v_check}) {
    *v = Ramp(n, base);
    base += 100000.0f;
  }
  return s;
}

std::vector<float> Slice(const std::vector<float>& v, size_t b, size_t e) {
  return std::vector<float>(v.begin() + b, v.begin() + e);
}

TEST(OptimizerState, AShardRestoresBitForBitAndOntoOtherShardBoundaries) {
  const std::string dir = TempRoot("shards");
  // Two servers: [0, 600) and [600, 1000); the whole x is their concatenation.
  const ServerShardState a = Shard(0, 0, 600, 30), b = Shard(1, 600, 400, 30);
  ASSERT_TRUE(SaveServerShard(a).WriteTo(dir, "server-0.state").ok());
  ASSERT_TRUE(SaveServerShard(b).WriteTo(dir, "server-1.state").ok());
  auto ra = StateReader::Open(dir + "/server-0.state");
  auto rb = StateReader::Open(dir + "/server-1.state");
  ASSERT_TRUE(ra.ok() && rb.ok());

  ServerShardState back;
  back.shard = 1;
  ASSERT_TRUE(LoadServerShard({&*rb, &*ra}, 600, 1000, &back).ok());
  EXPECT_EQ(back.shard, 1u);
  EXPECT_EQ(back.begin, 600u);
  EXPECT_EQ(back.step, 30u);
  EXPECT_TRUE(back.frozen);
  EXPECT_EQ(back.floored, 8u);
  EXPECT_EQ(back.x, b.x);
  EXPECT_EQ(back.m, b.m);
  EXPECT_EQ(back.v, b.v);
  EXPECT_EQ(back.den, b.den);
  EXPECT_EQ(back.e, b.e);
  EXPECT_EQ(back.v_check, b.v_check);
  EXPECT_TRUE(back.replica.empty());

  // Three servers instead: [300, 700) straddles the old boundary.
  std::vector<float> all_e = a.e;
  all_e.insert(all_e.end(), b.e.begin(), b.e.end());
  std::vector<float> all_x = a.x;
  all_x.insert(all_x.end(), b.x.begin(), b.x.end());
  ServerShardState mid;
  mid.shard = 1;
  ASSERT_TRUE(LoadServerShard({&*ra, &*rb}, 300, 700, &mid).ok());
  EXPECT_EQ(mid.begin, 300u);
  EXPECT_EQ(mid.x, Slice(all_x, 300, 700));
  EXPECT_EQ(mid.e, Slice(all_e, 300, 700));
  EXPECT_EQ(mid.floored, 8u);  // server 1's range starts inside [300, 700)

  // Pieces missing, or of another step: refused by name.
  ServerShardState untouched = a;
  absl::Status st = LoadServerShard({&*ra}, 300, 700, &untouched);
  EXPECT_THAT(std::string(st.message()), HasSubstr("cover 300 of the 400 elements of [300, 700)"));
  EXPECT_EQ(untouched.x, a.x);
  ASSERT_TRUE(SaveServerShard(Shard(1, 600, 400, 31)).WriteTo(dir, "late.state").ok());
  auto late = StateReader::Open(dir + "/late.state");
  st = LoadServerShard({&*ra, &*late}, 0, 1000, &untouched);
  EXPECT_THAT(std::string(st.message()), HasSubstr("is of step 31"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("not one checkpoint"));
}

TEST(OptimizerState, ASeededShardKeepsItsBiasStepsAndAnUnseededOneCountsFromZero) {
  const std::string dir = TempRoot("bias_steps");
  ServerShardState seeded = Shard(0, 0, 100, 7);
  seeded.bias_steps = 30;
  ASSERT_TRUE(SaveServerShard(seeded).WriteTo(dir, "seeded.state").ok());
  ASSERT_TRUE(SaveServerShard(Shard(0, 0, 100, 7)).WriteTo(dir, "plain.state").ok());
  auto rs = StateReader::Open(dir + "/seeded.state");
  auto rp = StateReader::Open(dir + "/plain.state");
  ASSERT_TRUE(rs.ok() && rp.ok());
  // Files written before seeding existed have no such value: 0.
  EXPECT_FALSE(rp->Value("bias_steps").ok());
  ServerShardState back;
  back.bias_steps = 99;
  ASSERT_TRUE(LoadServerShard({&*rs}, 0, 100, &back).ok());
  EXPECT_EQ(back.bias_steps, 30u);
  EXPECT_EQ(back.step, 7u);
  ASSERT_TRUE(LoadServerShard({&*rp}, 0, 100, &back).ok());
  EXPECT_EQ(back.bias_steps, 0u);
}

TEST(OptimizerState, AWorkersStateRestoresBitForBitExceptX) {
  const std::string dir = TempRoot("worker");
  WorkerState w;
  w.x = Ramp(500, 1.0f);
  w.mbar = Ramp(500, -2.0f);
  w.e = Ramp(500, 3.5f);
  w.den = Ramp(500, 0.125f);
  w.frozen = true;
  ASSERT_TRUE(SaveWorkerState(w, 2, 44).WriteTo(dir, "worker-2.state").ok());
  auto r = StateReader::Open(dir + "/worker-2.state");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->header().step(), 44u);
  EXPECT_EQ(r->header().rank(), 2u);
  WorkerState back;
  back.x = Ramp(500, 9.0f);  // the caller's (from the servers): kept
  ASSERT_TRUE(LoadWorkerState(*r, 500, &back).ok());
  EXPECT_EQ(back.x, Ramp(500, 9.0f));
  EXPECT_EQ(back.mbar, w.mbar);
  EXPECT_EQ(back.e, w.e);
  EXPECT_EQ(back.den, w.den);
  EXPECT_TRUE(back.frozen);
  EXPECT_THAT(std::string(LoadWorkerState(*r, 501, &back).message()),
              HasSubstr("worker 2's state file is of d = 500, the job's model has d = 501"));
}

// Three workers' files resumed by four: rank 3 takes old rank 0's momentum
// (3 mod 3), and every worker the mean of the three errors.
TEST(OptimizerState, AnotherNumberOfWorkersKeepsTheMeanError) {
  const std::string dir = TempRoot("resized");
  std::vector<std::string> paths;
  for (uint32_t r = 0; r < 3; ++r) {
    WorkerState w;
    w.x = Ramp(8, 0.0f);
    w.mbar = Ramp(8, 10.0f * static_cast<float>(r));
    w.e = std::vector<float>(8, static_cast<float>(r + 1));  // 1, 2, 3: mean 2
    w.den = Ramp(8, 0.5f);
    w.frozen = true;
    const std::string name = absl::StrCat("worker-", r, ".state");
    ASSERT_TRUE(SaveWorkerState(w, r, 7).WriteTo(dir, name).ok());
    paths.push_back(dir + "/" + name);
  }
  WorkerState s;
  s.x = Ramp(8, 5.0f);
  ASSERT_TRUE(LoadWorkerStateResized(paths, 3, 8, &s).ok());
  EXPECT_EQ(s.x, Ramp(8, 5.0f));
  EXPECT_EQ(s.mbar, Ramp(8, 0.0f));
  EXPECT_EQ(s.e, std::vector<float>(8, 2.0f));
  EXPECT_EQ(s.den, Ramp(8, 0.5f));
  EXPECT_TRUE(s.frozen);
  WorkerState t;
  t.x = Ramp(8, 5.0f);
  ASSERT_TRUE(LoadWorkerStateResized(paths, 1, 8, &t).ok());
  EXPECT_EQ(t.mbar, Ramp(8, 10.0f));
  std::filesystem::remove(paths[2]);
  EXPECT_THAT(std::string(LoadWorkerStateResized(paths, 0, 8, &t).message()), HasSubstr(paths[2]));
}

OptimizerOptions OptionsOf(OptimizerKind kind, ReplyMode reply = ReplyMode::kMomentum) {
  OptimizerOptions o;
  o.kind = kind;
  o.reply = reply;
  return o;
}

// A zero-one-adam worker between two synchronisations: its local x, its own
// m, x_sync and the learning rates since the sync; v is gone (frozen).
WorkerState ZeroOneLocalState(size_t d) {
  WorkerState w;
  w.x = Ramp(d, 1.0f);
  w.mbar = Ramp(d, -2.0f);
  w.e = Ramp(d, 3.5f);
  w.den = Ramp(d, 0.125f);
  w.x_sync = Ramp(d, 0.5f);
  // Not a short decimal: six significant digits would read back as
  // another float.
  w.lrs = 0.123456789f;
  w.frozen = true;
  return w;
}

TEST(OptimizerState, AZeroOneAdamWorkerRestoresItsLocalModelSyncCopyAndLearningRates) {
  const std::string dir = TempRoot("zero_one");
  const OptimizerOptions o = OptionsOf(OptimizerKind::kZeroOneAdam);
  // Every rank keeps its x and m (its own between syncs); onebit-adam's
  // rank 1 neither.
  const WorkerFileOmits omit = WorkerOmits(o, 1);
  EXPECT_FALSE(omit.x);
  EXPECT_FALSE(omit.mbar);
  EXPECT_FALSE(omit.den);
  EXPECT_TRUE(WorkerOmits(OptionsOf(OptimizerKind::kOnebitAdam), 1).x);
  EXPECT_TRUE(WorkerOmits(OptionsOf(OptimizerKind::kOnebitAdam), 1).mbar);
  // diloco's every rank keeps its local model and its inner AdamW's m.
  EXPECT_FALSE(WorkerOmits(OptionsOf(OptimizerKind::kDiloco), 1).x);
  EXPECT_FALSE(WorkerOmits(OptionsOf(OptimizerKind::kDiloco), 1).mbar);

  const WorkerState w = ZeroOneLocalState(500);
  WorkerState copy = w;
  ASSERT_TRUE(SaveWorkerState(std::move(copy), 1, 9, 500).WriteTo(dir, "worker-1.state").ok());
  auto r = StateReader::Open(dir + "/worker-1.state");
  ASSERT_TRUE(r.ok()) << r.status();
  WorkerState back;
  back.x = Ramp(500, 9.0f);  // the master from the servers: the file's local x wins
  absl::Status loaded = LoadWorkerState(*r, 500, &back);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(back.x, w.x);
  EXPECT_EQ(back.mbar, w.mbar);
  EXPECT_EQ(back.e, w.e);
  EXPECT_EQ(back.den, w.den);
  EXPECT_EQ(back.x_sync, w.x_sync);
  EXPECT_TRUE(back.v.empty());
  EXPECT_EQ(back.lrs, 0.123456789f);
  EXPECT_TRUE(back.frozen);
  EXPECT_TRUE(CheckWorkerStateFits(o, 500, back).ok());

  // Before the freeze: v instead of x_sync, and no lrs.
  WorkerState warm = ZeroOneLocalState(64);
  warm.frozen = false;
  warm.x_sync.clear();
  warm.v = Ramp(64, 7.0f);
  copy = warm;
  ASSERT_TRUE(SaveWorkerState(std::move(copy), 0, 3, 64).WriteTo(dir, "worker-0.state").ok());
  r = StateReader::Open(dir + "/worker-0.state");
  ASSERT_TRUE(r.ok()) << r.status();
  WorkerState warm_back;
  warm_back.x = Ramp(64, 9.0f);
  ASSERT_TRUE(LoadWorkerState(*r, 64, &warm_back).ok());
  EXPECT_EQ(warm_back.v, warm.v);
  EXPECT_EQ(warm_back.x, warm.x);
  EXPECT_TRUE(warm_back.x_sync.empty());
  EXPECT_FALSE(warm_back.frozen);
  EXPECT_TRUE(CheckWorkerStateFits(o, 64, warm_back).ok());
  // The same arrays are wrong for the other phase.
  warm_back.frozen = true;
  EXPECT_THAT(std::string(CheckWorkerStateFits(o, 64, warm_back).message()),
              HasSubstr("has 64 floats of 'v' where 0 fit, lacks 'x_sync' (64 floats)"));
}

TEST(OptimizerState, AWorkerFileLackingAnArrayOrValueItsOptimizerHoldsIsRefusedByName) {
  const std::string dir = TempRoot("zero_one_missing");
  const OptimizerOptions o = OptionsOf(OptimizerKind::kZeroOneAdam);
  // Written without x_sync (as a build that did not save it would).
  WorkerState w = ZeroOneLocalState(100);
  w.x_sync.clear();
  ASSERT_TRUE(SaveWorkerState(std::move(w), 2, 9, 100).WriteTo(dir, "worker-2.state").ok());
  auto r = StateReader::Open(dir + "/worker-2.state");
  ASSERT_TRUE(r.ok()) << r.status();
  WorkerState back;
  back.x = Ramp(100, 9.0f);
  ASSERT_TRUE(LoadWorkerState(*r, 100, &back).ok());
  absl::Status st = CheckWorkerStateFits(o, 100, back);
  EXPECT_THAT(std::string(st.message()), HasSubstr("lacks 'x_sync' (100 floats)"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("zero-one-adam"));

  // x_sync without the learning rates since the sync.
  checkpoint::StateHeader h;
  h.set_step(9);
  h.set_role("worker");
  h.set_rank(2);
  h.set_end(100);
  StateWriter no_lrs(h);
  for (const char* name : {"x", "mbar", "e", "den", "x_sync"}) no_lrs.AddFloats(name, Ramp(100, 1));
  no_lrs.SetValue("frozen", "1");
  ASSERT_TRUE(no_lrs.WriteTo(dir, "no-lrs.state").ok());
  r = StateReader::Open(dir + "/no-lrs.state");
  ASSERT_TRUE(r.ok()) << r.status();
  st = LoadWorkerState(*r, 100, &back);
  EXPECT_THAT(std::string(st.message()), HasSubstr(dir + "/no-lrs.state has no value 'lrs'"));

  // x_sync of another size.
  StateWriter short_sync(h);
  for (const char* name : {"x", "mbar", "e", "den"}) short_sync.AddFloats(name, Ramp(100, 1));
  short_sync.AddFloats("x_sync", Ramp(99, 1));
  short_sync.SetValue("frozen", "1");
  short_sync.SetValue("lrs", "0.5");
  ASSERT_TRUE(short_sync.WriteTo(dir, "short.state").ok());
  r = StateReader::Open(dir + "/short.state");
  ASSERT_TRUE(r.ok()) << r.status();
  st = LoadWorkerState(*r, 100, &back);
  EXPECT_THAT(std::string(st.message()), HasSubstr(dir + "/short.state"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("x_sync"));

  // onebit-lamb's workers step by den after the freeze with momentum
  // replies only.
  WorkerState lamb;
  lamb.x = Ramp(10, 0);
  lamb.mbar = Ramp(10, 1);
  lamb.e = Ramp(10, 2);
  lamb.frozen = true;
  EXPECT_TRUE(
      CheckWorkerStateFits(OptionsOf(OptimizerKind::kOnebitLamb, ReplyMode::kDelta), 10, lamb)
          .ok());
  EXPECT_THAT(
      std::string(CheckWorkerStateFits(OptionsOf(OptimizerKind::kOnebitLamb), 10, lamb).message()),
      HasSubstr("lacks 'den' (10 floats)"));
}

// onebit-lamb's shards: [0, 100) with layers [0, 40) and [40, 100), and
// [100, 160) with one layer. Their ratios and factors restore by global
// position, onto other aligned boundaries too.
ServerShardState LambShard(uint32_t shard, uint64_t begin, uint64_t n,
                           std::vector<std::pair<uint64_t, uint64_t>> layers,
                           std::vector<float> coeff, std::vector<float> factor) {
  ServerShardState s = Shard(shard, begin, n, 12);
  s.layers = std::move(layers);
  s.lamb_coeff = std::move(coeff);
  s.lamb_factor = std::move(factor);
  return s;
}

TEST(OptimizerState, LambLayerValuesRestoreByGlobalPositionOntoOtherShards) {
  const std::string dir = TempRoot("lamb");
  const ServerShardState a =
      LambShard(0, 0, 100, {{0, 40}, {40, 100}}, {1.5f, 2.25f}, {0.75f, 1.125f});
  const ServerShardState b = LambShard(1, 100, 60, {{0, 60}}, {3.5f}, {0.5f});
  ASSERT_TRUE(SaveServerShard(a).WriteTo(dir, "server-0.state").ok());
  ASSERT_TRUE(SaveServerShard(b).WriteTo(dir, "server-1.state").ok());
  auto ra = StateReader::Open(dir + "/server-0.state");
  auto rb = StateReader::Open(dir + "/server-1.state");
  ASSERT_TRUE(ra.ok() && rb.ok());

  ServerShardState same;
  ASSERT_TRUE(LoadServerShard({&*rb, &*ra}, 0, 100, &same).ok());
  EXPECT_EQ(same.layers, a.layers);
  EXPECT_EQ(same.lamb_coeff, a.lamb_coeff);
  EXPECT_EQ(same.lamb_factor, a.lamb_factor);
  EXPECT_EQ(same.v, a.v);  // the v that moves after the freeze
  EXPECT_EQ(same.den, a.den);

  // [40, 160): the second layer of one file, then the other file's.
  ServerShardState moved;
  ASSERT_TRUE(LoadServerShard({&*ra, &*rb}, 40, 160, &moved).ok());
  const std::vector<std::pair<uint64_t, uint64_t>> want = {{0, 60}, {60, 120}};
  EXPECT_EQ(moved.layers, want);
  EXPECT_EQ(moved.lamb_coeff, (std::vector<float>{2.25f, 3.5f}));
  EXPECT_EQ(moved.lamb_factor, (std::vector<float>{1.125f, 0.5f}));

  // A boundary inside a layer, or a file without the layers: refused.
  ServerShardState untouched = a;
  absl::Status st = LoadServerShard({&*ra, &*rb}, 0, 120, &untouched);
  EXPECT_THAT(std::string(st.message()), HasSubstr("layer [100, 160), which crosses the shard"));
  EXPECT_EQ(untouched.lamb_coeff, a.lamb_coeff);
  ASSERT_TRUE(SaveServerShard(Shard(1, 100, 60, 12)).WriteTo(dir, "plain.state").ok());
  auto plain = StateReader::Open(dir + "/plain.state");
  ASSERT_TRUE(plain.ok());
  st = LoadServerShard({&*ra, &*plain}, 0, 160, &untouched);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("server 1's state file lacks 'layers' where server 0's does not"));
}

StateWriter Small(uint64_t step) {
  checkpoint::StateHeader h;
  h.set_step(step);
  StateWriter w(h);
  w.AddFloats("x", Ramp(64, static_cast<float>(step)));
  return w;
}

TEST(AsyncStateWriter, WritesBesideTheCallerInOrderAndReportsFailuresByPath) {
  const std::string dir = TempRoot("async");
  absl::Mutex mu;
  std::vector<std::pair<uint64_t, std::string>> done;
  {
    AsyncStateWriter writer([&](uint64_t step, const absl::StatusOr<WrittenFile>& f) {
      absl::MutexLock l(&mu);
      done.emplace_back(step, f.ok() ? f->name : std::string(f.status().message()));
    });
    for (uint64_t step : {5, 10, 15}) {
      writer.Submit(step, Small(step), dir, absl::StrCat("s", step));
    }
    writer.Submit(20, Small(20), dir + "/no/such/folder", "s20");
    writer.Flush();
    absl::MutexLock l(&mu);
    ASSERT_EQ(done.size(), 4u);
    EXPECT_EQ(done[0], std::make_pair(uint64_t{5}, std::string("s5")));
    EXPECT_EQ(done[2], std::make_pair(uint64_t{15}, std::string("s15")));
    EXPECT_EQ(done[3].first, 20u);
    EXPECT_THAT(done[3].second, HasSubstr(dir + "/no/such/folder/s20.tmp"));
  }
  for (uint64_t step : {5, 10, 15}) {
    auto r = StateReader::Open(absl::StrCat(dir, "/s", step));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->Floats("x").value(), Ramp(64, static_cast<float>(step)));
  }
}

TEST(AsyncStateWriter, AThirdSnapshotWaitsForTheFirstToBeWritten) {
  const std::string dir = TempRoot("bounded");
  absl::Notification release;
  AsyncStateWriter writer([&](uint64_t step, const absl::StatusOr<WrittenFile>&) {
    if (step == 1) release.WaitForNotification();
  });
  writer.Submit(1, Small(1), dir, "a");  // being written, held in `done`
  writer.Submit(2, Small(2), dir, "b");  // queued
  std::atomic<bool> third{false};
  std::thread t([&] {
    writer.Submit(3, Small(3), dir, "c");
    third = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(third.load());
  release.Notify();
  t.join();
  EXPECT_TRUE(third.load());
  writer.Flush();
  EXPECT_TRUE(StateReader::Open(dir + "/c").ok());
}

}  // namespace
}  // namespace onebit
