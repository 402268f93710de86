#include "checkpoint/optimizer_state.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace onebit {
namespace {

// The per-element arrays of a shard, by section name.
std::vector<std::pair<const char*, std::vector<float> ServerShardState::*>> ShardArrays() {
  return {{"x", &ServerShardState::x},
          {"m", &ServerShardState::m},
          {"v", &ServerShardState::v},
          {"den", &ServerShardState::den},
          {"e", &ServerShardState::e},
          {"v_check", &ServerShardState::v_check},
          {"replica", &ServerShardState::replica}};
}

// A worker's arrays, by section name; x (the first) only where no other
// file holds it (WorkerFileOmits).
std::vector<std::pair<const char*, std::vector<float> WorkerState::*>> WorkerArrays() {
  return {{"x", &WorkerState::x}, {"mbar", &WorkerState::mbar},
          {"e", &WorkerState::e}, {"den", &WorkerState::den},
          {"v", &WorkerState::v}, {"x_sync", &WorkerState::x_sync}};
}

// A layer-wise shard's layers as global [first, second) pairs, 16
// little-endian bytes each.
std::string LayerBytes(const ServerShardState& s) {
  std::string out;
  out.reserve(16 * s.layers.size());
  for (const auto& [first, second] : s.layers) {
    for (uint64_t v : {s.begin + first, s.begin + second}) {
      out += LittleEndianU32(static_cast<uint32_t>(v));
      out += LittleEndianU32(static_cast<uint32_t>(v >> 32));
    }
  }
  return out;
}

absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> ReadLayers(const StateReader& r) {
  auto bytes = r.Bytes("layers");
  if (!bytes.ok()) return bytes.status();
  if (bytes->size() % 16 != 0) {
    return absl::DataLossError(absl::StrCat("server ", r.header().rank(),
                                            "'s state file: section 'layers' has ", bytes->size(),
                                            " bytes, not a multiple of 16"));
  }
  std::vector<std::pair<uint64_t, uint64_t>> out(bytes->size() / 16);
  auto u64 = [&bytes](size_t at) {
    return ReadLittleEndianU32(bytes->data() + at) |
           uint64_t{ReadLittleEndianU32(bytes->data() + at + 4)} << 32;
  };
  for (size_t j = 0; j < out.size(); ++j) out[j] = {u64(16 * j), u64(16 * j + 8)};
  return out;
}

// A float as text that reads back as the same float (9 significant digits).
std::string FloatText(float v) { return absl::StrFormat("%.9g", v); }

bool HasSection(const StateReader& r, const char* name) {
  for (const auto& s : r.header().sections()) {
    if (s.name() == name) return true;
  }
  return false;
}

absl::StatusOr<uint64_t> U64Value(const StateReader& r, const char* key) {
  auto text = r.Value(key);
  if (!text.ok()) return text.status();
  uint64_t v = 0;
  if (!absl::SimpleAtoi(*text, &v)) {
    return absl::DataLossError(absl::StrCat("value '", key, "' is '", *text, "', not a count"));
  }
  return v;
}

}  // namespace

