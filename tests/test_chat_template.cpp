// kakeya::ChatTemplate against transformers' own renderer (fixtures of
// tests/fixtures/make_chat_template_fixtures.py) on the shipped templates, and
// loading a template from a model directory the way transformers finds it.
#include "core/io/chat_template.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "core/error.h"

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;
using kakeya::ChatMessage;
using kakeya::ChatTemplate;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  if (!v) ADD_FAILURE() << name << " is not set: run the tests through ctest";
  return v ? v : "";
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open " + path);
  return json::parse(f);
}

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  ASSERT_TRUE(f.good()) << path;
}

std::string show(const std::string& s) {
  std::string out;
  for (char c : s) out += c == '\n' ? std::string("\\n") : std::string(1, c);
  return out;
}

std::string shipped(const std::string& name) {
  return env("KAKEYA_SOURCE_DIR") + "/checkpoints/chat_templates/" + name + ".jinja";
}

// What the template's raise_exception/errors say; "" when render succeeds.
std::string error_of(const ChatTemplate& t, const std::vector<ChatMessage>& messages, bool add_gen = true) {
  try {
    t.render(messages, add_gen);
  } catch (const kakeya::Error& e) {
    return e.what();
  }
  return "";
}

std::string load_error(const std::string& dir, const std::string& override_path = "") {
  try {
    ChatTemplate::load(dir, override_path);
  } catch (const kakeya::Error& e) {
    return e.what();
  }
  return "";
}

