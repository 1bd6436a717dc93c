// ModelConfig::from_file: what each family reads from an HF config.json, and
// that every bad config is refused with a message naming the file and the field.
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/model/config.h"
#include "core/error.h"
#include "core/io/fs.h"
#include "tests/test_util.h"

using namespace kakeya;
using json = nlohmann::json;

namespace {

// Writes `j` as <tmp>/kakeya_test_config_<pid>/<name>/config.json and returns the path.
std::string write_config(const std::string& name, const json& j) {
  std::string dir = fs::temp_dir() + "/kakeya_test_config_" + std::to_string(getpid()) + "/" + name;
  fs::make_dirs(dir);
  std::string path = dir + "/config.json";
  fs::write_atomic(path, j.dump(2));
  return path;
}

// from_file must throw kakeya::Error whose message names the file and contains every needle.
void expect_error(const std::string& name, const json& j, const std::vector<std::string>& needles) {
  const std::string path = write_config(name, j);
  try {
    ModelConfig::from_file(path);
    ADD_FAILURE() << name << ": expected an error, the config loaded";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << name << ": message does not name the file: " << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << name << ": no '" << n << "' in: " << msg;
  }
}

json llama() {
  return json{{"model_type", "llama"},         {"vocab_size", 101},        {"hidden_size", 48},
              {"intermediate_size", 80},       {"num_hidden_layers", 5},   {"num_attention_heads", 4},
              {"num_key_value_heads", 2},      {"head_dim", 16},           {"rms_norm_eps", 1e-6},
              {"max_position_embeddings", 256}};
}

// As transformers 5.17 saves a tiny Gemma4TextConfig (tests/fixtures/make_model_fixtures.py "gemma4").
json gemma4() {
  json j = llama();
  j["model_type"] = "gemma4_text";
  j["hidden_activation"] = "gelu_pytorch_tanh";
  j["sliding_window"] = 6;
  j["hidden_size_per_layer_input"] = 0;
  j["num_kv_shared_layers"] = 0;
  j["enable_moe_block"] = false;
  j["attention_k_eq_v"] = true;
  j["final_logit_softcapping"] = 30.0;
  j["layer_types"] = {"sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  j["per_layer_config"] = {{"2", {{"head_dim", 32}, {"num_key_value_heads", 1}}},
                           {"4", {{"head_dim", 32}, {"num_key_value_heads", 1}}}};
  j["rope_parameters"] = {
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
      {"full_attention", {{"rope_type", "proportional"}, {"rope_theta", 1e6}, {"partial_rotary_factor", 0.25}}}};
  return j;
}

TEST(Config, Gemma4Dense) {
  auto c = ModelConfig::from_file(write_config("gemma4", gemma4()));
  EXPECT_EQ(c.family, Family::Gemma4);
  EXPECT_EQ(c.layer_head_dim, (std::vector<int64_t>{16, 16, 32, 16, 32}));
  EXPECT_EQ(c.layer_kv_heads, (std::vector<int64_t>{2, 2, 1, 2, 1}));
  EXPECT_EQ(c.q_dim(2), 128);
  EXPECT_EQ(c.kv_dim(2), 32);
  EXPECT_TRUE(c.k_eq_v(2) && c.k_eq_v(4));
  EXPECT_FALSE(c.k_eq_v(0) || c.k_eq_v(3));
  EXPECT_TRUE(c.v_norm && c.qk_norm && c.sandwich_norm && c.layer_scalar && c.norm_f32);
  EXPECT_FALSE(c.norm_unit_offset);  // Gemma 4 norms are x̂·w, not Gemma 3's x̂·(1+w)
  EXPECT_DOUBLE_EQ(c.attn_scale, 1.0);
  EXPECT_FALSE(c.attn_logit_softcap.has_value());
  EXPECT_DOUBLE_EQ(c.final_logit_softcap.value_or(0), 30.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.embed_scale_sqrt_hidden);
  EXPECT_EQ(c.act, Activation::GeluTanh);
  EXPECT_EQ(c.rope_full.type, "proportional");
  EXPECT_DOUBLE_EQ(c.rope_full.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rope_sliding.type, "default");
}

TEST(Config, Gemma4GoogleLayoutAndDefaults) {
  // Google's checkpoints: global_head_dim / num_global_key_value_heads instead of per_layer_config,
  // decoder under text_config of a multimodal "gemma4" config; no rope_parameters: transformers' defaults.
  json t = gemma4();
  t.erase("per_layer_config");
  t.erase("rope_parameters");
  t["global_head_dim"] = 64;
  t["num_global_key_value_heads"] = 1;
  t["layer_types"][4] = "sliding_attention";  // transformers forces the last layer to full attention
  auto c = ModelConfig::from_file(write_config("gemma4_google", json{{"model_type", "gemma4"}, {"text_config", t}}));
  EXPECT_EQ(c.layer_types.back(), LayerType::Full);
  EXPECT_EQ(c.layer_head_dim, (std::vector<int64_t>{16, 16, 64, 16, 64}));
  EXPECT_EQ(c.layer_kv_heads, (std::vector<int64_t>{2, 2, 1, 2, 1}));
  EXPECT_EQ(c.rope_full.type, "proportional");
  EXPECT_DOUBLE_EQ(c.rope_full.partial_rotary_factor, 0.25);
  EXPECT_DOUBLE_EQ(c.rope_full.theta, 1e6);
  EXPECT_DOUBLE_EQ(c.rope_sliding.theta, 1e4);

  // Without attention_k_eq_v the global KV head count is not applied (as in transformers).
  t["attention_k_eq_v"] = false;
  c = ModelConfig::from_file(write_config("gemma4_google_kv", t));
  EXPECT_EQ(c.layer_kv_heads, (std::vector<int64_t>{2, 2, 2, 2, 2}));
  EXPECT_FALSE(c.k_eq_v(4));

  // "per_layer_config": null is an explicit (empty) per-layer config: global_head_dim is ignored.
  t["per_layer_config"] = nullptr;
  c = ModelConfig::from_file(write_config("gemma4_plc_null", t));
  EXPECT_EQ(c.layer_head_dim, (std::vector<int64_t>{16, 16, 16, 16, 16}));
}

TEST(ConfigErrors, UnknownModelType) {
  json j = llama();
  j["model_type"] = "mamba";
  expect_error("unknown_model_type", j, {"model_type", "mamba"});
}

TEST(ConfigErrors, HeadDimNotDerivable) {
  // No head_dim and hidden_size not a multiple of the heads (a fuzzer's 48 / 54 made head_dim 0).
  json j = llama();
  j.erase("head_dim");
  j["num_attention_heads"] = 54;
  j["num_key_value_heads"] = 2;
  expect_error("head_dim_not_derivable", j, {"no 'head_dim'", "hidden_size=48", "num_attention_heads=54"});
}

TEST(ConfigErrors, MissingModelType) {
  json j = llama();
  j.erase("model_type");
  expect_error("missing_model_type", j, {"missing field 'model_type'"});
}

TEST(Config, Gemma4MoE) {
  json j = gemma4();
  EXPECT_FALSE(ModelConfig::from_file(write_config("gemma4_dense", j)).moe());
  j["enable_moe_block"] = true;
  j["num_experts"] = 8;
  j["top_k_experts"] = 2;
  j["moe_intermediate_size"] = 24;
  auto c = ModelConfig::from_file(write_config("gemma4_moe", j));
  EXPECT_TRUE(c.moe());
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.top_k_experts, 2);
  EXPECT_EQ(c.moe_intermediate_size, 24);
  EXPECT_EQ(c.summary().at("num_experts"), 8);
  // A dense model's summary has no MoE fields (f_θ fingerprints of dense verifiers stay valid).
  EXPECT_FALSE(ModelConfig::from_file(write_config("gemma4_dense", gemma4())).summary().contains("num_experts"));
}

