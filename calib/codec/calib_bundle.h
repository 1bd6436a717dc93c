// Calibration bundle: the per-model side data the KV codec reads (and the
// decoder will read), made by `kakeya calibrate ...` (calib/). A directory:
//
//   manifest.json                 format, model identity (config hash), one entry per job
//                                 (command line, data, files, parameters)
//   q_calib.safetensors           layer_{l}_chol, layer_{l}_inv_chol, layer_{l}_sigma: [n_kv, D, D] f32
//                                 (+ layer_{l}_sigma_eff, the RoPE-averaged Σ_q that was factored,
//                                 when sigma-q ran with --rope-offsets); n_kv and D are the layer's own
//                                 (ModelConfig::kv_heads(l), layer_head_dim[l]: Gemma 4 full layers differ)
//   q_calib_diagnostics.json      condition numbers, anisotropy per layer and KV head
//   pca_basis.safetensors         layer_{l}_{k,kw,v}_basis [n_kv, D, D] f32 (columns: principal
//                                 directions by descending variance), layer_{l}_{k,kw,v}_eig [n_kv, D]
//                                 (k: raw pre-RoPE K, kw: K whitened by Σ_q, v: V)
//   codebook_{k,v}_b{1..4}.f32    Lloyd-Max tables, little-endian f32 [num_layers, 2^bits] (row = layer)
//   codebook_summary.json         MSE of the fitted vs the Gaussian-optimal tables
//   k_weights.safetensors         layer_{l}_k_weight [n_kv, D] f32 > 0 on full-attention layers: the
//                                 K weights of weighted row codes (--full-code pwB; calib/calibrate.h)
//   (manifest entry layer_codes)  the full-attention layers' row codes chosen on the calibration
//                                 text (infer/layer_codes.h), with the NLL of every upgrade
//
// Loading checks the model identity first: a bundle made for another model is
// refused with an error naming manifest.json and the mismatching field.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

#include "core/model/config.h"
#include "calib/codec/lloyd_max.h"

namespace kakeya {

constexpr const char* kCalibFormat = "kakeya-calib/1";

// FNV-1a 64 of the model's identity fields (sorted-key JSON; the list is fixed in
// calib_bundle.cpp so bundles survive new ModelConfig fields): "fnv1a64:<16 hex>".
std::string config_hash(const ModelConfig& cfg);
// The "model" object of a manifest: hash plus readable identity fields.
nlohmann::json model_identity(const ModelConfig& cfg);

class CalibBundle {
 public:
  // Reads dir/manifest.json and every file its entries list. Throws if the
  // manifest names another model, or a tensor/table has the wrong shape.
  static CalibBundle load(const std::string& dir, const ModelConfig& cfg);
  // Checks only the manifest's model identity (what load() does first).
  static nlohmann::json check_manifest(const std::string& dir, const ModelConfig& cfg);
  // The K weights alone (what the decoder's weighted rows read, without the bundle's bases and
  // tables): per layer [n_kv, D] f32 on the CPU, undefined on sliding layers. Checks the model
  // identity as load() does; throws naming the bundle when it has no K weights.
  static std::vector<at::Tensor> load_k_weights(const std::string& dir, const ModelConfig& cfg);
  // The full-attention codes `kakeya calibrate layer-codes` chose ("pw4+11=pw5v4": what
  // --full-code auto stands for). Checks the model identity as load() does; throws naming
  // manifest.json when the bundle has no such entry.
  static std::string layer_codes(const std::string& dir, const ModelConfig& cfg);
  // Before a job writes into dir: creates dir/manifest.json for `cfg` if absent,
  // refuses a directory holding another model's bundle.
  static void prepare_dir(const std::string& dir, const ModelConfig& cfg);
  // Adds/replaces one job's entry in dir/manifest.json (creating it for `cfg`;
  // refusing a directory that holds another model's bundle).
  static void update_manifest(const std::string& dir, const ModelConfig& cfg, const std::string& entry,
                              const nlohmann::json& value);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& manifest() const { return manifest_; }
  bool has_sigma_q() const { return !chol_.empty(); }
  bool has_basis() const { return !basis_.empty(); }
  bool has_codebooks(char stream) const;
  bool has_k_weights() const { return !k_weight_.empty(); }
  // [n_kv, D] f32 on the CPU; throws naming the bundle when it has none for `layer`.
  const at::Tensor& k_weight(int64_t layer) const;

  // Σ_q factors, per layer [n_kv, D, D] f32 on the CPU: Σ_q + ridge = L·Lᵀ, L lower triangular.
  const at::Tensor& chol(int64_t layer) const;
  const at::Tensor& inv_chol(int64_t layer) const;
  const at::Tensor& sigma(int64_t layer) const;
  // PCA basis of kind "k" | "kw" | "v": [n_kv, D, D] (columns by descending variance); eig: [n_kv, D].
  const at::Tensor& basis(int64_t layer, const std::string& kind) const;
  const at::Tensor& basis_eig(int64_t layer, const std::string& kind) const;
  // Lloyd-Max table of stream 'k' or 'v', `bits` in 1..4, for `layer`.
  const ScalarCodebook& codebook(char stream, int bits, int64_t layer) const;

  // Raw little-endian f32 table file I/O ([rows, 2^bits]); read checks the byte size.
  static void write_f32(const std::string& path, const std::vector<float>& v);
  static std::vector<float> read_f32(const std::string& path, int64_t expected_count);

 private:
  std::string dir_;
  nlohmann::json manifest_;
  std::vector<at::Tensor> chol_, inv_chol_, sigma_;            // per layer [n_kv, D, D]
  std::vector<at::Tensor> k_weight_;                           // per layer [n_kv, D] (undefined: sliding)
  std::map<std::string, std::vector<at::Tensor>> basis_, eig_;  // kind -> per layer
  std::map<std::pair<char, int>, std::vector<ScalarCodebook>> codebooks_;  // (stream, bits) -> per layer
};

}  // namespace kakeya
