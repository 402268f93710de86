// onebit-launch: a convenience over the binaries' own flags. Starts a
// coordinator, S servers and N workers on loopback (ports picked by the
// processes themselves, so no races), prefixes their logs with the role,
// stops every child when one fails, and exits with the job's status. A first
// SIGTERM or SIGINT is passed on to the coordinator as a stop (the job stops
// after a checkpoint, or fails without --checkpoint_dir, run folder written);
// a second one kills every process at once.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "checkpoint/checkpoint_dir.h"
#include "job/config.h"
#include "job/flags.h"
#include "job/run_folder.h"
#include "job/security_flags.h"
#include "net/control.h"
#include "net/health.h"
#include "security/job_secret.h"
#include "util/crash_report.h"
#include "util/process_exit.h"
#include "util/stop_signal.h"
#include "util/subprocess.h"

ABSL_FLAG(std::string, out, "", "run folder (metrics.csv, summary.json, logs)");
ABSL_FLAG(std::string, bin_dir, "", "where the onebit binaries are (default: next to this one)");
ABSL_FLAG(int32_t, metrics_port, -1,
          "every process serves its Prometheus metrics on 127.0.0.1 (--metrics_port of each "
          "binary): the coordinator the job's at this port P, server K at P+1+K, worker R at "
          "P+1+S+R (S servers; a --worker_cmd program through ONEBIT_METRICS_PORT); -1: none, "
          "0: each process any free port (its log says which)");
ABSL_FLAG(absl::Duration, metrics_linger, absl::ZeroDuration(),
          "every process keeps serving them this long after its part of the job ends "
          "(--metrics_linger of each binary, ONEBIT_METRICS_LINGER)");
ABSL_FLAG(int32_t, child_nice, -1,
          "the niceness (0-19) of the servers and workers this starts, the coordinator "
          "keeping 0: it answers every heartbeat, and a coordinator starved by its own job's "
          "processes fails the job; -1 (auto): 10 when the job's processes outnumber this "
          "machine's cores, else 0");
ABSL_FLAG(bool, dump_params, false,
          "workers and servers write their final x to --out (replica_w<R>.f32, master_s<K>.f32, "
          "and the server error error_s<K>.f32)");
ABSL_FLAG(std::vector<std::string>, worker_devices, {},
          "each worker process's --device, in order (by rank; with --local_ranks K, worker 0's "
          "K local ranks first), comma-separated (cpu, cuda, cuda:N, auto, cuda-twin); the last "
          "one repeats for the rest; empty: the workers' default (auto)");
ABSL_FLAG(
    std::string, worker_cmd, "",
    "run this program (with its arguments, shell-quoted) as each worker instead of "
    "onebit-worker; it implies --model external (a built-in --model with it is an error). "
    "It finds the job in its environment: ONEBIT_COORDINATOR, ONEBIT_RANK, ONEBIT_LOCAL_RANK, "
    "ONEBIT_WORLD_SIZE (also RANK, WORLD_SIZE, LOCAL_RANK as torchrun sets them), "
    "ONEBIT_DEVICE (from --worker_devices) and, with --dump_params, ONEBIT_DUMP_X; "
    "PYTHONPATH starts with this onebit-launch's own onebit_ps package (<build>/python, "
    "or <prefix>/lib/python3/dist-packages installed), so `import onebit_ps` works");
ABSL_FLAG(bool, overlap, true,
          "onebit-worker pushes each part of the gradient as soon as the backward has finished "
          "it (--overlap of onebit-worker); false: after the whole backward. The same results "
          "bit for bit");
ABSL_FLAG(int32_t, stall_worker, -1, "fault injection: this worker stops pushing ...");
ABSL_FLAG(int64_t, stall_at_step, -1, "... at this step");
ABSL_FLAG(absl::Duration, grace, absl::Seconds(1),
          "after a child fails: how long the others get to exit on their own, then to "
          "exit after SIGTERM before SIGKILL (0: no wait); the coordinator, which writes "
          "summary.json as it stops, gets at least 10 s");
ABSL_FLAG(int32_t, max_restarts, 0,
          "when a process fails mid-job, start it again, up to this many times in all: with "
          "--checkpoint_dir (and --rejoin_timeout > 0) that process alone, and the others roll "
          "back to the last complete checkpoint and go on; without, the whole job from the "
          "start. Either way the job ends bit for bit as if uninterrupted. Nothing is started "
          "again once onebit-launch got a SIGTERM or SIGINT");
ABSL_FLAG(int32_t, servers_per_worker_host, 0,
          "run K servers per worker: S = K x N, the layout of one server (or K) on every "
          "worker's host, in which each host's NIC carries what a ring allreduce carries; on "
          "this machine they all share loopback. 0: --servers as given");
ABSL_FLAG(absl::Duration, launch_register_timeout, absl::Seconds(60),
          "registration timeout passed to every process");

