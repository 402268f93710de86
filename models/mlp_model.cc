#include "models/mlp_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "models/blas_loader.h"
#include "models/registry.h"
#include "models/rng.h"

namespace onebit {

// Scratch memory for one forward/backward pass of up to `rows` examples.
struct MlpModel::Workspace {
  size_t rows = 0;
  std::vector<uint32_t> idx;
  std::vector<uint8_t> y;
  std::vector<float> x;                 // rows x layers[0]
  std::vector<std::vector<float>> act;  // act[l]: rows x layers[l+1], post-ReLU (logits last)
  std::vector<float> delta[2];          // ping-pong gradients w.r.t. pre-activations
};

namespace {

// True when every element is finite: an integer test on the exponent bits,
// which compilers vectorise (a float sum would not be, without fast-math).
bool AllFinite(const float* v, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, v + i, 4);
    bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

// Loss of one row of logits z (n classes) with label y: log-sum-exp around
// the maximum, so large logits cannot overflow. p (optional) = softmax(z).
double RowLoss(const float* z, size_t n, uint8_t y, double* p) {
  float mx = z[0];
  for (size_t k = 1; k < n; ++k) mx = std::max(mx, z[k]);
  double sum = 0;
  for (size_t k = 0; k < n; ++k) {
    const double e = std::exp(static_cast<double>(z[k]) - mx);
    if (p != nullptr) p[k] = e;
    sum += e;
  }
  if (p != nullptr) {
    for (size_t k = 0; k < n; ++k) p[k] /= sum;
  }
  return static_cast<double>(mx) + std::log(sum) - static_cast<double>(z[y]);
}

}  // namespace

MlpModel::MlpModel(const MlpOptions& o, std::shared_ptr<const ImageDataset> data,
                   std::unique_ptr<EpochSampler> sampler, const BlasApi* blas)
    : o_(o), data_(std::move(data)), sampler_(std::move(sampler)), blas_(blas) {
  uint64_t off = 0;
  for (size_t l = 0; l + 1 < o_.layers.size(); ++l) {
    w_off_.push_back(off);
    off += uint64_t{o_.layers[l]} * o_.layers[l + 1];
    b_off_.push_back(off);
    off += o_.layers[l + 1];
  }
  num_params_ = off;
}

MlpModel::~MlpModel() = default;

absl::StatusOr<std::unique_ptr<MlpModel>> MlpModel::Create(
    const MlpOptions& o, std::shared_ptr<const ImageDataset> data) {
  const std::string layers = absl::StrJoin(o.layers, "-");
  if (data == nullptr) return absl::InvalidArgumentError("mlp: no dataset");
  if (o.layers.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("mlp: layers '", layers, "' need at least an input and an output width"));
  }
  for (uint32_t w : o.layers) {
    if (w == 0)
      return absl::InvalidArgumentError(absl::StrCat("mlp: zero width in '", layers, "'"));
  }
  if (o.layers.front() != data->dim()) {
    return absl::InvalidArgumentError(absl::StrCat("mlp: layers '", layers, "' start at ",
                                                   o.layers.front(), " but the images have ",
                                                   data->dim(), " pixels"));
  }
  if (o.layers.back() != ImageDataset::kNumClasses) {
    return absl::InvalidArgumentError(absl::StrCat("mlp: layers '", layers, "' end at ",
                                                   o.layers.back(), " but there are ",
                                                   ImageDataset::kNumClasses, " classes"));
  }
  if (o.eval_batch == 0) return absl::InvalidArgumentError("mlp: eval_batch must be > 0");
  SamplerOptions so;
  so.seed = o.seed;
  so.workers = o.workers;
  so.batch = o.batch;
  absl::StatusOr<std::unique_ptr<EpochSampler>> sampler =
      EpochSampler::Create(data->num_train(), so);
  if (!sampler.ok()) return sampler.status();
  absl::StatusOr<const BlasApi*> blas = Blas();
  if (!blas.ok()) return blas.status();
  return std::unique_ptr<MlpModel>(new MlpModel(o, std::move(data), *std::move(sampler), *blas));
}

void MlpModel::Init(float* x) const {
  SplitMix64 rng(SplitMix64Mix(o_.seed ^ 0x6a09e667f3bcc908ULL));
  for (size_t l = 0; l < num_layers(); ++l) {
    const double bound = std::sqrt(6.0 / o_.layers[l]);
    const uint64_t nw = uint64_t{o_.layers[l]} * o_.layers[l + 1];
    float* w = x + w_off_[l];
    for (uint64_t j = 0; j < nw; ++j) {
      w[j] = static_cast<float>((2.0 * rng.UniformDouble() - 1.0) * bound);
    }
    std::fill(x + b_off_[l], x + b_off_[l] + o_.layers[l + 1], 0.0f);
  }
}

