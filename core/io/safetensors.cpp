// Safetensors mmap reader, model-directory store and atomic writer. Header
// validation lives in safetensors_header.cpp; by the time a tensor is built
// here its dtype, shape and byte range have been checked against the file.
#include "core/io/safetensors.h"

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

// Safetensors stores little-endian data; tensors alias the file bytes directly.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors aliasing assumes a little-endian host");

namespace kakeya {

namespace {

// POSIX calls instead of std::filesystem: the PyPI libtorch.so exports its
// own std::filesystem functions, built against a newer libstdc++, and they
// interpose on the system ones (remove_all jumps to a null symbol on GCC 12).

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

const std::vector<std::pair<std::string, at::ScalarType>>& dtype_table() {
  static const std::vector<std::pair<std::string, at::ScalarType>> table = {
      {"F64", at::kDouble},
      {"F32", at::kFloat},
      {"F16", at::kHalf},
      {"BF16", at::kBFloat16},
      {"F8_E4M3", at::kFloat8_e4m3fn},
      {"F8_E5M2", at::kFloat8_e5m2},
      {"I64", at::kLong},
      {"I32", at::kInt},
      {"I16", at::kShort},
      {"I8", at::kChar},
      {"U64", at::ScalarType::UInt64},
      {"U32", at::ScalarType::UInt32},
      {"U16", at::ScalarType::UInt16},
      {"U8", at::kByte},
      {"BOOL", at::kBool},
  };
  return table;
}

// Only called with dtypes parse_safetensors_header accepted, which are exactly
// the table's; the check guards the two lists drifting apart.
at::ScalarType scalar_type_of(const std::string& dtype, const std::string& where) {
  for (const auto& [name, type] : dtype_table()) {
    if (name == dtype) return type;
  }
  KAKEYA_FAIL(where << ": dtype '" << dtype << "' has no ATen equivalent");
}

std::string dtype_name_of(at::ScalarType type, const std::string& where) {
  for (const auto& [name, t] : dtype_table()) {
    if (t == type) return name;
  }
  KAKEYA_FAIL(where << ": dtype " << type << " has no safetensors equivalent");
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

// " (N tensors; nearest: 'a', 'b', 'c')" so a typo or a naming-scheme mismatch
// (model.layers.0 vs layers.0) is visible in the error without a debugger.
std::string nearest_names(const std::string& name, const std::vector<std::string>& candidates) {
  if (candidates.empty()) return " (it holds no tensors)";
  std::vector<std::pair<size_t, const std::string*>> scored;
  for (const auto& c : candidates) scored.emplace_back(edit_distance(name, c), &c);
  const size_t k = std::min<size_t>(5, scored.size());
  std::partial_sort(scored.begin(), scored.begin() + k, scored.end(),
                    [](const auto& x, const auto& y) { return std::tie(x.first, *x.second) < std::tie(y.first, *y.second); });
  std::ostringstream os;
  os << " (" << candidates.size() << " tensors; nearest:";
  for (size_t i = 0; i < k; ++i) os << (i ? ", '" : " '") << *scored[i].second << "'";
  os << ")";
  return os.str();
}

// Closes a descriptor on scope exit; error paths would otherwise leak it.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string errno_str() { return std::strerror(errno); }

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    // Linux writes at most ~2 GiB per call; larger tensors take several.
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0 && errno == EINTR) continue;
    KAKEYA_CHECK(w > 0, path << ": write failed: " << (w < 0 ? errno_str() : "wrote 0 bytes"));
    p += w;
    n -= size_t(w);
  }
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  KAKEYA_CHECK(f.fd >= 0, path << ": cannot open: " << errno_str());
  struct stat st {};
  KAKEYA_CHECK(::fstat(f.fd, &st) == 0, path << ": cannot stat: " << errno_str());
  KAKEYA_CHECK(S_ISREG(st.st_mode), path << ": not a regular file");
  size_ = uint64_t(st.st_size);
  // mmap rejects length 0; the header parser reports such a file as truncated
  // before reading anything.
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, f.fd, 0);
    KAKEYA_CHECK(p != MAP_FAILED, path << ": mmap of " << size_ << " bytes failed: " << errno_str());
    const uint64_t n = size_;
    map_ = std::shared_ptr<void>(p, [n](void* q) { ::munmap(q, n); });
  }
  header_ = parse_safetensors_header(static_cast<const uint8_t*>(map_.get()), size_, path_);
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& kv : header_.tensors) out.push_back(kv.first);
  return out;
}

