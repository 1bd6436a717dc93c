// Safetensors reader/writer: interop with the Python `safetensors` package in
// both directions, our own round trip, and malformed files. Reference files
// come from tests/fixtures/make_safetensors_fixtures.py ($KAKEYA_FIXTURES/safetensors).
#include "core/error.h"
#include "core/io/safetensors.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <dirent.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <string>

namespace kakeya {
namespace {

using nlohmann::json;
using StringMap = std::map<std::string, std::string>;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::string fixtures() {
  const std::string root = env("KAKEYA_FIXTURES");
  EXPECT_FALSE(root.empty()) << "KAKEYA_FIXTURES is unset; run through ctest";
  return root + "/safetensors";
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  return json::parse(in);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// Directory helpers use POSIX: libtorch.so interposes std::filesystem with
// functions built for a newer libstdc++ (remove_all crashes on GCC 12).
std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) out.push_back(e->d_name);
    }
    ::closedir(d);
  }
  return out;
}

void remove_tree(const std::string& dir) {
  ::nftw(dir.c_str(), [](const char* p, const struct stat*, int, FTW*) { return std::remove(p); }, 16,
         FTW_DEPTH | FTW_PHYS);
}

void copy_dir(const std::string& from, const std::string& to) {
  ASSERT_EQ(::mkdir(to.c_str(), 0755), 0) << to;
  for (const auto& name : list_dir(from)) write_bytes(to + "/" + name, read_bytes(from + "/" + name));
}

std::string basename_of(const std::string& path) { return path.substr(path.rfind('/') + 1); }

std::string u64_le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = char(v >> (8 * i));
  return s;
}

// A safetensors file from its parts; `length` overrides the true header length
// to make the prefix lie.
std::string raw_file(const std::string& header, const std::string& buffer, int64_t length = -1) {
  return u64_le(length < 0 ? header.size() : uint64_t(length)) + header + buffer;
}

std::string dtype_name(at::ScalarType t) {
  static const std::map<at::ScalarType, std::string> names = {
      {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"},
      {at::kFloat8_e4m3fn, "F8_E4M3"}, {at::kFloat8_e5m2, "F8_E5M2"}, {at::kLong, "I64"}, {at::kInt, "I32"},
      {at::kShort, "I16"}, {at::kChar, "I8"}, {at::ScalarType::UInt64, "U64"}, {at::ScalarType::UInt32, "U32"},
      {at::ScalarType::UInt16, "U16"}, {at::kByte, "U8"}, {at::kBool, "BOOL"}};
  auto it = names.find(t);
  return it == names.end() ? "?" : it->second;
}

// Flattened elements as JSON numbers, in the same convention as the Python
// side: floats through float64 (exact for every narrower float type), integers
// as integers (U64 kept unsigned).
json flat_values(const at::Tensor& t) {
  json out = json::array();
  const at::Tensor c = t.contiguous();
  if (at::isFloatingType(t.scalar_type())) {
    const at::Tensor d = c.to(at::kDouble).flatten();
    for (int64_t i = 0; i < d.numel(); ++i) out.push_back(d.data_ptr<double>()[i]);
  } else if (t.scalar_type() == at::ScalarType::UInt64) {
    const auto* p = static_cast<const uint64_t*>(c.data_ptr());
    for (int64_t i = 0; i < c.numel(); ++i) out.push_back(p[i]);
  } else {
    const at::Tensor l = c.to(at::kLong).flatten();
    for (int64_t i = 0; i < l.numel(); ++i) out.push_back(l.data_ptr<int64_t>()[i]);
  }
  return out;
}

// Compares a tensor we read with one SPEC entry of expected.json.
void expect_matches(const at::Tensor& t, const json& spec, const std::string& name) {
  SCOPED_TRACE(name);
  EXPECT_EQ(t.device().type(), at::kCPU);
  EXPECT_EQ(dtype_name(t.scalar_type()), spec["dtype"].get<std::string>());
  EXPECT_EQ(t.sizes().vec(), spec["shape"].get<std::vector<int64_t>>());
  const json vals = flat_values(t);
  if (spec.contains("values")) {
    EXPECT_EQ(vals, spec["values"]);  // exact: same bits on both sides
    return;
  }
  const double sum = t.to(at::kDouble).sum().item<double>();
  EXPECT_NEAR(sum, spec["sum"].get<double>(), 1e-9 * std::max(1.0, std::abs(sum)));
  for (size_t i = 0; i < spec["first"].size(); ++i) EXPECT_EQ(vals[i], spec["first"][i]) << "element " << i;
  EXPECT_EQ(vals.back(), spec["last"]);
}

// Passes if f() throws kakeya::Error whose message contains every part.
template <class F>
testing::AssertionResult throws_with(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) {
      if (msg.find(p) == std::string::npos) {
        return testing::AssertionFailure() << "message lacks '" << p << "': " << msg;
      }
    }
    return testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "threw a non-kakeya exception: " << e.what();
  }
  return testing::AssertionFailure() << "did not throw";
}

