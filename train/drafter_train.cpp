#include "train/drafter_train.h"

#include <ATen/core/Reduction.h>
#include <ATen/core/grad_mode.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "core/error.h"
#include "core/io/fs.h"
#include "core/io/safetensors.h"
#include "infer/generate.h"
#include "infer/speculative.h"
#include "train/train_util.h"

namespace kakeya::train {
using json = nlohmann::json;

DrafterTrainer::DrafterTrainer(const Model& target, Drafter& drafter, std::vector<Sequences> train,
                               const TrainOptions& opt, std::string checkpoint)
    : target_(target), drafter_(drafter), train_(std::move(train)), opt_(opt), ckpt_(std::move(checkpoint)) {
  KAKEYA_CHECK(drafter.dtype() == at::kFloat, "train-drafter: the drafter must hold f32 parameters while training");
  KAKEYA_CHECK(!train_.empty(), "train-drafter: no training sequences");
  const int64_t S = train_[0].tokens.size(1);
  for (const auto& s : train_)
    KAKEYA_CHECK(s.size() > 0 && s.tokens.size(1) == S && s.prompt_len == train_[0].prompt_len,
                 "train-drafter: training sets differ in sequence or prompt length");
  KAKEYA_CHECK(opt.batch > 0 && opt.anchors > 0 && opt.gamma > 0 && opt.lr > 0,
               "train-drafter: batch, anchors, gamma and lr must be positive");
  // q/k/v_proj are row views of one qkv leaf. The training forward (context_kv,
  // forward_block) reads each view on its own, so grads land per view, and AdamW's
  // in-place update of q_proj writes only q's rows: k/v rows keep their bits.
  // A frozen fc lets Drafter::kernels() take the fused norm in project_context on CUDA:
  // harmless, c needs no grad then (and ops:: fall back whenever an input requires grad).
  for (auto& np : drafter.named_parameters()) {
    const bool frozen = opt.freeze_context && is_context_parameter(np.first);
    np.second.requires_grad_(!frozen);
    (frozen ? frozen_ : params_).push_back(np);
  }
  for (auto& [name, p] : params_) {
    m_.push_back(at::zeros_like(p));
    v_.push_back(at::zeros_like(p));
  }
  const int64_t B = drafter.config().block_size;
  // w_k = exp(-(k-1)/γ), k = 1 .. B-1: early positions decide the acceptance length.
  pos_weights_host_ = at::exp(-at::arange(0, B - 1, at::kFloat) / opt.gamma);  // [B-1]
  pos_weights_ = pos_weights_host_.to(drafter.device());
}

void DrafterTrainer::distribute(const Dist& dist) {
  dist_ = &dist;
  dist.share(opt_.batch, "--batch");  // refuses a batch that does not split before anything runs
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> start;
  for (auto& [name, p] : params_) start.push_back(p.detach());
  dist.broadcast(start, "the starting drafter weights");
}

bool is_context_parameter(const std::string& name) {
  auto ends = [&](const std::string& suf) {
    return name.size() >= suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
  };
  return name == "fc.weight" || name == "hidden_norm.weight" ||
         (name.rfind("layers.", 0) == 0 && (ends(".self_attn.k_proj.weight") || ends(".self_attn.v_proj.weight")));
}

int64_t DrafterTrainer::trainable_parameters() const {
  int64_t n = 0;
  for (const auto& [name, p] : params_) n += p.numel();
  return n;
}

int64_t DrafterTrainer::frozen_parameters() const {
  int64_t n = 0;
  for (const auto& [name, p] : frozen_) n += p.numel();
  return n;
}

DrafterTrainer::Batch DrafterTrainer::sample(const std::vector<const Sequences*>& pool, uint64_t seed) const {
  std::mt19937_64 rng(seed);
  int64_t total = 0;
  for (const auto* s : pool) total += s->size();
  const int64_t Bs = opt_.batch, N = opt_.anchors, Bk = drafter_.config().block_size;
  const int64_t S = pool[0]->tokens.size(1), P = pool[0]->prompt_len;
  at::Tensor tokens = at::empty({Bs, S}, at::kLong);     // [Bs, S]
  at::Tensor anchors = at::empty({Bs, N}, at::kLong);    // [Bs, N]
  at::Tensor valid = at::zeros({Bs, N, Bk - 1}, at::kBool);  // [Bs, N, B-1]
  auto an = anchors.accessor<int64_t, 2>();
  auto va = valid.accessor<bool, 3>();
  for (int64_t b = 0; b < Bs; ++b) {
    int64_t r = (int64_t)(rng() % (uint64_t)total);
    const Sequences* s = pool[0];
    for (const auto* q : pool) {
      if (r < q->size()) { s = q; break; }
      r -= q->size();
    }
    tokens[b].copy_(s->tokens[r]);
    const int64_t L = s->lengths[r].item<int64_t>();
    // Anchors in the target-generated part: a in [P-1, L-2], so tok[a+1] exists and is the target's.
    std::vector<int64_t> cand;
    for (int64_t a = P - 1; a <= L - 2; ++a) cand.push_back(a);
    const int64_t take = std::min<int64_t>(N, cand.size());
    for (int64_t i = 0; i < take; ++i) std::swap(cand[i], cand[i + rng() % (cand.size() - i)]);
    for (int64_t n = 0; n < N; ++n) {
      const bool real = n < take;
      const int64_t a = real ? cand[n] : P - 1;  // padding anchors carry no loss
      an[b][n] = a;
      for (int64_t k = 1; k < Bk; ++k) va[b][n][k - 1] = real && a + k < L;
    }
  }
  const double weight = (pos_weights_host_.view({1, 1, Bk - 1}) * valid.to(at::kFloat)).sum().item<double>();
  const double blocks = valid.select(2, 0).sum().item<double>();
  return {tokens, anchors, valid, std::max(weight, 1e-6), std::max(blocks, 1.0)};
}

DrafterTrainer::Batch DrafterTrainer::rows(const Batch& b, int64_t begin, int64_t end) const {
  return {b.tokens.slice(0, begin, end), b.anchors.slice(0, begin, end), b.valid.slice(0, begin, end), b.weight_total,
          b.blocks_total};
}

at::Tensor block_hidden(const Model& target, const Drafter& drafter, const at::Tensor& tokens, const at::Tensor& A) {
  const auto& cfg = drafter.config();
  const at::Device dev = drafter.device();
  const int64_t Bs = tokens.size(0), S = tokens.size(1), N = A.size(1);
  const int64_t Bk = cfg.block_size, T = N * Bk, H = cfg.hidden_size;
  auto iopt = at::TensorOptions().dtype(at::kLong).device(dev);

  // The frozen target's features at every position: one forward, no graph.
  at::Tensor feats;  // [Bs, S, n·H]
  {
    at::NoGradGuard no_grad;
    KVCache cache(target.config(), target.cache_options(S, Bs));
    TargetFeatureCapture cap(target, cfg.target_layer_ids);
    ForwardOptions fo;
    fo.taps = &cap.taps();
    fo.skip_logits = true;
    target.forward(tokens, cache, fo);
    feats = cap.take();
  }
  // Context K/V of every position once; each block masks what it may see.
  at::Tensor ctx_pos = at::arange(S, iopt);  // [S]
  auto kv = drafter.context_kv(drafter.project_context(feats), ctx_pos);
  std::vector<at::Tensor> ks, vs;
  for (auto& [k, v] : kv) {
    ks.push_back(k);  // [Bs, H_kv, S, D]
    vs.push_back(v);
  }

  at::Tensor offs = at::arange(Bk, iopt);                                      // [B]
  at::Tensor q_pos = (A.unsqueeze(-1) + offs).view({Bs, T});                   // [Bs, T]
  at::Tensor ids = at::full({Bs, N, Bk}, cfg.mask_token_id, iopt);             // [Bs, N, B]
  ids.select(2, 0).copy_(tokens.gather(1, A));
  at::Tensor x = drafter.embed(ids.view({Bs, T}));                             // [Bs, T, H]

  // Block n sees context positions < its anchor and its own block only; DFlash's
  // per-layer rule (causal / window) applies on top, on absolute positions.
  at::Tensor Aq = A.unsqueeze(-1).expand({Bs, N, Bk}).reshape({Bs, T});       // anchor of each query
  at::Tensor ctx_vis = ctx_pos.view({1, 1, S}).lt(Aq.unsqueeze(-1));           // [Bs, T, S]
  at::Tensor blk = at::arange(T, iopt).div(Bk, "floor");                       // [T]
  at::Tensor same = blk.view({T, 1}).eq(blk.view({1, T})).expand({Bs, T, T}); // [Bs, T, T]
  at::Tensor structure = at::cat({ctx_vis, same}, 2);                          // [Bs, T, S + T]
  at::Tensor k_pos = at::cat({ctx_pos.view({1, S}).expand({Bs, S}), q_pos}, 1);  // [Bs, S + T]
  std::vector<at::Tensor> masks;
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    masks.push_back(!cfg.causal(l) && cfg.window(l) == 0
                        ? structure
                        : structure.logical_and(drafter.layer_mask(l, q_pos, k_pos)));

  at::Tensor h = drafter.forward_block(x, q_pos, ks, vs, masks);               // [Bs, T, H]
  return h.view({Bs, N, Bk, H}).slice(2, 1);                                   // [Bs, N, B-1, H]
}

std::pair<at::Tensor, at::Tensor> DrafterTrainer::loss(const Batch& batch) const {
  const auto& cfg = drafter_.config();
  const at::Device dev = drafter_.device();
  const int64_t Bs = batch.tokens.size(0), S = batch.tokens.size(1), N = batch.anchors.size(1);
  const int64_t Bk = cfg.block_size, H = cfg.hidden_size;
  auto iopt = at::TensorOptions().dtype(at::kLong).device(dev);
  // Host batches go up through pinned memory without blocking, so preparing the
  // next step never waits for the GPU to drain (a pageable copy would sync).
  auto up = [&](const at::Tensor& t) {
    return dev.is_cuda() ? t.pin_memory().to(at::TensorOptions().device(dev), /*non_blocking=*/true) : t.to(dev);
  };
  at::Tensor tokens = up(batch.tokens);                                        // [Bs, S]
  at::Tensor A = up(batch.anchors);                                            // [Bs, N]
  at::Tensor h = block_hidden(target_, drafter_, tokens, A);                   // [Bs, N, B-1, H]
  at::Tensor label_pos = (A.unsqueeze(-1) + at::arange(1, Bk, iopt)).clamp_max(S - 1);   // [Bs, N, B-1]
  at::Tensor labels = tokens.gather(1, label_pos.view({Bs, -1})).view({Bs, N, Bk - 1});  // [Bs, N, B-1]
  at::Tensor valid = up(batch.valid);                                          // [Bs, N, B-1]
  at::Tensor w = pos_weights_.view({1, 1, Bk - 1}) * valid.to(at::kFloat);     // [Bs, N, B-1]

  at::Tensor logits = drafter_.logits(h.reshape({-1, H}));                     // [M, V] f32
  at::Tensor ce = at::cross_entropy_loss(logits, labels.reshape({-1}), {}, at::Reduction::None);  // [M]
  at::Tensor loss = (ce.view_as(w) * w).sum() / batch.weight_total;  // this batch's share of the drawn batch's loss

  at::Tensor metrics;  // [3] f32: loss, top-1 accuracy at k = 1, acceptance length
  {
    at::NoGradGuard no_grad;
    at::Tensor correct = logits.argmax(-1).view_as(labels).eq(labels).logical_and(valid);  // [Bs, N, B-1]
    at::Tensor real = valid.select(2, 0).to(at::kFloat);                                    // [Bs, N]
    const double denom = batch.blocks_total;
    at::Tensor acc1 = correct.select(2, 0).to(at::kFloat).sum() / denom;
    // Greedy verification accepts the leading correct drafts and adds the target's own token.
    at::Tensor lead = correct.to(at::kLong).cumprod(2).sum(2).to(at::kFloat) + 1.0;        // [Bs, N]
    at::Tensor accept = (lead * real).sum() / denom;
    metrics = at::stack({loss.detach(), acc1, accept});
  }
  return {loss, metrics};
}

double DrafterTrainer::lr_at(int64_t step) const {
  if (step < opt_.warmup_steps) return opt_.lr * (double)(step + 1) / (double)opt_.warmup_steps;
  if (st_.total_steps <= opt_.warmup_steps) return opt_.lr;  // schedule not fixed yet (calibrating)
  const double progress =
      std::min(1.0, (double)(step - opt_.warmup_steps) / (double)std::max<int64_t>(1, st_.total_steps - opt_.warmup_steps));
  const double lo = opt_.lr * opt_.min_lr_ratio;
  return lo + (opt_.lr - lo) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

void DrafterTrainer::step_optimizer(double lr, at::Tensor& grad_norm) {
  std::vector<at::Tensor> ps;
  for (auto& [name, p] : params_) ps.push_back(p);
  AdamWOptions ao;
  ao.beta1 = opt_.beta1, ao.beta2 = opt_.beta2, ao.eps = opt_.eps, ao.weight_decay = opt_.weight_decay;
  ao.grad_clip = opt_.grad_clip;
  grad_norm = adamw_step(ps, m_, v_, st_.step + 1, lr, ao);
}

void DrafterTrainer::save_checkpoint() const {
  if (dist_ && !dist_->is_root()) return;  // every rank holds the same state: rank 0 writes it
  std::map<std::string, at::Tensor> t;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& n = params_[i].first;
    t["param/" + n] = params_[i].second.detach();
    t["adam_m/" + n] = m_[i];
    t["adam_v/" + n] = v_[i];
  }
  for (const auto& [n, p] : frozen_) t["param/" + n] = p.detach();  // all weights, so the file is a whole drafter
  json log = json::array();
  for (const auto& p : st_.log)
    log.push_back({p.step, p.loss, p.acc1, p.accept_len, p.lr, p.grad_norm, p.elapsed});
  json s{{"step", st_.step},
         {"total_steps", st_.total_steps},
         {"train_seconds", st_.train_seconds},
         {"step_seconds", st_.step_seconds},
         {"freeze_context", opt_.freeze_context},
         {"log", log}};
  // One file: parameters, moments and state are replaced together (save_safetensors is atomic).
  save_safetensors(ckpt_, t, {{"state", s.dump()}, {"drafter_config", drafter_.config().to_json().dump()}});
}

bool DrafterTrainer::resume() {
  if (!fs::exists(ckpt_)) return false;
  TensorStore st = TensorStore::open_file(ckpt_);
  auto md = st.metadata();
  KAKEYA_CHECK(md.count("state") && md.count("drafter_config"), ckpt_ << ": not a train-drafter checkpoint");
  KAKEYA_CHECK(json::parse(md["drafter_config"]) == drafter_.config().to_json(),
               ckpt_ << ": the checkpoint's drafter config differs from this run's (delete it or use the same flags)");
  json s = json::parse(md["state"]);
  // Moments exist for trained tensors only, and a frozen run must not pick up a
  // trained context (nor the reverse): the flag has to match. Older files lack it: false.
  const bool ck_freeze = s.value("freeze_context", false);
  KAKEYA_CHECK(ck_freeze == opt_.freeze_context,
               ckpt_ << ": the checkpoint was written with freeze_context=" << (ck_freeze ? "true" : "false")
                     << ", this run has freeze_context=" << (opt_.freeze_context ? "true" : "false")
                     << " (rerun with" << (ck_freeze ? "" : "out") << " --freeze-context, or delete the checkpoint)");
  at::NoGradGuard no_grad;
  // The frozen tensors are the init drafter's: a checkpoint of another --init is refused
  // rather than silently replacing the context f_θ was trained on.
  for (const auto& [n, p] : frozen_)
    KAKEYA_CHECK(at::equal(st.get("param/" + n, p.sizes().vec()).to(p.device(), p.scalar_type()), p),
                 ckpt_ << ": frozen tensor '" << n
                       << "' differs from the drafter being fine-tuned (another --init?); delete the checkpoint");
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& n = params_[i].first;
    params_[i].second.copy_(st.get("param/" + n, params_[i].second.sizes().vec()));
    m_[i].copy_(st.get("adam_m/" + n));
    v_[i].copy_(st.get("adam_v/" + n));
  }
  st_.step = s["step"];
  st_.total_steps = s["total_steps"];
  st_.train_seconds = s["train_seconds"];
  st_.step_seconds = s["step_seconds"];
  st_.log.clear();
  for (const auto& p : s["log"])
    st_.log.push_back({p[0].get<int64_t>(), p[1], p[2], p[3], p[4], p[5], p[6]});
  if (!dist_ || dist_->is_root())
    std::fprintf(stderr, "[train] resumed %s at step %lld/%lld (%.0fs trained)\n", ckpt_.c_str(), (long long)st_.step,
               (long long)st_.total_steps, st_.train_seconds);
  return true;
}

