#include "core/model/drafter.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/io/fs.h"
#include "core/kernels/ops.h"
#include "core/io/safetensors.h"

namespace kakeya {
using json = nlohmann::json;

std::vector<int64_t> dflash_target_layer_ids(int64_t num_target_layers, int64_t num_draft_layers) {
  KAKEYA_CHECK(num_target_layers > 0 && num_draft_layers > 0,
               "dflash_target_layer_ids: expected positive layer counts, got " << num_target_layers << " and "
                                                                               << num_draft_layers);
  if (num_draft_layers == 1) return {num_target_layers / 2};
  // Evenly spaced over [1, L-3]: past the embedding-like first layer, short of the
  // last layers that specialise in the next token only.
  const int64_t start = 1, end = num_target_layers - 3, span = end - start;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < num_draft_layers; ++i)
    // Python's round() is round-half-to-even, as std::nearbyint in the default rounding mode.
    ids.push_back((int64_t)std::nearbyint((double)start + (double)(i * span) / (double)(num_draft_layers - 1)));
  return ids;
}

// ---------------------------------------------------------------------------
// DrafterConfig

namespace {

// DFlash reads its fields from dflash_config first, then from the top level.
struct DFlashFields {
  const json& top;
  const json* dflash;  // nullptr if absent
  std::string origin;

  const json* find(const char* key, std::string* where) const {
    if (dflash && dflash->contains(key) && !dflash->at(key).is_null()) {
      *where = std::string("dflash_config.") + key;
      return &dflash->at(key);
    }
    if (top.contains(key) && !top.at(key).is_null()) {
      *where = key;
      return &top.at(key);
    }
    *where = std::string("dflash_config.") + key;
    return nullptr;
  }
  std::optional<int64_t> integer(const char* key) const {
    std::string where;
    const json* v = find(key, &where);
    if (!v) return std::nullopt;
    KAKEYA_CHECK(v->is_number_integer(), origin << ": field '" << where << "' expected an integer, got " << v->dump());
    return v->get<int64_t>();
  }
  std::optional<double> number(const char* key) const {
    std::string where;
    const json* v = find(key, &where);
    if (!v) return std::nullopt;
    KAKEYA_CHECK(v->is_number(), origin << ": field '" << where << "' expected a number, got " << v->dump());
    double d = v->get<double>();
    KAKEYA_CHECK(std::isfinite(d), origin << ": field '" << where << "' is not finite");
    return d;
  }
};

json rope_json(const RopeParams& p) {
  json r{{"rope_type", p.type}, {"rope_theta", p.theta}};
  if (p.type == "linear") r["factor"] = p.factor;
  if (p.type == "llama3") {
    r["factor"] = p.factor;
    r["low_freq_factor"] = p.low_freq_factor;
    r["high_freq_factor"] = p.high_freq_factor;
    r["original_max_position_embeddings"] = p.original_max_position;
  }
  if (p.type == "proportional") r["partial_rotary_factor"] = p.partial_rotary_factor;
  return r;
}

}  // namespace

