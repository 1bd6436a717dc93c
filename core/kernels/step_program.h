// ops::StepProgram: the decode step's kernels as programs of one persistent kernel
// (core/kernels/cuda/megakernel.cuh runs them, megakernel.cu records them; CUDA builds only).
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>

namespace kakeya::ops {

// A decode step as programs of one persistent kernel (core/kernels/cuda/megakernel.cuh; CUDA builds
// only): an execution strategy of the same forward, not a copy of it. record(step) runs `step` on the
// current stream, which must be capturing a CUDA graph; each launch of a kernel the persistent kernel
// has a body for (a decode step's GEMVs, norms, q/k step, attention, greedy head and bookkeeping, in
// bf16) becomes an instruction instead, each run of them one launch of the persistent kernel, and any
// other launch runs as it is, in order. True when the capture holds a usable step; false when work
// was issued that the program would reorder (why_not() says what): end that capture, throw it away
// and capture the step without recording. upload() after the capture ends, before the first replay.
// The decode step's tensors live in the graph's memory pool: the program is valid while the graph is.
// Experimental: bit-exact, and slower than the kernels it replaces (0.73x AR on the H200; megakernel.cuh
// says why): an opt-in (DecodeOptions::megakernel) for the work on bodies written for it.
class StepProgram {
 public:
  explicit StepProgram(at::Device device);
  ~StepProgram();
  StepProgram(const StepProgram&) = delete;
  StepProgram& operator=(const StepProgram&) = delete;
  bool record(const std::function<void()>& step);
  void upload();
  std::string why_not() const;
  int64_t instructions() const;   // recorded launches
  int64_t segments() const;       // persistent-kernel launches a step makes
  int64_t kernels_alone() const;  // launches kept as kernels of their own
  int64_t grid() const;           // persistent blocks
  // "N launches as S persistent-kernel launches of G blocks + K kernels" (DecodeResult::step_program's form).
  std::string summary() const;
  static bool recording();        // a step is being recorded on this thread
  // With KAKEYA_MEGA_TRACE set when the program was made, the blocks time each instruction of every
  // run; this writes the last run's timeline as JSON to `path` (per instruction: waits' ends, tasks'
  // ends, the longest block).
  void write_trace(const std::string& path) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kakeya::ops
