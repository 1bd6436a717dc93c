// A small Gemma 4 mixture-of-experts verifier of the 26B-A4B's kind (K=V full layers with a wider
// head and fewer KV heads, proportional partial RoPE, router + experts beside the dense MLP,
// logit softcap), with weights drawn by core/model/random_weights.h: head dims the CUDA decode
// kernels take (64 sliding, 128 full), sliding window shorter than the prompts.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

#include "core/model/config.h"
#include "core/model/model.h"

namespace kakeya::test {

inline nlohmann::json small_gemma4_moe_json() {
  return {
      {"model_type", "gemma4_text"}, {"hidden_size", 128}, {"num_hidden_layers", 4}, {"intermediate_size", 96},
      {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"num_global_key_value_heads", 1}, {"head_dim", 64},
      {"global_head_dim", 128}, {"vocab_size", 512}, {"rms_norm_eps", 1e-6}, {"max_position_embeddings", 4096},
      {"sliding_window", 16}, {"final_logit_softcapping", 30.0}, {"use_double_wide_mlp", false},
      {"num_kv_shared_layers", 0}, {"hidden_size_per_layer_input", 0}, {"attention_k_eq_v", true},
      {"enable_moe_block", true}, {"num_experts", 8}, {"top_k_experts", 2}, {"moe_intermediate_size", 64},
      {"tie_word_embeddings", true}, {"hidden_activation", "gelu_pytorch_tanh"}, {"attention_bias", false},
      {"layer_types", {"sliding_attention", "sliding_attention", "full_attention", "sliding_attention"}},
      {"rope_parameters",
       {{"full_attention", {{"partial_rotary_factor", 0.25}, {"rope_theta", 1000000.0}, {"rope_type", "proportional"}}},
        {"sliding_attention", {{"rope_theta", 10000.0}, {"rope_type", "default"}}}}}};
}

inline ModelConfig small_gemma4_moe() { return ModelConfig::from_json(small_gemma4_moe_json(), "small gemma4 moe (test)"); }

// Its weights drawn from `seed` on the CPU, f32, positions up to 256.
inline Model small_gemma4_moe_model(uint64_t seed) {
  ModelOptions mo;
  mo.max_positions = 256;
  return Model::random(small_gemma4_moe(), seed, mo);
}

// 70 token ids of its vocabulary: several sliding windows, and past sink + window of the tests.
inline std::vector<int64_t> small_gemma4_prompt() {
  std::vector<int64_t> p;
  for (int64_t i = 0; i < 70; ++i) p.push_back((i * 37 + 11) % 512);
  return p;
}

}  // namespace kakeya::test
