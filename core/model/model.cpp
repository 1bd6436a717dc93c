#include "core/model/model.h"

#include <cmath>
#include <optional>
#include <vector>

#include "core/error.h"
#include "core/model/random_weights.h"

namespace kakeya {

const char* tap_name(Tap t) {
  switch (t) {
    case Tap::QProj: return "q_proj";
    case Tap::QNorm: return "q_norm";
    case Tap::KProj: return "k_proj";
    case Tap::KNorm: return "k_norm";
    case Tap::VProj: return "v_proj";
    case Tap::VNorm: return "v_norm";
    case Tap::AttnOut: return "attn_out";
    case Tap::LayerOut: return "layer_out";
  }
  return "?";
}

namespace {

// HF checkpoints name the decoder "model.*" (CausalLM) or "model.language_model.*" (multimodal Gemma).
std::string find_prefix(const WeightSource& st) {
  for (const char* p : {"model.", "model.language_model.", "language_model.model.", ""})
    if (st.has(std::string(p) + "embed_tokens.weight")) return p;
  KAKEYA_FAIL(st.origin << ": no embedding tensor found (expected 'model.embed_tokens.weight')");
}

}  // namespace

Model Model::load(const std::string& dir, const ModelOptions& opt) {
  auto cfg = ModelConfig::from_file(dir + "/config.json");
  auto store = std::make_shared<TensorStore>(TensorStore::open_dir(dir));
  WeightSource src;
  src.origin = dir;
  src.has = [store](const std::string& name) { return store->has(name); };
  src.get = [store](const std::string& name, at::IntArrayRef shape) { return store->get(name, shape); };
  return from_weights(cfg, src, opt);
}

Model Model::random(const ModelConfig& cfg, uint64_t seed, const ModelOptions& opt) {
  return from_weights(cfg, random_weights(seed, opt.device), opt);
}

Model Model::from_weights(const ModelConfig& cfg, const WeightSource& st, const ModelOptions& opt) {
  KAKEYA_CHECK(opt.dtype == at::kFloat || opt.dtype == at::kBFloat16 || opt.dtype == at::kHalf,
               st.origin << ": dtype " << opt.dtype << " not supported (f32, bf16, f16)");
  Model m;
  m.cfg_ = cfg;
  m.opt_ = opt;
  const std::string pre = find_prefix(st);
  auto dev = [&](const at::Tensor& t) { return t.to(opt.device, opt.dtype); };
  auto get = [&](const std::string& name, std::vector<int64_t> shape) { return st.get(pre + name, shape); };
  m.norm_spec_ = {cfg.rms_norm_eps, cfg.norm_f32};
  // Norm weights in f32 (ops.h): Gemma 3's output is x̂·(1+w) in f32, so fold the 1 in
  // once; Gemma 4 (x̂·w in f32) and Llama/Qwen (x̂·w in the model dtype) read the
  // weight as the model holds it, rounded to its dtype.
  auto norm_w = [&](const std::string& name, int64_t dim) {
    auto w = get(name, {dim});
    auto wf = cfg.norm_unit_offset ? w.to(at::kFloat) + 1.0 : w.to(opt.dtype).to(at::kFloat);
    return wf.to(opt.device);
  };
  const int64_t H = cfg.hidden_size;

  m.embed_ = dev(get("embed_tokens.weight", {cfg.vocab_size, H}));
  m.norm_ = norm_w("norm.weight", H);
  if (cfg.tie_word_embeddings) {
    m.lm_head_ = m.embed_;
  } else {
    std::string name = st.has("lm_head.weight") ? "lm_head.weight" : pre + "lm_head.weight";
    m.lm_head_ = dev(st.get(name, {cfg.vocab_size, H}));
  }
  m.embed_scale_ = at::scalar_tensor(cfg.embed_scale_sqrt_hidden ? std::sqrt((double)H) : 1.0, at::kFloat)
                       .to(opt.device, opt.dtype);
  if (const int64_t P = cfg.per_layer_input_size; P > 0) {
    m.ple_embed_ = dev(get("embed_tokens_per_layer.weight", {cfg.per_layer_vocab_size, cfg.num_layers * P}));
    m.ple_embed_scale_ = at::scalar_tensor(std::sqrt((double)P), at::kFloat).to(opt.device, opt.dtype);
    m.ple_model_proj_ = dev(get("per_layer_model_projection.weight", {cfg.num_layers * P, H}));
    m.ple_proj_norm_ = norm_w("per_layer_projection_norm.weight", P);
  }

  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const int64_t D = cfg.layer_head_dim[l], qd = cfg.q_dim(l), kvd = cfg.kv_dim(l), I = cfg.mlp_width(l);
    LayerWeights w;
    const bool k_eq_v = cfg.k_eq_v(l);  // no v_proj: V is the raw K projection
    const bool shared = cfg.kv_shared(l);  // no k/v projections: K/V of layer kv_layer[l]
    // Built by push_back into reserved room: an initializer list followed by a growing
    // push_back trips GCC 12's -Warray-bounds on at::Tensor's move.
    std::vector<at::Tensor> qkv;
    qkv.reserve(3);
    qkv.push_back(get(p + "self_attn.q_proj.weight", {qd, H}));
    if (!shared) qkv.push_back(get(p + "self_attn.k_proj.weight", {kvd, H}));
    if (!shared && !k_eq_v) qkv.push_back(get(p + "self_attn.v_proj.weight", {kvd, H}));
    w.qkv = dev(at::cat(qkv));
    if (cfg.attention_bias) {
      std::vector<at::Tensor> b;
      b.reserve(3);
      b.push_back(get(p + "self_attn.q_proj.bias", {qd}));
      if (!shared) b.push_back(get(p + "self_attn.k_proj.bias", {kvd}));
      if (!shared && !k_eq_v) b.push_back(get(p + "self_attn.v_proj.bias", {kvd}));
      w.qkv_bias = dev(at::cat(b));
      w.o_bias = dev(get(p + "self_attn.o_proj.bias", {H}));
    }
    w.o = dev(get(p + "self_attn.o_proj.weight", {H, qd}));
    if (cfg.qk_norm) {
      w.q_norm = norm_w(p + "self_attn.q_norm.weight", D);
      if (!shared) w.k_norm = norm_w(p + "self_attn.k_norm.weight", D);
    }
    if (cfg.v_norm && !shared) w.v_norm = at::ones({D}, at::TensorOptions().dtype(at::kFloat).device(opt.device));
    w.attn_norm = norm_w(p + "input_layernorm.weight", H);
    if (cfg.sandwich_norm) {
      w.post_attn_norm = norm_w(p + "post_attention_layernorm.weight", H);
      w.ffn_norm = norm_w(p + "pre_feedforward_layernorm.weight", H);
      w.post_ffn_norm = norm_w(p + "post_feedforward_layernorm.weight", H);
    } else {
      // Llama/Qwen call their pre-FFN norm "post_attention_layernorm".
      w.ffn_norm = norm_w(p + "post_attention_layernorm.weight", H);
    }
    w.gate_up = dev(at::cat({get(p + "mlp.gate_proj.weight", {I, H}), get(p + "mlp.up_proj.weight", {I, H})}));
    w.down = dev(get(p + "mlp.down_proj.weight", {H, I}));
    if (cfg.mlp_bias) {
      w.gate_up_bias = dev(at::cat({get(p + "mlp.gate_proj.bias", {I}), get(p + "mlp.up_proj.bias", {I})}));
      w.down_bias = dev(get(p + "mlp.down_proj.bias", {H}));
    }
    if (cfg.moe()) {
      const int64_t E = cfg.num_experts, Ie = cfg.moe_intermediate_size;
      MoeWeights& e = w.moe;
      e.router_scale = dev(get(p + "router.scale", {H}));
      e.router_proj = dev(get(p + "router.proj.weight", {E, H}));
      e.per_expert_scale = dev(get(p + "router.per_expert_scale", {E}));
      e.gate_up = dev(get(p + "experts.gate_up_proj", {E, 2 * Ie, H}));
      e.down = dev(get(p + "experts.down_proj", {E, H, Ie}));
      e.pre_norm = norm_w(p + "pre_feedforward_layernorm_2.weight", H);
      e.post_norm = norm_w(p + "post_feedforward_layernorm_2.weight", H);
      e.post_dense_norm = norm_w(p + "post_feedforward_layernorm_1.weight", H);
    }
    if (const int64_t P = cfg.per_layer_input_size; P > 0) {
      w.ple_gate = dev(get(p + "per_layer_input_gate.weight", {P, H}));
      w.ple_proj = dev(get(p + "per_layer_projection.weight", {H, P}));
      w.ple_norm = norm_w(p + "post_per_layer_input_norm.weight", H);
    }
    if (cfg.layer_scalar) {
      auto s = dev(get(p + "layer_scalar", {1}));
      if (s.item<double>() != 1.0) w.layer_scalar = s;  // ×1 is exact: keep the fused residual step
    }
    m.layers_.push_back(std::move(w));
  }
  int64_t d_full = cfg.head_dim, d_sliding = cfg.head_dim;
  for (int64_t l = 0; l < cfg.num_layers; ++l) (cfg.is_sliding(l) ? d_sliding : d_full) = cfg.layer_head_dim[l];
  m.rope_full_ = RopeTable(cfg.rope_full, d_full, opt.max_positions, opt.dtype, opt.device);
  m.rope_sliding_ = RopeTable(cfg.rope_sliding, d_sliding, opt.max_positions, opt.dtype, opt.device);
  if (opt.head_screen && opt.device.is_cuda() && !cfg.final_logit_softcap) m.head_screen_ = ops::make_head_screen(m.lm_head_);
  return m;
}

