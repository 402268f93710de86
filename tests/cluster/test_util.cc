#include "tests/cluster/test_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compress/codec.h"
#include "gtest/gtest.h"
#include "job/config.h"
#include "models/model.h"
#include "net/data_plane.h"
#include "optim/reference.h"
#include "security/job_secret.h"
#include "shard/shard_map.h"
#include "tests/common/scratch.h"

namespace onebit::testing {

std::string Field(const std::string& summary, const std::string& key) {
  const std::string k = absl::StrCat("\"", key, "\": ");
  const size_t at = summary.find(k);
  if (at == std::string::npos) return "<missing " + key + ">";
  const size_t begin = at + k.size();
  std::string v = summary.substr(begin, summary.find('\n', begin) - begin);
  if (!v.empty() && v.back() == ',') v.pop_back();
  return v;
}

std::string Bin(const std::string& name) {
  const char* dir = std::getenv("ONEBIT_TEST_BIN_DIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : ONEBIT_BIN_DIR) + "/" + name;
}

std::string TempDir(const std::string& name) { return ScratchDir("onebit-rt", name); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<float> ReadFloats(const std::string& path) {
  const std::string bytes = ReadFile(path);
  std::vector<float> v(bytes.size() / sizeof(float));
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

Subprocess Start(const std::vector<std::string>& argv, const std::string& log_path) {
  int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  EXPECT_GE(fd, 0) << log_path;
  auto p = Subprocess::Spawn(argv, fd, fd);
  close(fd);
  EXPECT_TRUE(p.ok()) << p.status();
  return std::move(*p);
}

RunResult RunCommand(const std::vector<std::string>& argv, absl::Duration timeout) {
  static int counter = 0;
  const std::string log =
      absl::StrCat(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp",
                   "/onebit-rt-run-", getpid(), "-", counter++, ".log");
  Subprocess p = Start(argv, log);
  RunResult r;
  auto code = p.Wait(timeout);
  if (code) {
    r.code = *code;
  } else {
    p.Stop(absl::Seconds(1));
  }
  r.output = ReadFile(log);
  std::remove(log.c_str());
  return r;
}

std::string FirstDifference(const std::vector<float>& a, const std::vector<float>& b,
                            uint64_t offset) {
  if (a.size() != b.size()) return absl::StrCat("sizes differ: ", a.size(), " vs ", b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      return absl::StrFormat("element %d differs: %.9g vs %.9g", offset + i, a[i], b[i]);
    }
  }
  return "";
}

void SetSetting(control::TrainingConfig* config, const char* name, const std::string& text) {
  const JobSetting* s = FindJobSetting(name);
  ASSERT_NE(s, nullptr) << name;
  const absl::Status st = SetJobSetting(*s, text, config);
  ASSERT_TRUE(st.ok()) << "--" << name << "=" << text << ": " << st;
}

control::TrainingConfig MakeConfig(uint32_t workers, uint32_t servers, uint64_t dim, uint64_t steps,
                                   const std::string& optimizer) {
  control::TrainingConfig c;
  c.mutable_cluster()->set_workers(workers);
  c.mutable_cluster()->set_servers(servers);
  c.mutable_model()->set_name("synthetic");
  c.mutable_model()->set_dim(dim);
  c.mutable_model()->set_steps(steps);
  c.mutable_model()->set_seed(7);
  SetSetting(&c, "optimizer", optimizer);
  c.mutable_optimizer()->set_lr(optimizer == "adam" ? 0.01f : 0.1f);
  c.mutable_optimizer()->set_beta1(0.9f);
  c.mutable_optimizer()->set_beta2(0.999f);
  c.mutable_optimizer()->set_eps(1e-8f);
  c.mutable_optimizer()->set_weight_decay(optimizer == "adam" ? 0.01f : 0.0f);
  auto kind = ParseOptimizerKind(optimizer);
  const std::string codec = kind.ok() ? std::string(DefaultCodec(*kind)) : "fp32";
  SetSetting(&c, "worker_codec", codec);
  SetSetting(&c, "server_codec", codec);
  c.mutable_optimizer()->set_lr_schedule("constant");
  SetSetting(&c, "error_feedback", "both");
  SetSetting(&c, "server_reply",
             kind.ok() ? std::string(ReplyModeName(DefaultReplyMode(*kind))) : "momentum");
  SetSetting(&c, "scale", "l1");
  SetSetting(&c, "warmup_codec", "fp32");
  SetSetting(&c, "checkpoint_failure", "continue");
  c.mutable_optimizer()->set_v_floor(1e-8f);
  c.mutable_optimizer()->set_fragments(1);
  c.mutable_optimizer()->set_sync_mix(0.5f);
  c.mutable_compression()->set_block_size(32);
  c.mutable_compression()->set_chunk_elems(256);
  c.mutable_timeouts()->set_step_ms(20000);
  c.mutable_timeouts()->set_heartbeat_ms(20000);
  c.mutable_model()->set_noise(0.5f);
  c.mutable_model()->set_skip_model(false);
  return c;
}

std::vector<std::string> ConfigArgs(const control::TrainingConfig& c) {
  std::vector<std::string> args = {
      absl::StrCat("--workers=", c.cluster().workers()),
      absl::StrCat("--servers=", c.cluster().servers()),
      absl::StrCat("--local_ranks=", std::max<uint32_t>(1, c.cluster().local_ranks())),
      "--model=" + c.model().name(),
      absl::StrCat("--dim=", c.model().dim()),
      absl::StrCat("--steps=", c.model().steps()),
      absl::StrCat("--seed=", c.model().seed()),
      "--optimizer=" + EnumText(c.optimizer().algorithm()),
      absl::StrFormat("--lr=%.9g", c.optimizer().lr()),
      absl::StrFormat("--beta1=%.9g", c.optimizer().beta1()),
      absl::StrFormat("--beta2=%.9g", c.optimizer().beta2()),
      absl::StrFormat("--eps=%.9g", c.optimizer().eps()),
      absl::StrFormat("--weight_decay=%.9g", c.optimizer().weight_decay()),
      "--worker_codec=" + EnumText(c.compression().worker_codec()),
      "--server_codec=" + EnumText(c.compression().server_codec()),
      "--warmup_codec=" + EnumText(c.compression().warmup_codec()),
      "--lr_schedule=" + c.optimizer().lr_schedule(),
      absl::StrCat("--bias_correction=", c.optimizer().bias_correction() ? "true" : "false"),
      absl::StrCat("--freeze_step=", c.optimizer().freeze_step()),
      "--freeze=" + c.optimizer().freeze(),
      absl::StrFormat("--v_floor=%.9g", c.optimizer().v_floor()),
      absl::StrCat("--var_freeze_step=", c.optimizer().var_freeze_step()),
      absl::StrCat("--var_update_scaler=", c.optimizer().var_update_scaler()),
      absl::StrCat("--local_step_scaler=", c.optimizer().local_step_scaler()),
      absl::StrCat("--local_step_clipper=", c.optimizer().local_step_clipper()),
      absl::StrCat("--sync_every=", c.optimizer().sync_every()),
      absl::StrFormat("--outer_lr=%.9g", c.optimizer().outer_lr()),
      absl::StrFormat("--outer_momentum=%.9g", c.optimizer().outer_momentum()),
      absl::StrCat("--fragments=", c.optimizer().fragments()),
      absl::StrCat("--sync_delay=", c.optimizer().sync_delay()),
      absl::StrFormat("--sync_mix=%.9g", c.optimizer().sync_mix()),
      "--error_feedback=" + EnumText(c.compression().error_feedback()),
      "--server_reply=" + EnumText(c.compression().server_reply()),
      "--scale=" + EnumText(c.compression().scale()),
      absl::StrCat("--block_size=", c.compression().block_size()),
      absl::StrCat("--chunk_elems=", c.compression().chunk_elems()),
      absl::StrCat("--compressed_chunk_elems=", c.compression().compressed_chunk_elems()),
      absl::StrCat("--data_connections=",
                   std::max<uint32_t>(1, c.compression().data_connections())),
      "--data_cipher=" + (c.compression().data_cipher() == control::DATA_CIPHER_UNSPECIFIED
                              ? std::string("curve")
                              : EnumText(c.compression().data_cipher())),
      absl::StrCat("--step_timeout=", c.timeouts().step_ms(), "ms"),
      absl::StrCat("--heartbeat_timeout=", c.timeouts().heartbeat_ms(), "ms"),
      absl::StrFormat("--noise=%.9g", c.model().noise()),
      absl::StrFormat("--curvature_spread=%.9g", c.model().curvature_spread())};
  // An optimizer's own settings only where it is the job's (another refuses them).
  const std::string optimizer = EnumText(c.optimizer().algorithm());
  args.erase(std::remove_if(args.begin(), args.end(),
                            [&](const std::string& a) {
                              const JobSetting* s = FindJobSetting(a.substr(2, a.find('=') - 2));
                              return s != nullptr && s->only_for != nullptr &&
                                     optimizer != s->only_for;
                            }),
             args.end());
  return args;
}

bool WaitForText(const std::string& path, const std::string& text, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (ReadFile(path).find(text) != std::string::npos) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

std::vector<int> ProcessesMentioning(const std::string& text) {
  std::vector<int> pids;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    int pid = 0;
    if (!absl::SimpleAtoi(e.path().filename().string(), &pid) || pid == getpid()) continue;
    std::string cmd = ReadFile(e.path().string() + "/cmdline");
    std::replace(cmd.begin(), cmd.end(), '\0', ' ');
    if (cmd.find(text) != std::string::npos) pids.push_back(pid);
  }
  return pids;
}

ReferenceResult Reference(const control::TrainingConfig& cfg) {
  ReferenceResult out;
  auto model = NewModel(cfg);
  EXPECT_TRUE(model.ok()) << model.status();
  auto map = ShardMapForConfig(cfg, ModelLayerEnds(cfg).value_or(std::vector<uint64_t>{}));
  EXPECT_TRUE(map.ok()) << map.status();
  ReferenceOptions o;
  o.workers = cfg.cluster().workers();
  o.local_ranks = cfg.cluster().local_ranks();
  o.map = *map;
  o.steps = cfg.model().steps();
  auto optimizer = OptimizerOptionsFromConfig(cfg);
  EXPECT_TRUE(optimizer.ok()) << optimizer.status();
  o.optimizer = *optimizer;
  o.optimizer.layer_ends = ModelLayerEnds(cfg).value_or(std::vector<uint64_t>{});
  auto freeze = FreezeOptionsFromConfig(cfg);
  EXPECT_TRUE(freeze.ok()) << freeze.status();
  o.freeze = *freeze;
  std::vector<float> x0(cfg.model().dim());
  (*model)->Init(x0.data());
  auto r = RunReference(o, x0, [&](const float* x, uint32_t rank, uint64_t step, float* g) {
    return (*model)->Gradient(x, rank, step, g);
  });
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return out;
  out.x = r->workers[0].x;
  for (const WorkerState& w : r->workers) out.workers.push_back(w.x);
  out.worker_states = r->workers;
  out.masters = std::move(r->servers);
  out.losses = std::move(r->losses);
  out.freeze_step = r->freeze_step;
  out.push_bytes = std::move(r->push_bytes);
  out.reply_bytes = std::move(r->reply_bytes);
  return out;
}

std::string SecretFile() {
  static const std::string path = [] {
    const std::string p = ScratchDirForProcess("onebit-rt", "job-secret") + "/secret";
    if (!JobSecret::Generate().WriteFile(p).ok()) std::abort();
    return p;
  }();
  return path;
}

std::string SecretFlag() { return "--secret_file=" + SecretFile(); }

int FreeLocalPort() {
  // Random draws spread concurrent tests apart; the bind proves the port free.
  static std::mt19937 rng(std::random_device{}() ^ static_cast<unsigned>(getpid()));
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = std::uniform_int_distribution<int>(20000, 32000)(rng);
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    close(fd);
    if (free) return port;
  }
  ADD_FAILURE() << "no free loopback port in 20000-32000 after 200 draws";
  std::abort();
}

Ports::Ports() {
  listening_fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(listening_fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  EXPECT_EQ(listen(listening_fd, 128), 0);  // never accepted: room for every probe
  socklen_t len = sizeof(a);
  getsockname(listening_fd, reinterpret_cast<sockaddr*>(&a), &len);
  listening = absl::StrCat("127.0.0.1:", ntohs(a.sin_port));
  // Below the ephemeral range, so a connect to it can never be handed the
  // same port as its source and connect to itself.
  gone = absl::StrCat("127.0.0.1:", FreeLocalPort());
}

Ports::~Ports() { close(listening_fd); }

LocalCoordinator ServeLocally(control::Coordinator::Service* svc) {
  LocalCoordinator local;
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(svc);
  local.server = b.BuildAndStart();
  if (port <= 0) local.server.reset();
  local.target = absl::StrCat("127.0.0.1:", port);
  local.stub = control::Coordinator::NewStub(
      grpc::CreateChannel(local.target, grpc::InsecureChannelCredentials()));
  return local;
}

}  // namespace onebit::testing
