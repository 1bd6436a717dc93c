// A decode step's kernels run by one persistent kernel (FlashInfer layering: this file knows raw
// pointers and streams; core/kernels/cuda/megakernel.cu records the step and wraps it for the model;
// core/kernels/step_program.h declares ops::StepProgram).
//
// Why: a decode step of a small model is ~130 kernels of a few microseconds each, and every kernel
// boundary costs the grid's drain, the next grid's launch and ramp-up even under programmatic
// dependent launch. Here each recorded launch becomes an instruction: its kernel's body (the same
// __device__ code the kernel runs: an execution strategy, not a second copy of the model), its grid,
// and its arguments. The persistent kernel's blocks walk the instructions in order, each block taking
// the tasks (virtual blocks) blockIdx.x, blockIdx.x + gridDim.x, ... of every instruction; before an
// instruction's first task a block waits until every task of the instruction before it has finished
// (a per-instruction counter in global memory, one poller per block), so what one launch wrote, the
// next one reads, as stream order gave it.
//
// Counters never reset: run r of the program (r = 1, 2, ...) waits for counter i to reach r·tasks_i.
// The run number comes from sync->epoch, which the last block to leave a run advances; every block
// reads it on entry, before any block can leave.
//
// Measured (H200, Gemma 3 270M bf16, 512-token prompt; bench/results/README.md, stops 63 and 65): the
// step runs bit for bit as its kernels do but at 0.73x their speed (1,354 vs 1,845 tok/s). Where the
// time goes (KAKEYA_MEGA_TRACE, tools/mega_trace.py): a block sees the instruction before it finished
// ~0.7 us after its last block counted, so the 132 waits cost ~100 us of the ~740 us step; the rest is
// the bodies' own latency, a block's tasks of one instruction running one after another: a residual
// GEMV 6.5 us a block (its residual step and norms, then two GEMV tasks), a GEMV 3.3, the attention
// 3.9 + 2.3, the q/k step 2.3. The weights' latency is not what keeps them slow: copying every GEMV
// block's rows into shared memory before its wait changed nothing, nor did loading each instruction's
// arguments one instruction ahead (stop 65, both reverted).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/kernels/cuda/decode_kernels.cuh"
#include "core/kernels/cuda/spec_kernels.cuh"

namespace kakeya::kernels::mega {

using bf16 = __nv_bfloat16;

struct Instr {
  int op;             // the body: its index in ops_table() (megakernel.cu) and in run_task's switch
  int gx;             // the recorded grid: gx · gy tasks, task t = block (t mod gx, t / gx)
  unsigned tasks;
  unsigned args;      // byte offset of the launch's ArgPack in the program's argument bytes (16-aligned)
  unsigned bytes;     // its size
};
// A segment's instructions and one instruction's arguments as a block keeps them in shared memory.
constexpr int kMaxSegmentInstrs = 512;
constexpr int kMaxArgBytes = 512;

struct Sync {
  unsigned epoch;     // runs finished
  unsigned exited;    // blocks that left, over every run
};

// Threads of a persistent block: the GEMV and attention bodies are written for 8 warps
// (kGemvWarps, kAttnWarps); the other bodies take any block size (megakernel.cu says which).
constexpr int kThreads = 256;
static_assert(kGemvWarps * 32 == kThreads && kAttnWarps * 32 == kThreads, "bodies of 8 warps");

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A block waits for counter c to reach `target`: thread 0 polls with acquire loads, and the barrier
// after hands what they made visible to the block (as arrive's barrier gathered the writes before
// its release). A program whose counters never get there (a fault elsewhere) traps after ~4 s
// rather than hang: the launch then fails with an error the caller reports.
__device__ __forceinline__ void wait_count(const unsigned* c, unsigned target) {
  if (threadIdx.x == 0) {
    const long long t0 = clock64();
    while ((int)(ld_acquire(c) - target) < 0)
      if (clock64() - t0 > (4ll << 30)) __trap();
  }
  __syncthreads();
}
// After a barrier that follows the block's last task: its writes, then the count (one release).
__device__ __forceinline__ void arrive(unsigned* c, unsigned n) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(c), "r"(n) : "memory");
}

