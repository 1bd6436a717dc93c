// Helpers shared by the GoogleTest suites: where the reference fixtures and the
// real model live (set by CTest, see tests/CMakeLists.txt).
#pragma once
#include <gtest/gtest.h>

#include "core/error.h"
#include "core/io/fs.h"
#include "core/model/model.h"
#include "core/io/tokenizer.h"

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace kakeya::test {

inline std::string env_or_fail(const char* name) {
  const char* v = std::getenv(name);
  if (!v) ADD_FAILURE() << "environment variable " << name << " is not set (run the tests through ctest)";
  return v ? v : "";
}
// f() must throw a kakeya::Error whose message contains `needle`.
inline void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

inline std::string fixtures_dir(const std::string& name) { return env_or_fail("KAKEYA_FIXTURES") + "/" + name; }
// The real model; CI fetches it before the tests (`make model`), so its absence is a failure, not a skip.
inline std::string real_model_dir() {
  std::string d = env_or_fail("KAKEYA_MODEL_DIR");
  if (!fs::exists(d + "/model.safetensors"))
    ADD_FAILURE() << d << " has no model.safetensors: run `make model` first";
  return d;
}

// Trained artifacts shipped in the repo (checkpoints/gemma3-270m/<what>): tracked files, so absence is a failure.
inline std::string shipped_dir(const std::string& what) {
  std::string d = env_or_fail("KAKEYA_SOURCE_DIR") + "/checkpoints/gemma3-270m/" + what;
  if (!fs::exists(d)) ADD_FAILURE() << d << " does not exist (it is tracked in git)";
  return d;
}

// The real model loaded once per test binary (CPU f32, a RoPE table of 256 positions:
// real-model tests stay short), its tokenizer, and text encoded without special tokens.
inline const Model& real_model() {
  static Model m = [] {
    ModelOptions mo;
    mo.max_positions = 256;
    return Model::load(real_model_dir(), mo);
  }();
  return m;
}
inline const Tokenizer& real_tokenizer() {
  static Tokenizer t = Tokenizer::from_file(real_model_dir() + "/tokenizer.json");
  return t;
}
inline std::vector<int64_t> real_prompt(const std::string& text) {
  auto ids = real_tokenizer().encode(text);
  return std::vector<int64_t>(ids.begin(), ids.end());
}

}  // namespace kakeya::test