DrafterConfig DrafterConfig::from_json(const json& j, const std::string& origin) {
  KAKEYA_CHECK(j.is_object(), origin << ": expected a JSON object");
  DrafterConfig c;
  c.origin = origin;
  if (j.contains("architectures") && j["architectures"].is_array())
    for (const auto& a : j["architectures"])
      KAKEYA_CHECK(!(a.is_string() && a.get<std::string>() == "DFlash2DraftModel"),
                   origin << ": field 'architectures' names DFlash2DraftModel (dynamic convolutions, candidate "
                             "selector); only DFlashDraftModel is supported");
  // The decoder fields are an HF Qwen3 config: reuse ModelConfig's validating
  // parser for them (RoPE layouts of transformers 4.x and 5.x included). Layer
  // types and the window follow DFlash's reading below, so take them out here.
  json q = j;
  q["model_type"] = "qwen3";
  q.erase("layer_types");
  q["use_sliding_window"] = false;
  if (!q.contains("vocab_size") || q["vocab_size"].is_null()) q["vocab_size"] = 1;  // checked against the target instead
  ModelConfig base = ModelConfig::from_json(q, origin);
  c.hidden_size = base.hidden_size;
  c.intermediate_size = base.intermediate_size;
  c.num_layers = base.num_layers;
  c.num_heads = base.num_heads;
  c.num_kv_heads = base.num_kv_heads;
  c.head_dim = base.head_dim;
  c.rms_norm_eps = base.rms_norm_eps;
  c.rope = base.rope_full;
  c.max_position_embeddings = base.max_position_embeddings;
  c.vocab_size = j.contains("vocab_size") && !j["vocab_size"].is_null() ? base.vocab_size : 0;
  KAKEYA_CHECK(base.act == Activation::Silu,
               origin << ": field 'hidden_act' must be silu (the DFlash drafter is a Qwen3 MLP)");
  KAKEYA_CHECK(!base.attention_bias, origin << ": field 'attention_bias' is true; biased drafter projections are not supported");

  // Layer types and window, as HF Qwen3Config reads them (what dflash's torch reference sees).
  auto flag = [&](const char* key, bool fallback) {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    KAKEYA_CHECK(j[key].is_boolean(), origin << ": field '" << key << "' expected true/false, got " << j[key].dump());
    return j[key].get<bool>();
  };
  const bool use_sliding = flag("use_sliding_window", false);
  int64_t window = 4096;  // Qwen3Config's default
  if (j.contains("sliding_window") && !j["sliding_window"].is_null()) {
    KAKEYA_CHECK(j["sliding_window"].is_number_integer() && j["sliding_window"].get<int64_t>() > 0,
                 origin << ": field 'sliding_window' expected a positive integer, got " << j["sliding_window"].dump());
    window = j["sliding_window"].get<int64_t>();
  }
  c.sliding_window = use_sliding ? window : 0;
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const json& lt = j["layer_types"];
    KAKEYA_CHECK(lt.is_array() && (int64_t)lt.size() == c.num_layers,
                 origin << ": field 'layer_types' expected an array of num_hidden_layers=" << c.num_layers
                        << " entries, got " << lt.dump());
    for (size_t i = 0; i < lt.size(); ++i) {
      std::string s = lt[i].is_string() ? lt[i].get<std::string>() : lt[i].dump();
      if (s == "sliding_attention") c.layer_types.push_back(LayerType::Sliding);
      else if (s == "full_attention") c.layer_types.push_back(LayerType::Full);
      else KAKEYA_FAIL(origin << ": field 'layer_types[" << i << "]' is '" << s
                              << "' (expected sliding_attention or full_attention)");
    }
  } else {
    int64_t max_window_layers = 28;  // Qwen3Config's default
    if (j.contains("max_window_layers") && j["max_window_layers"].is_number_integer())
      max_window_layers = j["max_window_layers"].get<int64_t>();
    for (int64_t i = 0; i < c.num_layers; ++i)
      c.layer_types.push_back(use_sliding && i >= max_window_layers ? LayerType::Sliding : LayerType::Full);
  }
  if (j.contains("is_causal") && !j["is_causal"].is_null()) c.is_causal = flag("is_causal", false);

  const json* dcfg = nullptr;
  if (j.contains("dflash_config") && !j["dflash_config"].is_null()) {
    KAKEYA_CHECK(j["dflash_config"].is_object(),
                 origin << ": field 'dflash_config' expected an object, got " << j["dflash_config"].dump());
    dcfg = &j["dflash_config"];
  }
  DFlashFields d{j, dcfg, origin};
  c.block_size = d.integer("block_size").value_or(16);
  KAKEYA_CHECK(c.block_size >= 2, origin << ": field 'block_size' expected >= 2 (one committed token + drafts), got "
                                          << c.block_size);
  if (j.contains("num_target_layers") && !j["num_target_layers"].is_null()) {
    KAKEYA_CHECK(j["num_target_layers"].is_number_integer() && j["num_target_layers"].get<int64_t>() > 0,
                 origin << ": field 'num_target_layers' expected a positive integer, got " << j["num_target_layers"].dump());
    c.num_target_layers = j["num_target_layers"].get<int64_t>();
  }
  std::string where;
  if (const json* ids = d.find("target_layer_ids", &where)) {
    KAKEYA_CHECK(ids->is_array() && !ids->empty(),
                 origin << ": field '" << where << "' expected a non-empty array of layer ids, got " << ids->dump());
    for (size_t i = 0; i < ids->size(); ++i) {
      const json& v = (*ids)[i];
      KAKEYA_CHECK(v.is_number_integer(),
                   origin << ": field '" << where << "[" << i << "]' expected an integer, got " << v.dump());
      int64_t id = v.get<int64_t>();
      KAKEYA_CHECK(id >= 0, origin << ": field '" << where << "[" << i << "]' = " << id << " is negative");
      KAKEYA_CHECK(c.num_target_layers == 0 || id < c.num_target_layers,
                   origin << ": field '" << where << "[" << i << "]' = " << id
                          << " is out of range for num_target_layers=" << c.num_target_layers);
      c.target_layer_ids.push_back(id);
    }
  } else {
    KAKEYA_CHECK(c.num_target_layers > 0, origin << ": neither 'dflash_config.target_layer_ids' nor "
                                                    "'num_target_layers' is given (one is needed to pick target layers)");
    c.target_layer_ids = dflash_target_layer_ids(c.num_target_layers, c.num_layers);
    c.target_layer_ids_derived = true;
  }
  auto mask = d.integer("mask_token_id");
  KAKEYA_CHECK(mask.has_value(), origin << ": missing field 'dflash_config.mask_token_id'");
  KAKEYA_CHECK(*mask >= 0, origin << ": field 'dflash_config.mask_token_id' = " << *mask << " is negative");
  c.mask_token_id = *mask;
  c.input_embedding_scale = d.number("input_embedding_scale").value_or(1.0);
  KAKEYA_CHECK(c.input_embedding_scale > 0,
               origin << ": field 'input_embedding_scale' expected > 0, got " << c.input_embedding_scale);
  c.output_multiplier = d.number("output_multiplier").value_or(1.0);
  KAKEYA_CHECK(c.output_multiplier > 0, origin << ": field 'output_multiplier' expected > 0, got " << c.output_multiplier);
  auto cap = d.number("final_logit_softcapping");
  if (cap && *cap > 0) c.final_logit_softcap = cap;  // dflash: a cap <= 0 means none
  for (LayerType t : c.layer_types)
    if (t == LayerType::Sliding && c.sliding_window == 0 && !flag("use_sliding_window", false) &&
        j.contains("sliding_window") && !j["sliding_window"].is_null()) {
      // HF drops sliding_window when use_sliding_window is false; say so rather than surprise.
      KAKEYA_FAIL(origin << ": layer_types has sliding_attention layers and 'sliding_window' is set, but "
                            "'use_sliding_window' is false, so HF (and dflash) would ignore the window; set "
                            "use_sliding_window to true or drop sliding_window");
    }
  return c;
}

DrafterConfig DrafterConfig::from_file(const std::string& path) {
  return from_json(fs::read_json(path, "a DFlash config.json"), path);
}

json DrafterConfig::to_json() const {
  json lt = json::array();
  bool any_sliding = false;
  for (LayerType t : layer_types) {
    lt.push_back(layer_type_name(t));
    any_sliding |= t == LayerType::Sliding;
  }
  json dflash{{"mask_token_id", mask_token_id},
              {"target_layer_ids", target_layer_ids},
              {"block_size", block_size},
              {"input_embedding_scale", input_embedding_scale},
              {"output_multiplier", output_multiplier}};
  if (final_logit_softcap) dflash["final_logit_softcapping"] = *final_logit_softcap;
  json j{{"architectures", {"DFlashDraftModel"}},
         {"model_type", "qwen3"},
         {"hidden_size", hidden_size},
         {"intermediate_size", intermediate_size},
         {"num_hidden_layers", num_layers},
         {"num_attention_heads", num_heads},
         {"num_key_value_heads", num_kv_heads},
         {"head_dim", head_dim},
         {"hidden_act", "silu"},
         {"attention_bias", false},
         {"attention_dropout", 0.0},
         {"rms_norm_eps", rms_norm_eps},
         {"max_position_embeddings", max_position_embeddings},
         {"tie_word_embeddings", false},
         {"rope_parameters", rope_json(rope)},
         {"layer_types", lt},
         {"use_sliding_window", any_sliding && sliding_window > 0},
         {"sliding_window", any_sliding && sliding_window > 0 ? json(sliding_window) : json(nullptr)},
         {"max_window_layers", num_layers},
         {"block_size", block_size},
         {"dflash_config", dflash},
         {"dtype", "bfloat16"}};
  if (vocab_size > 0) j["vocab_size"] = vocab_size;
  if (num_target_layers > 0) j["num_target_layers"] = num_target_layers;
  if (is_causal) j["is_causal"] = *is_causal;
  return j;
}

