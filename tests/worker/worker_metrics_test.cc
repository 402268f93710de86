// WorkerMetrics (worker/worker_metrics.h): what one step adds, with values
// worked out by hand.
#include "worker/worker_metrics.h"

#include <map>
#include <string>

#include "gtest/gtest.h"
#include "metrics/endpoint.h"
#include "prometheus/metric_family.h"

namespace onebit {
namespace {

// The value of series `name` with exactly `labels` beyond role and rank
// (a histogram: its count, or with "sum" its sum); -1 when there is none.
double Value(MetricsEndpoint& e, const std::string& name,
             std::map<std::string, std::string> labels = {}, bool sum = false) {
  labels["role"] = "worker";
  labels["rank"] = "2";
  for (const prometheus::MetricFamily& f : e.registry().Collect()) {
    if (f.name != name) continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      std::map<std::string, std::string> have;
      for (const prometheus::ClientMetric::Label& l : m.label) have[l.name] = l.value;
      if (have != labels) continue;
      if (f.type == prometheus::MetricType::Counter) return m.counter.value;
      if (f.type == prometheus::MetricType::Gauge) return m.gauge.value;
      return sum ? m.histogram.sample_sum : static_cast<double>(m.histogram.sample_count);
    }
  }
  return -1;
}

TEST(WorkerMetrics, AStepAddsItsBytesToItsPhaseAndItsPartsToTheirHistograms) {
  auto e = MetricsEndpoint::Start("127.0.0.1", 0, {{"role", "worker"}});
  ASSERT_TRUE(e.ok()) << e.status();
  MetricsEndpoint& ep = **e;
  WorkerMetrics m(&ep, 2, /*num_params=*/1000);  // fp32: 4000 bytes a step
  // Absent until reported, not 0.
  EXPECT_EQ(Value(ep, "onebit_worker_loss"), -1);

  WorkerStepSample warm;
  warm.steps_done = 1;
  warm.bytes_up = 4100;
  warm.bytes_down = 4200;
  warm.step_s = 0.5;
  warm.gradient_s = 0.25;
  warm.push_s = 0.125;
  warm.wait_s = 0.25;
  warm.apply_s = 0.0625;
  warm.chunks = 4;
  warm.chunks_overlapped = 3;
  warm.has_loss = true;
  warm.loss = 2.5;
  m.StepDone(warm);
  WorkerStepSample comp = warm;
  comp.steps_done = 2;
  comp.compressed = true;
  comp.bytes_up = 200;
  comp.bytes_down = 300;
  comp.has_loss = false;
  m.StepDone(comp);
  WorkerStepSample local = comp;
  local.steps_done = 3;
  local.local = true;
  local.bytes_up = local.bytes_down = 0;
  m.StepDone(local);

  EXPECT_EQ(Value(ep, "onebit_worker_steps"), 3);
  EXPECT_EQ(Value(ep, "onebit_worker_compression_phase"), 1);
  EXPECT_EQ(Value(ep, "onebit_worker_sent_bytes_total", {{"direction", "up"}, {"phase", "warmup"}}),
            4100);
  EXPECT_EQ(
      Value(ep, "onebit_worker_sent_bytes_total", {{"direction", "up"}, {"phase", "compress"}}),
      200);
  EXPECT_EQ(
      Value(ep, "onebit_worker_sent_bytes_total", {{"direction", "down"}, {"phase", "compress"}}),
      300);
  // The last step that communicated in the compression phase, over 4·d;
  // the local step after it changes nothing.
  EXPECT_DOUBLE_EQ(Value(ep, "onebit_worker_compression_ratio", {{"direction", "up"}}), 0.05);
  EXPECT_DOUBLE_EQ(Value(ep, "onebit_worker_compression_ratio", {{"direction", "down"}}), 0.075);
  EXPECT_EQ(Value(ep, "onebit_worker_rounds_total"), 2);
  EXPECT_EQ(Value(ep, "onebit_worker_local_steps_total"), 1);
  EXPECT_EQ(Value(ep, "onebit_worker_pushed_chunks_total"), 12);
  EXPECT_EQ(Value(ep, "onebit_worker_overlapped_chunks_total"), 9);
  EXPECT_EQ(Value(ep, "onebit_worker_step_seconds"), 3);
  EXPECT_DOUBLE_EQ(Value(ep, "onebit_worker_step_seconds", {}, true), 1.5);
  EXPECT_EQ(Value(ep, "onebit_worker_step_part_seconds", {{"part", "gradient"}}), 3);
  EXPECT_DOUBLE_EQ(Value(ep, "onebit_worker_step_part_seconds", {{"part", "push"}}, true), 0.375);
  EXPECT_DOUBLE_EQ(Value(ep, "onebit_worker_step_part_seconds", {{"part", "apply"}}, true), 0.1875);
  // The loss last reported: the steps after reported none.
  EXPECT_EQ(Value(ep, "onebit_worker_loss"), 2.5);
}

}  // namespace
}  // namespace onebit
