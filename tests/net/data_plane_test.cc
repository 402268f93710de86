// The data plane (net/data_plane.h): header validation, where each refusal
// names its problem; parsing of arbitrary bytes; chunking of the shards.
#include "net/data_plane.h"

#include <sys/mman.h>

#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "compress/codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "security/curve.h"
#include "shard/shard_map.h"

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
  // A STATE_PULL from any rank asks for fp32 state and carries nothing.
  data::Header state = Good();
  state.set_kind(data::STATE_PULL);
  state.set_codec(fp32_->name());
  state.set_payload_bytes(0);
  EXPECT_TRUE(Check(state, 0).ok()) << Check(state, 0);
  state.set_payload_bytes(512);
  EXPECT_THAT(std::string(Check(state, 512).message()), HasSubstr("wrong payload length 512"));
  state.set_kind(data::STATE);
  state.set_payload_bytes(0);
  EXPECT_THAT(std::string(Check(state, 0).message()), HasSubstr("unexpected message kind STATE"));
  // A STATE_PUSH carries one fp32 array of the chunk, from rank 0 only.
  data::Header seed = init;
  seed.set_kind(data::STATE_PUSH);
  seed.add_arrays("m");
  EXPECT_TRUE(Check(seed, 512).ok()) << Check(seed, 512);
  EXPECT_THAT(std::string(Check(seed, 256).message()), HasSubstr("frame has 256"));
  seed.set_rank(1);
  EXPECT_THAT(std::string(Check(seed, 512).message()),
              HasSubstr("STATE_PUSH from rank 1 (only rank 0 seeds the optimizer state)"));
  // A VOTE is a header for chunk 0 of shard 0 (this server owns shard 1).
  data::Header vote = state;
  vote.set_kind(data::VOTE);
  vote.set_payload_bytes(0);
  EXPECT_THAT(std::string(Check(vote, 0).message()),
              HasSubstr("VOTE for shard 1 at element 640 (votes name chunk 0 of shard 0)"));
  vote.set_shard(0);
  vote.set_begin(0);
  EXPECT_TRUE(Check(vote, 0, /*shard=*/0).ok()) << Check(vote, 0, 0);
  // A GRAD_SCALE is a header for chunk 0 of the server's shard, its factor
  // finite and >= 0; only an fp32 PUSH may wait for one.
  data::Header scale = vote;
  scale.set_kind(data::GRAD_SCALE);
  scale.set_grad_scale(0.25f);
  EXPECT_TRUE(Check(scale, 0, /*shard=*/0).ok()) << Check(scale, 0, 0);
  scale.set_grad_scale(-1.0f);
  EXPECT_THAT(std::string(Check(scale, 0, 0).message()),
              HasSubstr("gradient scale -1 (want finite, >= 0)"));
  data::Header pending = Good();
  pending.set_scale_pending(true);
  EXPECT_THAT(std::string(Check(pending).message()),
              HasSubstr("scale_pending on a PUSH of codec 'fp16' (only an fp32 PUSH can wait"));
  seed.set_rank(0);
  seed.set_kind(data::STATE_TAKEN);
  EXPECT_THAT(std::string(Check(seed, 512).message()),
              HasSubstr("unexpected message kind STATE_TAKEN"));
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

