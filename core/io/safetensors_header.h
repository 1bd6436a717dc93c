// Framework-free part of the safetensors reader: header parsing and
// validation. Kept apart from safetensors.h (which needs ATen) so that
// tools/fuzz/fuzz_safetensors.cpp links without libtorch.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kakeya {

// HF's own limit (safetensors MAX_HEADER_SIZE); a larger length prefix is
// corruption, not a model.
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Framework-free view of one header entry (fuzzed by tools/fuzz/fuzz_safetensors.cpp).
struct TensorInfo {
  std::string dtype;              // "F32", "F16", "BF16", "I64", "I32", "U8", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;    // byte offsets into the data buffer
};

struct SafetensorsHeader {
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;        // absolute file offset of the data buffer
};

// Bytes per element of a safetensors dtype string ("BF16" -> 2), or 0 if the
// dtype is not one this project reads: F64 F32 F16 BF16 F8_E4M3 F8_E5M2
// I64 I32 I16 I8 U64 U32 U16 U8 BOOL.
size_t safetensors_dtype_size(const std::string& dtype);

// Parses and validates the header of a file of `file_size` bytes whose first
// bytes are `data` (at least min(file_size, 8 + header length)). `path` is only
// used in error messages. Throws kakeya::Error on any inconsistency: length
// prefix beyond the file or over kMaxSafetensorsHeaderBytes, invalid JSON,
// duplicated keys, unknown dtype or field, negative shape, data_offsets whose
// size disagrees with shape x dtype, offsets outside the buffer, and entries
// that overlap, leave gaps or do not cover the whole buffer.
SafetensorsHeader parse_safetensors_header(const uint8_t* data, uint64_t file_size, const std::string& path);

// nlohmann::json::parse, but duplicated object keys and nesting deeper than
// 16 levels are errors (nlohmann silently keeps the last duplicate). Parse
// failures become kakeya::Error naming `path`. Used for the safetensors header
// and for model.safetensors.index.json.
nlohmann::json parse_json_strict(const char* begin, const char* end, const std::string& path);

}  // namespace kakeya
