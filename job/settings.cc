#include "job/settings.h"

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace onebit {
namespace {

using T = SettingType;

// A new setting: add its TrainingConfig field (proto/control.proto) and one
// row here; validation, if any, goes in ValidateConfig.
constexpr JobSetting kSettings[] = {
    {"workers", "cluster.workers", T::kUint32, "1", "cluster", "number of workers N"},
    {"servers", "cluster.servers", T::kUint32, "1", "cluster",
     "number of servers S (one shard each)"},
    {"local_ranks", "cluster.local_ranks", T::kUint32, "1", "cluster",
     "K processes per worker (one host's GPUs or cores): they add their gradients in shared "
     "memory and their local rank 0 pushes once for the host (N x K ranks in all)"},

    {"model", "model.name", T::kString, "synthetic", "model",
     "model: a built-in one (see Models below) | external (the workers' own program, "
     "onebit-launch --worker_cmd: they declare d, and the job ends when every worker has "
     "finished unless --steps is given)"},
    {"model_options", "model.options", T::kStringMap, "", "model",
     "the model's own options as name=value,... (see Models below; in --config also an object "
     "{\"name\": \"value\"}); the defaults fill in the rest"},
    {"dim", "model.dim", T::kUint64, "1000", "model", "parameters d (synthetic model)"},
    {"steps", "model.steps", T::kUint64, "10", "model", "training steps (see --epochs)"},
    {"seed", "model.seed", T::kUint64, "1", "model", "seed of the model, its data and its noise"},
    {"noise", "model.noise", T::kFloat, "0.1", "model", "synthetic: gradient noise scale"},
    {"curvature_spread", "model.curvature_spread", T::kFloat, "0", "model",
     "synthetic: spread the curvatures over 10^±spread (an ill-conditioned problem)"},
    {"skip_model", "model.skip_model", T::kBool, "false", "model",
     "synthetic: skip the model arithmetic (zero gradients; data-plane benchmark)"},
    {"epochs", "model.epochs", T::kUint32, "0", "model",
     "models with a data set (mlp, softmax): train this many epochs (sets --steps: an epoch is "
     "60000 / (N * batch) steps, or max_train / (N * batch))"},
    {"layers", "model.layers", T::kString, "784-256-128-10", "model", "mlp: layer widths"},
    {"batch", "model.batch", T::kUint32, "64", "model", "mlp: local batch per worker"},
    {"data_dir", "model.data_dir", T::kString, "/usr/share/datasets/fashion-mnist", "model",
     "mlp: folder of the Fashion-MNIST IDX files (.gz)"},
    {"eval_every", "model.eval_every", T::kUint64, "0", "model",
     "models with a data set: evaluate the test set every this many steps (0: once an epoch) "
     "and at the end"},
    {"max_train", "model.max_train", T::kUint32, "0", "model",
     "mlp: use only the first N training images (0: all)"},
    {"max_test", "model.max_test", T::kUint32, "0", "model",
     "mlp: use only the first N test images (0: all)"},
    {"blas_threads", "model.blas_threads", T::kUint32, "1", "model",
     "mlp: OpenBLAS threads per worker"},

    {"optimizer", "optimizer.algorithm", T::kEnum, "sgd", "optimizer",
     "sgd | adam | onebit-adam | naive-onebit-adam | ef-sgd | zero-one-adam | onebit-lamb | "
     "diloco (docs/design.md §1.4, §1.6, §1.7, §1.8)"},
    {"lr", "optimizer.lr", T::kFloat, "0.01", "optimizer", "learning rate"},
    {"lr_schedule", "optimizer.lr_schedule", T::kString, "constant", "optimizer",
     "learning rate schedule: constant | warmup:N | cosine"},
    {"beta1", "optimizer.beta1", T::kFloat, "0.9", "optimizer", "Adam beta1"},
    {"beta2", "optimizer.beta2", T::kFloat, "0.999", "optimizer", "Adam beta2"},
    {"eps", "optimizer.eps", T::kFloat, "1e-8", "optimizer", "Adam epsilon"},
    {"weight_decay", "optimizer.weight_decay", T::kFloat, "0", "optimizer",
     "decoupled weight decay"},
    {"bias_correction", "optimizer.bias_correction", T::kBool, "false", "optimizer",
     "Adam bias correction (off, as DeepSpeed's OneBitAdam)"},
    {"freeze_step", "optimizer.freeze_step", T::kUint64, "0", "optimizer",
     "first compression step (the warm-up is steps 0..N-1); 0: use --freeze"},
    {"freeze", "optimizer.freeze", T::kString, "", "optimizer",
     "auto[:tau[:window[:F]]]: freeze once ||v_t - v_{t-K}||_1 / ||v_t||_1 < tau on every "
     "shard, checked every K steps, and at the latest after F of a fixed-length job's steps "
     "(default auto:0.05:50:0.25 when --freeze_step is not given; F 1: no latest)"},
    {"v_floor", "optimizer.v_floor", T::kFloat, "1e-8", "optimizer",
     "floor of the frozen variance: v = max(v, v_floor)"},
    {"var_freeze_step", "optimizer.var_freeze_step", T::kUint64, "100000", "optimizer",
     "zero-one-adam: the last step (counted from 1) that may refresh v; local steps after it",
     "zero-one-adam"},
    {"var_update_scaler", "optimizer.var_update_scaler", T::kUint32, "64", "optimizer",
     "zero-one-adam: v is refreshed this many times at each interval before it doubles",
     "zero-one-adam"},
    {"local_step_scaler", "optimizer.local_step_scaler", T::kUint64, "32678", "optimizer",
     "zero-one-adam: after the freeze the sync interval doubles every this many steps",
     "zero-one-adam"},
    {"local_step_clipper", "optimizer.local_step_clipper", T::kUint32, "16", "optimizer",
     "zero-one-adam: the largest sync interval (H)", "zero-one-adam"},
    {"max_coeff", "optimizer.max_coeff", T::kFloat, "10", "optimizer",
     "onebit-lamb: the warm-up's trust ratio ||x|| / ||u|| is clipped to [min_coeff, max_coeff]",
     "onebit-lamb"},
    {"min_coeff", "optimizer.min_coeff", T::kFloat, "0.01", "optimizer",
     "onebit-lamb: see --max_coeff", "onebit-lamb"},
    {"coeff_beta", "optimizer.coeff_beta", T::kFloat, "0.9", "optimizer",
     "onebit-lamb: the trust ratios' running average, frozen with v", "onebit-lamb"},
    {"factor_max", "optimizer.factor_max", T::kFloat, "4", "optimizer",
     "onebit-lamb: after the freeze a layer steps by its frozen ratio times a factor in "
     "[factor_min, factor_max]",
     "onebit-lamb"},
    {"factor_min", "optimizer.factor_min", T::kFloat, "0.5", "optimizer",
     "onebit-lamb: see --factor_max", "onebit-lamb"},
    {"factor_threshold", "optimizer.factor_threshold", T::kFloat, "0.1", "optimizer",
     "onebit-lamb: the most the factor may change in one step (a fraction)", "onebit-lamb"},
    {"sync_every", "optimizer.sync_every", T::kUint32, "32", "optimizer",
     "diloco: H, the inner AdamW steps per outer step (the job's last step synchronises too)",
     "diloco"},
    {"outer_lr", "optimizer.outer_lr", T::kFloat, "0.7", "optimizer",
     "diloco: the servers' outer learning rate", "diloco"},
    {"outer_momentum", "optimizer.outer_momentum", T::kFloat, "0.9", "optimizer",
     "diloco: the servers' outer Nesterov momentum (0: plain outer steps)", "diloco"},
    {"fragments", "optimizer.fragments", T::kUint32, "1", "optimizer",
     "diloco: F, Streaming DiLoCo's fragments (groups of whole shards, at most --servers), "
     "fragment f synchronised every H steps at an offset of f H / F; 1: the whole model at once",
     "diloco"},
    {"sync_delay", "optimizer.sync_delay", T::kUint32, "0", "optimizer",
     "diloco: tau, the inner steps a sync overlaps (the worker steps on while the outer step "
     "travels, then merges; below H / F); 0: it waits for the outer step",
     "diloco"},
    {"sync_mix", "optimizer.sync_mix", T::kFloat, "0.5", "optimizer",
     "diloco with --sync_delay: alpha, the local model's weight when it merges with the outer "
     "step's result, x = x_sync + alpha (x - x_sync); in [0, 1)",
     "diloco"},

    {"worker_codec", "compression.worker_codec", T::kEnum, "", "compression",
     "compression-phase push codec: fp32 | fp16 | onebit (default: onebit for the compressing "
     "optimizers, fp32 otherwise)"},
    {"server_codec", "compression.server_codec", T::kEnum, "", "compression",
     "compression-phase reply codec (default as --worker_codec)"},
    {"warmup_codec", "compression.warmup_codec", T::kEnum, "fp32", "compression",
     "warm-up pushes and replies: fp32 | fp16 (the servers still sum and update in fp32)"},
    {"error_feedback", "compression.error_feedback", T::kEnum, "both", "compression",
     "error feedback: both | worker | server | none (default: none for diloco, whose outer "
     "momentum amplifies the delayed residuals; both otherwise)"},
    {"server_reply", "compression.server_reply", T::kEnum, "", "compression",
     "compression-phase reply: momentum (replicas equal the master) | delta (C(Δ + e_s)); "
     "default momentum, delta for naive-onebit-adam"},
    {"scale", "compression.scale", T::kEnum, "l1", "compression",
     "onebit block scale: l1 (mean |y|) | l2 (||y||/sqrt(n))"},
    {"block_size", "compression.block_size", T::kUint32, "2048", "compression",
     "codec block size B (multiple of 32)"},

    {"chunk_elems", "compression.chunk_elems", T::kUint64, "0", "data plane",
     "elements per data-plane chunk (multiple of --block_size, at most 2^24); 0: an eighth of "
     "the largest shard, between 16 Ki and 1 Mi (64 KB to 4 MB of fp32)"},
    {"compressed_chunk_elems", "compression.compressed_chunk_elems", T::kUint64, "0", "data plane",
     "elements per chunk of the steps that push through the compression codecs (multiple of "
     "--block_size, at most 2^24); 0: a quarter of the largest shard, at least 512 Ki elements "
     "(64 KB of 1-bit payload) and --chunk_elems, at most the shard; the result is the same "
     "whatever the chunks"},
    {"data_connections", "compression.data_connections", T::kUint32, "1", "data plane",
     "TCP connections from each worker to each server (1 to 16), the chunks spread over them "
     "round-robin: ZeroMQ encrypts each on one I/O thread, so a secured job with few servers "
     "on hosts with spare cores may want 2 or more"},
    {"data_cipher", "compression.data_cipher", T::kEnum, "curve", "data plane",
     "how a secured job's data plane is encrypted: curve (ZeroMQ CURVE, about 1.3 GB/s a core, "
     "in ZeroMQ's I/O threads) | aes-gcm (AES-256-GCM under keys from the same CURVE keys, 4+ "
     "GB/s a core with AES-NI, in the sending and receiving threads; an eavesdropper on the "
     "path can open connections, though every message it sends is refused)"},
    {"step_timeout", "timeouts.step_ms", T::kDuration, "30s", "data plane",
     "how long a server waits for the missing pushes of a step, and a worker for its replies "
     "(worker waits twice this; the first step, which makes the job's connections, gets four "
     "times both)"},
    {"heartbeat_timeout", "timeouts.heartbeat_ms", T::kDuration, "10s", "data plane",
     "a process silent this long is declared dead by the coordinator"},

    {"checkpoint_dir", "checkpoint.dir", T::kString, "", "checkpoints",
     "folder every server, worker and the coordinator reach (a shared volume) where "
     "checkpoints go, one step-N folder each"},
    {"checkpoint_every", "checkpoint.every", T::kUint64, "0", "checkpoints",
     "checkpoint after every N completed steps (0: never)"},
    {"checkpoint_keep", "checkpoint.keep", T::kUint32, "2", "checkpoints",
     "complete checkpoints to keep (0: the default, 2)"},
    {"resume", "checkpoint.resume", T::kBool, "false", "checkpoints",
     "insist on resuming: fail unless --checkpoint_dir holds a complete checkpoint of this "
     "job's config (without it the job resumes from one when there is one, else starts "
     "afresh)"},
    {"rejoin_timeout", "timeouts.rejoin_ms", T::kDuration, "60s", "checkpoints",
     "when a process is lost (or the coordinator restarts), every other process rolls back to "
     "the last complete checkpoint and the job waits this long for the lost one to register "
     "again (restarted by onebit-launch --max_restarts, Kubernetes or you) before it fails; "
     "0: fail at once. Needs --checkpoint_dir"},
    {"checkpoint_failure", "checkpoint.on_failure", T::kEnum, "continue", "checkpoints",
     "a checkpoint that cannot be written (a full volume, an I/O error): continue (the job goes "
     "on without it; its files are removed, and summary.json says durable: false with the "
     "errors) | fail (the job fails, naming the error)"},
};

std::string Normalize(absl::string_view name) { return absl::StrReplaceAll(name, {{"-", "_"}}); }

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

// Where a setting lives: its group's field of TrainingConfig and its own
// field of the group's message; nullptr in either when the row names no
// field (config_test holds every row to one).
struct Place {
  const FieldDescriptor* group = nullptr;
  const FieldDescriptor* leaf = nullptr;
};

Place PlaceOf(const JobSetting& s) {
  const std::pair<absl::string_view, absl::string_view> path = absl::StrSplit(s.field, '.');
  Place p;
  p.group = control::TrainingConfig::descriptor()->FindFieldByName(std::string(path.first));
  if (p.group != nullptr && p.group->message_type() != nullptr) {
    p.leaf = p.group->message_type()->FindFieldByName(std::string(path.second));
  }
  return p;
}

FieldDescriptor::CppType CppTypeOf(SettingType t) {
  switch (t) {
    case T::kStringMap:
      return FieldDescriptor::CPPTYPE_MESSAGE;  // a map is a repeated entry message
    case T::kBool:
      return FieldDescriptor::CPPTYPE_BOOL;
    case T::kUint32:
    case T::kDuration:
      return FieldDescriptor::CPPTYPE_UINT32;
    case T::kUint64:
      return FieldDescriptor::CPPTYPE_UINT64;
    case T::kFloat:
      return FieldDescriptor::CPPTYPE_FLOAT;
    case T::kEnum:
      return FieldDescriptor::CPPTYPE_ENUM;
    case T::kString:
      break;
  }
  return FieldDescriptor::CPPTYPE_STRING;
}

// The values an enum setting takes, as "a | b | c".
std::string EnumChoices(const FieldDescriptor* f) {
  std::vector<std::string> names;
  const google::protobuf::EnumDescriptor* e = f->enum_type();
  for (int i = 0; i < e->value_count(); ++i) {
    if (e->value(i)->number() != 0) names.push_back(EnumText(e->value(i)));
  }
  return absl::StrJoin(names, " | ");
}

std::string TypeName(SettingType t, const FieldDescriptor* f) {
  switch (t) {
    case T::kBool:
      return "true or false";
    case T::kUint32:
    case T::kUint64:
      return "an unsigned integer";
    case T::kFloat:
      return "a number";
    case T::kDuration:
      return "a duration like 30s or 500ms";
    case T::kStringMap:
      return "name=value,... (names not empty, each once)";
    case T::kEnum:
      return absl::StrCat("one of ", EnumChoices(f));
    case T::kString:
      break;
  }
  return "a string";
}

// Whether the place exists and its field has the shape of setting type t.
bool Fits(const Place& p, SettingType t) {
  if (p.group == nullptr || p.leaf == nullptr || p.leaf->cpp_type() != CppTypeOf(t)) return false;
  return t == T::kStringMap ? p.leaf->is_map() : !p.leaf->is_repeated();
}

// "k=v,k=v" -> the pairs, keys with dashes as underscores; nullopt when malformed.
std::optional<std::map<std::string, std::string>> ParseStringMap(absl::string_view text) {
  std::map<std::string, std::string> out;
  if (absl::StripAsciiWhitespace(text).empty()) return out;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    const size_t eq = item.find('=');
    if (eq == item.npos) return std::nullopt;
    const std::string key = Normalize(absl::StripAsciiWhitespace(item.substr(0, eq)));
    if (key.empty()) return std::nullopt;
    if (!out.emplace(key, std::string(absl::StripAsciiWhitespace(item.substr(eq + 1)))).second) {
      return std::nullopt;
    }
  }
  return out;
}

// The shortest text that reads back to exactly v ("0.01", not "0.00999999978").
std::string FloatText(float v) {
  for (int digits = 6; digits < 9; ++digits) {
    std::string t = absl::StrFormat("%.*g", digits, v);
    float back = 0;
    if (absl::SimpleAtof(t, &back) && back == v) return t;
  }
  return absl::StrFormat("%.9g", v);  // 9 digits: exact for any float
}

// The enum value whose text (EnumText) is `text`, or nullptr.
const google::protobuf::EnumValueDescriptor* EnumValueOfText(const FieldDescriptor* f,
                                                             absl::string_view text) {
  const google::protobuf::EnumDescriptor* e = f->enum_type();
  for (int i = 0; i < e->value_count(); ++i) {
    if (EnumText(e->value(i)) == absl::AsciiStrToLower(text)) return e->value(i);
  }
  return nullptr;
}

}  // namespace

