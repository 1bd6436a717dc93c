#include "core/model/ftheta.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "core/error.h"
#include "core/io/fs.h"
#include "core/io/safetensors.h"

namespace kakeya {
using json = nlohmann::json;

namespace {

std::string fnv1a64(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "fnv1a64:%016llx", (unsigned long long)h);
  return buf;
}

const char* kPath[2] = {"k", "v"};

}  // namespace

const char* ftheta_input_name(FThetaInput i) {
  return i == FThetaInput::TargetFeatures ? "target_features" : "drafter_kv";
}

FThetaInput parse_ftheta_input(const std::string& name) {
  if (name == "drafter_kv") return FThetaInput::DrafterKV;
  if (name == "target_features") return FThetaInput::TargetFeatures;
  KAKEYA_FAIL("f_theta input '" << name << "': expected drafter_kv or target_features");
}

std::string config_fingerprint(const ModelConfig& verifier) { return fnv1a64(verifier.summary().dump()); }

std::string config_fingerprint(const DrafterConfig& drafter) {
  json j = drafter.to_json();
  return fnv1a64(j.dump());
}

// ---------------------------------------------------------------------------
// FThetaConfig

int64_t FThetaConfig::k_out() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers(); ++l) n += kv_dim(l);
  return n;
}

int64_t FThetaConfig::v_out() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers(); ++l) n += v_from_k[l] ? 0 : kv_dim(l);
  return n;
}

int64_t FThetaConfig::k_offset(int64_t l) const {
  int64_t n = 0;
  for (int64_t j = 0; j < l; ++j) n += kv_dim(j);
  return n;
}

int64_t FThetaConfig::v_offset(int64_t l) const {
  if (v_from_k[l]) return -1;
  int64_t n = 0;
  for (int64_t j = 0; j < l; ++j) n += v_from_k[j] ? 0 : kv_dim(j);
  return n;
}

int64_t FThetaConfig::exact_feature(int64_t l) const {
  if (!reads_features()) return -1;
  for (size_t i = 0; i < feature_layers.size(); ++i)
    if (feature_layers[i] == l - 1) return (int64_t)i;
  return -1;
}

int64_t FThetaConfig::exact_rows(bool v_path) const {
  int64_t n = 0;
  for (int64_t l : exact_layers) n += v_path && v_from_k[l] ? 0 : kv_dim(l);
  return n;
}

FThetaConfig FThetaConfig::for_pair(const ModelConfig& verifier, const DrafterConfig& drafter, int64_t rank,
                                    FThetaInput input) {
  KAKEYA_CHECK(rank > 0, "f_theta: rank expected > 0, got " << rank);
  FThetaConfig c;
  c.rank = rank;
  c.input = input;
  c.drafter_layers = drafter.num_layers;
  c.drafter_kv_heads = drafter.num_kv_heads;
  c.drafter_head_dim = drafter.head_dim;
  if (input == FThetaInput::TargetFeatures) {
    c.feature_layers = drafter.target_layer_ids;
    c.hidden = verifier.hidden_size;
  }
  for (int64_t l = 0; l < verifier.num_layers; ++l) {
    c.kv_heads.push_back(verifier.kv_heads(l));
    c.head_dim.push_back(verifier.layer_head_dim[l]);
    c.layer_types.push_back(verifier.layer_types[l]);
    c.v_from_k.push_back(verifier.k_eq_v(l));
  }
  c.verifier_fingerprint = config_fingerprint(verifier);
  c.drafter_fingerprint = config_fingerprint(drafter);
  return c;
}

json FThetaConfig::to_json() const {
  json layers = json::array();
  for (int64_t l = 0; l < num_layers(); ++l)
    layers.push_back({{"kv_heads", kv_heads[l]},
                      {"head_dim", head_dim[l]},
                      {"layer_type", layer_type_name(layer_types[l])},
                      {"v_from_k", (bool)v_from_k[l]}});
  json in = {{"kind", ftheta_input_name(input)}};
  if (input == FThetaInput::TargetFeatures) {
    in["layers"] = feature_layers;
    in["hidden"] = hidden;
  }
  json j = {{"format", kFThetaFormat},
            {"rank", rank},
            {"input", in},
            {"drafter", {{"layers", drafter_layers}, {"kv_heads", drafter_kv_heads}, {"head_dim", drafter_head_dim}}},
            {"verifier_layers", layers},
            {"restore_layers", restore_layers_measured ? json(restore_layers) : json(nullptr)},
            {"exact_layers", exact_layers},
            {"verifier_fingerprint", verifier_fingerprint},
            {"drafter_fingerprint", drafter_fingerprint},
            {"provenance", provenance}};
  if (mlp_hidden > 0) j["mlp_hidden"] = mlp_hidden;  // absent: none (configs written before the branch read alike)
  return j;
}

