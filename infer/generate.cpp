#include "infer/generate.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include "core/error.h"
#include "core/kernels/ops.h"
#include "infer/graph_capture.h"
#include "infer/loop_util.h"

#ifdef KAKEYA_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/kernels/step_program.h"
#endif

namespace kakeya {

#ifdef KAKEYA_CUDA
struct LoopGraphs {
  std::unique_ptr<at::cuda::CUDAGraph> step;
  std::unique_ptr<ops::StepProgram> program;  // the step's program (DecodeOptions::megakernel), kept with its graph
  std::string step_program;                   // DecodeResult::step_program
};
#else
struct LoopGraphs {};
#endif

namespace {

// One decode step with static buffers: reads token `cur` at position `pos`,
// writes the next token into `out[step]` and back into `cur`, advances pos and step.
struct DecodeStep {
  const Model& model;
  KVCache& cache;
  Sampler& sampler;
  at::Tensor cur;    // [1, 1] int64
  at::Tensor pos;    // [1] int64
  at::Tensor step;   // [1] int64
  at::Tensor out;    // [capacity] int64
  // !DecodeOptions::head_screen: the greedy head reads every row instead of the int8 screen.
  bool full_head;

  void run() {
    ForwardOptions fo;
    fo.advance_cache = false;
    fo.full_head = full_head;
    ops::advance_step(step_token(model, cur, pos, cache, fo, sampler), out, step, cur, pos);
  }
};

}  // namespace

KVCacheOptions ar_cache_options(const Model& model, int64_t capacity) {
  KAKEYA_CHECK(capacity <= model.options().max_positions,
               "generate: " << capacity << " positions (prompt + new tokens) exceed the model's position table ("
                            << model.options().max_positions << ")");
  return model.cache_options(capacity);
}

ArDecoder::ArDecoder(const Model& model, int64_t capacity, const DecodeOptions& opt)
    : Decoder(opt), model_(model), cache_(model.config(), ar_cache_options(model, capacity)),
      sampler_(opt.sampling, model.device()) {
  auto iopt = at::TensorOptions().dtype(at::kLong).device(model.device());
  cur_ = at::zeros({1, 1}, iopt);
  pos_ = at::zeros({1}, iopt);
  step_ = at::zeros({1}, iopt);
  out_ = at::zeros({capacity}, iopt);
  loop_.step = [this] { DecodeStep{model_, cache_, sampler_, cur_, pos_, step_, out_, !opt_.head_screen}.run(); };
  loop_.cur = cur_;
  loop_.step_idx = step_;
  loop_.out = out_;
}

DecodeResult ArDecoder::feed(const std::vector<int64_t>& tokens, const DecodeOptions& opt, bool fresh) {
  check_call("generate", tokens.size(), opt, fresh);
  const at::Device dev = model_.device();
  if (fresh) cache_.clear();
  const int64_t n_fed = cache_.length() + (int64_t)tokens.size();
  sampler_.reset(opt.sampling.seed);
  DecodeResult res;
  auto t0 = Clock::now();
  auto ids = at::tensor(tokens, at::kLong).view({1, (int64_t)tokens.size()}).to(dev);
  ForwardOptions fo;
  fo.last_logits_only = true;
  auto logits = model_.forward(ids, cache_, fo);
  pos_.fill_(n_fed);
  step_.zero_();
  // Sampling draws through the graph's captured generator offsets: recapture per run (greedy reuses).
  if (!sampler_.greedy()) loop_.graphs.reset();
  run_decode_loop(loop_, sampler_.sample(logits.select(1, 0)), cache_, n_fed, opt, t0, dev, res);
  res.served_positions = cache_.length();
  res.memory = memory();
  return res;
}

MemoryReport ArDecoder::memory() const { return ar_memory_report(model_, capacity()); }

DecodeResult generate(const Model& model, const std::vector<int64_t>& prompt, const DecodeOptions& opt) {
  KAKEYA_CHECK(!prompt.empty(), "generate: empty prompt (the tokenizer produced no tokens)");
  KAKEYA_CHECK(opt.max_new_tokens > 0, "generate: --max-new-tokens expected > 0, got " << opt.max_new_tokens);
  ArDecoder d(model, (int64_t)prompt.size() + opt.max_new_tokens, opt);
  return d.run(prompt, opt);
}

void run_decode_loop(DecodeLoop& loop, const at::Tensor& first, KVCache& cache, int64_t n_fed,
                     const DecodeOptions& opt, Clock::time_point t0, const at::Device& dev, DecodeResult& res) {
  loop.out.index_copy_(0, loop.step_idx, first);
  loop.cur.copy_(first.view({1, 1}));
  loop.step_idx.add_(1);
  res.prefill_seconds = seconds_since(t0, dev);

  // SYNC: the first token is read to stream it and check for a stop.
  int64_t tok = first.item<int64_t>();
  res.tokens.push_back(tok);
  if (opt.on_token) opt.on_token(tok);
  auto t1 = Clock::now();
  bool stopped = ends_generation(tok, opt);
  if (!loop.graphs) loop.graphs = std::make_shared<LoopGraphs>();

#ifdef KAKEYA_CUDA
  LoopGraphs& g = *loop.graphs;
  if (!g.step && dev.is_cuda() && opt.cuda_graph && opt.max_new_tokens > 2 && !stopped) {
    // Capture on a side stream (required by CUDA graphs). Capture records the
    // kernels without running them, so the cache is left untouched.
    auto tc = Clock::now();
    {
      c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
      if (opt.megakernel) {
        // The step recorded as persistent-kernel programs inside the capture; a recording that
        // cannot be used leaves a graph that is thrown away, and the step is captured as it is.
        g.program = std::make_unique<ops::StepProgram>(dev);
        g.step = capture_graph([&] { return g.program->record(loop.step); });
        if (g.step) {
          g.program->upload();
          g.step_program = g.program->summary();
        } else {
          g.step_program = "kept its kernels: " + g.program->why_not();
          g.program.reset();
        }
      }
      if (!g.step) g.step = capture_graph(loop.step);
    }
    if (loop.upkeep) loop.upkeep->capture();
    res.capture_seconds = std::chrono::duration<double>(Clock::now() - tc).count();
  }
#endif
  // The batches due before the step feeding p, then the wait for those it reads.
  auto upkeep = [&](int64_t p) {
    if (!loop.upkeep_due) return;
    for (UpkeepBatch b = loop.upkeep_due(p); b.from >= 0; b = loop.upkeep_due(p)) loop.upkeep->run(b.from, b.read_at);
    loop.upkeep->wait(p);
  };
  // Tokens run but not yet read back. Streaming reads each one; otherwise they are read in
  // batches of kStopCheckEvery when stop tokens are set, and once at the end when not.
  int64_t pending = 0;
  auto read_pending = [&] {
    const int64_t have = res.tokens.size();
    auto got = loop.out.slice(0, have, have + pending).cpu();  // SYNC: one read per batch of steps
    const int64_t* t = got.data_ptr<int64_t>();
    for (int64_t i = 0; i < pending && !stopped; ++i) {
      res.tokens.push_back(t[i]);
      if (opt.on_token) opt.on_token(t[i]);
      stopped = ends_generation(t[i], opt);  // later tokens of the batch are dropped
    }
    pending = 0;
  };
  const int64_t batch = opt.reads_each_token() ? 1 : (opt.stop_ids.empty() ? opt.max_new_tokens : kStopCheckEvery);
  int64_t allocs0 = -1;  // allocator count before the first replay
  while (!stopped && (int64_t)res.tokens.size() + pending < opt.max_new_tokens) {
    const int64_t p = n_fed + (int64_t)res.tokens.size() + pending - 1;  // position fed by this step
    upkeep(p);
#ifdef KAKEYA_CUDA
    if (g.step) {
      if (allocs0 < 0) allocs0 = device_allocations(dev);
      g.step->replay();
    } else
#endif
      loop.step();
    cache.advance(1);
    if (loop.after) loop.after(p);
    if (++pending == batch) read_pending();
  }
  if (pending > 0) read_pending();
  // Batches still running write positions no step of this run reads; the next run must not
  // find them half done.
  if (loop.upkeep) loop.upkeep->drain();
  if (allocs0 >= 0) res.steady_allocations = device_allocations(dev) - allocs0;
  if (opt.megakernel) {
#ifdef KAKEYA_CUDA
    res.step_program = g.step_program;
    if (const char* e = std::getenv("KAKEYA_MEGA_TRACE"); e && *e && g.program) g.program->write_trace(e);
#endif
    if (res.step_program.empty()) res.step_program = "no CUDA graph (CPU, eager, or too short a run): nothing recorded";
  }
  res.decode_seconds = seconds_since(t1, dev);
}

}  // namespace kakeya