namespace onebit {
namespace {

absl::Mutex log_mu;

// Processes per worker (--local_ranks).
uint32_t LocalRanks(const control::TrainingConfig& cfg) {
  return std::max<uint32_t>(1, cfg.cluster().local_ranks());
}

struct Child {
  std::string name;
  // How to start it again (live recovery).
  std::vector<std::string> argv;
  std::vector<std::string> env;
  std::optional<Subprocess> proc;
  int read_fd = -1;
  std::thread reader;
  std::optional<int> code;
};

// Copies a child's output to our stderr, line by line, prefixed "[name] ".
void PumpLines(int fd, std::string name) {
  std::string pending;
  char buf[4096];
  while (true) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending.append(buf, static_cast<size_t>(n));
    size_t nl;
    while ((nl = pending.find('\n')) != std::string::npos) {
      absl::MutexLock l(&log_mu);
      std::fprintf(stderr, "[%s] %s\n", name.c_str(), pending.substr(0, nl).c_str());
      pending.erase(0, nl + 1);
    }
  }
  if (!pending.empty()) {
    absl::MutexLock l(&log_mu);
    std::fprintf(stderr, "[%s] %s\n", name.c_str(), pending.c_str());
  }
  close(fd);
}

void Log(const std::string& msg) {
  absl::MutexLock l(&log_mu);
  std::fprintf(stderr, "launch: %s\n", msg.c_str());
}

// Stop signals. SIGTERM and SIGINT are blocked in every thread of ours (the
// children unblock them: util/subprocess.h) and taken by one thread, which
// records the first (the main thread passes it on to the coordinator as a
// stop) and on a second one kills every process of the job at once.
std::atomic<int> stop_signal{0};  // the first one's number; 0: none yet

// What a second signal kills (each child leads its own process group) and
// removes (the job's temporary folder, which may hold its secret).
absl::Mutex children_mu;
std::set<pid_t> child_pids ABSL_GUARDED_BY(children_mu);
std::string job_tmp ABSL_GUARDED_BY(children_mu);

void TrackChild(pid_t pid, bool running) {
  absl::MutexLock l(&children_mu);
  if (running) {
    child_pids.insert(pid);
  } else {
    child_pids.erase(pid);
  }
}

void SetJobTmp(const std::string& dir) {
  absl::MutexLock l(&children_mu);
  job_tmp = dir;
}

void TakeStopSignals(sigset_t set) {
  int sig = 0;
  while (sigwait(&set, &sig) == 0) {
    int none = 0;
    if (stop_signal.compare_exchange_strong(none, sig)) {
      Log(absl::StrCat(SignalName(sig),
                       ": stopping the job (after a checkpoint where it has a --checkpoint_dir); "
                       "a second SIGTERM or SIGINT kills it at once"));
      continue;
    }
    Log(absl::StrCat("a second stop signal (", SignalName(sig),
                     "): killing every process of the job, without a checkpoint"));
    absl::MutexLock l(&children_mu);
    for (pid_t pid : child_pids) {
      kill(-pid, SIGKILL);  // the child's process group: what it started too
      kill(pid, SIGKILL);
    }
    if (!job_tmp.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(job_tmp, ec);
    }
    _exit(128 + sig);
  }
}

// Blocks SIGTERM and SIGINT (those not ignored: a shell's background job
// ignores SIGINT) in this thread, and so in every thread it starts, and
// starts the thread that takes them. Call before any other thread exists.
void CatchStopSignalsInOneThread() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGTERM, SIGINT}) {
    struct sigaction old = {};
    if (sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) sigaddset(&set, sig);
  }
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread(TakeStopSignals, set).detach();
}

// `nice`: the child's niceness (0: as this process).
absl::Status Start(Child* c, const std::vector<std::string>& argv,
                   const std::vector<std::string>& env = {}, int nice = 0) {
  if (c->reader.joinable()) c->reader.join();  // a restart: the last one's output is done
  c->code.reset();
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
  auto p = Subprocess::Spawn(argv, fds[1], fds[1], env, nice);
  close(fds[1]);
  if (!p.ok()) {
    close(fds[0]);
    return p.status();
  }
  c->proc.emplace(std::move(*p));
  TrackChild(c->proc->pid(), true);
  c->read_fd = fds[0];
  c->reader = std::thread(PumpLines, fds[0], c->name);
  return absl::OkStatus();
}

std::string SelfDir() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : p.parent_path().string();
}

// The folder of this onebit-launch's own onebit_ps package: <build>/python
// next to the binary in the build tree, <prefix>/lib/python3/dist-packages
// installed (<prefix>/bin/onebit-launch); "" when neither holds it.
std::string OwnPythonPackageDir() {
  const std::filesystem::path self = SelfDir();
  for (const std::filesystem::path& dir :
       {self / "python", self.parent_path() / "lib" / "python3" / "dist-packages"}) {
    if (access((dir / "onebit_ps" / "__init__.py").c_str(), R_OK) == 0) {
      return dir.lexically_normal().string();
    }
  }
  return "";
}

// What every start of the job shares: the command line, checked.
struct LaunchPlan {
  control::TrainingConfig cfg;
  std::vector<std::string> config_args;  // the job's settings as coordinator flags
  std::string out;                       // the run folder; "" none
  std::string bin;                       // where the onebit binaries are
  std::string worker_cmd;                // the user's worker program; "" onebit-worker
  std::string python_path;               // PYTHONPATH for worker_cmd
  std::vector<std::string> devices;      // --worker_devices
  SecurityFlags security;
  int stall_worker = -1;
  int max_restarts = 0;
  bool live = false;   // live recovery: a lost process alone (a host: its local ranks) starts again
  int child_nice = 0;  // of the servers and workers (--child_nice, resolved)
  // NAME=K for a --worker_cmd program's math libraries' threads, those the
  // caller's environment leaves unset.
  std::vector<std::string> thread_env;
};

