// ops::StepProgram: a decode step recorded as programs of the persistent kernel
// (core/kernels/cuda/megakernel.cuh says how it runs them).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/kernels/cuda/megakernel.cuh"
#include "core/kernels/step_program.h"

namespace kakeya {
namespace kernels {

namespace {

// A body's kernel: the same parameters without the Blk.
template <typename B>
struct KernelOf;
template <typename... P>
struct KernelOf<void (*)(Blk, P...)> {
  using type = void (*)(P...);
};
template <auto Kernel, auto Body>
const void* op_kernel() {
  static_assert(std::is_same_v<decltype(Kernel), typename KernelOf<decltype(Body)>::type>,
                "a kernel and its body take the same arguments");
  return reinterpret_cast<const void*>(Kernel);
}
using mega::bf16;

// The kernels whose bodies mega::run_task runs, in its order, and whether the body takes any
// block size (false: exactly mega::kThreads threads, the size the kernel is launched with).
struct OpEntry {
  const void* kernel;
  bool any_threads;
};
const OpEntry* ops_table() {
  static const OpEntry t[mega::kNumOps] = {
      {op_kernel<&embed_rms_norm_kernel<bf16>, &embed_rms_norm_body<bf16>>(), true},
      {op_kernel<&store_positions_kernel<>, &store_positions_body>(), true},
      {op_kernel<&add_rms_norm_kernel<bf16>, &add_rms_norm_body<bf16>>(), true},
      {op_kernel<&qk_norm_rope_store_kernel<bf16>, &qk_norm_rope_store_body<bf16>>(), true},
      {op_kernel<&decode_attn_partial_kernel<bf16, 4, 1, false>, &decode_attn_partial_body<bf16, 4, 1, false>>(),
       false},
      {op_kernel<&decode_attn_partial_kernel<bf16, 8, 1, false>, &decode_attn_partial_body<bf16, 8, 1, false>>(),
       false},
      {op_kernel<&decode_attn_combine_kernel<bf16>, &decode_attn_combine_body<bf16>>(), false},
      {op_kernel<&gemv_kernel<bf16, 1>, &gemv_body<bf16, 1>>(), false},
      {op_kernel<&residual_gemv_kernel<bf16>, &residual_gemv_body<bf16>>(), false},
      {op_kernel<&gemv_argmax_kernel<bf16>, &gemv_argmax_body<bf16>>(), false},
      {op_kernel<&argmax_blocks_kernel<>, &argmax_blocks_body>(), true},
      {op_kernel<&advance_step_kernel<>, &advance_step_body>(), true},
      {op_kernel<&gemv_capped_kernel<bf16, 1>, &gemv_body<bf16, 1>>(), false},
  };
  return t;
}

// By the device function's name: a kernel's host-side address differs between the translation unit
// that launches it and this one (each has its own stub), its name does not.
std::string kernel_name(const void* kernel) {
  const char* name = nullptr;
  if (cudaFuncGetName(&name, kernel) != cudaSuccess || !name) {
    (void)cudaGetLastError();  // not a kernel this runtime knows: no op
    return {};
  }
  return name;
}
int op_of(const void* kernel) {
  static std::mutex mu;
  static std::map<const void*, int> seen;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = seen.find(kernel); it != seen.end()) return it->second;
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (int i = 0; i < mega::kNumOps; ++i) v.push_back(kernel_name(ops_table()[i].kernel));
    return v;
  }();
  const std::string name = kernel_name(kernel);
  int op = -1;
  for (int i = 0; i < mega::kNumOps && !name.empty(); ++i)
    if (names[i] == name) op = i;
  return seen[kernel] = op;
}

// Dynamic shared memory a recorded launch may ask (the persistent blocks are sized for it: a residual
// GEMV over 2,816 values takes 22.6 KB).
constexpr size_t kMaxSegmentSmem = 24 * 1024;
// Room for a step of a few hundred launches (Gemma 3 270M: 133 in 1 to 3 segments).
constexpr size_t kMaxInstrs = 4096, kMaxArgs = 1 << 20, kMaxSegments = 64;

// Launches of more tasks than this many per persistent block run as kernels of their own: their
// blocks would otherwise take their tasks one after another (a vocabulary's lm_head: 8,192 blocks),
// where a grid of their own keeps several in flight per SM.
constexpr unsigned kMaxTasksPerBlock = 4;

size_t capture_nodes(cudaStream_t s) {
  cudaStreamCaptureStatus st;
  cudaGraph_t g = nullptr;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(s, &st, nullptr, &g));
  TORCH_CHECK(st == cudaStreamCaptureStatusActive && g, "StepProgram: the stream is not capturing a CUDA graph");
  size_t n = 0;
  C10_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &n));
  return n;
}

thread_local StepRecording* t_recording = nullptr;

}  // namespace

