// Small pieces every decode loop in infer/ shares (AR, speculative, restored).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <vector>

#ifdef KAKEYA_CUDA
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

inline bool is_stop(int64_t tok, const std::vector<int64_t>& stop) {
  return std::find(stop.begin(), stop.end(), tok) != stop.end();
}

}  // namespace kakeya
