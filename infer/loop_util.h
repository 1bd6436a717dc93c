// Small pieces every decode loop in infer/ shares (AR, speculative, restored, fused).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "core/model/kv_cache.h"
#include "core/model/model.h"
#include "core/model/sampling.h"
#include "infer/options.h"
#include "infer/result.h"

#ifdef KAKEYA_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kakeya {

using Clock = std::chrono::steady_clock;

// Wall seconds since t0, after the device's queued work: a timing boundary.
inline double seconds_since(Clock::time_point t0, const at::Device& dev) {
#ifdef KAKEYA_CUDA
  if (dev.is_cuda()) c10::cuda::getCurrentCUDAStream().synchronize();  // SYNC: timing boundary
#endif
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Allocations the CUDA caching allocator has served on dev so far (-1 off CUDA). Read before
// the first graph replay of a decode loop and at its end: the difference is what the steady
// state allocates (nothing, when every part of it replays a graph).
inline int64_t device_allocations(const at::Device& dev) {
#ifdef KAKEYA_CUDA
  if (dev.is_cuda()) {
    const int idx = dev.has_index() ? dev.index() : c10::cuda::current_device();
    return c10::cuda::CUDACachingAllocator::getDeviceStats(idx)
        .allocation[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
        .allocated;
  }
#endif
  (void)dev;
  return -1;
}

// One decode step's forward of token cur [1, 1] at pos [1] and its next token [1]: a greedy
// sampler takes the forward's argmax (ForwardOptions::argmax: no logits), the others sample.
inline at::Tensor step_token(const Model& model, const at::Tensor& cur, const at::Tensor& pos, KVCache& cache,
                             ForwardOptions fo, Sampler& sampler) {
  fo.last_logits_only = true;
  fo.argmax = sampler.greedy();
  at::Tensor r = model.forward(cur, pos, cache, fo);  // [1, 1] tokens or [1, 1, V] logits
  return fo.argmax ? r.view({1}) : sampler.sample(r.select(1, 0));
}

// Generation ends after `tok`: a stop token, or opt.should_stop() (a client gone, a stop string).
inline bool ends_generation(int64_t tok, const DecodeOptions& opt) {
  return std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end() ||
         (opt.should_stop && opt.should_stop());
}

// The tokens one verify forward produced (r[0..n), speculative modes) committed within the
// budget (opt.max_new_tokens) and up to the first stop token or the first one after which
// opt.should_stop() answers true: appended to res.tokens (on_token each), their count appended
// to res.committed and returned; `stopped` turns true when a stop ended the block.
inline int64_t commit_tokens(const int64_t* r, int64_t n, const DecodeOptions& opt, DecodeResult& res,
                             bool& stopped) {
  const int64_t room = std::min<int64_t>(n, opt.max_new_tokens - (int64_t)res.tokens.size());
  int64_t produced = 0;
  while (produced < room && !stopped) {
    const int64_t t = r[produced++];
    res.tokens.push_back(t);
    if (opt.on_token) opt.on_token(t);
    stopped = ends_generation(t, opt);
  }
  res.committed.push_back(produced);
  return produced;
}

}  // namespace kakeya
