// safetensors reader (mmap, strict header validation) and writer.
// Format: u64 little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "F32"|"F16"|"BF16"|..., "shape": [...], "data_offsets": [begin, end]},
//  "__metadata__": {str: str}}, then the byte buffer. Offsets are relative to
// the buffer start, must be in-bounds, non-overlapping and cover the buffer.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kakeya {

// Framework-free view of one header entry (fuzzed by tools/fuzz_safetensors.cpp).
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

// Parses and validates the header of a file of `file_size` bytes whose first
// bytes are `data` (at least min(file_size, 8 + header length)). `path` is only
// used in error messages. Throws kakeya::Error on any inconsistency.
SafetensorsHeader parse_safetensors_header(const uint8_t* data, uint64_t file_size, const std::string& path);

// An mmapped safetensors file. Tensors returned by get() alias the mapping
// (zero copy, read-only) and keep it alive.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  bool has(const std::string& name) const { return header_.tensors.count(name) != 0; }
  std::vector<std::string> names() const;
  // CPU tensor aliasing the file. Throws naming file and tensor if absent.
  at::Tensor get(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<void> map_;     // munmap on last release
  uint64_t size_ = 0;
  SafetensorsHeader header_;
};

// All tensors of a model directory: model.safetensors, or the shards listed in
// model.safetensors.index.json ("weight_map": {tensor: shard file}).
class TensorStore {
 public:
  static TensorStore open_dir(const std::string& dir);
  static TensorStore open_file(const std::string& path);
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  std::vector<std::string> names() const;
  at::Tensor get(const std::string& name) const;
  // get() + shape check: error names file, tensor, expected and found shape.
  at::Tensor get(const std::string& name, at::IntArrayRef expected_shape) const;
  std::string file_of(const std::string& name) const;
  std::map<std::string, std::string> metadata() const;  // merged __metadata__

 private:
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;
};

// Writes tensors (any device; copied to CPU contiguous) atomically: a temp file
// in the same directory, fsync, rename. Supported dtypes: f32, f16, bf16, i64, i32, u8, bool.
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace kakeya
