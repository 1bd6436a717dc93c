#include "tools/cli_common.h"

#ifdef KAKEYA_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include "core/error.h"
#include "core/io/fs.h"

namespace kakeya::cli {

namespace {
CLI::Validator bound(bool strict, const std::string& name) {
  const std::string what = strict ? "> 0" : ">= 0";
  return CLI::Validator(
      [strict, what](std::string& s) -> std::string {
        double v = 0;
        const bool ok = CLI::detail::lexical_cast(s, v) && (strict ? v > 0 : v >= 0);
        return ok ? std::string() : "expected a number " + what + ", got '" + s + "'";
      },
      name);
}
}  // namespace

CLI::Validator positive() { return bound(true, "POSITIVE"); }
CLI::Validator non_negative() { return bound(false, "NONNEGATIVE"); }

void DeviceFlags::add(CLI::App* app) {
  app->add_option("--device", device, "cpu | cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_option("--dtype", dtype, "f32 | bf16 (default: f32 on cpu, bf16 on cuda)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app->add_flag("--head-screen", head_screen,
                "cuda: an int8 screen of the lm_head (about half the head's bytes more device memory): greedy steps "
                "read its codes and a few exact rows instead of the whole head, the same tokens");
}

at::Device DeviceFlags::torch_device() const {
  if (device == "cuda") {
    KAKEYA_CHECK(at::hasCUDA(), "--device cuda: no CUDA device is available to this build (built with KAKEYA_CUDA=ON?)");
#ifdef KAKEYA_CUDA
    // The current GPU: 0, except under `kakeya launch`, where train/dist.h made the rank's own
    // GPU current before the model is loaded (a fixed 0 put every rank's model on GPU 0).
    return at::Device(at::kCUDA, at::cuda::current_device());
#else
    return at::Device(at::kCUDA, 0);
#endif
  }
  return at::kCPU;
}

at::ScalarType DeviceFlags::torch_dtype() const {
  std::string d = dtype.empty() ? (device == "cuda" ? "bf16" : "f32") : dtype;
  return d == "bf16" ? at::kBFloat16 : at::kFloat;
}

static void check_model_dir(const std::string& dir) {
  KAKEYA_CHECK(fs::is_directory(dir),
               dir << ": model directory not found (run `make model` for the default model)");
}

Tokenizer load_tokenizer(const std::string& dir) {
  check_model_dir(dir);
  return Tokenizer::from_file(dir + "/tokenizer.json");
}

ModelOptions model_options(const DeviceFlags& df, int64_t max_positions) {
  ModelOptions mo;
  mo.device = df.torch_device();
  mo.dtype = df.torch_dtype();
  mo.max_positions = max_positions;
  KAKEYA_CHECK(!df.head_screen || mo.device.is_cuda(),
               "--head-screen: the lm_head's screen runs on CUDA only (--device cuda), got --device " << df.device);
  mo.head_screen = df.head_screen;
  return mo;
}

Model load_model(const std::string& dir, const DeviceFlags& df, int64_t max_positions) {
  check_model_dir(dir);
  return Model::load(dir, model_options(df, max_positions));
}

std::vector<int64_t> encode(const Tokenizer& tok, const std::string& text, bool add_special) {
  auto ids = tok.encode(text, add_special);
  return std::vector<int64_t>(ids.begin(), ids.end());
}

// A deterministic prompt of exactly n tokens: prose repeated, BOS first.
std::vector<int64_t> bench_prompt(const Tokenizer& tok, int64_t n) {
  const std::string para =
      "The history of the lighthouse keeper's island is told in the logbooks that line the tower's "
      "lower room. Each entry notes the weather, the ships that passed, the oil burned and the repairs "
      "made to the lamp. Over a century the handwriting changes many times, but the order of the entries "
      "never does. ";
  std::string text;
  std::vector<int64_t> ids;
  while ((int64_t)ids.size() < n) {
    text += para;
    ids = encode(tok, text);
  }
  ids.resize(n);
  return ids;
}

bool run_plot(const std::string& python, const std::string& script_args) {
  std::string py = python;
  if (py.empty() && std::getenv("KAKEYA_PYTHON")) py = std::getenv("KAKEYA_PYTHON");
  if (py.empty()) py = fs::exists(".venv/bin/python") ? ".venv/bin/python" : "python3";
  const std::string cmd = py + " " + script_args;
  const int rc = std::system(cmd.c_str());
  if (rc != 0) std::fprintf(stderr, "warning: plot failed (exit %d; matplotlib missing?); rerun: %s\n", rc, cmd.c_str());
  return rc == 0;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KAKEYA_CHECK(f.good(), path << ": cannot open file");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_json(const std::string& path, const nlohmann::json& j) { fs::write_atomic(path, j.dump(2) + "\n"); }

DeviceFlags training_device_flags(const DeviceFlags& df, const std::string& command) {
  KAKEYA_CHECK(df.dtype.empty() || df.dtype == "f32",
               command << ": --dtype " << df.dtype << ": training runs in f32 (bf16 autocast on CUDA)");
  DeviceFlags out = df;
  out.dtype = "f32";
  out.head_screen = false;  // training takes no greedy step's argmax
  if (out.torch_device().is_cuda()) at::globalContext().setAllowTF32CuBLAS(true);
  return out;
}

std::string device_description(const at::Device& dev) {
#ifdef KAKEYA_CUDA
  // Results name the card: timings (and bf16 rounding) of two GPU kinds do not compare.
  if (dev.is_cuda()) return at::cuda::getDeviceProperties(dev.has_index() ? dev.index() : at::cuda::current_device())->name;
#endif
  return dev.is_cuda() ? "cuda" : "cpu";
}

std::string run_capture(const std::string& cmd) {
  std::array<char, 4096> buf{};
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  KAKEYA_CHECK(p, "cannot run: " << cmd);
  while (fgets(buf.data(), buf.size(), p)) out += buf.data();
  int rc = pclose(p);
  KAKEYA_CHECK(rc == 0, "command failed (exit " << rc << "): " << cmd << "\n" << out);
  return out;
}

std::string git_commit() {
  // A tree exported with `git archive` (the GPU machine's copy) has no .git: its runner names the commit.
  if (const char* c = std::getenv("KAKEYA_COMMIT"); c && *c) return c;
  try {
    auto s = run_capture("git rev-parse --short HEAD 2>/dev/null");
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
  } catch (const Error&) {
    return "unknown";
  }
}

Progress::Progress(std::string label, int64_t total, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), t0_(std::chrono::steady_clock::now()), last_(t0_) {}

void Progress::update(int64_t done) {
  auto now = std::chrono::steady_clock::now();
  if (done < total_ && std::chrono::duration<double>(now - last_).count() < 0.5) return;
  last_ = now;
  double el = std::chrono::duration<double>(now - t0_).count();
  double rate = el > 0 ? done / el : 0;
  double eta = rate > 0 ? (total_ - done) / rate : 0;
  std::fprintf(stderr, "\r%s %lld/%lld (%.1f%%) %.1f %s/s ETA %.0fs   ", label_.c_str(), (long long)done,
               (long long)total_, total_ ? 100.0 * done / total_ : 100.0, rate, unit_.c_str(), eta);
}

void Progress::finish() { std::fprintf(stderr, "\n"); }

}  // namespace kakeya::cli