FThetaConfig FThetaConfig::from_json(const json& j, const std::string& file) {
  KAKEYA_CHECK(j.is_object(), file << ": expected a JSON object (f_theta_config.json)");
  auto field = [&](const json& o, const std::string& key, const std::string& where) -> const json& {
    KAKEYA_CHECK(o.contains(key), file << ": missing field '" << where << "'");
    return o.at(key);
  };
  auto positive = [&](const json& o, const std::string& key, const std::string& where) {
    const json& v = field(o, key, where);
    KAKEYA_CHECK(v.is_number_integer() && v.get<int64_t>() > 0,
                 file << ": field '" << where << "' expected an integer > 0, got " << v.dump());
    return v.get<int64_t>();
  };
  auto str = [&](const json& o, const std::string& key) {
    const json& v = field(o, key, key);
    KAKEYA_CHECK(v.is_string(), file << ": field '" << key << "' expected a string, got " << v.dump());
    return v.get<std::string>();
  };
  const std::string fmt = str(j, "format");
  KAKEYA_CHECK(fmt == kFThetaFormat, file << ": field 'format' is '" << fmt << "', expected '" << kFThetaFormat << "'");
  FThetaConfig c;
  c.rank = positive(j, "rank", "rank");
  if (j.contains("mlp_hidden")) {
    const json& h = j.at("mlp_hidden");
    KAKEYA_CHECK(h.is_number_integer() && h.get<int64_t>() >= 0,
                 file << ": field 'mlp_hidden' expected an integer >= 0 (0: no nonlinear branch), got " << h.dump());
    c.mlp_hidden = h.get<int64_t>();
  }
  const json& d = field(j, "drafter", "drafter");
  KAKEYA_CHECK(d.is_object(), file << ": field 'drafter' expected an object, got " << d.dump());
  c.drafter_layers = positive(d, "layers", "drafter.layers");
  c.drafter_kv_heads = positive(d, "kv_heads", "drafter.kv_heads");
  c.drafter_head_dim = positive(d, "head_dim", "drafter.head_dim");
  const json& ls = field(j, "verifier_layers", "verifier_layers");
  KAKEYA_CHECK(ls.is_array() && !ls.empty(),
               file << ": field 'verifier_layers' expected a non-empty array, got " << ls.dump().substr(0, 80));
  for (size_t l = 0; l < ls.size(); ++l) {
    const std::string w = "verifier_layers[" + std::to_string(l) + "]";
    KAKEYA_CHECK(ls[l].is_object(), file << ": field '" << w << "' expected an object, got " << ls[l].dump());
    c.kv_heads.push_back(positive(ls[l], "kv_heads", w + ".kv_heads"));
    c.head_dim.push_back(positive(ls[l], "head_dim", w + ".head_dim"));
    const json& t = field(ls[l], "layer_type", w + ".layer_type");
    const std::string ts = t.is_string() ? t.get<std::string>() : t.dump();
    KAKEYA_CHECK(ts == "sliding_attention" || ts == "full_attention",
                 file << ": field '" << w << ".layer_type' is " << ts << " (expected sliding_attention or full_attention)");
    c.layer_types.push_back(ts == "sliding_attention" ? LayerType::Sliding : LayerType::Full);
    const json& vk = field(ls[l], "v_from_k", w + ".v_from_k");
    KAKEYA_CHECK(vk.is_boolean(), file << ": field '" << w << ".v_from_k' expected true/false, got " << vk.dump());
    c.v_from_k.push_back(vk.get<bool>());
  }
  // Configs written before the input choice existed read the drafter's raw K/V.
  if (j.contains("input")) {
    const json& in = j.at("input");
    KAKEYA_CHECK(in.is_object() && in.contains("kind") && in.at("kind").is_string(),
                 file << ": field 'input' expected {\"kind\": \"drafter_kv\" | \"target_features\", ...}, got "
                      << in.dump());
    const std::string kind = in.at("kind").get<std::string>();
    KAKEYA_CHECK(kind == "drafter_kv" || kind == "target_features",
                 file << ": field 'input.kind' is '" << kind << "', expected drafter_kv or target_features");
    c.input = parse_ftheta_input(kind);
    if (c.input == FThetaInput::TargetFeatures) {
      const json& fl = field(in, "layers", "input.layers");
      KAKEYA_CHECK(fl.is_array() && !fl.empty(), file << ": field 'input.layers' expected a non-empty array of layer ids, got "
                                                      << fl.dump());
      for (const json& x : fl) {
        KAKEYA_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0,
                     file << ": field 'input.layers' expected layer ids >= 0, got " << x.dump());
        c.feature_layers.push_back(x.get<int64_t>());
      }
      c.hidden = positive(in, "hidden", "input.hidden");
    }
  }
  if (j.contains("restore_layers") && !j.at("restore_layers").is_null()) {
    const json& rl = j.at("restore_layers");
    c.restore_layers_measured = true;
    KAKEYA_CHECK(rl.is_array(), file << ": field 'restore_layers' expected an array of layer ids, got " << rl.dump());
    for (const json& x : rl) {
      KAKEYA_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() < c.num_layers(),
                   file << ": field 'restore_layers' expected layer ids in [0, " << c.num_layers() << "), got " << x.dump());
      c.restore_layers.push_back(x.get<int64_t>());
    }
  }
  if (j.contains("exact_layers")) {
    const json& el = j.at("exact_layers");
    KAKEYA_CHECK(el.is_array(), file << ": field 'exact_layers' expected an array of layer ids, got " << el.dump());
    for (const json& x : el) {
      KAKEYA_CHECK(x.is_number_integer(), file << ": field 'exact_layers' expected layer ids, got " << x.dump());
      const int64_t l = x.get<int64_t>();
      KAKEYA_CHECK(l > 0 && l < c.num_layers() && c.exact_feature(l) >= 0,
                   file << ": field 'exact_layers' lists layer " << l << ", expected layers whose previous layer is an "
                        << "input feature layer (input.layers " << json(c.feature_layers).dump() << ", "
                        << c.num_layers() << " verifier layers)");
      KAKEYA_CHECK(c.exact_layers.empty() || l > c.exact_layers.back(),
                   file << ": field 'exact_layers' expected ascending layer ids, got " << el.dump());
      c.exact_layers.push_back(l);
    }
  }
  c.verifier_fingerprint = str(j, "verifier_fingerprint");
  c.drafter_fingerprint = str(j, "drafter_fingerprint");
  if (j.contains("provenance")) c.provenance = j.at("provenance");
  return c;
}