TEST(ConfigErrors, Gemma4MoE) {
  json j = gemma4();
  j["enable_moe_block"] = true;
  j["num_experts"] = 8;
  j["top_k_experts"] = 9;
  j["moe_intermediate_size"] = 24;
  expect_error("gemma4_moe_topk", j, {"'top_k_experts'", "num_experts=8"});
  j["top_k_experts"] = 2;
  j.erase("moe_intermediate_size");
  // Nested in a multimodal config too: the message names the file and the text_config.
  expect_error("gemma4_moe_nested", json{{"model_type", "gemma4"}, {"text_config", j}},
               {":text_config", "'moe_intermediate_size'"});
}

TEST(Config, Gemma4PerLayerInputs) {
  json j = gemma4();
  EXPECT_EQ(ModelConfig::from_file(write_config("gemma4_no_ple", j)).per_layer_input_size, 0);
  j["hidden_size_per_layer_input"] = 8;
  j["vocab_size_per_layer_input"] = 77;
  auto c = ModelConfig::from_file(write_config("gemma4_ple", j));
  EXPECT_EQ(c.per_layer_input_size, 8);
  EXPECT_EQ(c.per_layer_vocab_size, 77);
  // Absent: transformers' defaults (E2B/E4B), per-layer inputs on.
  j.erase("hidden_size_per_layer_input");
  j.erase("vocab_size_per_layer_input");
  c = ModelConfig::from_file(write_config("gemma4_ple_default", j));
  EXPECT_EQ(c.per_layer_input_size, 256);
  EXPECT_EQ(c.per_layer_vocab_size, 262144);
}

