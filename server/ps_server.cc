#include "server/ps_server.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "security/curve.h"
#include "zmq_addon.hpp"

namespace onebit {
namespace {

// Whether a shard restored from a checkpoint holds every array a fresh one
// of its phase does (`fresh`, which this call may change), of the same
// size, and a layer-wise optimizer's values at the same layers: a
// checkpoint that lacks one is an error, never a silent zero.
absl::Status CheckRestoredFits(const ServerOptimizer& optimizer, const ServerShardState& restored,
                               ServerShardState* fresh) {
  if (restored.frozen && !fresh->frozen) optimizer.EnterCompression(fresh);
  const std::pair<const char*, std::vector<float> ServerShardState::*> arrays[] = {
      {"m", &ServerShardState::m},
      {"v", &ServerShardState::v},
      {"den", &ServerShardState::den},
      {"e", &ServerShardState::e},
      {"lamb_coeff", &ServerShardState::lamb_coeff},
      {"lamb_factor", &ServerShardState::lamb_factor}};
  std::vector<std::string> wrong;
  for (const auto& [name, field] : arrays) {
    const size_t want = (fresh->*field).size(), got = (restored.*field).size();
    if (want == 0 || got == want) continue;
    wrong.push_back(
        got == 0 ? absl::StrCat("lacks '", name, "' (", want, " floats)")
                 : absl::StrCat("has ", got, " floats of '", name, "' where ", want, " fit"));
  }
  if (restored.layers != fresh->layers) wrong.push_back("holds other layers than the shard's");
  if (wrong.empty()) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      "the checkpoint's state of shard ", restored.shard, " ", absl::StrJoin(wrong, ", "), ": ",
      OptimizerKindName(optimizer.options().kind), " keeps them",
      restored.frozen ? " in the compression phase" : " in the warm-up"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PsServer>> PsServer::Create(PsServerOptions options,
                                                           zmq::socket_t* socket) {
  std::unique_ptr<PsServer> s(new PsServer(std::move(options), socket));
  PsServerOptions& o = s->options_;
  o.optimizer.codec.block_size = o.job.map.block_size();
  auto init = NewCodec("fp32", o.optimizer.codec);
  if (!init.ok()) return init.status();
  auto optimizer = ServerOptimizer::Create(o.optimizer);
  if (!optimizer.ok()) return optimizer.status();
  s->init_codec_ = std::move(*init);
  s->optimizer_ = std::move(*optimizer);
  if (o.freeze.automatic && (!o.report_freeze_check || !o.freeze_decision)) {
    return absl::InvalidArgumentError("--freeze auto needs the coordinator's decisions");
  }
  if (o.shard >= o.job.map.num_shards()) {
    return absl::InvalidArgumentError(absl::StrCat("shard ", o.shard, " out of range"));
  }
  if (!o.sealed.empty()) {
    if (o.sealed.size() != o.job.workers) {
      return absl::InvalidArgumentError(
          absl::StrCat(o.sealed.size(), " workers' seal secrets for ", o.job.workers, " workers"));
    }
    for (uint32_t r = 0; r < o.job.workers; ++r) {
      for (uint32_t l = 0; l < o.job.connections; ++l) {
        s->seals_[WorkerIdentity(o.job.job_id, r, l)] = std::make_unique<ConnectionSeal>(
            o.sealed[r].ConnectionKey(l), SealDirection::kToWorker);
      }
    }
  }
  const Range r = o.job.map.shard(o.shard);
  s->optimizer_->InitState(o.shard, r.begin, r.size(), &s->state_);
  bool resumed = false;
  if (o.restored) {
    if (o.restored->begin != r.begin || o.restored->x.size() != r.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the restored state covers [", o.restored->begin, ", ",
                       o.restored->begin + o.restored->x.size(), "), not shard ", o.shard, "'s [",
                       r.begin, ", ", r.end, ")"));
    }
    if (o.job.steps > 0 && o.restored->step > o.job.steps) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the restored state is after ", o.restored->step, " steps; the job has ", o.job.steps));
    }
    if (absl::Status st = CheckRestoredFits(*s->optimizer_, *o.restored, &s->state_); !st.ok()) {
      return st;
    }
    s->state_ = *std::move(o.restored);
    s->state_.shard = o.shard;
    o.restored.reset();
    resumed = true;
  }
  o.job.init_codec = s->init_codec_.get();
  o.job.compressed_chunk_elems =
      CompressedChunkElemsFor(o.job.compressed_chunk_elems, o.job.chunk_elems, o.job.map,
                              s->optimizer_->push_codec(StepKind::kCompressed));
  const uint64_t n = NumChunks(r.size(), o.job.chunk_elems);
  s->slices_.resize(n);
  for (uint64_t i = 0; i < n; ++i) {
    Slice& c = s->slices_[i];
    c.range = ChunkRange(o.job.map, o.shard, o.job.chunk_elems, i);
    c.pulled.assign(o.job.workers, false);
    c.waiting.assign(o.job.workers, false);
    // A checkpoint's x needs no INIT (nor does one come: a resumed rank 0
    // pulls as the others do).
    c.initialized = resumed;
  }
  // acc only where some phase adds the pushes into it; a rule that reads
  // their mean piece by piece in both phases needs none (d floats fewer).
  if (!s->MeanInPieces(Phase::kWarmup) || !s->MeanInPieces(Phase::kCompress)) {
    s->acc_.assign(r.size(), 0.0f);
  }
  for (int g = 0; g < 2; ++g) {
    const uint64_t elems = g == 0 ? o.job.chunk_elems : o.job.compressed_chunk_elems;
    if (g == 1 && elems == o.job.chunk_elems) break;  // one grid serves both
    std::vector<Chunk>& grid = s->grids_[g];
    grid.resize(NumChunks(r.size(), elems));
    for (uint64_t i = 0; i < grid.size(); ++i) {
      Chunk& c = grid[i];
      c.range = ChunkRange(o.job.map, o.shard, elems, i);
      c.acc = s->acc_.empty() ? nullptr : s->acc_.data() + (c.range.begin - r.begin);
      c.pushed.assign(o.job.workers, false);
      c.held.resize(o.job.workers);
      c.lr.resize(o.job.workers);
      c.scale_pending.assign(o.job.workers, false);
    }
  }
  if (o.job.steps > 0) {
    s->end_step_ = o.job.steps;
    // An empty shard has nothing to aggregate: it is done from the start.
    if (n == 0) s->state_.step = o.job.steps;
  }
  s->SkipLocalSteps();
  return s;
}

PsServer::PsServer(PsServerOptions options, zmq::socket_t* socket)
    : options_(std::move(options)),
      socket_(socket),
      refusals_(absl::StrCat("server ", options_.shard)),
      metrics_(options_.metrics) {}

absl::Status PsServer::SetEndStep(uint64_t steps) {
  if (end_step_) {
    if (*end_step_ == steps) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("told the job ends after ", steps, " steps, but it has ", *end_step_));
  }
  if (slices_.empty()) state_.step = steps;
  if (state_.step != steps) {
    return absl::FailedPreconditionError(absl::StrCat("the workers finished after ", steps,
                                                      " steps, but shard ", options_.shard,
                                                      " has completed ", state_.step));
  }
  end_step_ = steps;
  return absl::OkStatus();
}

