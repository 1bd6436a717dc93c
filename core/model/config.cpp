#include "core/model/config.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/io/fs.h"

namespace kakeya {
using json = nlohmann::json;

const char* family_name(Family f) {
  switch (f) {
    case Family::Gemma3: return "gemma3_text";
    case Family::Gemma4: return "gemma4_text";
    case Family::Qwen3: return "qwen3";
    case Family::Llama: return "llama";
  }
  return "?";
}

const char* layer_type_name(LayerType t) { return t == LayerType::Sliding ? "sliding_attention" : "full_attention"; }

namespace {

// Field readers: every error names the file, the field and what was expected.
struct Reader {
  const json& j;
  std::string origin;

  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }

  int64_t integer(const char* key) const {
    KAKEYA_CHECK(has(key), origin << ": missing field '" << key << "' (expected an integer)");
    const json& v = j.at(key);
    KAKEYA_CHECK(v.is_number_integer(), origin << ": field '" << key << "' expected an integer, got " << v.dump());
    return v.get<int64_t>();
  }
  int64_t positive(const char* key) const {
    int64_t v = integer(key);
    KAKEYA_CHECK(v > 0, origin << ": field '" << key << "' expected > 0, got " << v);
    return v;
  }
  int64_t positive_or(const char* key, int64_t fallback) const { return has(key) ? positive(key) : fallback; }
  double number(const json& v, const std::string& key) const {
    KAKEYA_CHECK(v.is_number(), origin << ": field '" << key << "' expected a number, got " << v.dump());
    double d = v.get<double>();
    KAKEYA_CHECK(std::isfinite(d), origin << ": field '" << key << "' is not finite");
    return d;
  }
  double number_or(const char* key, double fallback) const { return has(key) ? number(j.at(key), key) : fallback; }
  std::optional<double> optional_number(const char* key) const {
    if (!has(key)) return std::nullopt;
    return number(j.at(key), key);
  }
  bool boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    KAKEYA_CHECK(j.at(key).is_boolean(), origin << ": field '" << key << "' expected true/false, got " << j.at(key).dump());
    return j.at(key).get<bool>();
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    KAKEYA_CHECK(j.at(key).is_string(), origin << ": field '" << key << "' expected a string, got " << j.at(key).dump());
    return j.at(key).get<std::string>();
  }
};

RopeParams parse_rope(const Reader& r, const json& p, const std::string& where) {
  KAKEYA_CHECK(p.is_object(), r.origin << ": field '" << where << "' expected an object, got " << p.dump());
  RopeParams rp;
  if (p.contains("rope_type") && !p["rope_type"].is_null()) rp.type = p["rope_type"].get<std::string>();
  else if (p.contains("type") && !p["type"].is_null()) rp.type = p["type"].get<std::string>();
  if (p.contains("rope_theta")) rp.theta = r.number(p["rope_theta"], where + ".rope_theta");
  if (p.contains("factor")) rp.factor = r.number(p["factor"], where + ".factor");
  if (p.contains("low_freq_factor")) rp.low_freq_factor = r.number(p["low_freq_factor"], where + ".low_freq_factor");
  if (p.contains("high_freq_factor")) rp.high_freq_factor = r.number(p["high_freq_factor"], where + ".high_freq_factor");
  if (p.contains("original_max_position_embeddings")) {
    // A count of positions: checked before the cast (a double past int64's range does not convert).
    const double n = r.number(p["original_max_position_embeddings"], where + ".original_max_position_embeddings");
    KAKEYA_CHECK(n >= 1 && n <= 1e15, r.origin << ": field '" << where << ".original_max_position_embeddings' expected "
                                                << "a position count in 1 .. 1e15, got " << n);
    rp.original_max_position = (int64_t)n;
  }
  if (p.contains("partial_rotary_factor"))
    rp.partial_rotary_factor = r.number(p["partial_rotary_factor"], where + ".partial_rotary_factor");
  KAKEYA_CHECK(rp.type == "default" || rp.type == "linear" || rp.type == "llama3" || rp.type == "proportional",
               r.origin << ": field '" << where << ".rope_type' is '" << rp.type
                        << "' (supported: default, linear, llama3, proportional)");
  KAKEYA_CHECK(rp.theta > 0, r.origin << ": field '" << where << ".rope_theta' expected > 0, got " << rp.theta);
  KAKEYA_CHECK(rp.factor > 0, r.origin << ": field '" << where << ".factor' expected > 0, got " << rp.factor);
  KAKEYA_CHECK(rp.partial_rotary_factor > 0 && rp.partial_rotary_factor <= 1,
               r.origin << ": field '" << where << ".partial_rotary_factor' expected in (0, 1], got " << rp.partial_rotary_factor);
  return rp;
}