int64_t Model::head_screen_bytes() const {
  int64_t b = 0;
  for (const at::Tensor* t : {&head_screen_.codes, &head_screen_.scale, &head_screen_.err})
    if (t->defined()) b += t->numel() * t->element_size();
  return b;
}

int64_t Model::weight_bytes() const {
  int64_t b = embed_.numel() * embed_.element_size() + norm_.numel() * norm_.element_size();
  for (const at::Tensor* t : {&ple_embed_, &ple_model_proj_, &ple_proj_norm_})
    if (t->defined()) b += t->numel() * t->element_size();
  if (!lm_head_.is_same(embed_)) b += lm_head_.numel() * lm_head_.element_size();
  for (const auto& w : layers_)
    for (const at::Tensor* t : {&w.qkv, &w.qkv_bias, &w.o, &w.o_bias, &w.q_norm, &w.k_norm, &w.attn_norm,
                                &w.post_attn_norm, &w.ffn_norm, &w.post_ffn_norm, &w.gate_up, &w.down,
                                &w.gate_up_bias, &w.down_bias, &w.layer_scalar, &w.moe.router_scale,
                                &w.moe.router_proj, &w.moe.per_expert_scale, &w.moe.gate_up, &w.moe.down,
                                &w.moe.pre_norm, &w.moe.post_norm, &w.moe.post_dense_norm, &w.ple_gate,
                                &w.ple_proj, &w.ple_norm})
      if (t->defined()) b += t->numel() * t->element_size();
  return b;
}

