#include "train/ftheta_train.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#ifdef KAKEYA_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "core/error.h"
#include "core/io/fs.h"
#include "core/io/safetensors.h"

namespace kakeya::train {
using json = nlohmann::json;

namespace {

// bf16 autocast for the GEMMs and attention on CUDA while alive; nothing on CPU.
class AutocastGuard {
 public:
  explicit AutocastGuard(bool on) : on_(on) {
    if (!on_) return;
    prev_ = at::autocast::is_autocast_enabled(at::kCUDA);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  }
  ~AutocastGuard() {
    if (!on_) return;
    at::autocast::set_autocast_enabled(at::kCUDA, prev_);
    at::autocast::clear_cache();
  }

 private:
  bool on_, prev_ = false;
};

json stats_means(const at::Tensor& stats, const std::vector<int64_t>& layers) {
  // Mean over the trained layers of each statistic (the log's loss components).
  json j = json::object();
  at::Tensor s = stats.index_select(0, at::tensor(layers, at::kLong)).mean(0);
  for (int64_t i = 0; i < kNumStats; ++i) j[ftheta_stat_name(i)] = s[i].item<double>();
  return j;
}

std::vector<int64_t> trained_layers(const FThetaLossOptions& o, int64_t L) {
  if (!o.layers.empty()) return o.layers;
  std::vector<int64_t> all;
  for (int64_t l = 0; l < L; ++l) all.push_back(l);
  return all;
}

}  // namespace

json FThetaTrainOptions::to_json() const {
  return {{"loss", ftheta_loss_name(loss.type)},
          {"sink", loss.layout.sink},
          {"window", loss.layout.window},
          {"lambda_k_dir", loss.lambda_k_dir},
          {"lambda_v_dir", loss.lambda_v_dir},
          {"lambda_k_mag", loss.lambda_k_mag},
          {"lambda_v_mag", loss.lambda_v_mag},
          {"layers", loss.layers},
          {"steps", steps},
          {"batch", batch},
          {"max_len", max_len},
          {"lr", lr},
          {"lr_schedule", lr_schedule},
          {"warmup_steps", warmup_steps},
          {"beta1", adamw.beta1},
          {"beta2", adamw.beta2},
          {"weight_decay", adamw.weight_decay},
          {"grad_clip", adamw.grad_clip},
          {"seed", seed},
          {"eval_every", eval_every}};
}

FThetaBatch make_ftheta_batch(const std::vector<const FThetaSequence*>& seqs, int64_t T, at::Device device) {
  KAKEYA_CHECK(!seqs.empty(), "f_theta batch: no sequences");
  auto stack = [&](auto get) {
    std::vector<at::Tensor> parts;
    for (const auto* s : seqs) parts.push_back(get(*s).narrow(0, 0, T));
    at::Tensor t = at::stack(parts);  // [B, T, ...]
    // Online sequences are already on the device; captured ones come from host memory.
    return device.is_cuda() && !t.is_cuda() ? t.pin_memory().to(device, at::kFloat, /*non_blocking=*/true)
                                            : t.to(device, at::kFloat);
  };
  FThetaBatch b;
  b.positions = at::arange(T, at::TensorOptions().dtype(at::kLong).device(device));
  if (seqs[0]->dk.defined()) {
    b.dk = stack([](const FThetaSequence& s) { return s.dk; });
    b.dv = stack([](const FThetaSequence& s) { return s.dv; });
  }
  if (seqs[0]->feats.defined()) b.feats = stack([](const FThetaSequence& s) { return s.feats; });
  const size_t L = seqs[0]->k.size();
  for (size_t l = 0; l < L; ++l) {
    b.k.push_back(stack([l](const FThetaSequence& s) { return s.k[l]; }));
    b.v.push_back(stack([l](const FThetaSequence& s) { return s.v[l]; }));
    if (!seqs[0]->q.empty()) b.q.push_back(stack([l](const FThetaSequence& s) { return s.q[l]; }));
    if (!seqs[0]->o.empty()) b.o.push_back(stack([l](const FThetaSequence& s) { return s.o[l]; }));
  }
  return b;
}

json FThetaEval::to_json(const ModelConfig& verifier) const {
  json per_layer = json::array();
  json by_type = json::object();
  for (LayerType t : {LayerType::Sliding, LayerType::Full}) {
    std::vector<int64_t> ls;
    for (int64_t l = 0; l < verifier.num_layers; ++l)
      if (verifier.layer_types[l] == t) ls.push_back(l);
    if (!ls.empty()) by_type[layer_type_name(t)] = stats_means(stats, ls);
  }
  for (int64_t l = 0; l < verifier.num_layers; ++l) {
    json e{{"layer", l}, {"type", layer_type_name(verifier.layer_types[l])}};
    for (int64_t i = 0; i < kNumStats; ++i) e[ftheta_stat_name(i)] = stats[l][i].item<double>();
    per_layer.push_back(e);
  }
  return {{"step", step}, {"loss", loss}, {"by_layer_type", by_type}, {"per_layer", per_layer}};
}

FThetaTrainer::FThetaTrainer(const Model& verifier, FTheta& f, std::vector<FThetaSequence> train,
                             std::vector<FThetaSequence> heldout, const FThetaTrainOptions& opt, std::string checkpoint)
    : verifier_(verifier), f_(f), train_(std::move(train)), heldout_(std::move(heldout)), opt_(opt),
      ckpt_(std::move(checkpoint)) {
  init(!train_.empty());
}

FThetaTrainer::FThetaTrainer(const Model& verifier, FTheta& f, FThetaSequenceSource source, int64_t n_train,
                             std::vector<FThetaSequence> heldout, const FThetaTrainOptions& opt, std::string checkpoint)
    : verifier_(verifier), f_(f), heldout_(std::move(heldout)), source_(std::move(source)), n_train_(n_train),
      opt_(opt), ckpt_(std::move(checkpoint)) {
  init(source_ && n_train_ > 0);
}

void FThetaTrainer::init(bool has_train) {
  const FTheta& f = f_;
  const FThetaTrainOptions& opt = opt_;
  KAKEYA_CHECK(f.dtype() == at::kFloat, "train-ftheta: f_theta must hold f32 parameters while training");
  KAKEYA_CHECK(verifier_.dtype() == at::kFloat, "train-ftheta: the verifier must be loaded in f32 (autocast does bf16)");
  KAKEYA_CHECK(has_train, "train-ftheta: no training sequences");
  KAKEYA_CHECK(!heldout_.empty(), "train-ftheta: no held-out sequences");
  KAKEYA_CHECK(opt.steps > 0 && opt.batch > 0 && opt.max_len > 0 && opt.lr > 0 && opt.warmup_steps >= 0,
               "train-ftheta: steps, batch, max-len and lr must be positive, warmup >= 0");
  KAKEYA_CHECK(opt.lr_schedule == "const" || opt.lr_schedule == "cosine",
               "train-ftheta: --lr-schedule '" << opt.lr_schedule << "' (expected const or cosine)");
  named_ = f_.named_parameters();
  for (auto& [name, p] : named_) {
    p.requires_grad_(true);
    params_.push_back(p);
    m_.push_back(at::zeros_like(p));
    v_.push_back(at::zeros_like(p));
  }
}

double FThetaTrainer::lr_at(int64_t step) const {
  if (step < opt_.warmup_steps) return opt_.lr * (double)(step + 1) / (double)opt_.warmup_steps;
  if (opt_.lr_schedule == "const") return opt_.lr;
  const double progress =
      std::min(1.0, (double)(step - opt_.warmup_steps) / (double)std::max<int64_t>(1, opt_.steps - 1 - opt_.warmup_steps));
  const double lo = opt_.lr / 100;  // the seeds' "cosine decay to peak/100"
  return lo + (opt_.lr - lo) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

FThetaBatch FThetaTrainer::sample(int64_t step) const {
  std::mt19937_64 rng(opt_.seed * 1000003ull + (uint64_t)step);  // a step's batch depends on (seed, step) only
  // Data-parallel: this rank's rows [lo, hi) of the global batch; every draw is still made,
  // so the rows are the ones a single process would put there.
  const auto [lo, hi] = dist_ ? dist_->share(opt_.batch, "--batch") : std::pair<int64_t, int64_t>{0, opt_.batch};
  std::vector<const FThetaSequence*> pick;
  std::vector<FThetaSequence> made;  // online: this rank's sequences of the batch
  made.reserve(opt_.batch);
  int64_t T = opt_.max_len;
  for (int64_t i = 0; i < opt_.batch; ++i) {
    const uint64_t draw = rng();
    const bool mine = i >= lo && i < hi;
    const FThetaSequence* s = nullptr;
    if (source_) {
      if (!mine) continue;  // another rank makes it
      made.push_back(source_((int64_t)(draw % (uint64_t)n_train_)));
      s = &made.back();
    } else {
      s = &train_[draw % train_.size()];
    }
    T = std::min(T, s->length());  // in memory: the whole batch's lengths are known here
    if (mine) pick.push_back(s);
  }
  // Online: the other rows were made elsewhere; the batch is cropped to the shortest of all.
  // SYNC: the length is needed on the host to crop (online batches wait on the verifier anyway).
  if (source_ && dist_) T = dist_->all_reduce_min(T, "batch length at step " + std::to_string(step));
  if (graphed() && T >= 128) T -= T % 128;  // a few batch lengths: one captured graph each
  return make_ftheta_batch(pick, T, f_.device());
}

FThetaEval FThetaTrainer::evaluate() const {
  at::NoGradGuard no_grad;
  AutocastGuard ac(opt_.autocast && f_.device().is_cuda());
  FThetaEval e;
  e.step = step_;
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(f_.device()));
  at::Tensor stats_sum = at::zeros({verifier_.config().num_layers, kNumStats}, loss_sum.options());
  // Data-parallel: held-out sequence i is evaluated by rank i mod N; the sums are all-reduced.
  const int world = dist_ ? dist_->world() : 1, rank = dist_ ? dist_->rank() : 0;
  for (size_t i = rank; i < heldout_.size(); i += world) {
    const FThetaSequence& s = heldout_[i];
    FThetaBatch b = make_ftheta_batch({&s}, std::min(opt_.max_len, s.length()), f_.device());
    FThetaLossResult r = ftheta_loss(verifier_, f_, b, opt_.loss);
    loss_sum += r.loss;
    stats_sum += r.stats;
  }
  if (dist_) {
    std::vector<at::Tensor> sums{loss_sum, stats_sum};
    dist_->all_reduce_sum(sums, "held-out evaluation at step " + std::to_string(step_));
  }
  e.loss = loss_sum.item<double>() / heldout_.size();  // SYNC: once per evaluation
  e.stats = (stats_sum / (double)heldout_.size()).cpu();
  return e;
}

void FThetaTrainer::distribute(const Dist& dist) {
  dist_ = &dist;
  dist.share(opt_.batch, "--batch");  // refuses a batch that does not split before anything runs
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> start;
  for (auto& p : params_) start.push_back(p.detach());
  dist.broadcast(start, "the starting f_theta weights");
}

void FThetaTrainer::reduce_step(FThetaStepResult& r, at::Tensor& finite) const {
  // One all-reduce per step: gradients (of each rank's share of the loss), loss and statistics
  // (already divided by N) and the count of ranks whose step was not finite.
  std::vector<at::Tensor> parts;
  for (const auto& p : params_)
    if (p.grad().defined()) parts.push_back(p.grad());
  const double share = 1.0 / dist_->world();
  at::Tensor loss = (r.loss * share).reshape({1}), stats = r.stats * share;
  at::Tensor bad = finite.logical_not().to(at::kFloat).reshape({1});
  parts.push_back(loss);
  parts.push_back(stats);
  parts.push_back(bad);
  dist_->all_reduce_sum(parts, "gradients at step " + std::to_string(step_ + 1));
  r.loss = loss.squeeze(0);
  r.stats = stats;
  finite = bad.squeeze(0).eq(0);
}

void FThetaTrainer::save_checkpoint() const {
  if (dist_ && !dist_->is_root()) return;  // every rank holds the same state: rank 0 writes it
  std::map<std::string, at::Tensor> t;
  for (size_t i = 0; i < named_.size(); ++i) {
    const std::string& n = named_[i].first;
    t["param/" + n] = params_[i].detach();
    t["adam_m/" + n] = m_[i];
    t["adam_v/" + n] = v_[i];
  }
  json s{{"step", step_}, {"train_seconds", train_seconds_}, {"log", log_}, {"evals", evals_}};
  // One file: parameters, moments and state are replaced together (save_safetensors is atomic).
  save_safetensors(ckpt_, t,
                   {{"state", s.dump()},
                    {"f_theta_config", f_.config().to_json().dump()},
                    {"options", opt_.to_json().dump()}});
}

bool FThetaTrainer::resume() {
  if (!fs::exists(ckpt_)) return false;
  TensorStore st = TensorStore::open_file(ckpt_);
  auto md = st.metadata();
  KAKEYA_CHECK(md.count("state") && md.count("f_theta_config") && md.count("options"),
               ckpt_ << ": not a train-ftheta checkpoint");
  // Provenance may differ (it records paths); the structure must not.
  json mine = f_.config().to_json(), theirs = json::parse(md["f_theta_config"]);
  mine.erase("provenance");
  theirs.erase("provenance");
  KAKEYA_CHECK(mine == theirs, ckpt_ << ": the checkpoint's f_theta config differs from this run's (rank, nonlinear branch, "
                                        "dimensions or model fingerprints): delete it or use the same models, --rank "
                                        "and --mlp-hidden");
  json o = json::parse(md["options"]), want = opt_.to_json();
  for (auto& [k, v] : want.items())
    KAKEYA_CHECK(o.contains(k) && o[k] == v, ckpt_ << ": option '" << k << "' was " << (o.contains(k) ? o[k].dump() : "absent")
                                                   << " in the checkpoint, this run has " << v.dump()
                                                   << " (a resumed run must use the same options)");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < named_.size(); ++i) {
    const std::string& n = named_[i].first;
    params_[i].copy_(st.get("param/" + n, params_[i].sizes().vec()));
    m_[i].copy_(st.get("adam_m/" + n, m_[i].sizes().vec()));
    v_[i].copy_(st.get("adam_v/" + n, v_[i].sizes().vec()));
  }
  json s = json::parse(md["state"]);
  step_ = s["step"];
  train_seconds_ = s["train_seconds"];
  log_ = s["log"];
  evals_ = s["evals"];
  if (!dist_ || dist_->is_root())
    std::fprintf(stderr, "[train-ftheta] resumed %s at step %lld/%lld\n", ckpt_.c_str(), (long long)step_,
                 (long long)opt_.steps);
  return true;
}