// transformers 5.x: "rope_parameters" = {rope_type, rope_theta, ...} or, for
// families with per-layer-type RoPE, {"sliding_attention": {...}, "full_attention": {...}}.
// transformers 4.x: "rope_theta" (+ "rope_local_base_freq" on Gemma 3) and "rope_scaling".
void parse_rope_fields(const Reader& r, ModelConfig& c, double legacy_local_theta) {
  if (r.has("rope_parameters")) {
    const json& p = r.j.at("rope_parameters");
    if (p.contains("full_attention") || p.contains("sliding_attention")) {
      KAKEYA_CHECK(p.contains("full_attention"), r.origin << ": field 'rope_parameters.full_attention' missing");
      c.rope_full = parse_rope(r, p["full_attention"], "rope_parameters.full_attention");
      c.rope_sliding = p.contains("sliding_attention") ? parse_rope(r, p["sliding_attention"], "rope_parameters.sliding_attention")
                                                        : c.rope_full;
    } else {
      c.rope_full = c.rope_sliding = parse_rope(r, p, "rope_parameters");
    }
    return;
  }
  c.rope_full.theta = r.number_or("rope_theta", 10000.0);
  if (r.has("rope_scaling")) {
    RopeParams s = parse_rope(r, r.j.at("rope_scaling"), "rope_scaling");
    s.theta = c.rope_full.theta;
    c.rope_full = s;
  }
  c.rope_sliding = c.rope_full;
  if (legacy_local_theta > 0) {
    // Gemma 3 (4.x layout): sliding layers use plain RoPE with rope_local_base_freq.
    c.rope_sliding = RopeParams{};
    c.rope_sliding.theta = r.number_or("rope_local_base_freq", legacy_local_theta);
  }
}

std::vector<LayerType> parse_layer_types(const Reader& r, int64_t n, const std::vector<LayerType>& fallback) {
  if (!r.has("layer_types")) return fallback;
  const json& lt = r.j.at("layer_types");
  KAKEYA_CHECK(lt.is_array() && (int64_t)lt.size() == n,
               r.origin << ": field 'layer_types' expected an array of num_hidden_layers=" << n << " entries, got "
                        << (lt.is_array() ? std::to_string(lt.size()) + " entries" : lt.dump()));
  std::vector<LayerType> out;
  for (size_t i = 0; i < lt.size(); ++i) {
    std::string s = lt[i].is_string() ? lt[i].get<std::string>() : lt[i].dump();
    if (s == "sliding_attention") out.push_back(LayerType::Sliding);
    else if (s == "full_attention") out.push_back(LayerType::Full);
    else KAKEYA_FAIL(r.origin << ": field 'layer_types[" << i << "]' is '" << s << "' (expected sliding_attention or full_attention)");
  }
  return out;
}

