// A server's checks of a data-plane request (net/data_plane.h): ParseHeader
// of frame 0, then ValidateRequest against a small fixed job with the
// payload frame's size, then what the server does with a request it
// accepted (server/ps_server.cc): the chunk it names lies inside the owned
// shard, and its payload decodes (PUSH: DecodeAdd into the chunk's
// accumulator; INIT: Decode into the shard's x) without a read or write
// outside the frame and the chunk.
//
// Input: a byte of flags (bits 0-1: the job, kJobs; bits 2-3: the shard this
// server owns, modulo the job's shards; bit 4: the routing id comes from the
// input, else it is the header's rank's own), the header (length-prefixed),
// the routing id (length-prefixed, with bit 4), then the payload frame.
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "compress/codec.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/fuzz_target.h"
#include "google/protobuf/stubs/logging.h"
#include "net/data_plane.h"

namespace onebit {
namespace {

constexpr uint64_t kJobId = 0x5eedf00d12345678;

struct JobSpec {
  const char* push_codec;
  uint32_t workers;
  uint64_t params;
  uint32_t shards;
  uint64_t chunk_elems;
  uint64_t push_chunk_elems;  // a compressed step's grid (0: chunk_elems)
};
// Block size 64 throughout. The third has more shards than blocks: shards 2
// and 3 are empty. The last is at a compressed step, whose pushes have
// chunks of their own.
constexpr JobSpec kJobs[] = {
    {"onebit", 3, 1000, 2, 128, 0},
    {"fp16", 1, 1000, 3, 64, 0},
    {"fp32", 2, 100, 4, 64, 0},
    {"onebit", 2, 1000, 2, 128, 320},
};
constexpr size_t kNumJobs = sizeof(kJobs) / sizeof(kJobs[0]);
constexpr uint32_t kBlock = 64;

struct Job {
  std::unique_ptr<const Codec> push, init;
  DataPlaneJob job;
};

const Job& GetJob(size_t i) {
  static const std::vector<Job>* jobs = [] {
    auto* v = new std::vector<Job>;
    for (const JobSpec& s : kJobs) {
      Job j;
      j.push = *NewCodec(s.push_codec, CodecOptions{kBlock});
      j.init = *NewCodec("fp32");
      j.job.job_id = kJobId;
      j.job.workers = s.workers;
      j.job.steps = 10;
      j.job.map = *ShardMap::Create(s.params, s.shards, kBlock);
      j.job.chunk_elems = s.chunk_elems;
      j.job.push_chunk_elems = s.push_chunk_elems;
      j.job.push_codec = j.push.get();
      j.job.init_codec = j.init.get();
      v->push_back(std::move(j));
    }
    return v;
  }();
  return (*jobs)[i];
}

// The chunk size of a request of `kind`.
uint64_t GridOf(const DataPlaneJob& job, data::Kind kind) {
  return kind == data::PUSH && job.push_chunk_elems != 0 ? job.push_chunk_elems : job.chunk_elems;
}

// The server's handling of an accepted request, minus its state machine.
void Serve(const data::Header& h, const DataPlaneJob& job, uint32_t owned, const uint8_t* payload) {
  const Range s = job.map.shard(owned);
  FUZZ_CHECK(h.begin() >= s.begin && h.count() >= 1 && h.begin() + h.count() <= s.end);
  const uint64_t elems = GridOf(job, h.kind());
  const uint64_t index = (h.begin() - s.begin) / elems;
  FUZZ_CHECK(index < NumChunks(s.size(), elems));
  FUZZ_CHECK(ChunkRange(job.map, owned, elems, index).size() == h.count());
  if (h.kind() == data::PUSH) {
    std::vector<float> acc(h.count(), 0.0f);
    const float w = 1.0f / static_cast<float>(job.workers);
    if (job.push_codec->DecodeAdd(payload, h.count(), w, acc.data()).ok()) {
      for (float a : acc) FUZZ_CHECK(std::isfinite(a));
    }
  } else if (h.kind() == data::INIT || h.kind() == data::STATE_PUSH) {
    FUZZ_CHECK(h.rank() == 0);
    std::vector<float> x(s.size(), 0.0f);
    (void)job.init_codec->Decode(payload, h.count(), x.data() + (h.begin() - s.begin));
  } else {
    FUZZ_CHECK((h.kind() == data::PULL || h.kind() == data::STATE_PULL || h.kind() == data::VOTE) &&
               h.payload_bytes() == 0);
    if (h.kind() == data::VOTE) FUZZ_CHECK(owned == 0 && h.begin() == 0);
  }
}

struct Request {
  data::Header header;
  std::string routing_id;  // empty: the header's rank's own
  std::string payload;
};

std::string Encode(uint8_t flags, const std::string& header, const std::string& routing_id,
                   const std::string& payload) {
  fuzz::Output o;
  o.Byte(flags).Bytes(header);
  if (flags & 16) o.Bytes(routing_id);
  return o.Rest(payload).data();
}

}  // namespace

std::vector<fuzz::Seed> Seeds() {
  std::vector<fuzz::Seed> seeds;
  const std::vector<float> x(128, 0.5f);
  for (uint8_t j = 0; j < kNumJobs; ++j) {
    const DataPlaneJob& job = GetJob(j).job;
    for (uint32_t shard = 0; shard < job.map.num_shards(); ++shard) {
      const Range s = job.map.shard(shard);
      const uint8_t flags = static_cast<uint8_t>(j | (shard << 2));
      for (data::Kind kind : {data::PUSH, data::INIT, data::PULL, data::STATE_PULL,
                              data::STATE_PUSH, data::VOTE, data::GRAD_SCALE}) {
        const uint64_t elems = GridOf(job, kind);
        const uint64_t chunks = NumChunks(s.size(), elems);
        // The first chunk, and in the first and last jobs the last (short) one.
        std::vector<uint64_t> which;
        if (chunks > 0) which.push_back(0);
        if (chunks > 1 && (j == 0 || j == kNumJobs - 1)) which.push_back(chunks - 1);
        for (uint64_t c : which) {
          const Range r = ChunkRange(job.map, shard, elems, c);
          if (kind == data::VOTE && (shard != 0 || c != 0)) continue;  // votes name chunk 0 of 0
          const Codec* codec = kind == data::PUSH ? job.push_codec : job.init_codec;
          data::Header h;
          h.set_version(kProtocolVersion);
          h.set_job_id(kJobId);
          h.set_kind(kind);
          h.set_rank(kind == data::PUSH ? job.workers - 1 : 0);
          h.set_step(kind == data::PUSH ? 3 : 0);
          h.set_shard(shard);
          h.set_begin(r.begin);
          h.set_count(r.size());
          h.set_codec(codec->name());
          h.set_block_size(kBlock);
          if (kind == data::PUSH && c == 0) h.set_lr(0.01f);
          if (kind == data::STATE_PUSH) h.add_arrays("m");
          if (kind == data::GRAD_SCALE) h.set_grad_scale(0.5f);
          std::string payload;
          if (kind == data::PUSH || kind == data::INIT || kind == data::STATE_PUSH) {
            payload.resize(codec->EncodedSize(r.size()));
            FUZZ_CHECK(
                codec->Encode(x.data(), r.size(), reinterpret_cast<uint8_t*>(&payload[0])).ok());
          }
          h.set_payload_bytes(payload.size());
          const std::string name = std::string(kJobs[j].push_codec) +
                                   (kJobs[j].push_chunk_elems != 0 ? "-compressed" : "") +
                                   "-shard" + std::to_string(shard) + "-chunk" + std::to_string(c) +
                                   "-" + data::Kind_Name(kind);
          seeds.push_back({name, Encode(flags, h.SerializeAsString(), "", payload)});
          if (j != 0 || shard != 1 || c != 0 || kind != data::PUSH) continue;
          // Each refusal once, from this good push.
          auto refused = [&](const std::string& why, auto mutate, std::string frame) {
            data::Header b = h;
            mutate(b);
            seeds.push_back({"refuse-" + why, Encode(flags, b.SerializeAsString(), "", frame)});
          };
          refused(
              "version", [](data::Header& b) { b.set_version(2); }, payload);
          refused(
              "job-id", [](data::Header& b) { b.set_job_id(1); }, payload);
          refused(
              "kind-reply", [](data::Header& b) { b.set_kind(data::REPLY); }, payload);
          refused(
              "rank", [](data::Header& b) { b.set_rank(3); }, payload);
          refused(
              "init-rank", [](data::Header& b) { b.set_kind(data::INIT); }, payload);
          refused(
              "shard-range", [](data::Header& b) { b.set_shard(2); }, payload);
          refused(
              "shard-owned", [](data::Header& b) { b.set_shard(0); }, payload);
          refused(
              "begin", [](data::Header& b) { b.set_begin(b.begin() + 1); }, payload);
          refused(
              "count", [](data::Header& b) { b.set_count(b.count() - 1); }, payload);
          refused(
              "codec", [](data::Header& b) { b.set_codec("fp32"); }, payload);
          refused(
              "block", [](data::Header& b) { b.set_block_size(32); }, payload);
          refused(
              "lr-nan", [](data::Header& b) { b.set_lr(std::nanf("")); }, payload);
          refused(
              "lr-negative", [](data::Header& b) { b.set_lr(-1.0f); }, payload);
          refused(
              "payload-header", [](data::Header& b) { b.set_payload_bytes(7); }, payload);
          refused(
              "payload-frame", [](data::Header&) {}, payload.substr(1));
          seeds.push_back({"refuse-routing-id", Encode(flags | 16, h.SerializeAsString(),
                                                       "w0-0000000000000000", payload)});
          seeds.push_back(
              {"refuse-malformed", Encode(flags, h.SerializeAsString().substr(0, 9), "", payload)});
        }
      }
    }
  }
  return seeds;
}

}  // namespace onebit

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Protobuf logs each string field that is not UTF-8 (the parse then
  // fails): a line per such input here.
  google::protobuf::SetLogHandler(nullptr);
  return onebit::fuzz::Initialize(argc, argv, onebit::Seeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace onebit;
  fuzz::Input in(data, size);
  const uint8_t flags = in.Byte();
  const DataPlaneJob& job = GetJob((flags & 3) % kNumJobs).job;
  const uint32_t owned = ((flags >> 2) & 3) % job.map.num_shards();
  const std::string frame0 = in.Bytes();
  const std::string routing = (flags & 16) ? in.Bytes() : std::string();
  const std::string frame1 = in.Rest();

  auto header = ParseHeader(frame0.data(), frame0.size());
  if (!header.ok()) {
    FUZZ_CHECK(absl::StartsWith(header.status().message(), "malformed header"));
    return 0;
  }
  const std::string id = (flags & 16) ? routing : WorkerIdentity(job.job_id, header->rank());
  // The payload frame on the heap at its exact size, as ZeroMQ hands it over.
  std::unique_ptr<uint8_t[]> payload(new uint8_t[frame1.size()]);
  if (!frame1.empty()) std::memcpy(payload.get(), frame1.data(), frame1.size());
  absl::Status st = ValidateRequest(*header, job, owned, id, frame1.size());
  if (st.ok()) {
    Serve(*header, job, owned, payload.get());
  } else {
    FUZZ_CHECK(!st.message().empty());
  }
  return 0;
}