int64_t Model::active_weight_bytes() const {
  int64_t b = weight_bytes();
  for (const auto& w : layers_) {
    if (!w.moe.defined()) continue;
    const int64_t experts = w.moe.gate_up.nbytes() + w.moe.down.nbytes();
    b -= experts - experts * cfg_.top_k_experts / w.moe.num_experts();
  }
  return b;
}

at::Tensor Model::per_layer_inputs(const at::Tensor& ids, const at::Tensor& embeds) const {
  const int64_t B = ids.size(0), T = ids.size(1), L = cfg_.num_layers, P = cfg_.per_layer_input_size;
  // The token's own rows of the packed table, and a projection of its (scaled) embedding,
  // each [B, T, L, P]; their sum × 2^-0.5 is what every layer gates.
  auto tok = (at::embedding(ple_embed_, ids) * ple_embed_scale_).view({B, T, L, P});
  auto proj = ops::linear(embeds, ple_model_proj_) * std::pow((double)cfg_.hidden_size, -0.5);
  proj = rms_norm(proj.view({B, T, L, P}), ple_proj_norm_);
  return (proj + tok) * std::pow(2.0, -0.5);
}

at::Tensor Model::final_norm(const at::Tensor& h) const { return rms_norm(h, norm_); }

at::Tensor Model::logits(const at::Tensor& hidden) const {
  auto lg = ops::linear(hidden, lm_head_);
  if (cfg_.final_logit_softcap) {
    double c = *cfg_.final_logit_softcap;
    lg = at::tanh(lg / c) * c;
  }
  return lg.to(at::kFloat);
}

std::pair<at::Tensor, at::Tensor> Model::finish_kv(int64_t layer, const at::Tensor& k_raw, const at::Tensor& v_raw,
                                                   const at::Tensor& positions) const {
  KAKEYA_CHECK(!cfg_.kv_shared(layer), "finish_kv: layer " << layer << " is KV-shared (config field "
                                           << "'num_kv_shared_layers'): it has no K/V of its own");
  const auto& w = layers_[layer];
  auto k = cfg_.qk_norm ? rms_norm(k_raw, w.k_norm) : k_raw;
  k = rope(layer).apply(k, positions);
  auto v = cfg_.v_norm ? rms_norm(v_raw, w.v_norm) : v_raw;
  return {k.transpose(1, 2), v.transpose(1, 2)};
}