void parse_common(const Reader& r, ModelConfig& c) {
  c.vocab_size = r.positive("vocab_size");
  c.hidden_size = r.positive("hidden_size");
  c.intermediate_size = r.positive("intermediate_size");
  c.num_layers = r.positive("num_hidden_layers");
  c.num_heads = r.positive("num_attention_heads");
  c.num_kv_heads = r.positive_or("num_key_value_heads", c.num_heads);
  // Without head_dim, HF derives it as hidden_size / num_attention_heads: it must divide exactly
  // (a fuzzed config with 48 / 54 gave head_dim 0).
  KAKEYA_CHECK(r.has("head_dim") || c.hidden_size % c.num_heads == 0,
               r.origin << ": no 'head_dim', and hidden_size=" << c.hidden_size << " is not a multiple of num_attention_heads="
                        << c.num_heads << " (expected head_dim or hidden_size = heads · head_dim)");
  c.head_dim = r.positive_or("head_dim", c.hidden_size / c.num_heads);
  c.rms_norm_eps = r.number_or("rms_norm_eps", 1e-6);
  c.max_position_embeddings = r.positive_or("max_position_embeddings", 8192);
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", false);
  c.attention_bias = r.boolean_or("attention_bias", false);
  c.mlp_bias = r.boolean_or("mlp_bias", false);
  KAKEYA_CHECK(c.num_heads % c.num_kv_heads == 0, r.origin << ": num_attention_heads=" << c.num_heads
                                                            << " must be a multiple of num_key_value_heads=" << c.num_kv_heads);
  KAKEYA_CHECK(c.rms_norm_eps > 0, r.origin << ": field 'rms_norm_eps' expected > 0");
  if (r.has("bos_token_id") && r.j.at("bos_token_id").is_number_integer()) c.bos_token_id = r.integer("bos_token_id");
  if (r.has("eos_token_id")) {
    const json& e = r.j.at("eos_token_id");
    if (e.is_number_integer()) c.eos_token_ids = {e.get<int64_t>()};
    else if (e.is_array())
      for (const auto& x : e) {
        KAKEYA_CHECK(x.is_number_integer(), r.origin << ": field 'eos_token_id' expected integers, got " << e.dump());
        c.eos_token_ids.push_back(x.get<int64_t>());
      }
    else KAKEYA_FAIL(r.origin << ": field 'eos_token_id' expected an integer or array, got " << e.dump());
  }
  std::string act = r.string_or("hidden_activation", r.string_or("hidden_act", "silu"));
  if (act == "gelu_pytorch_tanh" || act == "gelu_tanh") c.act = Activation::GeluTanh;
  else if (act == "silu" || act == "swish") c.act = Activation::Silu;
  else KAKEYA_FAIL(r.origin << ": field 'hidden_activation' is '" << act << "' (supported: gelu_pytorch_tanh, silu)");
}

void parse_gemma3(const Reader& r, ModelConfig& c) {
  parse_common(r, c);
  c.norm_unit_offset = c.norm_f32 = c.sandwich_norm = c.qk_norm = c.embed_scale_sqrt_hidden = true;
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", true);
  c.sliding_window = r.positive_or("sliding_window", 4096);
  int64_t pattern = r.positive_or("sliding_window_pattern", r.positive_or("_sliding_window_pattern", 6));
  std::vector<LayerType> fallback;
  for (int64_t i = 0; i < c.num_layers; ++i)
    fallback.push_back((i + 1) % pattern == 0 ? LayerType::Full : LayerType::Sliding);
  c.layer_types = parse_layer_types(r, c.num_layers, fallback);
  parse_rope_fields(r, c, 10000.0);
  c.attn_scale = 1.0 / std::sqrt(r.number_or("query_pre_attn_scalar", (double)c.head_dim));
  c.attn_logit_softcap = r.optional_number("attn_logit_softcapping");
  c.final_logit_softcap = r.optional_number("final_logit_softcapping");
  KAKEYA_CHECK(!r.boolean_or("use_bidirectional_attention", false),
               r.origin << ": field 'use_bidirectional_attention' is true; only causal decoders are supported");
}

