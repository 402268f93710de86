#include "job/run_folder.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "checkpoint/state_file.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

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

absl::StatusOr<run::Summary> ReadSummaryJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("no ", path));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  run::Summary s;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  const auto parsed = google::protobuf::util::JsonStringToMessage(text, &s, options);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a summary.json: ", parsed.ToString()));
  }
  return s;
}

std::optional<RestartHistory> ReadRestartHistory(const std::string& summary_path) {
  const absl::StatusOr<run::Summary> s = ReadSummaryJson(summary_path);
  if (!s.ok()) return std::nullopt;
  return RestartHistory{s->restarts(), s->rolled_back_steps()};
}

absl::Status CheckNotFinished(const std::string& dir) {
  const std::string path = dir + "/summary.json";
  const absl::StatusOr<run::Summary> s = ReadSummaryJson(path);
  if (absl::IsNotFound(s.status())) return absl::OkStatus();
  if (!s.ok()) {
    // Perhaps a finished job's, damaged: not ours to overwrite.
    return absl::FailedPreconditionError(absl::StrCat(
        s.status().message(), ": not overwriting it; remove the folder or choose another --out"));
  }
  if (s->status() != "ok") return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(path,
                   " is a finished job's (status ok): not overwriting it; remove the "
                   "folder or choose another --out"));
}

namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// Bytes per compression-phase step over fp32's bytes per step; nullopt when
// the run never compressed.
std::optional<double> CompressRatio(const run::Summary& s, uint64_t bytes) {
  if (s.compress_steps() == 0 || s.steps() == 0 || s.bytes_up_fp32() == 0) return std::nullopt;
  const double fp32_per_step =
      static_cast<double>(s.bytes_up_fp32()) / static_cast<double>(s.steps());
  return static_cast<double>(bytes) / static_cast<double>(s.compress_steps()) / fp32_per_step;
}

// Element i of a repeated field, or the singular field when i < 0, as JSON.
absl::StatusOr<std::string> FieldJson(const Message& m, const FieldDescriptor* f, int i) {
  const Reflection& r = *m.GetReflection();
  const bool rep = i >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(rep ? r.GetRepeatedInt32(m, f, i) : r.GetInt32(m, f));
    case FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat(rep ? r.GetRepeatedInt64(m, f, i) : r.GetInt64(m, f));
    case FieldDescriptor::CPPTYPE_UINT32:
      return absl::StrCat(rep ? r.GetRepeatedUInt32(m, f, i) : r.GetUInt32(m, f));
    case FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrCat(rep ? r.GetRepeatedUInt64(m, f, i) : r.GetUInt64(m, f));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return JsonFloat(rep ? r.GetRepeatedFloat(m, f, i) : r.GetFloat(m, f));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return JsonNum(rep ? r.GetRepeatedDouble(m, f, i) : r.GetDouble(m, f));
    case FieldDescriptor::CPPTYPE_BOOL:
      return std::string((rep ? r.GetRepeatedBool(m, f, i) : r.GetBool(m, f)) ? "true" : "false");
    case FieldDescriptor::CPPTYPE_STRING:
      return JsonQuote(rep ? r.GetRepeatedString(m, f, i) : r.GetString(m, f));
    case FieldDescriptor::CPPTYPE_ENUM:
      return JsonQuote((rep ? r.GetRepeatedEnum(m, f, i) : r.GetEnum(m, f))->name());
    case FieldDescriptor::CPPTYPE_MESSAGE: {
      const Message& sub = rep ? r.GetRepeatedMessage(m, f, i) : r.GetMessage(m, f);
      // A list of numbers (a freeze check) spaced as the rest of the file.
      if (const auto* list = dynamic_cast<const google::protobuf::ListValue*>(&sub);
          list != nullptr && std::all_of(list->values().begin(), list->values().end(),
                                         [](const google::protobuf::Value& v) {
                                           return v.has_number_value() || v.has_null_value();
                                         })) {
        std::vector<std::string> items;
        for (const google::protobuf::Value& v : list->values()) {
          items.push_back(v.has_number_value() ? JsonNum(v.number_value()) : "null");
        }
        return absl::StrCat("[", absl::StrJoin(items, ", "), "]");
      }
      // Any other message in protobuf's own form.
      std::string out;
      const auto st = google::protobuf::util::MessageToJsonString(sub, &out);
      if (!st.ok()) {
        return absl::InternalError(absl::StrCat(f->name(), ": ", st.ToString()));
      }
      return out;
    }
  }
  return absl::InternalError(absl::StrCat(f->name(), ": no JSON form for its type"));
}

}  // namespace

absl::Status WriteSummaryJson(const std::string& path, const run::Summary& summary) {
  run::Summary s = summary;
  if (auto r = CompressRatio(s, s.bytes_up_compress())) s.set_compress_ratio_up(*r);
  if (auto r = CompressRatio(s, s.bytes_down_compress())) s.set_compress_ratio_down(*r);
  const google::protobuf::Descriptor& d = *s.GetDescriptor();
  const Reflection& r = *s.GetReflection();
  std::vector<std::string> lines;
  for (int k = 0; k < d.field_count(); ++k) {
    const FieldDescriptor* f = d.field(k);
    std::string value;
    if (f->is_repeated()) {
      std::vector<std::string> items;
      for (int i = 0; i < r.FieldSize(s, f); ++i) {
        absl::StatusOr<std::string> v = FieldJson(s, f, i);
        if (!v.ok()) return v.status();
        items.push_back(*std::move(v));
      }
      value = absl::StrCat("[", absl::StrJoin(items, ", "), "]");
    } else if (f->has_presence() && !r.HasField(s, f)) {
      value = "null";
    } else {
      absl::StatusOr<std::string> v = FieldJson(s, f, -1);
      if (!v.ok()) return v.status();
      value = *std::move(v);
    }
    lines.push_back(absl::StrCat("  ", JsonQuote(f->name()), ": ", value));
  }
  return WriteAtomically(path, absl::StrCat("{\n", absl::StrJoin(lines, ",\n"), "\n}\n"));
}

}  // namespace onebit
