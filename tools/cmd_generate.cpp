// kakeya generate: stream text from a model with the plain AR decode loop.
#include <cstdio>
#include <iostream>

#include "infer/generate.h"
#include "core/error.h"
#include "core/io/text_stream.h"
#include "tools/cli_common.h"

namespace kakeya::cli {

void register_generate(CLI::App& app) {
  struct Opts {
    std::string model = "checkpoints/models/gemma3-270m";
    std::string prompt, json;
    int64_t max_new = 64;
    double temperature = 0.0, top_p = 1.0;
    uint64_t seed = 0;
    bool no_graph = false, raw = false, megakernel = false;
    DeviceFlags df;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("generate", "Generate text (greedy by default) and print tok/s");
  c->add_option("--model", o->model, "HF model directory")->capture_default_str();
  c->add_option("--prompt", o->prompt, "prompt text")->required();
  c->add_option("--max-new-tokens", o->max_new, "tokens to generate")->capture_default_str()->check(positive());
  c->add_option("--temperature", o->temperature, "0 = greedy")->capture_default_str()->check(non_negative());
  c->add_option("--top-p", o->top_p, "nucleus mass in (0, 1]")->capture_default_str();
  c->add_option("--seed", o->seed, "sampling seed")->capture_default_str();
  c->add_flag("--no-cuda-graph", o->no_graph, "run the decode step eagerly on CUDA");
  c->add_flag("--megakernel", o->megakernel,
              "CUDA graphs: run the step's kernels as persistent-kernel programs (experimental, slower today: "
              "greedy, bf16; prints how)");
  c->add_flag("--raw", o->raw, "do not add BOS / special tokens to the prompt");
  c->add_option("--json", o->json, "write prompt/generated ids, text and timings here");
  o->df.add(c);
  c->callback([o] {
    KAKEYA_CHECK(!(o->megakernel && o->no_graph),
                 "generate: --megakernel records the CUDA graph's step; it cannot go with --no-cuda-graph");
    auto tok = load_tokenizer(o->model);
    auto prompt = encode(tok, o->prompt, !o->raw);
    auto model = load_model(o->model, o->df, prompt.size() + o->max_new);
    DecodeOptions g;
    g.max_new_tokens = o->max_new;
    g.sampling = {o->temperature, o->top_p, o->seed};
    g.cuda_graph = !o->no_graph;
    g.megakernel = o->megakernel;
    g.stop_ids = model.config().eos_token_ids;
    TextStream text_out(tok);
    g.on_token = [&](int64_t t) { std::cout << text_out.push(t) << std::flush; };
    std::cout << o->prompt << std::flush;
    auto r = generate(model, prompt, g);
    std::cout << text_out.finish() << "\n";
    std::fprintf(stderr, "[generate] prompt %zu tok, generated %zu tok, prefill %.3fs, decode %.2f tok/s (%s, %s)\n",
                 prompt.size(), r.tokens.size(), r.prefill_seconds, r.decode_tokens_per_second(), o->df.device.c_str(),
                 c10::toString(model.dtype()));
    if (o->megakernel) std::fprintf(stderr, "[generate] step: %s\n", r.step_program.c_str());
    if (!o->json.empty()) {
      std::vector<int32_t> gen(r.tokens.begin(), r.tokens.end());
      write_json(o->json, {{"prompt_ids", prompt},
                           {"generated_ids", r.tokens},
                           {"text", tok.decode(gen, true)},
                           {"prefill_seconds", r.prefill_seconds},
                           {"decode_tokens_per_second", r.decode_tokens_per_second()}});
    }
  });
}

}  // namespace kakeya::cli