class SafetensorsTest : public testing::Test {
 protected:
  void SetUp() override {
    const std::string tmp = env("TMPDIR").empty() ? "/tmp" : env("TMPDIR");
    std::string tmpl = tmp + "/kakeya_st_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { remove_tree(dir_); }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // Writes a file and expects opening it to fail naming the file and `parts`.
  testing::AssertionResult bad_file(const std::string& name, const std::string& bytes,
                                    std::initializer_list<std::string> parts) {
    write_bytes(path(name), bytes);
    std::vector<std::string> all(parts);
    all.push_back(name);
    try {
      SafetensorsFile f(path(name));
    } catch (const Error& e) {
      const std::string msg = e.what();
      for (const auto& p : all) {
        if (msg.find(p) == std::string::npos) return testing::AssertionFailure() << "lacks '" << p << "': " << msg;
      }
      return testing::AssertionSuccess() << msg;
    }
    return testing::AssertionFailure() << name << " opened without error";
  }

  std::string dir_;
};

// ---- Python-written files read by us -------------------------------------

TEST_F(SafetensorsTest, ReadsFilesWrittenByPython) {
  const json expected = read_json(fixtures() + "/expected.json");
  ASSERT_FALSE(expected["files"].empty());
  for (const auto& [file, spec] : expected["files"].items()) {
    SCOPED_TRACE(file);
    SafetensorsFile f(fixtures() + "/" + file);
    std::vector<std::string> want;
    for (const auto& kv : spec["tensors"].items()) want.push_back(kv.key());
    EXPECT_EQ(f.names(), want);  // both sorted
    EXPECT_EQ(f.header().metadata, spec["metadata"].get<StringMap>());
    for (const auto& [name, t] : spec["tensors"].items()) expect_matches(f.get(name), t, name);

    const TensorStore store = TensorStore::open_file(fixtures() + "/" + file);
    EXPECT_EQ(store.names(), want);
    EXPECT_EQ(store.metadata(), f.header().metadata);
  }
}

TEST_F(SafetensorsTest, ReadsShardedDirWrittenByHuggingfaceHub) {
  const json spec = read_json(fixtures() + "/expected.json")["dirs"]["sharded"];
  const TensorStore store = TensorStore::open_dir(fixtures() + "/sharded");
  std::vector<std::string> want;
  for (const auto& kv : spec["tensors"].items()) want.push_back(kv.key());
  EXPECT_EQ(store.names(), want);
  for (const auto& [name, t] : spec["tensors"].items()) {
    expect_matches(store.get(name), t, name);
    EXPECT_EQ(basename_of(store.file_of(name)), spec["shard_of"][name].get<std::string>());
  }
  for (const auto& [k, v] : spec["metadata"].items()) EXPECT_EQ(store.metadata().at(k), v.get<std::string>());
  const at::Tensor w = store.get("model.layers.0.weight", {16, 16});
  EXPECT_EQ(w.scalar_type(), at::kBFloat16);
}

// ---- our writer -----------------------------------------------------------

std::map<std::string, at::Tensor> sample_tensors() {
  at::manual_seed(7);
  const at::Tensor base = at::randn({6, 5});
  return {
      {"f64", at::randn({3, 2}, at::kDouble)},
      {"f32", at::randn({4, 3})},
      {"f16", at::randn({7}).to(at::kHalf)},
      {"bf16", at::randn({2, 3, 5}).to(at::kBFloat16)},
      {"f8_e4m3", at::randn({9}).to(at::kFloat8_e4m3fn)},
      {"f8_e5m2", at::randn({3}).to(at::kFloat8_e5m2)},
      {"i64", at::arange(-5, 5, at::kLong)},
      {"i32", at::arange(0, 6, at::kInt).reshape({2, 3})},
      {"i16", at::arange(-3, 3, at::kShort)},
      {"i8", at::arange(-128, 128, 51, at::kChar)},
      {"u8", at::arange(0, 250, 31, at::kByte)},
      {"bool", at::randn({5}) > 0},
      {"scalar", at::scalar_tensor(2.5)},
      {"scalar_bf16", at::scalar_tensor(-1.25, at::kBFloat16)},
      {"empty", at::zeros({0, 4})},
      {"empty_i32", at::zeros({3, 0}, at::kInt)},
      {"odd_u8", at::arange(3, at::kByte)},  // odd size: later tensors land misaligned
      {"transposed", base.t()},              // non-contiguous view
      {"sliced", base.slice(0, 2, 5)},       // view with a storage offset
      {"z.last", at::ones({2, 2}, at::kBFloat16)},
  };
}

void expect_same(const at::Tensor& got, const at::Tensor& want, const std::string& name) {
  SCOPED_TRACE(name);
  ASSERT_EQ(got.scalar_type(), want.scalar_type());
  ASSERT_EQ(got.sizes(), want.sizes());
  const at::Tensor w = want.contiguous().cpu();
  const at::Tensor g = got.contiguous();
  // Bytes, not values: covers float8 and keeps NaN/-0.0 honest.
  EXPECT_EQ(std::memcmp(g.data_ptr(), w.data_ptr(), w.nbytes()), 0);
}

TEST_F(SafetensorsTest, RoundTripsOwnFiles) {
  const auto tensors = sample_tensors();
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "12"}, {"unicode", "\xc3\xa9"}};
  save_safetensors(path("rt.safetensors"), tensors, meta);
  const SafetensorsFile f(path("rt.safetensors"));
  EXPECT_EQ(f.header().metadata, meta);
  ASSERT_EQ(f.names().size(), tensors.size());
  for (const auto& [name, t] : tensors) expect_same(f.get(name), t, name);
  EXPECT_EQ(list_dir(dir_), std::vector<std::string>{"rt.safetensors"}) << "temp file left behind";
}