std::unique_ptr<MlpModel::Workspace> MlpModel::Borrow() const {
  {
    absl::MutexLock lock(&mu_);
    if (!pool_.empty()) {
      std::unique_ptr<Workspace> ws = std::move(pool_.back());
      pool_.pop_back();
      return ws;
    }
  }
  auto ws = std::make_unique<Workspace>();
  const size_t rows = std::max(o_.batch, o_.eval_batch);
  ws->rows = rows;
  ws->idx.resize(rows);
  ws->y.resize(rows);
  ws->x.resize(rows * o_.layers[0]);
  size_t widest = 0;
  for (size_t l = 0; l < num_layers(); ++l) {
    ws->act.emplace_back(rows * o_.layers[l + 1]);
    widest = std::max<size_t>(widest, o_.layers[l + 1]);
  }
  ws->delta[0].resize(rows * widest);
  ws->delta[1].resize(rows * widest);
  return ws;
}

void MlpModel::Return(std::unique_ptr<Workspace> ws) const {
  absl::MutexLock lock(&mu_);
  pool_.push_back(std::move(ws));
}

void MlpModel::Forward(const float* x, Workspace* ws, size_t rows) const {
  const int m = static_cast<int>(rows);
  const float* in = ws->x.data();
  for (size_t l = 0; l < num_layers(); ++l) {
    const int n_in = static_cast<int>(o_.layers[l]);
    const int n_out = static_cast<int>(o_.layers[l + 1]);
    float* out = ws->act[l].data();
    // out = in · W^T  (rows x n_out)
    blas_->sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n_out, n_in, 1.0f, in, n_in,
                 x + w_off_[l], n_in, 0.0f, out, n_out);
    const float* b = x + b_off_[l];
    const bool relu = l + 1 < num_layers();
    for (size_t i = 0; i < rows; ++i) {
      float* row = out + i * n_out;
      for (int k = 0; k < n_out; ++k) {
        const float v = row[k] + b[k];
        // NaN passes through (v < 0 is false), so a broken parameter shows up
        // in the loss instead of being hidden by the ReLU.
        row[k] = relu && v < 0.0f ? 0.0f : v;
      }
    }
    in = out;
  }
}

std::string MlpModel::DescribeParam(uint64_t j) const {
  for (size_t l = 0; l < num_layers(); ++l) {
    if (j < b_off_[l]) return absl::StrCat("W", l, "[", j - w_off_[l], "]");
    if (j < b_off_[l] + o_.layers[l + 1]) return absl::StrCat("b", l, "[", j - b_off_[l], "]");
  }
  return absl::StrCat("index ", j);
}

absl::StatusOr<double> MlpModel::Gradient(const float* x, uint32_t rank, uint64_t step,
                                          float* g) const {
  return Backward(x, rank, step, g, nullptr);
}

absl::StatusOr<double> MlpModel::GradientInParts(const float* x, uint32_t rank, uint64_t step,
                                                 float* g, const ReleaseFn& release) const {
  return Backward(x, rank, step, g, &release);
}