DrafterConfig DrafterConfig::for_target(const ModelConfig& t, int64_t num_layers, int64_t num_heads,
                                        int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size,
                                        int64_t block_size, int64_t mask_token_id) {
  DrafterConfig c;
  c.origin = "new drafter for " + t.model_type;
  c.hidden_size = t.hidden_size;
  c.intermediate_size = intermediate_size;
  c.num_layers = num_layers;
  c.num_heads = num_heads;
  c.num_kv_heads = num_kv_heads;
  c.head_dim = head_dim;
  c.rms_norm_eps = t.rms_norm_eps;
  c.rope = t.rope_full;
  c.max_position_embeddings = t.max_position_embeddings;
  c.vocab_size = t.vocab_size;
  c.layer_types.assign(num_layers, LayerType::Full);
  c.block_size = block_size;
  c.num_target_layers = t.num_layers;
  c.target_layer_ids = dflash_target_layer_ids(t.num_layers, num_layers);
  c.mask_token_id = mask_token_id;
  // Gemma scales its embeddings by sqrt(hidden) and softcaps its logits; the
  // drafter reads the raw table and lm_head, so it carries both itself.
  if (t.embed_scale_sqrt_hidden) c.input_embedding_scale = std::sqrt((double)t.hidden_size);
  c.final_logit_softcap = t.final_logit_softcap;
  KAKEYA_CHECK(num_layers > 0 && num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && intermediate_size > 0,
               "new drafter: layer/head/width sizes must be positive");
  KAKEYA_CHECK(num_heads % num_kv_heads == 0,
               "new drafter: heads (" << num_heads << ") must be a multiple of kv heads (" << num_kv_heads << ")");
  KAKEYA_CHECK(block_size >= 2, "new drafter: block size expected >= 2, got " << block_size);
  c.check_target(t);
  return c;
}

void DrafterConfig::check_target(const ModelConfig& t) const {
  KAKEYA_CHECK(hidden_size == t.hidden_size,
               "drafter/target dimension mismatch: " << origin << ": field 'hidden_size' is " << hidden_size
                                                     << ", the target's hidden size is " << t.hidden_size
                                                     << " (the drafter reads the target's embedding and lm_head)");
  KAKEYA_CHECK(vocab_size == 0 || vocab_size == t.vocab_size,
               "drafter/target mismatch: " << origin << ": field 'vocab_size' is " << vocab_size
                                           << ", the target's vocabulary has " << t.vocab_size << " tokens");
  KAKEYA_CHECK(mask_token_id < t.vocab_size,
               origin << ": field 'dflash_config.mask_token_id' = " << mask_token_id
                      << " is outside the target vocabulary [0, " << t.vocab_size << ")");
  KAKEYA_CHECK(num_target_layers == 0 || num_target_layers == t.num_layers,
               "drafter/target mismatch: " << origin << ": field 'num_target_layers' is " << num_target_layers
                                           << ", the target has " << t.num_layers << " layers");
  for (size_t i = 0; i < target_layer_ids.size(); ++i)
    KAKEYA_CHECK(target_layer_ids[i] >= 0 && target_layer_ids[i] < t.num_layers,
                 origin << ": field 'dflash_config.target_layer_ids[" << i << "]' = " << target_layer_ids[i]
                        << (target_layer_ids_derived ? " (derived from num_target_layers)" : "")
                        << " is out of range for a target with " << t.num_layers << " layers [0, "
                        << t.num_layers << ")");
}

// ---------------------------------------------------------------------------
// DrafterCache

DrafterCache::DrafterCache(const DrafterConfig& cfg, int64_t batch, int64_t capacity, at::ScalarType dtype,
                           at::Device device) {
  auto o = at::TensorOptions().dtype(dtype).device(device);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    k_.push_back(at::zeros({batch, cfg.num_kv_heads, capacity, cfg.head_dim}, o));
    v_.push_back(at::zeros({batch, cfg.num_kv_heads, capacity, cfg.head_dim}, o));
  }
}

void DrafterCache::truncate(int64_t n) {
  KAKEYA_CHECK(n >= 0 && n <= length_, "drafter cache: truncate(" << n << ") outside [0, " << length_ << "]");
  length_ = n;  // slots past n are never read (attention slices [.., length))
}

int64_t DrafterCache::bytes() const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) b += (k_[l].numel() + v_[l].numel()) * k_[l].element_size();
  return b;
}

// ---------------------------------------------------------------------------
// TargetFeatureCapture

TargetFeatureCapture::TargetFeatureCapture(const Model& target, std::vector<int64_t> layer_ids)
    : target_(target), ids_(std::move(layer_ids)), got_(ids_.size()) {
  for (int64_t id : ids_)
    KAKEYA_CHECK(id >= 0 && id < target.config().num_layers,
                 "target feature capture: layer " << id << " outside [0, " << target.config().num_layers << ")");
  taps_.subscribe(this);
}

void TargetFeatureCapture::on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) {
  if (tap != Tap::LayerOut) return;
  for (size_t i = 0; i < ids_.size(); ++i)
    if (ids_[i] == ctx.layer) got_[i] = x;  // the forward continues with a new tensor; this one stays intact
}

std::vector<at::Tensor> TargetFeatureCapture::parts() {
  std::vector<at::Tensor> out;
  const int64_t last = target_.config().num_layers - 1;
  for (size_t i = 0; i < ids_.size(); ++i) {
    KAKEYA_CHECK(got_[i].defined(), "target feature capture: no output of layer "
                                        << ids_[i] << " was captured (was the forward run with these taps?)");
    // HF's hidden_states[-1] is the final-normed output, and DFlash indexes hidden_states[id + 1].
    out.push_back(ids_[i] == last ? target_.final_norm(got_[i]) : got_[i]);
    got_[i] = at::Tensor();
  }
  return out;
}