at::Tensor SafetensorsFile::get(const std::string& name) const {
  auto it = header_.tensors.find(name);
  KAKEYA_CHECK(it != header_.tensors.end(), path_ << ": no tensor '" << name << "'" << nearest_names(name, names()));
  const TensorInfo& info = it->second;
  const std::string where = path_ + ": tensor '" + name + "'";
  const auto options = at::TensorOptions().dtype(scalar_type_of(info.dtype, where)).device(at::kCPU);
  const uint64_t nbytes = info.end - info.begin;
  if (nbytes == 0) return at::empty(info.shape, options);

  const uint8_t* ptr = static_cast<const uint8_t*>(map_.get()) + header_.data_start + info.begin;
  if (info.dtype == "BOOL") {
    // ATen bools must be 0 or 1; other bytes make comparisons and sums lie.
    const uint8_t* bad = std::find_if(ptr, ptr + nbytes, [](uint8_t b) { return b > 1; });
    KAKEYA_CHECK(bad == ptr + nbytes,
                 where << ": BOOL byte " << bad - ptr << " is " << int(*bad) << ", expected 0 or 1");
  }
  // The mapping is page-aligned, so only data_start + begin can misalign.
  if (reinterpret_cast<uintptr_t>(ptr) % safetensors_dtype_size(info.dtype) != 0) {
    at::Tensor copy = at::empty(info.shape, options);
    std::memcpy(copy.data_ptr(), ptr, nbytes);
    return copy;
  }
  // The deleter does nothing itself; owning a copy of map_ is what keeps the
  // mapping alive until ATen frees the storage.
  std::shared_ptr<void> keep = map_;
  return at::from_blob(const_cast<uint8_t*>(ptr), info.shape, [keep](void*) {}, options);
}

TensorStore TensorStore::open_file(const std::string& path) {
  TensorStore store;
  store.source_ = path;
  store.files_.push_back(std::make_shared<SafetensorsFile>(path));
  for (const auto& name : store.files_[0]->names()) store.where_[name] = 0;
  return store;
}

TensorStore TensorStore::open_dir(const std::string& dir) {
  const std::string index = join(dir, "model.safetensors.index.json");
  if (!is_regular_file(index)) {
    const std::string single = join(dir, "model.safetensors");
    KAKEYA_CHECK(is_regular_file(single),
                 dir << ": neither model.safetensors nor model.safetensors.index.json exists");
    TensorStore store = open_file(single);
    store.source_ = dir;
    return store;
  }

  std::ifstream in(index, std::ios::binary);
  KAKEYA_CHECK(in, index << ": cannot open: " << errno_str());
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  KAKEYA_CHECK(!in.bad(), index << ": read failed: " << errno_str());
  const nlohmann::json root = parse_json_strict(text.data(), text.data() + text.size(), index);
  KAKEYA_CHECK(root.is_object(), index << ": is a JSON " << root.type_name() << ", expected an object");
  KAKEYA_CHECK(root.contains("weight_map"), index << ": missing field 'weight_map'");
  const nlohmann::json& weight_map = root["weight_map"];
  KAKEYA_CHECK(weight_map.is_object(),
               index << ": field 'weight_map' is a JSON " << weight_map.type_name() << ", expected an object");

  // Shards are opened once each, in sorted order, remembering one tensor per
  // shard so that a missing shard error can say who needed it.
  std::map<std::string, std::string> shard_user;
  for (const auto& kv : weight_map.items()) {
    KAKEYA_CHECK(kv.value().is_string(), index << ": weight_map tensor '" << kv.key() << "' maps to a JSON "
                                               << kv.value().type_name() << ", expected a shard file name");
    const std::string shard = kv.value().get<std::string>();
    // HF writes shards next to the index; a path here could escape the model dir.
    KAKEYA_CHECK(!shard.empty() && shard.find('/') == std::string::npos && shard != "." && shard != "..",
                 index << ": weight_map tensor '" << kv.key() << "' maps to '" << shard
                       << "', expected a file name in " << dir);
    shard_user.emplace(shard, kv.key());
  }
  TensorStore store;
  store.source_ = dir;
  // huggingface_hub stores user metadata only here, not in the shards;
  // total_size is a number and not metadata in the __metadata__ sense.
  if (root.contains("metadata")) {
    const nlohmann::json& meta = root["metadata"];
    KAKEYA_CHECK(meta.is_object(), index << ": field 'metadata' is a JSON " << meta.type_name()
                                         << ", expected an object");
    for (const auto& kv : meta.items()) {
      if (kv.value().is_string()) store.index_metadata_[kv.key()] = kv.value().get<std::string>();
    }
  }
  std::map<std::string, size_t> shard_slot;
  for (const auto& [shard, user] : shard_user) {
    const std::string p = join(dir, shard);
    KAKEYA_CHECK(is_regular_file(p), index << ": weight_map tensor '" << user << "' maps to shard '" << shard
                                           << "', which does not exist in " << dir);
    shard_slot[shard] = store.files_.size();
    store.files_.push_back(std::make_shared<SafetensorsFile>(p));
  }
  for (const auto& kv : weight_map.items()) {
    const std::string shard = kv.value().get<std::string>();
    const size_t slot = shard_slot.at(shard);
    KAKEYA_CHECK(store.files_[slot]->has(kv.key()), index << ": weight_map tensor '" << kv.key()
                                                          << "' maps to shard '" << shard
                                                          << "', which has no such tensor");
    store.where_[kv.key()] = slot;
  }
  return store;
}

