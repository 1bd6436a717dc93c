#include "train/drafter_pipeline.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <utility>

#include "core/error.h"
#include "core/io/fs.h"
#include "core/model/drafter.h"
#include "train/dist.h"
#include "train/drafter_data.h"
#include "train/train_util.h"

namespace kakeya::train {
using json = nlohmann::json;

namespace {

json file_list(const std::vector<CorpusFile>& files, bool heldout) {
  json a = json::array();
  for (const auto& f : files)
    if (f.heldout == heldout) a.push_back(f.path);
  return a;
}

// Stage 1: prompts from the corpus of each domain, continued greedily by the target (each rank its
// slice, rank 0 joins them), written to data_dir; returns the data manifest (written last: its
// presence means the cache is complete).
json make_data(const DrafterPipelineOptions& o, const Dist& dist, const Tokenizer& tok, int64_t bos,
               const Model& target, const std::string& data_dir, const std::string& manifest_path) {
  const bool root = dist.is_root();
  const auto& tcfg = target.config();
  json data_manifest = {{"model", o.model},       {"prompt_len", o.prompt_len}, {"gen_len", o.gen_len},
                        {"heldout_percent", o.heldout_percent},
                        {"split_rule", "held out iff FNV-1a(file contents) mod 100 < heldout_percent; identical files "
                                       "count once; held-out prose prompts only from non-license files"},
                        {"seed", o.train.seed}, {"domains", json::object()}};
  for (Domain d : {Domain::Code, Domain::Prose}) {
    const std::string dn = domain_name(d);
    auto files = list_corpus(d == Domain::Code ? o.code : o.prose, d, o.heldout_percent);
    std::vector<CorpusFile> tr, ho;
    for (const auto& f : files) (f.heldout ? ho : tr).push_back(f);
    std::vector<CorpusFile> ho_eval;
    for (const auto& f : ho)
      if (f.eval_ok) ho_eval.push_back(f);
    KAKEYA_CHECK(!tr.empty() && !ho_eval.empty(),
                 "train-drafter: " << dn << " sources give " << tr.size() << " training and " << ho_eval.size()
                                   << " held-out files; need both");
    PromptOptions po;
    po.prompt_len = o.prompt_len;
    po.seed = o.train.seed;
    po.max_prompts = o.train_prompts;
    auto train_prompts = make_prompts(tok, bos, tr, d, po);
    po.max_prompts = o.eval_prompts;
    po.max_per_file = 1;        // one prompt per held-out file: spread over as many files as possible
    po.first_at_start = false;  // mid-file (a line start), not the license header / title every file opens with
    po.seed = o.train.seed + 1;
    auto heldout_prompts = make_prompts(tok, bos, ho_eval, d, po);
    std::fprintf(stderr, "[data] %s: %zu files (%zu held out), %zu training prompts, %zu held-out prompts\n",
                 dn.c_str(), files.size(), ho.size(), train_prompts.size(), heldout_prompts.size());
    KAKEYA_CHECK(!train_prompts.empty() && !heldout_prompts.empty(), "train-drafter: no " << dn << " prompts");
    int64_t bytes_tr = 0, bytes_ho = 0;
    for (const auto& f : tr) bytes_tr += f.bytes;
    for (const auto& f : ho) bytes_ho += f.bytes;
    std::map<std::string, std::string> md{{"domain", dn}, {"model", o.model}, {"gen_len", std::to_string(o.gen_len)}};
    for (auto& [split, prompts] : {std::make_pair(std::string("train"), &train_prompts),
                                  std::make_pair(std::string("heldout"), &heldout_prompts)}) {
      // Data-parallel: rank r continues prompts [r·n/N, (r+1)·n/N); rank 0 joins the parts below.
      const int64_t n = (int64_t)prompts->size(), lo = n * dist.rank() / dist.world(),
                    hi = n * (dist.rank() + 1) / dist.world();
      KAKEYA_CHECK(hi > lo, "train-drafter: " << n << " " << dn << " " << split << " prompts for " << dist.world()
                                              << " ranks (each rank needs at least one)");
      std::vector<std::vector<int64_t>> mine(prompts->begin() + lo, prompts->begin() + hi);
      auto s = generate_continuations(target, mine, o.gen_len, o.gen_batch, tcfg.eos_token_ids, dn + " " + split);
      const std::string path = data_dir + "/" + dn + "_" + split + ".safetensors";
      save_sequences(dist.world() > 1 ? path + ".rank" + std::to_string(dist.rank()) : path, s, md);
    }
    data_manifest["domains"][dn] = {{"sources", d == Domain::Code ? o.code : o.prose},
                                    {"files", files.size()},
                                    {"train_files", tr.size()},
                                    {"heldout_files", ho.size()},
                                    {"train_bytes", bytes_tr},
                                    {"heldout_bytes", bytes_ho},
                                    {"train_prompts", train_prompts.size()},
                                    {"heldout_prompts", heldout_prompts.size()},
                                    {"heldout_file_list", file_list(files, true)}};
  }
  dist.barrier("every rank's continuations written");
  if (dist.world() > 1 && root)
    for (const char* dn : {"code", "prose"})
      for (const char* split : {"train", "heldout"}) {
        const std::string path = data_dir + "/" + dn + "_" + split + ".safetensors";
        std::vector<Sequences> parts;
        std::map<std::string, std::string> md;
        for (int r = 0; r < dist.world(); ++r) parts.push_back(load_sequences(path + ".rank" + std::to_string(r), &md));
        save_sequences(path, concat_sequences(parts), md);
        for (int r = 0; r < dist.world(); ++r) ::unlink((path + ".rank" + std::to_string(r)).c_str());
      }
  if (root) fs::write_json_atomic(manifest_path, data_manifest);  // last: its presence means the cache is complete
  dist.barrier("the joined continuations written");
  return data_manifest;
}

}  // namespace

int64_t DrafterPipelineOptions::max_positions() const {
  return std::max(prompt_len + gen_len, prompt_len + eval_max_new) + block_size + 8;
}

json make_drafter(const DrafterPipelineOptions& opt, const DrafterPipelineLoaders& load) {
  const DrafterPipelineOptions& o = opt;
  // A frozen context only means something relative to a drafter an f_θ was trained on.
  KAKEYA_CHECK(!o.train.freeze_context || (!o.init.empty() && !o.eval_only),
               "train-drafter: --freeze-context fine-tunes an existing drafter: give --init DIR (and no --eval-only)");
  const std::string out = o.out, data_dir = out + "/data", ckpt = out + "/train/checkpoint.safetensors";
  fs::make_dirs(data_dir);
  fs::make_dirs(out + "/train");
  const double t_start = now_unix();
  // TF32 for the f32 drafter's matmuls on CUDA (the target runs in bf16 anyway).
  at::globalContext().setAllowTF32CuBLAS(true);
  const Dist dist(dist_env_from_environment(), o.torch_device);  // on CUDA: picks the rank's GPU
  const bool root = dist.is_root();
  auto tok = load.tokenizer();
  auto target = load.target(o.max_positions());
  const auto& tcfg = target.config();
  const int64_t bos = tcfg.bos_token_id >= 0 ? tcfg.bos_token_id : tok.bos_id();
  KAKEYA_CHECK(bos >= 0, "train-drafter: the target has no BOS token to start prompts with");
  if (root)
    std::fprintf(stderr, "[train-drafter] target %s (%lld layers, hidden %lld) on %s %s\n", o.model.c_str(),
                 (long long)tcfg.num_layers, (long long)tcfg.hidden_size, o.device.c_str(),
                 c10::toString(target.dtype()));

  // ---- 1. data ----
  json data_manifest;
  const std::string manifest_path = data_dir + "/manifest.json";
  std::map<std::string, Sequences> seqs;  // "<domain>_<split>"
  std::map<std::string, std::vector<std::vector<int64_t>>> eval_prompts;
  if (fs::exists(manifest_path)) {
    std::ifstream f(manifest_path);
    data_manifest = json::parse(f);
    KAKEYA_CHECK(data_manifest["prompt_len"] == o.prompt_len && data_manifest["gen_len"] == o.gen_len &&
                     data_manifest["model"] == o.model,
                 manifest_path << ": cached data was made with other --model/--prompt-len/--gen-len; use another --out");
    std::fprintf(stderr, "[data] reusing %s\n", manifest_path.c_str());
  } else {
    KAKEYA_CHECK(!o.code.empty() && !o.prose.empty() && !o.eval_only,
                 "train-drafter: no cached data in " << data_dir << "; give --code and --prose sources");
    data_manifest = make_data(o, dist, tok, bos, target, data_dir, manifest_path);
  }
  for (const char* dn : {"code", "prose"})
    for (const char* split : {"train", "heldout"}) {
      const std::string key = std::string(dn) + "_" + split;
      seqs[key] = load_sequences(data_dir + "/" + key + ".safetensors");
      if (std::string(split) == "heldout") {
        auto& ps = eval_prompts[dn];
        const auto& s = seqs[key];
        for (int64_t i = 0; i < s.size(); ++i) {
          auto row = s.tokens[i].slice(0, 0, s.prompt_len).contiguous();
          ps.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + s.prompt_len);
        }
      }
    }