// strftime_now("%d %b %Y") as the template sees it now (the Llama 3 template prints it).
std::string today() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%d %b %Y", std::localtime(&now));
  return buf;
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (size_t p = 0; (p = s.find(from, p)) != std::string::npos; p += to.size()) s.replace(p, from.size(), to);
}

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("kakeya_chat_template_" + std::to_string(getpid()) + "_" + std::to_string(counter_++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

const std::vector<ChatMessage> kHello = {{"user", "Hello!"}};

// Every case of the fixture, byte for byte; raising cases must raise with transformers' message.
TEST(ChatTemplateTest, MatchesTransformers) {
  const json fx = read_json(env("KAKEYA_FIXTURES") + "/chat_templates/cases.json");
  const std::string date = fx["date"];
  // Shipped templates go through load() as the server does: a model dir whose
  // tokenizer_config.json names the tokens, and the template by --chat-template.
  std::map<std::string, ChatTemplate> templates;
  for (const auto& [name, t] : fx["templates"].items()) {
    if (t.contains("source")) {
      templates.emplace(name, ChatTemplate(t["source"], t["bos_token"], t["eos_token"]));
      continue;
    }
    TempDir dir;
    write_file(dir.path() / "tokenizer_config.json",
               json{{"bos_token", t["bos_token"]}, {"eos_token", {{"content", t["eos_token"]}, {"special", true}}}}.dump());
    templates.emplace(name, ChatTemplate::load(dir.str(), t["file"]));
  }
  ASSERT_EQ(templates.size(), 4u);
  ASSERT_EQ(templates.count("gemma") + templates.count("qwen3") + templates.count("llama3"), 3u);

  size_t compared = 0, raised = 0;
  for (const json& c : fx["cases"]) {
    std::vector<ChatMessage> messages;
    for (const json& m : c["messages"]) messages.push_back({m["role"], m["content"]});
    const ChatTemplate& t = templates.at(c["template"]);
    const bool add_gen = c["add_generation_prompt"];
    const std::string what = std::string(c["template"]) + "/" + std::string(c["conversation"]) +
                             (add_gen ? " +gen" : " -gen");
    if (c.contains("error")) {
      const std::string err = error_of(t, messages, add_gen);
      EXPECT_NE(err.find(std::string(c["error"])), std::string::npos) << what << ": got error '" << err << "'";
      ++raised;
      continue;
    }
    std::string expected = c["expected"];
    if (date != today()) replace_all(expected, "Today Date: " + date, "Today Date: " + today());
    std::string got;
    try {
      got = t.render(messages, add_gen);
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": threw " << e.what();
      continue;
    }
    EXPECT_EQ(got, expected) << what << "\n got:      " << show(got) << "\n expected: " << show(expected);
    ++compared;
  }
  EXPECT_EQ(compared + raised, fx["cases"].size());
  EXPECT_GE(compared, 50u);
  EXPECT_EQ(raised, 2u);  // Gemma on the system turn, with and without the generation prompt
}

TEST(ChatTemplateTest, GemmaRaisesOnUnsupportedRoles) {
  TempDir dir;
  const ChatTemplate gemma = ChatTemplate::load(dir.str(), shipped("gemma"));
  EXPECT_EQ(error_of(gemma, kHello), "");
  const std::string system = error_of(gemma, {{"system", "Be brief."}, {"user", "Hi"}});
  // Just the template's message, without the engine's source excerpt: it goes back to the client.
  EXPECT_EQ(system, "chat template raised an exception: System role not supported");
  const std::string alternate = error_of(gemma, {{"user", "a"}, {"user", "b"}});
  EXPECT_NE(alternate.find("Conversation roles must alternate user/assistant/user/assistant/..."), std::string::npos)
      << alternate;
  // raise_exception() surfaces as a std::runtime_error as well.
  EXPECT_THROW(gemma.render({{"assistant", "first"}}), std::runtime_error);
}

TEST(ChatTemplateTest, EmptyMessagesAreRejected) {
  const ChatTemplate t("{{ messages|length }}", "", "");
  EXPECT_EQ(t.render({{"user", "x"}}), "1");
  EXPECT_NE(error_of(t, {}).find("empty"), std::string::npos);
}

// A template that shows the special tokens and the first message.
const char kEcho[] = "{{ bos_token }}|{{ eos_token }}|{{ messages[0].content }}";

TEST(ChatTemplateTest, LoadsStringFromTokenizerConfig) {
  TempDir dir;
  write_file(dir.path() / "tokenizer_config.json",
             json{{"bos_token", "<bos>"}, {"eos_token", {{"content", "<eos>"}, {"lstrip", false}}},
                  {"chat_template", kEcho}}.dump());
  const ChatTemplate t = ChatTemplate::load(dir.str());
  EXPECT_EQ(t.source(), kEcho);
  EXPECT_EQ(t.bos_token(), "<bos>");
  EXPECT_EQ(t.eos_token(), "<eos>");
  EXPECT_EQ(t.render(kHello), "<bos>|<eos>|Hello!");
}

TEST(ChatTemplateTest, LoadsDefaultFromTemplateList) {
  TempDir dir;
  write_file(dir.path() / "tokenizer_config.json",
             json{{"eos_token", "</s>"},
                  {"chat_template", json::array({{{"name", "tool_use"}, {"template", "TOOLS {{ eos_token }}"}},
                                                 {{"name", "default"}, {"template", "DEFAULT {{ eos_token }}"}},
                                                 {{"name", "rag"}, {"template", "RAG"}}})}}.dump());
  const ChatTemplate t = ChatTemplate::load(dir.str());
  EXPECT_EQ(t.render(kHello), "DEFAULT </s>");
  EXPECT_EQ(t.bos_token(), "");

  TempDir no_default;
  write_file(no_default.path() / "tokenizer_config.json",
             json{{"chat_template", json::array({{{"name", "tool_use"}, {"template", "x"}}})}}.dump());
  const std::string err = load_error(no_default.str());
  EXPECT_NE(err.find("tokenizer_config.json field 'chat_template'"), std::string::npos) << err;
  EXPECT_NE(err.find("\"default\""), std::string::npos) << err;
}

TEST(ChatTemplateTest, LoadsChatTemplateJinjaAndOverride) {
  TempDir dir;
  write_file(dir.path() / "tokenizer_config.json", json{{"bos_token", "<s>"}, {"eos_token", "</s>"}}.dump());
  // transformers drops one trailing newline of the template source, as Jinja does.
  write_file(dir.path() / "chat_template.jinja", "FILE {{ bos_token }}{{ messages[0].content }}\n");
  EXPECT_EQ(ChatTemplate::load(dir.str()).render(kHello), "FILE <s>Hello!");

  // The separate file wins over the tokenizer_config.json field, as in transformers.
  write_file(dir.path() / "tokenizer_config.json",
             json{{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"chat_template", "CONFIG"}}.dump());
  EXPECT_EQ(ChatTemplate::load(dir.str()).render(kHello), "FILE <s>Hello!");

  // --chat-template wins over both; the tokens still come from the model dir.
  const fs::path override_path = dir.path() / "override.jinja";
  write_file(override_path, "OVERRIDE {{ eos_token }}");
  EXPECT_EQ(ChatTemplate::load(dir.str(), override_path.string()).render(kHello), "OVERRIDE </s>");

  const std::string missing = load_error(dir.str(), (dir.path() / "absent.jinja").string());
  EXPECT_NE(missing.find("absent.jinja"), std::string::npos) << missing;
}

TEST(ChatTemplateTest, MissingTemplateNamesConfigAndFlag) {
  TempDir dir;
  write_file(dir.path() / "tokenizer_config.json", json{{"bos_token", "<bos>"}}.dump());
  const std::string err = load_error(dir.str());
  EXPECT_NE(err.find((dir.path() / "tokenizer_config.json").string()), std::string::npos) << err;
  EXPECT_NE(err.find("--chat-template"), std::string::npos) << err;

  // The embedded Gemma 3 270M is a base model: no template until --chat-template gives one.
  const std::string model_dir = env("KAKEYA_MODEL_DIR");
  if (!fs::exists(fs::path(model_dir) / "tokenizer_config.json")) GTEST_SKIP() << "no model at " << model_dir;
  const std::string model_err = load_error(model_dir);
  EXPECT_NE(model_err.find("tokenizer_config.json"), std::string::npos) << model_err;
  EXPECT_NE(model_err.find("--chat-template"), std::string::npos) << model_err;
  const ChatTemplate gemma = ChatTemplate::load(model_dir, shipped("gemma"));
  EXPECT_EQ(gemma.render(kHello), "<bos><start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n");
}

TEST(ChatTemplateTest, SyntaxErrorsAreReported) {
  EXPECT_THROW(ChatTemplate("{% if messages %}never closed", "", ""), kakeya::Error);
  EXPECT_THROW(ChatTemplate("{{ messages[0].content + }}", "", ""), std::runtime_error);
  EXPECT_NO_THROW(ChatTemplate("{% if messages %}closed{% endif %}", "", ""));

  TempDir dir;
  write_file(dir.path() / "tokenizer_config.json", json{{"chat_template", "{% for m in messages %}{{ m }"}}.dump());
  const std::string err = load_error(dir.str());
  EXPECT_NE(err.find("tokenizer_config.json field 'chat_template'"), std::string::npos) << err;
  EXPECT_NE(err.find("does not parse"), std::string::npos) << err;

  const fs::path bad = dir.path() / "bad.jinja";
  write_file(bad, "{{ 'unterminated }}");
  const std::string file_err = load_error(dir.str(), bad.string());
  EXPECT_NE(file_err.find("bad.jinja"), std::string::npos) << file_err;
  EXPECT_NE(file_err.find("does not parse"), std::string::npos) << file_err;
}

}  // namespace