FThetaConfig FThetaConfig::from_file(const std::string& path) {
  return from_json(fs::read_json(path, "an f_theta_config.json"), path);
}

void FThetaConfig::check(const ModelConfig& verifier, const DrafterConfig& drafter, const std::string& file) const {
  // Dimensions first: they say what differs, the fingerprints only that something does.
  KAKEYA_CHECK(num_layers() == verifier.num_layers,
               file << ": f_theta has " << num_layers() << " verifier layers, the verifier has " << verifier.num_layers);
  for (int64_t l = 0; l < num_layers(); ++l) {
    KAKEYA_CHECK(kv_heads[l] == verifier.kv_heads(l) && head_dim[l] == verifier.layer_head_dim[l],
                 file << ": field 'verifier_layers[" << l << "]' is " << kv_heads[l] << " KV heads × head_dim "
                      << head_dim[l] << ", the verifier's layer " << l << " has " << verifier.kv_heads(l) << " × "
                      << verifier.layer_head_dim[l]);
    KAKEYA_CHECK(layer_types[l] == verifier.layer_types[l],
                 file << ": field 'verifier_layers[" << l << "].layer_type' is " << layer_type_name(layer_types[l])
                      << ", the verifier's layer " << l << " is " << layer_type_name(verifier.layer_types[l]));
    KAKEYA_CHECK(v_from_k[l] == verifier.k_eq_v(l),
                 file << ": field 'verifier_layers[" << l << "].v_from_k' is " << (v_from_k[l] ? "true" : "false")
                      << ", the verifier's layer " << l << (verifier.k_eq_v(l) ? " has" : " has no") << " V = K");
  }
  KAKEYA_CHECK(drafter_layers == drafter.num_layers && drafter_kv_heads == drafter.num_kv_heads &&
                   drafter_head_dim == drafter.head_dim,
               file << ": field 'drafter' is " << drafter_layers << " layers × " << drafter_kv_heads << " KV heads × head_dim "
                    << drafter_head_dim << ", the drafter (" << drafter.origin << ") has " << drafter.num_layers << " × "
                    << drafter.num_kv_heads << " × " << drafter.head_dim);
  if (input == FThetaInput::TargetFeatures) {
    KAKEYA_CHECK(feature_layers == drafter.target_layer_ids,
                 file << ": field 'input.layers' is " << json(feature_layers).dump() << ", the drafter (" << drafter.origin
                      << ") reads target layers " << json(drafter.target_layer_ids).dump());
    KAKEYA_CHECK(hidden == verifier.hidden_size, file << ": field 'input.hidden' is " << hidden
                                                      << ", the verifier's hidden size is " << verifier.hidden_size);
  }
  const std::string vf = config_fingerprint(verifier), df = config_fingerprint(drafter);
  KAKEYA_CHECK(verifier_fingerprint == vf, file << ": field 'verifier_fingerprint' is " << verifier_fingerprint
                                                << ", the verifier's config gives " << vf
                                                << " (this f_theta was trained for another verifier)");
  KAKEYA_CHECK(drafter_fingerprint == df, file << ": field 'drafter_fingerprint' is " << drafter_fingerprint
                                               << ", the drafter's config (" << drafter.origin << ") gives " << df
                                               << " (this f_theta was trained for another drafter)");
}