  // ---- 2. train ----
  const std::string drafter_dir = o.drafter.empty() ? out + "/drafter" : o.drafter;
  json report;
  const std::string report_path = out + "/report.json";
  if (fs::exists(report_path)) {
    std::ifstream f(report_path);
    report = json::parse(f);
  }
  report["command"] = o.command;  // this run; the training run's own is "train_command"
  report["commit"] = o.commit;
  report["model"] = o.model;
  report["device"] = o.device;
  report["data"] = data_manifest;
  report["data"].erase("domains");
  for (auto& [dn, d] : data_manifest["domains"].items()) {
    report["data"]["domains"][dn] = d;
    report["data"]["domains"][dn].erase("heldout_file_list");
  }

  if (!o.eval_only) {
    DrafterOptions dopt;
    dopt.dtype = at::kFloat;  // f32 master weights; the target stays in its dtype
    int64_t mask = o.mask_token >= 0 ? o.mask_token : tok.token_id("<mask>");
    KAKEYA_CHECK(mask >= 0, "train-drafter: the tokenizer has no <mask> token; give --mask-token");
    Drafter drafter = o.init.empty()
                          ? Drafter::random(DrafterConfig::for_target(tcfg, o.layers, o.heads, o.kv_heads, o.head_dim,
                                                                      o.intermediate, o.block_size, mask),
                                            target, o.train.seed, dopt)
                          : Drafter::load(o.init, target, dopt);
    std::fprintf(stderr, "[train] drafter: %lld layers, %.1fM parameters (%.1f MB in bf16), target layers",
                 (long long)drafter.config().num_layers, drafter.num_parameters() / 1e6,
                 drafter.num_parameters() * 2 / 1e6);
    for (int64_t id : drafter.config().target_layer_ids) std::fprintf(stderr, " %lld", (long long)id);
    std::fprintf(stderr, ", mask %lld, input scale %.4f\n", (long long)mask, drafter.config().input_embedding_scale);
    DrafterTrainer trainer(target, drafter, {seqs["code_train"], seqs["prose_train"]}, o.train, ckpt);
    trainer.distribute(dist);
    if (o.train.freeze_context)
      std::fprintf(stderr, "[train] --freeze-context: fc, hidden_norm, k_proj, v_proj frozen (%.2fM), %.2fM trained\n",
                   trainer.frozen_parameters() / 1e6, trainer.trainable_parameters() / 1e6);
    trainer.resume();
    const bool done = trainer.run();
    if (!root) return json();  // rank 0 reports, exports and evaluates
    const auto& st = trainer.state();
    json log = json::array();
    for (const auto& p : st.log)
      log.push_back({{"step", p.step}, {"loss", p.loss}, {"acc1", p.acc1}, {"accept_len", p.accept_len},
                     {"lr", p.lr}, {"grad_norm", p.grad_norm}, {"seconds", p.elapsed}});
    report["train_command"] = o.command;
    report["train"] = {{"steps", st.step},
                       {"total_steps", st.total_steps},
                       {"seconds", st.train_seconds},
                       {"ms_per_step", 1e3 * st.step_seconds},
                       {"batch", o.train.batch},
                       {"anchors", o.train.anchors},
                       {"gamma", o.train.gamma},
                       {"lr", o.train.lr},
                       {"warmup", o.train.warmup_steps},
                       {"weight_decay", o.train.weight_decay},
                       {"grad_clip", o.train.grad_clip},
                       {"seed", o.train.seed},
                       {"init", o.init},
                       {"freeze_context", o.train.freeze_context},
                       {"ranks", dist.world()},
                       {"parameters", drafter.num_parameters()},
                       {"trainable_parameters", trainer.trainable_parameters()},
                       {"finished", done},
                       {"log", log}};
    json ho;
    for (const char* dn : {"code", "prose"}) {
      auto m = trainer.evaluate(seqs[std::string(dn) + "_heldout"], o.heldout_batches, 12345);
      ho[dn] = {{"loss", m.loss}, {"acc1", m.acc1}, {"accept_len_teacher_forced", m.accept_len}, {"blocks", m.blocks}};
      std::fprintf(stderr, "[train] held-out %s (teacher forced): loss %.4f acc@1 %.3f accept %.2f\n", dn, m.loss,
                   m.acc1, m.accept_len);
    }
    report["heldout_teacher_forced"] = ho;
    fs::write_json_atomic(report_path, report);
    if (!done) {
      std::fprintf(stderr, "[train-drafter] training not finished (step %lld/%lld): rerun the same command to resume\n",
                   (long long)st.step, (long long)st.total_steps);
      return report;
    }
    // ---- 3. export (bf16, z-lab layout) ----
    drafter.save(drafter_dir, at::kBFloat16, {{"kakeya_commit", o.commit}, {"kakeya_steps", std::to_string(st.step)}});
    std::fprintf(stderr, "[train-drafter] exported %s\n", drafter_dir.c_str());
  }