absl::Status PsServer::Serve(const std::function<bool()>& should_stop,
                             const std::function<void()>& on_finished) {
  first_step_ = state_.step;
  while (true) {
    if (!failure_.ok()) return failure_;
    if (finished() && !reported_finished_) {
      reported_finished_ = true;
      on_finished();
    }
    if (should_stop()) return absl::OkStatus();
    CompleteReady();
    if (!failure_.ok()) return failure_;
    if (waiting_since_ && absl::Now() - *waiting_since_ > options_.step_timeout) {
      return absl::DeadlineExceededError(absl::StrCat(
          "shard ", options_.shard, " step ", state_.step,
          ": no --freeze auto decision from the coordinator for the check after ",
          state_.step + 1 - options_.freeze.window,
          " steps within --step_timeout=", absl::FormatDuration(options_.step_timeout)));
    }
    zmq::pollitem_t item{socket_->handle(), 0, ZMQ_POLLIN, 0};
    PollItems(&item, 1, std::chrono::milliseconds(50));
    refusals_.Flush();
    if (metrics_ != nullptr) metrics_->SetPendingPushes(pending_pushes_);
    // Drain what has arrived; bounded so timeouts and stop are still checked.
    for (int i = 0; i < 1024 && failure_.ok(); ++i) {
      std::vector<zmq::message_t> frames;
      auto got =
          zmq::recv_multipart(*socket_, std::back_inserter(frames), zmq::recv_flags::dontwait);
      if (!got) break;
      HandleMessage(frames);
    }
    const bool starting = state_.step == first_step_;
    if (step_started_ && absl::Now() - *step_started_ >
                             (starting ? options_.startup_timeout : options_.step_timeout)) {
      const std::string msg = absl::StrCat(
          "shard ", options_.shard, " step ", state_.step, ": no push from ", MissingRanks(),
          starting ? absl::StrCat(" within ", absl::FormatDuration(options_.startup_timeout),
                                  " (the first step's bound: it carries the job's start-up)")
                   : absl::StrCat(" within --step_timeout=",
                                  absl::FormatDuration(options_.step_timeout)));
      // Tell the workers that did push, so they fail with the reason. The
      // reply names the step it is about (a header of no request says 0).
      for (uint32_t r = 0; r < options_.job.workers; ++r) {
        bool pushed = false;
        for (const Chunk& c : chunks()) pushed |= c.done || c.pushed[r];
        if (!pushed) continue;
        data::Header about;
        about.set_job_id(options_.job.job_id);
        about.set_rank(r);
        about.set_step(state_.step);
        about.set_shard(options_.shard);
        SendError(WorkerIdentity(options_.job.job_id, r), &about, msg, std::nullopt);
      }
      return absl::DeadlineExceededError(msg);
    }
  }
}

std::optional<float> PsServer::GradScaleOf(uint32_t rank) const {
  return rank < grad_scales_.size() ? grad_scales_[rank] : std::nullopt;
}

std::string PsServer::MissingRanks() const {
  std::vector<std::string> missing;
  for (uint32_t r = 0; r < options_.job.workers; ++r) {
    bool all = true, scale = false;
    for (const Chunk& c : chunks()) {
      all &= c.done || c.pushed[r];
      scale |= !c.done && c.scale_pending[r] && !GradScaleOf(r);
    }
    if (!all) missing.push_back(absl::StrCat(r));
    if (all && scale) missing.push_back(absl::StrCat(r, " (its GRAD_SCALE)"));
  }
  return absl::StrCat(missing.size() == 1 ? "rank " : "ranks ", absl::StrJoin(missing, ", "));
}

