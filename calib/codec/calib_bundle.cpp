#include "calib/codec/calib_bundle.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/io/fs.h"
#include "core/io/safetensors.h"

namespace kakeya {

using json = nlohmann::json;

// The fields that decide the shape and meaning of every calibrated tensor, in a
// fixed list (not ModelConfig::summary(), which grows with new families and would
// orphan every shipped bundle). Adding a field here invalidates existing bundles.
static json hashed_identity(const ModelConfig& cfg) {
  json types = json::array();
  for (LayerType t : cfg.layer_types) types.push_back(layer_type_name(t));
  return {{"model_type", cfg.model_type},          {"vocab_size", cfg.vocab_size},
          {"hidden_size", cfg.hidden_size},        {"num_layers", cfg.num_layers},
          {"num_heads", cfg.num_heads},            {"layer_head_dim", cfg.layer_head_dim},
          {"layer_kv_heads", cfg.layer_kv_heads},  {"layer_types", types},
          {"sliding_window", cfg.sliding_window},  {"rope_full_theta", cfg.rope_full.theta},
          {"rope_sliding_theta", cfg.rope_sliding.theta}};
}

std::string config_hash(const ModelConfig& cfg) {
  const std::string s = hashed_identity(cfg).dump();
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "fnv1a64:%016llx", (unsigned long long)h);
  return buf;
}

json model_identity(const ModelConfig& cfg) {
  return {{"config_hash", config_hash(cfg)},
          {"model_type", cfg.model_type},
          {"num_layers", cfg.num_layers},
          {"layer_kv_heads", cfg.layer_kv_heads},
          {"num_heads", cfg.num_heads},
          {"layer_head_dim", cfg.layer_head_dim}};
}

static json read_json_file(const std::string& path) {
  std::ifstream f(path);
  KAKEYA_CHECK(f.good(), path << ": cannot open (not a calibration bundle? run `kakeya calibrate sigma-q --out DIR`)");
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    KAKEYA_FAIL(path << ": not valid JSON: " << e.what());
  }
}

static void write_json_atomic(const std::string& path, const json& j) { fs::write_atomic(path, j.dump(2) + "\n"); }

json CalibBundle::check_manifest(const std::string& dir, const ModelConfig& cfg) {
  const std::string path = dir + "/manifest.json";
  json m = read_json_file(path);
  KAKEYA_CHECK(m.is_object() && m.value("format", "") == kCalibFormat,
               path << ": field 'format' expected \"" << kCalibFormat << "\", got "
                    << (m.is_object() && m.contains("format") ? m["format"].dump() : "nothing"));
  KAKEYA_CHECK(m.contains("model") && m["model"].is_object() && m["model"].contains("config_hash"),
               path << ": field 'model.config_hash' is missing");
  const json want = model_identity(cfg);
  const json& got = m["model"];
  if (got["config_hash"] != want["config_hash"]) {
    std::ostringstream os;
    os << path << ": field 'model.config_hash' is " << got["config_hash"].dump() << " (model_type "
       << got.value("model_type", "?") << ", " << got.value("num_layers", json()).dump() << " layers, head dims "
       << got.value("layer_head_dim", json()).dump() << ") but the model is " << want["config_hash"].dump()
       << " (model_type " << cfg.model_type << ", " << cfg.num_layers << " layers, head dims "
       << want["layer_head_dim"].dump() << "): this bundle was calibrated for another model";
    throw Error(os.str());
  }
  return m;
}

void CalibBundle::prepare_dir(const std::string& dir, const ModelConfig& cfg) {
  fs::make_dirs(dir);
  if (fs::exists(dir + "/manifest.json")) {
    check_manifest(dir, cfg);
  } else {
    write_json_atomic(dir + "/manifest.json",
                      {{"format", kCalibFormat}, {"model", model_identity(cfg)}, {"entries", json::object()}});
  }
}

void CalibBundle::update_manifest(const std::string& dir, const ModelConfig& cfg, const std::string& entry,
                                  const json& value) {
  fs::make_dirs(dir);
  json m;
  if (fs::exists(dir + "/manifest.json")) {
    m = check_manifest(dir, cfg);
  } else {
    m = {{"format", kCalibFormat}, {"model", model_identity(cfg)}, {"entries", json::object()}};
  }
  m["entries"][entry] = value;
  write_json_atomic(dir + "/manifest.json", m);
}