TEST_F(SafetensorsTest, WriterLayoutMatchesHuggingFace) {
  save_safetensors(path("layout.safetensors"), sample_tensors());
  const std::string bytes = read_bytes(path("layout.safetensors"));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "header not padded to 8 bytes";
  const std::string text = bytes.substr(8, n);
  const size_t close = text.find_last_of('}');
  EXPECT_EQ(text.find_first_not_of(' ', close + 1), std::string::npos) << "padding must be spaces";
  const json header = json::parse(text);
  EXPECT_FALSE(header.contains("__metadata__"));  // none given
  uint64_t prev_end = 0;
  for (const auto& [name, e] : header.items()) {  // nlohmann iterates keys sorted
    EXPECT_EQ(e["data_offsets"][0].get<uint64_t>(), prev_end) << name << " not in sorted-name order";
    prev_end = e["data_offsets"][1].get<uint64_t>();
  }
  EXPECT_EQ(8 + n + prev_end, bytes.size());
}

TEST_F(SafetensorsTest, PythonReadsOwnFiles) {
  const std::string python = env("KAKEYA_PYTHON"), src = env("KAKEYA_SOURCE_DIR");
  ASSERT_FALSE(python.empty() || src.empty()) << "KAKEYA_PYTHON / KAKEYA_SOURCE_DIR unset; run through ctest";
  auto tensors = sample_tensors();
  tensors["u16"] = at::arange(60000, 60003, at::kInt).to(at::ScalarType::UInt16);
  tensors["u32"] = at::arange(0, 4, at::kLong).mul(1000000000).to(at::ScalarType::UInt32);
  tensors["u64"] = at::arange(-2, 2, at::kLong).to(at::ScalarType::UInt64);  // -2 wraps to 2^64 - 2
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"who", "kakeya"}};
  save_safetensors(path("ours.safetensors"), tensors, meta);

  json spec = {{"metadata", meta}, {"tensors", json::object()}};
  for (const auto& [name, t] : tensors) {
    spec["tensors"][name] = {{"dtype", dtype_name(t.scalar_type())}, {"shape", t.sizes().vec()},
                             {"values", flat_values(t)}};
  }
  std::ofstream(path("ours.json")) << spec.dump();
  const std::string cmd = "'" + python + "' '" + src + "/tests/fixtures/check_safetensors.py' '" +
                          path("ours.safetensors") + "' '" + path("ours.json") + "'";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status)) << cmd;
  EXPECT_EQ(WEXITSTATUS(status), 0) << cmd;
}

