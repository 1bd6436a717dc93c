// kakeya decode: a decode session on the restored verifier (infer/restored.h).
// One --prompt: streams the text, then prints tok/s and the memory table.
// --prompts FILE.jsonl: one session per line ({"prompt": ...} or {"text": ...},
// optional "id" and "max_new_tokens"), a summary line each.
#include <cstdio>
#include <fstream>
#include <iostream>

#include "core/error.h"
#include "core/io/text_stream.h"
#include "infer/decoder.h"
#include "infer/restored.h"
#include "tools/cli_common.h"
#include "tools/restored_flags.h"

namespace kakeya::cli {
namespace {

struct PromptItem {
  std::string id, text;
  int64_t max_new = 0;  // 0: --max-new-tokens
};

std::vector<PromptItem> read_prompts(const std::string& path) {
  std::ifstream f(path);
  KAKEYA_CHECK(f.good(), path << ": cannot open the prompts file");
  std::vector<PromptItem> out;
  std::string line;
  int64_t n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      KAKEYA_FAIL(path << ":" << n << ": not valid JSON: " << e.what());
    }
    KAKEYA_CHECK(j.is_object(), path << ":" << n << ": expected a JSON object per line");
    PromptItem p;
    if (j.contains("prompt") && j["prompt"].is_string()) p.text = j["prompt"];
    else if (j.contains("text") && j["text"].is_string()) p.text = j["text"];
    else KAKEYA_FAIL(path << ":" << n << ": expected a string field \"prompt\" (or \"text\")");
    p.id = j.contains("id") ? (j["id"].is_string() ? j["id"].get<std::string>() : j["id"].dump()) : std::to_string(out.size());
    if (j.contains("max_new_tokens")) {
      KAKEYA_CHECK(j["max_new_tokens"].is_number_integer() && j["max_new_tokens"].get<int64_t>() > 0,
                   path << ":" << n << ": max_new_tokens expected a positive integer");
      p.max_new = j["max_new_tokens"];
    }
    out.push_back(p);
  }
  KAKEYA_CHECK(!out.empty(), path << ": no prompts");
  return out;
}

}  // namespace

