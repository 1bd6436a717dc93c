// kakeya bench gemm: the linear layers of speculative-decoding verify forwards and DFlash
// drafter blocks (9..16 token rows, bf16) through our dispatch (ops::linear /
// ops::linear_act_mul: the tensor-core skinny GEMM of core/cuda/decode_kernels.cuh at 9..16
// rows) next to cuBLAS (at::linear, plus the act_mul kernel for the gated MLP: the path those
// rows took before), same inputs, same run. Prints a table, writes JSON.
//
// Timing: each side is captured as a CUDA graph of back-to-back calls and replayed many
// times back to back (the replays queue on the stream, an event between each two); the
// figure is the median replay time / calls per replay. Launch overhead inside a graph is
// what a graph-replayed verify / drafter block pays, so it is included.
// Cold weights: a decode forward streams the model's weights, so a layer's weights are
// not in L2 when its linear runs. The calls rotate over enough copies of the weight to
// cover 2x the L2 (at least 4; --copies overrides) and a graph holds at least one call per
// copy (--calls sets the minimum, 20). --copies 4 --calls 20 gives the warm-L2 figure for
// small layers. x is one tensor for all calls (L2-resident, as the previous op just wrote it).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/ops.h"
#include "tools/cli_common.h"

#ifdef KAKEYA_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace kakeya::ops::cuda {
int64_t skinny_gemm_launches();  // core/cuda/decode_ops.cu: skinny GEMM launches so far (host count)
}
#endif

