#include "job/run_folder.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "checkpoint/state_file.h"

namespace onebit {
namespace {

// Temporary name, fsync, rename, fsync of the folder (checkpoint/state_file.h).
absl::Status WriteAtomically(const std::string& path, const std::string& text) {
  const std::filesystem::path p(path);
  const std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
  const absl::string_view parts[] = {text};
  return WriteFileAtomically(dir, p.filename().string(), parts).status();
}

std::string Num(double v) { return absl::StrFormat("%.9g", v); }

// JSON has no inf or nan.
std::string JsonNum(double v) { return std::isfinite(v) ? Num(v) : std::string("null"); }

// A float setting as the user gave it: the fewest significant digits that
// read back as the same float (at most 9 are needed).
std::string JsonFloat(float v) {
  if (!std::isfinite(v)) return "null";
  for (int digits = 1; digits < 9; ++digits) {
    std::string text = absl::StrFormat("%.*g", digits, v);
    if (std::strtof(text.c_str(), nullptr) == v) return text;
  }
  return absl::StrFormat("%.9g", v);
}

constexpr char kCsvHeader[] =
    "step,phase,loss,wall_s,bytes_up,bytes_down,step_s,push_s,reply_s,epoch,test_loss,"
    "test_accuracy\n";

}  // namespace

absl::Status MakeDirs(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

std::string JsonQuote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

namespace {
std::string JsonStrings(const std::vector<std::string>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + JsonQuote(v[i]);
  return out + "]";
}
}  // namespace

absl::Status WriteFloats(const std::string& path, const std::vector<float>& v) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(v.data()),
            static_cast<std::streamsize>(v.size() * sizeof(float)));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

namespace {

std::string CsvRows(const std::vector<MetricsRow>& rows) {
  std::string text;
  auto opt = [](const std::optional<double>& v) { return v ? Num(*v) : std::string(); };
  for (const MetricsRow& r : rows) {
    absl::StrAppend(&text, r.step, ",", r.phase, ",", Num(r.loss), ",", Num(r.wall_s), ",",
                    r.bytes_up, ",", r.bytes_down, ",", Num(r.step_s), ",", Num(r.push_s), ",",
                    Num(r.reply_s), ",", Num(r.epoch), ",", opt(r.test_loss), ",",
                    opt(r.test_accuracy), "\n");
  }
  return text;
}

}  // namespace

absl::Status WriteMetricsCsv(const std::string& path, const std::vector<MetricsRow>& rows) {
  return WriteAtomically(path, kCsvHeader + CsvRows(rows));
}

absl::StatusOr<std::vector<MetricsRow>> ReadMetricsCsv(const std::string& path) {
  std::ifstream in(path);
  std::vector<MetricsRow> rows;
  if (!in) return rows;
  std::string line;
  std::getline(in, line);
  if (line + "\n" != kCsvHeader) {
    return absl::DataLossError(
        absl::StrCat(path, ": not a metrics.csv of this version (header '", line, "')"));
  }
  for (int n = 2; std::getline(in, line); ++n) {
    // A crash may have cut the last line short; it is dropped.
    if (in.eof()) break;
    const std::vector<std::string> f = absl::StrSplit(line, ',');
    MetricsRow r;
    bool ok = f.size() == 12 && absl::SimpleAtoi(f[0], &r.step) &&
              absl::SimpleAtod(f[2], &r.loss) && absl::SimpleAtod(f[3], &r.wall_s) &&
              absl::SimpleAtoi(f[4], &r.bytes_up) && absl::SimpleAtoi(f[5], &r.bytes_down) &&
              absl::SimpleAtod(f[6], &r.step_s) && absl::SimpleAtod(f[7], &r.push_s) &&
              absl::SimpleAtod(f[8], &r.reply_s) && absl::SimpleAtod(f[9], &r.epoch);
    if (ok) {
      r.phase = f[1];
      for (auto [text, out] : {std::pair{&f[10], &r.test_loss}, {&f[11], &r.test_accuracy}}) {
        double v = 0;
        if (text->empty()) continue;
        ok &= absl::SimpleAtod(*text, &v);
        *out = v;
      }
    }
    if (!ok) return absl::DataLossError(absl::StrCat(path, " line ", n, ": not a metrics row"));
    rows.push_back(std::move(r));
  }
  return rows;
}

absl::StatusOr<MetricsLog> MetricsLog::Open(const std::string& path,
                                            const std::vector<MetricsRow>& first_rows) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    return absl::InternalError(absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  MetricsLog log(f, path);
  const std::string text = kCsvHeader + CsvRows(first_rows);
  if (std::fputs(text.c_str(), f) < 0 || std::fflush(f) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  return log;
}

MetricsLog::MetricsLog(MetricsLog&& other) noexcept
    : f_(std::exchange(other.f_, nullptr)), path_(std::move(other.path_)) {}

MetricsLog& MetricsLog::operator=(MetricsLog&& other) noexcept {
  if (this != &other) {
    if (f_ != nullptr) std::fclose(f_);
    f_ = std::exchange(other.f_, nullptr);
    path_ = std::move(other.path_);
  }
  return *this;
}

MetricsLog::~MetricsLog() {
  if (f_ != nullptr) std::fclose(f_);
}

absl::Status MetricsLog::Append(const std::vector<MetricsRow>& rows) {
  if (f_ == nullptr) return absl::FailedPreconditionError(absl::StrCat(path_, " is closed"));
  if (rows.empty()) return absl::OkStatus();
  const std::string text = CsvRows(rows);
  if (std::fwrite(text.data(), 1, text.size(), f_) != text.size() || std::fflush(f_) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status MetricsLog::Close() {
  if (f_ == nullptr) return absl::OkStatus();
  bool ok = std::fflush(f_) == 0;
  ok = fsync(fileno(f_)) == 0 && ok;
  ok = std::fclose(f_) == 0 && ok;
  f_ = nullptr;
  if (!ok)
    return absl::InternalError(absl::StrCat("cannot write ", path_, ": ", std::strerror(errno)));
  return absl::OkStatus();
}

std::optional<RestartHistory> ReadRestartHistory(const std::string& summary_path) {
  std::ifstream in(summary_path);
  if (!in) return std::nullopt;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto count = [&](absl::string_view key, auto* out) {
    const std::string tag = absl::StrCat("\"", key, "\": ");
    const size_t at = text.find(tag);
    if (at == std::string::npos) return false;
    const size_t begin = at + tag.size();
    return absl::SimpleAtoi(text.substr(begin, text.find_first_of(",\n}", begin) - begin), out);
  };
  RestartHistory h;
  if (!count("restarts", &h.restarts) || !count("rolled_back_steps", &h.rolled_back_steps)) {
    return std::nullopt;
  }
  return h;
}

absl::Status CheckNotFinished(const std::string& dir) {
  const std::string path = dir + "/summary.json";
  std::ifstream in(path);
  if (!in) return absl::OkStatus();
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.find("\"status\": \"ok\"") == std::string::npos) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(path,
                   " is a finished job's (status ok): not overwriting it; remove the "
                   "folder or choose another --out"));
}

namespace {
// Bytes per compression-phase step over fp32's bytes per step; null when the
// run never compressed.
std::string CompressRatio(const Summary& s, uint64_t bytes) {
  if (s.compress_steps == 0 || s.steps == 0 || s.bytes_up_fp32 == 0) return "null";
  const double fp32_per_step = static_cast<double>(s.bytes_up_fp32) / static_cast<double>(s.steps);
  return Num(static_cast<double>(bytes) / static_cast<double>(s.compress_steps) / fp32_per_step);
}
// [[steps completed, largest change], ...]
std::string FreezeChecks(const Summary& s) {
  std::vector<std::string> checks;
  for (const auto& [after, change] : s.freeze_checks) {
    checks.push_back(absl::StrCat("[", after, ", ", JsonNum(change), "]"));
  }
  return absl::StrCat("[", absl::StrJoin(checks, ", "), "]");
}
}  // namespace

absl::Status WriteSummaryJson(const std::string& path, const Summary& s) {
  auto opt_u = [](const std::optional<uint64_t>& v) {
    return v ? absl::StrCat(*v) : std::string("null");
  };
  auto opt_d = [](const std::optional<double>& v) { return v ? JsonNum(*v) : std::string("null"); };
  auto opt_b = [](const std::optional<bool>& v) { return !v ? "null" : *v ? "true" : "false"; };
  std::string text = absl::StrCat(
      "{\n", "  \"optimizer\": ", JsonQuote(s.optimizer), ",\n", "  \"lr\": ", JsonFloat(s.lr),
      ",\n", "  \"workers\": ", s.workers, ",\n", "  \"servers\": ", s.servers, ",\n",
      "  \"params\": ", s.params, ",\n", "  \"steps\": ", s.steps, ",\n",
      "  \"freeze_step\": ", opt_u(s.freeze_step), ",\n", "  \"wall_s\": ", JsonNum(s.wall_s),
      ",\n", "  \"bytes_up\": ", s.bytes_up, ",\n", "  \"bytes_down\": ", s.bytes_down, ",\n",
      "  \"bytes_up_fp32\": ", s.bytes_up_fp32, ",\n", "  \"bytes_down_fp32\": ", s.bytes_down_fp32,
      ",\n", "  \"final_loss\": ", opt_d(s.final_loss), ",\n",
      "  \"diverged\": ", s.diverged ? "true" : "false", ",\n",
      "  \"test_accuracy\": ", opt_d(s.test_accuracy), ",\n",
      "  \"test_loss\": ", opt_d(s.test_loss), ",\n",
      "  \"replicas_equal\": ", s.replicas_equal ? "true" : "false", ",\n",
      "  \"worker_codec\": ", JsonQuote(s.worker_codec), ",\n",
      "  \"server_codec\": ", JsonQuote(s.server_codec), ",\n",
      "  \"error_feedback\": ", JsonQuote(s.error_feedback), ",\n",
      "  \"server_reply\": ", JsonQuote(s.server_reply), ",\n",
      "  \"freeze\": ", JsonQuote(s.freeze), ",\n", "  \"freeze_checks\": ", FreezeChecks(s), ",\n",
      "  \"freeze_warning\": ", s.freeze_warning.empty() ? "null" : JsonQuote(s.freeze_warning),
      ",\n", "  \"v_floor\": ", JsonFloat(s.v_floor), ",\n", "  \"v_floored\": ", s.v_floored,
      ",\n", "  \"compress_steps\": ", s.compress_steps, ",\n", "  \"rounds\": ", s.rounds, ",\n",
      "  \"bytes_up_warmup\": ", s.bytes_up_warmup, ",\n",
      "  \"bytes_up_compress\": ", s.bytes_up_compress, ",\n",
      "  \"bytes_down_warmup\": ", s.bytes_down_warmup, ",\n",
      "  \"bytes_down_compress\": ", s.bytes_down_compress, ",\n",
      // Compression-phase bytes per step over what fp32 sends per step.
      "  \"compress_ratio_up\": ", CompressRatio(s, s.bytes_up_compress), ",\n",
      "  \"compress_ratio_down\": ", CompressRatio(s, s.bytes_down_compress), ",\n",
      "  \"workers_agree\": ", s.workers_agree ? "true" : "false", ",\n",
      "  \"max_replica_master_diff\": ", opt_d(s.max_replica_master_diff), ",\n",
      "  \"worker_devices\": ", JsonStrings(s.worker_devices), ",\n",
      "  \"checkpoints\": ", s.checkpoints, ",\n",
      "  \"last_checkpoint_step\": ", opt_u(s.last_checkpoint_step), ",\n",
      "  \"checkpoint_errors\": ", s.checkpoint_errors, ",\n", "  \"last_checkpoint_error\": ",
      s.last_checkpoint_error.empty() ? "null" : JsonQuote(s.last_checkpoint_error), ",\n",
      "  \"durable\": ", opt_b(s.durable), ",\n",
      "  \"resumed_from_step\": ", opt_u(s.resumed_from_step), ",\n",
      "  \"stopped_at_step\": ", opt_u(s.stopped_at_step), ",\n", "  \"restarts\": ", s.restarts,
      ",\n", "  \"rolled_back_steps\": ", s.rolled_back_steps, ",\n",
      "  \"rollbacks\": ", s.rollbacks, ",\n", "  \"job_id\": ", JsonQuote(s.job_id), ",\n",
      "  \"status\": ", JsonQuote(s.status), "\n}\n");
  return WriteAtomically(path, text);
}

}  // namespace onebit
