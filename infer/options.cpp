#include "infer/options.h"

#include "core/error.h"

#include <algorithm>

namespace kakeya {

const char* decode_mode_name(DecodeMode m) {
  switch (m) {
    case DecodeMode::Ar: return "ar";
    case DecodeMode::RestoredReforward: return "restored-reforward";
    case DecodeMode::Restored: return "restored";
    case DecodeMode::Fused: return "fused";
  }
  return "?";
}

DecodeMode parse_decode_mode(const std::string& s) {
  if (s == "ar") return DecodeMode::Ar;
  if (s == "restored-reforward") return DecodeMode::RestoredReforward;
  if (s == "restored") return DecodeMode::Restored;
  if (s == "fused") return DecodeMode::Fused;
  KAKEYA_FAIL("--mode: expected ar | restored-reforward | restored | fused, got '" << s << "'");
}

const char* full_attn_name(FullAttn f) {
  switch (f) {
    case FullAttn::Exact: return "exact";
    case FullAttn::Restored: return "restored";
    case FullAttn::Codec: return "codec";
  }
  return "?";
}

FullAttn parse_full_attn(const std::string& s) {
  if (s == "exact") return FullAttn::Exact;
  if (s == "restored") return FullAttn::Restored;
  if (s == "codec") return FullAttn::Codec;
  KAKEYA_FAIL("--full-attn: expected exact | restored | codec, got '" << s << "'");
}

bool RestoreOptions::full_code_weighted() const {
  return full_code.weighted ||
         std::any_of(full_code_layers.begin(), full_code_layers.end(), [](const ops::RowCode& c) { return c.weighted; });
}

nlohmann::json RestoreOptions::to_json() const {
  nlohmann::json j{{"sink", sink},        {"window", window},          {"full_attn", full_attn_name(full_attn)},
                   {"mix_alpha", mix_alpha}, {"chunk", resolved_chunk()}, {"stats", stats},
                   {"layers", layers},     {"token_layers", token_layers}};
  if (full_attn == FullAttn::Codec) j["full_code"] = ops::layer_codes_name(full_code, full_code_layers);
  if (full_attn == FullAttn::Codec && full_code_weighted()) j["calib"] = calib;
  // Only when coded: reports written before the option existed describe the same runs.
  if (region_code.defined()) j["restored_code"] = ops::row_code_name(region_code);
  return j;
}

}  // namespace kakeya