void CalibBundle::write_f32(const std::string& path, const std::vector<float>& v) {
  std::string bytes;
  for (float x : v) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    for (int i = 0; i < 4; ++i) bytes.push_back((char)(unsigned char)(u >> (8 * i)));  // little-endian whatever the host
  }
  fs::write_atomic(path, bytes);
}

std::vector<float> CalibBundle::read_f32(const std::string& path, int64_t expected_count) {
  std::ifstream f(path, std::ios::binary);
  KAKEYA_CHECK(f.good(), path << ": cannot open");
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  KAKEYA_CHECK((int64_t)bytes.size() == 4 * expected_count,
               path << ": expected " << expected_count << " little-endian f32 values (" << 4 * expected_count
                    << " bytes), found " << bytes.size() << " bytes");
  std::vector<float> v(expected_count);
  for (int64_t i = 0; i < expected_count; ++i) {
    const unsigned char* b = (const unsigned char*)bytes.data() + 4 * i;
    uint32_t u = b[0] | (b[1] << 8) | (b[2] << 16) | ((uint32_t)b[3] << 24);
    std::memcpy(&v[i], &u, 4);
  }
  return v;
}

namespace {

void finite(const at::Tensor& t, const std::string& what) {
  KAKEYA_CHECK(at::isfinite(t).all().item<bool>(), what << ": contains NaN or Inf");
}

// The manifest entry "k_weights" of a bundle's entries: per layer [n_kv, D] (undefined on sliding
// layers); empty when the bundle has none.
std::vector<at::Tensor> read_k_weights(const std::string& dir, const json& ent, const ModelConfig& cfg) {
  std::vector<at::Tensor> out;
  if (!ent.contains("k_weights")) return out;
  const std::string path = dir + "/" + ent["k_weights"].value("file", "k_weights.safetensors");
  auto st = TensorStore::open_file(path);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const std::string name = "layer_" + std::to_string(l) + "_k_weight";
    if (cfg.is_sliding(l)) {
      out.emplace_back();
      continue;
    }
    auto w = st.get(name, {cfg.kv_heads(l), cfg.layer_head_dim[l]}).to(at::kFloat).clone();
    finite(w, path + " tensor " + name);
    KAKEYA_CHECK(w.gt(0).all().item<bool>(), path << " tensor " << name << ": weights must be > 0");
    out.push_back(w);
  }
  return out;
}

}  // namespace

std::vector<at::Tensor> CalibBundle::load_k_weights(const std::string& dir, const ModelConfig& cfg) {
  const json m = check_manifest(dir, cfg);
  auto w = read_k_weights(dir, m.value("entries", json::object()), cfg);
  KAKEYA_CHECK(!w.empty(), dir << ": bundle has no K weights (run `kakeya calibrate k-weights --out " << dir << "`)");
  return w;
}

std::string CalibBundle::layer_codes(const std::string& dir, const ModelConfig& cfg) {
  const json m = check_manifest(dir, cfg);
  const json& e = m.value("entries", json::object());
  KAKEYA_CHECK(e.contains("layer_codes") && e["layer_codes"].is_object() && e["layer_codes"].contains("code") &&
                   e["layer_codes"]["code"].is_string(),
               dir << "/manifest.json: no entry 'layer_codes.code' (run `kakeya calibrate layer-codes --out " << dir
                   << "` to choose the full-attention codes --full-code auto reads)");
  return e["layer_codes"]["code"].get<std::string>();
}