absl::Span<const JobSetting> JobSettings() { return kSettings; }

const JobSetting* FindJobSetting(absl::string_view name) {
  const std::string n = Normalize(name);
  for (const JobSetting& s : kSettings) {
    if (n == s.name) return &s;
  }
  return nullptr;
}

std::string EnumText(const google::protobuf::EnumValueDescriptor* value) {
  if (value == nullptr || value->number() == 0) return "";
  // The enum's prefix is its name in upper snake case: ServerReply -> SERVER_REPLY_.
  std::string prefix;
  for (char ch : value->type()->name()) {
    if (absl::ascii_isupper(ch) && !prefix.empty()) prefix += '_';
    prefix += absl::ascii_toupper(ch);
  }
  absl::string_view name = value->name();
  absl::ConsumePrefix(&name, absl::StrCat(prefix, "_"));
  return absl::StrReplaceAll(absl::AsciiStrToLower(name), {{"_", "-"}});
}

absl::Status SetJobSetting(const JobSetting& s, absl::string_view text,
                           control::TrainingConfig* config) {
  const Place p = PlaceOf(s);
  if (!Fits(p, s.type)) {
    return absl::InternalError(
        absl::StrCat("no TrainingConfig field ", s.field, " fits setting ", s.name));
  }
  Message* c = config->GetReflection()->MutableMessage(config, p.group);
  const FieldDescriptor* f = p.leaf;
  const google::protobuf::Reflection* r = c->GetReflection();
  const absl::Status bad = absl::InvalidArgumentError(absl::StrCat("want ", TypeName(s.type, f)));
  const std::string t(absl::StripAsciiWhitespace(text));
  switch (s.type) {
    case T::kBool: {
      bool v = false;
      if (!absl::SimpleAtob(t, &v)) return bad;
      r->SetBool(c, f, v);
      break;
    }
    case T::kUint32: {
      uint32_t v = 0;
      if (!absl::SimpleAtoi(t, &v)) return bad;
      r->SetUInt32(c, f, v);
      break;
    }
    case T::kUint64: {
      uint64_t v = 0;
      if (!absl::SimpleAtoi(t, &v)) return bad;
      r->SetUInt64(c, f, v);
      break;
    }
    case T::kFloat: {
      float v = 0;
      if (!absl::SimpleAtof(t, &v)) return bad;
      r->SetFloat(c, f, v);
      break;
    }
    case T::kDuration: {
      absl::Duration d;
      if (!absl::ParseDuration(t, &d)) return bad;
      if (d < absl::ZeroDuration() ||
          d > absl::Milliseconds(std::numeric_limits<uint32_t>::max())) {
        return absl::InvalidArgumentError("out of range (0 to 49 days)");
      }
      r->SetUInt32(c, f, static_cast<uint32_t>(absl::ToInt64Milliseconds(d)));
      break;
    }
    case T::kString:
      r->SetString(c, f, std::string(text));
      break;
    case T::kEnum: {
      const google::protobuf::EnumValueDescriptor* v = EnumValueOfText(f, t);
      if (v == nullptr) return bad;
      r->SetEnum(c, f, v);
      break;
    }
    case T::kStringMap: {
      std::optional<std::map<std::string, std::string>> pairs = ParseStringMap(text);
      if (!pairs) return bad;
      // The map's entries through reflection: a repeated message of key and value.
      r->ClearField(c, f);
      const google::protobuf::Descriptor* entry = f->message_type();
      for (const auto& [k, v] : *pairs) {
        Message* e = r->AddMessage(c, f);
        e->GetReflection()->SetString(e, entry->FindFieldByName("key"), k);
        e->GetReflection()->SetString(e, entry->FindFieldByName("value"), v);
      }
      break;
    }
  }
  return absl::OkStatus();
}