at::Tensor TargetFeatureCapture::take() {
  auto p = parts();
  return p.size() == 1 ? p[0] : at::cat(p, -1);
}

void TargetFeatureCapture::take_into(at::Tensor* out, at::Tensor* ring, const at::Tensor& positions) {
  ops::concat_rows(parts(), out, ring, positions);
}

void TargetFeatureCapture::store_into(at::Tensor ring, at::Tensor ring_rows) {
  KAKEYA_CHECK(!ring.defined() || (ring.dim() == 2 && ring.size(1) == (int64_t)ids_.size() * target_.config().hidden_size),
               "target feature capture: a ring of [R, " << ids_.size() * target_.config().hidden_size << "] expected, got "
                                                         << ring.sizes());
  ring_ = std::move(ring);
  ring_rows_ = std::move(ring_rows);
}

bool TargetFeatureCapture::stores_all() const {
  if (!ring_.defined()) return false;
  for (int64_t id : ids_)
    if (id == target_.config().num_layers - 1) return false;
  return true;
}

bool TargetFeatureCapture::store(Tap tap, int64_t layer, ops::RowCopy* out) const {
  if (tap != Tap::LayerOut || !ring_.defined() || layer == target_.config().num_layers - 1) return false;
  for (size_t i = 0; i < ids_.size(); ++i)
    if (ids_[i] == layer) {
      out->dst = ring_;
      out->col = (int64_t)i * target_.config().hidden_size;
      out->positions = ring_rows_;  // undefined: the forward's positions
      return true;
    }
  return false;
}

void TargetFeatureCapture::clear() {
  for (auto& g : got_) g = at::Tensor();
}

// ---------------------------------------------------------------------------
// Drafter: weights