CalibBundle CalibBundle::load(const std::string& dir, const ModelConfig& cfg) {
  CalibBundle b;
  b.dir_ = dir;
  b.manifest_ = check_manifest(dir, cfg);
  const json& ent = b.manifest_.value("entries", json::object());
  const int64_t L = cfg.num_layers;
  if (ent.contains("sigma_q")) {
    const std::string path = dir + "/" + ent["sigma_q"].value("file", "q_calib.safetensors");
    auto st = TensorStore::open_file(path);
    for (int64_t l = 0; l < L; ++l) {
      const int64_t D = cfg.layer_head_dim[l], H = cfg.kv_heads(l);
      const std::string p = "layer_" + std::to_string(l) + "_";
      b.chol_.push_back(st.get(p + "chol", {H, D, D}).to(at::kFloat).clone());
      b.inv_chol_.push_back(st.get(p + "inv_chol", {H, D, D}).to(at::kFloat).clone());
      b.sigma_.push_back(st.get(p + "sigma", {H, D, D}).to(at::kFloat).clone());
      finite(b.chol_.back(), path + " tensor " + p + "chol");
      finite(b.inv_chol_.back(), path + " tensor " + p + "inv_chol");
    }
  }
  b.k_weight_ = read_k_weights(dir, ent, cfg);
  if (ent.contains("basis")) {
    const std::string path = dir + "/" + ent["basis"].value("file", "pca_basis.safetensors");
    auto st = TensorStore::open_file(path);
    for (const std::string kind : {"k", "kw", "v"}) {
      if (!st.has("layer_0_" + kind + "_basis")) continue;
      for (int64_t l = 0; l < L; ++l) {
        const int64_t D = cfg.layer_head_dim[l], H = cfg.kv_heads(l);
        const std::string p = "layer_" + std::to_string(l) + "_" + kind;
        b.basis_[kind].push_back(st.get(p + "_basis", {H, D, D}).to(at::kFloat).clone());
        b.eig_[kind].push_back(st.get(p + "_eig", {H, D}).to(at::kFloat).clone());
        finite(b.basis_[kind].back(), path + " tensor " + p + "_basis");
      }
    }
  }
  if (ent.contains("codebook")) {
    const json& cb = ent["codebook"];
    for (const auto& s : cb.value("streams", json::array({"k", "v"}))) {
      const char c = s.get<std::string>()[0];
      for (const auto& bj : cb.value("bits", json::array({1, 2, 3, 4}))) {
        const int bits = bj.get<int>();
        KAKEYA_CHECK(bits >= 1 && bits <= 4, dir << "/manifest.json: field 'entries.codebook.bits' has " << bits
                                                 << " (expected 1..4)");
        const std::string path = dir + "/codebook_" + std::string(1, c) + "_b" + std::to_string(bits) + ".f32";
        const int64_t k = int64_t(1) << bits;
        auto v = read_f32(path, L * k);
        auto& tables = b.codebooks_[{c, bits}];
        for (int64_t l = 0; l < L; ++l) {
          ScalarCodebook t;
          t.centroids.assign(v.begin() + l * k, v.begin() + (l + 1) * k);
          t.validate(path + " row " + std::to_string(l));
          tables.push_back(std::move(t));
        }
      }
    }
  }
  return b;
}

bool CalibBundle::has_codebooks(char stream) const {
  for (const auto& kv : codebooks_)
    if (kv.first.first == stream) return true;
  return false;
}

const at::Tensor& CalibBundle::chol(int64_t l) const {
  KAKEYA_CHECK(has_sigma_q(), dir_ << ": bundle has no Σ_q (run `kakeya calibrate sigma-q --out " << dir_ << "`)");
  return chol_.at(l);
}
const at::Tensor& CalibBundle::inv_chol(int64_t l) const {
  KAKEYA_CHECK(has_sigma_q(), dir_ << ": bundle has no Σ_q (run `kakeya calibrate sigma-q --out " << dir_ << "`)");
  return inv_chol_.at(l);
}
const at::Tensor& CalibBundle::k_weight(int64_t l) const {
  KAKEYA_CHECK(has_k_weights() && k_weight_.at(l).defined(),
               dir_ << ": bundle has no K weights for layer " << l << " (run `kakeya calibrate k-weights --out " << dir_ << "`)");
  return k_weight_.at(l);
}

const at::Tensor& CalibBundle::sigma(int64_t l) const {
  KAKEYA_CHECK(has_sigma_q(), dir_ << ": bundle has no Σ_q (run `kakeya calibrate sigma-q --out " << dir_ << "`)");
  return sigma_.at(l);
}

const at::Tensor& CalibBundle::basis(int64_t l, const std::string& kind) const {
  auto it = basis_.find(kind);
  KAKEYA_CHECK(it != basis_.end(), dir_ << ": bundle has no '" << kind
                                        << "' PCA basis (run `kakeya calibrate codebook --out " << dir_ << "`"
                                        << (kind == "kw" ? " after sigma-q" : "") << ")");
  return it->second.at(l);
}
const at::Tensor& CalibBundle::basis_eig(int64_t l, const std::string& kind) const {
  basis(l, kind);
  return eig_.at(kind).at(l);
}

const ScalarCodebook& CalibBundle::codebook(char stream, int bits, int64_t layer) const {
  auto it = codebooks_.find({stream, bits});
  KAKEYA_CHECK(it != codebooks_.end(), dir_ << ": bundle has no calibrated " << stream << " codebook for " << bits
                                            << " bits (run `kakeya calibrate codebook --out " << dir_ << "`)");
  return it->second.at(layer);
}

}  // namespace kakeya
