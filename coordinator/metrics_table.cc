#include "coordinator/metrics_table.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

namespace onebit {

void MetricsTable::Resume(std::vector<MetricsRow> prior_rows) {
  prior_rows_ = std::move(prior_rows);
  for (const MetricsRow& r : prior_rows_) loss_watch_.Add(r.step, r.loss);
}

std::optional<std::string> MetricsTable::Add(uint32_t rank, const control::StepMetrics& m,
                                             uint64_t steps_done, uint64_t job_steps,
                                             size_t workers) {
  if (m.step() < taken_) return std::nullopt;  // written already, before a roll-back
  // Metrics come after their step completes (at most one step ahead of the
  // step count they arrive with, which may be sampled just before).
  if (m.step() > steps_done || (job_steps > 0 && m.step() >= job_steps)) {
    return absl::StrCat("a metrics row of worker ", rank, " for step ", m.step(), " (it has run ",
                        steps_done, ")");
  }
  auto& row = reports_[m.step()];
  row.resize(workers);
  row[rank] = m;
  return std::nullopt;
}

std::optional<MetricsRow> MetricsTable::Row(uint64_t step, size_t workers) const {
  auto it = reports_.find(step);
  if (it == reports_.end()) return std::nullopt;
  const auto& per_rank = it->second;
  if (per_rank.size() != workers) return std::nullopt;
  for (const auto& m : per_rank) {
    if (!m.has_value()) return std::nullopt;
  }
  MetricsRow r;
  r.step = step;
  r.phase = per_rank[0]->phase().empty() ? "warmup" : per_rank[0]->phase();
  double loss = 0;
  for (const auto& m : per_rank) {
    loss += m->loss();
    r.wall_s = std::max(r.wall_s, m->wall_s());
    r.step_s = std::max(r.step_s, m->step_s());
    r.push_s = std::max(r.push_s, m->push_s());
    r.reply_s = std::max(r.reply_s, m->reply_s());
    r.bytes_up += m->bytes_up();
    r.bytes_down += m->bytes_down();
  }
  r.loss = loss / static_cast<double>(per_rank.size());
  r.epoch = per_rank[0]->epoch();
  if (per_rank[0]->has_eval()) {
    r.test_loss = per_rank[0]->test_loss();
    r.test_accuracy = per_rank[0]->test_accuracy();
  }
  return r;
}

std::vector<MetricsRow> MetricsTable::Rows(size_t workers) const {
  std::vector<MetricsRow> rows = prior_rows_;
  for (const auto& entry : reports_) {
    if (auto r = Row(entry.first, workers)) rows.push_back(*std::move(r));
  }
  return rows;
}

std::vector<MetricsRow> MetricsTable::TakeNew(size_t workers,
                                              absl::FunctionRef<std::string()> remedy) {
  std::vector<MetricsRow> rows;
  while (auto r = Row(taken_, workers)) {
    if (auto warning = loss_watch_.Add(r->step, r->loss)) {
      std::fprintf(stderr, "coordinator: warning: %s; try %s\n", warning->c_str(),
                   remedy().c_str());
    }
    rows.push_back(*std::move(r));
    ++taken_;
  }
  return rows;
}

void MetricsTable::DropUntaken() { reports_.erase(reports_.lower_bound(taken_), reports_.end()); }

}  // namespace onebit