std::vector<std::string> TensorStore::names() const {
  std::vector<std::string> out;
  for (const auto& kv : where_) out.push_back(kv.first);
  return out;
}

at::Tensor TensorStore::get(const std::string& name) const {
  auto it = where_.find(name);
  KAKEYA_CHECK(it != where_.end(), source_ << ": no tensor '" << name << "'" << nearest_names(name, names()));
  return files_[it->second]->get(name);
}

at::Tensor TensorStore::get(const std::string& name, at::IntArrayRef expected_shape) const {
  at::Tensor t = get(name);
  KAKEYA_CHECK(t.sizes() == expected_shape, file_of(name) << ": tensor '" << name << "' has shape " << t.sizes()
                                                          << ", expected " << expected_shape);
  return t;
}

std::string TensorStore::file_of(const std::string& name) const {
  auto it = where_.find(name);
  KAKEYA_CHECK(it != where_.end(), source_ << ": no tensor '" << name << "'" << nearest_names(name, names()));
  return files_[it->second]->path();
}

std::map<std::string, std::string> TensorStore::metadata() const {
  std::map<std::string, std::string> out = index_metadata_;
  for (const auto& f : files_) out.insert(f->header().metadata.begin(), f->header().metadata.end());
  return out;
}

void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  std::vector<at::Tensor> data;  // CPU, contiguous, in sorted name order (std::map order)
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const std::string where = path + ": tensor '" + name + "'";
    KAKEYA_CHECK(name != "__metadata__", where << ": the name is reserved for metadata");
    KAKEYA_CHECK(t.defined(), where << ": tensor is undefined");
    KAKEYA_CHECK(t.layout() == at::kStrided, where << ": layout " << t.layout() << " is not strided");
    const std::string dtype = dtype_name_of(t.scalar_type(), where);
    // to(kCPU) copies CUDA tensors; contiguous() packs views and transposes.
    at::Tensor c = t.to(at::kCPU).contiguous();
    const uint64_t nbytes = c.nbytes();
    header[name] = {{"dtype", dtype},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", nlohmann::json::array({offset, offset + nbytes})}};
    offset += nbytes;
    data.push_back(std::move(c));
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    KAKEYA_FAIL(path << ": a tensor name or metadata string is not valid UTF-8: " << e.what());
  }
  // HF pads the header with spaces so the data buffer starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');

  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  std::string tmp = join(dir, "." + path.substr(slash + 1) + ".tmp.XXXXXX");  // npos + 1 == 0
  Fd f{::mkstemp(tmp.data())};
  KAKEYA_CHECK(f.fd >= 0, path << ": cannot create a temporary file in " << dir << ": " << errno_str());
  // Removes the temp file unless the rename below succeeded.
  struct Unlink {
    const std::string& p;
    bool armed = true;
    ~Unlink() {
      if (armed) ::unlink(p.c_str());
    }
  } cleanup{tmp};

  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(text.size()) >> (8 * i));  // little-endian u64
  write_all(f.fd, len, sizeof len, tmp);
  write_all(f.fd, text.data(), text.size(), tmp);
  for (const auto& c : data) {
    if (c.nbytes() > 0) write_all(f.fd, c.data_ptr(), c.nbytes(), tmp);
  }
  // mkstemp creates 0600; a checkpoint should be as readable as any other file.
  KAKEYA_CHECK(::fchmod(f.fd, 0644) == 0, tmp << ": chmod failed: " << errno_str());
  KAKEYA_CHECK(::fsync(f.fd) == 0, tmp << ": fsync failed: " << errno_str());
  const int fd = f.fd;
  f.fd = -1;
  KAKEYA_CHECK(::close(fd) == 0, tmp << ": close failed: " << errno_str());
  KAKEYA_CHECK(::rename(tmp.c_str(), path.c_str()) == 0,
               path << ": cannot rename " << tmp << " into place: " << errno_str());
  cleanup.armed = false;
  // Persist the rename itself. The new file is already visible, so a failure
  // here only weakens crash durability and is not worth failing the save for.
  Fd d{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (d.fd >= 0) ::fsync(d.fd);
}

}  // namespace kakeya
