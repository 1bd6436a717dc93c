// libFuzzer target for the model config parser: any byte string must either
// throw kakeya::Error (not JSON, or not a supported config) or yield a config
// whose per-layer vectors match num_layers and whose dimensions are positive,
// since the model loader sizes every tensor from them. Anything else is a bug.
// FUZZ_SOURCES: core/model/config.cpp core/io/fs.cpp
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/model/config.h"
#include "core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(data), size), nullptr, false);
  if (j.is_discarded()) return 0;
  try {
    auto c = kakeya::ModelConfig::from_json(j, "fuzz/config.json");
    if ((int64_t)c.layer_types.size() != c.num_layers || (int64_t)c.layer_head_dim.size() != c.num_layers ||
        (int64_t)c.layer_kv_heads.size() != c.num_layers)
      __builtin_trap();
    if (c.hidden_size <= 0 || c.num_heads <= 0 || c.num_kv_heads <= 0 || c.num_heads % c.num_kv_heads != 0) __builtin_trap();
    for (int64_t d : c.layer_head_dim)
      if (d <= 0) __builtin_trap();
    for (int64_t h : c.layer_kv_heads)
      if (h <= 0 || c.num_heads % h != 0) __builtin_trap();
    (void)c.summary();
  } catch (const kakeya::Error&) {
  }
  return 0;
}