TEST_F(SafetensorsTest, TensorsAliasTheMappingAndOutliveTheFile) {
  save_safetensors(path("a.safetensors"), {{"x", at::arange(16, at::kFloat)}, {"y", at::ones({3})}});
  at::Tensor x;
  {
    const SafetensorsFile f(path("a.safetensors"));
    x = f.get("x");
    EXPECT_EQ(f.get("x").data_ptr(), x.data_ptr()) << "get() should alias, not copy";
  }
  // Replacing the file by rename leaves the old mapping intact.
  save_safetensors(path("a.safetensors"), {{"x", at::zeros({16})}});
  EXPECT_TRUE(at::equal(x, at::arange(16, at::kFloat)));
  EXPECT_TRUE(at::equal(SafetensorsFile(path("a.safetensors")).get("x"), at::zeros({16})));
}

TEST_F(SafetensorsTest, MisalignedTensorsAreCopied) {
  // U8[1] then F32[2] at buffer offset 1; the header pads to 8, so the F32
  // data sits at an odd address.
  std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                       R"("f":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const float vals[2] = {1.5f, -2.0f};
  std::string buffer(1, '\x07');
  buffer.append(reinterpret_cast<const char*>(vals), sizeof vals);
  write_bytes(path("mis.safetensors"), raw_file(header, buffer));
  const SafetensorsFile f(path("mis.safetensors"));
  const at::Tensor t = f.get("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4, 0u);
  EXPECT_NE(f.get("f").data_ptr(), t.data_ptr()) << "misaligned data must be copied";
  EXPECT_TRUE(at::equal(t, at::tensor({1.5f, -2.0f})));
  EXPECT_EQ(f.get("a").item<uint8_t>(), 7);

  // An unpadded header misaligns even the first tensor.
  const std::string odd = R"({"f":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} )";
  ASSERT_NE((8 + odd.size()) % 4, 0u);
  write_bytes(path("odd.safetensors"), raw_file(odd, std::string(reinterpret_cast<const char*>(vals), sizeof vals)));
  EXPECT_TRUE(at::equal(SafetensorsFile(path("odd.safetensors")).get("f"), at::tensor({1.5f, -2.0f})));
}

TEST_F(SafetensorsTest, OpenDirFindsSingleFile) {
  save_safetensors(path("model.safetensors"), {{"w", at::ones({2, 3})}}, {{"format", "pt"}});
  const TensorStore store = TensorStore::open_dir(dir_);
  EXPECT_EQ(store.names(), std::vector<std::string>{"w"});
  EXPECT_EQ(store.file_of("w"), path("model.safetensors"));
  EXPECT_EQ(store.metadata().at("format"), "pt");
  EXPECT_TRUE(at::equal(store.get("w", {2, 3}), at::ones({2, 3})));
}

// ---- errors: every message names the file and the field -------------------

TEST_F(SafetensorsTest, WriterRejectsBadInput) {
  EXPECT_TRUE(throws_with([&] { save_safetensors(path("c.safetensors"), {{"c", at::zeros({2}, at::kComplexFloat)}}); },
                          {"c.safetensors", "tensor 'c'", "ComplexFloat"}));
  EXPECT_TRUE(throws_with([&] { save_safetensors(path("m.safetensors"), {{"__metadata__", at::zeros({2})}}); },
                          {"m.safetensors", "__metadata__", "reserved"}));
  EXPECT_TRUE(throws_with([&] { save_safetensors(path("no/such/dir/x.safetensors"), {{"x", at::zeros({2})}}); },
                          {"x.safetensors", "temporary file"}));
  EXPECT_TRUE(list_dir(dir_).empty()) << "temp file left behind";
}

TEST_F(SafetensorsTest, TruncatedFiles) {
  const std::string good = read_bytes(fixtures() + "/large.safetensors");
  ASSERT_GT(good.size(), 1000u);
  EXPECT_TRUE(bad_file("half.safetensors", good.substr(0, good.size() / 2), {"data_offsets", "exceed", "truncated"}));
  EXPECT_TRUE(bad_file("in_header.safetensors", good.substr(0, 40), {"header length", "past the end"}));
  EXPECT_TRUE(bad_file("five.safetensors", good.substr(0, 5), {"5 bytes", "8-byte header length"}));
  EXPECT_TRUE(bad_file("empty.safetensors", "", {"0 bytes"}));
}

TEST_F(SafetensorsTest, LyingHeaderLength) {
  const std::string h = R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  EXPECT_TRUE(bad_file("beyond.safetensors", raw_file(h, "xy", h.size() + 3), {"header length", "past the end"}));
  EXPECT_TRUE(bad_file("huge.safetensors", raw_file(h, "xy", int64_t(1) << 62), {"header length", "limit"}));
  EXPECT_TRUE(bad_file("all_ff.safetensors", std::string(64, '\xff'), {"header length", "limit"}));
  // Too short: the header cuts the JSON, whose remainder lands in the buffer.
  EXPECT_TRUE(bad_file("short.safetensors", raw_file(h, "xy", h.size() - 5), {"invalid JSON"}));
}

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape, uint64_t b,
                  uint64_t e) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
         std::to_string(b) + "," + std::to_string(e) + "]}";
}