// Gemma 4 RoPE: one entry per layer type (transformers 5.x has no legacy layout
// for this family). Absent: transformers' defaults.
void parse_gemma4_rope(const Reader& r, ModelConfig& c) {
  c.rope_sliding = RopeParams{};  // default, theta 1e4
  c.rope_full = RopeParams{};
  c.rope_full.type = "proportional";
  c.rope_full.theta = 1e6;
  c.rope_full.partial_rotary_factor = 0.25;
  if (!r.has("rope_parameters")) return;
  const json& p = r.j.at("rope_parameters");
  KAKEYA_CHECK(p.is_object() && (p.contains("full_attention") || p.contains("sliding_attention")),
               r.origin << ": field 'rope_parameters' expected an object with 'sliding_attention' and 'full_attention'"
                        << " entries (Gemma 4 has RoPE per layer type), got " << p.dump());
  for (LayerType t : {LayerType::Sliding, LayerType::Full}) {
    const std::string name = layer_type_name(t);
    bool used = false;
    for (LayerType u : c.layer_types) used |= u == t;
    if (!used) continue;
    KAKEYA_CHECK(p.contains(name) && !p[name].is_null(),
                 r.origin << ": field 'rope_parameters." << name << "' missing (the config has " << name << " layers)");
    RopeParams rp = parse_rope(r, p[name], "rope_parameters." + name);
    KAKEYA_CHECK(rp.type == "default" || rp.type == "proportional",
                 r.origin << ": field 'rope_parameters." << name << ".rope_type' is '" << rp.type
                          << "': Gemma 4 RoPE types other than default and proportional are not supported yet");
    (t == LayerType::Sliding ? c.rope_sliding : c.rope_full) = rp;
  }
}

// Gemma 4 per-layer head dim / KV heads. transformers 5.x writes the layers that
// differ from the globals as "per_layer_config": {"<layer>": {"head_dim": .., "num_key_value_heads": ..}};
// Google's checkpoints give "global_head_dim" (default 512) and, with
// attention_k_eq_v, "num_global_key_value_heads" for the full-attention layers.
void parse_gemma4_layer_dims(const Reader& r, ModelConfig& c) {
  c.layer_head_dim.assign(c.num_layers, c.head_dim);
  c.layer_kv_heads.assign(c.num_layers, c.num_kv_heads);
  // Present (even null: transformers then keeps every layer at the globals) -> global_head_dim is ignored.
  const bool explicit_layers = r.j.contains("per_layer_config");
  if (explicit_layers) {
    const json& plc = r.j.at("per_layer_config").is_null() ? json::object() : r.j.at("per_layer_config");
    KAKEYA_CHECK(plc.is_object(), r.origin << ": field 'per_layer_config' expected an object {layer: {field: value}}, got "
                                           << plc.dump());
    for (const auto& [key, ov] : plc.items()) {
      const std::string where = "per_layer_config." + key;
      bool digits = !key.empty() && key.size() < 10 && key.find_first_not_of("0123456789") == std::string::npos;
      int64_t l = digits ? std::stoll(key) : -1;
      KAKEYA_CHECK(l >= 0 && l < c.num_layers, r.origin << ": field 'per_layer_config' has key '" << key
                                                        << "' (expected a layer index in [0, " << c.num_layers << "))");
      KAKEYA_CHECK(ov.is_object(), r.origin << ": field '" << where << "' expected an object, got " << ov.dump());
      for (const auto& [attr, v] : ov.items()) {
        const std::string field = where + "." + attr;
        KAKEYA_CHECK(attr == "head_dim" || attr == "num_key_value_heads",
                     r.origin << ": field '" << field << "': per-layer overrides of '" << attr
                              << "' are not supported yet (supported: head_dim, num_key_value_heads)");
        KAKEYA_CHECK(v.is_number_integer() && v.get<int64_t>() > 0,
                     r.origin << ": field '" << field << "' expected an integer > 0, got " << v.dump());
        (attr == "head_dim" ? c.layer_head_dim : c.layer_kv_heads)[l] = v.get<int64_t>();
      }
    }
  } else {
    const int64_t global_head_dim = r.positive_or("global_head_dim", 512);
    const int64_t global_kv = c.attention_k_eq_v ? r.positive_or("num_global_key_value_heads", c.num_kv_heads)
                                                 : c.num_kv_heads;
    for (int64_t l = 0; l < c.num_layers; ++l)
      if (!c.is_sliding(l)) {
        c.layer_head_dim[l] = global_head_dim;
        c.layer_kv_heads[l] = global_kv;
      }
  }
  const char* src = explicit_layers ? "per_layer_config" : "num_global_key_value_heads";
  for (int64_t l = 0; l < c.num_layers; ++l)
    KAKEYA_CHECK(c.num_heads % c.layer_kv_heads[l] == 0,
                 r.origin << ": field '" << src << "': layer " << l << " has " << c.layer_kv_heads[l]
                          << " KV heads, num_attention_heads=" << c.num_heads << " must be a multiple of it");
  // One head dim / KV head count per layer type (transformers builds one RoPE per type and refuses otherwise).
  int64_t first[2] = {-1, -1};
  for (int64_t l = 0; l < c.num_layers; ++l) {
    int64_t& m = first[c.is_sliding(l) ? 0 : 1];
    if (m < 0) m = l;
    KAKEYA_CHECK(c.layer_head_dim[m] == c.layer_head_dim[l] && c.layer_kv_heads[m] == c.layer_kv_heads[l],
                 r.origin << ": field 'per_layer_config': " << layer_type_name(c.layer_types[l]) << " layers " << m
                          << " and " << l << " differ (head_dim " << c.layer_head_dim[m] << " vs " << c.layer_head_dim[l]
                          << ", KV heads " << c.layer_kv_heads[m] << " vs " << c.layer_kv_heads[l]
                          << "); layers of one type must agree");
  }
}