namespace {

std::vector<std::pair<std::string, std::vector<int64_t>>> expected_tensors(const DrafterConfig& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
  std::vector<std::pair<std::string, std::vector<int64_t>>> e{{"fc.weight", {H, c.num_features() * H}},
                                                               {"hidden_norm.weight", {H}}};
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    e.push_back({p + "self_attn.q_proj.weight", {c.q_dim(), H}});
    e.push_back({p + "self_attn.k_proj.weight", {c.kv_dim(), H}});
    e.push_back({p + "self_attn.v_proj.weight", {c.kv_dim(), H}});
    e.push_back({p + "self_attn.o_proj.weight", {H, c.q_dim()}});
    e.push_back({p + "self_attn.q_norm.weight", {D}});
    e.push_back({p + "self_attn.k_norm.weight", {D}});
    e.push_back({p + "input_layernorm.weight", {H}});
    e.push_back({p + "post_attention_layernorm.weight", {H}});
    e.push_back({p + "mlp.gate_proj.weight", {I, H}});
    e.push_back({p + "mlp.up_proj.weight", {I, H}});
    e.push_back({p + "mlp.down_proj.weight", {H, I}});
  }
  e.push_back({"norm.weight", {H}});
  return e;
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> Drafter::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out{{"fc.weight", fc_}, {"hidden_norm.weight", hidden_norm_}};
  for (size_t l = 0; l < layers_.size(); ++l) {
    const auto& w = layers_[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    out.push_back({p + "self_attn.q_proj.weight", w.q_proj});
    out.push_back({p + "self_attn.k_proj.weight", w.k_proj});
    out.push_back({p + "self_attn.v_proj.weight", w.v_proj});
    out.push_back({p + "self_attn.o_proj.weight", w.o_proj});
    out.push_back({p + "self_attn.q_norm.weight", w.q_norm});
    out.push_back({p + "self_attn.k_norm.weight", w.k_norm});
    out.push_back({p + "input_layernorm.weight", w.input_norm});
    out.push_back({p + "post_attention_layernorm.weight", w.post_norm});
    out.push_back({p + "mlp.gate_proj.weight", w.gate_proj});
    out.push_back({p + "mlp.up_proj.weight", w.up_proj});
    out.push_back({p + "mlp.down_proj.weight", w.down_proj});
  }
  out.push_back({"norm.weight", norm_});
  return out;
}

int64_t Drafter::num_parameters() const {
  int64_t n = 0;
  for (const auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

int64_t Drafter::weight_bytes() const {
  int64_t b = num_parameters() * c10::elementSize(dtype_);  // qkv/gate_up are these tensors' storage
  if (dtype_ != at::kFloat) {
    int64_t norms = hidden_norm32_.numel() + norm32_.numel();
    for (const auto& L : layers_)
      norms += L.q_norm32.numel() + L.k_norm32.numel() + L.input_norm32.numel() + L.post_norm32.numel();
    b += norms * 4;
  }
  if (head_sub_.defined()) b += head_sub_.numel() * head_sub_.element_size() + vocab_ids_.numel() * 8;
  return b;
}

void Drafter::check_shapes(const std::string& origin) const {
  auto exp = expected_tensors(cfg_);
  auto got = named_parameters();
  for (size_t i = 0; i < exp.size(); ++i)
    KAKEYA_CHECK(got[i].second.sizes() == at::IntArrayRef(exp[i].second),
                 origin << ": tensor '" << exp[i].first << "' has shape " << got[i].second.sizes() << ", expected "
                        << at::IntArrayRef(exp[i].second));
}

Drafter Drafter::assemble(const DrafterConfig& cfg, const Model& target, const DrafterOptions& opt,
                          std::map<std::string, at::Tensor>& w) {
  Drafter d;
  d.cfg_ = cfg;
  d.target_ = &target;
  d.dtype_ = opt.dtype.value_or(target.dtype());
  d.device_ = opt.device.value_or(target.device());
  for (auto& [name, t] : w) t = t.to(d.device_, d.dtype_).clone();  // own the memory (never alias a mapped file)
  d.fc_ = w.at("fc.weight");
  d.hidden_norm_ = w.at("hidden_norm.weight");
  d.norm_ = w.at("norm.weight");
  // f32 norm weights for core/kernels/ops.h's kernels: the same tensors on an f32 drafter (so the
  // trainer's updates reach them), copies otherwise (a bf16 drafter is never trained).
  auto f32 = [&](const at::Tensor& t) { return d.dtype_ == at::kFloat ? t : t.to(at::kFloat); };
  d.hidden_norm32_ = f32(d.hidden_norm_);
  d.norm32_ = f32(d.norm_);
  d.qkv_all_ = at::empty({cfg.num_layers, cfg.q_dim() + 2 * cfg.kv_dim(), cfg.hidden_size},
                         at::TensorOptions().dtype(d.dtype_).device(d.device_));
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const int64_t qd = cfg.q_dim(), kd = cfg.kv_dim(), I = cfg.intermediate_size;
    DrafterLayer L;
    L.qkv = d.qkv_all_[l];
    L.qkv.copy_(at::cat({w.at(p + "self_attn.q_proj.weight"), w.at(p + "self_attn.k_proj.weight"),
                         w.at(p + "self_attn.v_proj.weight")}));
    L.q_proj = L.qkv.narrow(0, 0, qd);
    L.k_proj = L.qkv.narrow(0, qd, kd);
    L.v_proj = L.qkv.narrow(0, qd + kd, kd);
    L.kv = L.qkv.narrow(0, qd, 2 * kd);
    L.gate_up = at::cat({w.at(p + "mlp.gate_proj.weight"), w.at(p + "mlp.up_proj.weight")});
    L.gate_proj = L.gate_up.narrow(0, 0, I);
    L.up_proj = L.gate_up.narrow(0, I, I);
    L.o_proj = w.at(p + "self_attn.o_proj.weight");
    L.q_norm = w.at(p + "self_attn.q_norm.weight");
    L.k_norm = w.at(p + "self_attn.k_norm.weight");
    L.input_norm = w.at(p + "input_layernorm.weight");
    L.post_norm = w.at(p + "post_attention_layernorm.weight");
    L.down_proj = w.at(p + "mlp.down_proj.weight");
    L.q_norm32 = f32(L.q_norm);
    L.k_norm32 = f32(L.k_norm);
    L.input_norm32 = f32(L.input_norm);
    L.post_norm32 = f32(L.post_norm);
    d.layers_.push_back(std::move(L));
  }
  const int64_t maxpos = opt.max_positions > 0 ? opt.max_positions : target.options().max_positions;
  d.rope_ = RopeTable(cfg.rope, cfg.head_dim, maxpos, d.dtype_, d.device_);
  d.check_shapes(cfg.origin);
  return d;
}

Drafter Drafter::load(const std::string& dir, const Model& target, const DrafterOptions& opt) {
  KAKEYA_CHECK(fs::is_directory(dir), dir << ": drafter directory not found");
  DrafterConfig cfg = DrafterConfig::from_file(dir + "/config.json");
  cfg.check_target(target.config());
  TensorStore st = TensorStore::open_dir(dir);
  std::string pre = st.has("fc.weight") ? "" : st.has("model.fc.weight") ? "model." : "";
  // Nothing in the file may go unused: a tensor we do not know is a layout we do not implement.
  std::set<std::string> known;
  for (const auto& [name, shape] : expected_tensors(cfg)) known.insert(pre + name);
  for (const auto& name : st.names())
    KAKEYA_CHECK(known.count(name) || name.find("rotary_emb.inv_freq") != std::string::npos,
                 st.file_of(name) << ": tensor '" << name << "' is not part of a DFlashDraftModel with this config");
  if (st.has(pre + "fc.weight")) {
    at::Tensor fc = st.get(pre + "fc.weight");
    KAKEYA_CHECK(fc.dim() == 2 && fc.size(1) == cfg.num_features() * target.config().hidden_size,
                 "drafter/target dimension mismatch: " << st.file_of(pre + "fc.weight") << ": tensor 'fc.weight' has "
                     << (fc.dim() == 2 ? fc.size(1) : -1) << " inputs, expected " << cfg.num_features()
                     << " target layers × target hidden " << target.config().hidden_size << " = "
                     << cfg.num_features() * target.config().hidden_size);
  }
  std::map<std::string, at::Tensor> w;
  for (const auto& [name, shape] : expected_tensors(cfg)) w[name] = st.get(pre + name, shape);
  Drafter d = assemble(cfg, target, opt, w);
  const std::string vocab = dir + "/" + kDraftVocabFile;
  if (opt.draft_vocab && fs::exists(vocab)) {
    TensorStore vs = TensorStore::open_file(vocab);
    KAKEYA_CHECK(vs.has("ids"), vocab << ": missing tensor 'ids' (the draft vocabulary, [K] int64)");
    d.set_draft_vocab(vs.get("ids"), vocab);
  }
  return d;
}

void Drafter::set_draft_vocab(const at::Tensor& ids_in, const std::string& origin) {
  if (!ids_in.defined()) {
    vocab_ids_ = head_sub_ = at::Tensor();
    return;
  }
  const int64_t V = target_->lm_head().size(0);
  KAKEYA_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong && ids_in.numel() > 0,
               origin << ": tensor 'ids' must be [K] int64 with K > 0, got " << ids_in.sizes() << " "
                      << c10::toString(ids_in.scalar_type()));
  at::Tensor ids = ids_in.to(at::kCPU);
  const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
  KAKEYA_CHECK(lo >= 0 && hi < V, origin << ": tensor 'ids' holds token ids in [" << lo << ", " << hi
                                         << "], expected [0, " << V << ") (the target's vocabulary)");
  KAKEYA_CHECK(std::get<0>(at::_unique(ids)).numel() == ids.numel(), origin << ": tensor 'ids' repeats token ids");
  // On the head's device: draft_tokens maps the head's argmax through it.
  vocab_ids_ = ids.to(target_->lm_head().device());
  head_sub_ = target_->lm_head().index_select(0, vocab_ids_).contiguous();
}

Drafter Drafter::random(const DrafterConfig& cfg, const Model& target, uint64_t seed, const DrafterOptions& opt) {
  cfg.check_target(target.config());
  // Drawn on the CPU from one seeded generator, so a seed means the same drafter on every device.
  at::Generator gen = at::detail::createCPUGenerator(seed);
  std::map<std::string, at::Tensor> w;
  for (const auto& [name, shape] : expected_tensors(cfg))
    w[name] = name.find("norm") != std::string::npos ? at::ones(shape, at::kFloat)
                                                     : at::normal(0.0, 0.02, shape, gen, at::kFloat);
  return assemble(cfg, target, opt, w);
}

void Drafter::save(const std::string& dir, at::ScalarType dtype, const std::map<std::string, std::string>& metadata) const {
  fs::make_dirs(dir);
  std::map<std::string, at::Tensor> t;
  for (const auto& [name, w] : named_parameters()) t[name] = w.detach().to(at::kCPU, dtype).contiguous();
  auto md = metadata;
  md["format"] = "pt";  // transformers' from_pretrained expects it
  // Weights first, config last: a directory with a config always has its weights.
  save_safetensors(dir + "/model.safetensors", t, md);
  if (vocab_ids_.defined()) save_safetensors(dir + "/" + kDraftVocabFile, {{"ids", vocab_ids_.to(at::kCPU)}}, {});
  json cfg = cfg_.to_json();
  cfg["dtype"] = dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : "float32";
  fs::write_atomic(dir + "/config.json", cfg.dump(2) + "\n");
}

// ---------------------------------------------------------------------------
// Drafter: math

at::Tensor Drafter::rms_norm(const at::Tensor& x, const at::Tensor& w) const {
  // Qwen3RMSNorm: normalise in f32, cast back, then scale in the compute dtype.
  auto xf = x.to(at::kFloat);
  auto n = xf * at::rsqrt(xf.pow(2).mean(-1, true) + cfg_.rms_norm_eps);
  return w * n.to(x.scalar_type());
}

bool Drafter::kernels() const {
  // The kernels have no autograd: a drafter in training (parameters requiring grad) runs the reference.
  // norm_ trains in every mode (train-drafter --freeze-context keeps fc frozen, so fc cannot tell).
  return device_.is_cuda() && ops::cuda_kernels_available() && (dtype_ == at::kFloat || dtype_ == at::kBFloat16) &&
         !norm_.requires_grad();
}

at::Tensor Drafter::norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w32) const {
  if (!kernels()) return rms_norm(x, w);
  ops::NormSpec ns;
  ns.eps = cfg_.rms_norm_eps;
  ns.unit_offset = false;  // cast x̂ to the dtype, then × w there: Qwen3RMSNorm
  return ops::rms_norm(x, w32, ns);
}

