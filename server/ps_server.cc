#include "server/ps_server.h"

#include <algorithm>
#include <cstdio>
#include <iterator>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "zmq_addon.hpp"

namespace onebit {
namespace {

constexpr uint64_t kUpdatePiece = 16384;  // elements: 64 KB of fp32

}  // namespace

absl::StatusOr<std::unique_ptr<PsServer>> PsServer::Create(PsServerOptions options,
                                                           zmq::socket_t* socket) {
  std::unique_ptr<PsServer> s(new PsServer(std::move(options), socket));
  PsServerOptions& o = s->options_;
  CodecOptions codec_options;
  codec_options.block_size = o.job.map.block_size();
  auto push = NewCodec(o.push_codec, codec_options);
  if (!push.ok()) return push.status();
  auto reply = NewCodec("fp32", codec_options);
  if (!reply.ok()) return reply.status();
  auto rule = NewUpdateRule(o.update);
  if (!rule.ok()) return rule.status();
  s->push_codec_ = std::move(*push);
  s->reply_codec_ = std::move(*reply);
  s->rule_ = std::move(*rule);
  o.job.push_codec = s->push_codec_.get();
  o.job.init_codec = s->reply_codec_.get();
  if (o.shard >= o.job.map.num_shards()) {
    return absl::InvalidArgumentError(absl::StrCat("shard ", o.shard, " out of range"));
  }
  const Range r = o.job.map.shard(o.shard);
  s->state_.shard = o.shard;
  s->state_.begin = r.begin;
  s->state_.x.assign(r.size(), 0.0f);
  s->rule_->InitState(&s->state_);
  const uint64_t n = NumChunks(r.size(), o.job.chunk_elems);
  s->chunks_.resize(n);
  for (uint64_t i = 0; i < n; ++i) {
    Chunk& c = s->chunks_[i];
    c.range = ChunkRange(o.job.map, o.shard, o.job.chunk_elems, i);
    c.acc.assign(c.range.size(), 0.0f);
    c.pushed.assign(o.job.workers, false);
    c.held.resize(o.job.workers);
  }
  s->delta_.resize(std::min<uint64_t>(o.job.chunk_elems, r.size()));
  // An empty shard has nothing to aggregate: it is done from the start.
  if (n == 0) s->state_.step = o.job.steps;
  return s;
}

PsServer::PsServer(PsServerOptions options, zmq::socket_t* socket)
    : options_(std::move(options)), socket_(socket) {}

absl::Status PsServer::Serve(const std::function<bool()>& should_stop,
                             const std::function<void()>& on_finished) {
  while (true) {
    if (!failure_.ok()) return failure_;
    if (finished() && !reported_finished_) {
      reported_finished_ = true;
      on_finished();
    }
    if (should_stop()) return absl::OkStatus();
    zmq::pollitem_t item{socket_->handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(50));
    // Drain what has arrived; bounded so timeouts and stop are still checked.
    for (int i = 0; i < 1024 && failure_.ok(); ++i) {
      std::vector<zmq::message_t> frames;
      auto got =
          zmq::recv_multipart(*socket_, std::back_inserter(frames), zmq::recv_flags::dontwait);
      if (!got) break;
      HandleMessage(frames);
    }
    if (step_started_ && absl::Now() - *step_started_ > options_.step_timeout) {
      const std::string msg = absl::StrCat(
          "shard ", options_.shard, " step ", state_.step, ": no push from ", MissingRanks(),
          " within --step-timeout=", absl::FormatDuration(options_.step_timeout));
      // Tell the workers that did push, so they fail with the reason.
      for (uint32_t r = 0; r < options_.job.workers; ++r) {
        bool pushed = false;
        for (const Chunk& c : chunks_) pushed |= c.done || c.pushed[r];
        if (pushed) SendError(WorkerIdentity(options_.job.job_id, r), nullptr, msg);
      }
      return absl::DeadlineExceededError(msg);
    }
  }
}

std::string PsServer::MissingRanks() const {
  std::vector<uint32_t> missing;
  for (uint32_t r = 0; r < options_.job.workers; ++r) {
    bool all = true;
    for (const Chunk& c : chunks_) all &= c.done || c.pushed[r];
    if (!all) missing.push_back(r);
  }
  return absl::StrCat(missing.size() == 1 ? "rank " : "ranks ", absl::StrJoin(missing, ", "));
}

void PsServer::HandleMessage(std::vector<zmq::message_t>& frames) {
  const std::string routing_id = frames[0].to_string();
  if (frames.size() < 2) {
    SendError(routing_id, nullptr, "empty message (want header and payload frames)");
    return;
  }
  auto header = ParseHeader(frames[1].data(), frames[1].size());
  if (!header.ok()) {
    SendError(routing_id, nullptr, std::string(header.status().message()));
    return;
  }
  if (frames.size() != 3) {
    SendError(routing_id, &*header,
              absl::StrCat("expected 2 frames (header, payload), got ", frames.size() - 1));
    return;
  }
  absl::Status st =
      ValidateRequest(*header, options_.job, options_.shard, routing_id, frames[2].size());
  if (st.ok()) st = HandleRequest(routing_id, *header, frames[2]);
  if (!st.ok()) SendError(routing_id, &*header, std::string(st.message()));
}

absl::Status PsServer::HandleRequest(const std::string& routing_id, const data::Header& h,
                                     zmq::message_t& payload) {
  (void)routing_id;  // ValidateRequest tied it to h.rank()
  const uint64_t index = (h.begin() - state_.begin) / options_.job.chunk_elems;
  Chunk& c = chunks_[index];
  const uint64_t steps = options_.job.steps;
  if (h.kind() == data::INIT) {
    if (h.step() != 0) return absl::InvalidArgumentError("INIT must carry step 0");
    if (state_.step > 0 || c.done) {
      return absl::InvalidArgumentError(
          absl::StrCat("INIT is from the past (shard ", options_.shard, " is past step 0)"));
    }
    if (c.initialized) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate INIT for chunk ", index));
    }
    absl::Status st = reply_codec_->Decode(static_cast<const uint8_t*>(payload.data()), h.count(),
                                           state_.x.data() + (h.begin() - state_.begin));
    if (!st.ok())
      return absl::InvalidArgumentError(absl::StrCat("bad INIT payload: ", st.message()));
    c.initialized = true;
    return DrainInOrder(c, index);
  }
  if (h.step() >= steps) {
    return absl::InvalidArgumentError(absl::StrCat("step ", h.step(),
                                                   " is from the future: beyond the job's last "
                                                   "step ",
                                                   steps - 1));
  }
  if (h.step() < state_.step) {
    return absl::InvalidArgumentError(absl::StrCat("step ", h.step(), " is from the past (shard ",
                                                   options_.shard, " is at step ", state_.step,
                                                   ")"));
  }
  if (h.step() > state_.step) {
    return absl::InvalidArgumentError(absl::StrCat("step ", h.step(), " is from the future (shard ",
                                                   options_.shard, " is at step ", state_.step,
                                                   ")"));
  }
  if (c.pushed[h.rank()] || c.done) {
    return absl::InvalidArgumentError(absl::StrCat("duplicate push from rank ", h.rank(),
                                                   " for chunk ", index, " of step ", h.step()));
  }
  c.pushed[h.rank()] = true;
  c.held[h.rank()] = std::move(payload);
  if (!step_started_) step_started_ = absl::Now();
  return DrainInOrder(c, index);
}