void PsServer::HandleMessage(std::vector<zmq::message_t>& frames) {
  const std::string routing_id = frames[0].to_string();
  if (!seals_.empty()) {
    // Opened before anything reads it. A connection that passed the PLAIN
    // handshake under an id of no worker cannot be answered (nothing to
    // seal with): counted and dropped.
    // The header as it came, not yet authenticated: only to name or drop.
    const auto unopened = [&frames]() -> absl::StatusOr<data::Header> {
      if (frames.size() < 2) return absl::DataLossError("no header");
      return ParseHeader(frames[1].data(), frames[1].size());
    };
    auto seal = seals_.find(routing_id);
    if (seal == seals_.end()) {
      // Most likely a worker's connection of before a roll-back (its id
      // names the old incarnation), dropped as under CURVE.
      auto header = unopened();
      if (header.ok() && DroppedAsEarlier(routing_id, *header)) return;
      if (metrics_ != nullptr) metrics_->Refused(Refusal::kBadSeal);
      refusals_.Refused(absl::StrCat("a request from '", absl::CHexEscape(routing_id),
                                     "': not a worker connection of this job"));
      return;
    }
    absl::Status opened =
        frames.size() == 4
            ? seal->second->Open(frames[1], &frames[2], frames[3])
            : absl::PermissionDeniedError(absl::StrCat("an unsealed message (", frames.size() - 1,
                                                       " frames; want header, payload and seal)"));
    if (!opened.ok()) {
      auto header = unopened();
      SendError(routing_id, header.ok() ? &*header : nullptr, std::string(opened.message()),
                Refusal::kBadSeal);
      return;
    }
    frames.pop_back();
  }
  if (frames.size() < 2) {
    SendError(routing_id, nullptr, "empty message (want header and payload frames)",
              Refusal::kMalformed);
    return;
  }
  auto header = ParseHeader(frames[1].data(), frames[1].size());
  if (!header.ok()) {
    SendError(routing_id, nullptr, std::string(header.status().message()), Refusal::kMalformed);
    return;
  }
  if (DroppedAsEarlier(routing_id, *header)) return;
  if (frames.size() != 3) {
    SendError(routing_id, &*header,
              absl::StrCat("expected 2 frames (header, payload), got ", frames.size() - 1),
              Refusal::kMalformed);
    return;
  }
  absl::Status st =
      ValidateRequest(*header, options_.job, options_.shard, routing_id, frames[2].size());
  Refusal why = header->job_id() != options_.job.job_id ? Refusal::kWrongJob : Refusal::kMalformed;
  if (st.ok() && options_.authenticated) {
    // The routing id is the sender's to choose; its key is not.
    const std::string peer = PeerUserId(frames[1]);
    if (peer != WorkerPeerId(header->rank())) {
      st = absl::PermissionDeniedError(
          absl::StrCat("rank ", header->rank(), " claimed by the key of ",
                       peer.empty() ? std::string("no worker") : peer));
      why = Refusal::kWrongKey;
    }
  }
  // Counted as the phase of the step it was taken for (before it may end it).
  const size_t bytes = frames[1].size() + frames[2].size();
  const Phase phase = PhaseOf(state_);
  if (st.ok()) {
    // Validated: one of a worker's own, so at most workers x connections.
    if (connections_seen_.insert(routing_id).second && metrics_ != nullptr) {
      metrics_->SetDataConnections(connections_seen_.size());
    }
    if (options_.peers_heard != nullptr) options_.peers_heard->Heard(header->rank());
    st = HandleRequest(routing_id, *header, frames[2], &why);
    if (st.ok() && metrics_ != nullptr && header->kind() == data::PUSH) {
      metrics_->Pushed(phase, bytes);
    }
  }
  if (!st.ok()) SendError(routing_id, &*header, std::string(st.message()), why);
}

bool PsServer::DroppedAsEarlier(const std::string& routing_id, const data::Header& h) {
  if (std::find(options_.earlier_job_ids.begin(), options_.earlier_job_ids.end(), h.job_id()) ==
      options_.earlier_job_ids.end()) {
    return false;
  }
  // Its sender has rejoined under the new id, or is gone.
  if (metrics_ != nullptr) metrics_->Refused(Refusal::kEarlierIncarnation);
  if (dropped_++ == 0) {
    std::fprintf(stderr,
                 "server %u: dropping the messages sent before the job rolled back "
                 "(first from '%s')\n",
                 options_.shard, absl::CHexEscape(routing_id).c_str());
  }
  return true;
}

