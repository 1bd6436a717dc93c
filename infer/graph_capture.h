// Capturing a CUDA graph: every graph infer/ replays (the decode step, its upkeep, a restored
// prefill's chunk, the fused decoder's parts) and those of `kakeya bench chain` come from here.
#pragma once
#ifdef KAKEYA_CUDA
#include <ATen/cuda/CUDAGraph.h>

#include <memory>
#include <type_traits>

namespace kakeya {

// A graph of one run of body() on the current stream, which must not be the default one (the
// caller sets a side stream: capture refuses the default stream). body returns void, or bool:
// false drops the graph (nullptr), as when what it recorded cannot be used. A throw inside body
// ends the capture before it propagates: a capture left open makes every later launch on the
// stream fail with an error that says nothing of the first one, and the half-captured graph is
// dropped, so no later run replays it. pool: the memory pool the graph's temporaries come from
// ({0, 0}: a new one).
template <typename Body>
std::unique_ptr<at::cuda::CUDAGraph> capture_graph(Body&& body, at::cuda::MempoolId_t pool = {0, 0}) {
  auto g = std::make_unique<at::cuda::CUDAGraph>();
  g->capture_begin(pool);
  bool keep = true;
  try {
    if constexpr (std::is_same_v<decltype(body()), bool>)
      keep = body();
    else
      body();
  } catch (...) {
    try {
      g->capture_end();
    } catch (...) {  // the first error is the one to report
    }
    throw;
  }
  g->capture_end();
  if (!keep) g.reset();
  return g;
}

}  // namespace kakeya
#endif
