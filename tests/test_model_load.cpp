// Bad model directories give a clear error naming the file and the tensor or
// field, never a crash: missing files, missing / mis-shaped tensors, a
// truncated weights file. Built from the tiny HF fixture of test_model_parity.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include "core/error.h"
#include "core/io/fs.h"
#include "core/model/model.h"
#include "tests/test_util.h"

using namespace kakeya;

namespace {

std::string fixture() { return test::fixtures_dir("model_parity") + "/gemma3"; }

// A copy of the fixture with its tensors edited by `edit`.
std::string edited_copy(const std::string& name,
                        const std::function<void(std::map<std::string, at::Tensor>&)>& edit) {
  std::string dir = fs::temp_dir() + "/kakeya_model_load_" + name;
  fs::make_dirs(dir);
  fs::write_atomic(dir + "/config.json", [] {
    std::ifstream f(fixture() + "/config.json");
    return std::string(std::istreambuf_iterator<char>(f), {});
  }());
  auto st = TensorStore::open_dir(fixture());
  std::map<std::string, at::Tensor> t;
  for (const auto& n : st.names()) t[n] = st.get(n).clone();
  edit(t);
  save_safetensors(dir + "/model.safetensors", t);
  return dir;
}

void expect_error(const std::function<void()>& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << "\n  lacks: " << p;
  }
}

TEST(ModelLoad, FixtureLoads) { EXPECT_NO_THROW(Model::load(fixture())); }

TEST(ModelLoad, MissingDirectoryNamesConfig) {
  expect_error([] { Model::load("/nonexistent/model"); }, {"/nonexistent/model/config.json"});
}

TEST(ModelLoad, MissingTensorNamesIt) {
  auto dir = edited_copy("missing", [](auto& t) { t.erase("model.layers.1.self_attn.k_proj.weight"); });
  expect_error([&] { Model::load(dir); }, {"model.layers.1.self_attn.k_proj.weight", dir});
}

TEST(ModelLoad, MisShapedTensorNamesExpectedShape) {
  auto dir = edited_copy("shape", [](auto& t) {
    auto& w = t["model.layers.0.mlp.down_proj.weight"];
    w = w.slice(1, 0, w.size(1) - 1).contiguous();
  });
  expect_error([&] { Model::load(dir); }, {"model.layers.0.mlp.down_proj.weight", "[48, 80]", "[48, 79]"});
}

TEST(ModelLoad, TruncatedWeightsFile) {
  auto dir = edited_copy("truncated", [](auto&) {});
  std::string path = dir + "/model.safetensors";
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  fs::write_atomic(path, bytes.substr(0, bytes.size() - 100));
  expect_error([&] { Model::load(dir); }, {"model.safetensors"});
}

TEST(ModelLoad, BadConfigJson) {
  std::string dir = fs::temp_dir() + "/kakeya_model_load_badjson";
  fs::make_dirs(dir);
  fs::write_atomic(dir + "/config.json", "{\"model_type\": \"gemma3_text\", \"hidden_size\": ");
  expect_error([&] { Model::load(dir); }, {dir + "/config.json", "not valid JSON"});
  fs::write_atomic(dir + "/config.json", "{\"model_type\": \"mamba\"}");
  expect_error([&] { Model::load(dir); }, {"model_type 'mamba'", "config.json"});
}

}  // namespace
