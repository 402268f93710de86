// onebit-reference: the single-process reference of docs/design.md §1.5. Takes the
// same config flags as onebit-launch and runs the whole job in this process,
// with no network, through the same optimizer code. Its x is what every
// distributed run of the same config must end with, bit for bit.
#include <cstdio>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "job/config.h"
#include "job/flags.h"
#include "job/loss_watch.h"
#include "job/run_folder.h"
#include "models/model.h"
#include "optim/reference.h"
#include "util/memory.h"

ABSL_FLAG(std::string, out, "",
          "folder for metrics.csv, summary.json and the final x (replica_w<R>.f32, "
          "master_s<K>.f32, error_s<K>.f32, as onebit-launch --dump_params)");

namespace onebit {
namespace {

int Main(int argc, char** argv) {
  const control::TrainingConfig cfg = ConfigFromCommandLineOrExit(
      argc, argv,
      "onebit-reference --workers N --servers S [--optimizer ...] [--out DIR]\n"
      "Runs the job in one process: the oracle a distributed run must equal bit for bit.");
  // d is resolved (job/config.h), so the memory is checked before the
  // model or anything else of d's size is built.
  auto layers = ModelLayerEnds(cfg);
  if (!layers.ok()) ExitError(2, std::string(layers.status().message()));
  auto map = ShardMapForConfig(cfg, *layers);
  if (!map.ok()) ExitError(1, std::string(map.status().message()));
  ReferenceOptions o;
  o.workers = cfg.cluster().workers();
  o.local_ranks = cfg.cluster().local_ranks();
  o.map = *map;
  o.steps = cfg.model().steps();
  o.optimizer = *OptimizerOptionsFromConfig(cfg);  // validated by ConfigFromFlags
  o.optimizer.layer_ends = *layers;
  o.freeze = *FreezeOptionsFromConfig(cfg);
  const StateSize size = ReferenceSize(o);
  if (absl::Status st = CheckMemory(absl::StrCat("the reference of this job (d = ",
                                                 cfg.model().dim(), ", ", size.arrays, ")"),
                                    size.bytes);
      !st.ok()) {
    ExitError(2, st.message());
  }
  auto model = NewModel(cfg);
  if (!model.ok()) ExitError(1, std::string(model.status().message()));
  if ((*model)->num_params() != cfg.model().dim()) {
    ExitError(1, absl::StrCat("the model has ", (*model)->num_params(), " parameters, the job ",
                              cfg.model().dim()));
  }
  std::vector<float> x0((*model)->num_params());
  (*model)->Init(x0.data());
  auto r = RunReference(o, x0, [&](const float* x, uint32_t rank, uint64_t step, float* g) {
    return (*model)->Gradient(x, rank, step, g);
  });
  if (!r.ok()) ExitError(1, absl::StrCat("reference: ", r.status().message()));
  const uint64_t freeze = r->freeze_step;
  std::fprintf(stderr, "reference: %llu steps (%llu rounds), final loss %.9g, freeze step %s\n",
               static_cast<unsigned long long>(cfg.model().steps()),
               static_cast<unsigned long long>(r->rounds), r->losses.back(),
               freeze == kNever ? "none" : absl::StrCat(freeze).c_str());

  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return 0;
  absl::Status st = MakeDirs(out);
  std::vector<MetricsRow> rows;
  run::Summary s;
  s.set_optimizer(EnumText(cfg.optimizer().algorithm()));
  s.set_lr(cfg.optimizer().lr());
  s.set_workers(cfg.cluster().workers());
  s.set_servers(cfg.cluster().servers());
  s.set_params(map->num_params());
  s.set_steps(cfg.model().steps());
  s.set_worker_codec(EnumText(cfg.compression().worker_codec()));
  s.set_server_codec(EnumText(cfg.compression().server_codec()));
  s.set_error_feedback(EnumText(cfg.compression().error_feedback()));
  s.set_server_reply(EnumText(cfg.compression().server_reply()));
  s.set_v_floor(cfg.optimizer().v_floor());
  s.set_freeze(FreezeText(cfg));
  s.set_rounds(r->rounds);
  s.set_status("ok");
  LossWatch watch;
  for (uint64_t t = 0; t < cfg.model().steps(); ++t) {
    MetricsRow row;
    row.step = t;
    row.phase = freeze != kNever && t >= freeze ? "compress" : "warmup";
    row.loss = r->losses[t];
    if (auto warning = watch.Add(t, row.loss)) {
      std::fprintf(stderr, "reference: warning: %s; try %s\n", warning->c_str(),
                   DivergenceRemedy(o.optimizer).c_str());
    }
    row.bytes_up = r->push_bytes[t];  // payload only: no headers without a network
    row.bytes_down = r->reply_bytes[t];
    rows.push_back(row);
    s.set_bytes_up(s.bytes_up() + row.bytes_up);
    s.set_bytes_down(s.bytes_down() + row.bytes_down);
  }
  const uint64_t fp32 = map->num_params() * 4 * cfg.cluster().workers() * cfg.model().steps();
  s.set_bytes_up_fp32(fp32);
  s.set_bytes_down_fp32(fp32);
  if (freeze != kNever && freeze < cfg.model().steps()) s.set_freeze_step(freeze);
  s.set_final_loss(r->losses.back());
  s.set_diverged(watch.diverged());
  bool equal = true;
  uint64_t floored = 0;
  for (const ServerShardState& k : r->servers) {
    floored += k.floored;
    for (size_t i = 0; i < k.x.size(); ++i) equal &= k.x[i] == r->workers[0].x[k.begin + i];
  }
  s.set_v_floored(floored);
  s.set_replicas_equal(equal);
  bool agree = true;
  for (uint32_t w = 0; st.ok() && w < r->workers.size(); ++w) {
    agree &= r->workers[w].x == r->workers[0].x;
    st = WriteFloats(absl::StrCat(out, "/replica_w", w, ".f32"), r->workers[w].x);
  }
  s.set_workers_agree(agree);
  for (uint32_t k = 0; st.ok() && k < r->servers.size(); ++k) {
    st = WriteFloats(absl::StrCat(out, "/master_s", k, ".f32"), r->servers[k].x);
    if (st.ok()) st = WriteFloats(absl::StrCat(out, "/error_s", k, ".f32"), r->servers[k].e);
  }
  if (st.ok()) st = WriteMetricsCsv(out + "/metrics.csv", rows);
  if (st.ok()) st = WriteSummaryJson(out + "/summary.json", s);
  if (!st.ok()) ExitError(1, std::string(st.message()));
  return 0;
}

}  // namespace
}  // namespace onebit

int main(int argc, char** argv) { return onebit::Main(argc, argv); }