// One start of the whole job: the coordinator, then the servers and the
// workers, watched until they end; a failed process alone is started again
// under live recovery. One thread.
class Attempt {
 public:
  // *restarts_used counts every restart, of one process or of the job.
  Attempt(const LaunchPlan& plan, int attempt, int* restarts_used)
      : plan_(plan), attempt_(attempt), restarts_used_(*restarts_used) {}

  // The exit code; *running: it got as far as starting every process (a
  // job that fails before that is not worth restarting).
  int Run(bool* running) {
    Prepare();
    summary_before_ = SummaryStamp();
    if (std::optional<int> code = StartCoordinator()) return *code;
    *running = true;
    Log(absl::StrCat("coordinator at ", target_, " is serving; starting ",
                     plan_.cfg.cluster().servers(), " servers and ", plan_.cfg.cluster().workers(),
                     " workers"));
    if (std::optional<int> code = StartServers()) return *code;
    if (std::optional<int> code = StartWorkers()) return *code;
    if (std::optional<int> code = Watch()) {
      if (job_over_) *running = false;  // over: nothing to start again
      return *code;
    }
    return Outcome();
  }

 private:
  // The job's temporary folder, its secret, and the arguments every process
  // shares.
  void Prepare() {
    char tmpl[] = "/tmp/onebit-launch.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) ExitError(1, "cannot create a temporary folder");
    tmp_ = tmpl;
    SetJobTmp(tmp_);
    port_file_ = tmp_ + "/coordinator.port";
    stop_reason_file_ = tmp_ + "/stop_reason";
    const SecurityFlags& security = plan_.security;
    secret_file_ = security.secret_file;
    if (!security.insecure && secret_file_.empty()) {
      secret_file_ = tmp_ + "/secret";  // the folder is the launcher's alone (0700)
      if (absl::Status st = JobSecret::Generate().WriteFile(secret_file_); !st.ok()) {
        ExitError(1, st.message());
      }
    }
    auto job_security = ResolveSecurity(secret_file_, security.insecure, "--secret_file");
    if (!job_security.ok()) ExitError(1, job_security.status().message());
    job_security_ = *std::move(job_security);
    security_arg_ = security.insecure ? std::string("--insecure") : "--secret_file=" + secret_file_;
    reg_timeout_ = absl::FormatDuration(absl::GetFlag(FLAGS_launch_register_timeout));
    grace_ = absl::GetFlag(FLAGS_grace);
    // The coordinator writes the run folder's summary.json as it stops: on a
    // crowded machine (160 processes on 2 cores) 1 s was too short for that,
    // and the job was left with summary.json.tmp alone.
    coordinator_grace_ =
        grace_ == absl::ZeroDuration() ? grace_ : std::max(grace_, absl::Seconds(10));
    children_.resize(1 + plan_.cfg.cluster().servers() +
                     plan_.cfg.cluster().workers() * LocalRanks(plan_.cfg));
  }