// ---------------------------------------------------------------------------
// FTheta

namespace {

// nn.Linear's init, U(-1/√fan_in, 1/√fan_in), drawn in f32 from `gen` (the same values on every device).
at::Tensor linear_uniform(at::IntArrayRef shape, int64_t fan_in, at::Generator& gen, const at::TensorOptions& to) {
  const double b = 1.0 / std::sqrt((double)fan_in);
  return (at::rand(shape, gen, at::kFloat) * (2 * b) - b).to(to);
}

std::vector<std::pair<std::string, std::vector<int64_t>>> expected_tensors(const FThetaConfig& c) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (int p = 0; p < 2; ++p) {
    const int64_t n = p == 0 ? c.k_out() : c.v_out();
    const std::string pre = kPath[p];
    out.push_back({pre + ".encoder.weight", {c.rank, c.in_features()}});
    out.push_back({pre + ".encoder.bias", {c.rank}});
    out.push_back({pre + ".decoder.weight", {n, c.rank}});
    out.push_back({pre + ".decoder.bias", {n}});
  }
  for (int p = 0; p < 2 && c.mlp_hidden > 0; ++p) {
    const int64_t n = p == 0 ? c.k_out() : c.v_out();
    const std::string pre = kPath[p];
    out.push_back({pre + ".mlp.fc1.weight", {c.mlp_hidden, c.in_features()}});
    out.push_back({pre + ".mlp.fc1.bias", {c.mlp_hidden}});
    out.push_back({pre + ".mlp.fc2.weight", {n, c.mlp_hidden}});
  }
  for (int p = 0; p < 2; ++p) {
    const int64_t n = c.exact_rows(p == 1);
    if (n == 0) continue;
    const std::string pre = kPath[p];
    out.push_back({pre + ".exact.weight", {n, c.hidden}});
    out.push_back({pre + ".exact.bias", {n}});
  }
  return out;
}

}  // namespace

FTheta FTheta::random(const FThetaConfig& cfg, uint64_t seed, at::ScalarType dtype, at::Device device) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  FTheta f;
  f.cfg_ = cfg;
  f.cfg_.exact_layers.clear();  // their tensors are the verifier's: add_exact_layers
  f.cfg_.mlp_hidden = 0;        // add_mlp below
  const auto to = at::TensorOptions().dtype(dtype).device(device);
  auto uniform = [&](at::IntArrayRef shape, int64_t fan_in) { return linear_uniform(shape, fan_in, gen, to); };
  for (int p = 0; p < 2; ++p) {
    const int64_t n = p == 0 ? cfg.k_out() : cfg.v_out();
    f.enc_w_[p] = uniform({cfg.rank, cfg.in_features()}, cfg.in_features());
    f.enc_b_[p] = uniform({cfg.rank}, cfg.in_features());
    f.dec_w_[p] = uniform({n, cfg.rank}, cfg.rank);
    f.dec_b_[p] = uniform({n}, cfg.rank);
  }
  f.check_shapes("f_theta (random)");
  if (cfg.mlp_hidden > 0) f.add_mlp(cfg.mlp_hidden, seed + 1);
  return f;
}