at::Tensor Drafter::project_context(const at::Tensor& target_hidden) const {
  KAKEYA_CHECK(target_hidden.size(-1) == fc_.size(1),
               "drafter: context features have " << target_hidden.size(-1) << " channels, fc expects " << fc_.size(1));
  return norm(at::linear(target_hidden.to(dtype_), fc_), hidden_norm_, hidden_norm32_);
}

at::Tensor Drafter::embed(const at::Tensor& ids) const {
  // dflash: F.embedding(ids, target.embed_tokens.weight) * input_embedding_scale, in the table's dtype.
  at::Tensor e = at::embedding(target_->embedding(), ids);
  if (cfg_.input_embedding_scale != 1.0) e = e * cfg_.input_embedding_scale;
  return e.to(dtype_);
}

namespace {

// RoPE with positions shared by the batch ([T]) or per sequence ([B, T]).
at::Tensor rope_at(const RopeTable& rope, const at::Tensor& x, const at::Tensor& pos) {
  if (pos.dim() == 1) return rope.apply(x, pos);
  const int64_t B = x.size(0), T = x.size(1);
  return rope.apply(x.reshape({1, B * T, x.size(2), x.size(3)}), pos.reshape({B * T})).view(x.sizes());
}

}  // namespace

std::vector<std::pair<at::Tensor, at::Tensor>> Drafter::context_raw_kv(const at::Tensor& c, const at::Tensor& positions,
                                                                       const Taps* taps) const {
  const int64_t B = c.size(0), T = c.size(1), Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  if (taps && taps->empty()) taps = nullptr;
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    const auto& w = layers_[l];
    // The context enters every layer's K/V directly (no input_layernorm): dflash's k_proj(target_hidden).
    at::Tensor k = at::linear(c, w.k_proj).view({B, T, Hkv, D});  // [B, T, H_kv, D]
    at::Tensor v = at::linear(c, w.v_proj).view({B, T, Hkv, D});  // [B, T, H_kv, D]
    if (taps) {
      TapContext ctx{l, cfg_.layer_types[l], positions};
      taps->cb(Tap::KProj, ctx, k);
      taps->cb(Tap::VProj, ctx, v);
    }
    out.push_back({k, v});
  }
  return out;
}

std::pair<at::Tensor, at::Tensor> Drafter::context_raw_kv_rows(const at::Tensor& c) const {
  const int64_t B = c.size(0), T = c.size(1), L = cfg_.num_layers, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
  const int64_t qd = cfg_.q_dim(), kd = cfg_.kv_dim();
  at::Tensor all = at::linear(c, qkv_all_.view({L * (qd + 2 * kd), qkv_all_.size(2)}))  // [B, T, L·(qd + 2kd)]
                       .view({B, T, L, qd + 2 * kd});
  return {all.narrow(3, qd, kd).view({B, T, L, Hkv, D}), all.narrow(3, qd + kd, kd).view({B, T, L, Hkv, D})};
}

std::vector<std::pair<at::Tensor, at::Tensor>> Drafter::context_kv(const at::Tensor& c, const at::Tensor& positions,
                                                                   const Taps* taps) const {
  auto out = context_raw_kv(c, positions, taps);
  if (taps && taps->empty()) taps = nullptr;
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    auto& [k, v] = out[l];
    TapContext ctx{l, cfg_.layer_types[l], positions};
    auto tap = [&](Tap t, at::Tensor& x) { if (taps) taps->cb(t, ctx, x); };
    at::Tensor kn = rms_norm(k, layers_[l].k_norm);
    tap(Tap::KNorm, kn);
    tap(Tap::VNorm, v);
    k = rope_at(rope_, kn, positions).transpose(1, 2);
    v = v.transpose(1, 2);
  }
  return out;
}

