// kakeya bench spec: ar vs restored vs fused decode tok/s in one run, τ and the fused per-block
// split, on held-out code/prose prompts and NIAH prompts. The benchmark is infer/bench_spec.h:
// this file parses the flags into its options, loads the models for it, prints its table and
// writes its report as JSON.
#include <cstdio>
#include <sstream>

#include "core/error.h"
#include "infer/bench_spec.h"
#include "tools/cli_common.h"
#include "tools/restored_flags.h"

namespace kakeya::cli {
namespace {

std::vector<int64_t> parse_ints(const std::string& s, const char* flag) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    try {
      size_t used = 0;
      out.push_back(std::stoll(item, &used));
      KAKEYA_CHECK(used == item.size(), "");
    } catch (const std::exception&) {
      KAKEYA_FAIL(flag << ": '" << item << "' is not an integer");
    }
  }
  return out;
}

std::vector<double> parse_fracs(const std::string& s, const char* flag) {
  std::vector<double> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    double v = -1;
    try {
      v = std::stod(item);
    } catch (const std::exception&) {
    }
    KAKEYA_CHECK(v >= 0 && v <= 1, flag << ": '" << item << "' is not a number in [0, 1]");
    out.push_back(v);
  }
  KAKEYA_CHECK(!out.empty(), flag << ": expected a comma-separated list");
  return out;
}

}  // namespace

void register_bench_spec(CLI::App& bench) {
  struct Opts {
    RestoreFlags rf;
    BenchSpecOptions b;
    std::string niah_contexts = "4096,16384", niah_depths = "0.5", json;
    std::string modes = "ar,restored,fused";
    bool no_graph = false;
  };
  auto o = std::make_shared<Opts>();
  o->b.code = {"/usr/lib/python3.12"};
  o->b.prose = {"/opt/torch/.venv/lib/python3.12/site-packages", "/usr/share/common-licenses", "/usr/share/doc"};
  auto* c = bench.add_subcommand(
      "spec", "ar vs restored vs fused decode tok/s in one run: τ, fused per-block split, held-out code/prose + NIAH");
  o->rf.add(c);
  c->add_option("--block-size", o->b.block_size, "fused: tokens per verify forward (0: the drafter's block_size)")
      ->capture_default_str()
      ->check(non_negative());
  c->add_option("--new-tokens", o->b.new_tokens, "tokens generated per held-out prompt (no stop)")
      ->capture_default_str()
      ->check(positive());
  c->add_option("--prompts", o->b.prompts, "held-out prompts per domain (0: no code/prose sets)")
      ->capture_default_str()
      ->check(non_negative());
  c->add_option("--prompt-len", o->b.prompt_len, "held-out prompt length in tokens (BOS included)")
      ->capture_default_str()
      ->check(positive());
  c->add_option("--heldout-percent", o->b.heldout_percent, "train-drafter's split: files held out by content hash")
      ->capture_default_str()
      ->check(CLI::Range(1, 99));
  c->add_option("--seed", o->b.seed, "prompt sampling seed (train-drafter's eval prompts: its --seed + 1)")
      ->capture_default_str();
  c->add_option("--code", o->b.code, "code roots (*.py), as given to train-drafter")->capture_default_str();
  c->add_option("--prose", o->b.prose, "prose roots, as given to train-drafter")->capture_default_str();
  c->add_option("--niah-contexts", o->niah_contexts, "NIAH prompt lengths in tokens ('' for none)")->capture_default_str();
  c->add_option("--niah-depths", o->niah_depths, "NIAH needle depths, one prompt each")->capture_default_str();
  c->add_option("--niah-samples", o->b.niah_samples, "NIAH prompts per depth and context")
      ->capture_default_str()
      ->check(positive());
  c->add_option("--niah-new", o->b.niah_new, "tokens generated per NIAH prompt (stops at EOS)")
      ->capture_default_str()
      ->check(positive());
  c->add_option("--source-dir", o->b.source_dir, "NIAH haystack files")->capture_default_str();
  c->add_option("--modes", o->modes, "comma-separated subset of ar,restored,fused")->capture_default_str();
  c->add_option("--warmup", o->b.warmup, "untimed runs per mode and set first (allocator, cuBLAS; captures each decoder's graphs)")
      ->capture_default_str()
      ->check(non_negative());
  c->add_flag("--no-graph", o->no_graph, "no CUDA graphs in any mode (eager launches)");
  c->add_option("--json", o->json, "write the results here");
  c->callback([o] {
    BenchSpecOptions b = o->b;
    b.modes.clear();
    std::stringstream ss(o->modes);
    for (std::string m; std::getline(ss, m, ',');)
      if (!m.empty()) b.modes.push_back(m);
    b.restore = o->rf.options();
    b.cuda_graph = !o->no_graph;
    b.niah_depths = parse_fracs(o->niah_depths, "--niah-depths");
    b.niah_contexts = parse_ints(o->niah_contexts, "--niah-contexts");
    auto tok = load_tokenizer(o->rf.verifier);
    DecodeStack st;
    auto r = run_bench_spec(tok, b, [&](int64_t positions, bool need_restore) {
      st = load_decode_stack(o->rf, positions, need_restore);
      return BenchSpecModels{st.model.get(), st.d(), st.f(), device_description(st.model->device())};
    });
    std::fputs(r.table.c_str(), stdout);
    if (!o->json.empty()) {
      r.report["command"] = command_line();
      r.report["commit"] = git_commit();
      r.report["models"] = o->rf.to_json();
      write_json(o->json, r.report);
      std::fprintf(stderr, "-> %s\n", o->json.c_str());
    }
  });
}

}  // namespace kakeya::cli
