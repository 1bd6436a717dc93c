// Safetensors header validation. Everything a file claims is checked before
// any byte of the data buffer is touched, so a corrupt or hostile file yields
// a kakeya::Error and never an out-of-bounds read.
#include "core/io/safetensors_header.h"

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <set>

namespace kakeya {

namespace {

using nlohmann::json;

// Deep enough for any header field, shallow enough that a hostile file of
// nested brackets cannot make the parser allocate a huge state stack.
constexpr int kMaxJsonDepth = 16;

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string offsets_str(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// A JSON value that is an integer >= 0. nlohmann stores non-negative integer
// literals as number_unsigned; floats such as 4.0 or 1e3 are rejected because
// the reference writer never produces them.
bool is_uint(const json& v) { return v.is_number_unsigned(); }

// Short rendering of an offending JSON value for messages; long values are cut.
std::string brief(const json& v) {
  std::string s = v.dump();
  return s.size() > 40 ? s.substr(0, 37) + "..." : s;
}

TensorInfo parse_entry(const std::string& path, const std::string& name, const json& entry) {
  const std::string where = path + ": tensor '" + name + "'";
  KAKEYA_CHECK(entry.is_object(), where << ": entry is a JSON " << entry.type_name()
                                        << ", expected an object with dtype, shape, data_offsets");
  for (const auto& kv : entry.items()) {
    KAKEYA_CHECK(kv.key() == "dtype" || kv.key() == "shape" || kv.key() == "data_offsets",
                 where << ": unknown field '" << kv.key() << "' (expected dtype, shape, data_offsets)");
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    KAKEYA_CHECK(entry.contains(field), where << ": missing field '" << field << "'");
  }

  TensorInfo info;
  const json& dtype = entry["dtype"];
  KAKEYA_CHECK(dtype.is_string(), where << ": field 'dtype' is a JSON " << dtype.type_name() << ", expected a string");
  info.dtype = dtype.get<std::string>();
  const size_t itemsize = safetensors_dtype_size(info.dtype);
  KAKEYA_CHECK(itemsize != 0, where << ": dtype '" << info.dtype
                                    << "' is not one of F64, F32, F16, BF16, F8_E4M3, F8_E5M2, "
                                       "I64, I32, I16, I8, U64, U32, U16, U8, BOOL");

  const json& shape = entry["shape"];
  KAKEYA_CHECK(shape.is_array(), where << ": field 'shape' is a JSON " << shape.type_name() << ", expected an array");
  uint64_t numel = 1;
  bool numel_overflow = false, has_zero_dim = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    const json& d = shape[i];
    KAKEYA_CHECK(is_uint(d) && d.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()),
                 where << ": shape[" << i << "] is " << brief(d) << ", expected a non-negative integer");
    const uint64_t dim = d.get<uint64_t>();
    info.shape.push_back(int64_t(dim));
    numel_overflow |= __builtin_mul_overflow(numel, dim, &numel);
    has_zero_dim |= dim == 0;
  }
  // A zero dimension makes the tensor empty whatever the other dims multiply to.
  if (has_zero_dim) numel = 0, numel_overflow = false;
  uint64_t need = 0;
  numel_overflow |= __builtin_mul_overflow(numel, uint64_t(itemsize), &need);
  numel_overflow |= numel > uint64_t(std::numeric_limits<int64_t>::max());
  KAKEYA_CHECK(!numel_overflow, where << ": shape " << shape_str(info.shape) << " of " << info.dtype
                                      << " overflows a 64-bit byte count");

  const json& offs = entry["data_offsets"];
  KAKEYA_CHECK(offs.is_array() && offs.size() == 2,
               where << ": field 'data_offsets' is " << brief(offs) << ", expected [begin, end]");
  for (size_t i = 0; i < 2; ++i) {
    KAKEYA_CHECK(is_uint(offs[i]), where << ": data_offsets[" << i << "] is " << brief(offs[i])
                                         << ", expected a non-negative integer");
  }
  info.begin = offs[0].get<uint64_t>();
  info.end = offs[1].get<uint64_t>();
  KAKEYA_CHECK(info.begin <= info.end,
               where << ": data_offsets " << offsets_str(info.begin, info.end) << " end before they begin");
  KAKEYA_CHECK(info.end - info.begin == need,
               where << ": data_offsets " << offsets_str(info.begin, info.end) << " hold " << info.end - info.begin
                     << " bytes, shape " << shape_str(info.shape) << " of " << info.dtype << " needs " << need);
  return info;
}

}  // namespace