#ifdef KAKEYA_CUDA
// One captured loss + backward for batches of one shape: static inputs, outputs and gradients.
struct FThetaStepGraph {
  at::cuda::CUDAGraph graph;
  FThetaBatch in;                 // static inputs (each step's batch is copied in)
  FThetaStepResult out;           // loss, stats (grad_norm unused)
  at::Tensor finite;              // [] bool
  std::vector<at::Tensor> grads;  // per parameter, written by every replay
};
#else
struct FThetaStepGraph {};
#endif

FThetaTrainer::~FThetaTrainer() = default;

bool FThetaTrainer::graphed() const {
#ifdef KAKEYA_CUDA
  return opt_.cuda_graph && f_.device().is_cuda();
#else
  return false;
#endif
}

FThetaStepResult FThetaTrainer::forward_backward(const FThetaBatch& b, at::Tensor& finite) {
  FThetaLossResult r;
  {
    AutocastGuard ac(opt_.autocast && f_.device().is_cuda());
    r = ftheta_loss(verifier_, f_, b, opt_.loss);
  }
  // Data-parallel: each rank's gradient is of its share of the global mean (they sum to it).
  (dist_ ? r.loss * (1.0 / dist_->world()) : r.loss).backward();
  at::Tensor gsq = at::zeros({}, r.loss.options());
  for (auto& p : params_)
    if (p.grad().defined()) gsq = gsq + p.grad().pow(2).sum();
  finite = at::isfinite(r.loss.detach() + gsq);
  return {r.loss.detach(), r.stats, at::Tensor()};
}

