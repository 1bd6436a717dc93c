// A model's own Jinja chat template, rendered as HF transformers'
// apply_chat_template renders it (trim_blocks/lstrip_blocks, a single trailing
// newline of the source dropped, raise_exception and strftime_now available),
// so that /v1/chat/completions gives the model the prompt it was trained on.
// The engine is llama.cpp's (third_party/llama_jinja); parity with transformers
// on the shipped templates (checkpoints/chat_templates) is tested in
// tests/test_chat_template.cpp.
#pragma once
#include <memory>
#include <string>
#include <vector>

namespace kakeya {

struct ChatMessage {
  std::string role, content;
};

class ChatTemplate {
 public:
  // The template of the model in `model_dir`, found where transformers looks:
  // a chat_template.jinja file, which wins over tokenizer_config.json
  // "chat_template" (a string, or a list of {name, template} of which
  // "default" is taken). A non-empty `override_path` (a .jinja file) wins over
  // both. bos_token/eos_token come from tokenizer_config.json (a string or an
  // object with "content"; empty when absent). Throws kakeya::Error naming the
  // file and field when there is no template or it does not parse.
  static ChatTemplate load(const std::string& model_dir, const std::string& override_path = "");

  // Parses `source`; throws kakeya::Error with the parser's message on a syntax error.
  ChatTemplate(std::string source, std::string bos_token, std::string eos_token);

  // The prompt text for `messages`. The template sees `messages` (a list of
  // {role, content}), `add_generation_prompt`, `bos_token` and `eos_token`.
  // Throws kakeya::Error when `messages` is empty (as transformers does), when
  // the template calls raise_exception (its message included) or fails.
  // Only reads the parsed program: concurrent calls are safe.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true) const;

  const std::string& source() const;
  const std::string& bos_token() const;
  const std::string& eos_token() const;

 private:
  struct Parsed;
  std::shared_ptr<const Parsed> parsed_;  // the program, parsed once
  std::string source_, bos_token_, eos_token_;
};

}  // namespace kakeya
