#include "data/capture.h"

#include <dirent.h>
#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <sstream>

#include "core/error.h"
#include "core/io/fs.h"
#include "infer/generate.h"

#ifdef KAKEYA_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace kakeya::data {

using json = nlohmann::json;

// ============================================================== sha256 (FIPS 180-4)

namespace {

struct Sha256 {
  std::array<uint32_t, 8> h{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                            0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  uint8_t buf[64];
  size_t fill = 0;
  uint64_t total = 0;

  static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
  void block(const uint8_t* p) {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) w[i] = uint32_t(p[4 * i]) << 24 | uint32_t(p[4 * i + 1]) << 16 | uint32_t(p[4 * i + 2]) << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
  }
  void update(const void* data, size_t n) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    total += n;
    while (n > 0) {
      size_t take = std::min(n, 64 - fill);
      std::memcpy(buf + fill, p, take);
      fill += take; p += take; n -= take;
      if (fill == 64) { block(buf); fill = 0; }
    }
  }
  std::string hex() {
    uint64_t bits = total * 8;
    uint8_t pad = 0x80, zero = 0;
    update(&pad, 1);
    while (fill != 56) update(&zero, 1);
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = uint8_t(bits >> (56 - 8 * i));
    update(len, 8);
    char out[65];
    for (int i = 0; i < 8; ++i) std::snprintf(out + 8 * i, 9, "%08x", h[i]);
    return std::string(out, 64);
  }
};

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  KAKEYA_CHECK(d, dir << ": cannot list directory: " << std::strerror(errno));
  while (dirent* e = ::readdir(d)) names.push_back(e->d_name);
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