void FTheta::add_mlp(int64_t hidden, uint64_t seed) {
  KAKEYA_CHECK(hidden > 0, "f_theta: nonlinear branch width expected > 0, got " << hidden);
  KAKEYA_CHECK(cfg_.mlp_hidden == 0, "f_theta: has a nonlinear branch of width " << cfg_.mlp_hidden << " already");
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const int64_t in = cfg_.in_features();
  const auto to = at::TensorOptions().dtype(dtype()).device(device());
  for (int p = 0; p < 2; ++p) {
    mlp1_w_[p] = linear_uniform({hidden, in}, in, gen, to);
    mlp1_b_[p] = linear_uniform({hidden}, in, gen, to);
    mlp2_w_[p] = at::zeros({dec_w_[p].size(0), hidden}, to);
  }
  cfg_.mlp_hidden = hidden;
  check_shapes("f_theta (nonlinear branch)");
}

FTheta FTheta::load(const std::string& dir, at::ScalarType dtype, at::Device device) {
  KAKEYA_CHECK(fs::is_directory(dir), dir << ": f_theta directory not found");
  const std::string cfg_path = dir + "/f_theta_config.json", w_path = dir + "/f_theta.safetensors";
  FTheta f;
  f.cfg_ = FThetaConfig::from_file(cfg_path);
  KAKEYA_CHECK(fs::exists(w_path), w_path << ": missing (f_theta weights)");
  SafetensorsFile st(w_path);
  std::set<std::string> known;
  for (const auto& [name, shape] : expected_tensors(f.cfg_)) known.insert(name);
  for (const auto& name : st.names())
    KAKEYA_CHECK(known.count(name), w_path << ": tensor '" << name << "' is not part of an f_theta with " << cfg_path);
  std::map<std::string, at::Tensor> w;
  for (const auto& [name, shape] : expected_tensors(f.cfg_)) {
    at::Tensor t = st.get(name);
    KAKEYA_CHECK(t.sizes() == at::IntArrayRef(shape),
                 w_path << ": tensor '" << name << "' has shape " << t.sizes() << ", " << cfg_path << " implies "
                        << at::IntArrayRef(shape));
    KAKEYA_CHECK(at::isfinite(t.to(at::kFloat)).all().item<bool>(), w_path << ": tensor '" << name << "' has NaN/Inf");
    w[name] = t.to(device, dtype).clone();  // own the memory (never alias the mapping)
  }
  for (int p = 0; p < 2; ++p) {
    const std::string pre = kPath[p];
    f.enc_w_[p] = w.at(pre + ".encoder.weight");
    f.enc_b_[p] = w.at(pre + ".encoder.bias");
    f.dec_w_[p] = w.at(pre + ".decoder.weight");
    f.dec_b_[p] = w.at(pre + ".decoder.bias");
    if (f.cfg_.mlp_hidden > 0) {
      f.mlp1_w_[p] = w.at(pre + ".mlp.fc1.weight");
      f.mlp1_b_[p] = w.at(pre + ".mlp.fc1.bias");
      f.mlp2_w_[p] = w.at(pre + ".mlp.fc2.weight");
    }
    if (w.count(pre + ".exact.weight")) {
      f.ex_w_[p] = w.at(pre + ".exact.weight");
      f.ex_b_[p] = w.at(pre + ".exact.bias");
    }
  }
  f.check_shapes(w_path);
  return f;
}

void FTheta::save(const std::string& dir, at::ScalarType dtype) const {
  fs::make_dirs(dir);
  std::map<std::string, at::Tensor> t;
  for (const auto& [name, w] : named_tensors()) t[name] = w.detach().to(at::kCPU, dtype).contiguous();
  save_safetensors(dir + "/f_theta.safetensors", t, {{"format", kFThetaFormat}});
  fs::write_atomic(dir + "/f_theta_config.json", cfg_.to_json().dump(2) + "\n");
}