// The GPU's nanosecond clock, the same on every SM (clock64 is not): the step's timeline (trace).
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// F(args...) for a body F(Blk, args...) with its arguments read from their ArgPack.
template <typename B>
struct BodyPack;
template <typename... P>
struct BodyPack<void (*)(Blk, P...)> {
  using type = ArgPack<P...>;
};
template <auto Body>
__device__ __forceinline__ void call(Blk b, const unsigned char* a) {
  using Pack = typename BodyPack<decltype(Body)>::type;
  auto f = [b](const auto&... p) { Body(b, p...); };
  apply_pack(f, *reinterpret_cast<const Pack*>(a));
}

// The bodies, in the order of ops_table() (megakernel.cu).
__device__ __forceinline__ void run_task(int op, Blk b, const unsigned char* a) {
  switch (op) {
    case 0: call<&embed_rms_norm_body<bf16>>(b, a); break;
    case 1: call<&store_positions_body>(b, a); break;
    case 2: call<&add_rms_norm_body<bf16>>(b, a); break;
    case 3: call<&qk_norm_rope_store_body<bf16>>(b, a); break;
    case 4: call<&decode_attn_partial_body<bf16, 4, 1, false>>(b, a); break;
    case 5: call<&decode_attn_partial_body<bf16, 8, 1, false>>(b, a); break;
    case 6: call<&decode_attn_combine_body<bf16>>(b, a); break;
    case 7: call<&gemv_body<bf16, 1>>(b, a); break;
    case 8: call<&residual_gemv_body<bf16>>(b, a); break;
    case 9: call<&gemv_argmax_body<bf16>>(b, a); break;
    case 10: call<&argmax_blocks_body>(b, a); break;
    case 11: call<&advance_step_body>(b, a); break;
    case 12: call<&gemv_body<bf16, 1>>(b, a); break;  // gemv_capped_kernel: the same body
    default: __trap();
  }
}
constexpr int kNumOps = 13;

// One run of a program of n instructions: done[i] counts instruction i's finished tasks.
// The program (n <= kMaxSegmentInstrs) is read into shared memory once; each instruction's arguments
// are copied there before the block waits, so neither is a global load on the chain of dependent
// instructions. trace (nullable, [n, gridDim.x, 2]): when each block's wait for instruction i ended
// and when its tasks of it were done (global_ns), for ops::StepProgram::write_trace.
__global__ void __launch_bounds__(kThreads, 2) step_kernel(const Instr* __restrict__ prog, int n,
                                                        const unsigned char* __restrict__ args, unsigned* done,
                                                        Sync* sync, unsigned long long* trace) {
  __shared__ unsigned s_epoch;
  __shared__ Instr s_prog[kMaxSegmentInstrs];
  __shared__ uint4 s_args[kMaxArgBytes / 16];
  if (threadIdx.x == 0) s_epoch = ld_acquire(&sync->epoch);
  for (int i = threadIdx.x; i < n; i += blockDim.x) s_prog[i] = prog[i];
  __syncthreads();
  const unsigned run = s_epoch + 1;
  const unsigned char* a = reinterpret_cast<const unsigned char*>(s_args);
  for (int i = 0; i < n; ++i) {
    const Instr in = s_prog[i];
    if (blockIdx.x >= in.tasks) continue;  // no task here: the next instruction's wait covers this one
    for (unsigned j = threadIdx.x; j < in.bytes / 16; j += blockDim.x)
      s_args[j] = reinterpret_cast<const uint4*>(args + in.args)[j];
    __syncthreads();
    if (i > 0) wait_count(done + i - 1, run * s_prog[i - 1].tasks);
    unsigned long long* tr = trace ? trace + ((size_t)i * gridDim.x + blockIdx.x) * 2 : nullptr;
    if (tr && threadIdx.x == 0) tr[0] = global_ns();
    unsigned mine = 0;
    for (unsigned t = blockIdx.x; t < in.tasks; t += gridDim.x, ++mine) {
      run_task(in.op, Blk{(int)(t % in.gx), (int)(t / in.gx), in.gx}, a);
      __syncthreads();  // shared memory is the next task's; the task's writes precede the count
    }
    if (threadIdx.x == 0) {
      if (tr) tr[1] = global_ns();
      arrive(done + i, mine);
    }
  }
  if (threadIdx.x == 0) {
    const unsigned left = atomicAdd(&sync->exited, 1u) + 1;
    if (left == run * gridDim.x) {
      __threadfence();
      atomicExch(&sync->epoch, run);
    }
  }
}

}  // namespace kakeya::kernels::mega