ops::QKRopeArgs Drafter::rope_args(int64_t num_heads) const {
  ops::QKRopeArgs a;
  a.num_heads = num_heads;
  a.num_kv_heads = cfg_.num_kv_heads;
  a.head_dim = cfg_.head_dim;
  a.norm.eps = cfg_.rms_norm_eps;  // unit_offset false: Qwen3RMSNorm
  a.cos = rope_.cos();
  a.sin = rope_.sin();
  return a;
}

void Drafter::store_context(const at::Tensor& c, const at::Tensor& positions, std::vector<at::Tensor>& k_cache,
                            std::vector<at::Tensor>& v_cache, const Taps* taps) const {
  if (taps && taps->empty()) taps = nullptr;
  const bool fast = kernels() && c.size(0) == 1 &&
                    !(taps && (taps->reads(Tap::KNorm) || taps->reads(Tap::VNorm)));  // the kernel never materialises k_norm(k)
  if (!fast) {
    auto kv = context_kv(c, positions, taps);
    for (int64_t l = 0; l < cfg_.num_layers; ++l) {
      k_cache[l].index_copy_(2, positions, kv[l].first);
      v_cache[l].index_copy_(2, positions, kv[l].second);
    }
    return;
  }
  const int64_t T = c.size(1), Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
  ops::QKRopeArgs a = rope_args(0);  // K/V only: the context has no queries
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    const auto& w = layers_[l];
    at::Tensor kv = at::linear(c, w.kv);  // [1, T, 2·H_kv·D]: k | v, one GEMM
    if (taps) {
      TapContext ctx{l, cfg_.layer_types[l], positions};
      auto tap = [&](Tap t, int64_t h0) {
        at::Tensor x = kv.view({1, T, 2 * Hkv, D}).narrow(2, h0, Hkv);  // [1, T, H_kv, D]
        at::Tensor mine = x;
        taps->cb(t, ctx, x);
        if (!x.is_same(mine)) mine.copy_(x);  // a subscriber replaced it: the kernel reads kv
      };
      tap(Tap::KProj, 0);
      tap(Tap::VProj, Hkv);
    }
    a.k_norm = w.k_norm32;
    ops::qk_norm_rope_store(kv, positions, a, k_cache[l], v_cache[l]);
  }
}

at::Tensor Drafter::layer_mask(int64_t layer, const at::Tensor& q_pos, const at::Tensor& k_pos) const {
  auto qp = q_pos.unsqueeze(-1);  // [..., T, 1]
  auto kp = k_pos.unsqueeze(-2);  // [..., 1, S]
  const bool causal = cfg_.causal(layer);
  const int64_t W = cfg_.window(layer);
  // dflash._attention_mask on absolute positions (its cache index is the position).
  at::Tensor m = causal ? kp.le(qp) : at::ones_like(kp.le(qp));
  if (W > 0) {
    m = m.logical_and((qp - kp).lt(W));
    if (!causal) m = m.logical_and((kp - qp).lt(W));
  }
  return m;
}

at::Tensor Drafter::attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& mask) const {
  // q: [B, T, Hq, D]; k, v: [B, H_kv, S, D]; mask: undefined, [T, S] or [B, T, S] bool.
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.size(1), G = Hq / Hkv;
  // Fold each GQA group into the query axis (q head h reads kv head h / G, as HF's repeat_kv).
  auto qg = q.permute({0, 2, 1, 3}).reshape({B, Hkv, G * T, D});  // row g·T + t
  at::Tensor m;
  if (mask.defined()) {
    if (mask.dim() == 2) m = G == 1 ? mask : mask.repeat({G, 1});  // [G·T, S]
    else m = (G == 1 ? mask : mask.repeat({1, G, 1})).unsqueeze(1);  // [B, 1, G·T, S]
  }
  std::optional<at::Tensor> om;
  if (m.defined()) om = m;
  auto out = at::scaled_dot_product_attention(qg, k, v, om, 0.0, false, 1.0 / std::sqrt((double)D));
  return out.reshape({B, Hq, T, D}).permute({0, 2, 1, 3}).reshape({B, T, Hq * D});
}

at::Tensor Drafter::forward_block(const at::Tensor& x, const at::Tensor& q_pos, const std::vector<at::Tensor>& ctx_k,
                                  const std::vector<at::Tensor>& ctx_v, const std::vector<at::Tensor>& masks) const {
  const int64_t B = x.size(0), T = x.size(1), Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
  at::Tensor h = x;  // [B, T, H]
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    const auto& w = layers_[l];
    at::Tensor xn = rms_norm(h, w.input_norm);
    at::Tensor q = rope_at(rope_, rms_norm(at::linear(xn, w.q_proj).view({B, T, Hq, D}), w.q_norm), q_pos);
    at::Tensor k = rope_at(rope_, rms_norm(at::linear(xn, w.k_proj).view({B, T, Hkv, D}), w.k_norm), q_pos);
    at::Tensor v = at::linear(xn, w.v_proj).view({B, T, Hkv, D});
    // Keys/values: the committed context, then the block itself.
    at::Tensor K = at::cat({ctx_k[l], k.transpose(1, 2)}, 2);  // [B, H_kv, C + T, D]
    at::Tensor V = at::cat({ctx_v[l], v.transpose(1, 2)}, 2);
    h = h + at::linear(attention(q, K, V, masks[l]), w.o_proj);
    xn = rms_norm(h, w.post_norm);
    h = h + at::linear(at::silu(at::linear(xn, w.gate_proj)) * at::linear(xn, w.up_proj), w.down_proj);
  }
  return rms_norm(h, norm_);
}

bool Drafter::block_in_cache_supported() const {
  if (!kernels()) return false;
  const int64_t D = cfg_.head_dim;
  if (D != 64 && D != 128 && D != 256 && D != 512) return false;  // ops::decode_attention's head dims
  for (int64_t l = 0; l < cfg_.num_layers; ++l)
    if (cfg_.causal(l) || cfg_.window(l) > 0) return false;  // one shared visibility bound per block
  return true;
}