namespace kakeya::cli {
using json = nlohmann::json;

#ifdef KAKEYA_CUDA
namespace {

struct GemmShape {
  const char* model;  // verifier (Gemma 3 270M) | drafter (DFlash)
  const char* name;
  int64_t N, K;       // y = x·Wᵀ: W [N, K], or [2N, K] = [gate; up] when gated
  bool gated;         // act(gate)·up with GELU-tanh (Gemma's MLP)
};

// The drafter's qkv: 8 q heads + 1 k + 1 v head of dim 64 = (8 + 2)·64 = 640 rows.
const GemmShape kShapes[] = {
    {"verifier", "qkv", 1536, 640, false},         {"verifier", "o", 640, 1024, false},
    {"verifier", "gate_up", 2048, 640, true},      {"verifier", "down", 640, 2048, false},
    {"verifier", "lm_head", 262144, 640, false},   {"drafter", "qkv", 640, 640, false},
    {"drafter", "o", 640, 512, false},             {"drafter", "gate_up", 1280, 640, true},
    {"drafter", "down", 640, 1280, false},         {"drafter", "fc", 640, 3200, false},
    {"drafter", "draft_head", 32768, 640, false},
};

}  // namespace
#endif

void register_bench_gemm(CLI::App& bench) {
  struct Opts {
    std::string device = "cuda", json;
    int64_t rows = 16, replays = 200, copies = 0, calls = 20;
  };
  auto o = std::make_shared<Opts>();
  auto* c =
      bench.add_subcommand("gemm", "skinny GEMM (9..16 rows, bf16): ours vs cuBLAS on the verifier/drafter linears");
  c->add_option("--device", o->device, "cuda (the bench has no CPU version)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  c->add_option("--rows", o->rows, "token rows M of x [M, K] (ours: GEMV <= 8, skinny GEMM 9..16, else cuBLAS)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  c->add_option("--json", o->json, "write the results here");
  c->add_option("--replays", o->replays, "timed graph replays per side (median reported)")
      ->capture_default_str()
      ->check(CLI::Range(5, 100000));
  c->add_option("--copies", o->copies, "weight copies the calls rotate over (0: enough to cover 2x L2, at least 4)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  c->add_option("--calls", o->calls, "calls per captured graph (at least one per copy)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  c->callback([o] {
#ifndef KAKEYA_CUDA
    KAKEYA_FAIL("bench gemm needs a CUDA build and device: this build has no CUDA kernels "
                "(configure with -DKAKEYA_CUDA=ON)");
#else
    KAKEYA_CHECK(o->device == "cuda" && at::hasCUDA(),
                 "bench gemm needs a CUDA build and device: " << (o->device == "cuda" ? "no CUDA device is available"
                                                                                      : "run it with --device cuda"));
    const at::Device dev(at::kCUDA, 0);
    c10::cuda::CUDAGuard guard(dev);
    const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
    const int64_t l2 = std::max<int64_t>(prop->l2CacheSize, 1);
    const auto opts = at::TensorOptions().dtype(at::kBFloat16).device(dev);
    const int64_t M = o->rows;
    const char* ours_path = M <= 8 ? "gemv" : (M <= 16 ? "skinny_gemm" : "cublas (no kernel of ours at this M)");
    std::fprintf(stderr, "[bench] gemm: %s, %lld rows, bf16, L2 %.0f MB; ours = %s\n", prop->name, (long long)M,
                 l2 / 1e6, ours_path);

    // Median over `replays` back-to-back replays of a graph holding `calls` calls of op(i).
    auto time_us = [&](const std::function<at::Tensor(int64_t)>& op, int64_t calls) {
      op(0);  // eager warm-up: cuBLAS handle/workspace, our launcher's one-time queries
      at::cuda::CUDAGraph graph;
      {
        c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());  // capture needs a side stream
        graph.capture_begin();
        for (int64_t i = 0; i < calls; ++i) op(i);
        graph.capture_end();
      }
      auto stream = c10::cuda::getCurrentCUDAStream();
      for (int i = 0; i < 5; ++i) graph.replay();  // warm-up; also primes the queue ahead of the first event
      std::vector<c10::cuda::CUDAEvent> ev;
      ev.reserve(o->replays + 1);
      for (int64_t r = 0; r <= o->replays; ++r) ev.emplace_back(cudaEventDefault);
      ev[0].record(stream);
      for (int64_t r = 0; r < o->replays; ++r) {
        graph.replay();
        ev[r + 1].record(stream);
      }
      ev.back().synchronize();
      std::vector<double> us;
      for (int64_t r = 0; r < o->replays; ++r) us.push_back(1e3 * ev[r].elapsed_time(ev[r + 1]) / (double)calls);
      std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
      return us[us.size() / 2];
    };

    std::printf("\n%-20s %8s %6s %6s %10s %10s %12s %10s  %s\n", "shape", "N", "K", "gated", "ours us", "cuBLAS us",
                "cuBLAS/ours", "ours GB/s", "ours kernel");
    json rows = json::array();
    for (const auto& s : kShapes) {
      const int64_t wrows = s.gated ? 2 * s.N : s.N;
      const double bytes = 2.0 * (double)wrows * (double)s.K;
      const int64_t copies =
          o->copies > 0 ? o->copies : std::clamp<int64_t>((int64_t)std::ceil(2.0 * (double)l2 / bytes), 4, 4096);
      const int64_t calls = std::max(o->calls, copies);
      auto x = at::randn({M, s.K}, opts);
      std::vector<at::Tensor> w;
      for (int64_t i = 0; i < copies; ++i) w.push_back(at::randn({wrows, s.K}, opts) * 0.05);
      auto ours = [&](int64_t i) {
        const auto& wi = w[i % copies];
        return s.gated ? ops::linear_act_mul(x, wi, {}, /*gelu_tanh=*/true) : ops::linear(x, wi);
      };
      auto cublas = [&](int64_t i) {
        auto y = at::linear(x, w[i % copies]);
        return s.gated ? ops::act_mul(y, /*gelu_tanh=*/true) : y;
      };
      // Both sides agree (a check that they compute the same thing), and which kernel ours ran.
      const auto want = cublas(0).to(at::kFloat);
      const int64_t before = ops::cuda::skinny_gemm_launches();
      const auto got = ours(0).to(at::kFloat);
      const bool skinny = ops::cuda::skinny_gemm_launches() > before;
      const double rel = (got - want).norm().item<double>() / (want.norm().item<double>() + 1e-30);  // SYNC
      // Up to 8 rows ours is the GEMV kernel where x fits its 48 KB of shared memory (launch_gemv).
      const bool gemv = M <= 8 && (M * s.K + 16 * M) * 4 <= 48 * 1024;
      const std::string kernel = skinny ? "skinny_gemm" : (gemv ? "gemv" : "cublas (fallback)");
      const double ours_us = time_us(ours, calls), cublas_us = time_us(cublas, calls);
      const std::string label = std::string(s.model) + " " + s.name;
      std::printf("%-20s %8lld %6lld %6s %10.2f %10.2f %11.2fx %10.0f  %s\n", label.c_str(), (long long)s.N,
                  (long long)s.K, s.gated ? "yes" : "no", ours_us, cublas_us, cublas_us / ours_us,
                  bytes / ours_us / 1e3, kernel.c_str());
      rows.push_back({{"model", s.model},
                      {"name", s.name},
                      {"N", s.N},
                      {"K", s.K},
                      {"gated", s.gated},
                      {"weight_bytes", bytes},
                      {"copies", copies},
                      {"calls_per_graph", calls},
                      {"ours_us", ours_us},
                      {"cublas_us", cublas_us},
                      {"cublas_over_ours", cublas_us / ours_us},
                      {"ours_GBps", bytes / ours_us / 1e3},
                      {"cublas_GBps", bytes / cublas_us / 1e3},
                      {"ours_kernel", kernel},
                      {"rel_diff_vs_cublas", rel}});
    }
    std::printf("us per call: median over %lld replays of a CUDA graph of back-to-back calls, weights rotated over "
                "copies covering 2x L2 (cold)\n",
                (long long)o->replays);
    json j = {{"bench", "gemm"},
              {"command", command_line()},
              {"commit", git_commit()},
              {"device", device_description(dev)},
              {"gpu", prop->name},
              {"l2_bytes", l2},
              {"dtype", "bf16"},
              {"rows", M},
              {"replays", o->replays},
              {"min_calls_per_graph", o->calls},
              {"copies_option", o->copies},
              {"shapes", rows}};
    if (!o->json.empty()) write_json(o->json, j);
#endif
  });
}

}  // namespace kakeya::cli