// Gemma 4 MoE (enable_moe_block): every layer gets the router and experts beside its dense MLP.
void parse_gemma4_moe(const Reader& r, ModelConfig& c) {
  if (!r.boolean_or("enable_moe_block", false)) return;
  c.num_experts = r.positive("num_experts");
  c.top_k_experts = r.positive("top_k_experts");
  c.moe_intermediate_size = r.positive("moe_intermediate_size");
  KAKEYA_CHECK(c.top_k_experts <= c.num_experts, r.origin << ": field 'top_k_experts' is " << c.top_k_experts
                                                          << ", expected <= num_experts=" << c.num_experts);
}

// Gemma 4 per-layer inputs (E2B/E4B). transformers' default is 256: an absent field means they are on.
void parse_gemma4_per_layer_inputs(const Reader& r, ModelConfig& c) {
  const int64_t ple = r.has("hidden_size_per_layer_input") ? r.integer("hidden_size_per_layer_input") : 256;
  KAKEYA_CHECK(ple >= 0, r.origin << ": field 'hidden_size_per_layer_input' expected >= 0, got " << ple);
  c.per_layer_input_size = ple;
  if (ple > 0) c.per_layer_vocab_size = r.positive_or("vocab_size_per_layer_input", 262144);
}

// Gemma 4 KV sharing: the last num_kv_shared_layers layers read the K/V of the last
// earlier non-shared layer of their type (which must exist).
void parse_gemma4_kv_sharing(const Reader& r, ModelConfig& c) {
  const int64_t shared = r.has("num_kv_shared_layers") ? r.integer("num_kv_shared_layers") : 0;
  KAKEYA_CHECK(shared >= 0 && shared < c.num_layers,
               r.origin << ": field 'num_kv_shared_layers' is " << shared << ", expected in [0, num_hidden_layers="
                        << c.num_layers << ") (the first layer computes its own K/V)");
  const int64_t first = c.num_layers - shared;
  for (int64_t l = 0; l < c.num_layers; ++l) c.kv_layer.push_back(l);
  for (int64_t l = first; l < c.num_layers; ++l) {
    int64_t src = first - 1;
    while (src >= 0 && c.layer_types[src] != c.layer_types[l]) --src;
    KAKEYA_CHECK(src >= 0, r.origin << ": field 'num_kv_shared_layers' is " << shared << ": shared layer " << l << " ("
                                    << layer_type_name(c.layer_types[l]) << ") has no earlier non-shared "
                                    << layer_type_name(c.layer_types[l]) << " layer to read K/V from");
    c.kv_layer[l] = src;
  }
  c.double_wide_mlp = r.boolean_or("use_double_wide_mlp", false);
}