absl::Status PsServer::DrainInOrder(Chunk& c, uint64_t index) {
  const uint32_t n_workers = options_.job.workers;
  const float w = 1.0f / static_cast<float>(n_workers);
  while (c.next_rank < n_workers && c.held[c.next_rank]) {
    const uint32_t r = c.next_rank;
    zmq::message_t& m = *c.held[r];
    // acc starts at +0.0f; zeroed here rather than at the end of the step so
    // it is in cache for the decode-add.
    if (r == 0) std::fill(c.acc.begin(), c.acc.end(), 0.0f);
    absl::Status st = push_codec_->DecodeAdd(static_cast<const uint8_t*>(m.data()), c.range.size(),
                                             w, c.acc.data());
    c.held[r].reset();
    if (!st.ok()) {
      // The codec left acc untouched; rank r may push this chunk again.
      c.pushed[r] = false;
      const std::string why = absl::StrCat("payload of rank ", r, " for chunk ", index, " of step ",
                                           state_.step, " does not decode: ", st.message());
      data::Header h;
      h.set_rank(r);
      h.set_step(state_.step);
      h.set_shard(options_.shard);
      h.set_begin(c.range.begin);
      h.set_count(c.range.size());
      SendError(WorkerIdentity(options_.job.job_id, r), &h, why);
      return absl::OkStatus();
    }
    ++c.next_rank;
  }
  if (c.next_rank == n_workers && (c.initialized || state_.step > 0)) Complete(c, index);
  return absl::OkStatus();
}