// The recording of one step (ops::StepProgram::record): instructions of the segment not yet
// launched, and every segment's place in the program's buffers.
struct StepRecording {
  cudaStream_t stream;
  int grid = 0;                       // persistent blocks
  std::vector<mega::Instr> instrs;    // every segment's, in order
  std::vector<unsigned char> args;    // their ArgPacks, 16-byte aligned
  int seg_first = 0;                  // the pending segment's first instruction
  int segments = 0;
  size_t smem = 0;                    // the pending segment's dynamic shared memory
  size_t nodes = 0;                   // nodes the capture holds when nothing foreign was issued
  int kernels_alone = 0;              // recorded launches that ran as kernels of their own
  std::string failed;                 // why the recording cannot be used
  // Device buffers (StepProgram's), written by upload().
  mega::Instr* d_prog = nullptr;
  unsigned char* d_args = nullptr;
  unsigned* d_done = nullptr;
  mega::Sync* d_sync = nullptr;
  unsigned long long* d_trace = nullptr;  // [instructions, grid, 2] or nullptr (StepProgram::write_trace)

  // Something launched outside the recording since the last check: fine between segments,
  // fatal while a segment waits to be launched after it.
  void check_foreign() {
    const size_t n = capture_nodes(stream);
    if (n != nodes && (int)instrs.size() > seg_first && failed.empty())
      failed = "work other than the recorded kernels was issued inside a segment";
    nodes = n;
  }
  void flush() {
    const int n = (int)instrs.size() - seg_first;
    if (n == 0) return;
    if ((size_t)segments >= kMaxSegments) {
      if (failed.empty()) failed = "more segments than the program's room";
      seg_first = (int)instrs.size();
      return;
    }
    mega::step_kernel<<<grid, mega::kThreads, smem, stream>>>(d_prog + seg_first, n, d_args, d_done + seg_first,
                                                              d_sync + segments,
                                                              d_trace ? d_trace + (size_t)seg_first * grid * 2 : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    ++segments;
    seg_first = (int)instrs.size();
    smem = 0;
    nodes = capture_nodes(stream);
  }
};

StepRecording* step_recording() { return t_recording; }

bool record_launch(StepRecording* r, const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                   const void* args, size_t bytes) {
  r->check_foreign();
  const int op = op_of(kernel);
  const unsigned tasks = grid.x * grid.y;
  const unsigned threads = block.x * block.y * block.z;
  const size_t off = (r->args.size() + 15) / 16 * 16, padded = (bytes + 15) / 16 * 16;
  // Arguments larger than the blocks' copy of them (kMaxArgBytes) take a kernel of their own too.
  const bool fits = op >= 0 && s == r->stream && grid.z == 1 && smem <= kMaxSegmentSmem &&
                    padded <= (size_t)mega::kMaxArgBytes &&
                    (ops_table()[op].any_threads ? threads <= 1024 : threads == (unsigned)mega::kThreads) &&
                    tasks <= kMaxTasksPerBlock * (unsigned)r->grid;
  if (!fits) {
    // It runs as it would have, after the segment before it: the caller launches it.
    r->flush();
    ++r->kernels_alone;
    return false;
  }
  if ((int)r->instrs.size() - r->seg_first >= mega::kMaxSegmentInstrs) r->flush();
  if (r->instrs.size() >= kMaxInstrs || off + padded > kMaxArgs) {
    if (r->failed.empty()) r->failed = "the step has more launches than the program's room";
    return true;
  }
  r->args.resize(off + padded);
  std::memcpy(r->args.data() + off, args, bytes);
  r->instrs.push_back({op, (int)grid.x, tasks, (unsigned)off, (unsigned)padded});
  r->smem = std::max(r->smem, smem);
  return true;
}

}  // namespace kernels

namespace ops {

namespace mk = kakeya::kernels::mega;
using kernels::kMaxArgs;
using kernels::kMaxInstrs;
using kernels::kMaxSegments;

struct StepProgram::Impl {
  at::Tensor prog, args, counters;  // device buffers: instructions, argument bytes, done[] + Sync[]
  at::Tensor trace;                 // [kMaxInstrs, grid, 2] int64 timestamps, or undefined (no trace)
  int grid = 0;                     // persistent blocks
  kernels::StepRecording rec;
};

StepProgram::StepProgram(at::Device device) : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(device.is_cuda(), "StepProgram: a CUDA device expected, got ", device);
  auto o = at::TensorOptions().device(device).dtype(at::kByte);
  impl_->prog = at::empty({(int64_t)(kMaxInstrs * sizeof(mk::Instr))}, o);
  impl_->args = at::empty({(int64_t)kMaxArgs}, o);
  impl_->counters = at::zeros({(int64_t)(kMaxInstrs * sizeof(unsigned) + kMaxSegments * sizeof(mk::Sync))}, o);
  // Every persistent block resident at once (a block waits on others' tasks: one that could not be
  // resident would never run them).
  int per_sm = 0, sms = 0;
  // Its static shared memory (the program, the bodies' arrays) and the launches' dynamic part pass
  // the 48 KB a kernel gets without asking.
  C10_CUDA_CHECK(cudaFuncSetAttribute(mk::step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)kernels::kMaxSegmentSmem));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, mk::step_kernel, mk::kThreads,
                                                               kernels::kMaxSegmentSmem));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                        device.has_index() ? device.index() : at::cuda::current_device()));
  TORCH_CHECK(per_sm > 0, "StepProgram: the persistent kernel does not fit an SM");
  impl_->grid = per_sm * sms;
  if (const char* e = std::getenv("KAKEYA_MEGA_TRACE"); e && *e)
    impl_->trace = at::zeros({(int64_t)kMaxInstrs, impl_->grid, 2}, o.dtype(at::kLong));
}
StepProgram::~StepProgram() = default;

