#include "infer/bench_chain.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <vector>

#include "core/error.h"
#include "core/kernels/ops.h"

#ifdef KAKEYA_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/kernels/step_program.h"
#include "infer/graph_capture.h"
#endif

namespace kakeya {

namespace {

// What a link reads and writes: the residual stream h and the row x, both [1, H].
struct Rows {
  at::Tensor h, x;
};

struct Chain {
  const char* name;
  const char* what;
  int launches_per_link;
  std::function<Rows(const Rows&)> link;
  std::function<void()> start;                   // before the first link (resets what links count), or empty
  std::function<at::Tensor(const Rows&)> result;  // after the last: what the two strategies must agree on
  bool persistent = true;  // the persistent program runs it too (the lm_head stays a kernel of its own)
  std::function<void(nlohmann::json&)> report;  // after the longer chain's last replay: what else to note, or empty
};

#ifdef KAKEYA_CUDA
using Clock = std::chrono::steady_clock;

// One chain of `links` links captured in a graph: as the kernels (programmatic dependent launch,
// as a decode step runs them) or recorded as a persistent kernel's program. `out` lives in the
// graph's memory pool.
struct Captured {
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  std::unique_ptr<ops::StepProgram> program;
  Rows out;
};

Captured capture_chain(const Chain& c, const Rows& in, int64_t links, bool persistent, at::Device dev) {
  Captured r;
  auto run = [&] {
    if (c.start) c.start();
    Rows s = in;
    for (int64_t i = 0; i < links; ++i) s = c.link(s);
    r.out = s;
  };
  r.graph = capture_graph([&] {
    if (!persistent) {
      run();
      return true;
    }
    r.program = std::make_unique<ops::StepProgram>(dev);
    return r.program->record(run);
  });
  KAKEYA_CHECK(r.graph, "bench chain: chain '" << c.name << "': the persistent kernel cannot run it: " << r.program->why_not());
  if (r.program) r.program->upload();
  return r;
}

// Median wall seconds of one replay, after a warm-up replay.
double median_replay(at::cuda::CUDAGraph& g, int64_t repeats) {
  auto stream = at::cuda::getCurrentCUDAStream();
  g.replay();
  stream.synchronize();  // SYNC: warm-up done
  std::vector<double> t;
  for (int64_t i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    g.replay();
    stream.synchronize();  // SYNC: timing boundary
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The same bits (NaN included): bf16 rows compared as 16-bit integers.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == at::kBFloat16 ? at::equal(a.view(at::kShort), b.view(at::kShort)) : at::equal(a, b);
}
#endif

}  // namespace

nlohmann::json bench_chain(const BenchChainOptions& o) {
  KAKEYA_CHECK(o.device.is_cuda(), "bench chain: --device cuda expected (it times chains of CUDA launches), got "
                                       << o.device);
  KAKEYA_CHECK(o.hidden >= 16 && o.hidden <= 16384 && o.hidden % 16 == 0,
               "bench chain: --hidden expected a multiple of 16 in [16, 16384], got " << o.hidden);
  KAKEYA_CHECK(o.intermediate >= o.hidden && o.intermediate <= 65536 && o.intermediate % 16 == 0,
               "bench chain: --intermediate expected a multiple of 16 in [--hidden " << o.hidden << ", 65536], got "
                                                                                    << o.intermediate);
  KAKEYA_CHECK(o.qkv >= o.hidden && o.qkv <= 65536 && o.qkv % 16 == 0,
               "bench chain: --qkv expected a multiple of 16 in [--hidden " << o.hidden << ", 65536], got " << o.qkv);
  // The longer chain's launches (two a link for the MLP) must fit one persistent program (4,096).
  KAKEYA_CHECK(o.links >= 8 && o.links <= 1000, "bench chain: --links expected in [8, 1000], got " << o.links);
  KAKEYA_CHECK(o.repeats >= 3, "bench chain: --repeats expected at least 3, got " << o.repeats);
  KAKEYA_CHECK(o.vocab >= 1024 && o.vocab <= 1048576,
               "bench chain: --vocab expected in [1024, 1048576], got " << o.vocab);
#ifndef KAKEYA_CUDA
  throw Error("bench chain: this build has no CUDA (configure with -DKAKEYA_CUDA=ON)");
#else
  const int64_t H = o.hidden, I = o.intermediate, Q = o.qkv;
  const at::Device dev = o.device;
  c10::cuda::CUDAGuard device_guard(dev);
  // Graph capture needs a stream other than the default one; the replays run on it too.
  c10::cuda::CUDAStreamGuard stream_guard(c10::cuda::getStreamFromPool());
  at::Generator gen = at::globalContext().defaultGenerator(at::kCPU).clone();
  gen.set_current_seed(1);
  auto rnd = [&](std::vector<int64_t> shape, double scale, at::ScalarType dt) {
    return (at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat)) * scale).to(dev, dt);
  };
  // Weights drawn so a row keeps its size along the chain (values do not change a link's time).
  const at::Tensor w_sq = rnd({H, H}, 1.0 / std::sqrt((double)H), at::kBFloat16);  // [H, H]
  const at::Tensor w_gu = rnd({2 * I, H}, 1.0 / std::sqrt((double)H), at::kBFloat16);  // [2I, H]: gate; up
  const at::Tensor w_down = rnd({H, I}, 2.0 / std::sqrt((double)I), at::kBFloat16);  // [H, I]
  const at::Tensor w_qkv = rnd({Q, H}, 1.0 / std::sqrt((double)H), at::kBFloat16);  // [Q, H]
  const at::Tensor w_norm = rnd({H}, 0.1, at::kFloat), w_post = rnd({H}, 0.1, at::kFloat);  // [H] f32
  // The greedy head: the step's largest read (Gemma 3 270M's is 262,144 x 640, 335 MB in bf16).
  const at::Tensor w_head = rnd({o.vocab, H}, 1.0 / std::sqrt((double)H), at::kBFloat16);  // [V, H]
  const ops::HeadScreen screen = ops::make_head_screen(w_head);
  ops::NormSpec ns;
  ns.unit_offset = true;  // Gemma's norms
  ops::Linear sq, qkv, gate_up;
  sq.w = w_sq;
  qkv.w = w_qkv;
  gate_up.w = w_gu;
  gate_up.gated = gate_up.gelu_tanh = true;
  // The step's two residual steps: folded into the GEMV that reads their pre-norm (one kernel), or
  // a residual kernel then that GEMV. A wider output's first H values are the next link's row.
  const auto first_h = [H](const at::Tensor& y) { return y.slice(-1, 0, H); };  // [1, H], contiguous
  const auto folded = [&](const ops::Linear& lin) {
    return [&, lin](const Rows& r) {
      auto [h, y] = ops::add_rms_norm_linear(r.h, r.x, w_post, w_norm, ns, lin);
      return Rows{h, first_h(y)};
    };
  };
  const auto unfolded = [&](const ops::Linear& lin) {
    return [&, lin](const Rows& r) {
      auto [h, y] = ops::add_rms_norm(r.h, r.x, w_post, w_norm, ns);
      return Rows{h, first_h(lin.gated ? ops::linear_act_mul(y, lin.w, lin.bias, lin.gelu_tanh) : ops::linear(y, lin.w))};
    };
  };
  // The step's bookkeeping kernel: one block, a few integers, the least a launch of the step does.
  const auto i64 = at::TensorOptions().device(dev).dtype(at::kLong);
  const at::Tensor next = at::full({1}, 7, i64);  // [1]
  at::Tensor out = at::zeros({2 * o.links + 1}, i64), step = at::zeros({1}, i64), cur = at::zeros({1, 1}, i64),
             pos = at::zeros({1}, i64);
  const auto rows_x = [](const Rows& r) { return r.x; };
  // A head link's token picks the next link's row (a row of the head itself), as the step's token
  // picks its next embedding: each link waits for the one before.
  at::Tensor token = at::zeros({1}, i64);  // [1]
  const auto head = [&](const ops::HeadScreen* scr) {
    return [&, scr](const Rows& r) {
      ops::linear_argmax(r.x, w_head, token, scr);
      return Rows{r.h, w_head.index_select(0, token)};
    };
  };
  const auto rows_token = [&](const Rows&) { return token; };
  const std::vector<Chain> chains{
      {"bookkeeping", "the step's bookkeeping (out[step] = next, step += 1, ...): one block, the least a launch does", 1,
       [&](const Rows& r) {
         ops::advance_step(next, out, step, cur, pos);
         return r;
       },
       [&] {
         step.zero_();
         out.zero_();
       },
       [&](const Rows&) { return at::cat({out, step}); }},
      {"gemv", "one-row GEMV, H x H", 1, [&](const Rows& r) { return Rows{r.h, ops::linear(r.x, w_sq)}; }, {}, rows_x},
      {"residual-gemv", "residual step + RMS norm + one-row GEMV H x H, one kernel", 1, folded(sq), {}, rows_x},
      {"residual-step", "residual step + RMS norm alone (one block): the unfolded path's first kernel", 1,
       [&](const Rows& r) {
         auto [h, y] = ops::add_rms_norm(r.h, r.x, w_post, w_norm, ns);
         return Rows{h, y};
       },
       {}, rows_x},
      {"residual,gemv", "the residual step, then the GEMV H x H, as two kernels", 2, unfolded(sq), {}, rows_x},
      {"residual-qkv", "residual step + RMS norm + GEMV H -> qkv (the step's q/k/v shape), one kernel", 1, folded(qkv),
       {}, rows_x},
      {"residual,qkv", "the residual step, then the GEMV H -> qkv, as two kernels (as the step runs them)", 2,
       unfolded(qkv), {}, rows_x},
      {"residual-gate-up", "the step's gate/up kind: residual step + RMS norm + gated GEMV H -> 2I -> I, one kernel", 1,
       folded(gate_up), {}, rows_x},
      {"residual,gate-up", "the residual step, then the gated GEMV H -> 2I -> I, as two kernels", 2,
       unfolded(gate_up), {}, rows_x},
      {"mlp", "gated gate/up GEMV (H -> 2I -> I) then down GEMV (I -> H): the step's MLP", 2,
       [&](const Rows& r) {
         return Rows{r.h, ops::linear(ops::linear_act_mul(r.x, w_gu, {}, /*gelu_tanh=*/true), w_down)};
       },
       {}, rows_x},
      {"head", "the greedy lm_head V x H and its argmax (2 kernels) + the token's row (1)", 3, head(nullptr), {},
       rows_token, false},
      {"head-screen", "the same through the int8 screen (2 kernels) + the token's row (1)", 3, head(&screen),
       [&] { screen.summed.zero_(); }, rows_token, false,
       [&](nlohmann::json& row) {  // the rows the screen let through, summed again exactly
         row["rows_summed_per_link"] = (double)screen.summed.item<int>() / (double)(2 * o.links);
       }},
  };
  const Rows in{rnd({1, H}, 1.0, at::kBFloat16), rnd({1, H}, 1.0, at::kBFloat16)};  // [1, H] each
  nlohmann::json rows = nlohmann::json::array();
  for (const Chain& c : chains) {
    std::fprintf(stderr, "[bench chain] %s: %lld and %lld links, kernels then persistent\n", c.name,
                 (long long)o.links, (long long)(2 * o.links));
    nlohmann::json row = {{"chain", c.name}, {"what", c.what}, {"launches_per_link", c.launches_per_link}};
    at::Tensor final_x[2];  // each strategy's result after the longer chain
    for (const bool persistent : {false, true}) {
      if (persistent && !c.persistent) break;
      Captured shorter = capture_chain(c, in, o.links, persistent, dev);
      Captured longer = capture_chain(c, in, 2 * o.links, persistent, dev);
      const double t1 = median_replay(*shorter.graph, o.repeats), t2 = median_replay(*longer.graph, o.repeats);
      const std::string key = persistent ? "persistent" : "kernels";
      row[key + "_us_per_link"] = (t2 - t1) / (double)o.links * 1e6;
      row[key + "_replay_us"] = {t1 * 1e6, t2 * 1e6};
      if (persistent) row["persistent_step"] = longer.program->summary();
      longer.graph->replay();  // the state the result reads is this chain's (bookkeeping shares its tensors)
      final_x[persistent] = c.result(longer.out).clone();
      if (!persistent && c.report) c.report(row);
    }
    if (!c.persistent) {
      rows.push_back(row);
      continue;
    }
    row["outputs_equal"] = same_bits(final_x[0], final_x[1]);
    KAKEYA_CHECK(row["outputs_equal"].get<bool>(),
                 "bench chain: chain '" << c.name << "': the persistent program's output differs from the kernels'");
    rows.push_back(row);
  }
  const int idx = dev.has_index() ? dev.index() : at::cuda::current_device();
  return {{"bench", "chain"},
          {"device_name", at::cuda::getDeviceProperties(idx)->name},
          {"dtype", "bf16"},
          {"hidden", H},
          {"intermediate", I},
          {"qkv", Q},
          {"vocab", o.vocab},
          {"links", o.links},
          {"repeats", o.repeats},
          {"chains", rows}};
#endif
}

std::string bench_chain_table(const nlohmann::json& report) {
  std::string s;
  char line[256];
  std::snprintf(line, sizeof line, "%-17s %8s %18s %21s  %s\n", "chain", "launches", "kernels us/link",
                "persistent us/link", "what");
  s += line;
  for (const auto& r : report.at("chains")) {
    char persistent[32] = "-";  // a chain the persistent program does not run
    if (r.contains("persistent_us_per_link"))
      std::snprintf(persistent, sizeof persistent, "%.2f", r.at("persistent_us_per_link").get<double>());
    std::snprintf(line, sizeof line, "%-17s %8d %18.2f %21s  %s\n", r.at("chain").get<std::string>().c_str(),
                  r.at("launches_per_link").get<int>(), r.at("kernels_us_per_link").get<double>(), persistent,
                  r.at("what").get<std::string>().c_str());
    s += line;
  }
  return s;
}

}  // namespace kakeya