std::string JobSettingText(const JobSetting& s, const control::TrainingConfig& config) {
  const Place p = PlaceOf(s);
  if (!Fits(p, s.type)) return "";
  const Message& c = config.GetReflection()->GetMessage(config, p.group);
  const FieldDescriptor* f = p.leaf;
  const google::protobuf::Reflection* r = c.GetReflection();
  switch (s.type) {
    case T::kBool:
      return r->GetBool(c, f) ? "true" : "false";
    case T::kUint32:
      return absl::StrCat(r->GetUInt32(c, f));
    case T::kUint64:
      return absl::StrCat(r->GetUInt64(c, f));
    case T::kFloat:
      return FloatText(r->GetFloat(c, f));
    case T::kDuration:
      return absl::FormatDuration(absl::Milliseconds(r->GetUInt32(c, f)));
    case T::kEnum:
      return EnumText(r->GetEnum(c, f));
    case T::kStringMap: {
      const google::protobuf::Descriptor* entry = f->message_type();
      std::map<std::string, std::string> sorted;  // a protobuf map has no order
      for (int i = 0; i < r->FieldSize(c, f); ++i) {
        const Message& e = r->GetRepeatedMessage(c, f, i);
        sorted[e.GetReflection()->GetString(e, entry->FindFieldByName("key"))] =
            e.GetReflection()->GetString(e, entry->FindFieldByName("value"));
      }
      return absl::StrJoin(sorted, ",", absl::PairFormatter("="));
    }
    case T::kString:
      break;
  }
  return r->GetString(c, f);
}

control::TrainingConfig DefaultJobConfig() {
  control::TrainingConfig c;
  // Every default parses (config_test checks), so errors cannot happen here.
  for (const JobSetting& s : kSettings) SetJobSetting(s, s.default_value, &c).IgnoreError();
  return c;
}

std::string JobSettingsJson(const control::TrainingConfig& config) {
  google::protobuf::Struct out;
  auto& fields = *out.mutable_fields();
  for (const JobSetting& s : kSettings) {
    const std::string text = JobSettingText(s, config);
    google::protobuf::Value& v = fields[s.name];
    switch (s.type) {
      case T::kBool:
        v.set_bool_value(text == "true");
        break;
      case T::kUint32:
      case T::kUint64:
      case T::kFloat: {
        double d = 0;
        (void)absl::SimpleAtod(text, &d);  // JobSettingText wrote a number
        v.set_number_value(d);
        break;
      }
      default:
        v.set_string_value(text);
    }
  }
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(out, &json);
  return json;
}

}  // namespace onebit