  // ---- 4. eval: τ with the exported (bf16) drafter, as users will load it ----
  if (!root) return json();
  if (o.train.deadline > 0 && now_unix() + o.eval_seconds > o.train.deadline) {
    std::fprintf(stderr, "[train-drafter] evaluation deferred (deadline in %.0fs): rerun the same command\n",
                 o.train.deadline - now_unix());
    return report;
  }
  auto drafter = Drafter::load(drafter_dir, target);
  json ev;
  for (const char* dn : {"code", "prose"}) {
    ev[dn] = evaluate_tau(target, drafter, eval_prompts[dn], o.eval_max_new, 0, tcfg.eos_token_ids, dn);
    std::fprintf(stderr, "[eval] %s: tau %.3f (per-prompt mean %.3f), lossless %d/%d, speedup %.2fx\n", dn,
                 ev[dn]["tau"].get<double>(), ev[dn]["tau_mean_per_prompt"].get<double>(),
                 ev[dn]["lossless_prompts"].get<int>(), ev[dn]["prompts"].get<int>(), ev[dn]["speedup"].get<double>());
  }
  report["eval"] = ev;
  report["drafter"] = {{"dir", drafter_dir}, {"parameters", drafter.num_parameters()},
                       {"bytes", drafter.num_parameters() * 2}, {"config", drafter.config().to_json()}};
  report["wall_seconds_last_run"] = now_unix() - t_start;
  fs::write_json_atomic(report_path, report);
  json manifest{{"what", "DFlash drafter for " + o.model + " trained by kakeya train-drafter"},
                {"command", report.value("train_command", report["command"])},
                {"eval_command", report["command"]},
                {"commit", o.commit},
                {"target", o.model},
                {"device", o.device},
                {"data", report["data"]},
                {"train", report.contains("train")
                              ? json{{"steps", report["train"]["steps"]},
                                     {"seconds", report["train"]["seconds"]},
                                     {"parameters", report["train"]["parameters"]},
                                     {"init", report["train"].value("init", "")},
                                     {"freeze_context", report["train"].value("freeze_context", false)}}
                              : json()},
                {"tau", {{"code", ev["code"]["tau"]}, {"prose", ev["prose"]["tau"]}}},
                {"eval", {{"prompts_per_domain", eval_prompts["code"].size()},
                          {"max_new_tokens", o.eval_max_new},
                          {"block_size", drafter.config().block_size},
                          {"lossless_prompts", {{"code", ev["code"]["lossless_prompts"]},
                                                {"prose", ev["prose"]["lossless_prompts"]}}},
                          {"speedup", {{"code", ev["code"]["speedup"]}, {"prose", ev["prose"]["speedup"]}}}}}};
  fs::write_json_atomic(drafter_dir + "/manifest.json", manifest);
  std::fprintf(stderr, "[train-drafter] tau code %.3f, prose %.3f; report %s\n", ev["code"]["tau"].get<double>(),
               ev["prose"]["tau"].get<double>(), report_path.c_str());
  return report;
}

}  // namespace kakeya::train
