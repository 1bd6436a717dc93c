// Model configuration: one struct for every supported decoder family, filled by
// a validating from_json per family (HF config.json layout of transformers 5.x,
// legacy 4.x rope fields accepted too). Per-layer vectors carry what differs by
// layer (attention type, head dim), so the forward loop never branches on family.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kakeya {

enum class Family { Gemma3, Gemma4, Qwen3, Llama };
enum class LayerType { Sliding, Full };
enum class Activation { GeluTanh, Silu };

const char* family_name(Family f);
const char* layer_type_name(LayerType t);  // "sliding_attention" / "full_attention"

// RoPE of one layer type. Types: default, linear, llama3, proportional (Gemma 4
// full layers: the first partial_rotary_factor·head_dim/2 frequencies of the
// whole head_dim, the rest 0, so rotate_half over the whole head pairs d with
// d + head_dim/2 and the high half of each pair set passes through unrotated).
struct RopeParams {
  std::string type = "default";
  double theta = 10000.0;
  double factor = 1.0;                 // linear, llama3
  double low_freq_factor = 1.0;        // llama3
  double high_freq_factor = 4.0;       // llama3
  int64_t original_max_position = 8192;  // llama3
  double partial_rotary_factor = 1.0;  // proportional
};

struct ModelConfig {
  Family family = Family::Llama;
  std::string model_type;              // as in config.json
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;            // default KV heads (sliding layers)
  int64_t head_dim = 0;                // default head dim (sliding layers)
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 0;
  int64_t sliding_window = 0;          // 0: no sliding layers
  std::vector<LayerType> layer_types;  // [num_layers]
  std::vector<int64_t> layer_head_dim; // [num_layers]
  std::vector<int64_t> layer_kv_heads; // [num_layers] (Gemma 4 full layers may have fewer)
  RopeParams rope_full, rope_sliding;
  double attn_scale = 0.0;             // softmax scale (Gemma 3: query_pre_attn_scalar^-0.5; Gemma 4: 1)
  std::optional<double> attn_logit_softcap;
  std::optional<double> final_logit_softcap;
  Activation act = Activation::Silu;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  bool mlp_bias = false;
  // Family traits (set by from_json, not read from the file):
  bool norm_unit_offset = false;       // Gemma 3 RMSNorm weights are offsets: x̂·(1+w)
  bool norm_f32 = false;               // Gemma 3/4: x̂·weight computed in f32, one cast (else Llama: cast x̂, ·w in dtype)
  bool sandwich_norm = false;          // Gemma: post-attention and pre/post-FFN norms
  bool qk_norm = false;                // per-head RMSNorm on q and k before RoPE
  bool v_norm = false;                 // Gemma 4: RMSNorm without weight on v
  bool attention_k_eq_v = false;       // Gemma 4: full layers have no v_proj, V = raw k_proj output (then v_norm)
  bool layer_scalar = false;           // Gemma 4: per-layer scalar weight multiplies the residual stream after each layer
  bool embed_scale_sqrt_hidden = false;  // Gemma: embeddings × sqrt(hidden) rounded to the weight dtype
  // Gemma 4 mixture of experts (enable_moe_block; core/model/moe.h): every layer routes
  // each token to top_k of num_experts experts beside its dense MLP. 0: no MoE.
  int64_t num_experts = 0;
  int64_t top_k_experts = 0;
  int64_t moe_intermediate_size = 0;
  // Gemma 4 per-layer inputs (E2B/E4B, hidden_size_per_layer_input): a packed token table
  // [per_layer_vocab_size, num_layers·per_layer_input_size] plus a projection of the embeddings
  // give every layer a [per_layer_input_size] input that gates a residual branch. 0: none.
  int64_t per_layer_input_size = 0;
  int64_t per_layer_vocab_size = 0;
  // Gemma 4 KV sharing (num_kv_shared_layers): the last layers compute no K/V and attend over
  // the K/V of the last earlier non-shared layer of their type. [num_layers]: that layer, or l.
  std::vector<int64_t> kv_layer;
  bool double_wide_mlp = false;        // Gemma 4 use_double_wide_mlp: KV-shared layers' MLP is 2·intermediate wide
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;

  static ModelConfig from_json(const nlohmann::json& j, const std::string& origin);
  static ModelConfig from_file(const std::string& path);  // config.json
  // Dictionary with the same fields, for manifests and --json reports.
  nlohmann::json summary() const;

  bool is_sliding(int64_t layer) const { return layer_types[layer] == LayerType::Sliding; }
  const RopeParams& rope(int64_t layer) const { return is_sliding(layer) ? rope_sliding : rope_full; }
  int64_t kv_heads(int64_t layer) const { return layer_kv_heads[layer]; }
  // This layer's V is its raw K projection (no v_proj weight, no v rows in the fused qkv).
  bool k_eq_v(int64_t layer) const { return attention_k_eq_v && !is_sliding(layer); }
  int64_t q_dim(int64_t layer) const { return num_heads * layer_head_dim[layer]; }
  int64_t kv_dim(int64_t layer) const { return layer_kv_heads[layer] * layer_head_dim[layer]; }
  bool moe() const { return num_experts > 0; }
  bool kv_shared(int64_t layer) const { return kv_layer[layer] != layer; }
  int64_t num_kv_shared() const {
    int64_t n = 0;
    for (int64_t l = 0; l < num_layers; ++l) n += kv_shared(l);
    return n;
  }
  // A full-attention layer that computes and stores its own K/V: what a full-attention code
  // (--full-code, a layer's own code) applies to.
  bool stores_full_kv(int64_t layer) const { return !is_sliding(layer) && !kv_shared(layer); }
  int64_t mlp_width(int64_t layer) const { return intermediate_size * (double_wide_mlp && kv_shared(layer) ? 2 : 1); }
};

}  // namespace kakeya