void FTheta::check_shapes(const std::string& origin) const {
  const auto& c = cfg_;
  KAKEYA_CHECK(c.num_layers() > 0 && (int64_t)c.head_dim.size() == c.num_layers() &&
                   (int64_t)c.layer_types.size() == c.num_layers() && (int64_t)c.v_from_k.size() == c.num_layers(),
               origin << ": f_theta config has inconsistent per-layer vectors");
  auto named = named_tensors();
  auto exp = expected_tensors(c);
  KAKEYA_CHECK(named.size() == exp.size(), origin << ": f_theta holds " << named.size() << " tensors, its config implies "
                                                  << exp.size() << " (exact_layers: " << json(c.exact_layers).dump() << ")");
  for (size_t i = 0; i < exp.size(); ++i)
    KAKEYA_CHECK(named[i].second.sizes() == at::IntArrayRef(exp[i].second),
                 origin << ": tensor '" << exp[i].first << "' has shape " << named[i].second.sizes() << ", expected "
                        << at::IntArrayRef(exp[i].second));
}

int64_t FTheta::num_parameters() const {
  int64_t n = 0;
  for (const auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

std::vector<std::pair<std::string, at::Tensor>> FTheta::named_tensors() const {
  auto out = named_parameters();
  for (int p = 0; p < 2; ++p) {
    if (!ex_w_[p].defined()) continue;
    const std::string pre = kPath[p];
    out.push_back({pre + ".exact.weight", ex_w_[p]});
    out.push_back({pre + ".exact.bias", ex_b_[p]});
  }
  return out;
}

void FTheta::add_exact_layers(const Model& verifier) {
  auto& c = cfg_;
  const ModelConfig& vc = verifier.config();
  KAKEYA_CHECK(c.reads_features(), "f_theta: exact layers need the target_features input (this f_theta reads "
                                       << ftheta_input_name(c.input) << ")");
  KAKEYA_CHECK(config_fingerprint(vc) == c.verifier_fingerprint,
               "f_theta: exact layers from a verifier whose config gives " << config_fingerprint(vc)
                                                                          << ", this f_theta was made for "
                                                                          << c.verifier_fingerprint);
  c.exact_layers.clear();
  std::vector<at::Tensor> w[2], b[2];
  for (int64_t l = 1; l < c.num_layers(); ++l) {
    if (c.exact_feature(l) < 0 || vc.kv_shared(l)) continue;
    c.exact_layers.push_back(l);
    const LayerWeights& lw = verifier.layer(l);
    const int64_t q = vc.q_dim(l), kvd = vc.kv_dim(l);
    at::Tensor g = lw.attn_norm.to(at::kFloat);  // [H] the input norm's weight (Gemma 3's 1+w folded in)
    for (int p = 0; p < (vc.k_eq_v(l) ? 1 : 2); ++p) {
      const int64_t r0 = q + p * kvd;  // qkv rows: q, then k, then v
      w[p].push_back(lw.qkv.narrow(0, r0, kvd).to(at::kFloat) * g);  // [kvd, H]
      b[p].push_back(lw.qkv_bias.defined() ? lw.qkv_bias.narrow(0, r0, kvd).to(at::kFloat)
                                           : at::zeros({kvd}, g.options()));
    }
  }
  const auto to = at::TensorOptions().dtype(dtype()).device(device());
  for (int p = 0; p < 2; ++p) {
    ex_w_[p] = w[p].empty() ? at::Tensor() : at::cat(w[p]).to(to);
    ex_b_[p] = b[p].empty() ? at::Tensor() : at::cat(b[p]).to(to);
  }
  check_shapes("f_theta (exact layers)");
}

std::vector<std::pair<std::string, at::Tensor>> FTheta::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int p = 0; p < 2; ++p) {
    const std::string pre = kPath[p];
    out.push_back({pre + ".encoder.weight", enc_w_[p]});
    out.push_back({pre + ".encoder.bias", enc_b_[p]});
    out.push_back({pre + ".decoder.weight", dec_w_[p]});
    out.push_back({pre + ".decoder.bias", dec_b_[p]});
  }
  for (int p = 0; p < 2; ++p) {
    if (!mlp1_w_[p].defined()) continue;
    const std::string pre = kPath[p];
    out.push_back({pre + ".mlp.fc1.weight", mlp1_w_[p]});
    out.push_back({pre + ".mlp.fc1.bias", mlp1_b_[p]});
    out.push_back({pre + ".mlp.fc2.weight", mlp2_w_[p]});
  }
  return out;
}