void register_decode(CLI::App& app) {
  struct Opts {
    RestoreFlags rf;
    std::string mode = "restored", prompt, prompts, json;
    int64_t max_new = 64;
    double temperature = 0.0, top_p = 1.0;
    uint64_t seed = 0;
    bool raw = false, stats = false, compare_ar = false;
    int64_t block_size = 0;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("decode", "Decode on the restored verifier (ar | restored-reforward | restored | fused); "
                                         "tok/s and a memory table against full KV and the native cache");
  o->rf.add(c);
  c->add_option("--mode", o->mode, "ar (full-KV oracle) | restored-reforward (slow reference) | restored (incremental) | "
                                 "fused (restored + speculative blocks with the drafter)")
      ->capture_default_str()
      ->check(CLI::IsMember({"ar", "restored-reforward", "restored", "fused"}));
  c->add_option("--block-size", o->block_size, "fused: tokens per verify forward (0: the drafter's block_size)")
      ->capture_default_str();
  auto* p = c->add_option("--prompt", o->prompt, "prompt text (streamed)");
  c->add_option("--prompts", o->prompts, "JSONL file: one {\"prompt\": ...} per line")->excludes(p);
  c->add_option("--max-new-tokens", o->max_new, "tokens to generate")->capture_default_str()->check(positive());
  c->add_option("--temperature", o->temperature, "0 = greedy")->capture_default_str()->check(non_negative());
  c->add_option("--top-p", o->top_p, "nucleus mass in (0, 1]")->capture_default_str();
  c->add_option("--seed", o->seed, "sampling seed")->capture_default_str();
  c->add_flag("--raw", o->raw, "do not add BOS / special tokens to the prompt");
  c->add_flag("--stats", o->stats, "relative error of restored vs true K/V (keeps the true K/V: diagnostics)");
  c->add_flag("--compare-ar", o->compare_ar, "also decode with ar and report token agreement and its tok/s");
  c->add_option("--json", o->json, "write per prompt: ids, text, timings, memory");
  c->callback([o] {
    KAKEYA_CHECK(!o->prompt.empty() || !o->prompts.empty(), "decode: give --prompt TEXT or --prompts FILE.jsonl");
    const DecodeMode mode = parse_decode_mode(o->mode);
    std::vector<PromptItem> items =
        o->prompts.empty() ? std::vector<PromptItem>{{"0", o->prompt, 0}} : read_prompts(o->prompts);
    const bool stream = o->prompts.empty();
    RestoreOptions ro = o->rf.options();
    ro.stats = o->stats;
    const bool need_restore = mode != DecodeMode::Ar && (ro.needs_ftheta() || mode == DecodeMode::Fused);
    // Tokenize first: the RoPE table covers the longest prompt + its new tokens.
    auto tok = load_tokenizer(o->rf.verifier);
    std::vector<std::vector<int64_t>> ids;
    int64_t longest = 1;
    for (const auto& it : items) {
      ids.push_back(encode(tok, it.text, !o->raw));
      longest = std::max<int64_t>(longest, ids.back().size() + (it.max_new ? it.max_new : o->max_new));
    }
    // fused: the last verify block reaches up to block_size (<= window) positions past the budget.
    auto st = load_decode_stack(o->rf, longest + (mode == DecodeMode::Fused ? ro.window : 0), need_restore);
    const Model& model = *st.model;

    nlohmann::json report{{"command", command_line()},
                          {"mode", o->mode},
                          {"device", device_description(model.device())},
                          {"dtype", c10::toString(model.dtype())},
                          {"models", o->rf.to_json()},
                          {"restore", ro.to_json()},
                          {"prompts", nlohmann::json::array()}};
    auto options = [&](size_t i, DecodeMode m) {
      DecodeOptions d;
      d.mode = m;
      d.restore = ro;
      d.max_new_tokens = items[i].max_new ? items[i].max_new : o->max_new;
      d.sampling = {o->temperature, o->top_p, o->seed};
      d.block_size = o->block_size;
      d.stop_ids = model.config().eos_token_ids;
      return d;
    };
    // One decoder for the whole batch (and one ar decoder for --compare-ar), sized for its
    // longest prompt: caches, buffers and CUDA graphs are built once and reused per prompt.
    // Bad input of the first prompt is reported before anything is allocated.
    decode_checks(model, st.d(), st.f(), ids[0], options(0, mode));
    auto dec = make_decoder(model, st.d(), st.f(), options(0, mode), longest);
    std::unique_ptr<Decoder> ar_dec;
    if (o->compare_ar && mode != DecodeMode::Ar)
      ar_dec = make_decoder(model, nullptr, nullptr, options(0, DecodeMode::Ar), longest);
    for (size_t i = 0; i < items.size(); ++i) {
      DecodeOptions d = options(i, mode);
      TextStream text_out(tok);
      if (stream) {
        d.on_token = [&](int64_t t) { std::cout << text_out.push(t) << std::flush; };
        std::cout << items[i].text << std::flush;
      }
      auto r = dec->run(ids[i], d);
      if (stream) std::cout << text_out.finish() << "\n";
      std::vector<int32_t> gen(r.tokens.begin(), r.tokens.end());
      const std::string text = tok.decode(gen, true);
      std::fprintf(stderr,
                   "[decode %s] prompt %s: %zu tok, generated %zu tok, prefill %.3fs, decode %.2f tok/s; KV %.2f MiB "
                   "= %.3fx full KV, %.3fx native (%s, %s)\n",
                   o->mode.c_str(), items[i].id.c_str(), ids[i].size(), r.tokens.size(), r.prefill_seconds,
                   r.decode_tokens_per_second(), r.memory.kv_bytes() / 1048576.0,
                   r.memory.full_kv_bytes ? (double)r.memory.kv_bytes() / r.memory.full_kv_bytes : 0.0,
                   r.memory.native_kv_bytes ? (double)r.memory.kv_bytes() / r.memory.native_kv_bytes : 0.0,
                   o->rf.df.device.c_str(), c10::toString(model.dtype()));
      if (mode == DecodeMode::Fused)
        std::fprintf(stderr, "[decode fused] %zu verify forwards, tau %.2f\n", r.committed.size(), r.tau());
      if (i == 0 || i + 1 == items.size()) std::fputs(r.memory.table().c_str(), stderr);
      nlohmann::json pj{{"id", items[i].id},
                        {"prompt_ids", ids[i]},
                        {"generated_ids", r.tokens},
                        {"text", text},
                        {"prefill_seconds", r.prefill_seconds},
                        {"decode_seconds", r.decode_seconds},
                        {"decode_tokens_per_second", r.decode_tokens_per_second()},
                        {"memory", r.memory.to_json()}};
      if (mode == DecodeMode::Fused) pj["fused"] = {{"tau", r.tau()}, {"committed_per_forward", r.committed}};
      if (mode != DecodeMode::Ar) {
        pj["restored_positions"] = r.restored_positions;
        pj["attention_fraction"] = {{"sliding", r.attention_fraction_sliding}, {"full", r.attention_fraction_full}};
        if (o->stats) pj["restore_error"] = r.stats.to_json();
      }
      if (o->compare_ar && mode != DecodeMode::Ar) {
        DecodeOptions a = options(i, DecodeMode::Ar);
        auto ar = ar_dec->run(ids[i], a);
        size_t same = 0;
        while (same < ar.tokens.size() && same < r.tokens.size() && ar.tokens[same] == r.tokens[same]) ++same;
        std::fprintf(stderr, "[decode ar] %.2f tok/s; %s (first %zu of %zu tokens agree); ratio %.2fx\n",
                     ar.decode_tokens_per_second(), ar.tokens == r.tokens ? "identical" : "differs", same,
                     ar.tokens.size(),
                     ar.decode_tokens_per_second() > 0 ? r.decode_tokens_per_second() / ar.decode_tokens_per_second() : 0.0);
        pj["ar"] = {{"generated_ids", ar.tokens},
                    {"identical", ar.tokens == r.tokens},
                    {"agreeing_prefix", same},
                    {"decode_tokens_per_second", ar.decode_tokens_per_second()}};
      }
      report["prompts"].push_back(pj);
    }
    if (!o->json.empty()) {
      write_json(o->json, report);
      std::fprintf(stderr, "-> %s\n", o->json.c_str());
    }
  });
}

}  // namespace kakeya::cli