absl::Status PsServer::HandleRequest(const std::string& routing_id, const data::Header& h,
                                     zmq::message_t& payload, Refusal* why) {
  (void)routing_id;  // ValidateRequest tied it to h.rank()
  // Most refusals below are of a step this shard is not at.
  *why = Refusal::kWrongStep;
  // ValidateRequest checked the range against the grid of its kind.
  const uint64_t index =
      (h.begin() - state_.begin) /
      (h.kind() == data::PUSH ? options_.job.push_chunk_elems : options_.job.chunk_elems);
  const uint64_t steps = options_.job.steps;
  if (h.kind() == data::INIT) {
    Slice& c = slices_[index];
    if (h.step() != 0) return absl::InvalidArgumentError("INIT must carry step 0");
    // (Local steps at the start, diloco's, left x as it was: still step 0's.)
    if (!StateIsOfStep(0) || ChunkAt(h.begin()).done) {
      return absl::InvalidArgumentError(
          absl::StrCat("INIT is from the past (shard ", options_.shard, " is past step 0)"));
    }
    if (c.initialized) {
      *why = Refusal::kDuplicate;
      return absl::InvalidArgumentError(absl::StrCat("duplicate INIT for chunk ", index));
    }
    absl::Status st = init_codec_->Decode(static_cast<const uint8_t*>(payload.data()), h.count(),
                                          state_.x.data() + (h.begin() - state_.begin));
    if (!st.ok()) {
      *why = Refusal::kBadPayload;
      return absl::InvalidArgumentError(absl::StrCat("bad INIT payload: ", st.message()));
    }
    c.initialized = true;
    c.state.reset();  // x changed
    for (uint32_t r = 0; r < options_.job.workers; ++r) {
      if (c.waiting[r]) SendParams(r, 0, c);
      c.waiting[r] = false;
    }
    // The pushes of step 0 that waited for x: every chunk of the step's
    // grid that overlaps this slice (a finer grid has several).
    for (size_t i = &ChunkAt(h.begin()) - chunks().data();
         i < chunks().size() && chunks()[i].range.begin < c.range.end; ++i) {
      if (chunks()[i].done || chunks()[i].ready) continue;
      if (absl::Status st = DrainInOrder(chunks()[i], i); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  if (h.kind() == data::STATE_PULL) {
    // The state as of the start of the current step: between steps of the
    // puller, so none of its chunks has moved yet.
    if (!StateIsOfStep(h.step())) {
      return absl::InvalidArgumentError(absl::StrCat("STATE_PULL for step ", h.step(),
                                                     ", but shard ", options_.shard, " is at step ",
                                                     state_.step));
    }
    const Chunk& pushed = ChunkAt(h.begin());
    if (pushed.done || pushed.pushed[h.rank()]) {
      return absl::InvalidArgumentError(absl::StrCat("STATE_PULL from rank ", h.rank(),
                                                     " for chunk ", index,
                                                     " after pushing to step ", state_.step));
    }
    SendState(h.rank(), h.step(), slices_[index]);
    return absl::OkStatus();
  }
  if (h.kind() == data::STATE_PUSH) return SeedState(h, payload, slices_[index], index, why);
  if (h.kind() == data::VOTE) return TakeVote(h, why);
  if (h.kind() == data::GRAD_SCALE) return TakeGradScale(h, why);
  if (h.kind() == data::PULL) {
    // x as of the start of the current step: the initial x at step 0 (once
    // rank 0's INIT is in), a checkpoint's after a resume. A checkpoint
    // between zero-one-adam's synchronisations is of a local step, which
    // the shard has skipped (SkipLocalSteps): its x is the same.
    if (!StateIsOfStep(h.step())) {
      return absl::InvalidArgumentError(absl::StrCat("PULL for step ", h.step(), ", but shard ",
                                                     options_.shard, " is at step ", state_.step));
    }
    Slice& c = slices_[index];
    const Chunk& pushed = ChunkAt(h.begin());
    if (pushed.done || pushed.pushed[h.rank()]) {
      *why = Refusal::kDuplicate;
      return absl::InvalidArgumentError(absl::StrCat("PULL from rank ", h.rank(), " for chunk ",
                                                     index, " after pushing to step ",
                                                     state_.step));
    }
    if (c.pulled[h.rank()]) {
      *why = Refusal::kDuplicate;
      return absl::InvalidArgumentError(absl::StrCat(
          "duplicate PULL from rank ", h.rank(), " for chunk ", index, " of step ", state_.step));
    }
    c.pulled[h.rank()] = true;
    // (x is step 0's until rank 0's INIT is in, even past local steps.)
    if (c.initialized) {
      SendParams(h.rank(), h.step(), c);
    } else {
      c.waiting[h.rank()] = true;  // at most one per rank: bounded
    }
    return absl::OkStatus();
  }
  if (steps > 0 && h.step() >= steps) {
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
  Chunk& c = chunks()[index];
  if (c.pushed[h.rank()] || c.done) {
    *why = Refusal::kDuplicate;
    return absl::InvalidArgumentError(absl::StrCat("duplicate push from rank ", h.rank(),
                                                   " for chunk ", index, " of step ", h.step()));
  }
  c.pushed[h.rank()] = true;
  c.held[h.rank()] = std::move(payload);
  c.lr[h.rank()] = h.has_lr() ? std::optional<float>(h.lr()) : std::nullopt;
  c.scale_pending[h.rank()] = h.scale_pending();
  ++pending_pushes_;
  if (!step_started_) step_started_ = absl::Now();
  return DrainInOrder(c, index);
}

bool PsServer::MeanInPieces(Phase phase) const {
  // A layer-wise step takes the whole shard's acc (CompleteShard).
  return !IsLayerwise(options_.optimizer.kind) && optimizer_->MeansInPieces(phase);
}

absl::Status PsServer::DrainInOrder(Chunk& c, uint64_t index) {
  const uint32_t n_workers = options_.job.workers;
  const float w = 1.0f / static_cast<float>(n_workers);
  const bool in_pieces = MeanInPieces(PhaseOf(state_));
  while (c.next_rank < n_workers && c.held[c.next_rank]) {
    const uint32_t r = c.next_rank;
    const std::optional<float> scale = GradScaleOf(r);
    if (c.scale_pending[r] && !scale) break;  // until its GRAD_SCALE
    zmq::message_t& m = *c.held[r];
    const uint8_t* payload = static_cast<const uint8_t*>(m.data());
    if (c.scale_pending[r]) {
      // The worker's g * s in float32, as it would have pushed it, then
      // the same decode-add: bitwise what scaling before the push gives.
      // (Into one buffer kept for it: fresh MB-sized ones fault pages.)
      scaled_.resize(c.range.size());
      std::memcpy(scaled_.data(), payload, 4 * c.range.size());
      for (float& v : scaled_) v *= *scale;
      payload = reinterpret_cast<const uint8_t*>(scaled_.data());
      if (in_pieces) {
        // Kept until the step: its own copy, not the shared buffer.
        m = zmq::message_t(scaled_.data(), 4 * scaled_.size());
        payload = static_cast<const uint8_t*>(m.data());
      }
    }
    const Codec& codec = *options_.job.push_codec;
    absl::Status st;
    if (in_pieces) {
      // Checked now, so that a bad push is refused at once; summed piece by
      // piece when the step reads it (Complete).
      st = codec.CheckPayload(payload, c.range.size());
    } else {
      // acc = +0 + w D_0 + w D_1 + ... in rank order; the first without
      // zeroing acc and reading the zeros back.
      st = r == 0 ? DecodeScaled(codec, payload, c.range.size(), w, c.acc)
                  : codec.DecodeAdd(payload, c.range.size(), w, c.acc);
    }
    if (!in_pieces || !st.ok()) c.held[r].reset();
    if (!st.ok()) {
      // The codec left acc untouched; rank r may push this chunk again.
      c.pushed[r] = false;
      --pending_pushes_;
      const std::string why = absl::StrCat("payload of rank ", r, " for chunk ", index, " of step ",
                                           state_.step, " does not decode: ", st.message());
      data::Header h;
      h.set_rank(r);
      h.set_step(state_.step);
      h.set_shard(options_.shard);
      h.set_begin(c.range.begin);
      h.set_count(c.range.size());
      SendError(WorkerIdentity(options_.job.job_id, r), &h, why, Refusal::kBadPayload);
      return absl::OkStatus();
    }
    ++c.next_rank;
  }
  if (c.next_rank == n_workers && Initialized(c)) {
    if (absl::Status st = AgreeOnLr(c, index); !st.ok()) {
      failure_ = st;
      if (metrics_ != nullptr) metrics_->Refused(Refusal::kLrMismatch);
      for (uint32_t r = 0; r < n_workers; ++r) {
        SendError(WorkerIdentity(options_.job.job_id, r), nullptr, std::string(st.message()),
                  std::nullopt);
      }
      return absl::OkStatus();
    }
    c.ready = true;
    CompleteReady();
  }
  return absl::OkStatus();
}

absl::Status PsServer::AgreeOnLr(const Chunk& c, uint64_t index) {
  auto text = [](const std::optional<float>& lr) {
    return lr ? absl::StrCat(*lr) : std::string("none (the job's schedule)");
  };
  auto same = [](const std::optional<float>& a, const std::optional<float>& b) {
    // Bitwise: every replica must apply the same float.
    return a.has_value() == b.has_value() && (!a || std::memcmp(&*a, &*b, sizeof(float)) == 0);
  };
  for (uint32_t r = 1; r < options_.job.workers; ++r) {
    if (!same(c.lr[r], c.lr[0])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", state_.step, ": the workers disagree on the learning rate: rank 0 sends ",
          text(c.lr[0]), ", rank ", r, " sends ", text(c.lr[r]), "; nothing was applied"));
    }
  }
  if (step_lr_known_ && !same(step_lr_, c.lr[0])) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", state_.step, ": chunk ", index, " carries learning rate ",
                     text(c.lr[0]), " but earlier chunks of the step carried ", text(step_lr_)));
  }
  step_lr_known_ = true;
  step_lr_ = c.lr[0];
  return absl::OkStatus();
}