bool StepProgram::recording() { return kernels::t_recording != nullptr; }

bool StepProgram::record(const std::function<void()>& step) {
  auto& r = impl_->rec;
  r = kernels::StepRecording{};
  r.stream = at::cuda::getCurrentCUDAStream().stream();
  r.grid = impl_->grid;
  r.d_prog = reinterpret_cast<mk::Instr*>(impl_->prog.data_ptr());
  r.d_args = impl_->args.data_ptr<uint8_t>();
  r.d_done = reinterpret_cast<unsigned*>(impl_->counters.data_ptr());
  r.d_sync = reinterpret_cast<mk::Sync*>(impl_->counters.data_ptr<uint8_t>() + kMaxInstrs * sizeof(unsigned));
  r.d_trace = impl_->trace.defined() ? reinterpret_cast<unsigned long long*>(impl_->trace.data_ptr<int64_t>()) : nullptr;
  r.nodes = kernels::capture_nodes(r.stream);
  kernels::t_recording = &r;
  try {
    step();
  } catch (...) {
    kernels::t_recording = nullptr;
    throw;
  }
  kernels::t_recording = nullptr;
  r.check_foreign();
  r.flush();
  if (r.failed.empty() && r.segments == 0)
    r.failed = "no launch of the step has a persistent-kernel body (bf16 decode-step kernels only)";
  return r.failed.empty();
}

std::string StepProgram::why_not() const { return impl_->rec.failed; }
int64_t StepProgram::instructions() const { return (int64_t)impl_->rec.instrs.size(); }
int64_t StepProgram::segments() const { return impl_->rec.segments; }
int64_t StepProgram::kernels_alone() const { return impl_->rec.kernels_alone; }
int64_t StepProgram::grid() const { return impl_->rec.grid; }
std::string StepProgram::summary() const {
  return std::to_string(instructions()) + " launches as " + std::to_string(segments()) + " persistent-kernel launches of " +
         std::to_string(grid()) + " blocks + " + std::to_string(kernels_alone()) + " kernels";
}

// Per instruction of the last run: when the blocks' waits ended and their tasks were done (ns from the
// step's first wait end; a kernel run alone between segments shows as a gap), and the longest a block
// spent on its tasks. An instruction's share of the chain is its last `done` less the one before's.
void StepProgram::write_trace(const std::string& path) const {
  const auto& r = impl_->rec;
  if (!impl_->trace.defined()) throw Error("StepProgram::write_trace: no trace recorded (set KAKEYA_MEGA_TRACE)");
  const at::Tensor t = impl_->trace.cpu();  // SYNC: once, after the run
  const int64_t* v = t.data_ptr<int64_t>();
  const int G = impl_->grid;
  nlohmann::json j;
  j["grid"] = G;
  j["instructions"] = nlohmann::json::array();
  int64_t t0 = 0;  // the step's first instruction's first wait end
  for (size_t i = 0; i < r.instrs.size(); ++i) {
    const auto& in = r.instrs[i];
    int64_t w0 = INT64_MAX, w1 = 0, d0 = INT64_MAX, d1 = 0, body = 0;
    for (int b = 0; b < G && b < (int)in.tasks; ++b) {
      const int64_t w = v[(i * G + b) * 2], d = v[(i * G + b) * 2 + 1];
      w0 = std::min(w0, w), w1 = std::max(w1, w), d0 = std::min(d0, d), d1 = std::max(d1, d);
      body = std::max(body, d - w);
    }
    if (i == 0) t0 = w0;
    const std::string name = kernels::kernel_name(kernels::ops_table()[in.op].kernel);
    j["instructions"].push_back({{"op", name.substr(0, std::min<size_t>(name.size(), 60))},
                                 {"tasks", in.tasks},
                                 {"wait_end_ns", {w0 - t0, w1 - t0}},
                                 {"done_ns", {d0 - t0, d1 - t0}},
                                 {"longest_block_ns", body}});
  }
  std::ofstream f(path);
  if (!f) throw Error("StepProgram::write_trace: cannot write " + path);
  f << j.dump(1) << "\n";
}

void StepProgram::upload() {
  const auto& r = impl_->rec;
  C10_CUDA_CHECK(cudaMemcpy(r.d_prog, r.instrs.data(), r.instrs.size() * sizeof(mk::Instr), cudaMemcpyHostToDevice));
  C10_CUDA_CHECK(cudaMemcpy(r.d_args, r.args.data(), r.args.size(), cudaMemcpyHostToDevice));
  impl_->counters.zero_();
  C10_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace ops
}  // namespace kakeya
