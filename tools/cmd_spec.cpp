// kakeya spec: greedy speculative decoding with a DFlash drafter (lossless:
// the same tokens as `kakeya generate` at temperature 0), with τ and tok/s.
// --mode plain: the DFlash loop on a full-KV target (infer/speculative.h);
// --mode fused: on the restored verifier (infer/fused.h; --ftheta, --sink, --window, --mix-alpha).
#include <cstdio>
#include <iostream>

#include "core/model/drafter.h"
#include "core/error.h"
#include "infer/fused.h"
#include "infer/generate.h"
#include "infer/speculative.h"
#include "core/io/text_stream.h"
#include "tools/cli_common.h"
#include "tools/restored_flags.h"

namespace kakeya::cli {

void register_spec(CLI::App& app) {
  struct Opts {
    std::string model = "checkpoints/models/gemma3-270m";
    std::string drafter = "checkpoints/gemma3-270m/drafter";
    std::string prompt, prompt_file, json;
    int64_t max_new = 64, block_size = 0;
    bool raw = false, check_ar = false;
    DeviceFlags df;
    std::string mode = "plain", ftheta = "checkpoints/gemma3-270m/ftheta", full_attn = "exact";
    int64_t sink = RestoreOptions{}.sink, window = RestoreOptions{}.window;
    double mix_alpha = 0.0;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("spec", "Greedy speculative decoding with a DFlash drafter; prints τ and tok/s");
  c->add_option("--model", o->model, "HF model directory (the target)")->capture_default_str();
  c->add_option("--drafter", o->drafter, "DFlash drafter directory (z-lab layout)")->capture_default_str();
  auto* p = c->add_option("--prompt", o->prompt, "prompt text");
  c->add_option("--prompt-file", o->prompt_file, "read the prompt from this file")->excludes(p);
  c->add_option("--max-new-tokens", o->max_new, "tokens to generate")->capture_default_str()->check(positive());
  c->add_option("--block-size", o->block_size, "tokens per verify forward (default: the drafter's block_size)")
      ->check(CLI::Range((int64_t)2, (int64_t)1024));
  c->add_flag("--raw", o->raw, "do not add BOS / special tokens to the prompt");
  c->add_flag("--check-ar", o->check_ar, "also decode with plain greedy AR and require identical tokens");
  c->add_option("--mode", o->mode, "plain (full-KV target) | fused (restored verifier, infer/fused.h)")
      ->capture_default_str()
      ->check(CLI::IsMember({"plain", "fused"}));
  c->add_option("--ftheta", o->ftheta, "fused: f_θ directory, or random[:SEED]")->capture_default_str();
  c->add_option("--sink", o->sink, "fused: attention-sink positions kept exact")->capture_default_str();
  c->add_option("--window", o->window, "fused: exact recent positions per query")->capture_default_str();
  c->add_option("--full-attn", o->full_attn, "fused: exact | restored")->capture_default_str();
  c->add_option("--mix-alpha", o->mix_alpha, "fused: restored raw K/V = a·true + (1-a)·f_θ (1: exact restoration)")
      ->capture_default_str();
  c->add_option("--json", o->json, "write ids, text, τ, acceptance lengths and timings here");
  o->df.add(c);
  c->callback([o] {
    KAKEYA_CHECK(!o->prompt.empty() || !o->prompt_file.empty(), "spec: give --prompt or --prompt-file");
    const std::string text = o->prompt_file.empty() ? o->prompt : read_file(o->prompt_file);
    auto tok = load_tokenizer(o->model);
    auto prompt = encode(tok, text, !o->raw);
    // Room for the prompt, the new tokens and one block past them (the last verify forward).
    auto model = load_model(o->model, o->df, prompt.size() + o->max_new + 1024);
    auto drafter = Drafter::load(o->drafter, model);
    const bool fused = o->mode == "fused";
    RestoreFlags rf;  // fused: f_θ and the restore policy
    rf.verifier = o->model;
    rf.drafter = o->drafter;
    rf.ftheta = o->ftheta;
    rf.sink = o->sink;
    rf.window = o->window;
    rf.full_attn = o->full_attn;
    rf.mix_alpha = o->mix_alpha;
    DecodeStack fst;
    if (fused && rf.options().needs_ftheta()) load_restoration(rf, model, tok, fst);
    DecodeOptions so;
    so.max_new_tokens = o->max_new;
    so.block_size = o->block_size;
    so.stop_ids = model.config().eos_token_ids;
    TextStream text_out(tok);
    so.on_token = [&](int64_t t) { std::cout << text_out.push(t) << std::flush; };
    std::cout << text << std::flush;
    DecodeResult r;
    if (fused) {
      so.mode = DecodeMode::Fused;
      so.restore = rf.options();
      r = decode(model, &drafter, fst.f(), prompt, so);
    } else {
      r = speculative_generate(model, drafter, prompt, so);
    }
    std::cout << text_out.finish() << "\n";
    std::fprintf(stderr, "[spec] prompt %zu tok, generated %zu tok in %lld verify forwards: tau %.2f, %.2f tok/s (%s, %s, block %lld)\n",
                 prompt.size(), r.tokens.size(), (long long)r.verify_forwards(), r.tau(), r.decode_tokens_per_second(),
                 o->df.device.c_str(), c10::toString(model.dtype()),
                 (long long)(o->block_size > 0 ? o->block_size : drafter.config().block_size));
    nlohmann::json j{{"prompt_ids", prompt},
                     {"generated_ids", r.tokens},
                     {"text", text_out.emitted()},
                     {"tau", r.tau()},
                     {"committed_per_forward", r.committed},
                     {"prefill_seconds", r.prefill_seconds},
                     {"decode_tokens_per_second", r.decode_tokens_per_second()},
                     {"mode", o->mode}};
    if (fused) {
      const auto& sp = r.split;
      std::fprintf(stderr, "[spec fused] per block: draft %.2f ms, verify %.2f ms, upkeep %.2f ms (restore %.2f, extend %.2f)%s\n",
                   sp.blocks ? 1e3 * sp.draft / sp.blocks : 0.0, sp.blocks ? 1e3 * sp.verify / sp.blocks : 0.0,
                   sp.blocks ? 1e3 * sp.upkeep() / sp.blocks : 0.0, sp.blocks ? 1e3 * sp.restore / sp.blocks : 0.0,
                   sp.blocks ? 1e3 * sp.extend / sp.blocks : 0.0, r.cuda_graph ? ", CUDA graphs" : "");
      j["restore"] = rf.options().to_json();
      j["split"] = sp.to_json();
      j["memory"] = r.memory.to_json();
    }
    if (o->check_ar) {
      DecodeOptions g;
      g.max_new_tokens = o->max_new;
      g.stop_ids = model.config().eos_token_ids;
      g.stream = false;
      auto ar = generate(model, prompt, g);
      const bool same = ar.tokens == r.tokens;
      std::fprintf(stderr, "[spec] greedy AR: %.2f tok/s; tokens %s\n", ar.decode_tokens_per_second(),
                   same ? "identical" : "DIFFER");
      j["ar_decode_tokens_per_second"] = ar.decode_tokens_per_second();
      j["identical_to_ar"] = same;
      if (!o->json.empty()) write_json(o->json, j);
      KAKEYA_CHECK(same, "spec: speculative output differs from greedy AR (first " << r.tokens.size() << " vs "
                                                                                  << ar.tokens.size() << " tokens)");
    }
    if (!o->json.empty()) write_json(o->json, j);
  });
}

}  // namespace kakeya::cli