void PsServer::Complete(Chunk& c, uint64_t index) {
  const uint64_t pushed_ns = MonotonicNs();
  const uint64_t n = c.range.size();
  const size_t bytes = reply_codec_->EncodedSize(n);
  if (c.reply == nullptr || c.reply.use_count() > 1 || c.reply->size() != bytes) {
    c.reply = std::make_shared<std::vector<uint8_t>>(bytes);
  }
  // Update and encode in pieces that stay in L2. fp32 encodes element by
  // element, so the pieces' encodings concatenate to the chunk's.
  const uint64_t piece = reply_codec_->kind() == CodecKind::kFp32 ? kUpdatePiece : n;
  absl::Status st;
  for (uint64_t off = 0; off < n && st.ok(); off += piece) {
    const uint64_t m = std::min(piece, n - off);
    rule_->Apply(c.acc.data() + off, c.range.begin - state_.begin + off, m, &state_, delta_.data());
    st = reply_codec_->Encode(delta_.data(), m, c.reply->data() + off * sizeof(float));
  }
  if (!st.ok()) {
    failure_ = absl::InternalError(absl::StrCat("the update of shard ", options_.shard, " chunk ",
                                                index, " at step ", state_.step,
                                                " is not finite (diverged?): ", st.message()));
    return;
  }
  const SharedBytes shared = c.reply;
  data::Header h;
  h.set_version(kProtocolVersion);
  h.set_job_id(options_.job.job_id);
  h.set_kind(data::REPLY);
  h.set_step(state_.step);
  h.set_shard(options_.shard);
  h.set_begin(c.range.begin);
  h.set_count(n);
  h.set_codec(reply_codec_->name());
  h.set_block_size(options_.job.map.block_size());
  h.set_payload_bytes(shared->size());
  h.set_pushed_ns(pushed_ns);
  for (uint32_t r = 0; r < options_.job.workers; ++r) {
    h.set_rank(r);
    h.set_sent_ns(MonotonicNs());
    zmq::message_t payload = ShareFrame(shared, 0, shared->size());
    Send(WorkerIdentity(options_.job.job_id, r), h, &payload);
  }
  c.done = true;
  if (++chunks_done_ < chunks_.size()) return;
  // Every chunk of the shard is done: the step is over.
  ++state_.step;
  chunks_done_ = 0;
  step_started_.reset();
  for (Chunk& ch : chunks_) {
    ch.next_rank = 0;
    std::fill(ch.pushed.begin(), ch.pushed.end(), false);
    ch.done = false;
  }
}

void PsServer::SendError(const std::string& routing_id, const data::Header* request,
                         const std::string& error) {
  data::Header h;
  if (request != nullptr) {
    h.set_rank(request->rank());
    h.set_step(request->step());
    h.set_shard(request->shard());
    h.set_begin(request->begin());
    h.set_count(request->count());
  }
  h.set_version(kProtocolVersion);
  h.set_job_id(options_.job.job_id);
  h.set_kind(data::ERROR);
  h.set_error(error);
  std::fprintf(stderr, "server %u: refused a request from '%s': %s\n", options_.shard,
               absl::CHexEscape(routing_id).c_str(), error.c_str());
  zmq::message_t empty;
  Send(routing_id, h, &empty);
}

void PsServer::Send(const std::string& routing_id, const data::Header& h, zmq::message_t* payload) {
  try {
    socket_->send(CopyFrame(routing_id), zmq::send_flags::sndmore);
    socket_->send(CopyFrame(h.SerializeAsString()), zmq::send_flags::sndmore);
    socket_->send(*payload, zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    // ROUTER_MANDATORY: the peer is gone. Its rank's absence surfaces as a
    // step timeout; nothing else to do here.
    std::fprintf(stderr, "server %u: cannot reply to '%s': %s\n", options_.shard,
                 absl::CHexEscape(routing_id).c_str(), e.what());
  }
}

}  // namespace onebit
