#include "infer/bench_spec.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>

#include "core/error.h"
#include "data/niah.h"
#include "infer/decoder.h"
#include "train/drafter_data.h"

namespace kakeya {
namespace {

struct PromptSet {
  std::string name;
  std::vector<std::vector<int64_t>> prompts;
  std::vector<std::vector<std::string>> answers;  // NIAH: per prompt; empty otherwise
  int64_t max_new = 0;
  bool stop = false;  // stop at EOS (NIAH); held-out sets generate exactly max_new tokens
};

struct ModeStats {
  int64_t runs = 0, tokens = 0;  // tokens counted as decode_tokens_per_second does: generated - 1 per run
  double decode_s = 0, prefill_s = 0, recall = 0;
  double capture_s = 0;  // CUDA graph capture inside decode_s (a decoder's first run: 0 after the warm-up)
  int64_t committed = 0, blocks = 0;
  FusedTiming split;
  int64_t identical_to_restored = 0, identical_to_ar = 0;
  int64_t steady_allocs = -1;  // CUDA allocations while replaying graphs, summed over runs (-1: none replayed)
  nlohmann::json memory;
  double tps() const { return decode_s > 0 ? tokens / decode_s : 0.0; }
  double steady_tps() const { return decode_s > capture_s ? tokens / (decode_s - capture_s) : 0.0; }
  double tau() const { return blocks > 0 ? (double)committed / blocks : 0.0; }
};

// The held-out code/prose sets (train-drafter's held-out prompts) and the NIAH sets.
std::vector<PromptSet> make_sets(const Tokenizer& tok, const BenchSpecOptions& o) {
  std::vector<PromptSet> sets;
  const int64_t bos = tok.bos_id();
  if (o.prompts > 0) {
    for (train::Domain d : {train::Domain::Code, train::Domain::Prose}) {
      const auto& roots = d == train::Domain::Code ? o.code : o.prose;
      auto files = train::list_corpus(roots, d, (int)o.heldout_percent);
      std::vector<train::CorpusFile> ho;
      for (const auto& f : files)
        if (f.heldout && f.eval_ok) ho.push_back(f);
      KAKEYA_CHECK(!ho.empty(), "bench spec: no held-out " << train::domain_name(d) << " files under the given roots");
      train::PromptOptions po;  // train-drafter's held-out prompts
      po.prompt_len = o.prompt_len;
      po.max_prompts = o.prompts;
      po.max_per_file = 1;
      po.first_at_start = false;
      po.seed = o.seed;
      PromptSet s;
      s.name = train::domain_name(d);
      s.prompts = train::make_prompts(tok, bos, ho, d, po);
      s.max_new = o.new_tokens;
      std::fprintf(stderr, "[bench spec] %s: %zu held-out prompts of %lld tokens from %zu held-out files\n",
                   s.name.c_str(), s.prompts.size(), (long long)o.prompt_len, ho.size());
      sets.push_back(std::move(s));
    }
  }
  for (int64_t ctx : o.niah_contexts) {
    PromptSet s;
    s.name = "niah-" + std::to_string(ctx);
    s.max_new = o.niah_new;
    s.stop = true;
    data::NiahOptions no;
    no.split = data::NiahSplit::Eval;
    no.context_tokens = ctx;
    no.chat = data::detect_chat_format(tok);
    no.source_dir = o.source_dir;
    for (int64_t k = 0; k < o.niah_samples; ++k)
      for (size_t di = 0; di < o.niah_depths.size(); ++di) {
        no.seed = (uint64_t)(k * o.niah_depths.size() + di);
        no.depths = {o.niah_depths[di]};
        auto sample = data::make_niah(tok, no);
        s.prompts.push_back(sample.prompt_ids);
        s.answers.push_back(sample.answers);
      }
    sets.push_back(std::move(s));
  }
  KAKEYA_CHECK(!sets.empty(), "bench spec: no prompts (--prompts 0 and no --niah-contexts)");
  return sets;
}

}  // namespace

BenchSpecResult run_bench_spec(const Tokenizer& tok, const BenchSpecOptions& opt, const BenchSpecLoader& load) {
  const BenchSpecOptions& o = opt;
  std::string mode_list;
  for (const auto& m : o.modes) {
    KAKEYA_CHECK(m == "ar" || m == "restored" || m == "fused", "--modes: unknown mode '" << m << "'");
    mode_list += (mode_list.empty() ? "" : ",") + m;
  }
  const auto& modes = o.modes;
  const bool want_fused = std::find(modes.begin(), modes.end(), "fused") != modes.end();
  const RestoreOptions& ro = o.restore;

  // ---- prompt sets ----
  const std::vector<PromptSet> sets = make_sets(tok, o);

  int64_t longest = 0;
  for (const auto& s : sets)
    for (const auto& p : s.prompts) longest = std::max<int64_t>(longest, p.size() + s.max_new);
  const bool need_drafter = want_fused || ro.needs_ftheta();
  const BenchSpecModels st = load(longest + 1024, need_drafter);
  KAKEYA_CHECK(st.verifier, "bench spec: the loader gave no verifier");
  const Model& model = *st.verifier;
  const int64_t B = o.block_size > 0 ? o.block_size : (st.drafter ? st.drafter->config().block_size : 0);
  std::fprintf(stderr, "[bench spec] %s %s, sink %lld window %lld, a=%.2f, block %lld, modes %s\n", st.device.c_str(),
               c10::toString(model.dtype()), (long long)ro.sink, (long long)ro.window, ro.mix_alpha, (long long)B,
               mode_list.c_str());

  // One decoder per mode and prompt set, sized for the set's longest prompt + new tokens:
  // caches, buffers and CUDA graphs are built once and reused by every prompt of the set,
  // as a server keeps them across requests (a graph's grid covers the cache it was
  // captured on, so a set of short prompts gets a decoder of its own size).
  auto options = [&](const std::string& mode, const PromptSet& s) {
    DecodeOptions d;
    d.mode = parse_decode_mode(mode);
    d.restore = ro;
    d.max_new_tokens = s.max_new;
    if (s.stop) d.stop_ids = model.config().eos_token_ids;
    d.stream = false;
    d.cuda_graph = o.cuda_graph;
    d.block_size = B;
    return d;
  };
  std::map<std::string, std::unique_ptr<Decoder>> decoders;
  auto run = [&](const std::string& mode, const std::vector<int64_t>& prompt, const PromptSet& s, ModeStats* acc,
                 std::vector<int64_t>* tokens) {
    DecodeResult r = decoders.at(mode)->run(prompt, options(mode, s));
    if (tokens) *tokens = r.tokens;
    if (!acc) return std::string();
    acc->runs += 1;
    acc->tokens += std::max<int64_t>(0, (int64_t)r.tokens.size() - 1);
    acc->decode_s += r.decode_seconds;
    acc->capture_s += r.capture_seconds;
    if (r.steady_allocations >= 0) acc->steady_allocs = std::max<int64_t>(0, acc->steady_allocs) + r.steady_allocations;
    acc->prefill_s += r.prefill_seconds;
    for (int64_t c : r.committed) acc->committed += c;
    acc->blocks += r.committed.size();
    acc->split += r.split;
    if (acc->memory.is_null()) acc->memory = r.memory.to_json();
    std::vector<int32_t> g(r.tokens.begin(), r.tokens.end());
    return tok.decode(g, true);
  };

  nlohmann::json jsets = nlohmann::json::array();
  std::string table, allocs;  // allocs: per set, the CUDA allocations of each mode's graph replays
  char line[512];
  std::snprintf(line, sizeof line, "%-12s %4s %9s %9s %9s %7s %7s %7s %5s %8s %8s %8s %6s %6s %s\n", "set", "n",
                "ar tok/s", "rest tok/s", "fused", "f/ar", "f/rest", "f/ar ss", "tau", "draft", "verify", "upkeep",
                "=rest", "=ar", "recall ar/rest/fused");
  table += line;
  for (const auto& s : sets) {
    int64_t capacity = 0;
    for (const auto& p : s.prompts) capacity = std::max<int64_t>(capacity, p.size() + s.max_new);
    decoders.clear();  // the previous set's caches go first
    for (const auto& m : modes) decoders[m] = make_decoder(model, st.drafter, st.ftheta, options(m, s), capacity);
    // Warm-up: every mode on the set's first prompt (not timed; captures the decoders' graphs).
    for (int64_t w = 0; w < o.warmup; ++w)
      for (const auto& m : modes) run(m, s.prompts[0], s, nullptr, nullptr);
    std::map<std::string, ModeStats> ms;
    nlohmann::json per_prompt = nlohmann::json::array();
    for (size_t i = 0; i < s.prompts.size(); ++i) {
      std::map<std::string, std::vector<int64_t>> toks;
      nlohmann::json pj{{"prompt_tokens", s.prompts[i].size()}};
      for (const auto& m : modes) {
        std::string text = run(m, s.prompts[i], s, &ms[m], &toks[m]);
        if (!s.answers.empty()) {
          const double rec = data::niah_recall(s.answers[i], text);
          ms[m].recall += rec;
          pj[m + "_recall"] = rec;
        }
      }
      if (toks.count("fused")) {
        if (toks.count("restored") && toks["fused"] == toks["restored"]) ms["fused"].identical_to_restored++;
        if (toks.count("ar") && toks["fused"] == toks["ar"]) ms["fused"].identical_to_ar++;
        pj["fused_identical_to_restored"] =
            toks.count("restored") ? nlohmann::json(toks["fused"] == toks["restored"]) : nullptr;
        pj["fused_identical_to_ar"] = toks.count("ar") ? nlohmann::json(toks["fused"] == toks["ar"]) : nullptr;
      }
      per_prompt.push_back(pj);
      std::fprintf(stderr, "\r[bench spec] %s: %zu/%zu prompts", s.name.c_str(), i + 1, s.prompts.size());
    }
    std::fprintf(stderr, "\n");
    const int64_t n = s.prompts.size();
    auto tps = [&](const char* m) { return ms.count(m) ? ms[m].tps() : 0.0; };
    const double ar = tps("ar"), rest = tps("restored"), fu = tps("fused");
    auto steady = [&](const char* m) { return ms.count(m) ? ms[m].steady_tps() : 0.0; };
    const double ar_ss = steady("ar"), fu_ss = steady("fused");
    const ModeStats& f = ms["fused"];  // (adds an empty "fused" entry when fused did not run, as the report lists it)
    auto per_block = [&](double sec) { return f.split.blocks > 0 ? 1e3 * sec / f.split.blocks : 0.0; };
    auto rec = [&](const char* m) -> std::string {
      if (s.answers.empty() || !ms.count(m)) return "-";
      char b[16];
      std::snprintf(b, sizeof b, "%.2f", ms[m].recall / n);
      return b;
    };
    std::snprintf(line, sizeof line,
                  "%-12s %4lld %9.1f %9.1f %9.1f %6.2fx %6.2fx %6.2fx %5.2f %6.2fms %6.2fms %6.2fms %3lld/%lld "
                  "%3lld/%lld %s/%s/%s\n",
                  s.name.c_str(), (long long)n, ar, rest, fu, ar > 0 ? fu / ar : 0.0, rest > 0 ? fu / rest : 0.0,
                  ar_ss > 0 ? fu_ss / ar_ss : 0.0, f.tau(), per_block(f.split.draft), per_block(f.split.verify),
                  per_block(f.split.upkeep()), (long long)f.identical_to_restored, (long long)n,
                  (long long)f.identical_to_ar, (long long)n, rec("ar").c_str(), rec("restored").c_str(),
                  rec("fused").c_str());
    table += line;
    allocs += (allocs.empty() ? "" : "; ") + s.name + ":";
    for (auto& [m, v] : ms) allocs += " " + m + " " + (v.steady_allocs >= 0 ? std::to_string(v.steady_allocs) : "-");
    nlohmann::json jm;
    for (auto& [m, v] : ms) {
      jm[m] = {{"runs", v.runs},
               {"decode_tokens", v.tokens},
               {"decode_seconds", v.decode_s},
               {"prefill_seconds", v.prefill_s},
               {"decode_tokens_per_second", v.tps()},
               {"graph_capture_seconds", v.capture_s},
               {"decode_tokens_per_second_excl_capture", v.steady_tps()},
               {"cuda_allocations_in_graph_replays",
                v.steady_allocs >= 0 ? nlohmann::json(v.steady_allocs) : nlohmann::json(nullptr)},
               {"memory_first_prompt", v.memory}};
      if (!s.answers.empty()) jm[m]["recall"] = v.recall / n;
      if (m == "fused") {
        const double total = v.split.draft + v.split.verify + v.split.upkeep();
        jm[m]["tau"] = v.tau();
        jm[m]["verify_forwards"] = v.blocks;
        jm[m]["split"] = v.split.to_json();
        // Shares of the critical path; restoration overlapped on a side stream is listed apart.
        jm[m]["split"]["share_of_decode"] = {
            {"draft", v.decode_s > 0 ? v.split.draft / v.decode_s : 0.0},
            {"verify", v.decode_s > 0 ? v.split.verify / v.decode_s : 0.0},
            {"upkeep", v.decode_s > 0 ? v.split.upkeep() / v.decode_s : 0.0},
            {"graph_capture", v.decode_s > 0 ? v.split.capture / v.decode_s : 0.0},
            {"host_and_gaps", v.decode_s > 0 ? 1.0 - (total + v.split.capture) / v.decode_s : 0.0},
            {"restore_overlapped", v.split.restore_overlapped && v.decode_s > 0 ? v.split.restore / v.decode_s : 0.0}};
        jm[m]["identical_to_restored"] = v.identical_to_restored;
        jm[m]["identical_to_ar"] = v.identical_to_ar;
      }
    }
    nlohmann::json js{{"set", s.name},
                      {"prompts", n},
                      {"max_new_tokens", s.max_new},
                      {"stop_at_eos", s.stop},
                      {"modes", jm},
                      {"per_prompt", per_prompt}};
    if (ar > 0) js["fused_vs_ar"] = fu / ar;
    if (ar_ss > 0) js["fused_vs_ar_excl_capture"] = fu_ss / ar_ss;
    if (rest > 0) js["fused_vs_restored"] = fu / rest;
    jsets.push_back(js);
  }

  BenchSpecResult r;
  r.table = "\n" + table +
            "draft/verify/upkeep: ms per fused block (upkeep = restoration + drafter context extension); "
            "=rest/=ar: fused outputs token-identical to restored / ar; ss: steady state, both without their "
            "one-time CUDA graph capture\n"
            "CUDA allocations while replaying graphs (steady state; - = no replay): " +
            allocs + "\n";
  r.report = {{"bench", "spec"},
              {"device", st.device},
              {"dtype", c10::toString(model.dtype())},
              {"restore", ro.to_json()},
              {"block_size", B},
              {"cuda_graph", o.cuda_graph},
              {"heldout", {{"percent", o.heldout_percent}, {"seed", o.seed}, {"prompt_len", o.prompt_len},
                           {"code", o.code}, {"prose", o.prose}}},
              {"sets", jsets}};
  return r;
}

}  // namespace kakeya
