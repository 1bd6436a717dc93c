// Named taps in the forward pass (llama.cpp's cb(cur, "name", il)). Capture,
// restoration and calibration subscribe here instead of forking the forward.
// A subscriber may read the tensor or replace it (assign a tensor of the same
// shape); the forward continues with whatever the tensor holds afterwards.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "core/model/config.h"
#include "core/kernels/ops.h"

namespace kakeya {

enum class Tap {
  QProj,     // q after q_proj                    [B, T, H_q, D]
  QNorm,     // q after q_norm, before RoPE       [B, T, H_q, D]   (= QProj without qk-norm)
  // The k/v taps do not fire on KV-shared layers (Gemma 4 num_kv_shared_layers): they compute none.
  KProj,     // k after k_proj (raw)              [B, T, H_kv, D]
  KNorm,     // k after k_norm, before RoPE       [B, T, H_kv, D]
  VProj,     // v after v_proj (raw)              [B, T, H_kv, D]
  VNorm,     // v after v_norm                    [B, T, H_kv, D]  (= VProj without v-norm)
  AttnOut,   // attention output after o_proj     [B, T, hidden]
  LayerOut,  // decoder layer output hidden state [B, T, hidden]
};
const char* tap_name(Tap t);  // "q_proj", "q_norm", "k_proj", "k_norm", "v_proj", "v_norm", "attn_out", "layer_out"

struct TapContext {
  int64_t layer;
  LayerType layer_type;
  const at::Tensor& positions;  // [T] int64 absolute positions of the chunk ([B, T] on independent rows)
};

class TapSubscriber {
 public:
  virtual ~TapSubscriber() = default;
  virtual void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) = 0;
  // Asked before `tap` of `layer` is computed (LayerOut only, so far): true to have its rows
  // stored in a ring of per-position rows, out->dst from column out->col (core/kernels/ops.h RowCopy;
  // the forward fills in the positions, unless the subscriber set out->positions — ring rows of its
  // own, one per row of the tap —, and writes them itself: for LayerOut inside the residual kernel,
  // no launch of its own). on_tap is still called.
  virtual bool store(Tap, int64_t layer, ops::RowCopy* out) const { return false; }
  // Whether on_tap reads or replaces `tap`. The forward runs its fused CUDA kernels, which never
  // materialise some tapped tensors (q/k/v before RoPE), only when no subscriber reads those taps;
  // a subscriber that declares only what it reads keeps the fast path (default: every tap).
  virtual bool reads(Tap) const { return true; }
};

class Taps {
 public:
  void subscribe(TapSubscriber* s) { subs_.push_back(s); }
  bool empty() const { return subs_.empty(); }
  bool reads(Tap tap) const {
    for (const TapSubscriber* s : subs_)
      if (s->reads(tap)) return true;
    return false;
  }
  void cb(Tap tap, const TapContext& ctx, at::Tensor& x) const {
    for (TapSubscriber* s : subs_) s->on_tap(tap, ctx, x);
  }
  bool store(Tap tap, int64_t layer, ops::RowCopy* out) const {  // the first subscriber that asks
    for (const TapSubscriber* s : subs_)
      if (s->store(tap, layer, out)) return true;
    return false;
  }

 private:
  std::vector<TapSubscriber*> subs_;
};

}  // namespace kakeya
