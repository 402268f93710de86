// Trains softmax.h's model with 1-bit Adam over onebit-ps's servers, e.g.
//   onebit-launch --workers 4 --servers 2 --model external
//     --optimizer onebit-adam --worker-cmd 'softmax_train --steps 300'
// Each worker takes its own batches; rank 0 reports the test accuracy.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "onebit/worker.h"
#include "softmax.h"

int main(int argc, char** argv) {
  std::string data = "/usr/share/datasets/fashion-mnist";
  uint64_t steps = 300;
  size_t batch = 32, max_train = 60000;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      std::printf(
          "usage: softmax_train [--data DIR] [--steps N] [--batch B] [--max_train N]\n"
          "A worker of a onebit-ps job (onebit-launch --worker-cmd sets ONEBIT_COORDINATOR).\n");
      return 0;
    }
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--data")
      data = argv[i + 1];
    else if (k == "--steps")
      steps = std::strtoull(argv[i + 1], nullptr, 10);
    else if (k == "--batch")
      batch = std::strtoul(argv[i + 1], nullptr, 10);
    else if (k == "--max_train")
      max_train = std::strtoul(argv[i + 1], nullptr, 10);
    else
      return std::fprintf(stderr, "unknown argument %s\n", k.c_str()), 2;
  }
  softmax::Data train, test;
  std::string err = softmax::Load(data + "/train-images-idx3-ubyte.gz",
                                  data + "/train-labels-idx1-ubyte.gz", max_train, &train);
  if (err.empty()) {
    err = softmax::Load(data + "/t10k-images-idx3-ubyte.gz", data + "/t10k-labels-idx1-ubyte.gz",
                        10000, &test);
  }
  if (!err.empty()) return std::fprintf(stderr, "softmax_train: %s\n", err.c_str()), 1;

  // --- onebit-ps: join the job, share rank 0's start, step, finish. ---
  auto options = onebit::WorkerOptionsFromEnvironment(softmax::kParams);
  if (!options.ok()) return std::fprintf(stderr, "%s\n", options.status().ToString().c_str()), 1;
  auto worker = onebit::Worker::Connect(*options);
  if (!worker.ok()) return std::fprintf(stderr, "%s\n", worker.status().ToString().c_str()), 1;
  onebit::Worker& w = **worker;
  softmax::Init(w.rank() + 1, w.params());  // each rank its own: rank 0's wins
  if (absl::Status st = w.BroadcastParameters(); !st.ok()) {
    return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
  }
  if (w.job().steps > 0) steps = w.job().steps;  // the job may fix the length
  // From steps_done(): a job resumed from a checkpoint starts there, and a
  // roll-back (a lost process came back) goes back there.
  for (uint64_t t = w.steps_done(); t < steps; t = w.steps_done()) {
    onebit::StepOptions s;
    s.loss = softmax::Gradient(train, w.params(), (t * w.job().workers + w.rank()) * batch, batch,
                               w.grads());
    auto stats = w.Step(s);
    if (!stats.ok() && !onebit::IsRolledBack(stats.status())) {
      return std::fprintf(stderr, "%s\n", stats.status().ToString().c_str()), 1;
    }
  }
  // --- end of onebit-ps ---

  if (w.rank() == 0) {
    std::printf("softmax_train: %llu steps, test accuracy %.4f\n",
                static_cast<unsigned long long>(steps), softmax::Accuracy(test, w.params()));
  }
  if (const char* dump = std::getenv("ONEBIT_DUMP_X")) {  // onebit-launch --dump_params
    std::ofstream(dump, std::ios::binary)
        .write(reinterpret_cast<const char*>(w.params()), 4 * softmax::kParams);
  }
  absl::Status st = w.Finish();
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
  return 0;
}
