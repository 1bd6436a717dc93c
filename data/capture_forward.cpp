// One sequence's forward with every tap f_θ training reads (capture_sequence, data/capture.h):
// no HDF5 here, so online training (train/ftheta_online.h) links it without the capture writer.
#include <ATen/ATen.h>

#include "core/error.h"
#include "core/model/kv_cache.h"
#include "core/model/taps.h"
#include "data/capture.h"

namespace kakeya::data {
namespace {

// Keeps a copy of q/k/v (raw) and the attention output of every layer at batch row 0.
class VerifierRecorder : public TapSubscriber {
 public:
  explicit VerifierRecorder(int64_t layers) : q(layers), k(layers), v(layers), o(layers) {}
  void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) override {
    switch (tap) {
      case Tap::QProj: q[ctx.layer] = x.select(0, 0).clone(); break;
      case Tap::KProj: k[ctx.layer] = x.select(0, 0).clone(); break;
      case Tap::VProj: v[ctx.layer] = x.select(0, 0).clone(); break;
      case Tap::AttnOut: o[ctx.layer] = x.select(0, 0).clone(); break;
      default: break;
    }
  }
  std::vector<at::Tensor> q, k, v, o;  // per layer [T, H, D] / [T, hidden]
};

class DrafterRecorder : public TapSubscriber {
 public:
  explicit DrafterRecorder(int64_t layers) : k(layers), v(layers) {}
  void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) override {
    if (tap == Tap::KProj) k[ctx.layer] = x.select(0, 0).clone();
    if (tap == Tap::VProj) v[ctx.layer] = x.select(0, 0).clone();
  }
  std::vector<at::Tensor> k, v;  // per layer [T, H_d, D_d]
};

}  // namespace

CaptureSequence capture_sequence(const Model& verifier, const Drafter& drafter, const std::vector<int64_t>& tokens,
                                 bool on_device) {
  const auto& cfg = verifier.config();
  const int64_t T = (int64_t)tokens.size(), L = cfg.num_layers, Ld = drafter.config().num_layers;
  KAKEYA_CHECK(T > 0, "capture: empty sequence");
  KAKEYA_CHECK(T <= verifier.options().max_positions,
               "capture: sequence of " << T << " tokens exceeds the verifier's position table ("
                                       << verifier.options().max_positions << ")");
  const at::Device dev = verifier.device();
  VerifierRecorder rec(L);
  TargetFeatureCapture feats(verifier, drafter.config().target_layer_ids);
  Taps taps;
  taps.subscribe(&rec);
  taps.subscribe(&feats);
  KVCache cache(cfg, verifier.cache_options(T));
  ForwardOptions fo;
  fo.skip_logits = true;
  fo.taps = &taps;
  at::Tensor ids = at::tensor(tokens, at::kLong).view({1, T}).to(dev);
  at::Tensor pos = at::arange(T, at::TensorOptions().dtype(at::kLong).device(dev));
  verifier.forward(ids, pos, cache, fo);

  DrafterRecorder drec(Ld);
  Taps dtaps;
  dtaps.subscribe(&drec);
  at::Tensor f = feats.take();  // [1, T, n·H]
  drafter.context_kv(drafter.project_context(f), pos, &dtaps);
  auto keep = [&](const at::Tensor& t) { return on_device ? t : t.cpu(); };

  CaptureSequence s;
  s.prompt_len = T;
  s.tokens = at::tensor(tokens, at::kLong);
  s.positions = at::arange(T, at::kLong);
  for (int64_t l = 0; l < L; ++l) {
    KAKEYA_CHECK(rec.q[l].defined() && rec.k[l].defined() && rec.v[l].defined() && rec.o[l].defined(),
                 "capture: layer " << l << " fired no q/k/v/attn_out taps");
    s.q.push_back(keep(rec.q[l]));
    s.k.push_back(keep(rec.k[l]));
    s.v.push_back(keep(rec.v[l]));
    s.o.push_back(keep(rec.o[l]));
  }
  for (int64_t l = 0; l < Ld; ++l)
    KAKEYA_CHECK(drec.k[l].defined() && drec.v[l].defined(), "capture: drafter layer " << l << " fired no K/V taps");
  s.dk = keep(at::stack(drec.k, 1));  // [T, L_d, H_d, D_d]
  s.dv = keep(at::stack(drec.v, 1));
  s.feats = keep(f.select(0, 0));
  return s;
}

}  // namespace kakeya::data