TEST_F(SafetensorsTest, BadOffsets) {
  EXPECT_TRUE(bad_file("overlap.safetensors",
                       raw_file("{" + entry("a", "F32", "[4]", 0, 16) + "," + entry("b", "F32", "[2]", 8, 16) + "}",
                                std::string(16, '\0')),
                       {"tensor 'b'", "data_offsets [8, 16]", "overlap tensor 'a'"}));
  EXPECT_TRUE(bad_file("range.safetensors", raw_file("{" + entry("a", "F32", "[4]", 4, 20) + "}", std::string(16, '\0')),
                       {"tensor 'a'", "data_offsets [4, 20]", "exceed the data buffer of 16 bytes"}));
  EXPECT_TRUE(bad_file("gap.safetensors",
                       raw_file("{" + entry("a", "F32", "[1]", 0, 4) + "," + entry("b", "F32", "[1]", 8, 12) + "}",
                                std::string(12, '\0')),
                       {"tensor 'b'", "data_offsets [8, 12]", "gap", "[4, 8]"}));
  EXPECT_TRUE(bad_file("lead.safetensors", raw_file("{" + entry("a", "F32", "[1]", 4, 8) + "}", std::string(8, '\0')),
                       {"tensor 'a'", "gap", "[0, 4]"}));
  EXPECT_TRUE(bad_file("trailing.safetensors", raw_file("{" + entry("a", "F32", "[1]", 0, 4) + "}", std::string(9, '\0')),
                       {"data buffer is 9 bytes", "cover 4"}));
  EXPECT_TRUE(bad_file("reversed.safetensors", raw_file("{" + entry("a", "U8", "[0]", 4, 0) + "}", std::string(4, '\0')),
                       {"tensor 'a'", "end before they begin"}));
  EXPECT_TRUE(bad_file("offs3.safetensors",
                       raw_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", "x"),
                       {"tensor 'a'", "data_offsets", "expected [begin, end]"}));
  EXPECT_TRUE(bad_file("offneg.safetensors",
                       raw_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", "x"),
                       {"tensor 'a'", "data_offsets[0] is -1"}));
}