absl::StatusOr<double> MlpModel::Backward(const float* x, uint32_t rank, uint64_t step, float* g,
                                          const ReleaseFn* release) const {
  std::unique_ptr<Workspace> ws = Borrow();
  const size_t rows = o_.batch;
  const int m = static_cast<int>(rows);
  absl::Status s = sampler_->BatchIndices(rank, step, ws->idx.data());
  if (!s.ok()) {
    Return(std::move(ws));
    return s;
  }
  data_->GatherTrain(ws->idx.data(), rows, ws->x.data(), ws->y.data());
  Forward(x, ws.get(), rows);

  // Loss and its gradient w.r.t. the logits: (softmax - onehot) / rows.
  const size_t L = num_layers();
  const size_t classes = o_.layers.back();
  const float* logits = ws->act[L - 1].data();
  float* d = ws->delta[0].data();
  double loss = 0;
  double p[256];
  const float inv_rows = 1.0f / static_cast<float>(rows);
  for (size_t i = 0; i < rows; ++i) {
    loss += RowLoss(logits + i * classes, classes, ws->y[i], p);
    p[ws->y[i]] -= 1.0;
    for (size_t k = 0; k < classes; ++k) d[i * classes + k] = static_cast<float>(p[k]) * inv_rows;
  }
  loss /= static_cast<double>(rows);
  if (!std::isfinite(loss)) {
    Return(std::move(ws));
    return absl::InternalError(
        absl::StrCat("mlp: loss is not finite (", loss, ") at rank ", rank, " step ", step));
  }

  // Backward, from the output layer down; delta[cur] holds dLoss/dZ_{l+1}.
  // Each layer's W_l and b_l are adjacent in x, so once both are computed
  // (and checked) the layer is released while the layers below are computed.
  int cur = 0;
  absl::Status failed;
  for (size_t l = L; l-- > 0;) {
    const int n_in = static_cast<int>(o_.layers[l]);
    const int n_out = static_cast<int>(o_.layers[l + 1]);
    const float* in = l == 0 ? ws->x.data() : ws->act[l - 1].data();
    const float* dz = ws->delta[cur].data();
    // dW = dZ^T · in  (n_out x n_in)
    blas_->sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n_out, n_in, m, 1.0f, dz, n_out, in, n_in,
                 0.0f, g + w_off_[l], n_in);
    float* gb = g + b_off_[l];
    std::fill(gb, gb + n_out, 0.0f);
    for (size_t i = 0; i < rows; ++i) {
      for (int k = 0; k < n_out; ++k) gb[k] += dz[i * n_out + k];
    }
    const uint64_t end = b_off_[l] + static_cast<uint64_t>(n_out);
    if (!AllFinite(g + w_off_[l], end - w_off_[l])) {
      uint64_t j = w_off_[l];
      while (std::isfinite(g[j])) ++j;
      failed =
          absl::InternalError(absl::StrCat("mlp: gradient ", DescribeParam(j), " is not finite (",
                                           g[j], ") at rank ", rank, " step ", step));
      break;
    }
    if (release != nullptr) {
      failed = (*release)(w_off_[l], end);
      if (!failed.ok()) break;
    }
    if (l == 0) break;  // no gradient w.r.t. the pixels needed
    // dA = dZ · W  (rows x n_in), then through the ReLU of layer l-1.
    float* da = ws->delta[1 - cur].data();
    blas_->sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n_in, n_out, 1.0f, dz, n_out,
                 x + w_off_[l], n_in, 0.0f, da, n_in);
    const float* a = ws->act[l - 1].data();
    // A select, not a conditional store, so that it vectorises.
    for (size_t i = 0; i < rows * static_cast<size_t>(n_in); ++i) {
      da[i] = a[i] > 0.0f ? da[i] : 0.0f;
    }
    cur = 1 - cur;
  }
  Return(std::move(ws));
  if (!failed.ok()) return failed;
  return loss;
}

absl::StatusOr<EvalResult> MlpModel::Evaluate(const float* x) const {
  std::unique_ptr<Workspace> ws = Borrow();
  const size_t L = num_layers();
  const size_t classes = o_.layers.back();
  const uint32_t n = data_->num_test();
  double loss = 0;
  uint64_t correct = 0;
  for (uint32_t first = 0; first < n; first += o_.eval_batch) {
    const size_t rows = std::min<uint32_t>(o_.eval_batch, n - first);
    data_->GatherTest(first, rows, ws->x.data(), ws->y.data());
    Forward(x, ws.get(), rows);
    const float* logits = ws->act[L - 1].data();
    for (size_t i = 0; i < rows; ++i) {
      const float* z = logits + i * classes;
      loss += RowLoss(z, classes, ws->y[i], nullptr);
      // Ties go to the lowest class, as with std::max_element.
      correct += static_cast<size_t>(std::max_element(z, z + classes) - z) == ws->y[i];
    }
  }
  Return(std::move(ws));
  EvalResult r;
  r.examples = n;
  if (n > 0) {
    r.accuracy = static_cast<double>(correct) / n;
    r.loss = loss / n;
  }
  if (!std::isfinite(r.loss)) {
    return absl::InternalError(absl::StrCat("mlp: test loss is not finite (", r.loss, ")"));
  }
  return r;
}

absl::StatusOr<std::vector<uint32_t>> ParseLayers(absl::string_view spec) {
  std::vector<uint32_t> widths;
  for (absl::string_view part : absl::StrSplit(spec, absl::ByAnyChar("-,x"))) {
    uint32_t w = 0;
    if (!absl::SimpleAtoi(part, &w) || w == 0 || w > (1u << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("mlp layers '", spec, "': '", part, "' is not a width in [1, 1048576]"));
    }
    widths.push_back(w);
  }
  if (widths.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("mlp layers '", spec, "': need an input and an output width"));
  }
  return widths;
}