void FThetaTrainer::fail_non_finite(const FThetaStepResult& r) const {
  std::string where;
  at::Tensor bad_rows = at::isfinite(r.stats.cpu()).logical_not().any(1);
  for (int64_t l = 0; l < verifier_.config().num_layers; ++l)
    if (bad_rows[l].item<bool>()) where += (where.empty() ? "" : ", ") + std::to_string(l);
  std::string params;
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].grad().defined() && !at::isfinite(params_[i].grad()).all().item<bool>())
      params += (params.empty() ? "" : ", ") + named_[i].first;
  KAKEYA_FAIL("train-ftheta: non-finite " << (at::isfinite(r.loss).item<bool>() ? "gradient" : "loss") << " at step "
                                          << step_ << (where.empty() ? "" : " in verifier layer(s) " + where)
                                          << (params.empty() ? "" : "; gradient of " + params)
                                          << " (weights of the last checkpoint are intact; lower --lr?)");
}

FThetaStepResult FThetaTrainer::step_on(const FThetaBatch& b, double lr) {
  FThetaStepResult r;
  at::Tensor finite;
#ifdef KAKEYA_CUDA
  if (graphed()) {
    const int64_t T = b.positions.size(0);
    auto it = graphs_.find(T);
    if (it == graphs_.end()) {
      // PyTorch's whole-network capture recipe: warm up on a side stream (autograd, cuBLAS and
      // cuDNN workspaces, allocator), drop the warm-up gradients, capture forward + backward.
      auto g = std::make_unique<FThetaStepGraph>();
      auto copy = [](const at::Tensor& t) { return t.defined() ? t.clone() : t; };
      g->in.positions = copy(b.positions);
      g->in.dk = copy(b.dk);
      g->in.dv = copy(b.dv);
      g->in.feats = copy(b.feats);
      for (const auto& t : b.q) g->in.q.push_back(copy(t));
      for (const auto& t : b.k) g->in.k.push_back(copy(t));
      for (const auto& t : b.v) g->in.v.push_back(copy(t));
      for (const auto& t : b.o) g->in.o.push_back(copy(t));
      c10::cuda::device_synchronize();  // SYNC: once per captured shape
      {
        c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
        for (int i = 0; i < 2; ++i) {
          forward_backward(g->in, g->finite);
          for (auto& p : params_) p.mutable_grad() = at::Tensor();
        }
        c10::cuda::device_synchronize();
        g->graph.capture_begin();
        g->out = forward_backward(g->in, g->finite);
        g->graph.capture_end();
      }
      c10::cuda::device_synchronize();
      for (auto& p : params_) g->grads.push_back(p.grad());
      it = graphs_.emplace(T, std::move(g)).first;
    }
    FThetaStepGraph& g = *it->second;
    if (b.dk.defined()) {
      g.in.dk.copy_(b.dk);
      g.in.dv.copy_(b.dv);
    }
    if (b.feats.defined()) g.in.feats.copy_(b.feats);
    for (size_t l = 0; l < b.k.size(); ++l) {
      if (l < b.q.size()) g.in.q[l].copy_(b.q[l]);
      g.in.k[l].copy_(b.k[l]);
      g.in.v[l].copy_(b.v[l]);
      if (l < b.o.size()) g.in.o[l].copy_(b.o[l]);
    }
    g.graph.replay();
    for (size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = g.grads[i];
    r = {g.out.loss.clone(), g.out.stats.clone(), at::Tensor()};  // the next replay overwrites the static outputs
    finite = g.finite;
  } else
#endif
  {
    r = forward_backward(b, finite);
  }
  if (dist_) reduce_step(r, finite);
  // Halt on NaN/Inf before the update touches the weights (the last checkpoint stays good).
  if (!finite.item<bool>()) fail_non_finite(r);  // SYNC: one flag per step
  r.grad_norm = adamw_step(params_, m_, v_, step_ + 1, lr, opt_.adamw);
  ++step_;
  return r;
}

bool FThetaTrainer::run() {
  const ModelConfig& mc = verifier_.config();
  const std::vector<int64_t> layers = trained_layers(opt_.loss, mc.num_layers);
  if (evals_.empty()) evals_.push_back(evaluate().to_json(mc));  // the initial held-out loss (reduction factor)
  auto t_session = std::chrono::steady_clock::now();
  auto t_ckpt = t_session, t_log = t_session;
  const double trained_before = train_seconds_;
  const int64_t first_step = step_;
  at::Tensor stats_acc, loss_acc, g_acc;
  int64_t acc_n = 0;
  double step_seconds = 0;
  const bool root = !dist_ || dist_->is_root();
  while (step_ < opt_.steps) {
    bool stop = opt_.deadline > 0 && now_unix() + std::max(20.0, 5 * step_seconds) > opt_.deadline;
    // Every rank stops at the same step (clocks differ a little): one flag when a deadline is set.
    // SYNC: the flag is read on the host (a tiny all-reduce per step, only with a deadline).
    if (dist_ && opt_.deadline > 0) stop = dist_->any(stop, "the deadline check at step " + std::to_string(step_));
    if (stop) {
      if (root)
        std::fprintf(stderr, "\n[train-ftheta] deadline: stopping at step %lld/%lld; rerun with --resume\n",
                   (long long)step_, (long long)opt_.steps);
      break;
    }
    if (opt_.max_steps_this_run > 0 && step_ - first_step >= opt_.max_steps_this_run) break;
    const double lr = lr_at(step_);
    FThetaStepResult r = step_on(sample(step_), lr);
    stats_acc = stats_acc.defined() ? stats_acc + r.stats : r.stats.clone();
    loss_acc = loss_acc.defined() ? loss_acc + r.loss : r.loss.clone();
    g_acc = g_acc.defined() ? g_acc + r.grad_norm : r.grad_norm.clone();
    ++acc_n;
    const bool last = step_ >= opt_.steps;
    const double el = seconds_since(t_session);
    step_seconds = el / (double)(step_ - first_step);
    if (last || seconds_since(t_log) >= opt_.log_seconds) {
      t_log = std::chrono::steady_clock::now();
      train_seconds_ = trained_before + el;
      const double loss = loss_acc.item<double>() / acc_n;  // SYNC: progress line (every few seconds)
      const double g = g_acc.item<double>() / acc_n;
      json terms = stats_means((stats_acc / (double)acc_n).cpu(), layers);
      log_.push_back({{"step", step_}, {"loss", loss}, {"lr", lr}, {"grad_norm", g}, {"seconds", train_seconds_},
                      {"terms", terms}});
      const double rate = (step_ - first_step) / std::max(1e-9, el);
      if (root)
        std::fprintf(stderr,
                   "[train-ftheta] step %lld/%lld  loss %.4g  attn %.3g  kDir %.3g  vDir %.3g  kMag %.3g  vMag %.3g  "
                   "lr %.2e  |g| %.3g  %.2f step/s  ETA %.0fs\n",
                   (long long)step_, (long long)opt_.steps, loss, terms["attn"].get<double>(), terms["k_dir"].get<double>(),
                   terms["v_dir"].get<double>(), terms["k_mag"].get<double>(), terms["v_mag"].get<double>(), lr, g, rate,
                   (opt_.steps - step_) / std::max(rate, 1e-9));
      stats_acc = loss_acc = g_acc = at::Tensor();
      acc_n = 0;
    }
    if (last || (opt_.eval_every > 0 && step_ % opt_.eval_every == 0)) {
      FThetaEval e = evaluate();
      if (root) std::fprintf(stderr, "[train-ftheta] held-out at step %lld: loss %.4g\n", (long long)step_, e.loss);
      evals_.push_back(e.to_json(mc));
    }
    if (seconds_since(t_ckpt) >= opt_.checkpoint_seconds) {
      train_seconds_ = trained_before + seconds_since(t_session);
      save_checkpoint();
      t_ckpt = std::chrono::steady_clock::now();
    }
  }
  train_seconds_ = trained_before + seconds_since(t_session);
  save_checkpoint();
  return step_ >= opt_.steps;
}

json FThetaTrainer::report() const {
  json r{{"options", opt_.to_json()},
         {"f_theta_config", f_.config().to_json()},
         {"f_theta_parameters", f_.num_parameters()},
         {"train_sequences", train_.size()},
         {"heldout_sequences", heldout_.size()},
         {"ranks", dist_ ? dist_->world() : 1},
         {"steps_done", step_},
         {"train_seconds", train_seconds_},
         {"log", log_},
         {"evals", evals_}};
  if (evals_.size() >= 2) {
    const double first = evals_.front()["loss"], final = evals_.back()["loss"];
    r["heldout_loss_initial"] = first;
    r["heldout_loss_final"] = final;
    r["reduction_factor"] = final > 0 ? first / final : 0.0;
    r["final"] = evals_.back();
  }
  return r;
}

}  // namespace kakeya::train