TEST_F(DataHeader, AWorkersConnectionsEachPassUpToTheJobsCount) {
  job_.connections = 3;
  const data::Header h = Good();
  std::set<std::string> ids;
  for (uint32_t c = 0; c < 3; ++c) {
    const std::string id = WorkerIdentity(job_.job_id, 2, c);
    ids.insert(id);
    EXPECT_TRUE(ValidateRequest(h, job_, 1, id, 256).ok()) << "connection " << c;
    // Another rank's connection c is not rank 2's.
    EXPECT_THAT(
        std::string(ValidateRequest(h, job_, 1, WorkerIdentity(job_.job_id, 1, c), 256).message()),
        HasSubstr("claimed by a socket"));
  }
  EXPECT_EQ(ids.size(), 3u);
  EXPECT_EQ(WorkerIdentity(job_.job_id, 2), WorkerIdentity(job_.job_id, 2, 0));
  // One more than the job has, and one of a job with a single connection.
  EXPECT_THAT(
      std::string(ValidateRequest(h, job_, 1, WorkerIdentity(job_.job_id, 2, 3), 256).message()),
      HasSubstr("claimed by a socket"));
  // Ids that only look like a connection of rank 2.
  const std::string job_part = WorkerIdentity(job_.job_id, 2).substr(2);  // "-<job>"
  for (const std::string& fake : {"w2.01" + job_part, "w2.+1" + job_part, "w2.x" + job_part,
                                  "w2.99999999999" + job_part, "w2." + job_part}) {
    EXPECT_THAT(std::string(ValidateRequest(h, job_, 1, fake, 256).message()),
                HasSubstr("claimed by a socket"))
        << fake;
  }
  job_.connections = 1;
  EXPECT_THAT(
      std::string(ValidateRequest(h, job_, 1, WorkerIdentity(job_.job_id, 2, 1), 256).message()),
      HasSubstr("claimed by a socket"));
  EXPECT_EQ(ChunkConnection(0, 3), 0u);
  EXPECT_EQ(ChunkConnection(4, 3), 1u);
  EXPECT_EQ(ChunkConnection(5, 1), 0u);
  EXPECT_EQ(DataConnectionsFor(0), 1u);
  EXPECT_EQ(DataConnectionsFor(4), 4u);
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

// A compressed step's pushes are cut by its own grid (push_chunk_elems);
// INIT, PULL and the state messages keep the warm-up's.
TEST_F(DataHeader, PushesFollowTheStepsGridEverythingElseTheWarmupGrid) {
  job_.push_chunk_elems = 320;  // shard 1 [512, 1000): [512, 832), [832, 1000)
  data::Header push = Good();
  push.set_begin(832);
  push.set_count(168);
  push.set_payload_bytes(336);
  EXPECT_TRUE(Check(push, 336).ok()) << Check(push, 336);
  // The warm-up grid's chunk [640, 768) is not one of this step's.
  EXPECT_THAT(std::string(Check(Good()).message()),
              HasSubstr("element range begins at 640, not at a chunk of shard 1 [512, 1000) with "
                        "chunks of 320"));
  data::Header wrong = push;
  wrong.set_begin(512);  // [512, 832) has 320
  EXPECT_THAT(std::string(Check(wrong, 336).message()),
              HasSubstr("wrong element count 168 for chunk 0 of shard 1 (want 320)"));
  data::Header pull = Good();
  pull.set_kind(data::PULL);
  pull.set_codec(fp32_->name());
  pull.set_payload_bytes(0);
  EXPECT_TRUE(Check(pull, 0).ok()) << Check(pull, 0);  // [640, 768): the warm-up's grid
  pull.set_begin(832);
  pull.set_count(168);
  EXPECT_THAT(std::string(Check(pull, 0).message()), HasSubstr("with chunks of 128"));
}

// --compressed_chunk_elems 0: a quarter of the largest shard, at least
// 512 Ki elements and the warm-up's chunk, at most the shard, and no wider
// on the wire than an fp32 chunk of the warm-up's; a set value is kept.
TEST(DataChunks, CompressedStepsHaveCoarserChunksWithinTheFrameOfAWarmupChunk) {
  const CodecOptions b2048{2048};
  auto onebit = *NewCodec("onebit", b2048);
  auto fp16 = *NewCodec("fp16", b2048);
  auto fp32 = *NewCodec("fp32", b2048);
  // The GPT example on 2 servers: shards of 69 632 and 67 328; warm-up
  // chunks of 16 Ki (4 + 5 per step), one 1-bit chunk per shard.
  auto gpt = *ShardMap::Create(136960, 2, 2048);
  ASSERT_EQ(ChunkElemsFor(0, gpt), 16384u);
  EXPECT_EQ(CompressedChunkElemsFor(0, 16384, gpt, *onebit), 69632u);
  // 25 M on 4 servers (shards of 6 291 456): warm-up chunks of 786 432, a
  // quarter of the shard is 1 572 864.
  auto big = *ShardMap::Create(25165824, 4, 2048);
  ASSERT_EQ(ChunkElemsFor(0, big), 786432u);
  EXPECT_EQ(CompressedChunkElemsFor(0, 786432, big, *onebit), 1572864u);
  // 8 M on 1 server: a quarter is 2 Mi, above what fits a 64 KB warm-up
  // chunk's frame: 1-bit payloads of 16 Ki elements take 2048 + 32 bytes,
  // so 31 of them (507 904 elements) fit 65 536 bytes.
  auto one = *ShardMap::Create(8 << 20, 1, 2048);
  EXPECT_EQ(CompressedChunkElemsFor(0, 16384, one, *onebit), 507904u);
  EXPECT_LE(onebit->EncodedSize(507904), 4u * 16384);
  // fp16 is half of fp32: twice the warm-up chunk; fp32 the same.
  EXPECT_EQ(CompressedChunkElemsFor(0, 786432, big, *fp16), 1572864u);
  EXPECT_EQ(CompressedChunkElemsFor(0, 16384, one, *fp16), 32768u);
  EXPECT_EQ(CompressedChunkElemsFor(0, 16384, one, *fp32), 16384u);
  // Never smaller than the warm-up's chunk: the mlp's shards are smaller.
  auto mlp = *ShardMap::Create(235146, 2, 2048);
  EXPECT_EQ(CompressedChunkElemsFor(0, 1 << 20, mlp, *onebit), uint64_t{1} << 20);
  // Rounded up to the block: a quarter of 9 973 000 is 2 493 250, and
  // 2 493 312 the next multiple of 96 (warm-up chunks of 1 048 608).
  auto ragged = *ShardMap::Create(9973000, 1, 96);
  ASSERT_EQ(ChunkElemsFor(0, ragged), 1048608u);
  EXPECT_EQ(
      CompressedChunkElemsFor(0, 1048608, ragged, *NewCodec("onebit", CodecOptions{96}).value()),
      2493312u);
  EXPECT_EQ(CompressedChunkElemsFor(4096, 16384, one, *onebit), 4096u);
  // An explicit size may be as wide as fp32: the servers take its frame.
  EXPECT_EQ(ServerFrameLimit(16384), 4u * 16384 + 4096);
  EXPECT_EQ(ServerFrameLimit(16384, 65536), 4u * 65536 + 4096);
  EXPECT_EQ(ServerFrameLimit(16384, 4096), 4u * 16384 + 4096);
}

// A worker's handshake is never restarted by ZeroMQ: on a crowded host it
// may take longer than ZeroMQ's 30 s, and 128 x 128 on 2 cores restarted
// some for minutes (docs/scale.md); the worker's step bounds end the wait.
// A server, which anyone can reach, still drops a half-done handshake.
TEST(DataSockets, AWorkerWaitsOutASlowHandshakeAServerDropsAHalfDoneOne) {
  zmq::context_t ctx;
  zmq::socket_t worker(ctx, zmq::socket_type::dealer);
  ConfigureDataSocket(&worker);
  EXPECT_EQ(worker.get(zmq::sockopt::handshake_ivl), 0);
  zmq::socket_t server(ctx, zmq::socket_type::router);
  ConfigureServerDataSocket(&server, ServerFrameLimit(1024, 0));
  EXPECT_EQ(server.get(zmq::sockopt::handshake_ivl), kServerHandshakeMs);
  // Bounded, and longer than a handshake may wait for the job's keys.
  EXPECT_GT(absl::Milliseconds(kServerHandshakeMs), kZapWait);
}

}  // namespace
}  // namespace onebit
