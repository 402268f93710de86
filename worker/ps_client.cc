#include "worker/ps_client.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "net/data_plane.h"
#include "zmq_addon.hpp"

namespace onebit {

absl::StatusOr<std::unique_ptr<PsClient>> PsClient::Connect(PsClientOptions options,
                                                            zmq::context_t* ctx) {
  std::unique_ptr<PsClient> c(new PsClient(std::move(options)));
  const PsClientOptions& o = c->options_;
  if (o.server_endpoints.size() != o.map.num_shards()) {
    return absl::InvalidArgumentError(absl::StrCat(
        o.server_endpoints.size(), " server endpoints for ", o.map.num_shards(), " shards"));
  }
  if (o.optimizer == nullptr) return absl::InvalidArgumentError("PsClient: no optimizer");
  auto fp32 = NewCodec("fp32", o.optimizer->options().codec);
  if (!fp32.ok()) return fp32.status();
  c->fp32_ = std::move(*fp32);
  if (o.keys && o.server_keys.size() != o.server_endpoints.size()) {
    return absl::InvalidArgumentError(absl::StrCat(o.server_keys.size(), " server keys for ",
                                                   o.server_endpoints.size(), " servers"));
  }
  if (!o.sealed.empty() && o.sealed.size() != o.server_endpoints.size()) {
    return absl::InvalidArgumentError(absl::StrCat(o.sealed.size(), " servers' seal secrets for ",
                                                   o.server_endpoints.size(), " servers"));
  }
  if (o.connections < 1 || o.connections > kMaxDataConnections) {
    return absl::InvalidArgumentError(absl::StrCat(
        o.connections, " connections per server (want 1 to ", kMaxDataConnections, ")"));
  }
  for (size_t k = 0; k < o.server_endpoints.size(); ++k) {
    const std::string& ep = o.server_endpoints[k];
    for (uint32_t l = 0; l < o.connections; ++l) {
      zmq::socket_t s(*ctx, zmq::socket_type::dealer);
      s.set(zmq::sockopt::routing_id, WorkerIdentity(o.job_id, o.rank, l));
      ConfigureDataSocket(&s);
      if (!o.sealed.empty()) {
        MakePlainClient(&s, WorkerPeerId(o.rank), o.sealed[k].Password());
        c->seals_.push_back(std::make_unique<ConnectionSeal>(o.sealed[k].ConnectionKey(l),
                                                             SealDirection::kToServer));
      } else if (o.keys) {
        MakeCurveClient(&s, *o.keys, o.server_keys[k]);
      }
      try {
        s.connect(ep);
      } catch (const zmq::error_t& e) {
        return absl::InvalidArgumentError(absl::StrCat("cannot connect to ", ep, ": ", e.what()));
      }
      c->sockets_.push_back(std::move(s));
    }
  }
  c->MakeGrid(o.chunk_elems, &c->grids_[0]);
  if (o.compressed_chunk_elems != 0 && o.compressed_chunk_elems != o.chunk_elems) {
    c->MakeGrid(o.compressed_chunk_elems, &c->grids_[1]);
  }
  c->pushed_.assign(std::max(c->grids_[0].chunks.size(), c->grids_[1].chunks.size()), false);
  return c;
}

void PsClient::MakeGrid(uint64_t chunk_elems, Grid* g) const {
  const ShardMap& map = options_.map;
  g->chunk_elems = chunk_elems;
  g->by_shard.resize(map.num_shards());
  uint64_t max_chunks = 0;
  for (uint32_t k = 0; k < map.num_shards(); ++k) {
    max_chunks = std::max(max_chunks, NumChunks(map.shard(k).size(), chunk_elems));
  }
  for (uint64_t i = 0; i < max_chunks; ++i) {
    for (uint32_t k = 0; k < map.num_shards(); ++k) {
      if (i >= NumChunks(map.shard(k).size(), chunk_elems)) continue;
      g->by_shard[k].push_back(g->chunks.size());
      g->chunks.push_back(Chunk{k, i, ChunkRange(map, k, chunk_elems, i), nullptr});
    }
  }
  for (size_t i = 0; i < g->chunks.size(); ++i) g->by_begin.push_back(i);
  std::sort(g->by_begin.begin(), g->by_begin.end(), [&](size_t a, size_t b) {
    return g->chunks[a].range.begin < g->chunks[b].range.begin;
  });
}

absl::Status PsClient::SendChunk(Chunk& c, uint64_t step, const Codec& codec, int kind,
                                 const std::function<absl::Status(const Range&, uint8_t*)>& encode,
                                 const std::function<void(data::Header&)>& more) {
  const size_t n = c.range.size();
  const bool header_only = kind == data::PULL || kind == data::STATE_PULL || kind == data::VOTE ||
                           kind == data::GRAD_SCALE;
  const size_t bytes = header_only ? 0 : codec.EncodedSize(n);
  // Reuse the buffer once ZeroMQ has let go of it, else take a fresh one
  // (a header-only message leaves the chunk's for its next push).
  static const SharedBytes kNone = std::make_shared<const std::vector<uint8_t>>();
  if (!header_only && (c.buf == nullptr || c.buf.use_count() > 1 || c.buf->size() != bytes)) {
    c.buf = std::make_shared<std::vector<uint8_t>>(bytes);
  }
  const SharedBytes payload = header_only ? kNone : c.buf;
  absl::Status st = header_only ? absl::OkStatus() : encode(c.range, c.buf->data());
  if (!st.ok()) {
    return absl::Status(
        st.code(), absl::StrCat("encoding chunk [", c.range.begin, ", ", c.range.end, ") of step ",
                                step, ": ", st.message()));
  }
  data::Header h;
  h.set_version(kProtocolVersion);
  h.set_job_id(options_.job_id);
  h.set_kind(static_cast<data::Kind>(kind));
  h.set_rank(options_.rank);
  h.set_step(step);
  h.set_shard(c.shard);
  h.set_begin(c.range.begin);
  h.set_count(n);
  h.set_codec(codec.name());
  h.set_block_size(options_.map.block_size());
  h.set_payload_bytes(bytes);
  if (kind == data::PUSH && lr_) h.set_lr(*lr_);
  if (kind == data::PUSH && defer_scale_) h.set_scale_pending(true);
  if (more) more(h);
  const std::string header = h.SerializeAsString();
  const size_t j = c.shard * options_.connections + ChunkConnection(c.index, options_.connections);
  zmq::socket_t& s = sockets_[j];
  zmq::message_t header_frame = CopyFrame(header), payload_frame = ShareFrame(payload, 0, bytes);
  std::optional<zmq::message_t> seal;
  if (!seals_.empty()) {
    auto sealed = seals_[j]->Seal(header_frame, &payload_frame);
    if (!sealed.ok()) return sealed.status();
    seal = *std::move(sealed);
  }
  try {
    s.send(header_frame, zmq::send_flags::sndmore);
    s.send(payload_frame, seal ? zmq::send_flags::sndmore : zmq::send_flags::none);
    if (seal) s.send(*seal, zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    return absl::UnavailableError(absl::StrCat(
        "sending to server ", c.shard, " (", options_.server_endpoints[c.shard], "): ", e.what()));
  }
  bytes_up_ += header.size() + bytes;
  return absl::OkStatus();
}

absl::Status PsClient::SendInit(const float* x) {
  for (Chunk& c : grids_[0].chunks) {
    absl::Status st = SendChunk(c, 0, *fp32_, data::INIT, [&](const Range& r, uint8_t* out) {
      return fp32_->Encode(x + r.begin, r.size(), out);
    });
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

void PsClient::LingerOnClose(absl::Duration bound) {
  for (zmq::socket_t& s : sockets_) {
    s.set(zmq::sockopt::linger, static_cast<int>(absl::ToInt64Milliseconds(bound)));
  }
}

absl::Status PsClient::SendHeader(Chunk& c, uint64_t step, int kind,
                                  const std::function<void(data::Header&)>& more) {
  return SendChunk(
      c, step, *fp32_, kind, [](const Range&, uint8_t*) { return absl::OkStatus(); }, more);
}

absl::StatusOr<size_t> PsClient::CheckReply(const Grid& grid, uint32_t server, uint64_t step,
                                            int kind, const std::vector<zmq::message_t>& frames,
                                            data::Header* h) {
  const std::string& ep = options_.server_endpoints[server];
  auto who = [&] { return absl::StrCat("server ", server, " (", ep, ")"); };
  if (frames.empty()) return absl::DataLossError(absl::StrCat("empty message from ", who()));
  auto parsed = ParseHeader(frames[0].data(), frames[0].size());
  if (!parsed.ok())
    return absl::DataLossError(absl::StrCat(who(), ": ", parsed.status().message()));
  *h = *std::move(parsed);
  if (h->kind() == data::ERROR) {
    // The step this worker is at: an error about no request of its own
    // (a step timeout) may come with a header that names none.
    return absl::FailedPreconditionError(
        absl::StrCat(who(), " refused rank ", options_.rank, "'s step ", step, ": ", h->error()));
  }
  auto bad = [&](auto&&... parts) {
    return absl::DataLossError(absl::StrCat("bad reply from ", who(), ": ", parts...));
  };
  if (h->version() != kProtocolVersion) return bad("protocol version ", h->version());
  if (h->job_id() != options_.job_id) return bad("wrong job id");
  if (h->kind() != kind) return bad("kind ", data::Kind_Name(h->kind()));
  if (h->step() != step) return bad("step ", h->step(), " while at step ", step);
  if (h->shard() != server) return bad("shard ", h->shard());
  const Range s = options_.map.shard(server);
  if (h->begin() < s.begin || h->begin() >= s.end ||
      (h->begin() - s.begin) % grid.chunk_elems != 0) {
    return bad("range begins at ", h->begin());
  }
  const size_t i = grid.by_shard[server][(h->begin() - s.begin) / grid.chunk_elems];
  if (h->count() != grid.chunks[i].range.size()) return bad("count ", h->count());
  if (options_.peers_heard != nullptr) options_.peers_heard->Heard(server);
  return i;
}

absl::Status PsClient::ReceiveAll(
    const Grid& grid, const std::string& what,
    const std::function<absl::Status(uint32_t k, std::vector<zmq::message_t>&)>& handle,
    const Check& check, const std::vector<size_t>& expected_given) {
  const size_t S = num_servers(), L = options_.connections;
  std::vector<size_t> expected(S), outstanding(S);
  size_t left = 0;
  for (uint32_t k = 0; k < S; ++k) {
    expected[k] = expected_given.empty() ? grid.by_shard[k].size() : expected_given[k];
    left += outstanding[k] = expected[k];
  }
  std::vector<absl::Time> last_heard(S, absl::Now());
  // A server's replies come on any of its connections.
  std::vector<zmq::pollitem_t> items(S * L);
  while (left > 0) {
    for (size_t j = 0; j < S * L; ++j) items[j] = {sockets_[j].handle(), 0, ZMQ_POLLIN, 0};
    PollItems(items.data(), S * L, std::chrono::milliseconds(100));
    for (size_t j = 0; j < S * L; ++j) {
      if (!(items[j].revents & ZMQ_POLLIN)) continue;
      const auto k = static_cast<uint32_t>(j / L);
      while (true) {
        std::vector<zmq::message_t> frames;
        auto r =
            zmq::recv_multipart(sockets_[j], std::back_inserter(frames), zmq::recv_flags::dontwait);
        if (!r) break;
        if (!seals_.empty()) {
          // Opened before anything reads it: a message that does not open
          // came from no server of this job (or was altered on the way).
          absl::Status opened =
              frames.size() == 3 ? seals_[j]->Open(frames[0], &frames[1], frames[2])
                                 : absl::PermissionDeniedError(absl::StrCat(
                                       "an unsealed message (", frames.size(), " frames; want 3)"));
          if (!opened.ok()) {
            return absl::PermissionDeniedError(absl::StrCat(
                "server ", k, " (", options_.server_endpoints[k], ") sent ", opened.message(),
                " while rank ", options_.rank, " waited for ", what));
          }
          frames.pop_back();
        }
        if (pending_ && KeepEarlyReply(k, frames)) continue;
        if (outstanding[k] == 0) {
          // Owed nothing (more): its refusal, if it is one, says why.
          const std::string who =
              absl::StrCat("server ", k, " (", options_.server_endpoints[k], ")");
          auto h = frames.empty() ? absl::StatusOr<data::Header>(absl::DataLossError("empty"))
                                  : ParseHeader(frames[0].data(), frames[0].size());
          if (h.ok() && h->kind() == data::ERROR) {
            return absl::FailedPreconditionError(absl::StrCat(who, " refused rank ", options_.rank,
                                                              " while it waited for ", what, ": ",
                                                              h->error()));
          }
          return absl::DataLossError(
              absl::StrCat(who, " sent a message beyond the ", expected[k], " it owed for ", what));
        }
        if (absl::Status st = handle(k, frames); !st.ok()) return st;
        last_heard[k] = absl::Now();
        --outstanding[k];
        --left;
      }
    }
    const absl::Time now = absl::Now();
    const bool starting = !first_step_ || step_ <= *first_step_ + 1;
    const absl::Duration limit = starting ? options_.startup_timeout : options_.reply_timeout;
    for (uint32_t k = 0; k < S; ++k) {
      if (outstanding[k] > 0 && now - last_heard[k] > limit) {
        return absl::DeadlineExceededError(absl::StrCat(
            "no reply from server ", k, " (", options_.server_endpoints[k], ") for ", what,
            " within ", absl::FormatDuration(limit), starting ? " (the job's start-up)" : "", " (",
            outstanding[k], " of ", expected[k], " replies outstanding): is it dead?"));
      }
    }
    if (absl::Status st = check(); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status PsClient::PullParams(uint64_t step, Replica* replica, const Check& check) {
  Grid& grid = grids_[0];
  for (Chunk& c : grid.chunks) {
    absl::Status st = SendHeader(c, step, data::PULL);
    if (!st.ok()) return st;
  }
  std::vector<bool> got(grid.chunks.size(), false);
  std::vector<float> x;
  absl::Status st = ReceiveAll(
      grid,
      step == 0 ? std::string("the initial parameters")
                : absl::StrCat("the parameters at step ", step),
      [&](uint32_t k, std::vector<zmq::message_t>& frames) -> absl::Status {
        data::Header h;
        auto i = CheckReply(grid, k, step, data::PARAMS, frames, &h);
        if (!i.ok()) return i.status();
        const Range& r = grid.chunks[*i].range;
        const size_t need = fp32_->EncodedSize(r.size());
        if (frames.size() != 2 || h.payload_bytes() != need || frames[1].size() != need) {
          return absl::DataLossError(absl::StrCat("bad initial parameters from server ", k,
                                                  ": payload of ", need, " bytes expected"));
        }
        if (got[*i]) {
          return absl::DataLossError(absl::StrCat("server ", k, " sent chunk [", r.begin, ", ",
                                                  r.end, ") of the initial parameters twice"));
        }
        got[*i] = true;
        x.resize(r.size());
        absl::Status st =
            fp32_->Decode(static_cast<const uint8_t*>(frames[1].data()), r.size(), x.data());
        if (!st.ok()) {
          return absl::DataLossError(
              absl::StrCat("initial parameters from server ", k, ": ", st.message()));
        }
        return replica->WriteX(r.begin, r.size(), x.data(), step == 0);
      },
      check);
  if (!st.ok() || step == 0) return st;
  ResumeMerge(step, replica->phase());
  return absl::OkStatus();
}

void PsClient::ResumeMerge(uint64_t step, Phase phase) {
  // MergeStep does not decrease with the step: the syncs still to merge at
  // `step` are among the last ones before it.
  const WorkerOptimizer& opt = *options_.optimizer;
  pending_.reset();
  for (uint64_t t = step; t-- > 0 && opt.MergeStep(t) >= step;) {
    if (opt.MergeStep(t) == t) continue;
    std::vector<StepKind> kinds(num_servers());
    bool any = false;
    for (uint32_t k = 0; k < kinds.size(); ++k) {
      kinds[k] = opt.KindAt(t, phase, options_.map.shard(k).begin);
      any |= kinds[k] != StepKind::kLocal;
    }
    if (!any) continue;
    Round p;
    p.step = t;
    p.merge = opt.MergeStep(t);
    p.shard_kind = std::move(kinds);
    p.outstanding.assign(num_servers(), 0);
    pending_ = std::move(p);
    return;
  }
}

absl::Status PsClient::PushState(const std::map<std::string, const float*>& arrays,
                                 uint64_t bias_steps, const Check& check) {
  // One array at a time: each message is one fp32 chunk, within the
  // servers' frame limit.
  Grid& grid = grids_[0];
  for (const auto& entry : arrays) {
    // Not a structured binding: lambdas below capture them (clang 14 cannot).
    const std::string& name = entry.first;
    const float* values = entry.second;
    for (Chunk& c : grid.chunks) {
      absl::Status st = SendChunk(
          c, 0, *fp32_, data::STATE_PUSH,
          [&](const Range& r, uint8_t* out) {
            return fp32_->Encode(values + r.begin, r.size(), out);
          },
          [&](data::Header& h) {
            h.add_arrays(name);
            h.set_bias_steps(bias_steps);
          });
      if (!st.ok()) return st;
    }
    std::vector<bool> got(grid.chunks.size(), false);
    absl::Status st = ReceiveAll(
        grid, absl::StrCat("the seeded optimizer state '", name, "'"),
        [&](uint32_t k, std::vector<zmq::message_t>& frames) -> absl::Status {
          data::Header h;
          auto i = CheckReply(grid, k, 0, data::STATE_TAKEN, frames, &h);
          if (!i.ok()) return i.status();
          if (h.arrays_size() != 1 || h.arrays(0) != name || got[*i]) {
            const Range& r = grid.chunks[*i].range;
            return absl::DataLossError(
                absl::StrCat("bad reply from server ", k, ": STATE_TAKEN for chunk [", r.begin,
                             ", ", r.end, ") twice or for another array than '", name, "'"));
          }
          got[*i] = true;
          return absl::OkStatus();
        },
        check);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> PsClient::Vote(uint64_t step, bool found_inf, const Check& check) {
  // A worker whose sync still travels may be ahead of a server.
  if (absl::Status st = AwaitPending(check); !st.ok()) return st;
  Grid& grid = grids_[0];
  Chunk& first = grid.chunks[grid.by_shard[0][0]];  // chunk 0 of shard 0
  absl::Status st =
      SendHeader(first, step, data::VOTE, [&](data::Header& h) { h.set_found_inf(found_inf); });
  if (!st.ok()) return st;
  bool any = false;
  st = ReceiveAll(
      grid, absl::StrCat("the verdict on step ", step, "'s overflow"),
      [&](uint32_t k, std::vector<zmq::message_t>& frames) -> absl::Status {
        data::Header h;
        auto i = CheckReply(grid, k, step, data::VERDICT, frames, &h);
        if (!i.ok()) return i.status();
        any = h.found_inf();
        return absl::OkStatus();
      },
      check, [&] {  // one message, of server 0
        std::vector<size_t> e(num_servers(), 0);
        e[0] = 1;
        return e;
      }());
  if (!st.ok()) return st;
  return any;
}

absl::StatusOr<PsClient::ServerState> PsClient::PullState(uint64_t step, const Check& check) {
  if (absl::Status st = AwaitPending(check); !st.ok()) return st;
  Grid& grid = grids_[0];
  for (Chunk& c : grid.chunks) {
    absl::Status st = SendHeader(c, step, data::STATE_PULL);
    if (!st.ok()) return st;
  }
  const uint64_t d = options_.map.num_params();
  ServerState out;
  std::map<std::string, uint64_t> filled;  // elements received per array
  std::vector<bool> got(grid.chunks.size(), false);
  int frozen = -1;
  uint64_t bias_steps = 0;
  bool got_any = false;
  absl::Status st = ReceiveAll(
      grid, absl::StrCat("the optimizer state at step ", step),
      [&](uint32_t k, std::vector<zmq::message_t>& frames) -> absl::Status {
        data::Header h;
        auto i = CheckReply(grid, k, step, data::STATE, frames, &h);
        if (!i.ok()) return i.status();
        const Range& r = grid.chunks[*i].range;
        auto bad = [&](auto&&... parts) {
          return absl::DataLossError(absl::StrCat("bad optimizer state from server ", k,
                                                  " for chunk [", r.begin, ", ", r.end,
                                                  "): ", parts...));
        };
        // Only the names a shard may hold, each once: memory stays within
        // 5 d floats, and an array counted to d came from every chunk.
        std::set<std::string> names;
        for (const std::string& name : h.arrays()) {
          if (name != "x" && name != "m" && name != "v" && name != "den" && name != "e") {
            return bad("unknown array '", absl::CHexEscape(name), "'");
          }
          if (!names.insert(name).second) return bad("array '", name, "' twice");
        }
        const size_t need = 4 * r.size() * h.arrays_size();
        if (frames.size() != 2 || h.payload_bytes() != need || frames[1].size() != need) {
          return bad("payload of ", frames.size() == 2 ? frames[1].size() : 0, " bytes, want ",
                     need);
        }
        if (got[*i]) return bad("sent twice");
        if (frozen >= 0 && frozen != static_cast<int>(h.frozen())) {
          return bad("the servers disagree on whether v is frozen");
        }
        if (got_any && bias_steps != h.bias_steps()) {
          return bad("the servers disagree on the state's bias_steps");
        }
        frozen = h.frozen();
        bias_steps = h.bias_steps();
        got_any = true;
        got[*i] = true;
        const auto* payload = static_cast<const uint8_t*>(frames[1].data());
        for (int a = 0; a < h.arrays_size(); ++a) {
          std::vector<float>& into = out.arrays[h.arrays(a)];
          if (into.empty()) into.resize(d);
          std::memcpy(into.data() + r.begin, payload + 4 * r.size() * a, 4 * r.size());
          filled[h.arrays(a)] += r.size();
        }
        return absl::OkStatus();
      },
      check);
  if (!st.ok()) return st;
  for (const auto& [name, n] : filled) {
    if (n != d) {
      return absl::DataLossError(absl::StrCat("the servers' optimizer state: array '", name,
                                              "' came for ", n, " of the ", d,
                                              " parameters (the shards disagree on what they "
                                              "hold)"));
    }
  }
  out.frozen = frozen == 1;
  out.bias_steps = bias_steps;
  return out;
}

absl::Status PsClient::HandleReply(uint32_t server, std::vector<zmq::message_t>& frames,
                                   Replica* replica, Round* round) {
  data::Header h;
  const Grid& grid = grids_[round->grid];
  auto i = CheckReply(grid, server, round->step, data::REPLY, frames, &h);
  if (!i.ok()) return i.status();
  const Chunk& c = grid.chunks[*i];
  auto bad = [&](auto&&... parts) {
    return absl::DataLossError(absl::StrCat("bad reply from server ", server, " (",
                                            options_.server_endpoints[server], "): ", parts...));
  };
  const WorkerOptimizer& opt = *options_.optimizer;
  const StepKind kind = round->shard_kind[server];
  if (kind == StepKind::kLocal) return bad("a reply for a shard that sent nothing");
  if (h.codec() != opt.reply_codec(kind).name()) {
    return bad("codec '", h.codec(), "' (want ", opt.reply_codec(kind).name(), ")");
  }
  // Every server ends the warm-up at the same (coordinator-wide) step.
  if (round->last_warmup >= 0 && round->last_warmup != static_cast<int>(h.last_warmup())) {
    return bad("servers disagree on whether step ", round->step, " ends the warm-up");
  }
  round->last_warmup = h.last_warmup();
  const size_t need = opt.ReplyBytes(kind, c.range.begin, c.range.size(), h.last_warmup());
  if (frames.size() != 2 || h.payload_bytes() != need || frames[1].size() != need) {
    return bad("payload of ", frames.size() == 2 ? frames[1].size() : 0, " bytes, want ", need);
  }
  if (round->got[*i]) return bad("duplicate reply for chunk ", c.index);
  const uint64_t apply_start = MonotonicNs();
  absl::Status st =
      replica->Apply(round->step, round->lr, h.last_warmup(),
                     static_cast<const uint8_t*>(frames[1].data()), c.range.begin, c.range.size());
  apply_ns_ += MonotonicNs() - apply_start;
  if (!st.ok()) return bad(st.message());
  round->got[*i] = true;
  bytes_down_ += frames[0].size() + need;
  last_pushed_ns_ = std::max<uint64_t>(last_pushed_ns_, h.pushed_ns());
  first_sent_ns_ =
      first_sent_ns_ == 0 ? h.sent_ns() : std::min<uint64_t>(first_sent_ns_, h.sent_ns());
  return absl::OkStatus();
}

absl::Status PsClient::BeginStep(uint64_t step, std::optional<float> lr, bool defer_scale) {
  if (in_step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step_, " has begun and not completed"));
  }
  in_step_ = true;
  defer_scale_ = defer_scale;
  step_ = step;
  if (!first_step_) first_step_ = step;
  lr_ = lr;
  replica_begun_ = false;
  std::fill(pushed_.begin(), pushed_.end(), false);
  pushed_count_ = 0;
  pushed_before_last_ready_ = 0;
  ready_.clear();
  bytes_up_ = 0;
  bytes_down_ = 0;
  last_pushed_ns_ = 0;
  first_sent_ns_ = 0;
  start_ns_ = 0;
  send_ns_ = wait_ns_ = apply_ns_ = 0;
  return absl::OkStatus();
}

absl::Status PsClient::SetStepLr(std::optional<float> lr) {
  if (pushed_count_ > 0) {
    return absl::FailedPreconditionError("the step's pushes have gone out with another lr");
  }
  lr_ = lr;
  return absl::OkStatus();
}

float PsClient::StepLr() const {
  return lr_ ? *lr_ : LearningRate(options_.optimizer->options(), step_);
}

absl::Status PsClient::BeginReplicaStep(Replica* replica) {
  if (replica_begun_) return absl::OkStatus();
  replica_begun_ = true;
  const WorkerOptimizer& opt = *options_.optimizer;
  kind_ = opt.KindOf(step_, replica->phase());
  shard_kind_.assign(num_servers(), kind_);
  if (kind_ != StepKind::kLocal) {
    for (uint32_t k = 0; k < shard_kind_.size(); ++k) {
      shard_kind_[k] = opt.KindAt(step_, replica->phase(), options_.map.shard(k).begin);
    }
  }
  step_grid_ = kind_ == StepKind::kCompressed && !grids_[1].chunks.empty() ? 1 : 0;
  return replica->BeginStep(step_, StepLr());
}

absl::Status PsClient::PushChunk(size_t i, Replica* replica) {
  const uint64_t begin_ns = MonotonicNs();
  if (pushed_count_ == 0) start_ns_ = begin_ns;
  const WorkerOptimizer& opt = *options_.optimizer;
  if (defer_scale_ && !CanDeferScale(step_, replica->phase())) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step_, " pushes ", opt.push_codec(kind_).name(),
                     " that are not the gradient itself: its scale cannot follow the pushes"));
  }
  absl::Status st = SendChunk(
      step_grid().chunks[i], step_, opt.push_codec(kind_), data::PUSH,
      [&](const Range& r, uint8_t* out) { return replica->Push(step_, r.begin, r.size(), out); });
  send_ns_ += MonotonicNs() - begin_ns;
  if (!st.ok()) return st;
  pushed_[i] = true;
  ++pushed_count_;
  return absl::OkStatus();
}

absl::Status PsClient::PushReady(uint64_t b, uint64_t e, Replica* replica) {
  if (!in_step_) return absl::FailedPreconditionError("no step has begun");
  const uint64_t d = options_.map.num_params();
  if (b > e || e > d) {
    return absl::OutOfRangeError(
        absl::StrCat("gradient range [", b, ", ", e, ") is not within [0, ", d, ")"));
  }
  pushed_before_last_ready_ = pushed_count_;
  if (b == e) return absl::OkStatus();
  if (absl::Status st = BeginReplicaStep(replica); !st.ok()) return st;
  if (kind_ == StepKind::kLocal) return absl::OkStatus();  // nothing goes out
  // Merge [b, e) into the released ranges.
  auto it = ready_.upper_bound(b);
  if (it != ready_.begin() && std::prev(it)->second >= b) {
    --it;
    b = it->first;
  }
  while (it != ready_.end() && it->first <= e) {
    e = std::max(e, it->second);
    it = ready_.erase(it);
  }
  ready_[b] = e;
  // Push every chunk that [b, e) now covers, in the order of x.
  const Grid& grid = step_grid();
  auto first =
      std::lower_bound(grid.by_begin.begin(), grid.by_begin.end(), b,
                       [&](size_t i, uint64_t v) { return grid.chunks[i].range.begin < v; });
  for (auto c = first; c != grid.by_begin.end() && grid.chunks[*c].range.end <= e; ++c) {
    if (pushed_[*c] || shard_kind_[grid.chunks[*c].shard] == StepKind::kLocal) continue;
    if (absl::Status st = PushChunk(*c, replica); !st.ok()) return st;
  }
  return absl::OkStatus();
}

bool PsClient::CanDeferScale(uint64_t step, Phase phase) const {
  // A full-precision step pushes the gradient as it is, and no worker rule
  // keeps anything made from it (Apply sees only the reply): with fp32 on
  // the wire a server can scale it afterwards, exactly.
  const WorkerOptimizer& opt = *options_.optimizer;
  return opt.KindOf(step, phase) == StepKind::kFull &&
         opt.push_codec(StepKind::kFull).kind() == CodecKind::kFp32;
}

absl::Status PsClient::CompleteStep(Replica* replica, const Check& check,
                                    std::optional<float> grad_scale) {
  if (!in_step_) return absl::FailedPreconditionError("no step has begun");
  in_step_ = false;  // a failed step is not retried: the job fails
  if (absl::Status st = BeginReplicaStep(replica); !st.ok()) return st;
  step_chunks_ = chunks_overlapped_ = 0;
  if (pending_ && pending_->merge < step_) {
    return absl::InternalError(absl::StrCat("the replies of step ", pending_->step,
                                            " were to be merged at step ", pending_->merge,
                                            ", before step ", step_));
  }
  if (kind_ == StepKind::kLocal) {
    push_s_ = reply_s_ = 0;
    const uint64_t local_start = MonotonicNs();
    const uint64_t d = options_.map.num_params();
    if (absl::Status st = replica->LocalStep(step_, 0, d); !st.ok()) return st;
    if (pending_ && pending_->merge == step_) {
      // The sync that travelled during these steps: its replies, then the
      // merge.
      const uint64_t receive_ns = MonotonicNs();
      if (absl::Status st = ReceivePending(replica, check); !st.ok()) return st;
      const uint64_t receiving_ns = MonotonicNs() - receive_ns;
      wait_ns_ = receiving_ns > apply_ns_ ? receiving_ns - apply_ns_ : 0;
      for (uint32_t k = 0; k < pending_->shard_kind.size(); ++k) {
        const Range r = options_.map.shard(k);
        if (pending_->shard_kind[k] == StepKind::kLocal || r.size() == 0) continue;
        if (absl::Status st = replica->Merge(pending_->step, step_, r.begin, r.size()); !st.ok()) {
          return st;
        }
      }
      pending_.reset();
    }
    absl::Status st = replica->FinishStep(false);
    apply_ns_ = MonotonicNs() - local_start - wait_ns_;
    return st;
  }
  if (pending_) {
    return absl::InternalError(absl::StrCat("step ", step_, " syncs while the replies of step ",
                                            pending_->step, " are still to be merged at step ",
                                            pending_->merge));
  }
  if (grad_scale.has_value() != defer_scale_) {
    return absl::FailedPreconditionError(
        defer_scale_
            ? absl::StrCat("step ", step_, "'s pushes wait for a gradient scale; none given")
            : absl::StrCat("a gradient scale for step ", step_,
                           ", whose pushes were not made to wait for one"));
  }
  std::vector<size_t> expected(num_servers(), 0);
  for (size_t i = 0; i < step_grid().chunks.size(); ++i) {
    const uint32_t k = step_grid().chunks[i].shard;
    if (shard_kind_[k] == StepKind::kLocal) continue;
    ++expected[k];
    if (pushed_[i]) continue;
    if (absl::Status st = PushChunk(i, replica); !st.ok()) return st;
  }
  // The shards whose fragment does not sync this step: their part of the
  // step is local, while the others' replies are on their way.
  const uint64_t local_start = MonotonicNs();
  for (uint32_t k = 0; k < shard_kind_.size(); ++k) {
    if (shard_kind_[k] != StepKind::kLocal) continue;
    const Range r = options_.map.shard(k);
    if (absl::Status st = replica->LocalStep(step_, r.begin, r.size()); !st.ok()) return st;
  }
  const uint64_t local_ns = MonotonicNs() - local_start;
  Round round;
  round.step = step_;
  round.lr = StepLr();
  round.grid = step_grid_;
  round.shard_kind = shard_kind_;
  round.got.assign(step_grid().chunks.size(), false);
  round.merge = options_.optimizer->MergeStep(step_);
  if (round.merge > step_) {
    // The replies come while the next steps run (diloco's --sync_delay).
    if (defer_scale_) {
      return absl::FailedPreconditionError(
          "a gradient scale for a step whose replies are merged later");
    }
    round.outstanding = std::move(expected);
    pending_ = std::move(round);
    absl::Status st = replica->FinishStep(false);
    apply_ns_ = local_ns;
    push_s_ = reply_s_ = 0;
    step_chunks_ = pushed_count_;
    chunks_overlapped_ = pushed_before_last_ready_;
    return st;
  }
  if (defer_scale_) {
    Grid& fine = grids_[0];  // a GRAD_SCALE names a chunk of the warm-up's grid
    for (uint32_t k = 0; k < num_servers(); ++k) {
      if (fine.by_shard[k].empty()) continue;
      absl::Status st = SendHeader(fine.chunks[fine.by_shard[k][0]], step_, data::GRAD_SCALE,
                                   [&](data::Header& h) { h.set_grad_scale(*grad_scale); });
      if (!st.ok()) return st;
    }
  }
  const uint64_t receive_ns = MonotonicNs();
  absl::Status st = ReceiveAll(
      step_grid(), absl::StrCat("step ", step_),
      [&](uint32_t k, std::vector<zmq::message_t>& frames) {
        return HandleReply(k, frames, replica, &round);
      },
      check, expected);
  if (!st.ok()) return st;
  const uint64_t received_ns = MonotonicNs();
  if (absl::Status st = replica->FinishStep(round.last_warmup == 1); !st.ok()) return st;
  const uint64_t end_ns = MonotonicNs();
  // The replies were applied as they came: that time is not waiting.
  const uint64_t receiving_ns = received_ns - receive_ns;
  wait_ns_ = receiving_ns > apply_ns_ ? receiving_ns - apply_ns_ : 0;
  apply_ns_ += end_ns - received_ns + local_ns;
  auto seconds = [](uint64_t from, uint64_t to) { return to > from ? (to - from) * 1e-9 : 0.0; };
  push_s_ = seconds(start_ns_, last_pushed_ns_);
  reply_s_ = seconds(first_sent_ns_, end_ns);
  step_chunks_ = pushed_count_;
  chunks_overlapped_ = pushed_before_last_ready_;
  return absl::OkStatus();
}

bool PsClient::KeepEarlyReply(uint32_t k, std::vector<zmq::message_t>& frames) {
  if (pending_->outstanding[k] == 0 || frames.empty()) return false;
  auto h = ParseHeader(frames[0].data(), frames[0].size());
  if (!h.ok() || h->kind() != data::REPLY || h->step() != pending_->step) return false;
  pending_->early.emplace_back(k, std::move(frames));
  --pending_->outstanding[k];
  return true;
}

absl::Status PsClient::ReceivePending(Replica* replica, const Check& check) {
  if (absl::Status st = AwaitPending(check); !st.ok()) return st;
  Round& p = *pending_;
  for (auto& [k, frames] : p.early) {
    if (absl::Status st = HandleReply(k, frames, replica, &p); !st.ok()) return st;
  }
  p.early.clear();
  return absl::OkStatus();
}

absl::Status PsClient::AwaitPending(const Check& check) {
  if (!pending_) return absl::OkStatus();
  // Out of pending_ while it is received, so that ReceiveAll hands these
  // replies to `handle` rather than to KeepEarlyReply.
  Round p = std::move(*pending_);
  pending_.reset();
  absl::Status st = ReceiveAll(
      grids_[p.grid], absl::StrCat("step ", p.step, " (merged at step ", p.merge, ")"),
      [&](uint32_t k, std::vector<zmq::message_t>& frames) {
        p.early.emplace_back(k, std::move(frames));
        return absl::OkStatus();
      },
      check, p.outstanding);
  if (st.ok()) std::fill(p.outstanding.begin(), p.outstanding.end(), 0);
  pending_ = std::move(p);
  return st;
}

absl::Status PsClient::TakeReplies(Replica* replica, const Check& check) {
  if (!pending_) return absl::OkStatus();
  if (in_step_) return absl::FailedPreconditionError("TakeReplies: step under way");
  return ReceivePending(replica, check);
}

absl::Status PsClient::PushPull(uint64_t step, Replica* replica, const Check& check) {
  if (absl::Status st = BeginStep(step, std::nullopt); !st.ok()) return st;
  return CompleteStep(replica, check);
}

}  // namespace onebit