StateWriter SaveServerShard(const ServerShardState& s, bool with_den,
                            std::shared_ptr<SnapshotBuffers> buffers,
                            std::optional<uint64_t> step) {
  const uint64_t of = step.value_or(s.step);
  checkpoint::StateHeader h;
  h.set_step(of);
  h.set_role("server");
  h.set_rank(s.shard);
  h.set_begin(s.begin);
  h.set_end(s.begin + s.x.size());
  StateWriter w(std::move(h));
  for (const auto& [name, field] : ShardArrays()) {
    if (field == &ServerShardState::den && !with_den) continue;
    if ((s.*field).empty()) continue;
    w.AddFloats(name, buffers != nullptr ? buffers->Copy(s.*field) : SnapshotFloats(s.*field));
  }
  // Per layer (onebit-lamb): the values and where each layer lies. Their
  // floats go in as bytes, so that these few do not take the places of
  // the shard's arrays among the buffers kept for the next snapshot.
  if (!s.layers.empty()) {
    for (const auto& [name, values] :
         {std::pair{"lamb_coeff", &s.lamb_coeff}, std::pair{"lamb_factor", &s.lamb_factor}}) {
      w.AddBytes(name, absl::string_view(reinterpret_cast<const char*>(values->data()),
                                         sizeof(float) * values->size()));
    }
    w.AddBytes("layers", LayerBytes(s));
  }
  w.ReturnBuffersTo(std::move(buffers));
  w.SetValue("step", absl::StrCat(of));
  w.SetValue("frozen", s.frozen ? "1" : "0");
  w.SetValue("floored", absl::StrCat(s.floored));
  // Only in a seeded job's files: one without it counts from 0.
  if (s.bias_steps != 0) w.SetValue("bias_steps", absl::StrCat(s.bias_steps));
  return w;
}

absl::Status LoadServerShard(const std::vector<const StateReader*>& files, uint64_t begin,
                             uint64_t end, ServerShardState* s) {
  return LoadServerArrays(files, begin, end, {}, s);
}

absl::Status LoadServerArrays(const std::vector<const StateReader*>& files, uint64_t begin,
                              uint64_t end, const std::vector<std::string>& only,
                              ServerShardState* s) {
  auto wanted = [&only](const char* name) {
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  };
  if (files.empty()) return absl::NotFoundError("no server state files to restore a shard from");
  // The arrays a job keeps show in any file with elements (an empty shard
  // saves none).
  const StateReader* model = files[0];
  for (const StateReader* r : files) {
    if (r->header().end() > r->header().begin()) {
      model = r;
      break;
    }
  }
  const StateReader& first = *model;
  auto step = U64Value(first, "step");
  auto frozen = first.Value("frozen");
  if (!step.ok()) return step.status();
  if (!frozen.ok()) return frozen.status();
  const uint64_t n = end - begin;
  ServerShardState out;
  out.shard = s->shard;
  out.begin = begin;
  out.step = *step;
  out.frozen = *frozen == "1";
  if (first.header().values().count("bias_steps") > 0) {
    auto bias = U64Value(first, "bias_steps");
    if (!bias.ok()) return bias.status();
    out.bias_steps = *bias;
  }
  for (const auto& [name, field] : ShardArrays()) {
    if (HasSection(first, name) && wanted(name)) (out.*field).assign(n, 0.0f);
  }
  // The layers of [begin, end) with their values, from whichever files hold them.
  const bool layered = HasSection(first, "layers") && wanted("lamb_coeff");
  struct Layer {
    uint64_t first, second;
    float coeff, factor;
  };
  std::vector<Layer> layers;
  uint64_t covered = 0;
  for (const StateReader* r : files) {
    const checkpoint::StateHeader& h = r->header();
    auto file_step = U64Value(*r, "step");
    auto file_frozen = r->Value("frozen");
    if (!file_step.ok()) return file_step.status();
    if (!file_frozen.ok()) return file_frozen.status();
    if (*file_step != out.step || (*file_frozen == "1") != out.frozen) {
      return absl::DataLossError(absl::StrCat(
          "server ", h.rank(), "'s state file is of step ", *file_step, " (frozen ", *file_frozen,
          "), server ", first.header().rank(), "'s of step ", out.step, ": not one checkpoint"));
    }
    const uint64_t lo = std::max(begin, h.begin()), hi = std::min(end, h.end());
    if (h.begin() >= begin && h.begin() < end) {
      auto floored = U64Value(*r, "floored");
      if (!floored.ok()) return floored.status();
      out.floored += *floored;
    }
    if (lo >= hi) continue;
    covered += hi - lo;
    if (layered != (HasSection(*r, "layers") && wanted("lamb_coeff"))) {
      return absl::DataLossError(absl::StrCat("server ", h.rank(), "'s state file ",
                                              layered ? "lacks" : "has", " 'layers' where server ",
                                              first.header().rank(), "'s does not"));
    }
    if (layered) {
      auto ranges = ReadLayers(*r);
      if (!ranges.ok()) return ranges.status();
      auto coeff = r->Floats("lamb_coeff", ranges->size());
      if (!coeff.ok()) return coeff.status();
      auto factor = r->Floats("lamb_factor", ranges->size());
      if (!factor.ok()) return factor.status();
      for (size_t j = 0; j < ranges->size(); ++j) {
        const auto [f, e] = (*ranges)[j];
        if (!(e > begin && f < end)) continue;  // as LayerPieces decides
        if (f < begin || e > end) {
          return absl::DataLossError(absl::StrCat("server ", h.rank(), "'s state file has layer [",
                                                  f, ", ", e, "), which crosses the shard [", begin,
                                                  ", ", end, ")"));
        }
        layers.push_back({f, e, (*coeff)[j], (*factor)[j]});
      }
    }
    for (const auto& [name, field] : ShardArrays()) {
      if (!wanted(name)) continue;
      if ((out.*field).empty() != !HasSection(*r, name)) {
        return absl::DataLossError(absl::StrCat(
            "server ", h.rank(), "'s state file ", HasSection(*r, name) ? "has" : "lacks", " '",
            name, "' where server ", first.header().rank(), "'s does not"));
      }
      if ((out.*field).empty()) continue;
      auto values = r->Floats(name, h.end() - h.begin());
      if (!values.ok()) return values.status();
      std::copy(values->begin() + (lo - h.begin()), values->begin() + (hi - h.begin()),
                (out.*field).begin() + (lo - begin));
    }
  }
  // Shards do not overlap, so the pieces cover [begin, end) when they add up.
  if (covered != n) {
    return absl::DataLossError(absl::StrCat("the server state files cover ", covered, " of the ", n,
                                            " elements of [", begin, ", ", end, ")"));
  }
  std::sort(layers.begin(), layers.end(),
            [](const Layer& a, const Layer& b) { return a.first < b.first; });
  for (const Layer& l : layers) {
    out.layers.emplace_back(l.first - begin, l.second - begin);
    out.lamb_coeff.push_back(l.coeff);
    out.lamb_factor.push_back(l.factor);
  }
  *s = std::move(out);
  return absl::OkStatus();
}