// Gemma 4 text decoder (transformers 5.17 Gemma4TextModel): Gemma 3's sandwich
// norms and q/k norm, plus weightless v_norm, attention scale 1, K=V full layers
// (attention_k_eq_v), per-layer head dims, proportional partial RoPE on full
// layers, a per-layer scalar on the residual stream and, optionally, the experts
// beside the dense MLP (26B-A4B), per-layer inputs and KV sharing (E2B/E4B).
void parse_gemma4(const Reader& r, ModelConfig& c) {
  const std::string bidir = r.string_or("use_bidirectional_attention", "");
  KAKEYA_CHECK(bidir.empty() || bidir == "vision",
               r.origin << ": field 'use_bidirectional_attention' is '" << bidir
                        << "': only causal decoders are supported (null, or 'vision', which leaves text causal)");

  parse_common(r, c);
  c.norm_f32 = c.sandwich_norm = c.qk_norm = c.v_norm = c.embed_scale_sqrt_hidden = c.layer_scalar = true;
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", true);
  if (!r.has("hidden_activation") && !r.has("hidden_act")) c.act = Activation::GeluTanh;
  c.mlp_bias = false;  // Gemma4TextMLP has no biases whatever the config says
  c.sliding_window = r.positive_or("sliding_window", 512);
  std::vector<LayerType> fallback;
  for (int64_t i = 0; i < c.num_layers; ++i)
    fallback.push_back((i + 1) % 6 == 0 ? LayerType::Full : LayerType::Sliding);
  c.layer_types = parse_layer_types(r, c.num_layers, fallback);
  c.layer_types.back() = LayerType::Full;  // transformers forces the last layer to full attention
  parse_gemma4_rope(r, c);
  c.attention_k_eq_v = r.boolean_or("attention_k_eq_v", false);
  parse_gemma4_layer_dims(r, c);
  parse_gemma4_moe(r, c);
  parse_gemma4_per_layer_inputs(r, c);
  parse_gemma4_kv_sharing(r, c);
  c.attn_scale = 1.0;  // Gemma4TextAttention.scaling: q and k are RMS-normed, no 1/sqrt(d)
  c.final_logit_softcap = r.optional_number("final_logit_softcapping");
  KAKEYA_CHECK(!c.final_logit_softcap || *c.final_logit_softcap > 0,
               r.origin << ": field 'final_logit_softcapping' expected > 0 or null, got " << *c.final_logit_softcap);
}

void parse_qwen3(const Reader& r, ModelConfig& c) {
  parse_common(r, c);
  c.qk_norm = true;
  bool sliding = r.boolean_or("use_sliding_window", false);
  c.sliding_window = sliding ? r.positive_or("sliding_window", 4096) : 0;
  int64_t max_window_layers = r.has("max_window_layers") ? r.integer("max_window_layers") : c.num_layers;
  std::vector<LayerType> fallback;
  for (int64_t i = 0; i < c.num_layers; ++i)
    fallback.push_back(sliding && i >= max_window_layers ? LayerType::Sliding : LayerType::Full);
  c.layer_types = parse_layer_types(r, c.num_layers, fallback);
  parse_rope_fields(r, c, 0);
  c.attn_scale = 1.0 / std::sqrt((double)c.head_dim);
}

void parse_llama(const Reader& r, ModelConfig& c) {
  parse_common(r, c);
  c.layer_types.assign(c.num_layers, LayerType::Full);
  c.layer_types = parse_layer_types(r, c.num_layers, c.layer_types);
  for (LayerType t : c.layer_types)
    KAKEYA_CHECK(t == LayerType::Full, r.origin << ": llama with sliding layers is not supported");
  parse_rope_fields(r, c, 0);
  c.attn_scale = 1.0 / std::sqrt((double)c.head_dim);
}

}  // namespace