TEST_F(SafetensorsTest, BadEntries) {
  EXPECT_TRUE(bad_file("size.safetensors",
                       raw_file("{" + entry("model.layers.0.q_proj.weight", "BF16", "[4, 8]", 0, 100) + "}",
                                std::string(100, '\0')),
                       {"tensor 'model.layers.0.q_proj.weight': data_offsets [0, 100] hold 100 bytes, "
                        "shape [4, 8] of BF16 needs 64"}));
  EXPECT_TRUE(bad_file("dtype.safetensors", raw_file("{" + entry("a", "F33", "[1]", 0, 4) + "}", std::string(4, '\0')),
                       {"tensor 'a'", "dtype 'F33'"}));
  EXPECT_TRUE(bad_file("dtype_num.safetensors",
                       raw_file(R"({"a":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0')),
                       {"tensor 'a'", "field 'dtype'", "expected a string"}));
  EXPECT_TRUE(bad_file("negshape.safetensors",
                       raw_file("{" + entry("a", "F32", "[2, -1]", 0, 0) + "}", ""), {"tensor 'a'", "shape[1] is -1"}));
  EXPECT_TRUE(bad_file("floatshape.safetensors",
                       raw_file("{" + entry("a", "F32", "[2.0]", 0, 8) + "}", std::string(8, '\0')),
                       {"tensor 'a'", "shape[0] is 2.0"}));
  EXPECT_TRUE(bad_file("hugeshape.safetensors",
                       raw_file("{" + entry("a", "F32", "[4294967296, 4294967296]", 0, 0) + "}", ""),
                       {"tensor 'a'", "overflows"}));
  EXPECT_TRUE(bad_file("missing.safetensors", raw_file(R"({"a":{"dtype":"F32","shape":[1]}})", ""),
                       {"tensor 'a'", "missing field 'data_offsets'"}));
  EXPECT_TRUE(bad_file("unknown.safetensors",
                       raw_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"offset":3}})", "x"),
                       {"tensor 'a'", "unknown field 'offset'"}));
  EXPECT_TRUE(bad_file("notobj.safetensors", raw_file(R"({"a":[1,2]})", ""), {"tensor 'a'", "entry is a JSON array"}));
  EXPECT_TRUE(bad_file("meta.safetensors", raw_file(R"({"__metadata__":{"step":12}})", ""),
                       {"__metadata__ key 'step'", "expected a string"}));
}

TEST_F(SafetensorsTest, BadJson) {
  EXPECT_TRUE(bad_file("nonjson.safetensors", raw_file("this is not json", ""), {"header", "invalid JSON"}));
  EXPECT_TRUE(bad_file("array.safetensors", raw_file("[1, 2]  ", ""), {"header is a JSON array, expected an object"}));
  EXPECT_TRUE(bad_file("empty_header.safetensors", raw_file("", ""), {"invalid JSON"}));
  EXPECT_TRUE(bad_file("dup.safetensors",
                       raw_file("{" + entry("a", "U8", "[1]", 0, 1) + "," + entry("a", "U8", "[1]", 1, 2) + "}", "xy"),
                       {"key 'a' appears twice"}));
  EXPECT_TRUE(bad_file("dupfield.safetensors",
                       raw_file(R"({"a":{"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]}})", "x"),
                       {"entry 'a'", "key 'dtype' appears twice"}));
  EXPECT_TRUE(bad_file("deep.safetensors", raw_file(std::string(1000, '[') + std::string(1000, ']'), ""),
                       {"nested deeper"}));
  EXPECT_TRUE(bad_file("nul.safetensors", raw_file(std::string("{\"a\0\":1}", 9), ""), {"invalid JSON"}));
}

TEST_F(SafetensorsTest, InvalidBoolBytes) {
  write_bytes(path("bool.safetensors"), raw_file("{" + entry("m", "BOOL", "[3]", 0, 3) + "}", std::string("\1\0\2", 3)));
  const SafetensorsFile f(path("bool.safetensors"));
  EXPECT_TRUE(throws_with([&] { f.get("m"); }, {"bool.safetensors", "tensor 'm'", "BOOL byte 2 is 2"}));
}

