// The Python binding of include/onebit/worker.h: the Worker, its buffers as
// writable Python buffers (torch.frombuffer views them without a copy), and
// absl::Status errors as onebit_ps.OnebitError. Blocking calls release the
// GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dlpack/dlpack.h"
#include "onebit/worker.h"

namespace py = pybind11;

namespace {

PyObject* g_error = nullptr;        // onebit_ps.OnebitError, set at import
PyObject* g_stopped = nullptr;      // _onebit.Stopped (CANCELLED), a kind of it
PyObject* g_rolled_back = nullptr;  // _onebit.RolledBack (onebit::IsRolledBack), another

[[noreturn]] void Raise(const absl::Status& st) {
  PyObject* type = absl::IsCancelled(st)      ? g_stopped
                   : onebit::IsRolledBack(st) ? g_rolled_back
                                              : g_error;
  PyErr_SetString(type, std::string(st.message()).c_str());
  throw py::error_already_set();
}

void Check(const absl::Status& st) {
  if (!st.ok()) Raise(st);
}

// One of the worker's flat buffers as a DLPack tensor (torch.from_dlpack):
// a view, no copy, on the GPU where the worker's buffers are. It holds a
// reference to the Python Worker, so the memory outlives every tensor made
// from it.
struct DlpackView {
  DLManagedTensor managed{};
  int64_t shape[1] = {0};
  PyObject* owner = nullptr;
};

bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

void DeleteDlpackView(DLManagedTensor* t) {
  auto* v = static_cast<DlpackView*>(t->manager_ctx);
  // A tensor freed while the interpreter shuts down (or after) must not take
  // the GIL: that blocks the exiting thread for ever. The owner's reference
  // is dropped with the process instead.
  if (Py_IsInitialized() && !Finalizing()) {
    py::gil_scoped_acquire gil;
    Py_XDECREF(v->owner);
  }
  delete v;
}

py::capsule Dlpack(py::object owner, onebit::Worker& w, float* p) {
  auto* v = new DlpackView;
  v->owner = owner.release().ptr();
  v->shape[0] = static_cast<int64_t>(w.num_params());
  DLTensor& t = v->managed.dl_tensor;
  t.data = p;
  // "cuda:N (name)" is GPU memory; "cpu" and the CPU twin of the GPU path
  // ("cuda-twin") are host memory.
  const std::string& dev = w.device();
  t.device = {kDLCPU, 0};
  if (dev.rfind("cuda:", 0) == 0) {
    t.device = {kDLCUDA, std::atoi(dev.c_str() + 5)};
  }
  t.ndim = 1;
  t.dtype = {kDLFloat, 32, 1};
  t.shape = v->shape;
  t.strides = nullptr;  // compact
  t.byte_offset = 0;
  v->managed.manager_ctx = v;
  v->managed.deleter = DeleteDlpackView;
  // A capsule nobody consumed frees its tensor; a consumer renames it
  // ("used_dltensor") and calls the deleter itself.
  return py::capsule(&v->managed, "dltensor", [](PyObject* c) {
    if (PyCapsule_IsValid(c, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
      m->deleter(m);
    }
  });
}

std::unique_ptr<onebit::Worker> Connect(
    const std::string& coordinator, int rank, uint64_t num_params, const std::string& device,
    const std::string& advertise_host, const std::vector<std::tuple<uint64_t, uint64_t, float>>& wd,
    const std::map<std::string, std::string>& settings, double register_timeout_s,
    const std::string& secret_file, bool insecure, const std::vector<uint64_t>& layer_ends,
    const std::vector<std::pair<std::string, uint32_t>>& local_state, int metrics_port,
    const std::string& metrics_host, double metrics_linger_s,
    const std::vector<std::tuple<uint64_t, uint64_t, float>>& lr_scale, int local_rank) {
  onebit::WorkerOptions o;
  if (coordinator.empty()) {
    auto env = onebit::WorkerOptionsFromEnvironment(num_params);
    if (!env.ok()) Raise(env.status());
    o = *env;
  } else {
    o.coordinator = coordinator;
    o.rank = rank;
    o.num_params = num_params;
  }
  if (local_rank >= 0) o.local_rank = local_rank;  // below 0: as the environment says
  if (!secret_file.empty()) o.secret_file = secret_file;
  if (insecure) o.insecure = true;
  if (!device.empty()) o.device = device;
  if (!advertise_host.empty()) o.advertise_host = advertise_host;
  o.register_timeout = absl::Seconds(register_timeout_s);
  for (const auto& [b, e, v] : wd) o.weight_decay.push_back({b, e, v});
  for (const auto& [b, e, v] : lr_scale) o.lr_scale.push_back({b, e, v});
  o.layer_ends = layer_ends;
  for (const auto& [name, crc] : local_state) o.local_state.push_back({name, crc});
  o.settings = settings;
  if (metrics_port >= -1) o.metrics_port = metrics_port;  // below -1: as the environment says
  if (!metrics_host.empty()) o.metrics_host = metrics_host;
  if (metrics_linger_s >= 0) o.metrics_linger = absl::Seconds(metrics_linger_s);
  // Preemption (SIGTERM) stops the job after a checkpoint. Python keeps its
  // own SIGINT handler (KeyboardInterrupt).
  o.stop_signal = onebit::StopOnSignals();
  absl::StatusOr<std::unique_ptr<onebit::Worker>> w;
  {
    py::gil_scoped_release release;
    w = onebit::Worker::Connect(o);
  }
  if (!w.ok()) Raise(w.status());
  return std::move(*w);
}

}  // namespace

PYBIND11_MODULE(_onebit, m) {
  m.doc() = "onebit-ps worker (include/onebit/worker.h); use the onebit_ps package";
  static py::exception<std::runtime_error> error(m, "OnebitError");
  g_error = error.ptr();
  static py::exception<std::runtime_error> stopped(m, "Stopped", error.ptr());
  g_stopped = stopped.ptr();
  static py::exception<std::runtime_error> rolled_back(m, "RolledBack", error.ptr());
  g_rolled_back = rolled_back.ptr();

  py::class_<onebit::Worker>(m, "Worker")
      .def_static("connect", &Connect, py::arg("coordinator") = "", py::arg("rank") = -1,
                  py::arg("num_params") = 0, py::arg("device") = "", py::arg("advertise_host") = "",
                  py::arg("weight_decay") = std::vector<std::tuple<uint64_t, uint64_t, float>>{},
                  py::arg("settings") = std::map<std::string, std::string>{},
                  py::arg("register_timeout_s") = 60.0, py::arg("secret_file") = "",
                  py::arg("insecure") = false, py::arg("layer_ends") = std::vector<uint64_t>{},
                  py::arg("local_state") = std::vector<std::pair<std::string, uint32_t>>{},
                  py::arg("metrics_port") = -2, py::arg("metrics_host") = "",
                  py::arg("metrics_linger_s") = -1.0,
                  py::arg("lr_scale") = std::vector<std::tuple<uint64_t, uint64_t, float>>{},
                  py::arg("local_rank") = -1,
                  "Registers with the coordinator ('' : from the environment) and waits for "
                  "the job. secret_file: the job secret ('': $ONEBIT_SECRET_FILE); insecure: "
                  "none; weight_decay, lr_scale: (begin, end, value) ranges of x with their "
                  "own weight decay, their own lr multiplier; layer_ends: where each tensor ends "
                  "in x; local_state: (name, CRC-32) "
                  "of each tensor the job does not train, which must match across workers; "
                  "metrics_port: serve this worker's Prometheus metrics there (-1: none, 0: any "
                  "free port; -2: the environment's), on metrics_host ('': the bind host), "
                  "kept up metrics_linger_s after finish() (-1: the environment's).")
      .def_property_readonly("rank", &onebit::Worker::rank)
      .def_property_readonly("num_params", &onebit::Worker::num_params)
      .def_property_readonly("device", &onebit::Worker::device)
      .def_property_readonly("on_device", &onebit::Worker::on_device)
      .def_property_readonly("steps_done", &onebit::Worker::steps_done)
      .def_property_readonly("compressing", &onebit::Worker::compressing)
      .def_property_readonly("job",
                             [](const onebit::Worker& w) {
                               const onebit::JobInfo& j = w.job();
                               py::dict d;
                               d["job_id"] = j.job_id;
                               d["rank"] = j.rank;
                               d["workers"] = j.workers;
                               d["local_ranks"] = j.local_ranks;
                               d["local_rank"] = j.local_rank;
                               d["servers"] = j.servers;
                               d["num_params"] = j.num_params;
                               d["steps"] = j.steps;
                               d["model"] = j.model;
                               d["optimizer"] = j.optimizer;
                               d["lr"] = j.lr;
                               d["config_json"] = j.config_json;
                               return d;
                             })
      .def(
          "params_dlpack",
          [](py::object self) {
            onebit::Worker& w = self.cast<onebit::Worker&>();
            return Dlpack(self, w, w.params());
          },
          "x[0, d) as a DLPack capsule (torch.from_dlpack): a view, where the buffer lives")
      .def(
          "grads_dlpack",
          [](py::object self) {
            onebit::Worker& w = self.cast<onebit::Worker&>();
            return Dlpack(self, w, w.grads());
          },
          "g[0, d) as a DLPack capsule, likewise")
      .def("broadcast_parameters",
           [](onebit::Worker& w) {
             absl::Status st;
             {
               py::gil_scoped_release release;
               st = w.BroadcastParameters();
             }
             Check(st);
           })
      .def("set_learning_rate", [](onebit::Worker& w, float lr) { Check(w.SetLearningRate(lr)); })
      .def("gradients_ready",
           [](onebit::Worker& w, uint64_t begin, uint64_t end) {
             absl::Status st;
             {
               py::gil_scoped_release release;
               st = w.GradientsReady(begin, end);
             }
             Check(st);
           })
      .def(
          "step",
          [](onebit::Worker& w, std::optional<double> loss, double epoch,
             std::optional<float> gradient_scale) {
            onebit::StepOptions o;
            o.gradient_scale = gradient_scale;
            // A loss given is reported, NaN included (which fails the step).
            if (loss) {
              o.loss = *loss;
              o.has_loss = true;
            }
            o.epoch = epoch;
            absl::StatusOr<onebit::StepStats> s;
            {
              py::gil_scoped_release release;
              s = w.Step(o);
            }
            if (!s.ok()) Raise(s.status());
            py::dict d;
            d["step"] = s->step;
            d["compressed"] = s->compressed;
            d["bytes_up"] = s->bytes_up;
            d["bytes_down"] = s->bytes_down;
            d["step_s"] = s->step_s;
            return d;
          },
          py::arg("loss") = py::none(), py::arg("epoch") = 0.0,
          py::arg("gradient_scale") = py::none())
      .def(
          "optimizer_state",
          [](onebit::Worker& w) {
            absl::StatusOr<onebit::OptimizerState> s;
            {
              py::gil_scoped_release release;
              s = w.GatherOptimizerState();
            }
            if (!s.ok()) Raise(s.status());
            auto arrays = [](const std::map<std::string, std::vector<float>>& in) {
              py::dict d;
              for (const auto& [name, a] : in) {
                d[py::str(name)] = py::bytes(reinterpret_cast<const char*>(a.data()), 4 * a.size());
              }
              return d;
            };
            py::dict d;
            d["step"] = s->step;
            d["frozen"] = s->frozen;
            d["bias_steps"] = s->bias_steps;
            d["server"] = arrays(s->server);
            d["worker"] = arrays(s->worker);
            return d;
          },
          "The optimizer state between steps (Worker::GatherOptimizerState): step, frozen, "
          "and the servers' and this worker's arrays by name, as bytes of d float32 each.")
      .def(
          "seed_optimizer_state",
          [](onebit::Worker& w, uint64_t steps, const py::bytes& m, const py::bytes& v) {
            onebit::AdamSeed seed;
            seed.steps = steps;
            for (const auto& [from, into] : {std::pair{&m, &seed.m}, std::pair{&v, &seed.v}}) {
              const std::string bytes = *from;
              if (bytes.size() % 4 != 0) {
                throw py::value_error("seed_optimizer_state: m and v must be float32 bytes");
              }
              into->resize(bytes.size() / 4);
              std::memcpy(into->data(), bytes.data(), 4 * into->size());
            }
            absl::Status st;
            {
              py::gil_scoped_release release;
              st = w.SeedOptimizerState(seed);
            }
            Check(st);
          },
          "Starts the job from an Adam state (Worker::SeedOptimizerState): steps taken, and m "
          "and v as bytes of d float32 each.")
      .def(
          "agree_on_overflow",
          [](onebit::Worker& w, bool found_inf) {
            absl::StatusOr<bool> any;
            {
              py::gil_scoped_release release;
              any = w.AgreeOnOverflow(found_inf);
            }
            if (!any.ok()) Raise(any.status());
            return *any;
          },
          "Whether any rank's gradient of the coming step overflowed "
          "(Worker::AgreeOnOverflow); every rank calls it before its first push.")
      .def("can_defer_gradient_scale", &onebit::Worker::CanDeferGradientScale)
      .def("defer_gradient_scale", [](onebit::Worker& w) { Check(w.DeferGradientScale()); })
      .def("report_evaluation",
           [](onebit::Worker& w, double test_loss, double test_accuracy) {
             Check(w.ReportEvaluation(test_loss, test_accuracy));
           })
      .def("finish",
           [](onebit::Worker& w) {
             absl::Status st;
             {
               py::gil_scoped_release release;
               st = w.Finish();
             }
             Check(st);
           })
      .def("abort", [](onebit::Worker& w, const std::string& why) { w.Abort(why); });
}
