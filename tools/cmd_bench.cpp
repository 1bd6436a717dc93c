// kakeya bench decode: our AR decode tok/s next to HF transformers' generate
// (default dynamic cache and static cache), same prompt ids, same run; with --llama-bench,
// llama.cpp's llama-bench on GGUF files of the same model in the same run (infer/llama_peer.h).
// kakeya bench chain: what one dependent launch of the decode step's kernels costs, as kernels and
// as a persistent kernel's program (infer/bench_chain.h).
#include <algorithm>
#include <array>
#include <cstdio>
#include <iostream>
#include <optional>

#include "core/error.h"
#include "core/io/fs.h"
#include "infer/bench_chain.h"
#include "infer/bench_memory.h"
#include "infer/generate.h"
#include "infer/decoder.h"
#include "infer/llama_peer.h"
#include "infer/restored.h"
#include "tools/cli_common.h"
#include "tools/restored_flags.h"

namespace kakeya::cli {

namespace {

void register_bench_chain(CLI::App& bench) {
  struct Opts {
    BenchChainOptions b;
    DeviceFlags df;  // --device only: the chains are bf16
    std::string json;
  };
  auto o = std::make_shared<Opts>();
  auto* c = bench.add_subcommand("chain", "What one dependent launch of the decode step's kernels costs (bf16, CUDA)");
  // Ranges checked at parse time (the library checks them again, with the multiples of 16).
  c->add_option("--hidden", o->b.hidden, "the row each link reads and writes (a multiple of 16)")
      ->capture_default_str()
      ->check(CLI::Range(16, 16384));
  c->add_option("--intermediate", o->b.intermediate, "the MLP chain's inner size (a multiple of 16, at least --hidden)")
      ->capture_default_str()
      ->check(CLI::Range(16, 65536));
  c->add_option("--qkv", o->b.qkv, "rows of the q/k/v projection (a multiple of 16, at least --hidden)")
      ->capture_default_str()
      ->check(CLI::Range(16, 65536));
  c->add_option("--vocab", o->b.vocab, "rows of the greedy head's chains")
      ->capture_default_str()
      ->check(CLI::Range(1024, 1048576));
  c->add_option("--links", o->b.links, "links of the shorter chain (the longer has twice as many)")
      ->capture_default_str()
      ->check(CLI::Range(8, 1000));
  c->add_option("--repeats", o->b.repeats, "timed replays of each chain (median)")
      ->capture_default_str()
      ->check(CLI::Range(3, 100000));
  c->add_option("--json", o->json, "write the results here");
  o->df.device = "cuda";
  c->add_option("--device", o->df.device, "cuda (a CPU has no launches to chain)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  c->callback([o] {
    BenchChainOptions b = o->b;
    b.device = o->df.torch_device();
    nlohmann::json report = bench_chain(b);
    std::printf("\n%s", bench_chain_table(report).c_str());
    report["device"] = o->df.device;
    report["commit"] = git_commit();
    report["command"] = command_line();
    if (!o->json.empty()) write_json(o->json, report);
  });
}

}  // namespace