size_t safetensors_dtype_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},   {"U64", 8},     {"U32", 4},
      {"U16", 2}, {"U8", 1},  {"BOOL", 1}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

nlohmann::json parse_json_strict(const char* begin, const char* end, const std::string& path) {
  // One key set per open object; the parser reports object_start/key/object_end
  // in document order, so the top of the stack is the object a key belongs to.
  std::vector<std::set<std::string>> open_objects;
  std::string top_key;  // last key of the root object, to name the entry in errors
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        KAKEYA_CHECK(depth < kMaxJsonDepth, path << ": JSON nested deeper than " << kMaxJsonDepth << " levels");
        if (event == json::parse_event_t::object_start) open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
        open_objects.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        const bool fresh = open_objects.back().insert(key).second;
        if (open_objects.size() == 1) {
          KAKEYA_CHECK(fresh, path << ": key '" << key << "' appears twice");
          top_key = key;
        } else {
          KAKEYA_CHECK(fresh, path << ": entry '" << top_key << "': key '" << key << "' appears twice");
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(begin, end, callback);
  } catch (const json::exception& e) {
    throw Error(path + ": invalid JSON: " + e.what());
  }
}

SafetensorsHeader parse_safetensors_header(const uint8_t* data, uint64_t file_size, const std::string& path) {
  KAKEYA_CHECK(file_size >= 8, path << ": file is " << file_size
                                    << " bytes, shorter than the 8-byte header length prefix (truncated?)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];  // little-endian u64
  KAKEYA_CHECK(n <= kMaxSafetensorsHeaderBytes,
               path << ": header length " << n << " exceeds the limit of " << kMaxSafetensorsHeaderBytes
                    << " bytes (not a safetensors file?)");
  KAKEYA_CHECK(n <= file_size - 8, path << ": header length " << n << " runs past the end of the file ("
                                        << file_size - 8 << " bytes after the length prefix; truncated?)");

  const char* text = reinterpret_cast<const char*>(data + 8);
  const json root = parse_json_strict(text, text + n, path + ": header");
  KAKEYA_CHECK(root.is_object(), path << ": header is a JSON " << root.type_name() << ", expected an object");

  SafetensorsHeader header;
  header.data_start = 8 + n;
  const uint64_t buffer_size = file_size - header.data_start;
  for (const auto& kv : root.items()) {
    if (kv.key() == "__metadata__") {
      KAKEYA_CHECK(kv.value().is_object(), path << ": __metadata__ is a JSON " << kv.value().type_name()
                                                << ", expected an object of strings");
      for (const auto& m : kv.value().items()) {
        KAKEYA_CHECK(m.value().is_string(), path << ": __metadata__ key '" << m.key() << "' is a JSON "
                                                 << m.value().type_name() << ", expected a string");
        header.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    TensorInfo info = parse_entry(path, kv.key(), kv.value());
    KAKEYA_CHECK(info.end <= buffer_size, path << ": tensor '" << kv.key() << "': data_offsets "
                                               << offsets_str(info.begin, info.end) << " exceed the data buffer of "
                                               << buffer_size << " bytes (truncated?)");
    header.tensors.emplace(kv.key(), std::move(info));
  }

  // The spec requires the entries, ordered by offset, to tile the buffer
  // exactly: overlaps would alias tensors, gaps and trailing bytes hide data.
  std::vector<const std::pair<const std::string, TensorInfo>*> order;
  for (const auto& kv : header.tensors) order.push_back(&kv);
  std::sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return std::make_pair(a->second.begin, a->second.end) < std::make_pair(b->second.begin, b->second.end);
  });
  uint64_t covered = 0;
  const std::pair<const std::string, TensorInfo>* prev = nullptr;
  for (const auto* e : order) {
    const TensorInfo& t = e->second;
    KAKEYA_CHECK(t.begin >= covered, path << ": tensor '" << e->first << "': data_offsets "
                                          << offsets_str(t.begin, t.end) << " overlap tensor '" << prev->first
                                          << "' data_offsets " << offsets_str(prev->second.begin, prev->second.end));
    KAKEYA_CHECK(t.begin == covered, path << ": tensor '" << e->first << "': data_offsets "
                                          << offsets_str(t.begin, t.end) << " leave a gap: bytes "
                                          << offsets_str(covered, t.begin) << " belong to no tensor");
    covered = t.end;
    prev = e;
  }
  KAKEYA_CHECK(covered == buffer_size, path << ": data buffer is " << buffer_size << " bytes but data_offsets cover "
                                            << covered << " (trailing bytes belong to no tensor)");
  return header;
}

}  // namespace kakeya