void PsServer::SendParams(uint32_t rank, uint64_t step, const Slice& c) {
  const uint64_t n = c.range.size();
  auto buf = std::make_shared<std::vector<uint8_t>>(init_codec_->EncodedSize(n));
  // Under --server-reply delta the workers' x is the replica, not the master.
  const std::vector<float>& x = state_.replica.empty() ? state_.x : state_.replica;
  absl::Status st = init_codec_->Encode(x.data() + (c.range.begin - state_.begin), n, buf->data());
  if (!st.ok()) {
    // rank 0 sent x through the same codec, so this does not happen.
    failure_ = absl::InternalError(absl::StrCat("encoding the initial x: ", st.message()));
    return;
  }
  SendFp32(data::PARAMS, rank, step, c.range, buf, {});
}

void PsServer::SendFp32(data::Kind kind, uint32_t rank, uint64_t step, const Range& range,
                        const SharedBytes& payload_bytes,
                        const std::function<void(data::Header&)>& more) {
  data::Header h;
  h.set_version(kProtocolVersion);
  h.set_job_id(options_.job.job_id);
  h.set_kind(kind);
  h.set_rank(rank);
  h.set_step(step);
  h.set_shard(options_.shard);
  h.set_begin(range.begin);
  h.set_count(range.size());
  h.set_codec(init_codec_->name());
  h.set_block_size(options_.job.map.block_size());
  h.set_payload_bytes(payload_bytes->size());
  if (more) more(h);
  zmq::message_t payload = ShareFrame(payload_bytes, 0, payload_bytes->size());
  Send(ChunkPeer(rank, range.begin, options_.job.chunk_elems), h, &payload);
}

std::string PsServer::ChunkPeer(uint32_t rank, uint64_t begin, uint64_t chunk_elems) const {
  if (chunk_elems == 0) chunk_elems = options_.job.chunk_elems;
  return WorkerIdentity(
      options_.job.job_id, rank,
      ChunkConnection((begin - state_.begin) / chunk_elems, options_.job.connections));
}

