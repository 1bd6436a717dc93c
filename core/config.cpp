#include "core/config.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"

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
  if (p.contains("original_max_position_embeddings"))
    rp.original_max_position = (int64_t)r.number(p["original_max_position_embeddings"], where + ".original_max_position_embeddings");
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
  c.norm_unit_offset = c.sandwich_norm = c.qk_norm = c.embed_scale_sqrt_hidden = true;
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

void parse_gemma4(const Reader& r, ModelConfig& c) {
  KAKEYA_CHECK(!r.boolean_or("enable_moe_block", false),
               r.origin << ": field 'enable_moe_block' is true: Gemma 4 MoE models are not supported yet (dense only)");
  KAKEYA_FAIL(r.origin << ": model_type 'gemma4_text' is recognised but its decoder is not implemented yet");
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
  // A multimodal Gemma 3 config nests the decoder under text_config.
  if (r.has("text_config") && r.string_or("model_type", "") == "gemma3")
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
  for (LayerType t : c.layer_types)
    if (t == LayerType::Sliding)
      KAKEYA_CHECK(c.sliding_window > 0, origin << ": sliding layers need field 'sliding_window' > 0");
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::ifstream f(path);
  KAKEYA_CHECK(f.good(), path << ": cannot open model config (expected an HF config.json)");
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    KAKEYA_FAIL(path << ": not valid JSON: " << e.what());
  }
  return from_json(j, path);
}

json ModelConfig::summary() const {
  json layer_types_json = json::array();
  for (LayerType t : layer_types) layer_types_json.push_back(layer_type_name(t));
  return json{{"family", family_name(family)},
              {"model_type", model_type},
              {"vocab_size", vocab_size},
              {"hidden_size", hidden_size},
              {"intermediate_size", intermediate_size},
              {"num_layers", num_layers},
              {"num_heads", num_heads},
              {"num_kv_heads", num_kv_heads},
              {"head_dim", head_dim},
              {"layer_head_dim", layer_head_dim},
              {"sliding_window", sliding_window},
              {"layer_types", layer_types_json},
              {"rope_full_theta", rope_full.theta},
              {"rope_sliding_theta", rope_sliding.theta},
              {"attn_scale", attn_scale}};
}

}  // namespace kakeya