at::Tensor Drafter::forward_block_in_cache(const at::Tensor& x, const at::Tensor& q_pos, const at::Tensor& last_pos,
                                           std::vector<at::Tensor>& ctx_k, std::vector<at::Tensor>& ctx_v,
                                           const at::Tensor& slot_pos) const {
  KAKEYA_CHECK(block_in_cache_supported(),
               "drafter: the in-cache block forward needs a CUDA f32/bf16 drafter with full non-causal layers ("
                   << cfg_.origin << ")");
  KAKEYA_CHECK(x.size(0) == 1, "drafter: the in-cache block forward takes one sequence, got " << x.size(0));
  ops::QKRopeArgs a = rope_args(cfg_.num_heads);
  const ops::NormSpec& ns = a.norm;
  const double scale = 1.0 / std::sqrt((double)cfg_.head_dim);
  // Each layer's weights a layer ahead (ops::L2Prefetch).
  ops::L2Prefetch prefetch(x, x.size(1));
  auto prefetch_layer = [&](int64_t l) {
    if (l < cfg_.num_layers) prefetch.ahead({layers_[l].qkv, layers_[l].o_proj, layers_[l].gate_up, layers_[l].down_proj});
  };
  prefetch_layer(0);
  at::Tensor h = x;                                                     // [1, T, H]
  at::Tensor xn = ops::rms_norm(h, layers_[0].input_norm32, ns);        // [1, T, H]
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    prefetch_layer(l + 1);
    const auto& w = layers_[l];
    a.q_norm = w.q_norm32;
    a.k_norm = w.k_norm32;
    // The block's K/V go to their own slots (slot = position), so attention reads
    // context and block from one cache with one bound: every slot <= last_pos.
    at::Tensor q = ops::qk_norm_rope_store(ops::linear(xn, w.qkv), q_pos, a, ctx_k[l], ctx_v[l]);  // [1, T, Hq, D]
    at::Tensor o = ops::linear(ops::decode_attention(q, ctx_k[l], ctx_v[l], slot_pos, last_pos, 0, scale, 0.0),
                               w.o_proj);                                // [1, T, H]
    std::tie(h, xn) = ops::add_rms_norm(h, o, at::Tensor(), w.post_norm32, ns);
    at::Tensor m = ops::linear(ops::linear_act_mul(xn, w.gate_up, at::Tensor(), false), w.down_proj);  // [1, T, H]
    const at::Tensor& next = l + 1 < cfg_.num_layers ? layers_[l + 1].input_norm32 : norm32_;
    std::tie(h, xn) = ops::add_rms_norm(h, m, at::Tensor(), next, ns);
  }
  return xn;  // the final norm's output
}

at::Tensor Drafter::draft_tokens(const at::Tensor& hidden) const {
  at::Tensor out = at::empty(hidden.sizes().slice(0, hidden.dim() - 1), hidden.options().dtype(at::kLong));
  draft_tokens_into(hidden, out);
  return out;
}

void Drafter::draft_tokens_into(const at::Tensor& hidden, at::Tensor& out) const {
  // The multiplier (> 0, checked at load) and the softcap are monotone: the argmax of the
  // head's raw scores is logits()'s (up to rounding ties), without its passes over [T, V].
  const at::Tensor& head = head_sub_.defined() ? head_sub_ : target_->lm_head();  // [K or V, H]
  at::Tensor scores = at::linear(hidden.to(head.scalar_type()), head);            // [B, T, K or V]
  ops::argmax_rows(scores, vocab_ids_, out);  // vocab_ids_ undefined: the whole vocabulary
}

at::Tensor Drafter::logits(const at::Tensor& hidden) const {
  // dflash compute_logits: output head, × output_multiplier, softcap — in the head's dtype.
  const at::Tensor& head = target_->lm_head();
  at::Tensor lg = at::linear(hidden.to(head.scalar_type()), head);
  if (cfg_.output_multiplier != 1.0) lg = lg * cfg_.output_multiplier;
  if (cfg_.final_logit_softcap) {
    const double c = *cfg_.final_logit_softcap;
    lg = at::tanh(lg / c) * c;
  }
  return lg.to(at::kFloat);
}

// ---------------------------------------------------------------------------
// Drafter: decoding

DrafterCache Drafter::make_cache(int64_t capacity, int64_t batch) const {
  KAKEYA_CHECK(capacity <= rope_.max_positions(),
               "drafter: cache capacity " << capacity << " exceeds the RoPE table (" << rope_.max_positions() << ")");
  return DrafterCache(cfg_, batch, capacity, dtype_, device_);
}

void Drafter::extend(DrafterCache& cache, const at::Tensor& target_hidden, const Taps* taps) const {
  const int64_t s = cache.length_, n = target_hidden.size(1);
  KAKEYA_CHECK(s + n <= cache.capacity(),
               "drafter cache: " << s << " + " << n << " positions exceed its capacity " << cache.capacity());
  auto pos = at::arange(s, s + n, at::TensorOptions().dtype(at::kLong).device(device_));
  store_context(project_context(target_hidden), pos, cache.k_, cache.v_, taps);
  cache.length_ += n;
}

at::Tensor Drafter::draft(const DrafterCache& cache, const at::Tensor& block_ids) const {
  const int64_t s = cache.length_, T = block_ids.size(1);
  KAKEYA_CHECK(T >= 2, "drafter: a block needs the committed token and at least one mask, got " << T << " tokens");
  KAKEYA_CHECK(s + T <= rope_.max_positions(),
               "drafter: block ends at position " << s + T << ", past the RoPE table (" << rope_.max_positions() << ")");
  auto iopt = at::TensorOptions().dtype(at::kLong).device(device_);
  auto q_pos = at::arange(s, s + T, iopt);  // [T]
  std::vector<at::Tensor> ks, vs, masks;
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    const int64_t W = cfg_.window(l);
    // A window hides context older than s - W + 1 from every query of the block: skip reading it.
    const int64_t c0 = W > 0 ? std::max<int64_t>(0, s - W + 1) : 0;
    ks.push_back(cache.k_[l].slice(2, c0, s));
    vs.push_back(cache.v_[l].slice(2, c0, s));
    if (!cfg_.causal(l) && W == 0) masks.push_back(at::Tensor());  // everything visible: no mask
    else masks.push_back(layer_mask(l, q_pos, at::cat({at::arange(c0, s, iopt), q_pos})));
  }
  at::Tensor h = forward_block(embed(block_ids), q_pos, ks, vs, masks);  // [B, T, H]
  return logits(h.slice(1, 1));
}

}  // namespace kakeya