absl::Status PsServer::TakeGradScale(const data::Header& h, Refusal* why) {
  const uint32_t rank = h.rank();
  if (h.step() != state_.step) {
    return absl::InvalidArgumentError(absl::StrCat("GRAD_SCALE for step ", h.step(), ", but shard ",
                                                   options_.shard, " is at step ", state_.step));
  }
  grad_scales_.resize(options_.job.workers);
  if (grad_scales_[rank]) {
    *why = Refusal::kDuplicate;
    return absl::InvalidArgumentError(
        absl::StrCat("duplicate GRAD_SCALE from rank ", rank, " for step ", state_.step));
  }
  grad_scales_[rank] = h.grad_scale();
  for (uint64_t i = 0; i < chunks().size(); ++i) {
    if (chunks()[i].done || chunks()[i].ready) continue;
    if (absl::Status st = DrainInOrder(chunks()[i], i); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status PsServer::TakeVote(const data::Header& h, Refusal* why) {
  const uint32_t rank = h.rank();
  if (!StateIsOfStep(h.step())) {
    return absl::InvalidArgumentError(
        absl::StrCat("VOTE for step ", h.step(), ", but shard 0 is at step ", state_.step));
  }
  // Votes come before any push of the step: a rank that pushed without
  // one steps without the loss scale's agreement. (Counted, so that a vote
  // costs O(1); the chunks are searched only to name the rank.)
  if (pending_pushes_ > 0 || chunks_done_ > 0) {
    uint32_t pusher = 0;
    for (const Chunk& c : chunks()) {
      for (uint32_t r = 0; r < options_.job.workers; ++r) {
        if (c.pushed[r]) pusher = r;
      }
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "VOTE from rank ", rank, " for step ", state_.step, ", but rank ", pusher,
        " has pushed to it without one: every rank must step through the same loss scaler"));
  }
  votes_.resize(options_.job.workers);
  if (votes_[rank]) {
    *why = Refusal::kDuplicate;
    return absl::InvalidArgumentError(
        absl::StrCat("duplicate VOTE from rank ", rank, " for step ", state_.step));
  }
  votes_[rank] = h.found_inf();
  bool found_inf = false;
  for (const std::optional<bool>& v : votes_) {
    if (!v) return absl::OkStatus();
    found_inf = found_inf || *v;
  }
  votes_.clear();  // the next round (the same step again, after a skip)
  const SharedBytes none = std::make_shared<const std::vector<uint8_t>>();
  for (uint32_t r = 0; r < options_.job.workers; ++r) {
    SendFp32(data::VERDICT, r, h.step(), slices_[0].range, none,
             [&](data::Header& reply) { reply.set_found_inf(found_inf); });
  }
  return absl::OkStatus();
}

absl::Status PsServer::SeedState(const data::Header& h, zmq::message_t& payload, Slice& c,
                                 uint64_t slice_index, Refusal* why) {
  auto refuse = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("STATE_PUSH: ", parts...));
  };
  if (!TraitsOf(options_.optimizer.kind).adam_state_on_servers) {
    *why = Refusal::kBadPayload;
    return refuse(OptimizerKindName(options_.optimizer.kind),
                  "'s state is not Adam's m and v on the servers alone; only adam, onebit-adam "
                  "and naive-onebit-adam can be seeded");
  }
  // Before anything of step 0 applied: the workers' first replies then
  // come from the seeded state, and every replica stays equal.
  const Chunk& pushed = ChunkAt(h.begin());
  if (h.step() != 0 || state_.step != 0 || pushed.done || pushed.pushed[0]) {
    return refuse("for step ", h.step(), " of chunk ", slice_index, ", but shard ", options_.shard,
                  " is at step ", state_.step,
                  pushed.done || pushed.pushed[0] ? " and rank 0 has pushed to it" : "",
                  ": a state is seeded only before the job's first step");
  }
  if (state_.frozen) return refuse("shard ", options_.shard, " is past the warm-up (v frozen)");
  *why = Refusal::kBadPayload;
  std::vector<float>* into = nullptr;
  if (h.arrays_size() == 1 && h.arrays(0) == "m") into = &state_.m;
  if (h.arrays_size() == 1 && h.arrays(0) == "v") into = &state_.v;
  if (into == nullptr || into->size() != state_.x.size()) {
    return refuse("names ", h.arrays_size(), " arrays (",
                  absl::CHexEscape(absl::StrJoin(h.arrays(), ", ")), "); want one, m or v");
  }
  if (seeded_bias_steps_ && *seeded_bias_steps_ != h.bias_steps()) {
    return refuse("bias_steps ", h.bias_steps(), ", but an earlier STATE_PUSH said ",
                  *seeded_bias_steps_);
  }
  absl::Status st = init_codec_->Decode(static_cast<const uint8_t*>(payload.data()), h.count(),
                                        into->data() + (h.begin() - state_.begin));
  if (!st.ok()) return refuse("bad payload: ", st.message());
  seeded_bias_steps_ = h.bias_steps();
  state_.bias_steps = h.bias_steps();
  c.state.reset();
  SendFp32(data::STATE_TAKEN, 0, 0, c.range, std::make_shared<const std::vector<uint8_t>>(),
           [&](data::Header& reply) { reply.add_arrays(h.arrays(0)); });
  return absl::OkStatus();
}

void PsServer::SendState(uint32_t rank, uint64_t step, Slice& c) {
  if (c.state == nullptr) {
    const uint64_t n = c.range.size();
    const uint64_t off = c.range.begin - state_.begin;
    // x, then each array the algorithm holds now (all of the shard's length).
    std::vector<const std::vector<float>*> arrays = {&state_.x};
    c.state_arrays = {"x"};
    for (const auto& [name, a] : {std::pair<const char*, const std::vector<float>*>{"m", &state_.m},
                                  {"v", &state_.v},
                                  {"den", &state_.den},
                                  {"e", &state_.e}}) {
      if (a->size() != state_.x.size()) continue;
      arrays.push_back(a);
      c.state_arrays.push_back(name);
    }
    auto buf = std::make_shared<std::vector<uint8_t>>(4 * n * arrays.size());
    for (size_t k = 0; k < arrays.size(); ++k) {
      std::memcpy(buf->data() + 4 * n * k, arrays[k]->data() + off, 4 * n);
    }
    c.state = std::move(buf);
  }
  SendFp32(data::STATE, rank, step, c.range, c.state, [&](data::Header& h) {
    h.set_frozen(state_.frozen);
    h.set_bias_steps(state_.bias_steps);
    for (const char* name : c.state_arrays) h.add_arrays(name);
  });
}

std::optional<bool> PsServer::LastWarmup() {
  const OptimizerKind kind = options_.optimizer.kind;
  if (state_.frozen || !HasWarmup(kind) || !HasCompressionPhase(kind)) return false;
  const FreezeOptions& f = options_.freeze;
  const uint64_t next = state_.step + 1;
  if (!f.automatic) return next == f.step;
  // Automatic: the warm-up can only end K steps after a check.
  if (next <= f.window || next % f.window != 0) return false;
  std::optional<uint64_t> decided = options_.freeze_decision(next - f.window);
  if (!decided) return std::nullopt;
  return *decided == next;
}