absl::StatusOr<std::unique_ptr<MlpModel>> NewMlpModel(const MlpOptions& o) {
  DatasetOptions d;
  d.dir = o.data_dir;
  d.max_train = o.max_train;
  d.max_test = o.max_test;
  absl::StatusOr<std::shared_ptr<const ImageDataset>> data = LoadFashionMnist(d);
  if (!data.ok()) return data.status();
  absl::StatusOr<const BlasApi*> blas = Blas();
  if (!blas.ok()) return blas.status();
  // For the whole process: OpenBLAS has one thread pool.
  if (o.blas_threads > 0) (*blas)->set_num_threads(std::max(1, o.blas_threads));
  return MlpModel::Create(o, *std::move(data));
}

absl::StatusOr<std::vector<uint64_t>> MlpLayerEnds(absl::string_view layers) {
  std::vector<uint64_t> widths;
  for (absl::string_view part : absl::StrSplit(layers, '-')) {
    uint64_t w = 0;
    if (!absl::SimpleAtoi(part, &w) || w == 0 || w > (1u << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--layers: '", layers, "' is not a list of widths like 784-256-128-10"));
    }
    widths.push_back(w);
  }
  if (widths.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat("--layers: '", layers, "' needs 2+ widths"));
  }
  // W0, b0, W1, b1, ...: the layout MlpModel keeps x in.
  std::vector<uint64_t> ends;
  uint64_t d = 0;
  for (size_t l = 0; l + 1 < widths.size(); ++l) {
    d += widths[l] * widths[l + 1];
    ends.push_back(d);
    d += widths[l + 1];
    ends.push_back(d);
  }
  return ends;
}

absl::StatusOr<uint64_t> MlpParamCount(absl::string_view layers) {
  absl::StatusOr<std::vector<uint64_t>> ends = MlpLayerEnds(layers);
  if (!ends.ok()) return ends.status();
  return ends->back();
}

namespace {

absl::StatusOr<uint64_t> MlpParams(const control::TrainingConfig& c) {
  return MlpParamCount(c.model().layers());
}

absl::Status ValidateMlp(const control::TrainingConfig& c) {
  if (absl::StatusOr<uint64_t> d = MlpParamCount(c.model().layers()); !d.ok()) return d.status();
  if (c.model().batch() < 1) return absl::InvalidArgumentError("--batch: must be >= 1");
  if (c.model().blas_threads() > 256)
    return absl::InvalidArgumentError("--blas_threads: must be in [0, 256]");
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> MlpEpochSteps(const control::TrainingConfig& c) {
  const uint64_t steps =
      FashionMnistEpochSteps(c.model().max_train(), DataRanks(c), c.model().batch());
  if (steps == 0) {
    const uint32_t train = c.model().max_train() > 0
                               ? std::min(c.model().max_train(), kFashionMnistTrain)
                               : kFashionMnistTrain;
    return absl::InvalidArgumentError(absl::StrCat(
        "--batch: ", DataRanks(c), c.cluster().local_ranks() > 1 ? " ranks" : " workers",
        " x batch ", c.model().batch(), " exceed the ", train, " training images"));
  }
  return steps;
}

absl::StatusOr<std::unique_ptr<Model>> MakeMlp(const control::TrainingConfig& c) {
  MlpOptions o;
  auto layers = ParseLayers(c.model().layers());
  if (!layers.ok()) return layers.status();
  o.layers = *layers;
  o.seed = c.model().seed();
  o.data_dir = c.model().data_dir();
  o.batch = c.model().batch();
  o.workers = DataRanks(c);
  o.blas_threads = static_cast<int>(c.model().blas_threads());
  o.max_train = c.model().max_train();
  o.max_test = c.model().max_test();
  auto mlp = NewMlpModel(o);
  if (!mlp.ok()) return mlp.status();
  return std::unique_ptr<Model>(std::move(*mlp));
}

}  // namespace

// Its settings are job settings of their own (--layers ...), from before the registry.
extern const ModelEntry kMlpModel = {
    "mlp",
    "a multi-layer perceptron (ReLU, softmax cross-entropy) on Fashion-MNIST",
    "--layers --batch --data_dir --max_train --max_test --blas_threads",
    {},
    MlpParams,
    ValidateMlp,
    MlpEpochSteps,
    MakeMlp,
    [](const control::TrainingConfig& c) { return MlpLayerEnds(c.model().layers()); },
};

}  // namespace onebit