bool DrafterTrainer::run() {
  std::vector<const Sequences*> pool;
  for (const auto& s : train_) pool.push_back(&s);
  auto t_session = std::chrono::steady_clock::now();
  auto t_ckpt = t_session, t_log = t_session;
  double trained_before = st_.train_seconds;
  const int64_t first_step = st_.step;
  std::chrono::steady_clock::time_point t_calib;
  at::Tensor acc = at::zeros({3}, at::TensorOptions().dtype(at::kFloat).device(drafter_.device()));  // summed metrics
  at::Tensor gsum = at::zeros({}, acc.options());
  int64_t acc_n = 0;
  const bool root = !dist_ || dist_->is_root();
  while (!st_.finished()) {
    // Stop early enough to write the checkpoint before the deadline (a few steps of margin).
    bool stop = opt_.deadline > 0 && now_unix() + std::max(20.0, 5 * st_.step_seconds) > opt_.deadline;
    // Every rank stops at the same step (clocks differ a little): one flag when a deadline is set.
    // SYNC: the flag is read on the host (a tiny all-reduce per step, only with a deadline).
    if (dist_ && opt_.deadline > 0) stop = dist_->any(stop, "the deadline check at step " + std::to_string(st_.step));
    if (stop) {
      if (root)
        std::fprintf(stderr, "\n[train] deadline: stopping at step %lld/%lld; rerun the same command to resume\n",
                   (long long)st_.step, (long long)st_.total_steps);
      break;
    }
    if (opt_.max_steps_this_run > 0 && st_.step - first_step >= opt_.max_steps_this_run) break;
    const double lr = lr_at(st_.step);
    Batch b = sample(pool, opt_.seed * 1000003ull + (uint64_t)st_.step);  // a step's batch depends on (seed, step) only
    if (dist_) {
      const auto [lo, hi] = dist_->share(opt_.batch, "--batch");
      b = rows(b, lo, hi);
    }
    auto [loss, metrics] = this->loss(b);
    loss.backward();
    if (dist_) {
      // One all-reduce per step: the gradients and the metrics (each rank's share of the batch's).
      std::vector<at::Tensor> parts;
      for (auto& [name, p] : params_)
        if (p.grad().defined()) parts.push_back(p.grad());
      parts.push_back(metrics);
      dist_->all_reduce_sum(parts, "gradients at step " + std::to_string(st_.step + 1));
    }
    at::Tensor gnorm;
    step_optimizer(lr, gnorm);
    acc += metrics;
    gsum += gnorm;
    ++acc_n;
    ++st_.step;

    // Calibration: time a few steps, then fix the schedule to the time budget.
    if (st_.total_steps == 0) {
      const int64_t done = st_.step - first_step;
      if (done == 2) {
        (void)acc.sum().item<float>();  // SYNC: start the clock after allocator/cuBLAS warm-up
        t_calib = std::chrono::steady_clock::now();
      }
      if (opt_.steps > 0) {
        st_.total_steps = opt_.steps;
      } else if (done == opt_.calibration_steps) {
        (void)acc.sum().item<float>();  // SYNC: end of the timed steps
        st_.step_seconds = seconds_since(t_calib) / (double)(opt_.calibration_steps - 2);
        st_.total_steps = std::max<int64_t>(st_.step + 1, (int64_t)(opt_.train_seconds / st_.step_seconds));
        if (dist_) st_.total_steps = dist_->all_reduce_min(st_.total_steps, "the timed schedule");  // one schedule
        if (root)
          std::fprintf(stderr, "[train] %.1f ms/step: %lld steps fit the %.0fs budget\n", 1e3 * st_.step_seconds,
                     (long long)st_.total_steps, opt_.train_seconds);
      }
    }
    const bool last = st_.finished();
    if (last || seconds_since(t_log) >= opt_.log_seconds) {
      t_log = std::chrono::steady_clock::now();
      auto m = (acc / (double)acc_n).cpu();  // SYNC: progress line (every few seconds)
      const double g = gsum.item<float>() / acc_n;
      st_.train_seconds = trained_before + seconds_since(t_session);
      const double rate = (st_.step - first_step) / std::max(1e-9, seconds_since(t_session));
      const double eta = st_.total_steps > 0 ? (st_.total_steps - st_.step) / std::max(rate, 1e-9) : 0.0;
      LogPoint p{st_.step, m[0].item<double>(), m[1].item<double>(), m[2].item<double>(), lr, g, st_.train_seconds};
      st_.log.push_back(p);
      if (root)
        std::fprintf(stderr, "[train] step %lld/%lld  loss %.4f  acc@1 %.3f  accept %.2f  lr %.2e  |g| %.2f  %.2f step/s  ETA %.0fs\n",
                   (long long)st_.step, (long long)st_.total_steps, p.loss, p.acc1, p.accept_len, lr, g, rate, eta);
      acc.zero_();
      gsum.zero_();
      acc_n = 0;
    }
    if (seconds_since(t_ckpt) >= opt_.checkpoint_seconds) {
      st_.train_seconds = trained_before + seconds_since(t_session);
      save_checkpoint();
      t_ckpt = std::chrono::steady_clock::now();
    }
  }
  st_.train_seconds = trained_before + seconds_since(t_session);
  save_checkpoint();
  return st_.finished();
}