void PsServer::CompleteReady() {
  bool any = false;
  for (const Chunk& c : chunks()) any |= c.ready;
  if (!any) return;
  std::optional<bool> last = LastWarmup();
  if (!last) {
    if (!waiting_since_) waiting_since_ = absl::Now();
    return;
  }
  waiting_since_.reset();
  if (IsLayerwise(options_.optimizer.kind)) {
    CompleteShard();
    return;
  }
  for (uint64_t i = 0; i < chunks().size() && failure_.ok(); ++i) {
    if (chunks()[i].ready) Complete(chunks()[i], i);
  }
}

void PsServer::PrepareReply(Chunk& c, StepKind kind, bool last_warmup) {
  const size_t bytes = optimizer_->ReplyBytes(kind, c.range.begin, c.range.size(), last_warmup);
  if (c.reply == nullptr || c.reply.use_count() > 1 || c.reply->size() != bytes) {
    c.reply = std::make_shared<std::vector<uint8_t>>(bytes);
  }
  c.ready = false;
}

float PsServer::StepLr() const {
  return step_lr_ ? *step_lr_ : LearningRate(options_.optimizer, state_.step);
}

void PsServer::Complete(Chunk& c, uint64_t index) {
  const uint64_t pushed_ns = MonotonicNs();
  const uint64_t n = c.range.size();
  const bool last_warmup = LastWarmup().value_or(false);
  const StepKind kind = optimizer_->KindAt(state_.step, PhaseOf(state_), state_.begin);
  PrepareReply(c, kind, last_warmup);
  absl::Status st;
  if (MeanInPieces(PhaseOf(state_))) {
    ChunkPushes pushes;
    pushes.codec = options_.job.push_codec;
    pushes.n = n;
    pushes.w = 1.0f / static_cast<float>(options_.job.workers);
    for (const auto& m : c.held) pushes.payloads.push_back(static_cast<const uint8_t*>(m->data()));
    st = optimizer_->StepFromPushes(state_.step, StepLr(), last_warmup, pushes,
                                    c.range.begin - state_.begin, &state_, c.reply->data());
    for (auto& m : c.held) m.reset();
  } else {
    st = optimizer_->Step(state_.step, StepLr(), last_warmup, c.acc, c.range.begin - state_.begin,
                          n, &state_, c.reply->data());
  }
  apply_ns_ += MonotonicNs() - pushed_ns;
  pending_pushes_ -= options_.job.workers;
  if (!st.ok()) {
    failure_ = absl::InternalError(
        absl::StrCat("shard ", options_.shard, " chunk ", index, ": ", st.message()));
    return;
  }
  SendReply(c, kind, last_warmup, pushed_ns);
  if (++chunks_done_ < chunks().size()) return;
  EndStep();
}

void PsServer::CompleteShard() {
  for (const Chunk& c : chunks()) {
    if (!c.ready) return;
  }
  const uint64_t pushed_ns = MonotonicNs();
  const bool last_warmup = LastWarmup().value_or(false);
  const StepKind kind = optimizer_->KindAt(state_.step, PhaseOf(state_), state_.begin);
  std::vector<ServerOptimizer::ChunkSpan> spans;
  for (Chunk& c : chunks()) {
    PrepareReply(c, kind, last_warmup);
    spans.push_back({c.range.begin - state_.begin, c.range.size(), c.acc, c.reply->data()});
  }
  absl::Status st = optimizer_->StepShard(state_.step, StepLr(), last_warmup, spans, &state_);
  apply_ns_ += MonotonicNs() - pushed_ns;
  pending_pushes_ = 0;
  if (!st.ok()) {
    failure_ = absl::InternalError(absl::StrCat("shard ", options_.shard, ": ", st.message()));
    return;
  }
  for (Chunk& c : chunks()) SendReply(c, kind, last_warmup, pushed_ns);
  chunks_done_ = chunks().size();
  EndStep();
}

void PsServer::SendReply(Chunk& c, StepKind kind, bool last_warmup, uint64_t pushed_ns) {
  const uint64_t n = c.range.size();
  const SharedBytes shared = c.reply;
  data::Header h;
  h.set_version(kProtocolVersion);
  h.set_job_id(options_.job.job_id);
  h.set_kind(data::REPLY);
  h.set_step(state_.step);
  h.set_shard(options_.shard);
  h.set_begin(c.range.begin);
  h.set_count(n);
  h.set_codec(optimizer_->reply_codec(kind).name());
  h.set_block_size(options_.job.map.block_size());
  h.set_payload_bytes(shared->size());
  h.set_pushed_ns(pushed_ns);
  h.set_last_warmup(last_warmup);
  const Phase phase = PhaseOf(state_);
  for (uint32_t r = 0; r < options_.job.workers; ++r) {
    h.set_rank(r);
    h.set_sent_ns(MonotonicNs());
    zmq::message_t payload = ShareFrame(shared, 0, shared->size());
    const size_t sent =
        Send(ChunkPeer(r, c.range.begin, options_.job.push_chunk_elems), h, &payload);
    if (metrics_ != nullptr && sent > 0) metrics_->Replied(phase, sent);
  }
  c.done = true;
}

