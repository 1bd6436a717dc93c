// Flags and loading shared by the restored-decoder commands (decode, niah,
// sweep-alpha, bench decode): verifier + drafter + f_θ, sink/window/full-attn.
#pragma once
#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "core/io/tokenizer.h"
#include "infer/restored.h"
#include "tools/cli_common.h"

namespace kakeya::cli {

struct RestoreFlags {
  std::string verifier = "checkpoints/models/gemma3-270m";
  // A directory, or "random[:SEED]" (seeded random weights: plumbing runs and tests before training).
  std::string drafter = "checkpoints/gemma3-270m/drafter";
  std::string ftheta = "checkpoints/gemma3-270m/ftheta";
  int64_t sink = RestoreOptions{}.sink, window = RestoreOptions{}.window, chunk = 0;
  std::string full_attn = "exact";
  std::string layers = "auto";  // --restore-layers (RestoreOptions::layers)
  std::string token_layers = RestoreOptions{}.token_layers ? "on" : "off";  // --token-layers
  std::string region_code = "none";  // --restored-code (RestoreOptions::region_code)
  std::string full_code = ops::row_code_name(RestoreOptions{}.full_code);  // --full-code
  std::string calib = "checkpoints/gemma3-270m/calib";                    // --calib (pwB's K weights)
  double mix_alpha = 0.0;
  DeviceFlags df;
  // --verifier, add_restore's options, --mix-alpha (with_alpha) and the device flags.
  void add(CLI::App* app, bool with_alpha = true);
  // The restored decoder's own options (drafter, f_θ, sink, window, chunk, full-attn, codes,
  // calib, restore-layers), each help line led by `prefix`: a command that times the restored
  // decoder beside another one names them "--restored: ".
  void add_restore(CLI::App* app, const std::string& prefix = "");
  RestoreOptions options() const;
  nlohmann::json to_json() const;
};

// The drafter's and f_θ's configs for `verifier` without their weights (what bytes-only plans
// need): read from the directories, or the geometry `random` would build (mask token 0).
std::pair<DrafterConfig, FThetaConfig> restoration_configs(const RestoreFlags& f, const ModelConfig& verifier);

// The verifier, and the drafter and f_θ when `need_restore` (restored modes with a < 1).
// The model lives behind a pointer: the drafter binds to its address.
struct DecodeStack {
  std::unique_ptr<Model> model;
  std::unique_ptr<Drafter> drafter;
  std::unique_ptr<FTheta> ftheta;
  std::string ftheta_origin;
  std::unique_ptr<Tokenizer> tok;
  const Drafter* d() const { return drafter.get(); }
  const FTheta* f() const { return ftheta.get(); }
};
DecodeStack load_decode_stack(const RestoreFlags& f, int64_t max_positions, bool need_restore);
// The drafter (bound to `model`) and f_θ of the flags, checked against each other and the
// model.
void load_restoration(const RestoreFlags& f, const Model& model, const Tokenizer& tok, DecodeStack& s);

}  // namespace kakeya::cli