void register_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks: print a table, write JSON");
  bench->require_subcommand(1);
  register_bench_train_ftheta(*bench);
  register_bench_memory(*bench);
  register_bench_chain(*bench);
  struct Opts {
    std::string model = "checkpoints/models/gemma3-270m";
    std::string json, python = "python3", peer = "tools/hf_bench.py";
    int64_t prompt_len = 512, new_tokens = 256, repeats = 3;
    bool no_peer = false, restored = false, megakernel = false;
    std::string random_init;         // an HF config.json: random weights of its shape, no checkpoint
    uint64_t seed = 0;
    std::string llama_bench;         // llama-bench binary (tools/device/llama_bench.sh builds it)
    std::vector<std::string> ggufs;  // GGUF files of the same model for it (e.g. BF16, Q4_K_M)
    RestoreFlags rf;  // --restored: drafter, f_θ, sink/window/full-attn
    DeviceFlags df;
  };
  auto o = std::make_shared<Opts>();
  auto* c = bench->add_subcommand("decode", "AR decode tok/s: ours vs HF transformers generate (batch 1)");
  c->add_option("--model", o->model, "HF model directory")->capture_default_str();
  c->add_option("--json", o->json, "write the results here");
  c->add_option("--prompt-len", o->prompt_len, "prompt tokens")->capture_default_str()->check(positive());
  c->add_option("--new-tokens", o->new_tokens, "generated tokens")->capture_default_str()->check(CLI::Range(2, 1 << 20));
  c->add_option("--repeats", o->repeats, "timed runs per engine (median reported)")->capture_default_str()->check(positive());
  c->add_option("--python", o->python, "python with transformers for the peer")->capture_default_str();
  c->add_option("--peer", o->peer, "HF peer script")->capture_default_str();
  c->add_flag("--no-peer", o->no_peer, "skip the HF transformers peer");
  c->add_option("--random-init", o->random_init,
                "HF config.json: time random weights of its shape instead of --model (drawn on the device; "
                "the HF peer draws the same ones, core/model/random_weights.h), random prompt ids")
      ->check(CLI::ExistingFile);
  c->add_option("--seed", o->seed, "--random-init: the weights' and the prompt's seed")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{0}, uint64_t{0x7fffffffffffffff}));
  c->add_option("--llama-bench", o->llama_bench, "llama.cpp's llama-bench binary: a llama.cpp peer on --gguf")
      ->check(CLI::ExistingFile);
  c->add_option("--gguf", o->ggufs, "--llama-bench: GGUF files of the same model (comma-separated)")
      ->delimiter(',')
      ->check(CLI::ExistingFile);
  c->add_flag("--restored", o->restored, "also time the restored decoder (infer/restored.h), ratio vs ar in this run");
  c->add_flag("--megakernel", o->megakernel,
              "also time AR with the step as persistent kernels (DecodeOptions::megakernel, experimental), ratio vs "
              "ar in this run, its tokens compared with ar's");
  o->rf.add_restore(c, "--restored: ");
  o->df.add(c);
  c->callback([o] {
    KAKEYA_CHECK(o->llama_bench.empty() == o->ggufs.empty(),
                 "bench decode: --llama-bench and --gguf go together (the binary and the GGUF files it runs)");
    const bool random = !o->random_init.empty();
    KAKEYA_CHECK(!o->megakernel || o->df.torch_device().is_cuda(),
                 "bench decode --megakernel: the persistent kernel runs on CUDA only (--device cuda), got --device "
                     << o->df.device);
    KAKEYA_CHECK(!random || (!o->restored && o->ggufs.empty()),
                 "bench decode --random-init: times AR (and the HF peer) only; --restored needs a trained "
                 "drafter and f_θ, --llama-bench a GGUF of the same weights");
    std::vector<int64_t> prompt;
    std::optional<ModelConfig> random_cfg;
    if (random) {
      random_cfg = ModelConfig::from_file(o->random_init);
      // Prompt ids drawn from the same seed, uniformly over the vocabulary (the peer gets these ids).
      at::Generator gen = at::globalContext().defaultGenerator(at::kCPU).clone();
      gen.set_current_seed(o->seed);
      auto ids = at::randint(random_cfg->vocab_size, {o->prompt_len}, gen, at::TensorOptions().dtype(at::kLong));
      prompt.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
    } else {
      prompt = bench_prompt(load_tokenizer(o->model), o->prompt_len);
    }
    // The restore flags are parsed before anything runs: a flag the restored decoder refuses
    // fails the command at once, not after the peer and the AR runs.
    const RestoreOptions restore = o->restored ? o->rf.options() : RestoreOptions{};
    // The HF peer runs first, before our weights exist: a model that fills most of the GPU
    // (26B-A4B: 50 GB in bf16) is then never held twice at once.
    nlohmann::json peer = nlohmann::json::object();
    if (!o->no_peer) {
      std::string ids_path = fs::temp_dir() + "/kakeya_bench_prompt.json";
      write_json(ids_path, prompt);
      const std::string weights = random ? " --random-init " + o->random_init + " --seed " + std::to_string(o->seed)
                                         : " --model " + o->model;
      std::string cmd = o->python + " " + o->peer + weights + " --ids " + ids_path +
                        " --new-tokens " + std::to_string(o->new_tokens) + " --device " + o->df.device +
                        " --dtype " + (o->df.torch_dtype() == at::kBFloat16 ? "bf16" : "f32") +
                        " --repeats " + std::to_string(o->repeats);
      std::fprintf(stderr, "[bench] peer: %s\n", cmd.c_str());
      auto out = run_capture(cmd);
      auto pos = out.rfind("{");
      KAKEYA_CHECK(pos != std::string::npos, "peer printed no JSON:\n" << out);
      peer = nlohmann::json::parse(out.substr(pos));
    }

    Model model = random ? Model::random(*random_cfg, o->seed, model_options(o->df, o->prompt_len + o->new_tokens))
                         : load_model(o->model, o->df, o->prompt_len + o->new_tokens);
    DecodeOptions g;
    g.max_new_tokens = o->new_tokens;
    g.stream = false;  // no stop tokens either: every run generates exactly new_tokens
    // The restored decoder on the same prompt, same model, same run (greedy, no stop, no
    // streaming). Its runs alternate with AR's, so a clock that drifts during the run (an H100
    // warming up) weighs on both the same way rather than on whichever engine runs last.
    DecodeStack st;
    DecodeOptions d;
    if (o->restored) {
      load_restoration(o->rf, model, load_tokenizer(o->model), st);
      d.mode = DecodeMode::Restored;
      d.restore = restore;
      d.max_new_tokens = o->new_tokens;
      d.stream = false;
    }
    // Each engine is a decoder built once for this prompt and kept across the runs (caches,
    // buffers and CUDA graphs reused, as a server keeps them); the warm-up run captures.
    const int64_t capacity = o->prompt_len + o->new_tokens;
    ArDecoder ar(model, capacity, g);
    std::unique_ptr<Decoder> rest;
    std::vector<TimedDecoder> timed{{&ar, g}};
    if (o->restored) {
      rest = make_decoder(model, st.d(), st.f(), d, capacity);
      timed.push_back({rest.get(), d});
    }
    DecodeOptions gm = g;
    gm.megakernel = true;
    std::unique_ptr<ArDecoder> ar_mega;
    const size_t mega_i = timed.size();
    if (o->megakernel) {
      ar_mega = std::make_unique<ArDecoder>(model, capacity, gm);
      timed.push_back({ar_mega.get(), gm});
    }
    // The screened lm_head's baseline in the same run: AR reading the whole head.
    DecodeOptions gf = g;
    gf.head_screen = false;
    std::unique_ptr<ArDecoder> ar_full;
    const size_t full_i = timed.size();
    const bool screened = model.head_screen().defined();
    if (screened) {
      ar_full = std::make_unique<ArDecoder>(model, capacity, gf);
      timed.push_back({ar_full.get(), gf});
    }
    time_in_rounds(timed, prompt, o->repeats, o->new_tokens);
    const auto& decode_tps = timed[0].decode_tps;
    const double ours_decode = timed[0].median_decode_tps(), ours_e2e = timed[0].median_e2e_tps(),
                 ours_prefill = timed[0].median_prefill_tps();
    // Another engine's decode tok/s over AR's, run by run (interleaved pairs): the ratio's own spread.
    auto pairs_vs_ar = [&](const TimedDecoder& t) {
      std::vector<double> p;
      for (size_t i = 0; i < t.decode_tps.size(); ++i) p.push_back(t.decode_tps[i] / decode_tps[i]);
      return p;
    };
    nlohmann::json restored = nullptr;
    double rest_decode = 0, rest_e2e = 0, rest_prefill = 0;
    std::vector<double> pairs;  // restored / ar
    if (o->restored) {
      const TimedDecoder& t = timed[1];
      rest_decode = t.median_decode_tps();
      rest_e2e = t.median_e2e_tps();
      rest_prefill = t.median_prefill_tps();
      pairs = pairs_vs_ar(t);
      restored = {{"restore", d.restore.to_json()},
                  {"drafter", o->rf.drafter},
                  {"ftheta", o->rf.ftheta},
                  {"decode_tps", rest_decode},
                  {"e2e_tps", rest_e2e},
                  {"decode_runs", t.decode_tps},
                  {"decode_ratio_vs_ar", rest_decode / ours_decode},
                  {"decode_ratio_pairs", pairs},
                  {"prefill_tps", rest_prefill},
                  {"prefill_runs", t.prefill_tps},
                  {"prefill_ratio_vs_ar", rest_prefill / ours_prefill},
                  {"runs_interleaved_with_ar", true},
                  {"decoders_kept_across_runs", true},
                  {"memory", t.last.memory.to_json()}};
    }
    nlohmann::json mega = nullptr;
    double mega_decode = 0, mega_e2e = 0;
    std::vector<double> mega_pairs;
    bool mega_same_tokens = false;
    if (o->megakernel) {
      const TimedDecoder& t = timed[mega_i];
      mega_decode = t.median_decode_tps();
      mega_e2e = t.median_e2e_tps();
      mega_pairs = pairs_vs_ar(t);
      mega_same_tokens = t.last.tokens == timed[0].last.tokens;
      mega = {{"decode_tps", mega_decode},
              {"e2e_tps", mega_e2e},
              {"decode_runs", t.decode_tps},
              {"decode_ratio_vs_ar", mega_decode / ours_decode},
              {"decode_ratio_pairs", mega_pairs},
              {"tokens_equal_ar", mega_same_tokens},
              {"step_program", t.last.step_program},
              {"steady_allocations", t.last.steady_allocations},
              {"runs_interleaved_with_ar", true}};
    }
    nlohmann::json full_head = nullptr;
    double full_decode = 0, full_e2e = 0;
    std::vector<double> full_pairs;
    bool full_same_tokens = false;
    double rows_per_token = 0;
    if (screened) {
      const TimedDecoder& t = timed[full_i];
      full_decode = t.median_decode_tps();
      full_e2e = t.median_e2e_tps();
      full_pairs = pairs_vs_ar(t);
      full_same_tokens = t.last.tokens == timed[0].last.tokens;
      // Rows the screen passed to the exact sums, per generated token: one more untimed AR run.
      at::Tensor summed = model.head_screen().summed;
      summed.zero_();
      ar.run(prompt, g);
      rows_per_token = summed.item<int>() / (double)o->new_tokens;  // SYNC: once, after the runs
      full_head = {{"decode_tps", full_decode},
                   {"e2e_tps", full_e2e},
                   {"decode_runs", t.decode_tps},
                   {"screened_ar_vs_whole_head_decode", ours_decode / full_decode},
                   {"decode_ratio_pairs_vs_screened_ar", full_pairs},
                   {"tokens_equal_screened_ar", full_same_tokens},
                   {"screen_rows_summed_exactly_per_token", rows_per_token},
                   {"screen_bytes", model.head_screen_bytes()},
                   {"runs_interleaved_with_ar", true}};
    }
    // The bound: bytes a decode step must read (the selected experts only, for MoE) at the
    // device's measured copy bandwidth.
    const double weight_bytes = (double)model.weight_bytes(), active_bytes = (double)model.active_weight_bytes();
    const double bandwidth = copy_bandwidth(model.device());
    const double bound = bandwidth / active_bytes;

    nlohmann::json llama = nlohmann::json::array();
    for (const auto& gguf : o->ggufs) {
      const std::string cmd = llama_bench_command(o->llama_bench, gguf, (int64_t)prompt.size(), o->new_tokens,
                                                  o->repeats);
      std::fprintf(stderr, "[bench] llama.cpp peer: %s\n", cmd.c_str());
      auto r = parse_llama_bench(run_capture(cmd + " 2>/dev/null"), gguf, (int64_t)prompt.size(), o->new_tokens);
      r["command"] = cmd;
      llama.push_back(r);
    }

    const std::string engine = std::string("engine (batch 1, ") + (model.dtype() == at::kBFloat16 ? "bf16" : "f32") + ")";
    // The ratio column is end to end over HF's static cache end to end (prefill included); decode-only
    // ratios are the decode column's quotients.
    std::printf("\n%-34s %12s %12s %16s\n", engine.c_str(), "e2e tok/s", "decode tok/s", "e2e vs HF static");
    double hf_static = peer.value("static_e2e_tps", 0.0);
    auto row = [&](const char* name, double e2e, double dec) {
      std::printf("%-34s %12.1f %12.1f %16s\n", name, e2e, dec,
                  hf_static > 0 ? (std::to_string(e2e / hf_static).substr(0, 5) + "x").c_str() : "-");
    };
    if (peer.contains("default_e2e_tps")) row("HF generate (dynamic cache)", peer["default_e2e_tps"], peer["default_decode_tps"]);
    if (peer.contains("static_e2e_tps")) row("HF generate (static cache)", peer["static_e2e_tps"], peer["static_decode_tps"]);
    for (const auto& r : llama) {
      const std::string name = "llama.cpp " + r["model_type"].get<std::string>();
      row(name.substr(0, 34).c_str(), r["e2e_tps"], r["decode_tps"]);
    }
    row(screened ? "kakeya ar (screened lm_head)" : "kakeya ar", ours_e2e, ours_decode);
    if (screened) {
      row("kakeya ar, whole lm_head", full_e2e, full_decode);
      std::printf("screened / whole-head ar decode tok/s = %.3fx (same run; interleaved pairs %.3f .. %.3f); tokens %s; "
                  "%.1f rows a token summed exactly; screen %.0f MB of device memory\n",
                  ours_decode / full_decode, 1.0 / *std::max_element(full_pairs.begin(), full_pairs.end()),
                  1.0 / *std::min_element(full_pairs.begin(), full_pairs.end()), full_same_tokens ? "equal" : "DIFFER",
                  rows_per_token, model.head_screen_bytes() / 1e6);
    }
    if (o->megakernel) {
      row("kakeya ar, persistent kernels", mega_e2e, mega_decode);
      std::printf("persistent / ar decode tok/s = %.3fx (same run; interleaved pairs %.3f .. %.3f); %.1f%% of the "
                  "bound; tokens %s ar's; step: %s\n",
                  mega_decode / ours_decode, *std::min_element(mega_pairs.begin(), mega_pairs.end()),
                  *std::max_element(mega_pairs.begin(), mega_pairs.end()), 100.0 * mega_decode / bound,
                  mega_same_tokens ? "equal" : "DIFFER from", timed[mega_i].last.step_program.c_str());
    }
    if (o->restored) {
      row("kakeya restored", rest_e2e, rest_decode);
      std::printf("restored / ar decode tok/s = %.3fx (same run; interleaved pairs %.3f .. %.3f)\n",
                  rest_decode / ours_decode, *std::min_element(pairs.begin(), pairs.end()),
                  *std::max_element(pairs.begin(), pairs.end()));
      std::printf("prefill of the %lld-token prompt: ar %.0f tok/s, restored %.0f tok/s = %.3fx\n",
                  (long long)prompt.size(), ours_prefill, rest_prefill, rest_prefill / ours_prefill);
    }
    for (const auto& r : llama)
      std::printf("kakeya ar / llama.cpp %s: decode %.3fx, prefill %.3fx (llama.cpp prefill %.0f tok/s, ours %.0f)\n",
                  r["model_type"].get<std::string>().c_str(), ours_decode / r["decode_tps"].get<double>(),
                  ours_prefill / r["prefill_tps"].get<double>(), r["prefill_tps"].get<double>(), ours_prefill);
    std::printf("weights read per token %.0f MB (of %.0f MB); measured copy bandwidth %.2f TB/s; bound %.0f tok/s; "
                "kakeya decode = %.1f%% of it\n",
                active_bytes / 1e6, weight_bytes / 1e6, bandwidth / 1e12, bound, 100.0 * ours_decode / bound);
    // Same weights on both sides (--random-init): how far the greedy tokens agree (bf16 rounding
    // differs between the two, so an early split on a near-tie is expected; f32 agrees further).
    int64_t agree = -1;
    if (peer.contains("tokens")) {
      const auto theirs = peer["tokens"].get<std::vector<int64_t>>();
      const auto& ours = timed[0].last.tokens;
      agree = 0;
      while (agree < (int64_t)std::min(ours.size(), theirs.size()) && ours[agree] == theirs[agree]) ++agree;
      std::printf("greedy tokens: kakeya ar and HF agree on the first %lld of %lld\n", (long long)agree,
                  (long long)ours.size());
    }
    nlohmann::json j = {{"bench", "decode"},
                        {"commit", git_commit()},
                        {"device", o->df.device},
                        {"dtype", c10::toString(model.dtype())},
                        {"model", random ? "random weights of " + o->random_init : o->model},
                        {"seed", o->seed},
                        {"prompt_len", o->prompt_len},
                        {"new_tokens", o->new_tokens},
                        {"repeats", o->repeats},
                        {"command", command_line()},
                        {"kakeya_e2e_tps", ours_e2e},
                        {"kakeya_decode_tps", ours_decode},
                        {"kakeya_decode_runs", decode_tps},
                        {"kakeya_prefill_tps", ours_prefill},
                        {"weight_bytes", weight_bytes},
                        {"active_weight_bytes_per_token", active_bytes},
                        {"copy_bandwidth_bytes_per_s", bandwidth},
                        {"bandwidth_bound_tps", bound},
                        {"greedy_tokens_agreeing_with_hf", agree},
                        {"fraction_of_bound", ours_decode / bound},
                        {"hf", peer},
                        {"llama_cpp", llama},
                        {"restored", restored},
                        {"megakernel", mega},
                        {"whole_head", full_head}};
    if (o->megakernel) j["megakernel"]["fraction_of_bound"] = mega_decode / bound;
    if (hf_static > 0) j["speedup_vs_hf_static_e2e"] = ours_e2e / hf_static;
    if (!o->json.empty()) write_json(o->json, j);
  });
}

}  // namespace kakeya::cli
