#include "infer/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "infer/loop_util.h"

#ifdef KAKEYA_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kakeya {
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
  at::Tensor out;    // [max_new] int64

  void run() {
    ForwardOptions fo;
    fo.last_logits_only = true;
    fo.advance_cache = false;
    auto logits = model.forward(cur, pos, cache, fo);   // [1, 1, V]
    auto next = sampler.sample(logits.select(1, 0));  // [1]
    out.index_copy_(0, step, next);
    cur.copy_(next.view({1, 1}));
    pos.add_(1);
    step.add_(1);
  }
};

}  // namespace

GenerateResult generate(const Model& model, const std::vector<int64_t>& prompt, const GenerateOptions& opt) {
  KAKEYA_CHECK(!prompt.empty(), "generate: empty prompt (the tokenizer produced no tokens)");
  KAKEYA_CHECK(opt.max_new_tokens > 0, "generate: --max-new-tokens expected > 0, got " << opt.max_new_tokens);
  const at::Device dev = model.device();
  const int64_t n_prompt = prompt.size();
  KVCacheOptions co;
  co.capacity = n_prompt + opt.max_new_tokens;
  co.dtype = model.dtype();
  co.device = dev;
  co.rollback = 0;
  KAKEYA_CHECK(co.capacity <= model.options().max_positions,
               "generate: prompt (" << n_prompt << ") + new tokens (" << opt.max_new_tokens
                                    << ") exceed the model's position table (" << model.options().max_positions << ")");
  KVCache cache(model.config(), co);
  Sampler sampler(opt.sampling, dev);
  GenerateResult res;

  auto iopt = at::TensorOptions().dtype(at::kLong).device(dev);
  auto t0 = Clock::now();
  auto ids = at::tensor(prompt, at::kLong).view({1, n_prompt}).to(dev);
  ForwardOptions fo;
  fo.last_logits_only = true;
  auto logits = model.forward(ids, cache, fo);
  DecodeStep st{model, cache, sampler, at::empty({1, 1}, iopt), at::full({1}, n_prompt, iopt), at::zeros({1}, iopt),
                at::zeros({opt.max_new_tokens}, iopt)};
  DecodeLoop loop{[&st] { st.run(); }, nullptr, nullptr, st.cur, st.step, st.out};
  run_decode_loop(loop, sampler.sample(logits.select(1, 0)), cache, n_prompt, opt, t0, dev, res);
  res.cache_bytes = cache.bytes();
  return res;
}

void run_decode_loop(DecodeLoop& loop, const at::Tensor& first, KVCache& cache, int64_t n_prompt,
                     const GenerateOptions& opt, Clock::time_point t0, const at::Device& dev, GenerateResult& res) {
  loop.out.index_copy_(0, loop.step_idx, first);
  loop.cur.copy_(first.view({1, 1}));
  loop.step_idx.add_(1);
  res.prefill_seconds = seconds_since(t0, dev);

  // SYNC: the first token is read to stream it and check for a stop.
  int64_t tok = first.item<int64_t>();
  res.tokens.push_back(tok);
  if (opt.on_token) opt.on_token(tok);
  auto t1 = Clock::now();
  bool stopped = is_stop(tok, opt.stop_ids);

#ifdef KAKEYA_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph, upkeep_graph;
  if (dev.is_cuda() && opt.cuda_graph && !loop.before && opt.max_new_tokens > 2 && !stopped) {
    // Capture on a side stream (required by CUDA graphs). Capture records the
    // kernels without running them, so the cache is left untouched.
    auto tc = Clock::now();
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
    graph = std::make_unique<at::cuda::CUDAGraph>();
    graph->capture_begin();
    loop.step();
    graph->capture_end();
    if (loop.upkeep) {
      upkeep_graph = std::make_unique<at::cuda::CUDAGraph>();
      upkeep_graph->capture_begin();
      loop.upkeep();
      upkeep_graph->capture_end();
    }
    res.capture_seconds = std::chrono::duration<double>(Clock::now() - tc).count();
  }
#endif
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
      stopped = is_stop(t[i], opt.stop_ids);  // later tokens of the batch are dropped
    }
    pending = 0;
  };
  const int64_t batch = opt.stream ? 1 : (opt.stop_ids.empty() ? opt.max_new_tokens : kStopCheckEvery);
  while (!stopped && (int64_t)res.tokens.size() + pending < opt.max_new_tokens) {
    const int64_t p = n_prompt + (int64_t)res.tokens.size() + pending - 1;  // position fed by this step
    if (loop.before) loop.before(p);
    if (loop.upkeep_due && loop.upkeep_due(p)) {
#ifdef KAKEYA_CUDA
      if (upkeep_graph) upkeep_graph->replay();
      else
#endif
        loop.upkeep();
    }
#ifdef KAKEYA_CUDA
    if (graph) graph->replay();
    else
#endif
      loop.step();
    cache.advance(1);
    if (loop.after) loop.after(p);
    if (++pending == batch) read_pending();
  }
  if (pending > 0) read_pending();
  res.decode_seconds = seconds_since(t1, dev);
}

}  // namespace kakeya
