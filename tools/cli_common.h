// Shared pieces of the kakeya subcommands: device/dtype flags, model +
// tokenizer loading, progress lines and JSON output.
#pragma once
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <string>

#include "core/model/model.h"
#include "core/io/tokenizer.h"

namespace kakeya::cli {

// Numeric flag bounds whose error names the bound and the value ("--window: expected a number > 0,
// got '0'"); CLI11's PositiveNumber / NonNegativeNumber report "Value 0 not in range 0.000000 to
// 1.797693e+308".
CLI::Validator positive();      // > 0
CLI::Validator non_negative();  // >= 0

struct DeviceFlags {
  std::string device = "cpu";  // cpu | cuda
  std::string dtype = "";      // f32 | bf16 (default: f32 on CPU, bf16 on CUDA)
  bool head_screen = false;  // ModelOptions::head_screen (training: always off)
  void add(CLI::App* app);
  at::Device torch_device() const;
  at::ScalarType torch_dtype() const;
};

// Training and its benchmarks run in f32 (bf16 autocast on CUDA): refuses another --dtype
// (naming `command`), allows TF32 GEMMs on CUDA; returns the flags with dtype f32.
DeviceFlags training_device_flags(const DeviceFlags& df, const std::string& command);

Tokenizer load_tokenizer(const std::string& model_dir);
// max_positions: RoPE table length = the longest sequence this run will see.
Model load_model(const std::string& dir, const DeviceFlags& df, int64_t max_positions);
// The model options those flags and positions give (load_model's, and a random-weight model's).
ModelOptions model_options(const DeviceFlags& df, int64_t max_positions);

std::vector<int64_t> encode(const Tokenizer& tok, const std::string& text, bool add_special = true);
// A deterministic benchmark prompt of exactly n tokens: one prose paragraph repeated, BOS first.
std::vector<int64_t> bench_prompt(const Tokenizer& tok, int64_t n);
std::string read_file(const std::string& path);
// Writes JSON atomically (temp file + rename), so a crash never leaves half a report.
void write_json(const std::string& path, const nlohmann::json& j);
std::string device_description(const at::Device& dev);
// Runs `PYTHON SCRIPT_ARGS` to draw a PNG (PYTHON: `python`, else $KAKEYA_PYTHON, .venv/bin/python,
// python3). A failed plot only warns, with the command to rerun: the results stand without it.
bool run_plot(const std::string& python, const std::string& script_args);
// Runs a shell command and returns its stdout; throws with the output when it fails.
std::string run_capture(const std::string& cmd);
std::string git_commit();  // $KAKEYA_COMMIT, else the short HEAD hash of the working directory's repo, else "unknown"

// "label  12/100  (12.0%)  34.5 tok/s  ETA 3s" on stderr, at most a few times per second.
class Progress {
 public:
  Progress(std::string label, int64_t total, std::string unit = "tok");
  void update(int64_t done);
  void finish();

 private:
  std::string label_, unit_;
  int64_t total_;
  std::chrono::steady_clock::time_point t0_, last_;
};

// Subcommand registration (one file each under tools/).
void register_generate(CLI::App& app);
void register_score(CLI::App& app);
void register_bench(CLI::App& app);
void register_bench_train_ftheta(CLI::App& bench);
void register_bench_memory(CLI::App& bench);         // cmd_bench_memory.cpp: `kakeya bench memory`  // cmd_bench_train.cpp: `kakeya bench train-ftheta`
void register_bench_spec(CLI::App& bench);          // cmd_bench_spec.cpp: `kakeya bench spec` (kakeya.cpp registers it)
void register_calibrate(CLI::App& app);   // cmd_calibrate.cpp
void register_codec_eval(CLI::App& app);  // cmd_codec_eval.cpp
// The invocation, recorded in calibration manifests and reports (set by main).
void set_command_line(int argc, char** argv);
const std::string& command_line();
void register_spec(CLI::App& app);           // cmd_spec.cpp
void register_train_drafter(CLI::App& app);  // cmd_train_drafter.cpp
void register_draft_vocab(CLI::App& app);    // cmd_draft_vocab.cpp
void register_capture(CLI::App& app);        // cmd_capture.cpp (built where HDF5 is found)
void register_train_ftheta(CLI::App& app);   // cmd_train_ftheta.cpp (reads captures: HDF5 too)
void register_decode(CLI::App& app);         // cmd_decode.cpp
void register_niah(CLI::App& app);           // cmd_niah.cpp
void register_eval_long(CLI::App& app);      // cmd_eval_long.cpp
void register_ftheta_layers(CLI::App& app);  // cmd_ftheta_layers.cpp
void register_ftheta_exact(CLI::App& app);   // cmd_ftheta_layers.cpp
void register_sweep_alpha(CLI::App& app);    // cmd_niah.cpp
void register_launch(CLI::App& app);         // cmd_launch.cpp: data-parallel ranks
void register_serve(CLI::App& app);          // cmd_serve.cpp: OpenAI-compatible server (built where cpp-httplib is found)

}  // namespace kakeya::cli