ModelConfig ModelConfig::from_json(const json& j, const std::string& origin) {
  KAKEYA_CHECK(j.is_object(), origin << ": expected a JSON object");
  Reader r{j, origin};
  // A multimodal Gemma 3 / 4 config nests the decoder under text_config.
  if (r.has("text_config") && (r.string_or("model_type", "") == "gemma3" || r.string_or("model_type", "") == "gemma4"))
    return from_json(j.at("text_config"), origin + ":text_config");
  std::string mt = r.string_or("model_type", "");
  KAKEYA_CHECK(!mt.empty(), origin << ": missing field 'model_type' (expected gemma3_text, gemma4_text, qwen3 or llama)");
  ModelConfig c;
  c.model_type = mt;
  try {
    if (mt == "gemma3_text" || mt == "gemma3") { c.family = Family::Gemma3; parse_gemma3(r, c); }
    else if (mt == "gemma4_text" || mt == "gemma4") { c.family = Family::Gemma4; parse_gemma4(r, c); }
    else if (mt == "qwen3") { c.family = Family::Qwen3; parse_qwen3(r, c); }
    else if (mt == "llama") { c.family = Family::Llama; parse_llama(r, c); }
    else KAKEYA_FAIL(origin << ": model_type '" << mt << "' is not supported (expected gemma3_text, gemma4_text, qwen3 or llama)");
  } catch (const json::exception& e) {
    KAKEYA_FAIL(origin << ": malformed field: " << e.what());
  }
  if (c.layer_head_dim.empty()) c.layer_head_dim.assign(c.num_layers, c.head_dim);
  if (c.kv_layer.empty())
    for (int64_t l = 0; l < c.num_layers; ++l) c.kv_layer.push_back(l);
  if (c.layer_kv_heads.empty()) c.layer_kv_heads.assign(c.num_layers, c.num_kv_heads);
  for (LayerType t : c.layer_types)
    if (t == LayerType::Sliding)
      KAKEYA_CHECK(c.sliding_window > 0, origin << ": sliding layers need field 'sliding_window' > 0");
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  return from_json(fs::read_json(path, "an HF config.json"), path);
}

json ModelConfig::summary() const {
  json layer_types_json = json::array();
  for (LayerType t : layer_types) layer_types_json.push_back(layer_type_name(t));
  json j{{"family", family_name(family)},
          {"model_type", model_type},
          {"vocab_size", vocab_size},
          {"hidden_size", hidden_size},
          {"intermediate_size", intermediate_size},
          {"num_layers", num_layers},
          {"num_heads", num_heads},
          {"num_kv_heads", num_kv_heads},
          {"head_dim", head_dim},
          {"layer_head_dim", layer_head_dim},
          {"layer_kv_heads", layer_kv_heads},
          {"attention_k_eq_v", attention_k_eq_v},
          {"sliding_window", sliding_window},
          {"layer_types", layer_types_json},
          {"rope_full_theta", rope_full.theta},
          {"rope_sliding_theta", rope_sliding.theta},
          {"attn_scale", attn_scale}};
  // Only where set: a dense model's summary (and so the fingerprint of f_θ files made for it) stays as it was.
  if (moe()) {
    j["num_experts"] = num_experts;
    j["top_k_experts"] = top_k_experts;
    j["moe_intermediate_size"] = moe_intermediate_size;
  }
  if (per_layer_input_size > 0) {
    j["per_layer_input_size"] = per_layer_input_size;
    j["per_layer_vocab_size"] = per_layer_vocab_size;
  }
  if (num_kv_shared() > 0) {
    j["kv_layer"] = kv_layer;
    j["double_wide_mlp"] = double_wide_mlp;
  }
  return j;
}

}  // namespace kakeya
