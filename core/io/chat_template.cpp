// Chat templates through llama.cpp's Jinja engine. The engine already follows
// the environment transformers renders with (trim_blocks, lstrip_blocks,
// raise_exception, strftime_now, a tojson that leaves non-ASCII alone); what
// is left here is finding the template the way transformers does and giving
// it the same variables: messages, add_generation_prompt (always defined),
// bos_token, eos_token, and tools/documents as None.
#include "core/io/chat_template.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/io/fs.h"
#include "jinja/lexer.h"
#include "jinja/parser.h"
#include "jinja/runtime.h"
#include "json.h"

namespace kakeya {

struct ChatTemplate::Parsed {
  jinja::program program;
};

namespace {

using json = nlohmann::json;

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KAKEYA_CHECK(f, "cannot read chat template file " << path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A special token in tokenizer_config.json: "<bos>" or {"content": "<bos>", ...}.
std::string special_token(const json& config, const char* field, const std::string& origin) {
  if (!config.contains(field) || config[field].is_null()) return "";
  const json& v = config[field];
  if (v.is_string()) return v.get<std::string>();
  KAKEYA_CHECK(v.is_object() && v.contains("content") && v["content"].is_string(),
               origin << ": field '" << field << "' expected a string or an object with a string \"content\", got "
                      << v.dump());
  return v["content"].get<std::string>();
}

// raise_exception() surfaces as "...Error: Jinja Exception: <message>" once the
// runtime has wrapped it with the source location; the message is what callers show.
const char kRaisedMarker[] = "Jinja Exception: ";

}  // namespace

ChatTemplate::ChatTemplate(std::string source, std::string bos_token, std::string eos_token)
    : source_(std::move(source)), bos_token_(std::move(bos_token)), eos_token_(std::move(eos_token)) {
  auto parsed = std::make_shared<Parsed>();
  try {
    jinja::lexer lexer;
    parsed->program = jinja::parse_from_tokens(lexer.tokenize(source_));
  } catch (const std::exception& e) {
    KAKEYA_FAIL("chat template does not parse: " << e.what());
  }
  parsed_ = std::move(parsed);
}

ChatTemplate ChatTemplate::load(const std::string& model_dir, const std::string& override_path) {
  const std::string config_path = model_dir + "/tokenizer_config.json";
  json config = json::object();
  if (fs::exists(config_path)) {
    config = fs::read_json(config_path, "a tokenizer_config.json");
    KAKEYA_CHECK(config.is_object(), config_path << ": expected a JSON object");
  }
  const std::string bos = special_token(config, "bos_token", config_path);
  const std::string eos = special_token(config, "eos_token", config_path);

  // Same precedence as transformers: a chat_template.jinja file beside the
  // tokenizer wins over the tokenizer_config.json field.
  std::string source, origin;
  const std::string jinja_path = model_dir + "/chat_template.jinja";
  if (!override_path.empty()) {
    source = read_text(override_path);
    origin = override_path;
  } else if (fs::exists(jinja_path)) {
    source = read_text(jinja_path);
    origin = jinja_path;
  } else if (config.contains("chat_template") && !config["chat_template"].is_null()) {
    const json& t = config["chat_template"];
    origin = config_path + " field 'chat_template'";
    if (t.is_string()) {
      source = t.get<std::string>();
    } else {
      // The named-templates form: [{"name": "default", "template": "..."}, {"name": "tool_use", ...}].
      KAKEYA_CHECK(t.is_array(), origin << ": expected a string or a list of {name, template}, got " << t.type_name());
      bool found = false;
      for (const json& entry : t) {
        KAKEYA_CHECK(entry.is_object() && entry.contains("name") && entry["name"].is_string() &&
                         entry.contains("template") && entry["template"].is_string(),
                     origin << ": expected entries {\"name\": string, \"template\": string}, got " << entry.dump());
        if (entry["name"] == "default") {
          source = entry["template"].get<std::string>();
          found = true;
        }
      }
      KAKEYA_CHECK(found, origin << ": no template named \"default\"");
    }
  } else {
    KAKEYA_FAIL("no chat template for " << model_dir << ": " << config_path
                << (fs::exists(config_path) ? " has no field 'chat_template'" : " does not exist")
                << " and there is no " << jinja_path
                << "; pass one with --chat-template FILE.jinja (e.g. checkpoints/chat_templates/gemma.jinja)");
  }
  try {
    return ChatTemplate(std::move(source), bos, eos);
  } catch (const Error& e) {
    throw Error(origin + ": " + e.what());  // a rethrow: KAKEYA_FAIL here would leave load() without a return
  }
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  KAKEYA_CHECK(!messages.empty(), "chat template: cannot render an empty list of messages");
  common_json msgs = common_json::array();
  for (const ChatMessage& m : messages) msgs.push_back({{"role", m.role}, {"content", m.content}});
  common_json vars = common_json::object();
  vars["messages"] = msgs;
  vars["add_generation_prompt"] = add_generation_prompt;
  vars["bos_token"] = bos_token_;
  vars["eos_token"] = eos_token_;
  vars["tools"] = nullptr;
  vars["documents"] = nullptr;

  try {
    jinja::context ctx(source_);  // the source only serves error locations
    jinja::global_from_json(ctx, vars, /*mark_input=*/false);
    jinja::runtime runtime(ctx);
    const jinja::value result = runtime.execute(parsed_->program);
    return jinja::runtime::gather_string_parts(result)->as_string().str();
  } catch (const std::exception& e) {
    std::string what = e.what();
    const size_t raised = what.rfind(kRaisedMarker);
    if (raised != std::string::npos) {
      throw Error("chat template raised an exception: " + what.substr(raised + sizeof(kRaisedMarker) - 1));
    }
    what.erase(0, what.find_first_not_of('\n'));
    throw Error("chat template failed to render: " + what);
  }
}

const std::string& ChatTemplate::source() const { return source_; }
const std::string& ChatTemplate::bos_token() const { return bos_token_; }
const std::string& ChatTemplate::eos_token() const { return eos_token_; }

}  // namespace kakeya