  // Starts the coordinator and waits until it serves; an exit code when it
  // does not.
  std::optional<int> StartCoordinator() {
    const std::string& bin = plan_.bin;
    const std::string& out = plan_.out;
    const std::vector<std::string>& config_args = plan_.config_args;
    Child& coord = children_[0];
    coord.name = "coordinator";
    std::vector<std::string> args = {bin + "/onebit-coordinator",
                                     "--port=0",
                                     "--port_file=" + port_file_,
                                     "--stop_reason_file=" + stop_reason_file_,
                                     "--bind_host=127.0.0.1",
                                     "--register_timeout=" + reg_timeout_,
                                     security_arg_};
    if (!out.empty()) args.push_back("--out=" + out);
    if (const int p = absl::GetFlag(FLAGS_metrics_port); p >= 0) {
      args.push_back(absl::StrCat("--metrics_port=", p));
      args.push_back("--metrics_linger=" +
                     absl::FormatDuration(absl::GetFlag(FLAGS_metrics_linger)));
    }
    for (const std::string& a : config_args) args.push_back(a);
    coord.argv = args;
    if (absl::Status st = Start(&coord, args); !st.ok()) {
      Log(std::string(st.message()));
      return Finish(1);
    }
    int port = 0;
    const absl::Time port_deadline = absl::Now() + absl::Seconds(30);
    while (port == 0) {
      std::ifstream in(port_file_);
      std::string text;
      if (in >> text && absl::SimpleAtoi(text, &port) && port > 0) break;
      port = 0;
      if (auto code = coord.proc->Poll()) {
        Log(absl::StrCat("the coordinator exited before listening (", DescribeExit(*code), ")"));
        return Finish(*code == 0 ? 1 : (*code < 126 ? *code : 1));
      }
      if (absl::Now() > port_deadline) {
        Log("the coordinator did not start listening within 30s");
        return Finish(1);
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    coordinator_listening_ = true;
    target_ = absl::StrCat("127.0.0.1:", port);
    // Started again, the coordinator must listen where everyone looks for it.
    for (std::string& a : coord.argv) {
      if (a == "--port=0") a = absl::StrCat("--port=", port);
    }
    if (absl::Status st = CheckHealth(target_, absl::Seconds(10), &job_security_); !st.ok()) {
      Log(std::string(st.message()));
      return Finish(1);
    }
    return std::nullopt;
  }

  // The metrics flags of child `c` (--metrics_port: P plus its index).
  void AddMetricsFlags(const Child& c, std::vector<std::string>* args) const {
    const int p = absl::GetFlag(FLAGS_metrics_port);
    if (p < 0) return;
    const int index = static_cast<int>(&c - children_.data());
    args->push_back(absl::StrCat("--metrics_port=", p == 0 ? 0 : p + index));
    args->push_back("--metrics_host=127.0.0.1");
    args->push_back("--metrics_linger=" +
                    absl::FormatDuration(absl::GetFlag(FLAGS_metrics_linger)));
  }

  std::optional<int> StartServers() {
    const control::TrainingConfig& cfg = plan_.cfg;
    const std::string& bin = plan_.bin;
    const std::string& out = plan_.out;
    // Stopped while starting: the coordinator ends the job; start no more.
    for (uint32_t k = 0; k < cfg.cluster().servers() && stop_signal.load() == 0; ++k) {
      Child& c = children_[1 + k];
      c.name = absl::StrCat("server", k);
      std::vector<std::string> a = {bin + "/onebit-server",
                                    "--coordinator=" + target_,
                                    absl::StrCat("--shard=", k),
                                    "--bind_host=127.0.0.1",
                                    "--advertise_host=127.0.0.1",
                                    "--data_port=0",
                                    "--health_port=0",
                                    "--register_timeout=" + reg_timeout_,
                                    security_arg_};
      if (absl::GetFlag(FLAGS_dump_params)) {
        a.push_back(absl::StrCat("--dump_x=", out, "/master_s", k, ".f32"));
        a.push_back(absl::StrCat("--dump_error=", out, "/error_s", k, ".f32"));
      }
      AddMetricsFlags(c, &a);
      c.argv = a;
      if (absl::Status st = Start(&c, a, {}, plan_.child_nice); !st.ok()) {
        StopAll(std::string(st.message()));
        return Finish(1);
      }
    }
    return std::nullopt;
  }

  std::optional<int> StartWorkers() {
    const control::TrainingConfig& cfg = plan_.cfg;
    const std::string& bin = plan_.bin;
    const std::string& out = plan_.out;
    const std::string& worker_cmd = plan_.worker_cmd;
    const std::string& python_path = plan_.python_path;
    const std::vector<std::string>& devices = plan_.devices;
    const SecurityFlags& security = plan_.security;
    const int stall_worker = plan_.stall_worker;
    const int attempt = attempt_;
    const uint32_t K = LocalRanks(cfg);
    for (uint32_t p = 0; p < cfg.cluster().workers() * K && stop_signal.load() == 0; ++p) {
      // Process p is worker i's local rank k: a host's K processes.
      const uint32_t i = p / K, k = p % K;
      Child& c = children_[1 + cfg.cluster().servers() + p];
      c.name = k == 0 ? absl::StrCat("worker", i) : absl::StrCat("worker", i, ".", k);
      // Every replica, a local rank's too, for comparisons.
      const std::string dump = k == 0 ? absl::StrCat(out, "/replica_w", i, ".f32")
                                      : absl::StrCat(out, "/replica_w", i, "_local", k, ".f32");
      if (!worker_cmd.empty()) {
        // The user's program: `exec` so that the child is the program itself
        // (our signals reach it, and it dies with us).
        std::vector<std::string> env = {
            "ONEBIT_COORDINATOR=" + target_, absl::StrCat("ONEBIT_RANK=", i),
            absl::StrCat("ONEBIT_LOCAL_RANK=", k), absl::StrCat("ONEBIT_LOCAL_RANKS=", K),
            absl::StrCat("ONEBIT_WORLD_SIZE=", cfg.cluster().workers()), absl::StrCat("RANK=", p),
            absl::StrCat("WORLD_SIZE=", cfg.cluster().workers() * K),
            // Every process runs on this machine.
            absl::StrCat("LOCAL_RANK=", p), "ONEBIT_ADVERTISE_HOST=127.0.0.1",
            security.insecure ? std::string("ONEBIT_INSECURE=1")
                              : "ONEBIT_SECRET_FILE=" + secret_file_};
        if (!devices.empty()) {
          env.push_back("ONEBIT_DEVICE=" + devices[std::min<size_t>(p, devices.size() - 1)]);
        }
        if (!python_path.empty()) env.push_back("PYTHONPATH=" + python_path);
        env.insert(env.end(), plan_.thread_env.begin(), plan_.thread_env.end());
        if (absl::GetFlag(FLAGS_dump_params)) {
          env.push_back("ONEBIT_DUMP_X=" + dump);
        }
        std::vector<std::string> metrics;
        AddMetricsFlags(c, &metrics);
        for (const std::string& flag : metrics) {
          // --metrics_port=P as ONEBIT_METRICS_PORT=P.
          const size_t eq = flag.find('=');
          env.push_back(absl::StrCat("ONEBIT_", absl::AsciiStrToUpper(flag.substr(2, eq - 2)),
                                     flag.substr(eq)));
        }
        c.argv = {"/bin/sh", "-c", "exec " + worker_cmd};
        c.env = env;
        if (absl::Status st = Start(&c, c.argv, env, plan_.child_nice); !st.ok()) {
          StopAll(std::string(st.message()));
          return Finish(1);
        }
        continue;
      }
      std::vector<std::string> a = {bin + "/onebit-worker",
                                    "--coordinator=" + target_,
                                    absl::StrCat("--rank=", i),
                                    absl::StrCat("--local_rank=", k),
                                    "--bind_host=127.0.0.1",
                                    "--advertise_host=127.0.0.1",
                                    "--health_port=0",
                                    "--register_timeout=" + reg_timeout_,
                                    security_arg_};
      if (absl::GetFlag(FLAGS_dump_params)) {
        a.push_back("--dump_x=" + dump);
      }
      if (!devices.empty()) {
        a.push_back("--device=" + devices[std::min<size_t>(p, devices.size() - 1)]);
      }
      if (!absl::GetFlag(FLAGS_overlap)) a.push_back("--overlap=false");
      AddMetricsFlags(c, &a);
      c.argv = a;  // a restarted one does not stall again
      if (static_cast<int>(i) == stall_worker && k == 0 && attempt == 0) {
        a.push_back(absl::StrCat("--stall_at_step=", absl::GetFlag(FLAGS_stall_at_step)));
      }
      if (absl::Status st = Start(&c, a, {}, plan_.child_nice); !st.ok()) {
        StopAll(std::string(st.message()));
        return Finish(1);
      }
    }

    return std::nullopt;
  }

  // Until every process has exited 0 (nullopt), or an exit code.
  std::optional<int> Watch() {
    const control::TrainingConfig& cfg = plan_.cfg;
    const bool live = plan_.live;
    const int max_restarts = plan_.max_restarts;
    int* restarts_used = &restarts_used_;
    Child& coord = children_[0];
    // Watch: the first failure stops everyone; after the coordinator is done,
    // the rest must follow promptly. Once a stop signal came, the coordinator
    // ends the job (it writes the run folder): a process that fails meanwhile
    // stops the others only after it (or after stop_bound), and nothing is
    // started again.
    std::optional<absl::Time> coordinator_exited;
    const absl::Duration after_coordinator = absl::Seconds(10);
    const absl::Duration stop_bound =
        std::max(absl::Seconds(30),
                 3 * absl::Milliseconds(cfg.timeouts().heartbeat_ms()) + absl::Seconds(20));
    std::optional<std::string> failed_while_stopping;  // the first failure's message
    while (true) {
      if (!coordinator_listening_ && !coord.code && std::ifstream(port_file_).good()) {
        coordinator_listening_ = true;  // started again, it listens again
      }
      PassOnStop(coord);
      bool all_done = true;
      for (Child& c : children_) {
        if (c.code || !c.proc) continue;  // exited, or never started (stopped first)
        c.code = c.proc->Poll();
        if (!c.code) {
          all_done = false;
          continue;
        }
        // The coordinator ended the job (finished, or stopped after a
        // checkpoint): a process that fails after that (at its exit) fails
        // the launch, but nothing is started again, since a restart would
        // find the job over.
        if (*c.code != 0 && &c != &coord && JobOver(coord)) {
          Log(absl::StrCat(c.name, " failed (", DescribeExit(*c.code),
                           ") after the coordinator had ended the job; nothing is started "
                           "again"));
          if (!job_over_) exit_code_ = *c.code < 126 ? *c.code : 1;
          job_over_ = true;
          continue;
        }
        // Live recovery: this process alone starts again and the job rolls
        // back; the coordinator only when it was killed (a job that
        // failed would fail again).
        const bool coordinator_running = !coord.code;
        if (*c.code != 0 && live && *restarts_used < max_restarts && stop_signal.load() == 0 &&
            (&c == &coord ? *c.code > 128 : coordinator_running) &&
            HasCompleteCheckpoint(cfg.checkpoint().dir())) {
          ++*restarts_used;
          // A host's local ranks stand or fall together: the rest of a lost
          // rank's group goes too, and the group starts again as one.
          const std::vector<Child*> group = GroupOf(c);
          // Which of the group had failed too (the cause may be another's).
          std::string with;
          for (Child* m : group) {
            if (m != &c && !m->code && m->proc) m->code = m->proc->Poll();
            if (m != &c && m->code && *m->code != 0) {
              absl::StrAppend(&with, with.empty() ? ", with " : ", ", m->name, " (",
                              DescribeExit(*m->code), ")");
            }
          }
          Log(absl::StrCat(c.name, " failed (", DescribeExit(*c.code), ")", with, "; restart ",
                           *restarts_used, " of ", max_restarts, ": starting ",
                           group.size() > 1
                               ? absl::StrCat("its host's ", group.size(), " local ranks")
                               : std::string("it"),
                           " again",
                           &c == &coord ? "; the others wait for it"
                                        : "; the job rolls back to its last complete checkpoint"));
          if (&c == &coord) {
            // Told to stop before it listens, it would die of the signal.
            std::remove(port_file_.c_str());
            coordinator_listening_ = false;
          }
          for (Child* m : group) {
            if (m != &c && !m->code && m->proc) {
              m->proc->Signal(SIGKILL);
              m->code = m->proc->Wait(absl::Seconds(10));
              if (!m->code) {  // not started twice beside itself
                StopAll(absl::StrCat(m->name, " did not exit within 10s of SIGKILL"));
                return Finish(1);
              }
            }
            TrackChild(m->proc->pid(), false);
          }
          for (Child* m : group) {
            if (absl::Status st = Start(m, m->argv, m->env, m == &coord ? 0 : plan_.child_nice);
                !st.ok()) {
              StopAll(std::string(st.message()));
              return Finish(1);
            }
          }
          all_done = false;
          continue;
        }
        if (&c == &coord) coordinator_exited = absl::Now();
        if (*c.code != 0) {
          const std::string why =
              absl::StrCat(c.name, " failed (", DescribeExit(*c.code), "); stopping the others");
          if (stop_signal.load() != 0 && !coord.code) {
            if (!failed_while_stopping) {
              exit_code_ = *c.code < 126 ? *c.code : 1;
              failed_while_stopping = why;
            }
            continue;
          }
          if (!failed_while_stopping) exit_code_ = *c.code < 126 ? *c.code : 1;
          SayWhy(
              absl::StrCat("onebit-launch, as ", c.name, " failed (", DescribeExit(*c.code), ")"));
          StopAll(failed_while_stopping.value_or(why));
          return Finish(exit_code_);
        }
      }
      if (failed_while_stopping &&
          (coord.code || (stop_sent_ && absl::Now() - *stop_sent_ > stop_bound))) {
        StopAll(coord.code ? *failed_while_stopping
                           : absl::StrCat("the coordinator did not end the job within ",
                                          absl::FormatDuration(stop_bound), " of the stop"));
        return Finish(exit_code_);
      }
      if (all_done) {
        if (job_over_) return Finish(exit_code_);
        break;
      }
      if (coordinator_exited && absl::Now() - *coordinator_exited > after_coordinator) {
        StopAll(absl::StrCat("processes still running ", absl::FormatDuration(after_coordinator),
                             " after the coordinator exited"));
        return Finish(1);
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return std::nullopt;
  }

  // The processes that are started again together with c: a worker's
  // local ranks (c's own group, local rank 0 first), else c alone.
  std::vector<Child*> GroupOf(Child& c) {
    const uint32_t K = LocalRanks(plan_.cfg);
    const size_t first_worker = 1 + plan_.cfg.cluster().servers();
    const size_t at = static_cast<size_t>(&c - children_.data());
    if (K <= 1 || at < first_worker) return {&c};
    const size_t leader = first_worker + (at - first_worker) / K * K;
    std::vector<Child*> group;
    for (size_t i = leader; i < leader + K; ++i) group.push_back(&children_[i]);
    return group;
  }

  // When the run folder's summary.json was last written; nullopt: none.
  std::optional<std::filesystem::file_time_type> SummaryStamp() const {
    if (plan_.out.empty()) return std::nullopt;
    std::error_code ec;
    const auto t = std::filesystem::last_write_time(plan_.out + "/summary.json", ec);
    if (ec) return std::nullopt;
    return t;
  }

  // The coordinator has ended this attempt's job, finished or stopped
  // after a checkpoint: it exited 0, or it wrote summary.json saying so
  // (it does before it waits for every process to hear; a process exits
  // only after hearing).
  bool JobOver(const Child& coord) const {
    if (coord.code) return *coord.code == 0;
    const auto stamp = SummaryStamp();
    if (!stamp || stamp == summary_before_) return false;
    const absl::StatusOr<run::Summary> summary = ReadSummaryJson(plan_.out + "/summary.json");
    return summary.ok() &&
           (summary->status() == "ok" || absl::StartsWith(summary->status(), "stopped: "));
  }

  // Every process exited 0: the job finished, or stopped after a checkpoint.
  int Outcome() {
    const std::string& out = plan_.out;
    // Every process exited 0: the job finished, or stopped after a checkpoint.
    std::string outcome = "job finished";
    if (!out.empty()) {
      const absl::StatusOr<run::Summary> summary = ReadSummaryJson(out + "/summary.json");
      if (!summary.ok()) {
        outcome = absl::StrCat("job finished; ", summary.status().message());
      } else if (absl::StartsWith(summary->status(), "stopped: ")) {
        outcome = "job stopped after a checkpoint (summary.json says why); run it again to resume";
      } else if (summary->has_durable() && !summary->durable()) {
        // The last line is what a user reads: training went on without them.
        outcome =
            "job finished, but not durable: checkpoints failed (summary.json's "
            "last_checkpoint_error says why)";
      }
    }
    Log(out.empty() ? outcome : absl::StrCat(outcome, "; run folder ", out));
    return Finish(0);
  }

  // Who stops the job, for the coordinator's summary (written before the
  // SIGTERM that tells it).
  void SayWhy(const std::string& who) { std::ofstream(stop_reason_file_) << who << "\n"; }

  absl::Duration GraceOf(const Child& c) const {
    return &c == &children_[0] ? coordinator_grace_ : grace_;
  }

  void StopAll(const std::string& why) {
    Log(why);
    // First let the others exit on their own (they may name the cause).
    const absl::Time deadline = absl::Now() + grace_;
    for (Child& c : children_) {
      if (!c.proc) continue;
      while (!c.proc->Poll() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
    }
    for (Child& c : children_) {
      if (c.proc && !c.proc->Poll()) {
        Log(absl::StrCat("stopping ", c.name));
        c.proc->Stop(GraceOf(c));
      }
    }
  }

  int Finish(int code) {
    for (Child& c : children_) {
      if (c.proc && !c.proc->Poll()) c.proc->Stop(GraceOf(c));
      if (c.proc) TrackChild(c.proc->pid(), false);
      if (c.reader.joinable()) c.reader.join();
    }
    SetJobTmp("");
    std::error_code ec;
    if (!tmp_.empty()) std::filesystem::remove_all(tmp_, ec);
    return code;
  }

  // A stop signal goes to the coordinator once it listens (it has caught
  // stop signals by then), once: a second SIGTERM would kill it.
  void PassOnStop(Child& coord) {
    const int sig = stop_signal.load();
    if (sig == 0 || stop_sent_ || !coordinator_listening_ || coord.code) return;
    stop_sent_ = absl::Now();
    Log(absl::StrCat("passing ", SignalName(sig), " on to the coordinator; waiting for it to ",
                     plan_.cfg.checkpoint().dir().empty()
                         ? "end the job (it has no --checkpoint_dir: the job fails)"
                         : "stop the job after a checkpoint"));
    SayWhy(absl::StrCat(SignalName(sig), " to onebit-launch"));
    coord.proc->Signal(SIGTERM);
  }

  const LaunchPlan& plan_;
  const int attempt_;
  int& restarts_used_;
  std::string tmp_, port_file_, stop_reason_file_, secret_file_;
  Security job_security_;
  std::string security_arg_, reg_timeout_;
  absl::Duration grace_, coordinator_grace_;
  std::vector<Child> children_;
  std::string target_;  // the coordinator's address
  int exit_code_ = 0;
  bool job_over_ = false;  // a process failed after the coordinator ended the job
  std::optional<std::filesystem::file_time_type> summary_before_;  // as the attempt began
  bool coordinator_listening_ = false;
  std::optional<absl::Time> stop_sent_;
};

// The plan from the command line; exits naming the flag at a bad one.
LaunchPlan PlanFromCommandLine(int argc, char** argv) {
  LaunchPlan plan;
  std::set<std::string> given;
  control::TrainingConfig job = ConfigFromCommandLineOrExit(
      argc, argv,
      "onebit-launch --workers N --servers S [--model synthetic --dim D --steps T] [--out DIR]\n"
      "Runs a whole job on this machine over loopback; takes every coordinator config flag.\n"
      "SIGTERM or Ctrl-C: the job stops after a checkpoint (with --checkpoint_dir; without, it "
      "fails), run folder written; a second one kills every process at once.",
      &given);
  std::vector<std::string>& config_args = plan.config_args;
  config_args = ConfigFlagArgs();
  const std::string& worker_cmd = plan.worker_cmd = absl::GetFlag(FLAGS_worker_cmd);
  if (!worker_cmd.empty() && job.model().name() != kExternalModel) {
    // The workers are the user's program: an external model.
    if (given.count("model")) {
      ExitFlagError("model", absl::StrCat("'", job.model().name(),
                                          "' is a built-in model, which onebit-worker runs; "
                                          "--worker_cmd runs your program as each worker instead: "
                                          "leave --model out (or give --model external)"));
    }
    config_args.push_back(absl::StrCat("--model=", kExternalModel));
    auto external = ConfigFromFlags(config_args);
    if (!external.ok()) ExitError(2, external.status().message());
    job = *std::move(external);
    given.insert("model");
  }
  if (const int per_host = absl::GetFlag(FLAGS_servers_per_worker_host); per_host != 0) {
    if (per_host < 0) ExitFlagError("servers_per_worker_host", "must be >= 0");
    const uint64_t servers = uint64_t{job.cluster().workers()} * static_cast<uint64_t>(per_host);
    if (given.count("servers") && job.cluster().servers() != servers) {
      ExitFlagError("servers_per_worker_host",
                    absl::StrCat(per_host, " x ", job.cluster().workers(), " workers is ", servers,
                                 " servers, but --servers is ", job.cluster().servers()));
    }
    job.mutable_cluster()->set_servers(static_cast<uint32_t>(servers));
    if (absl::Status st = ValidateConfig(job); !st.ok()) {
      ExitFlagError("servers_per_worker_host", st.message());
    }
    config_args.erase(
        std::remove_if(config_args.begin(), config_args.end(),
                       [](const std::string& a) { return absl::StartsWith(a, "--servers="); }),
        config_args.end());
    config_args.push_back(absl::StrCat("--servers=", servers));
  }
  plan.cfg = std::move(job);
  const control::TrainingConfig& cfg = plan.cfg;
  const std::string& out = plan.out = absl::GetFlag(FLAGS_out);
  if (absl::Status st = CheckTimeout(absl::GetFlag(FLAGS_launch_register_timeout)); !st.ok()) {
    ExitFlagError("launch_register_timeout", st.message());
  }
  if (absl::GetFlag(FLAGS_dump_params) && out.empty()) ExitFlagError("dump_params", "needs --out");
  if (const int64_t p = absl::GetFlag(FLAGS_metrics_port); p < -1 || p > 65535) {
    ExitFlagError("metrics_port", "must be -1 (none) or in [0, 65535]");
  } else if (p > 0 && p + int64_t{cfg.cluster().servers()} + cfg.cluster().workers() > 65535) {
    ExitFlagError("metrics_port", absl::StrCat("the workers' ports would pass 65535 (P+1+S+R)"));
  }
  if (absl::Duration l = absl::GetFlag(FLAGS_metrics_linger);
      l < absl::ZeroDuration() || l > absl::Hours(1)) {
    ExitFlagError("metrics_linger", "must be in [0s, 1h]");
  }
  const int stall_worker = plan.stall_worker = absl::GetFlag(FLAGS_stall_worker);
  if (stall_worker >= static_cast<int>(cfg.cluster().workers())) {
    ExitFlagError("stall_worker", "no such worker");
  }
  const std::vector<std::string>& devices = plan.devices = absl::GetFlag(FLAGS_worker_devices);
  if (devices.size() > cfg.cluster().workers() * LocalRanks(cfg)) {
    ExitFlagError(
        "worker_devices",
        absl::StrCat(devices.size(), " devices for ", cfg.cluster().workers(), " workers",
                     LocalRanks(cfg) > 1 ? absl::StrCat(" of ", LocalRanks(cfg), " local ranks")
                                         : std::string()));
  }
  if (!worker_cmd.empty() && stall_worker >= 0) {
    ExitFlagError("stall_worker", "works with onebit-worker only, not --worker_cmd");
  }
  if (!worker_cmd.empty() && !absl::GetFlag(FLAGS_overlap)) {
    ExitFlagError("overlap",
                  "works with onebit-worker only; a --worker_cmd program chooses its own (the "
                  "PyTorch front: DistributedOptimizer(overlap=False))");
  }
  // Secure by default: without --secret_file (or $ONEBIT_SECRET_FILE) or
  // --insecure, each start of the job gets a fresh secret of its own.
  plan.security = LauncherSecurityFlagsOrExit();
  if (plan.security.insecure)
    Log("INSECURE (--insecure): the job's planes are neither authenticated nor encrypted");
  std::string& bin = plan.bin = absl::GetFlag(FLAGS_bin_dir);
  if (bin.empty()) bin = SelfDir();
  for (const char* b : {"onebit-coordinator", "onebit-server", "onebit-worker"}) {
    if (!worker_cmd.empty() && std::string(b) == "onebit-worker") continue;
    if (access((bin + "/" + b).c_str(), X_OK) != 0) {
      ExitFlagError("bin_dir", absl::StrCat("no executable ", b, " in ", bin));
    }
  }
  if (!out.empty()) {
    absl::Status st = MakeDirs(out);
    if (!st.ok()) ExitFlagError("out", st.message());
  }
  plan.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  const int32_t nice = absl::GetFlag(FLAGS_child_nice);
  if (nice < -1 || nice > 19) ExitFlagError("child_nice", "must be -1 (auto) or in [0, 19]");
  const uint64_t processes = 1 + uint64_t{cfg.cluster().servers()} + cfg.cluster().workers();
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  plan.child_nice = nice >= 0 ? nice : processes > cores ? 10 : 0;
  if (nice < 0 && plan.child_nice > 0) {
    std::fprintf(stderr,
                 "launch: %llu processes on %u cores: the servers and workers run at niceness "
                 "%d, so that the coordinator keeps its share (--child_nice)\n",
                 static_cast<unsigned long long>(processes), cores, plan.child_nice);
  }
  // torch's OpenMP and OpenBLAS start a thread per core by default, and
  // OpenBLAS's idle threads spin (sched_yield) after each call: N programs
  // on one host's cores then take each other's CPU, and the servers'
  // (measured: 4 GPT workers and 2 servers on 2 cores, a compression step
  // of 104 ms with the defaults against 49 ms with one thread each). So each
  // worker program gets its share of the cores (the workers' compute is
  // what competes; servers and coordinator mostly wait meanwhile), unless
  // the caller chose.
  if (!worker_cmd.empty()) {
    const uint64_t share = std::max<uint64_t>(1, cores / cfg.cluster().workers());
    std::string shown;
    for (const char* name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}) {
      if (std::getenv(name) != nullptr) continue;
      plan.thread_env.push_back(absl::StrCat(name, "=", share));
      absl::StrAppend(&shown, shown.empty() ? "" : " ", plan.thread_env.back());
    }
    if (!shown.empty()) {
      std::fprintf(stderr,
                   "launch: worker programs get %s (%u cores for %u workers; set them in the "
                   "environment to choose)\n",
                   shown.c_str(), cores, cfg.cluster().workers());
    }
  }
  if (plan.max_restarts < 0) ExitFlagError("max_restarts", "must be >= 0");
  // A --worker_cmd program imports our onebit_ps first; its own PYTHONPATH
  // follows.
  std::string& python_path = plan.python_path = OwnPythonPackageDir();
  if (const char* theirs = std::getenv("PYTHONPATH");
      theirs != nullptr && *theirs != '\0' && !python_path.empty()) {
    python_path = absl::StrCat(python_path, ":", theirs);
  }
  // (A host's local ranks are started again together: GroupOf.)
  plan.live = RejoinWait(cfg) > absl::ZeroDuration();
  return plan;
}

int Main(int argc, char** argv) {
  ReportCrashes(argc > 0 ? argv[0] : "");
  CatchStopSignalsInOneThread();
  const LaunchPlan plan = PlanFromCommandLine(argc, argv);
  int restarts_used = 0;
  for (int attempt = 0;; ++attempt) {
    bool running = false;
    const int code = Attempt(plan, attempt, &restarts_used).Run(&running);
    if (code == 0 || restarts_used >= plan.max_restarts || !running) return code;
    if (const int sig = stop_signal.load(); sig != 0) {
      Log(absl::StrCat("not starting the job again: stopped by ", SignalName(sig)));
      return code;
    }
    ++restarts_used;
    Log(absl::StrCat(
        "restart ", restarts_used, " of ", plan.max_restarts, ": starting the whole job again",
        plan.cfg.checkpoint().dir().empty() ? " from the start (it has no --checkpoint_dir)"
                                            : "; it resumes from its last complete checkpoint"));
  }
}

}  // namespace
}  // namespace onebit

// Ends without static destructors (util/process_exit.h says why).
int main(int argc, char** argv) { onebit::ExitWithoutTeardown(onebit::Main(argc, argv)); }