ops::QKRopeArgs Model::rope_args(int64_t layer, int64_t num_heads, int64_t ring) const {
  const auto& w = layers_[layer];
  ops::QKRopeArgs a;
  a.num_heads = num_heads;
  a.num_kv_heads = cfg_.kv_heads(layer);
  a.head_dim = cfg_.layer_head_dim[layer];
  a.norm = norm_spec_;
  a.q_norm = w.q_norm;
  a.k_norm = w.k_norm;
  a.v_norm = w.v_norm;
  a.v_from_k = cfg_.k_eq_v(layer);
  a.cos = rope(layer).cos();
  a.sin = rope(layer).sin();
  a.ring = ring;
  return a;
}

at::Tensor Model::finish_q(int64_t layer, const at::Tensor& q_raw, const at::Tensor& positions) const {
  auto q = cfg_.qk_norm ? rms_norm(q_raw, layers_[layer].q_norm) : q_raw;
  return rope(layer).apply(q, positions);
}

at::Tensor Model::layer_mask(int64_t layer, const at::Tensor& k_pos, const at::Tensor& q_pos) const {
  return causal_visible(k_pos, q_pos, cfg_.is_sliding(layer) ? cfg_.sliding_window : 0);
}

at::Tensor Model::attention(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask) const {
  // q: [B, T, H_q, D]; k, v: [B, H_kv, S, D]; mask: [T, S] bool, or [B, T, S] (rows that are
  // independent sequences).
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.size(1), G = Hq / Hkv;
  const bool row_masks = mask.dim() == 3;
  // The mask over the folded query axis [G·T]: [G·T, S], or [B, 1, G·T, S] per row.
  auto group_mask = [&] {
    if (row_masks) return (G == 1 ? mask : mask.repeat({1, G, 1})).unsqueeze(1);
    return G == 1 ? mask : mask.repeat({G, 1});
  };
  // Fold each GQA group into the query axis (q head h reads kv head h / G, as
  // HF's repeat_kv): [B, H_kv, G·T, D] attends to K/V without copying them.
  auto qg = q.permute({0, 2, 1, 3}).reshape({B, Hkv, G * T, D});
  const int64_t S = k.size(2), rows = B * Hkv * G * T;
  // Fused SDPA kernels split the work over query rows and heads only: a restored prefill chunk
  // (256 queries × 4 heads of Gemma 3 270M, one KV head) gets 8 thread blocks, and spends ~1 ms
  // on a full-attention layer of 8k slots. With few query rows, two batched GEMMs around an f32
  // softmax spread over the whole GPU instead (scores f32 from the dtype's inputs, probabilities
  // in the dtype for the value product, as the fused kernels keep them), while the score matrix
  // stays small (<= 1 GiB). One pass over the keys: a pass in key tiles with a running max
  // (less scratch) made the 8k restored prefill 16% slower (H200).
  const bool few_rows = q.is_cuda() && rows <= 8192 && rows * S * 4 <= (int64_t{1} << 30);
  at::Tensor out;
  if (few_rows && !cfg_.attn_logit_softcap) {
    const auto dt = q.scalar_type();
    auto qb = qg.reshape({B * Hkv, G * T, D});
    auto kb = k.reshape({B * Hkv, S, D}).transpose(1, 2);                    // [B·H_kv, D, S]
    auto s = dt == at::kFloat ? at::bmm(qb, kb) : at::bmm(qb, kb, at::kFloat);  // [B·H_kv, G·T, S] f32
    // The mask is the same for every query head of a group: [T, S] (or [B, 1, 1, T, S]) over [B, H_kv, G, T, S].
    s.mul_(cfg_.attn_scale)
        .view({B, Hkv, G, T, S})
        .masked_fill_((row_masks ? mask.view({B, 1, 1, T, S}) : mask).logical_not(), -INFINITY);
    out = at::bmm(at::softmax(s, -1).to(dt), v.reshape({B * Hkv, S, D}));
  } else if (cfg_.attn_logit_softcap) {
    auto m = group_mask();
    double c = *cfg_.attn_logit_softcap;
    auto s = at::matmul(qg, k.transpose(-1, -2)) * cfg_.attn_scale;
    s = at::tanh(s / c) * c;
    s = s.masked_fill(m.logical_not(), -INFINITY);
    out = at::matmul(at::softmax(s, -1, at::kFloat).to(q.scalar_type()), v);
  } else {
    auto m = group_mask();
    out = at::scaled_dot_product_attention(qg, k, v, m, 0.0, false, cfg_.attn_scale);
  }
  return out.reshape({B, Hq, T, D}).permute({0, 2, 1, 3}).reshape({B, T, Hq * D});
}