// Every chunk of the shard is done: the step is over.
void PsServer::EndStep() {
  const bool last_warmup = LastWarmup().value_or(false);
  const double step_s = step_started_ ? absl::ToDoubleSeconds(absl::Now() - *step_started_) : 0;
  if (metrics_ != nullptr) {
    metrics_->StepServed(state_.step + 1, state_.frozen, apply_ns_ * 1e-9, step_s);
  }
  step_parts_.Add(state_.frozen, {apply_ns_ * 1e-9, step_s});
  apply_ns_ = 0;
  pending_pushes_ = 0;
  ++state_.step;
  chunks_done_ = 0;
  step_started_.reset();
  step_lr_known_ = false;
  step_lr_.reset();
  grad_scales_.clear();
  for (Chunk& ch : chunks()) {
    ch.next_rank = 0;
    for (auto& m : ch.held) m.reset();
    std::fill(ch.scale_pending.begin(), ch.scale_pending.end(), false);
    std::fill(ch.pushed.begin(), ch.pushed.end(), false);
    ch.done = false;
  }
  for (Slice& sl : slices_) {
    std::fill(sl.pulled.begin(), sl.pulled.end(), false);
    sl.state.reset();  // of the step just ended
  }
  if (last_warmup) {
    optimizer_->EnterCompression(&state_);
    std::fprintf(stderr,
                 "server %u: warm-up over after %llu steps; %llu coordinates of v "
                 "raised to the floor\n",
                 options_.shard, static_cast<unsigned long long>(state_.step),
                 static_cast<unsigned long long>(state_.floored));
  }
  // --freeze auto: every K steps, how far v moved since the previous check.
  const FreezeOptions& f = options_.freeze;
  if (f.automatic && !state_.frozen && HasCompressionPhase(options_.optimizer.kind) &&
      state_.step % f.window == 0) {
    const double change = FreezeCheckChange(
        options_.optimizer, f.window, state_.bias_steps + state_.step, state_.v, state_.v_check);
    state_.v_check = state_.v;
    if (metrics_ != nullptr) metrics_->FreezeChecked(change);
    options_.report_freeze_check(state_.step, change);
  }
  if (options_.on_step_end) options_.on_step_end(state_);
  SkipLocalSteps();
}

bool PsServer::StateIsOfStep(uint64_t step) const {
  if (step > state_.step) return false;
  for (uint64_t t = step; t < state_.step; ++t) {
    if (optimizer_->KindAt(t, PhaseOf(state_), state_.begin) != StepKind::kLocal) return false;
  }
  return true;
}

void PsServer::SkipLocalSteps() {
  // Steps that send nothing (zero-one-adam's local steps) leave the shard
  // as it is: they end as they begin. The schedule ends every job on a
  // step that synchronises, so this stops at the job's end at the latest.
  while (!slices_.empty() && (!end_step_ || state_.step < *end_step_) &&
         optimizer_->KindAt(state_.step, PhaseOf(state_), state_.begin) == StepKind::kLocal) {
    ++state_.step;
    if (options_.on_step_end) options_.on_step_end(state_);
  }
  if (metrics_ != nullptr) metrics_->SetSteps(state_.step);
  const StepKind kind = optimizer_->KindAt(state_.step, PhaseOf(state_), state_.begin);
  options_.job.push_codec = &optimizer_->push_codec(kind);
  // The compressed steps' grid, where they have one of their own. The
  // other grid's reply buffers go (the warm-up's are fp32, as large as the
  // shard's x, and after the freeze unused).
  const size_t grid = kind == StepKind::kCompressed && !grids_[1].empty() ? 1 : 0;
  if (grid != grid_) {
    for (Chunk& c : grids_[grid_]) c.reply.reset();
  }
  grid_ = grid;
  options_.job.push_chunk_elems =
      grid_ == 1 ? options_.job.compressed_chunk_elems : options_.job.chunk_elems;
}

PsServer::Chunk& PsServer::ChunkAt(uint64_t begin) {
  return chunks()[(begin - state_.begin) / options_.job.push_chunk_elems];
}

bool PsServer::Initialized(const Chunk& c) const {
  const uint64_t elems = options_.job.chunk_elems;
  for (uint64_t i = (c.range.begin - state_.begin) / elems;
       i < slices_.size() && slices_[i].range.begin < c.range.end; ++i) {
    if (!slices_[i].initialized) return false;
  }
  return true;
}

void PsServer::SendError(const std::string& routing_id, const data::Header* request,
                         const std::string& error, std::optional<Refusal> why) {
  if (metrics_ != nullptr && why) metrics_->Refused(*why);
  data::Header h;
  if (request != nullptr) {
    h.set_rank(request->rank());
    h.set_step(request->step());
    h.set_shard(request->shard());
    h.set_begin(request->begin());
    h.set_count(request->count());
  }
  h.set_version(kProtocolVersion);
  // The request's own id, not the job's: a stranger learns nothing.
  h.set_job_id(request != nullptr ? request->job_id() : 0);
  h.set_kind(data::ERROR);
  h.set_error(error);
  refusals_.Refused(absl::StrCat("a request from '", absl::CHexEscape(routing_id), "': ", error));
  zmq::message_t empty;
  Send(routing_id, h, &empty);
}

size_t PsServer::Send(const std::string& routing_id, const data::Header& h,
                      zmq::message_t* payload) {
  std::vector<zmq::message_t> frames;
  frames.push_back(CopyFrame(routing_id));
  frames.push_back(CopyFrame(h.SerializeAsString()));
  frames.push_back(std::move(*payload));
  if (!seals_.empty()) {
    auto seal = seals_.find(routing_id);
    absl::StatusOr<zmq::message_t> sealed =
        seal == seals_.end() ? absl::NotFoundError("not a worker connection of this job")
                             : seal->second->Seal(frames[1], &frames[2]);
    if (!sealed.ok()) {
      refusals_.Refused(absl::StrCat("a reply to '", absl::CHexEscape(routing_id),
                                     "' not sent: ", sealed.status().message()));
      return 0;
    }
    frames.push_back(*std::move(sealed));
  }
  const size_t bytes = frames[1].size() + frames[2].size();
  if (SendOrDrop(socket_, frames)) return bytes;
  if (metrics_ != nullptr) metrics_->ReplyDropped();
  // The peer is gone, or does not read its replies (its queue is full):
  // never block on it. A worker's missing reply surfaces as its timeout.
  if (unsent_++ % 1000 == 0) {
    std::fprintf(stderr,
                 "server %u: cannot reply to '%s' (gone, or not reading its replies); %llu "
                 "replies dropped so far\n",
                 options_.shard, absl::CHexEscape(routing_id).c_str(),
                 static_cast<unsigned long long>(unsent_));
  }
  return 0;
}

}  // namespace onebit