at::Tensor FTheta::input_rows(const at::Tensor& x, bool v_path) const {
  const auto& c = cfg_;
  const int64_t nd = x.dim();
  const auto wt = enc_w_[v_path ? 1 : 0].scalar_type();
  if (c.reads_features()) {
    const int64_t n = (int64_t)c.feature_layers.size();
    KAKEYA_CHECK(nd >= 1 && x.size(nd - 1) == n * c.hidden,
                 "f_theta: target-feature input has shape " << x.sizes() << ", expected [..., " << n * c.hidden << "] ("
                                                            << n << " layers x hidden " << c.hidden << ")");
    // Per layer x / rms(x) in f32: the scale Gemma's input norm removes, so K and V of a layer fed
    // by a tapped output are linear in the row.
    auto shape = x.sizes().vec();
    shape.back() = n;
    shape.push_back(c.hidden);
    at::Tensor h = x.to(at::kFloat).view(shape);                         // [..., n, H]
    h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + 1e-6);
    return h.flatten(nd - 1).to(wt);                                     // [..., n·H]
  }
  KAKEYA_CHECK(nd >= 3 && x.size(nd - 3) == c.drafter_layers && x.size(nd - 2) == c.drafter_kv_heads &&
                   x.size(nd - 1) == c.drafter_head_dim,
               "f_theta: drafter " << kPath[v_path] << " input has shape " << x.sizes() << ", expected [..., "
                                   << c.drafter_layers << ", " << c.drafter_kv_heads << ", " << c.drafter_head_dim
                                   << "] (drafter layers, KV heads, head dim)");
  // Per position, the drafter layers' K (resp. V) concatenated: layer-major, then head, then dim.
  return x.to(wt).flatten(nd - 3);  // [..., in]
}

at::Tensor FTheta::predict_fused(const at::Tensor& x, bool v_path) const {
  const int p = v_path ? 1 : 0;
  at::Tensor rows = input_rows(x, v_path);                    // [..., in]
  at::Tensor z = at::linear(rows, enc_w_[p], enc_b_[p]);      // [..., r]
  at::Tensor y = at::linear(z, dec_w_[p], dec_b_[p]);         // [..., k_out | v_out]
  if (mlp1_w_[p].defined())                                   // the nonlinear branch: [..., h] -> [..., k_out | v_out]
    y = y + at::linear(at::gelu(at::linear(rows, mlp1_w_[p], mlp1_b_[p])), mlp2_w_[p]);
  return ex_w_[p].defined() ? with_exact(y, rows, p) : y;
}

at::Tensor FTheta::with_exact(const at::Tensor& y, const at::Tensor& rows, int p) const {
  const auto& c = cfg_;
  const int64_t H = c.hidden;
  std::vector<at::Tensor> parts;  // the learned columns between exact layers, and the exact ones
  int64_t col = 0, row = 0;
  for (int64_t l : c.exact_layers) {
    if (p == 1 && c.v_from_k[l]) continue;
    const int64_t off = p == 0 ? c.k_offset(l) : c.v_offset(l), n = c.kv_dim(l);
    if (off > col) parts.push_back(y.narrow(-1, col, off - col));
    at::Tensor xi = rows.narrow(-1, c.exact_feature(l) * H, H);                                // [..., H]
    parts.push_back(at::linear(xi, ex_w_[p].narrow(0, row, n), ex_b_[p].narrow(0, row, n)));  // [..., n]
    col = off + n;
    row += n;
  }
  if (col < y.size(-1)) parts.push_back(y.narrow(-1, col, y.size(-1) - col));
  return at::cat(parts, -1);
}

std::vector<std::pair<at::Tensor, at::Tensor>> FTheta::predict(const at::Tensor& xk, const at::Tensor& xv) const {
  const auto& c = cfg_;
  at::Tensor yk = predict_fused(xk, false);
  at::Tensor yv = c.v_out() > 0 ? predict_fused(xv, true) : at::Tensor();
  auto lead = yk.sizes().slice(0, yk.dim() - 1).vec();  // [...]
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  for (int64_t l = 0; l < c.num_layers(); ++l) {
    auto shape = lead;
    shape.push_back(c.kv_heads[l]);
    shape.push_back(c.head_dim[l]);
    at::Tensor k = yk.narrow(-1, c.k_offset(l), c.kv_dim(l)).reshape(shape);
    at::Tensor v = c.v_from_k[l] ? k : yv.narrow(-1, c.v_offset(l), c.kv_dim(l)).reshape(shape);
    out.push_back({k, v});
  }
  return out;
}

}  // namespace kakeya
