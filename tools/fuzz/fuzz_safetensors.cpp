// libFuzzer target for the safetensors header parser. Any byte string must
// either throw kakeya::Error or yield a header whose entries tile the data
// buffer exactly with sizes matching shape x dtype, since
// SafetensorsFile::get() reads the mapping on that promise alone. Crashes,
// sanitizer reports, other exceptions and broken promises (trap) are bugs.
// FUZZ_SOURCES: core/io/safetensors_header.cpp
#include "core/error.h"
#include "core/io/safetensors_header.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

void check(const uint8_t* data, size_t size) {
  kakeya::SafetensorsHeader header;
  try {
    header = kakeya::parse_safetensors_header(data, size, "fuzz.safetensors");
  } catch (const kakeya::Error&) {
    return;
  }
  if (header.data_start < 8 || header.data_start > size) __builtin_trap();
  const uint64_t buffer = size - header.data_start;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, t] : header.tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) __builtin_trap();
      numel *= uint64_t(d);  // the parser rejected overflowing shapes
    }
    const size_t itemsize = kakeya::safetensors_dtype_size(t.dtype);
    if (itemsize == 0 || t.begin > t.end || t.end > buffer) __builtin_trap();
    if (t.end - t.begin != numel * itemsize) __builtin_trap();
    ranges.emplace_back(t.begin, t.end);
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin != covered) __builtin_trap();
    covered = end;
  }
  if (covered != buffer) __builtin_trap();
}

// The largest data_offsets end the input names when read as header JSON, or 0.
uint64_t claimed_buffer_size(const uint8_t* data, size_t size) {
  const auto root = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  uint64_t end = 0;
  if (!root.is_object()) return 0;
  for (const auto& entry : root) {
    if (!entry.is_object() || !entry.contains("data_offsets")) continue;
    const auto& offs = entry["data_offsets"];
    if (offs.is_array() && offs.size() == 2 && offs[1].is_number_unsigned()) {
      end = std::max(end, offs[1].get<uint64_t>());
    }
  }
  return end;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The input as a file: mutations of the length prefix and truncation.
  check(data, size);
  // The input as the header JSON of a well-formed file whose buffer is as long
  // as the header claims, so that mutated JSON reaches the offset and tiling
  // checks instead of mostly failing the length prefix.
  const uint64_t buffer = claimed_buffer_size(data, size);
  if (buffer > (1u << 20)) return 0;
  std::vector<uint8_t> file(8 + size + buffer, 0);
  for (int i = 0; i < 8; ++i) file[i] = uint8_t(uint64_t(size) >> (8 * i));
  std::copy(data, data + size, file.begin() + 8);
  check(file.data(), file.size());
  return 0;
}