BatchMetrics DrafterTrainer::evaluate(const Sequences& seqs, int64_t max_batches, uint64_t seed) const {
  at::NoGradGuard no_grad;
  std::vector<const Sequences*> pool{&seqs};
  BatchMetrics out;
  at::Tensor sum = at::zeros({3}, at::TensorOptions().dtype(at::kFloat).device(drafter_.device()));
  const int64_t n = std::max<int64_t>(1, std::min(max_batches, (seqs.size() + opt_.batch - 1) / opt_.batch));
  for (int64_t i = 0; i < n; ++i) sum += loss(sample(pool, seed + (uint64_t)i)).second;
  auto m = (sum / (double)n).cpu();  // SYNC: once per evaluation
  out.loss = m[0].item<double>();
  out.acc1 = m[1].item<double>();
  out.accept_len = m[2].item<double>();
  out.blocks = n * opt_.batch * opt_.anchors;
  return out;
}

json evaluate_tau(const Model& target, const Drafter& drafter, const std::vector<std::vector<int64_t>>& prompts,
                  int64_t max_new, int64_t block_size, const std::vector<int64_t>& stop_ids, const std::string& label) {
  KAKEYA_CHECK(!prompts.empty(), "evaluate " << label << ": no prompts");
  at::NoGradGuard no_grad;
  const int64_t B = block_size > 0 ? block_size : drafter.config().block_size;
  DecodeOptions so;
  so.max_new_tokens = max_new;
  so.block_size = B;
  so.stop_ids = stop_ids;
  DecodeOptions go;
  go.max_new_tokens = max_new;
  go.stop_ids = stop_ids;
  go.stream = false;
  // Warm-up on the first prompt (allocator, kernels, CUDA graph capture) outside the timings.
  {
    auto w = so;
    w.max_new_tokens = std::min<int64_t>(max_new, 2 * B);
    speculative_generate(target, drafter, prompts[0], w);
    auto g = go;
    g.max_new_tokens = std::min<int64_t>(max_new, 2 * B);
    generate(target, prompts[0], g);
  }
  std::vector<int64_t> hist(B + 1, 0);
  int64_t committed = 0, forwards = 0, matches = 0, spec_tokens = 0, ar_tokens = 0;
  double spec_s = 0, ar_s = 0, tau_sum = 0;
  json per_prompt = json::array();
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto sp = speculative_generate(target, drafter, prompts[i], so);
    auto ar = generate(target, prompts[i], go);
    for (int64_t k : sp.committed) ++hist[std::min<int64_t>(k, B)];
    committed += sp.committed_tokens();
    forwards += sp.verify_forwards();
    tau_sum += sp.tau();
    matches += sp.tokens == ar.tokens;
    spec_tokens += sp.tokens.size();
    ar_tokens += ar.tokens.size();
    spec_s += sp.prefill_seconds + sp.decode_seconds;
    ar_s += ar.prefill_seconds + ar.decode_seconds;
    per_prompt.push_back({{"tau", sp.tau()}, {"tokens", sp.tokens.size()}, {"lossless", sp.tokens == ar.tokens}});
    std::fprintf(stderr, "\r[eval] %s %zu/%zu  tau %.2f   ", label.c_str(), i + 1, prompts.size(),
                 forwards ? (double)committed / forwards : 0.0);
  }
  std::fprintf(stderr, "\n");
  const double tau = forwards ? (double)committed / forwards : 0.0;
  return {{"domain", label},
          {"prompts", prompts.size()},
          {"max_new_tokens", max_new},
          {"block_size", B},
          {"tau", tau},
          {"tau_mean_per_prompt", tau_sum / prompts.size()},
          {"verify_forwards", forwards},
          {"committed_tokens", committed},
          {"acceptance_histogram", hist},
          {"lossless_prompts", matches},
          {"spec_tokens_per_second", spec_s > 0 ? spec_tokens / spec_s : 0.0},
          {"ar_tokens_per_second", ar_s > 0 ? ar_tokens / ar_s : 0.0},
          {"speedup", spec_s > 0 && ar_s > 0 ? (spec_tokens / spec_s) / (ar_tokens / ar_s) : 0.0},
          {"per_prompt", per_prompt}};
}

}  // namespace kakeya::train