TEST(ConfigErrors, Gemma4PerLayerInputs) {
  json j = gemma4();
  j["hidden_size_per_layer_input"] = -1;
  expect_error("gemma4_ple_negative", j, {"'hidden_size_per_layer_input'", ">= 0"});
  j["hidden_size_per_layer_input"] = 8;
  j["vocab_size_per_layer_input"] = 0;
  expect_error("gemma4_ple_vocab", j, {"'vocab_size_per_layer_input'", "> 0"});
}

TEST(Config, Gemma4KvSharing) {
  // layer_types: sliding, sliding, full, sliding, full. The last 2 share: layer 3 reads
  // layer 1 (the last earlier sliding layer), layer 4 reads layer 2.
  json j = gemma4();
  auto c = ModelConfig::from_file(write_config("gemma4_unshared", j));
  EXPECT_EQ(c.num_kv_shared(), 0);
  EXPECT_EQ(c.kv_layer, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  j["num_kv_shared_layers"] = 2;
  j["use_double_wide_mlp"] = true;
  c = ModelConfig::from_file(write_config("gemma4_kv_shared", j));
  EXPECT_EQ(c.kv_layer, (std::vector<int64_t>{0, 1, 2, 1, 2}));
  EXPECT_EQ(c.num_kv_shared(), 2);
  EXPECT_TRUE(c.kv_shared(3) && !c.kv_shared(2));
  EXPECT_EQ(c.mlp_width(2), 80);
  EXPECT_EQ(c.mlp_width(3), 160);  // double wide on the shared layers only
  EXPECT_EQ(c.summary().at("kv_layer"), json({0, 1, 2, 1, 2}));
  j["use_double_wide_mlp"] = false;
  EXPECT_EQ(ModelConfig::from_file(write_config("gemma4_kv_shared_narrow", j)).mlp_width(3), 80);
}

TEST(ConfigErrors, Gemma4KvSharing) {
  json j = gemma4();
  j["num_kv_shared_layers"] = 5;  // every layer: none computes K/V
  expect_error("gemma4_kv_shared_all", j, {"'num_kv_shared_layers'", "[0, num_hidden_layers=5)"});
  j["num_kv_shared_layers"] = -1;
  expect_error("gemma4_kv_shared_negative", j, {"'num_kv_shared_layers'", "[0, num_hidden_layers=5)"});
  // Shared layers 2..4 include sliding layer 3, but the only non-shared layers (0, 1) are sliding
  // and layer 4 is full: no full layer to read from.
  j["num_kv_shared_layers"] = 3;
  expect_error("gemma4_kv_shared_no_source", j,
               {"'num_kv_shared_layers'", "shared layer 2 (full_attention)", "no earlier non-shared full_attention"});
}

TEST(ConfigErrors, Gemma4Bidirectional) {
  json j = gemma4();
  j["use_bidirectional_attention"] = "all";
  expect_error("gemma4_bidir", j, {"'use_bidirectional_attention'", "causal"});
}

TEST(ConfigErrors, Gemma4PerLayerOverride) {
  json j = gemma4();
  j["per_layer_config"]["2"]["intermediate_size"] = 160;
  expect_error("gemma4_plc_attr", j, {"'per_layer_config.2.intermediate_size'", "not supported yet"});
  j = gemma4();
  j["per_layer_config"]["7"] = {{"head_dim", 32}};
  expect_error("gemma4_plc_index", j, {"'per_layer_config'", "'7'"});
  j = gemma4();
  j["per_layer_config"]["4"]["head_dim"] = 64;  // full layers 2 and 4 disagree
  expect_error("gemma4_plc_mixed", j, {"'per_layer_config'", "layers 2 and 4"});
  j = gemma4();
  j["per_layer_config"]["2"]["num_key_value_heads"] = 3;
  j["per_layer_config"]["4"]["num_key_value_heads"] = 3;
  expect_error("gemma4_plc_heads", j, {"'per_layer_config'", "num_attention_heads=4"});
}

TEST(ConfigErrors, Gemma4RopeParameters) {
  json j = gemma4();
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  expect_error("gemma4_rope_flat", j, {"'rope_parameters'", "full_attention"});
  // A count past int64's range (found by fuzz_config): refused, not cast.
  j = gemma4();
  j["rope_parameters"]["full_attention"]["original_max_position_embeddings"] = 3.27778e+93;
  expect_error("gemma4_rope_orig_max", j, {"'rope_parameters.full_attention.original_max_position_embeddings'", "1 .. 1e15"});
  j = gemma4();
  j["rope_parameters"].erase("sliding_attention");
  expect_error("gemma4_rope_missing", j, {"'rope_parameters.sliding_attention'"});
  j = gemma4();
  j["rope_parameters"]["full_attention"]["rope_type"] = "llama3";
  expect_error("gemma4_rope_type", j, {"'rope_parameters.full_attention.rope_type'"});
}

TEST(ConfigErrors, MissingField) {
  json j = llama();
  j.erase("hidden_size");
  expect_error("missing_field", j, {"missing field 'hidden_size'"});
  j = gemma4();
  j.erase("num_attention_heads");
  expect_error("missing_field_gemma4", j, {"missing field 'num_attention_heads'"});
}

TEST(ConfigErrors, WrongType) {
  json j = llama();
  j["num_hidden_layers"] = "5";
  expect_error("wrong_type_int", j, {"'num_hidden_layers'", "expected an integer", "\"5\""});
  j = gemma4();
  j["attention_k_eq_v"] = "yes";
  expect_error("wrong_type_bool", j, {"'attention_k_eq_v'", "true/false"});
  j = gemma4();
  j["final_logit_softcapping"] = "30";
  expect_error("wrong_type_number", j, {"'final_logit_softcapping'", "expected a number"});
}

TEST(ConfigErrors, LayerTypesLengthMismatch) {
  json j = gemma4();
  j["layer_types"] = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  expect_error("layer_types_length", j, {"'layer_types'", "num_hidden_layers=5", "4 entries"});
  j = gemma4();
  j["layer_types"][1] = "chunked_attention";
  expect_error("layer_types_value", j, {"'layer_types[1]'", "chunked_attention"});
}

TEST(ConfigErrors, HeadsNotDivisible) {
  json j = llama();
  j["num_key_value_heads"] = 3;
  expect_error("heads_not_divisible", j, {"num_attention_heads=4", "num_key_value_heads=3"});
  j = gemma4();
  j["num_key_value_heads"] = 3;
  expect_error("heads_not_divisible_gemma4", j, {"num_attention_heads=4", "num_key_value_heads=3"});
}

TEST(ConfigErrors, NotJson) {
  const std::string path = write_config("not_json", json::object());
  fs::write_atomic(path, "{\"model_type\": \"llama\",");
  try {
    ModelConfig::from_file(path);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

}  // namespace