at::Tensor Model::forward(const at::Tensor& ids, KVCache& cache, const ForwardOptions& fo) const {
  auto pos = at::arange(cache.length(), cache.length() + ids.size(1), at::TensorOptions().dtype(at::kLong).device(opt_.device));
  return forward(ids, pos, cache, fo);
}

at::Tensor Model::forward(const at::Tensor& ids, const at::Tensor& positions, KVCache& cache,
                          const ForwardOptions& fo) const {
  const int64_t B = ids.size(0), T = ids.size(1), Hq = cfg_.num_heads;
  // positions [B, T]: each row an independent sequence at its own positions (a batch of
  // sessions in a cache of independent rows, KVCacheOptions::rows); its caller tracks the rows'
  // lengths, so the cache does not advance.
  const bool rows = positions.dim() == 2;
  KAKEYA_CHECK(rows == cache.options().rows,
               "forward: positions " << positions.sizes() << " for a cache of "
                                     << (cache.options().rows ? "independent rows ([B, T] expected)" : "one sequence ([T] expected)"));
  KAKEYA_CHECK(positions.size(-1) == T && (!rows || positions.size(0) == B),
               "forward: positions " << positions.sizes() << " for ids " << ids.sizes());

  // Masks are shared by all layers of a type. A chunk too long to write first (the
  // model's own sliding ring, a restored layer's exact ring, or a coded full-attention
  // layer's under exact copies) attends over [slots as they were ++ chunk], so keep
  // the slots' positions.
  int64_t first_sliding = -1, first_full = -1;
  for (int64_t l = cfg_.num_layers - 1; l >= 0; --l) (cfg_.is_sliding(l) ? first_sliding : first_full) = l;
  const bool sliding_concat = first_sliding >= 0 && !cache.write_first(first_sliding, T);
  const bool full_concat = first_full >= 0 && !cache.write_first(first_full, T);
  KAKEYA_CHECK(!full_concat || (cache.coded(first_full) && cache.options().restore.exact_copies),
               "forward: a chunk of " << T << " tokens is too long for the restored cache's exact ring");
  KAKEYA_CHECK(!rows || !(sliding_concat || full_concat),
               "forward: " << T << " tokens per row are too many for the rings of independent rows");
  // [S_l] slot positions before mark(), where a layer type concatenates (a coded layer's cache has no
  // KV-shared layers: KVCache refuses restoration with KV sharing)
  const at::Tensor old_sliding_pos = sliding_concat ? cache.slot_positions(first_sliding).clone() : at::Tensor();
  const at::Tensor old_full_pos = full_concat ? cache.slot_positions(first_full).clone() : at::Tensor();
  cache.mark(positions);
  const Taps* taps = fo.taps && !fo.taps->empty() ? fo.taps : nullptr;
  // Fused CUDA kernels where nothing needs the intermediate tensors: q/k norm +
  // RoPE + cache store in one kernel (no subscriber taps q/k/v), and the attention
  // kernel for decode steps and verify blocks, which reads visibility from the slot
  // positions and the cache's copy rule itself (no mask tensors, no SDPA launches).
  const bool cuda_fused = ids.is_cuda() && ops::cuda_kernels_available();
  // The fused q/k-norm + RoPE + store kernel skips the q/k/v taps: only when nobody reads them.
  bool qkv_tapped = false;
  for (Tap t : {Tap::QProj, Tap::QNorm, Tap::KProj, Tap::KNorm, Tap::VProj, Tap::VNorm})
    qkv_tapped = qkv_tapped || (taps && taps->reads(t));
  // The kernel re-reads K/V per query: right for a few queries; prefill chunks take SDPA.
  constexpr int64_t kAttnKernelMaxQueries = 32;
  const bool attn_kernel = cuda_fused && T <= kAttnKernelMaxQueries;
  // A sliding chunk that attends over [slots as they were ++ chunk] (a restored decoder's prefill
  // chunk of up to its window): on a few hundred slots re-reading them per query costs less than
  // the ~30 small kernels per layer of decoding the region, concatenating, masking and softmax;
  // the chunk's own keys go to the kernel as its tail, and to the ring after it.
  // (Not with KV-shared layers: they attend over the [slots ++ chunk] their source layer built.)
  // (Nor with a chunk longer than a restored cache's window, RestorePolicy::exact_copies: the
  // kernel reads a chunk's own keys by the exact-window rule, and the write stores their copies.)
  constexpr int64_t kTailKernelMaxQueries = 64;
  const bool tail_kernel = cuda_fused && sliding_concat && T <= kTailKernelMaxQueries && cfg_.num_kv_shared() == 0 &&
                           (cache.plain(first_sliding) || T <= cache.options().restore.window);
  // Layers that drop their restored positions (RestorePolicy::drop) see fewer slots: one mask
  // per (layer type, drop) pair, built from the first such layer.
  at::Tensor mask[2][2];  // [full|sliding][keeps|drops]: [T, S] bool
  if (!attn_kernel || sliding_concat || full_concat) {
    for (int64_t l = 0; l < cfg_.num_layers; ++l) {
      const bool sl = cfg_.is_sliding(l), dr = cache.options().restore.drops(l);
      at::Tensor& m = mask[sl][dr];
      if (m.defined()) continue;
      if (sl && sliding_concat) {
        if (!tail_kernel) m = cache.visible_concat(l, old_sliding_pos, positions);
      } else if (!sl && full_concat) {
        m = cache.visible_concat(l, old_full_pos, positions);
      } else if (!attn_kernel) {
        m = cache.visible(l, positions);
      }
    }
  }
  // The tail's row order: the fused store below writes position p to row p mod T of a [.., T, D]
  // scratch (a forward's positions are consecutive, so the rows are a rotation of them).
  at::Tensor tail_pos;  // [T] int64: the position each scratch row holds
  if (tail_kernel && !qkv_tapped) {
    tail_pos = at::empty_like(positions);
    ops::store_positions(tail_pos, positions, T);
  }

  // Each layer's weights, and its K/V rows where they fit L2 beside them, a layer ahead (ops::L2Prefetch).
  // 16 MB of K + V: a Gemma 3 270M full-attention layer's 8k positions, beside its 11 MB of weights.
  constexpr size_t kPrefetchKVBytes = 16 << 20;
  ops::L2Prefetch prefetch(ids, T);
  auto prefetch_layer = [&](int64_t l) {
    if (!prefetch.active() || l >= cfg_.num_layers) return;  // no tensor lists for a forward that takes none
    const auto& w = layers_[l];
    std::vector<at::Tensor> ts{w.qkv, w.o, w.gate_up, w.down};
    const at::Tensor &k = cache.keys(l), &v = cache.values(l);
    const at::Tensor& pos = cache.slot_positions(l);
    if (k.is_contiguous() && v.is_contiguous() && pos.is_contiguous() && k.nbytes() + v.nbytes() <= kPrefetchKVBytes)
      ts.insert(ts.end(), {k, v, pos});
    prefetch.ahead(ts);
  };
  prefetch_layer(0);
  // h: [B, T, hidden] = embed(ids); x: its first pre-norm (later layers get theirs from the residual steps)
  at::Tensor h, x;
  std::tie(h, x) = ops::embed_rms_norm(embed_, ids, embed_scale_, layers_[0].attn_norm, norm_spec_);
  const at::Tensor ple = ple_embed_.defined() ? per_layer_inputs(ids, h) : at::Tensor();  // [B, T, L, P]
  std::pair<at::Tensor, at::Tensor> concat_kv;       // [B, H_kv, S + T, D] each: see !write_first below
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    prefetch_layer(l + 1);
    const auto& w = layers_[l];
    const int64_t D = cfg_.layer_head_dim[l], Hkv = cfg_.kv_heads(l), qd = cfg_.q_dim(l), kvd = cfg_.kv_dim(l);
    const bool sliding = cfg_.is_sliding(l);
    TapContext ctx{l, cfg_.layer_types[l], positions};
    auto tap = [&](Tap t, at::Tensor& x) { if (taps) taps->cb(t, ctx, x); };

    // [B, T, qd + 2·kvd] ([B, T, qd + kvd] on K=V layers, [B, T, qd] on KV-shared layers)
    // The layer's first residual step stays a kernel of its own (ops::add_rms_norm at the end of the
    // layer before): folded into this projection (ops::add_rms_norm_linear, as the gate/up one is),
    // the decode step was slower (H200, Gemma 3 270M's shape, AR at 512: 1,906.8 against 1,927.5
    // tok/s; 8k 1,779.2 against 1,812.6).
    at::Tensor qkv = ops::linear(x, w.qkv, w.qkv_bias);
    at::Tensor q, kc, vc;  // q: [B, T, Hq, D] after RoPE; kc, vc: [B, H_kv, T, D] when not stored yet
    const bool write_first = sliding ? !sliding_concat : !full_concat;
    // KV-shared layers compute only q: the cache's buffers of such a layer are those of
    // kv_layer[l], which wrote them earlier in this forward, so they attend over its K/V.
    const bool shared = cfg_.kv_shared(l);
    // The fused kernel also norms v (Gemma 4's v_norm) and takes V from the raw K rows on K=V
    // layers. It stores at position mod the exact ring, as KVCache::write does; a coded layer then
    // codes the rows it stored.
    if (cuda_fused && !qkv_tapped && write_first && !shared) {
      q = ops::qk_norm_rope_store(qkv, positions, rope_args(l, Hq, cache.exact_slots(l)), cache.k_mut(l),
                                  cache.v_mut(l));
      if (cache.coded(l)) cache.code_stored(l, positions);
    } else if (tail_kernel && !qkv_tapped && sliding) {
      // Into the tail's scratch (rows in tail_pos order), written to the ring after attending.
      kc = at::empty({B, Hkv, T, D}, qkv.options());
      vc = at::empty({B, Hkv, T, D}, qkv.options());
      q = ops::qk_norm_rope_store(qkv, positions, rope_args(l, Hq, T), kc, vc);
    } else {
      q = qkv.slice(-1, 0, qd).view({B, T, Hq, D});
      at::Tensor k, v;  // raw [B, T, H_kv, D]; none on KV-shared layers
      if (!shared) {
        k = qkv.slice(-1, qd, qd + kvd).view({B, T, Hkv, D});
        // K=V layers: V is the raw K projection (before k_norm and RoPE), as in HF.
        v = cfg_.k_eq_v(l) ? k : qkv.slice(-1, qd + kvd).view({B, T, Hkv, D});
      }
      tap(Tap::QProj, q);
      if (!shared) {
        tap(Tap::KProj, k);
        tap(Tap::VProj, v);
      }
      if (cfg_.qk_norm) q = rms_norm(q, w.q_norm);
      tap(Tap::QNorm, q);
      q = rope(l).apply(q, positions);
      if (!shared) {
        at::Tensor kn = cfg_.qk_norm ? rms_norm(k, w.k_norm) : k;
        tap(Tap::KNorm, kn);
        at::Tensor vn = cfg_.v_norm ? rms_norm(v, w.v_norm) : v;
        tap(Tap::VNorm, vn);
        kc = rope(l).apply(kn, positions).transpose(1, 2);
        vc = vn.transpose(1, 2);
        if (write_first) cache.write(l, kc, vc, positions);
      }
    }

    at::Tensor attn;  // [B, T, Hq·D]
    if (!write_first && sliding && tail_kernel) {
      // Rows of kc/vc: tail_pos order from the fused store, else the forward's own order.
      const at::Tensor& rows = qkv_tapped ? positions : tail_pos;
      attn = ops::decode_attention(q, cache.keys(l), cache.values(l), old_sliding_pos, positions, cfg_.sliding_window,
                                   cfg_.attn_scale, cfg_.attn_logit_softcap.value_or(0.0), cache.copy_rule(l),
                                   {kc.contiguous(), vc.contiguous(), rows});
      cache.write(l, kc, vc, rows);
    } else if (!write_first) {
      // [slots as they were ++ chunk], written after attending; KV-shared sliding layers attend
      // over the one their source layer built (the ring no longer holds what it overwrote).
      if (!shared) {
        const auto [k_all, v_all] = cache.attend_kv(l);  // coded rows (a region, a coded layer) decoded
        concat_kv = {at::cat({k_all, kc}, 2), at::cat({v_all, vc}, 2)};
      }
      attn = attention(l, q, concat_kv.first, concat_kv.second, mask[sliding][cache.options().restore.drops(l)]);
      if (!shared) cache.write(l, kc, vc, positions);
    } else if (attn_kernel) {
      attn = ops::decode_attention(q, cache.keys(l), cache.values(l), cache.slot_positions(l), positions,
                                   sliding ? cfg_.sliding_window : 0, cfg_.attn_scale,
                                   cfg_.attn_logit_softcap.value_or(0.0), cache.copy_rule(l));
    } else {
      const auto [k_all, v_all] = cache.attend_kv(l);
      attn = attention(l, q, k_all, v_all, mask[sliding][cache.options().restore.drops(l)]);
    }
    at::Tensor a = ops::linear(attn, w.o, w.o_bias);  // [B, T, hidden]
    tap(Tap::AttnOut, a);
    const bool gelu = cfg_.act == Activation::GeluTanh;
    at::Tensor gu;  // act(gate)·up of the dense MLP: [B, T, intermediate]
    if (w.moe.defined())
      std::tie(h, x) = ops::add_rms_norm(h, a, w.post_attn_norm, w.ffn_norm, norm_spec_);
    else
      std::tie(h, gu) = ops::add_rms_norm_linear(h, a, w.post_attn_norm, w.ffn_norm, norm_spec_,
                                                 {w.gate_up, w.gate_up_bias, /*gated=*/true, gelu});

    // Gemma 4 MoE: the router and the experts read the residual stream h (not the dense
    // branch's pre-norm x), so they run beside the dense MLP (ops::SideBranch).
    ops::ExpertRoute route;
    at::Tensor y;  // the experts' pair rows, or their weighted sum (moe_experts)
    std::optional<ops::SideBranch> experts;
    if (w.moe.defined()) {
      experts.emplace(h);
      experts->run([&] {
        const auto flat = h.reshape({-1, h.size(-1)});  // [N, H]
        route = moe_route(w.moe, flat, cfg_.top_k_experts, norm_spec_);
        y = moe_experts(w.moe, ops::rms_norm(flat, w.moe.pre_norm, norm_spec_), route, gelu);
      });
    }
    // MoE layers: the dense branch after the experts' side branch is issued, so the two overlap.
    if (!gu.defined()) gu = ops::linear_act_mul(x, w.gate_up, w.gate_up_bias, gelu);
    at::Tensor f = ops::linear(gu, w.down, w.down_bias);
    if (experts) experts->join();
    const at::Tensor& next_norm = l + 1 < cfg_.num_layers ? layers_[l + 1].attn_norm : norm_;
    // A subscriber may want the layer output stored as it is computed (core/model/taps.h).
    ops::RowCopy store;
    const bool stored = taps && taps->store(Tap::LayerOut, l, &store);
    if (stored && !store.positions.defined()) store.positions = positions;  // unless the subscriber names the rows
    if (w.moe.defined()) {
      // One residual step sums the two branches through their post-norms. Per-layer inputs come
      // between that sum and the layer scalar (below).
      const bool per_layer = w.ple_gate.defined();
      std::tie(h, x) = ops::moe_residual(
          h, f, y, route.plan.experts.defined() ? route.weights : at::Tensor(),
          {w.moe.post_dense_norm, w.moe.post_norm, w.post_ffn_norm, per_layer ? at::Tensor() : w.layer_scalar},
          next_norm, norm_spec_, stored && !per_layer ? &store : nullptr);
    }
    if (w.ple_gate.defined() || (w.layer_scalar.defined() && !w.moe.defined())) {
      if (!w.moe.defined()) h = h + (w.post_ffn_norm.defined() ? rms_norm(f, w.post_ffn_norm) : f);
      // Gemma 4 per-layer inputs: h += norm(proj(act(gate(h)) · this layer's input)).
      if (w.ple_gate.defined()) {
        auto g = ops::act_mul(at::cat({ops::linear(h, w.ple_gate), ple.select(2, l)}, -1), gelu);  // [B, T, P]
        h = h + rms_norm(ops::linear(g, w.ple_proj), w.ple_norm);
      }
      // Gemma 4: the layer's whole output (residual stream included) ×= layer_scalar, in the model dtype.
      if (w.layer_scalar.defined()) h = h * w.layer_scalar;
      x = rms_norm(h, next_norm);
      if (stored) ops::copy_rows(h, store);
    } else if (!w.moe.defined()) {
      std::tie(h, x) = ops::add_rms_norm(h, f, w.post_ffn_norm, next_norm, norm_spec_, stored ? &store : nullptr);
    }
    if (taps) {
      const at::Tensor before = h;
      tap(Tap::LayerOut, h);
      if (!h.is_same(before)) x = rms_norm(h, next_norm);  // a subscriber replaced h (core/model/taps.h)
    }
  }
  if (fo.advance_cache && !rows) cache.advance(T);
  if (fo.skip_logits) return at::Tensor();
  if (fo.last_logits_only) x = x.slice(1, T - 1);
  if (fo.argmax) {
    at::Tensor out = at::empty({B, x.size(1)}, ids.options().dtype(at::kLong));
    // A final softcap's bf16 rounding can tie two distinct scores: argmax of the capped logits then.
    if (cfg_.final_logit_softcap) ops::argmax_rows(logits(x), {}, out);
    else ops::linear_argmax(x, lm_head_, out, fo.full_head ? nullptr : &head_screen_);
    return out;
  }
  if (fo.raw_logits) return ops::linear(x, lm_head_);
  return logits(x);  // x = final_norm(h) from the last residual step
}

}  // namespace kakeya