StateWriter SaveWorkerState(const WorkerState& s, uint32_t rank, uint64_t step) {
  WorkerState copy;
  for (const auto& [name, field] : WorkerArrays()) {
    if (field != &WorkerState::x) copy.*field = s.*field;
  }
  copy.lrs = s.lrs;
  copy.frozen = s.frozen;
  return SaveWorkerState(std::move(copy), rank, step, s.x.size());
}

StateWriter SaveWorkerState(WorkerState&& s, uint32_t rank, uint64_t step, uint64_t d) {
  checkpoint::StateHeader h;
  h.set_step(step);
  h.set_role("worker");
  h.set_rank(rank);
  h.set_begin(0);
  h.set_end(d);
  StateWriter w(std::move(h));
  // The learning rates since the last synchronisation (a worker that keeps
  // x_sync); not a function of the step where the program sets them.
  if (!s.x_sync.empty()) w.SetValue("lrs", FloatText(s.lrs));
  for (const auto& [name, field] : WorkerArrays()) {
    if (!(s.*field).empty()) w.AddFloats(name, std::move(s.*field));
  }
  w.SetValue("frozen", s.frozen ? "1" : "0");
  return w;
}

absl::Status LoadWorkerState(const StateReader& file, uint64_t d, WorkerState* s) {
  if (file.header().end() != d) {
    return absl::DataLossError(absl::StrCat("worker ", file.header().rank(),
                                            "'s state file is of d = ", file.header().end(),
                                            ", the job's model has d = ", d));
  }
  auto frozen = file.Value("frozen");
  if (!frozen.ok()) return frozen.status();
  WorkerState out;
  out.x = std::move(s->x);
  for (const auto& [name, field] : WorkerArrays()) {
    if (!HasSection(file, name)) continue;
    auto values = file.Floats(name, d);
    if (!values.ok()) return values.status();
    out.*field = *std::move(values);
  }
  if (!out.x_sync.empty()) {
    auto lrs = file.Value("lrs");
    if (!lrs.ok()) return lrs.status();
    if (!absl::SimpleAtof(*lrs, &out.lrs)) {
      return absl::DataLossError(absl::StrCat("worker ", file.header().rank(),
                                              "'s state file: value 'lrs' is '", *lrs,
                                              "', not a number"));
    }
  }
  out.frozen = *frozen == "1";
  *s = std::move(out);
  return absl::OkStatus();
}