TEST_F(SafetensorsTest, MissingTensorAndShapeMismatch) {
  save_safetensors(path("model.safetensors"),
                   {{"model.layers.0.self_attn.q_proj.weight", at::zeros({8, 4})},
                    {"model.layers.0.self_attn.k_proj.weight", at::zeros({4, 4})},
                    {"model.norm.weight", at::zeros({4})}});
  const TensorStore store = TensorStore::open_dir(dir_);
  EXPECT_TRUE(throws_with([&] { store.get("layers.0.self_attn.q_proj.weight"); },
                          {dir_, "no tensor 'layers.0.self_attn.q_proj.weight'",
                           "nearest: 'model.layers.0.self_attn.q_proj.weight'"}));
  EXPECT_TRUE(throws_with([&] { store.file_of("nope"); }, {dir_, "no tensor 'nope'"}));
  EXPECT_TRUE(throws_with([&] { SafetensorsFile(path("model.safetensors")).get("model.norm.wieght"); },
                          {"model.safetensors", "no tensor 'model.norm.wieght'", "nearest: 'model.norm.weight'"}));
  EXPECT_TRUE(throws_with([&] { store.get("model.layers.0.self_attn.q_proj.weight", {4, 8}); },
                          {"model.safetensors", "tensor 'model.layers.0.self_attn.q_proj.weight'",
                           "has shape [8, 4], expected [4, 8]"}));
}

TEST_F(SafetensorsTest, BadModelDirs) {
  const std::string src = fixtures() + "/sharded";
  const json index = read_json(src + "/model.safetensors.index.json");
  const std::string victim = index["weight_map"]["model.layers.4.weight"];
  auto fresh_copy = [&](const std::string& name) {
    const std::string d = path(name);
    copy_dir(src, d);
    return d;
  };

  const std::string missing = fresh_copy("missing_shard");
  ASSERT_EQ(::unlink((missing + "/" + victim).c_str()), 0);
  EXPECT_TRUE(throws_with([&] { TensorStore::open_dir(missing); },
                          {"model.safetensors.index.json", "tensor '", "shard '" + victim + "'", "does not exist"}));

  const std::string extra = fresh_copy("extra_tensor");
  json idx = index;
  idx["weight_map"]["model.ghost.weight"] = victim;
  std::ofstream(extra + "/model.safetensors.index.json") << idx.dump();
  EXPECT_TRUE(throws_with([&] { TensorStore::open_dir(extra); },
                          {"model.safetensors.index.json", "tensor 'model.ghost.weight'", victim, "no such tensor"}));

  const std::string escape = fresh_copy("escape");
  idx = index;
  idx["weight_map"]["model.norm.weight"] = "../model.safetensors";
  std::ofstream(escape + "/model.safetensors.index.json") << idx.dump();
  EXPECT_TRUE(throws_with([&] { TensorStore::open_dir(escape); },
                          {"model.safetensors.index.json", "tensor 'model.norm.weight'", "expected a file name"}));

  const std::string nomap = fresh_copy("no_weight_map");
  std::ofstream(nomap + "/model.safetensors.index.json") << R"({"metadata": {}})";
  EXPECT_TRUE(throws_with([&] { TensorStore::open_dir(nomap); },
                          {"model.safetensors.index.json", "missing field 'weight_map'"}));

  const std::string broken = fresh_copy("broken_index");
  std::ofstream(broken + "/model.safetensors.index.json") << R"({"weight_map": {"a": "x", "a": "y"}})";
  EXPECT_TRUE(throws_with([&] { TensorStore::open_dir(broken); },
                          {"model.safetensors.index.json", "key 'a' appears twice"}));

  const std::string corrupt = fresh_copy("corrupt_shard");
  write_bytes(corrupt + "/" + victim, "garbage!garbage!");
  EXPECT_TRUE(throws_with([&] { TensorStore::open_dir(corrupt); }, {victim, "header length"}));

  ASSERT_EQ(::mkdir(path("empty_dir").c_str(), 0755), 0);
  EXPECT_TRUE(throws_with([&] { TensorStore::open_dir(path("empty_dir")); },
                          {"empty_dir", "neither model.safetensors nor model.safetensors.index.json"}));
  EXPECT_TRUE(throws_with([&] { SafetensorsFile(path("absent.safetensors")); },
                          {"absent.safetensors", "cannot open"}));
}

}  // namespace
}  // namespace kakeya