std::string read_bytes(const std::string& path, size_t max_bytes = SIZE_MAX) {
  std::ifstream f(path, std::ios::binary);
  KAKEYA_CHECK(f.good(), path << ": cannot open file");
  std::string s;
  if (max_bytes == SIZE_MAX) {
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  s.resize(max_bytes);
  f.read(&s[0], (std::streamsize)max_bytes);
  s.resize((size_t)f.gcount());
  return s;
}

double now_seconds(const at::Device& dev) {
#ifdef KAKEYA_CUDA
  if (dev.is_cuda()) c10::cuda::getCurrentCUDAStream().synchronize();  // SYNC: timing boundary
#endif
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::string sha256_hex(const std::string& bytes) {
  Sha256 s;
  s.update(bytes.data(), bytes.size());
  return s.hex();
}

std::string sha256_file(const std::string& path) { return sha256_hex(read_bytes(path)); }

// ============================================================== model identity

json model_dir_identity(const std::string& dir) {
  KAKEYA_CHECK(fs::is_directory(dir), dir << ": model directory not found");
  Sha256 headers;
  json files = json::array();
  for (const auto& name : list_dir(dir)) {
    if (!ends_with(name, ".safetensors")) continue;
    const std::string path = dir + "/" + name;
    std::string prefix = read_bytes(path, 8);
    KAKEYA_CHECK(prefix.size() == 8, path << ": not a safetensors file (shorter than 8 bytes)");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | (uint8_t)prefix[i];
    KAKEYA_CHECK(n <= kMaxSafetensorsHeaderBytes, path << ": safetensors header length " << n << " is not plausible");
    std::string head = read_bytes(path, 8 + n);
    KAKEYA_CHECK(head.size() == 8 + n, path << ": truncated safetensors header");
    headers.update(head.data(), head.size());
    files.push_back(name);
  }
  KAKEYA_CHECK(!files.empty(), dir << ": no *.safetensors file");
  return json{{"dir", dir},
              {"config_sha256", sha256_file(dir + "/config.json")},
              {"safetensors", files},
              {"safetensors_headers_sha256", headers.hex()}};
}

void check_model_dir_identity(const json& recorded, const std::string& dir, const std::string& what) {
  json now = model_dir_identity(dir);
  for (const char* f : {"config_sha256", "safetensors_headers_sha256"}) {
    KAKEYA_CHECK(recorded.contains(f), what << ": field '" << f << "' missing");
    KAKEYA_CHECK(recorded[f] == now[f], what << ": captured from another model: " << f << " "
                                             << recorded[f].get<std::string>() << " (recorded, dir "
                                             << recorded.value("dir", std::string("?")) << ") != "
                                             << now[f].get<std::string>() << " (" << dir << ")");
  }
}

// ============================================================== HDF5 helpers

namespace {

// RAII for one HDF5 identifier; close is chosen by kind.
class H5 {
 public:
  using Closer = herr_t (*)(hid_t);
  H5() = default;
  H5(hid_t id, Closer c) : id_(id), close_(c) {}
  H5(H5&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  H5& operator=(H5&& o) noexcept {
    reset();
    id_ = o.id_; close_ = o.close_; o.id_ = -1;
    return *this;
  }
  ~H5() { reset(); }
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }
  // Explicit close whose failure (e.g. the final flush of a file on a full disk) is reported.
  herr_t close() {
    herr_t r = id_ >= 0 ? close_(id_) : 0;
    id_ = -1;
    return r;
  }

 private:
  void reset() { if (id_ >= 0) close_(id_); id_ = -1; }
  hid_t id_ = -1;
  Closer close_ = nullptr;
};

// The library prints its own error stacks by default; we report errors ourselves.
void quiet_hdf5() {
  static bool done = false;
  if (!done) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    done = true;
  }
}

void write_string_attr(hid_t obj, const std::string& name, const std::string& value, const std::string& where) {
  H5 type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), std::max<size_t>(1, value.size()));
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  H5Tset_strpad(type.get(), H5T_STR_NULLPAD);
  H5 space(H5Screate(H5S_SCALAR), H5Sclose);
  H5 attr(H5Acreate2(obj, name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  std::string padded = value.empty() ? std::string(1, '\0') : value;
  KAKEYA_CHECK(attr.ok() && H5Awrite(attr.get(), type.get(), padded.data()) >= 0,
               where << ": cannot write attribute '" << name << "' (disk full?)");
}

void write_int_attr(hid_t obj, const std::string& name, int64_t value, const std::string& where) {
  H5 space(H5Screate(H5S_SCALAR), H5Sclose);
  H5 attr(H5Acreate2(obj, name.c_str(), H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  KAKEYA_CHECK(attr.ok() && H5Awrite(attr.get(), H5T_NATIVE_INT64, &value) >= 0,
               where << ": cannot write attribute '" << name << "' (disk full?)");
}

std::string read_string_attr(hid_t obj, const std::string& name, const std::string& where) {
  H5 attr(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  KAKEYA_CHECK(attr.ok(), where << ": attribute '" << name << "' missing");
  H5 type(H5Aget_type(attr.get()), H5Tclose);
  KAKEYA_CHECK(H5Tget_class(type.get()) == H5T_STRING && !H5Tis_variable_str(type.get()),
               where << ": attribute '" << name << "' is not a fixed-length string");
  std::string s(H5Tget_size(type.get()), '\0');
  KAKEYA_CHECK(H5Aread(attr.get(), type.get(), &s[0]) >= 0, where << ": cannot read attribute '" << name << "'");
  s.resize(std::strlen(s.c_str()));
  return s;
}

int64_t read_int_attr(hid_t obj, const std::string& name, const std::string& where) {
  H5 attr(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  KAKEYA_CHECK(attr.ok(), where << ": attribute '" << name << "' missing");
  int64_t v = 0;
  KAKEYA_CHECK(H5Aread(attr.get(), H5T_NATIVE_INT64, &v) >= 0, where << ": cannot read attribute '" << name << "'");
  return v;
}

H5 make_group(hid_t parent, const std::string& name, const std::string& where) {
  H5 g(H5Gcreate2(parent, name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
  KAKEYA_CHECK(g.ok(), where << ": cannot create group '" << name << "' (disk full?)");
  return g;
}

// Writes a CPU tensor: int64 as int64; floats as float32, or as bfloat16 bit
// patterns in uint16 (attribute dtype says which). Chunks of about 1 MiB along
// the first axis; deflate (with byte shuffle, which groups the exponent bytes)
// when level > 0.
void write_tensor(hid_t parent, const std::string& name, const at::Tensor& t, at::ScalarType store, int level,
                  const std::string& where) {
  at::Tensor x;
  hid_t file_type, mem_type;
  const char* dtype_name;
  if (t.scalar_type() == at::kLong) {
    x = t.contiguous();
    file_type = H5T_STD_I64LE, mem_type = H5T_NATIVE_INT64, dtype_name = "int64";
  } else if (store == at::kBFloat16) {
    x = t.to(at::kBFloat16).contiguous();
    file_type = H5T_STD_U16LE, mem_type = H5T_NATIVE_UINT16, dtype_name = "bfloat16";
  } else {
    x = t.to(at::kFloat).contiguous();
    file_type = H5T_IEEE_F32LE, mem_type = H5T_NATIVE_FLOAT, dtype_name = "float32";
  }
  std::vector<hsize_t> dims(x.sizes().begin(), x.sizes().end());
  H5 space(H5Screate_simple((int)dims.size(), dims.data(), nullptr), H5Sclose);
  H5 dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  const int64_t row = x.numel() / std::max<int64_t>(1, x.size(0)) * x.element_size();
  std::vector<hsize_t> chunk = dims;
  chunk[0] = (hsize_t)std::clamp<int64_t>((1 << 20) / std::max<int64_t>(1, row), 1, std::max<int64_t>(1, x.size(0)));
  H5Pset_chunk(dcpl.get(), (int)chunk.size(), chunk.data());
  if (level > 0) {
    H5Pset_shuffle(dcpl.get());
    H5Pset_deflate(dcpl.get(), (unsigned)level);
  }
  H5 ds(H5Dcreate2(parent, name.c_str(), file_type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT), H5Dclose);
  KAKEYA_CHECK(ds.ok(), where << ": cannot create dataset '" << name << "' (disk full?)");
  KAKEYA_CHECK(H5Dwrite(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, x.data_ptr()) >= 0,
               where << ": cannot write dataset '" << name << "' (disk full?)");
  write_string_attr(ds.get(), "dtype", dtype_name, where + "/" + name);
}

// Reads a dataset written by write_tensor into a CPU tensor (int64, float32 or bfloat16).
at::Tensor read_tensor(hid_t parent, const std::string& name, const std::string& where) {
  H5 ds(H5Dopen2(parent, name.c_str(), H5P_DEFAULT), H5Dclose);
  KAKEYA_CHECK(ds.ok(), where << ": dataset '" << name << "' missing");
  const std::string dt = read_string_attr(ds.get(), "dtype", where + "/" + name);
  H5 space(H5Dget_space(ds.get()), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  std::vector<hsize_t> dims(std::max(rank, 0));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  std::vector<int64_t> shape(dims.begin(), dims.end());
  at::Tensor out;
  hid_t mem_type;
  if (dt == "int64") out = at::empty(shape, at::kLong), mem_type = H5T_NATIVE_INT64;
  else if (dt == "float32") out = at::empty(shape, at::kFloat), mem_type = H5T_NATIVE_FLOAT;
  else if (dt == "bfloat16") out = at::empty(shape, at::kShort), mem_type = H5T_NATIVE_UINT16;
  else KAKEYA_FAIL(where << "/" << name << ": unknown dtype attribute '" << dt << "'");
  KAKEYA_CHECK(H5Dread(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data_ptr()) >= 0,
               where << ": cannot read dataset '" << name << "' (corrupt file?)");
  return dt == "bfloat16" ? out.view(at::kBFloat16) : out;
}

std::string layer_group(int64_t l) {
  char b[32];
  std::snprintf(b, sizeof b, "layer_%02lld", (long long)l);
  return b;
}

std::string seq_group(int64_t i) {
  char b[32];
  std::snprintf(b, sizeof b, "seq_%06lld", (long long)i);
  return b;
}

std::string shard_name(int64_t s) {
  char b[32];
  std::snprintf(b, sizeof b, "shard-%05lld.h5", (long long)s);
  return b;
}

const char* store_dtype_name(at::ScalarType t) { return t == at::kBFloat16 ? "bfloat16" : "float32"; }

// First path where a and b differ ("" if equal), ignoring keys named "dir"
// (a model may move; its hashes identify it).
std::string json_diff(const json& a, const json& b, const std::string& path) {
  if (a.is_object() && b.is_object()) {
    for (auto it = a.begin(); it != a.end(); ++it) {
      if (it.key() == "dir") continue;
      if (!b.contains(it.key())) return path + "." + it.key();
      auto d = json_diff(it.value(), b[it.key()], path + "." + it.key());
      if (!d.empty()) return d;
    }
    for (auto it = b.begin(); it != b.end(); ++it)
      if (it.key() != "dir" && !a.contains(it.key())) return path + "." + it.key();
    return "";
  }
  return a == b ? "" : path;
}

const json& at_path(const json& j, const std::string& path) {
  const json* p = &j;
  std::stringstream ss(path);
  std::string part;
  while (std::getline(ss, part, '.'))
    if (!part.empty()) {
      if (!p->is_object() || !p->contains(part)) {
        static const json missing = "(missing)";
        return missing;
      }
      p = &(*p)[part];
    }
  return *p;
}

}  // namespace

// ============================================================== reader

struct CaptureReader::Impl {
  std::string dir;                // "" for a single file
  json manifest;
  std::vector<LayerType> layer_types;
  int64_t drafter_layers = 0;
  struct Entry {
    size_t file;
    int64_t index, length;
  };
  std::vector<std::string> files;  // shard paths
  std::vector<Entry> entries;
  mutable std::vector<H5> open;    // per file, opened on first read
  int64_t tokens = 0;

  void index_manifest() {
    for (const auto& lt : manifest.at("identity").at("verifier").at("layer_types"))
      layer_types.push_back(lt.get<std::string>() == "full_attention" ? LayerType::Full : LayerType::Sliding);
    drafter_layers = manifest.at("identity").at("drafter").at("num_layers").get<int64_t>();
  }
  void add_shard(const std::string& path, const json& shard) {
    files.push_back(path);
    int64_t first = shard.at("first").get<int64_t>();
    const auto& lengths = shard.at("lengths");
    for (size_t i = 0; i < lengths.size(); ++i) {
      entries.push_back({files.size() - 1, first + (int64_t)i, lengths[i].get<int64_t>()});
      tokens += lengths[i].get<int64_t>();
    }
  }
  hid_t file(size_t f) const {
    if (open.size() < files.size()) open.resize(files.size());
    if (!open[f].ok()) {
      open[f] = H5(H5Fopen(files[f].c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
      KAKEYA_CHECK(open[f].ok(), files[f] << ": cannot open as HDF5 (missing or corrupt shard)");
    }
    return open[f].get();
  }
};

CaptureReader::CaptureReader(const std::string& path) : impl_(std::make_unique<Impl>()) {
  quiet_hdf5();
  auto& m = *impl_;
  try {
    if (fs::is_directory(path)) {
      m.dir = path;
      const std::string mp = path + "/capture.json";
      KAKEYA_CHECK(fs::exists(mp), mp << ": not found (not a capture directory?)");
      std::ifstream f(mp);
      m.manifest = json::parse(f);
      for (const auto& sh : m.manifest.at("shards")) m.add_shard(path + "/" + sh.at("file").get<std::string>(), sh);
    } else {
      KAKEYA_CHECK(fs::exists(path), path << ": capture file not found");
      KAKEYA_CHECK(!ends_with(path, ".tmp"), path << ": a half-written shard (.tmp) is never read");
      H5 f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
      KAKEYA_CHECK(f.ok(), path << ": cannot open as HDF5");
      KAKEYA_CHECK(read_string_attr(f.get(), "format", path) == kCaptureFormat,
                   path << ": attribute 'format' is not " << kCaptureFormat);
      m.manifest = json::parse(read_string_attr(f.get(), "manifest", path));
      m.add_shard(path, json::parse(read_string_attr(f.get(), "shard", path)));
    }
    KAKEYA_CHECK(m.manifest.value("format", "") == kCaptureFormat,
                 path << ": manifest 'format' expected " << kCaptureFormat << ", got "
                      << m.manifest.value("format", "(none)"));
    m.index_manifest();
  } catch (const json::exception& e) {
    KAKEYA_FAIL(path << ": malformed capture manifest: " << e.what());
  }
}

CaptureReader::~CaptureReader() = default;
CaptureReader::CaptureReader(CaptureReader&&) noexcept = default;
CaptureReader& CaptureReader::operator=(CaptureReader&&) noexcept = default;

int64_t CaptureReader::size() const { return (int64_t)impl_->entries.size(); }
int64_t CaptureReader::total_tokens() const { return impl_->tokens; }
const json& CaptureReader::manifest() const { return impl_->manifest; }
bool CaptureReader::complete() const { return impl_->manifest.value("complete", false); }
const std::vector<LayerType>& CaptureReader::layer_types() const { return impl_->layer_types; }
int64_t CaptureReader::num_layers() const { return (int64_t)impl_->layer_types.size(); }
int64_t CaptureReader::drafter_layers() const { return impl_->drafter_layers; }

void CaptureReader::check_models(const std::string& verifier_dir, const std::string& drafter_dir) const {
  const auto& id = impl_->manifest.at("identity");
  check_model_dir_identity(id.at("verifier"), verifier_dir, "capture manifest: verifier");
  check_model_dir_identity(id.at("drafter"), drafter_dir, "capture manifest: drafter");
}

int64_t CaptureReader::length(int64_t i) const {
  KAKEYA_CHECK(i >= 0 && i < size(), "capture: sequence " << i << " outside [0, " << size() << ")");
  return impl_->entries[i].length;
}

CaptureSequence CaptureReader::read(int64_t i, at::ScalarType dtype, at::Device device,
                                    const CaptureFields& fields) const {
  KAKEYA_CHECK(i >= 0 && i < size(), "capture: sequence " << i << " outside [0, " << size() << ")");
  const auto& e = impl_->entries[i];
  const std::string& path = impl_->files[e.file];
  const std::string gname = seq_group(e.index);
  const std::string where = path + ":/" + gname;
  H5 g(H5Gopen2(impl_->file(e.file), gname.c_str(), H5P_DEFAULT), H5Gclose);
  KAKEYA_CHECK(g.ok(), path << ": group '/" << gname << "' missing");
  CaptureSequence s;
  s.index = e.index;
  s.source = read_string_attr(g.get(), "source", where);
  s.prompt_len = read_int_attr(g.get(), "prompt_len", where);
  s.tokens = read_tensor(g.get(), "tokens", where).to(device);
  s.positions = read_tensor(g.get(), "positions", where).to(device);
  KAKEYA_CHECK(s.tokens.dim() == 1 && s.tokens.size(0) == e.length,
               where << "/tokens: expected [" << e.length << "], got " << s.tokens.sizes());
  auto conv = [&](const at::Tensor& t) { return t.to(device, dtype); };
  for (int64_t l = 0; l < num_layers(); ++l) {
    if (!fields.q && !fields.kv && !fields.o) break;
    const std::string lg = layer_group(l);
    H5 gl(H5Gopen2(g.get(), lg.c_str(), H5P_DEFAULT), H5Gclose);
    KAKEYA_CHECK(gl.ok(), where << ": group '" << lg << "' missing");
    const std::string lw = where + "/" + lg;
    if (fields.q) s.q.push_back(conv(read_tensor(gl.get(), "q", lw)));
    if (fields.kv) {
      s.k.push_back(conv(read_tensor(gl.get(), "k", lw)));
      s.v.push_back(conv(read_tensor(gl.get(), "v", lw)));
    }
    if (fields.o) s.o.push_back(conv(read_tensor(gl.get(), "o", lw)));
  }
  if (fields.drafter) {
    H5 gd(H5Gopen2(g.get(), "drafter", H5P_DEFAULT), H5Gclose);
    KAKEYA_CHECK(gd.ok(), where << ": group 'drafter' missing");
    s.dk = conv(read_tensor(gd.get(), "k", where + "/drafter"));
    s.dv = conv(read_tensor(gd.get(), "v", where + "/drafter"));
  }
  return s;
}

// ============================================================== writer

json CaptureReport::to_json() const {
  return json{{"sequences", sequences},
              {"tokens", tokens},
              {"resumed_sequences", resumed_sequences},
              {"seconds", seconds},
              {"bytes", bytes},
              {"bench",
               {{"verifier_alone_seconds", bench_verifier_seconds},
                {"capture_seconds", bench_capture_seconds},
                {"plain_forward_seconds", bench_forward_seconds},
                {"tapped_forward_seconds", bench_tapped_seconds},
                {"write_seconds", bench_write_seconds},
                {"capture_cost_ratio", capture_cost_ratio()},
                {"forward_cost_ratio", forward_cost_ratio()}}}};
}

namespace {

void write_sequence(hid_t file, const CaptureSequence& s, at::ScalarType store, int level, const std::string& path) {
  const std::string gname = seq_group(s.index);
  const std::string where = path + ":/" + gname;
  H5 g = make_group(file, gname, path);
  write_string_attr(g.get(), "source", s.source, where);
  write_int_attr(g.get(), "prompt_len", s.prompt_len, where);
  write_int_attr(g.get(), "length", s.length(), where);
  write_tensor(g.get(), "tokens", s.tokens, store, level, where);
  write_tensor(g.get(), "positions", s.positions, store, level, where);
  for (size_t l = 0; l < s.q.size(); ++l) {
    H5 gl = make_group(g.get(), layer_group((int64_t)l), where);
    const std::string lw = where + "/" + layer_group((int64_t)l);
    write_tensor(gl.get(), "q", s.q[l], store, level, lw);
    write_tensor(gl.get(), "k", s.k[l], store, level, lw);
    write_tensor(gl.get(), "v", s.v[l], store, level, lw);
    write_tensor(gl.get(), "o", s.o[l], store, level, lw);
  }
  H5 gd = make_group(g.get(), "drafter", where);
  write_tensor(gd.get(), "k", s.dk, store, level, where + "/drafter");
  write_tensor(gd.get(), "v", s.dv, store, level, where + "/drafter");
}

int64_t file_bytes(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? (int64_t)st.st_size : 0;
}

}  // namespace

CaptureReport run_capture(const Model& verifier, const std::string& verifier_dir, const Drafter& drafter,
                          const std::string& drafter_dir, const std::vector<CapturePrompt>& prompts,
                          const CaptureOptions& opt, const std::function<void(const CaptureProgress&)>& progress) {
  quiet_hdf5();
  KAKEYA_CHECK(!opt.out_dir.empty(), "capture: no output directory");
  KAKEYA_CHECK(opt.gen_len >= 0, "capture: gen_len expected >= 0, got " << opt.gen_len);
  KAKEYA_CHECK(opt.seqs_per_shard > 0, "capture: seqs_per_shard expected > 0, got " << opt.seqs_per_shard);
  KAKEYA_CHECK(opt.deflate >= 0 && opt.deflate <= 9, "capture: deflate level expected 0..9, got " << opt.deflate);
  KAKEYA_CHECK(!prompts.empty(), "capture: no prompts");
  KAKEYA_CHECK(opt.world >= 1 && opt.rank >= 0 && opt.rank < opt.world,
               "capture: rank " << opt.rank << " of " << opt.world << " (expected 0 <= rank < world)");
  const bool sharded = opt.world > 1;
  const at::ScalarType store = opt.store_dtype.value_or(verifier.dtype());
  KAKEYA_CHECK(store == at::kFloat || store == at::kBFloat16,
               "capture: store dtype must be float32 or bfloat16, got " << c10::toString(store));
  // The loaded models must be the directories' models (their hashes go into the manifest).
  const ModelConfig on_disk = ModelConfig::from_file(verifier_dir + "/config.json");
  KAKEYA_CHECK(on_disk.summary() == verifier.config().summary(),
               verifier_dir << "/config.json: does not describe the loaded verifier");
  KAKEYA_CHECK(DrafterConfig::from_file(drafter_dir + "/config.json").to_json() == drafter.config().to_json(),
               drafter_dir << "/config.json: does not describe the loaded drafter");

  const auto& cfg = verifier.config();
  const auto& dc = drafter.config();
  json layers = json::array(), layer_types = json::array();
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    layer_types.push_back(layer_type_name(cfg.layer_types[l]));
    layers.push_back({{"q", {cfg.num_heads, cfg.layer_head_dim[l]}},
                      {"kv", {cfg.kv_heads(l), cfg.layer_head_dim[l]}},
                      {"o", {cfg.hidden_size}},
                      {"k_eq_v", cfg.k_eq_v(l)}});
  }
  Sha256 ph;
  for (const auto& p : prompts) {
    int64_t n = (int64_t)p.ids.size();
    ph.update(&n, sizeof n);
    ph.update(p.ids.data(), p.ids.size() * sizeof(int64_t));
    ph.update(p.source.data(), p.source.size() + 1);
  }
  json vid = model_dir_identity(verifier_dir), did = model_dir_identity(drafter_dir);
  vid["dtype"] = c10::toString(verifier.dtype());
  vid["config"] = cfg.summary();
  vid["layer_types"] = layer_types;
  vid["layers"] = layers;
  did["dtype"] = c10::toString(drafter.dtype());
  did["config"] = dc.to_json();
  did["num_layers"] = dc.num_layers;
  did["kv"] = {dc.num_kv_heads, dc.head_dim};
  did["target_layer_ids"] = dc.target_layer_ids;
  const int64_t N = (int64_t)prompts.size();
  const json identity{{"verifier", vid},
                      {"drafter", did},
                      {"store_dtype", store_dtype_name(store)},
                      {"gen_len", opt.gen_len},
                      {"stop_ids", opt.stop_ids},
                      {"seqs_per_shard", opt.seqs_per_shard},
                      {"num_sequences", N},
                      {"prompts_sha256", ph.hex()},
                      {"inputs", opt.inputs}};

  fs::make_dirs(opt.out_dir);
  const std::string mpath = opt.out_dir + "/capture.json";
  json shards = json::array();
  CaptureReport rep;
  if (fs::exists(mpath)) {
    json old;
    try {
      std::ifstream f(mpath);
      old = json::parse(f);
    } catch (const json::exception& e) {
      KAKEYA_FAIL(mpath << ": not valid JSON (" << e.what() << "); remove the directory to start over");
    }
    KAKEYA_CHECK(old.value("format", "") == kCaptureFormat,
                 mpath << ": format expected " << kCaptureFormat << ", got " << old.value("format", "(none)"));
    const std::string d = json_diff(old.at("identity"), identity, "identity");
    KAKEYA_CHECK(d.empty(), mpath << ": cannot resume: " << d << " differs (recorded " << at_path(old, d).dump()
                                  << ", now " << at_path(json{{"identity", identity}}, d).dump()
                                  << "); use another --out or remove it");
    // Complete shards whose files are still there, in order; the first gap ends the resume.
    // (Several ranks look at the shard files themselves, below.)
    for (const auto& sh : sharded ? json::array() : old.at("shards")) {
      if (!fs::exists(opt.out_dir + "/" + sh.at("file").get<std::string>())) break;
      shards.push_back(sh);
      rep.resumed_sequences += sh.at("count").get<int64_t>();
    }
  }
  const int64_t num_shards = (N + opt.seqs_per_shard - 1) / opt.seqs_per_shard;
  auto mine = [&](int64_t s) { return s % opt.world == opt.rank; };
  // Leftovers of a killed run are never taken for complete; with several ranks, only this
  // rank's (another rank may be writing its own right now).
  for (int64_t s = 0; s < num_shards; ++s) {
    const std::string tmp = opt.out_dir + "/" + shard_name(s) + ".tmp";
    if (mine(s) && fs::exists(tmp)) ::unlink(tmp.c_str());
  }
  // Several ranks: shard s is complete when its file is there and carries this identity.
  const std::string manifest_attr = json{{"format", kCaptureFormat}, {"identity", identity}}.dump();
  auto complete_shard = [&](int64_t s) -> std::optional<json> {
    const std::string path = opt.out_dir + "/" + shard_name(s);
    if (!fs::exists(path)) return std::nullopt;
    H5 f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    if (!f.ok() || read_string_attr(f.get(), "manifest", path) != manifest_attr) return std::nullopt;
    json sh = json::parse(read_string_attr(f.get(), "shard", path));
    sh["bytes"] = file_bytes(path);
    return sh;
  };

  auto write_manifest = [&](bool complete) {
    int64_t seqs = 0, toks = 0, bytes = 0;
    for (const auto& sh : shards) {
      seqs += sh.at("count").get<int64_t>();
      toks += sh.at("tokens").get<int64_t>();
      bytes += sh.at("bytes").get<int64_t>();
    }
    rep.sequences = seqs, rep.tokens = toks, rep.bytes = bytes;
    json m{{"format", kCaptureFormat},
           {"identity", identity},
           {"shards", shards},
           {"sequences", seqs},
           {"tokens", toks},
           {"bytes", bytes},
           {"complete", complete},
           {"writer", {{"deflate", opt.deflate}, {"shuffle", opt.deflate > 0}, {"command_line", opt.command_line}}}};
    fs::write_atomic(mpath, m.dump(2) + "\n");
  };
  if (!sharded) write_manifest((int64_t)shards.size() == num_shards);

  const at::Device dev = verifier.device();
  const double t_start = now_seconds(dev);
  CaptureProgress pr;
  pr.total_seqs = N;
  std::vector<bool> todo(num_shards, true);  // several ranks: this rank's shards not yet on disk
  if (sharded) {  // this rank's share; its complete shards count as resumed
    pr.total_seqs = 0;
    for (int64_t s = 0; s < num_shards; ++s) {
      todo[s] = mine(s) && !complete_shard(s);
      if (!mine(s)) continue;
      const int64_t count = std::min(N, (s + 1) * opt.seqs_per_shard) - s * opt.seqs_per_shard;
      pr.total_seqs += count;
      if (!todo[s]) rep.resumed_sequences += count;
    }
  }
  pr.done_seqs = rep.resumed_sequences;
  int64_t benched = 0;
  if (progress) progress(pr);  // before any work: what is left
  for (int64_t s = (int64_t)shards.size(); s < num_shards; ++s) {
    if (!todo[s]) continue;
    const std::string name = shard_name(s);
    const std::string path = opt.out_dir + "/" + name, tmp = path + ".tmp";
    const int64_t first = s * opt.seqs_per_shard, last = std::min(N, first + opt.seqs_per_shard);
    json lengths = json::array();
    int64_t shard_tokens = 0;
    std::future<void> writing;  // the previous sequence's write_sequence
    bool last_benched = false;
    auto drain = [&] {
      if (writing.valid()) writing.get();  // rethrows the writer's error here
    };
    try {
      H5 file(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
      KAKEYA_CHECK(file.ok(), tmp << ": cannot create HDF5 file (directory writable? disk full?)");
      for (int64_t i = first; i < last; ++i) {
        const auto& p = prompts[i];
        KAKEYA_CHECK(!p.ids.empty(), "capture: prompt " << i << " is empty");
        const double t0 = now_seconds(dev);
        std::vector<int64_t> seq = p.ids;
        if (opt.gen_len > 0) {
          DecodeOptions g;
          g.max_new_tokens = opt.gen_len;
          g.stop_ids = opt.stop_ids;
          g.stream = false;
          auto r = generate(verifier, p.ids, g);
          seq.insert(seq.end(), r.tokens.begin(), r.tokens.end());
        }
        const double t1 = now_seconds(dev);
        const bool bench = benched < opt.bench_seqs;
        double t_plain = 0;
        if (bench) {  // the verifier alone: one plain forward over the same sequence
          KVCache cache(cfg, verifier.cache_options((int64_t)seq.size()));
          ForwardOptions fo;
          fo.skip_logits = true;
          const double a = now_seconds(dev);
          verifier.forward(at::tensor(seq, at::kLong).view({1, (int64_t)seq.size()}).to(dev), cache, fo);
          t_plain = now_seconds(dev) - a;
        }
        const double t2 = now_seconds(dev);
        CaptureSequence cs = capture_sequence(verifier, drafter, seq);
        cs.index = i;
        cs.source = p.source;
        cs.prompt_len = (int64_t)p.ids.size();
        const double t3 = now_seconds(dev);
        // The previous sequence's write (HDF5 compression on the host) ran while this one was
        // generated and captured on the device; wait for it, then hand this one over. One write
        // in flight keeps the serial HDF5 library on one thread at a time.
        drain();
        const double t4 = now_seconds(dev);
        const int64_t len = cs.length();
        writing = std::async(std::launch::async, [&file, seq = std::move(cs), store, level = opt.deflate, tmp] {
          write_sequence(file.get(), seq, store, level, tmp);
        });
        last_benched = bench;
        if (bench) {
          ++benched;
          rep.bench_verifier_seconds += (t1 - t0) + t_plain;
          rep.bench_capture_seconds += (t1 - t0) + (t4 - t3) + (t3 - t2);
          rep.bench_forward_seconds += t_plain;
          rep.bench_tapped_seconds += t3 - t2;
          rep.bench_write_seconds += t4 - t3;
        }
        lengths.push_back(len);
        shard_tokens += len;
        pr.done_seqs += 1;
        pr.done_tokens += len;
        pr.seconds = now_seconds(dev) - t_start;
        if (progress) progress(pr);
      }
      const double td = now_seconds(dev);
      drain();
      if (last_benched) rep.bench_write_seconds += now_seconds(dev) - td, rep.bench_capture_seconds += now_seconds(dev) - td;
      json shard{{"file", name}, {"first", first}, {"count", last - first}, {"tokens", shard_tokens},
                 {"lengths", lengths}};
      write_string_attr(file.get(), "format", kCaptureFormat, tmp);
      write_string_attr(file.get(), "manifest", json{{"format", kCaptureFormat}, {"identity", identity}}.dump(), tmp);
      write_string_attr(file.get(), "shard", shard.dump(), tmp);
      KAKEYA_CHECK(file.close() >= 0, tmp << ": closing (final flush) failed (disk full?)");
      int fd = ::open(tmp.c_str(), O_RDONLY);
      KAKEYA_CHECK(fd >= 0 && ::fsync(fd) == 0, tmp << ": fsync failed: " << std::strerror(errno));
      ::close(fd);
      KAKEYA_CHECK(::rename(tmp.c_str(), path.c_str()) == 0,
                   path << ": cannot rename from " << tmp << ": " << std::strerror(errno));
      shard["bytes"] = file_bytes(path);
      shards.push_back(shard);
    } catch (...) {
      if (writing.valid()) writing.wait();  // its error, if any, is superseded by the one in flight
      ::unlink(tmp.c_str());  // a partial shard is never left looking usable (and frees the disk)
      throw;
    }
    if (!sharded) write_manifest(s + 1 == num_shards);
  }
  if (sharded) {
    // The manifest only once every rank's shards are on disk (whichever rank sees that writes it).
    json all = json::array();
    for (int64_t s = 0; s < num_shards; ++s)
      if (auto sh = complete_shard(s)) all.push_back(*sh);
    if ((int64_t)all.size() == num_shards) {
      shards = all;
      write_manifest(true);
    }
  }
  rep.seconds = now_seconds(dev) - t_start;
  return rep;
}

}  // namespace kakeya::data
