#include "infer/upkeep.h"

#include <chrono>
#include <deque>
#include <optional>
#include <vector>

#include "core/error.h"
#include "infer/graph_capture.h"

#ifdef KAKEYA_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kakeya {

struct UpkeepRunner::Impl {
  std::function<void(int64_t)> arg;
  std::function<void()> work;
#ifdef KAKEYA_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  std::optional<c10::cuda::CUDAStream> side;
  // One event per batch in flight (a batch is waited for within about a window of positions,
  // so a few exist); an event returns to `free` once its wait is enqueued.
  std::vector<c10::cuda::CUDAEvent> done;
  std::vector<size_t> free;
  c10::cuda::CUDAEvent ready{cudaEventDisableTiming};  // the forwards before the batch are enqueued
  struct InFlight {
    int64_t read_at;
    size_t ev;
  };
  std::deque<InFlight> in_flight;
  std::vector<std::pair<c10::cuda::CUDAEvent, c10::cuda::CUDAEvent>> timed;  // start, end of each batch
#endif
  bool cuda = false;
  bool timing = false;
  double cpu_seconds = 0;  // batches run without CUDA events
};

UpkeepRunner::UpkeepRunner(std::function<void(int64_t)> arg, std::function<void()> work, bool cuda) : impl_(new Impl) {
  impl_->arg = std::move(arg);
  impl_->work = std::move(work);
  impl_->cuda = cuda;
}

UpkeepRunner::~UpkeepRunner() = default;

double UpkeepRunner::capture() {
#ifdef KAKEYA_CUDA
  if (impl_->graph) return 0.0;
  auto t0 = std::chrono::steady_clock::now();
  {
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
    impl_->graph = capture_graph(impl_->work);
  }
  impl_->side = c10::cuda::getStreamFromPool();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#else
  return 0.0;
#endif
}

bool UpkeepRunner::captured() const {
#ifdef KAKEYA_CUDA
  return impl_->graph != nullptr;
#else
  return false;
#endif
}

void UpkeepRunner::run(int64_t from, int64_t read_at) {
#ifdef KAKEYA_CUDA
  Impl& m = *impl_;
  if (m.graph) {
    auto main = c10::cuda::getCurrentCUDAStream();
    m.ready.record(main);
    if (m.free.empty()) {
      m.free.push_back(m.done.size());
      m.done.emplace_back(cudaEventDisableTiming);
    }
    const size_t e = m.free.back();
    m.free.pop_back();
    {
      c10::cuda::CUDAStreamGuard guard(*m.side);
      m.ready.block(*m.side);
      if (m.timing) {
        m.timed.emplace_back(c10::cuda::CUDAEvent(cudaEventDefault), c10::cuda::CUDAEvent(cudaEventDefault));
        m.timed.back().first.record(*m.side);
      }
      m.arg(from);
      m.graph->replay();
      if (m.timing) m.timed.back().second.record(*m.side);
      m.done[e].record(*m.side);
    }
    m.in_flight.push_back({read_at, e});
    return;
  }
#endif
  (void)read_at;
  auto t0 = std::chrono::steady_clock::now();
#ifdef KAKEYA_CUDA
  const bool events = impl_->timing && impl_->cuda;
  if (events) {
    impl_->timed.emplace_back(c10::cuda::CUDAEvent(cudaEventDefault), c10::cuda::CUDAEvent(cudaEventDefault));
    impl_->timed.back().first.record(c10::cuda::getCurrentCUDAStream());
  }
#else
  const bool events = false;
#endif
  impl_->arg(from);
  impl_->work();
#ifdef KAKEYA_CUDA
  if (events) impl_->timed.back().second.record(c10::cuda::getCurrentCUDAStream());
#endif
  if (impl_->timing && !events) impl_->cpu_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void UpkeepRunner::wait(int64_t pos) {
#ifdef KAKEYA_CUDA
  Impl& m = *impl_;
  while (!m.in_flight.empty() && m.in_flight.front().read_at <= pos) {
    m.done[m.in_flight.front().ev].block(c10::cuda::getCurrentCUDAStream());
    m.free.push_back(m.in_flight.front().ev);
    m.in_flight.pop_front();
  }
#else
  (void)pos;
#endif
}

void UpkeepRunner::drain() {
#ifdef KAKEYA_CUDA
  Impl& m = *impl_;
  for (const auto& f : m.in_flight) {
    m.done[f.ev].block(c10::cuda::getCurrentCUDAStream());
    m.free.push_back(f.ev);
  }
  m.in_flight.clear();
#endif
}

void UpkeepRunner::set_timing(bool on) { impl_->timing = on; }

double UpkeepRunner::take_seconds() {
  double s = impl_->cpu_seconds;
  impl_->cpu_seconds = 0;
#ifdef KAKEYA_CUDA
  for (auto& [start, end] : impl_->timed) {
    end.synchronize();  // SYNC: timing read once per run
    s += start.elapsed_time(end) / 1e3;
  }
  impl_->timed.clear();
#endif
  return s;
}

}  // namespace kakeya