WorkerFileOmits WorkerOmits(const OptimizerOptions& o, uint32_t rank) {
  WorkerFileOmits omit;
  // (A delta reply leaves each worker its own momentum; the naive variant
  // keeps none.)
  const AlgorithmTraits& t = TraitsOf(o.kind);
  omit.mbar = rank != 0 && o.reply == ReplyMode::kMomentum && t.worker_momentum && !t.local_model;
  omit.den = t.den_of_frozen_v;
  omit.x = !t.local_model;
  return omit;
}

absl::Status RestoreDenominators(float eps, ServerShardState* s) {
  if (!s->frozen || !s->den.empty() || s->v.empty()) return absl::OkStatus();
  std::vector<float> den(s->v.size());
  absl::Status st = HandOverDenominators(s->v.data(), s->v.size(), s->begin, eps, den.data());
  if (!st.ok()) return st;
  s->den = std::move(den);
  return absl::OkStatus();
}

absl::Status CompleteWorkerState(const StateReader& worker0,
                                 const std::vector<const StateReader*>& servers, uint64_t d,
                                 float eps, WorkerState* s) {
  if (s->mbar.empty() && HasSection(worker0, "mbar")) {
    auto mbar = worker0.Floats("mbar", d);
    if (!mbar.ok()) return mbar.status();
    s->mbar = *std::move(mbar);
  }
  if (s->frozen && s->den.empty() && !servers.empty()) {
    ServerShardState all;  // (den stays empty where the servers keep none)
    absl::Status st = LoadServerArrays(servers, 0, d, {"den", "v"}, &all);
    if (st.ok()) st = RestoreDenominators(eps, &all);
    if (!st.ok()) return st;
    s->den = std::move(all.den);
  }
  return absl::OkStatus();
}

absl::Status LoadWorkerStateResized(const std::vector<std::string>& paths, uint32_t rank,
                                    uint64_t d, WorkerState* s) {
  if (paths.empty()) return absl::NotFoundError("no worker state files to resume from");
  const size_t n = paths.size();
  std::vector<double> sum;
  bool has_e = false;
  WorkerState mine;
  mine.x = std::move(s->x);
  for (size_t w = 0; w < n; ++w) {
    auto file = StateReader::Open(paths[w]);
    if (!file.ok()) return file.status();
    WorkerState old;
    absl::Status st = LoadWorkerState(*file, d, &old);
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat(paths[w], ": ", st.message()));
    if (w == 0) has_e = !old.e.empty();
    if (old.e.empty() == has_e) {
      return absl::DataLossError(absl::StrCat(paths[w], ": ", has_e ? "lacks" : "has",
                                              " a worker error where ", paths[0],
                                              has_e ? " has one" : " has none"));
    }
    if (has_e) {
      sum.resize(d, 0.0);
      for (uint64_t i = 0; i < d; ++i) sum[i] += old.e[i];
    }
    if (w == rank % n) {
      old.x = std::move(mine.x);
      mine = std::move(old);
    }
  }
  if (has_e) {
    for (uint64_t i = 0; i < d; ++i)
      mine.e[i] = static_cast<float>(sum[i] / static_cast<double>(n));
  }
  *s = std::move(mine);
  return absl::OkStatus();
}

}  // namespace onebit
