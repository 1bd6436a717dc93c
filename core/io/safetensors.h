// safetensors reader (mmap, strict header validation) and writer.
// Format: u64 little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "F32"|"F16"|"BF16"|..., "shape": [...], "data_offsets": [begin, end]},
//  "__metadata__": {str: str}}, then the byte buffer. Offsets are relative to
// the buffer start, must be in-bounds, non-overlapping and cover the buffer.
#pragma once
#include "core/io/safetensors_header.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kakeya {

// An mmapped safetensors file; the header is validated on open.
//
// Tensors returned by get() alias the mapping (zero copy) and keep it alive
// after the SafetensorsFile is gone. The mapping is PROT_READ: writing into
// such a tensor (in-place ops, copy_ into it) faults with SIGSEGV, so clone()
// before modifying. The file must not be truncated or rewritten in place while
// mapped (save_safetensors replaces files by rename, which is safe).
//
// Safetensors does not align tensors within the buffer. A tensor whose data
// is not aligned to its element size is returned as an owned copy instead of
// an alias, because ATen kernels assume aligned elements.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  bool has(const std::string& name) const { return header_.tensors.count(name) != 0; }
  std::vector<std::string> names() const;
  // CPU tensor aliasing the file (see above). Throws naming file and tensor
  // if absent, and for BOOL tensors holding bytes other than 0 and 1.
  at::Tensor get(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<void> map_;     // munmap on last release
  uint64_t size_ = 0;
  SafetensorsHeader header_;
};

// All tensors of a model directory: model.safetensors, or the shards listed in
// model.safetensors.index.json ("weight_map": {tensor: shard file}). The index
// wins if both exist (as in HF). Opening validates every shard header, that
// every shard exists and that every listed tensor is in its shard; only the
// tensors named in weight_map are exposed. Errors for a missing tensor name
// the directory and the nearest existing names.
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
  // Merged metadata: the string entries of the index's "metadata" (where
  // huggingface_hub puts user metadata), then each file's __metadata__; the
  // first source (index, then shards in name order) wins on conflicts.
  std::map<std::string, std::string> metadata() const;

 private:
  std::string source_;            // directory or file, for error messages
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;
  std::map<std::string, std::string> index_metadata_;
};

// Writes tensors (any device; copied to CPU contiguous) atomically: a temp file
// in the same directory, fsync, rename, so readers see the old file or the
// complete new one. Layout as HF writes it: header padded with spaces to a
// multiple of 8 bytes, tensors in sorted name order, __metadata__ only if
// non-empty. Supported dtypes: every one safetensors_dtype_size() knows
// (f64, f32, f16, bf16, float8_e4m3fn, float8_e5m2, i64, i32, i16, i8,
// u64, u32, u16, u8, bool).
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace kakeya
