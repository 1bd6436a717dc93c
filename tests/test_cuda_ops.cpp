// The fused CUDA kernels (core/kernels/cuda/decode_kernels.cuh) against the plain
// LibTorch reference over odd sizes, f32 and bf16 (label gpu: runs on the GPU
// machine only; CI builds without CUDA).
#include <ATen/ATen.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <tuple>

#include "core/io/fs.h"
#include "core/kernels/ops.h"
#include "core/model/rope.h"
#include "core/io/safetensors.h"

using namespace kakeya;

namespace {

const at::Device kCuda(at::kCUDA, 0);

// Whether rows of D values take `code` (check_row_code refuses the rest, tested on the CPU).
bool code_fits(int64_t D, const ops::RowCode& code) {
  try {
    ops::check_row_code(D, code, "test");
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// f32: 1e-5 relative to the tensor's scale. bf16: `steps` rounding steps of the
// larger value (2^-7 relative each) — the kernel and PyTorch may round a float
// that sits on a bf16 tie differently after a different summation order.
void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what, int steps = 1) {
  auto g = got.to(at::kCPU, at::kFloat), w = want.to(at::kFloat);
  ASSERT_EQ(g.sizes(), w.sizes()) << what;
  auto err = (g - w).abs();
  if (want.scalar_type() == at::kBFloat16) {
    double scale = w.abs().max().item<double>() + 1e-6;
    auto tol = at::maximum(g.abs(), w.abs()) * (steps / 128.0) + 1e-5 * scale;
    EXPECT_TRUE(err.le(tol).all().item<bool>()) << what << ": max err " << err.max().item<double>();
    // And nearly all elements identical: a systematic error would show here.
    EXPECT_GE(err.eq(0).to(at::kFloat).mean().item<double>(), 0.97) << what;
  } else {
    double scale = w.abs().max().item<double>() + 1e-6;
    EXPECT_LE(err.max().item<double>(), 1e-5 * scale) << what;
  }
}

class CudaOps : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_FAIL() << "no CUDA device (label gpu tests run on the GPU machine)";
    at::manual_seed(1234);
  }
  at::ScalarType dt() const { return GetParam(); }
};

TEST_P(CudaOps, RmsNorm) {
  for (int64_t H : {7, 640, 1000})
    for (bool unit : {true, false}) {
      auto x = at::randn({3, 2, H}).to(dt());
      auto w = at::randn({H}) * 0.3;
      if (!unit) w = w.to(dt()).to(at::kFloat);
      ops::NormSpec ns{1e-6, unit};
      expect_close(ops::rms_norm(x.to(kCuda), w.to(kCuda), ns), ops::rms_norm(x, w, ns),
                   "rms_norm H=" + std::to_string(H));
    }
}

TEST_P(CudaOps, AddRmsNorm) {
  for (int64_t H : {5, 640, 1111})
    for (bool post : {true, false}) {
      auto h = at::randn({2, 3, H}).to(dt()), x = at::randn({2, 3, H}).to(dt());
      auto wp = post ? at::randn({H}) * 0.2 + 1 : at::Tensor(), wn = at::randn({H}) * 0.2 + 1;
      ops::NormSpec ns{1e-6, true};
      auto [h_ref, y_ref] = ops::add_rms_norm(h, x, wp, wn, ns);
      auto [h_got, y_got] = ops::add_rms_norm(h.to(kCuda), x.to(kCuda), post ? wp.to(kCuda) : wp, wn.to(kCuda), ns);
      expect_close(h_got, h_ref, "add_rms_norm h H=" + std::to_string(H));
      expect_close(y_got, y_ref, "add_rms_norm y H=" + std::to_string(H));
    }
}

// The forward's first rows (embedding × the model's scale, then the first pre-norm) in one
// kernel: h exactly the reference's (a gather and one rounded product), x as rms_norm's; and the
// bits of the CUDA ops it replaces.
TEST_P(CudaOps, EmbedRmsNorm) {
  for (int64_t H : {5, 640, 1111}) {
    auto table = at::randn({50, H}).to(dt());
    auto ids = at::tensor(std::vector<int64_t>{3, 0, 49, 3, 17, 8}, at::kLong).view({2, 3});
    auto scale = at::scalar_tensor(std::sqrt((double)H), at::kFloat).to(dt());
    auto w = at::randn({H}) * 0.2 + 1;
    ops::NormSpec ns{1e-6, true};
    auto [h_ref, x_ref] = ops::embed_rms_norm(table, ids, scale, w, ns);
    auto tc = table.to(kCuda), sc = scale.to(kCuda), wc = w.to(kCuda);
    auto [h_got, x_got] = ops::embed_rms_norm(tc, ids.to(kCuda), sc, wc, ns);
    const std::string tag = "embed_rms_norm H=" + std::to_string(H);
    ASSERT_EQ(h_got.sizes().vec(), (std::vector<int64_t>{2, 3, H})) << tag;
    EXPECT_TRUE(h_got.cpu().equal(h_ref)) << tag;
    expect_close(x_got, x_ref, tag + " x");
    auto h_two = at::embedding(tc, ids.to(kCuda)) * sc;
    EXPECT_TRUE(h_got.equal(h_two) && x_got.equal(ops::rms_norm(h_two, wc, ns))) << tag << ": not the two ops' bits";
  }
}

// A KV cache's slot positions in one kernel: index_copy_'s results, for a ring and for no ring.
TEST(CudaOpsStep, StorePositions) {
  if (!at::hasCUDA()) GTEST_FAIL() << "no CUDA device (label gpu tests run on the GPU machine)";
  for (int64_t ring : {0, 7})
    for (int64_t first : {0, 12}) {
      auto dst = at::full({20}, -1, at::kLong);
      auto positions = at::arange(first, first + (ring > 0 ? ring : 5), at::kLong);
      auto got = dst.to(kCuda);
      ops::store_positions(got, positions.to(kCuda), ring);
      ops::store_positions(dst, positions, ring);
      auto want = at::full({20}, -1, at::kLong).index_copy_(0, ring > 0 ? positions.remainder(ring) : positions, positions);
      EXPECT_TRUE(dst.equal(want)) << "CPU, ring " << ring;
      EXPECT_TRUE(got.cpu().equal(want)) << "CUDA, ring " << ring << ", first " << first;
    }
}

// A decode step's bookkeeping in one kernel: the four ATen ops' results.
TEST(CudaOpsStep, AdvanceStep) {
  if (!at::hasCUDA()) GTEST_FAIL() << "no CUDA device (label gpu tests run on the GPU machine)";
  auto o = at::TensorOptions().dtype(at::kLong);
  auto next = at::tensor(std::vector<int64_t>{4242}, o), out = at::arange(6, o), step = at::tensor(std::vector<int64_t>{2}, o);
  auto cur = at::zeros({1, 1}, o), pos = at::tensor(std::vector<int64_t>{100}, o);
  auto n_c = next.to(kCuda), out_c = out.to(kCuda), step_c = step.to(kCuda), cur_c = cur.to(kCuda), pos_c = pos.to(kCuda);
  ops::advance_step(next, out, step, cur, pos);
  ops::advance_step(n_c, out_c, step_c, cur_c, pos_c);
  EXPECT_EQ(out[2].item<int64_t>(), 4242);
  EXPECT_TRUE(out_c.cpu().equal(out) && step_c.cpu().equal(step) && cur_c.cpu().equal(cur) && pos_c.cpu().equal(pos));
  EXPECT_EQ(step.item<int64_t>(), 3);
  EXPECT_EQ(pos.item<int64_t>(), 101);
  EXPECT_EQ(cur.item<int64_t>(), 4242);
}

// The residual step that also stores its new residual rows into a ring of per-position rows
// (the drafter's target features in restored steps): same h', y as without, ring rows at
// position mod R and columns col.. equal h' rows, every other ring element untouched.
TEST_P(CudaOps, AddRmsNormCopiesRows) {
  const int64_t H = 640, T = 3, R = 5, F = 3 * H;
  auto h = at::randn({1, T, H}).to(dt()), x = at::randn({1, T, H}).to(dt());
  auto wp = at::randn({H}) * 0.2 + 1, wn = at::randn({H}) * 0.2 + 1;
  ops::NormSpec ns{1e-6, true};
  auto pos = at::tensor(std::vector<int64_t>{7, 8, 11}, at::kLong);  // rows 2, 3, 1 of R = 5
  auto ring_ref = at::randn({R, F}).to(dt());
  auto ring0 = ring_ref.clone();
  ops::RowCopy c_ref{ring_ref, H, pos};
  auto [h_ref, y_ref] = ops::add_rms_norm(h, x, wp, wn, ns, &c_ref);
  EXPECT_TRUE(ring_ref.narrow(1, H, H).index_select(0, pos.remainder(R)).equal(h_ref.view({T, H})));
  auto ring = ring0.to(kCuda);
  ops::RowCopy c{ring, H, pos.to(kCuda)};
  auto [h_got, y_got] = ops::add_rms_norm(h.to(kCuda), x.to(kCuda), wp.to(kCuda), wn.to(kCuda), ns, &c);
  auto [h_plain, y_plain] = ops::add_rms_norm(h.to(kCuda), x.to(kCuda), wp.to(kCuda), wn.to(kCuda), ns);
  EXPECT_TRUE(h_got.equal(h_plain) && y_got.equal(y_plain)) << "the copy changed the step's outputs";
  expect_close(h_got, h_ref, "h'");
  EXPECT_TRUE(ring.narrow(1, H, H).index_select(0, pos.remainder(R).to(kCuda)).equal(h_got.view({T, H})));
  auto untouched = at::ones({R, F}, at::kBool);
  untouched.narrow(1, H, H).index_fill_(0, pos.remainder(R), false);
  EXPECT_TRUE(ring.cpu().masked_select(untouched).equal(ring0.masked_select(untouched)));
}

TEST_P(CudaOps, ActMul) {
  for (int64_t I : {3, 2048, 1001})
    for (bool gelu : {true, false}) {
      auto gu = (at::randn({2, 5, 2 * I}) * 3).to(dt());
      expect_close(ops::act_mul(gu.to(kCuda), gelu), ops::act_mul(gu, gelu), "act_mul I=" + std::to_string(I));
    }
}

// Reference: split, per-head RMSNorm, RoPE, store at position mod ring (the unfused path of
// Model::forward; ring < S: a restored layer's exact ring, whose restored region must stay untouched).
TEST_P(CudaOps, QkNormRopeStore) {
  // Gemma 4 cases: v_norm (a scale-free RMS norm of v, unit_offset off), and K=V layers (no v
  // rows: V is the raw k head, then v_norm) with a partial proportional RoPE and D 512.
  // per_row: positions [B, T], each row at its own (a batch of sessions, KVCacheOptions::rows).
  struct Case {
    int64_t Hq, Hkv, D, S, T;
    double partial;
    bool norm;
    int64_t ring;
    bool v_norm = false, k_eq_v = false, per_row = false;
  };
  for (auto c : {Case{4, 1, 256, 70, 1, 1.0, true, 0}, Case{6, 2, 64, 37, 5, 1.0, false, 0},
                 Case{4, 2, 128, 33, 3, 0.25, true, 0}, Case{4, 1, 256, 90, 4, 1.0, true, 13},
                 Case{16, 8, 256, 40, 1, 1.0, true, 0, true, false}, Case{16, 2, 512, 41, 3, 0.25, true, 0, true, true},
                 Case{4, 1, 128, 29, 5, 0.5, true, 0, false, true}, Case{4, 1, 256, 70, 1, 1.0, true, 0, false, false, true},
                 Case{6, 2, 64, 37, 3, 1.0, false, 13, false, false, true},
                 Case{16, 2, 512, 41, 2, 0.25, true, 0, true, true, true}}) {
    const int64_t ring = c.ring > 0 ? c.ring : c.S;
    RopeParams rp;
    rp.type = c.partial < 1 ? "proportional" : "default";
    rp.partial_rotary_factor = c.partial;
    rp.theta = 10000;
    const int64_t B = 2, P = 100;
    RopeTable rope(rp, c.D, P, dt(), at::kCPU);
    RopeTable rope_gpu(rp, c.D, P, dt(), kCuda);
    auto qkv = at::randn({B, c.T, (c.Hq + (c.k_eq_v ? 1 : 2) * c.Hkv) * c.D}).to(dt());
    // Rows at different positions (per_row), else both at 40...
    auto positions = c.per_row ? at::stack({at::arange(40, 40 + c.T, at::kLong), at::arange(7, 7 + c.T, at::kLong)})
                               : at::arange(40, 40 + c.T, at::kLong);
    auto row_pos = [&](int64_t b) { return c.per_row ? positions.select(0, b) : positions; };
    auto qw = at::randn({c.D}) * 0.2 + 1, kw = at::randn({c.D}) * 0.2 + 1;
    ops::NormSpec ns{1e-6, !c.v_norm};  // Gemma 4 (v_norm) norms x̂·w with no unit offset
    if (c.v_norm) {  // ... and holds its norm weights in the model dtype
      qw = qw.to(dt()).to(at::kFloat);
      kw = kw.to(dt()).to(at::kFloat);
    }
    auto vw = at::ones({c.D});
    // Reference.
    const int64_t qd = c.Hq * c.D, kvd = c.Hkv * c.D;
    auto q = qkv.slice(-1, 0, qd).view({B, c.T, c.Hq, c.D});
    auto k = qkv.slice(-1, qd, qd + kvd).view({B, c.T, c.Hkv, c.D});
    auto v = c.k_eq_v ? k : qkv.slice(-1, qd + kvd).view({B, c.T, c.Hkv, c.D});
    if (c.v_norm) v = ops::rms_norm(v, vw, ns);
    if (c.norm) { q = ops::rms_norm(q, qw, ns); k = ops::rms_norm(k, kw, ns); }
    auto q_ref = at::empty_like(q);
    auto kc_ref = at::zeros({B, c.Hkv, c.S, c.D}, dt()), vc_ref = at::zeros({B, c.Hkv, c.S, c.D}, dt());
    for (int64_t b = 0; b < B; ++b) {
      q_ref.narrow(0, b, 1).copy_(rope.apply(q.narrow(0, b, 1), row_pos(b)));
      kc_ref.narrow(0, b, 1).index_copy_(2, row_pos(b).remainder(ring),
                                          rope.apply(k.narrow(0, b, 1), row_pos(b)).transpose(1, 2));
      vc_ref.narrow(0, b, 1).index_copy_(2, row_pos(b).remainder(ring), v.narrow(0, b, 1).transpose(1, 2));
    }
    // Kernel.
    ops::QKRopeArgs a{c.Hq, c.Hkv, c.D, ns, c.norm ? qw.to(kCuda) : at::Tensor(), c.norm ? kw.to(kCuda) : at::Tensor(),
                      rope_gpu.cos(), rope_gpu.sin(), c.ring};
    if (c.v_norm) a.v_norm = vw.to(kCuda);
    a.v_from_k = c.k_eq_v;
    auto kc = at::zeros({B, c.Hkv, c.S, c.D}, at::TensorOptions().dtype(dt()).device(kCuda)), vc = at::zeros_like(kc);
    auto q_got = ops::qk_norm_rope_store(qkv.to(kCuda), positions.to(kCuda), a, kc, vc);
    std::string tag = "D=" + std::to_string(c.D) + " T=" + std::to_string(c.T) + " ring=" + std::to_string(ring) +
                      (c.v_norm ? " v_norm" : "") + (c.k_eq_v ? " K=V" : "") + (c.per_row ? " per row" : "");
    expect_close(q_got, q_ref, "q " + tag);
    expect_close(kc, kc_ref, "k cache " + tag);
    expect_close(vc, vc_ref, "v cache " + tag);
  }
}

// Restoration's store (ops::RestoreStore): several layers in one launch, each a restored region
// (a strided view behind the exact ring of its own buffer, with its own ring sizes, norm
// weights and RoPE table), its raw rows at its own columns of the k/v rows (not in layer
// order), attention sinks copied from the exact ring instead of computed: what
// Restorer::restore_kernel asks of it. Reference per layer: norm + RoPE, exact copies for
// sinks, index_copy_ at ring + position mod rest; the exact rings must stay untouched.
TEST_P(CudaOps, RestoreStoreLayersWithSinks) {
  struct Layer { int64_t ring, rest; double partial; int64_t col; };
  struct Case { int64_t Hkv, D, sink; std::vector<Layer> layers; };
  for (const auto& c : {Case{1, 256, 4, {{11, 23, 1.0, 2}, {7, 16, 0.25, 0}, {13, 19, 1.0, 1}}},
                        Case{2, 64, 3, {{7, 9, 1.0, 1}, {5, 21, 1.0, 0}}}, Case{3, 128, 0, {{5, 19, 0.5, 0}}}}) {
    const int64_t P = 100, kvd = c.Hkv * c.D, NL = (int64_t)c.layers.size();
    // Odd positions, some below the sink count, no two on one slot of any restored region above
    // (mod 9, 16, 19, 21, 23) and none of the sinks on one exact-ring slot (mod 5, 7, 11, 13).
    auto positions = at::tensor(std::vector<int64_t>{2, 0, 13, 5, 1, 30, 8}, at::kLong);
    const int64_t N = positions.numel();
    auto k_raw = at::randn({N, NL * kvd + 3}).to(dt()), v_raw = at::randn({N, NL * kvd + 5}).to(dt());
    ops::NormSpec ns{1e-6, true};
    std::vector<ops::RestoreStore::Layer> layers;
    std::vector<at::Tensor> gks, gvs, want_ks, want_vs;
    std::vector<RopeTable> ropes;  // the device tables the descriptors point to stay alive
    for (const auto& L : c.layers) {
      RopeParams rp;
      rp.type = L.partial < 1 ? "proportional" : "default";
      rp.partial_rotary_factor = L.partial;
      rp.theta = 10000;
      RopeTable rope(rp, c.D, P, dt(), at::kCPU);
      ropes.emplace_back(rp, c.D, P, dt(), kCuda);
      auto kw = at::randn({c.D}) * 0.2 + 1;
      auto buf_k = at::randn({1, c.Hkv, L.ring + L.rest, c.D}).to(dt()), buf_v = at::randn_like(buf_k);
      // Reference.
      const int64_t k0 = L.col * kvd + 1, v0 = L.col * kvd + 2;  // columns off the layer grid
      auto k = ops::rms_norm(k_raw.slice(-1, k0, k0 + kvd).view({1, N, c.Hkv, c.D}), kw, ns);
      auto k_ref = rope.apply(k, positions).transpose(1, 2);                                // [1, H, N, D]
      auto v_ref = v_raw.slice(-1, v0, v0 + kvd).view({1, N, c.Hkv, c.D}).transpose(1, 2);  // [1, H, N, D]
      auto is_sink = positions.lt(c.sink).view({1, 1, N, 1});
      auto exact_slot = positions.remainder(L.ring);
      k_ref = at::where(is_sink, buf_k.index_select(2, exact_slot), k_ref);
      v_ref = at::where(is_sink, buf_v.index_select(2, exact_slot), v_ref);
      auto want_k = buf_k.clone(), want_v = buf_v.clone();
      want_k.index_copy_(2, positions.remainder(L.rest) + L.ring, k_ref);
      want_v.index_copy_(2, positions.remainder(L.rest) + L.ring, v_ref);
      want_ks.push_back(want_k);
      want_vs.push_back(want_v);
      // The store's view of one device buffer.
      auto gk = buf_k.to(kCuda), gv = buf_v.to(kCuda);
      gks.push_back(gk);
      gvs.push_back(gv);
      ops::RestoreStore::Layer R;
      R.k_src = k0;
      R.v_src = v0;
      R.args.num_kv_heads = c.Hkv;
      R.args.head_dim = c.D;
      R.args.norm = ns;
      R.args.k_norm = kw.to(kCuda);
      R.args.cos = ropes.back().cos();
      R.args.sin = ropes.back().sin();
      R.args.ring = L.rest;
      R.args.sink = c.sink;
      R.args.sink_ring = L.ring;
      R.args.sink_k = gk.narrow(2, 0, L.ring);
      R.args.sink_v = gv.narrow(2, 0, L.ring);
      R.k_cache = gk.narrow(2, L.ring, L.rest);
      R.v_cache = gv.narrow(2, L.ring, L.rest);
      layers.push_back(std::move(R));
    }
    ops::RestoreStore store(std::move(layers));
    store.run(k_raw.to(kCuda), v_raw.to(kCuda), positions.to(kCuda));
    for (int64_t i = 0; i < NL; ++i) {
      std::string tag = "D=" + std::to_string(c.D) + " Hkv=" + std::to_string(c.Hkv) + " sink=" +
                        std::to_string(c.sink) + " layer " + std::to_string(i);
      expect_close(gks[i], want_ks[i], "k buffer " + tag);
      expect_close(gvs[i], want_vs[i], "v buffer " + tag);
    }
  }
}

// The N(0,1) Lloyd-Max distortion of a rotated code's levels (per coordinate, relative to the
// row's mean square): what decoding a rotated row may lose, with room for rounding and the norm.
// The N(0,1) distortion of a rotated code's levels: Lloyd-Max, or evenly spaced (ruB).
double rotated_distortion(const ops::RowCode& c) {
  if (c.uniform) return c.bits == 5 ? 0.0035 : c.bits == 4 ? 0.0115 : c.bits == 3 ? 0.0374 : 0.1188;
  return c.bits == 5 ? 0.0025 : c.bits == 4 ? 0.0095 : c.bits == 3 ? 0.0345 : 0.1175;
}

// A coded row against the dense one it stands for: affine codes within one step of their group,
// rotated ones within their code's distortion (relative squared error per row).
void expect_coded_like(const at::Tensor& codes, const at::Tensor& side, const ops::RowCode& code, const at::Tensor& dense,
                       const std::string& tag) {
  auto have = ops::dequantize_rows(codes, side, code, at::kFloat), want = dense.to(at::kFloat);
  if (code.rotated()) {
    auto rel = (have - want).pow(2).sum(-1) / want.pow(2).sum(-1).clamp_min(1e-12);
    // The worst row: a row of fewer values averages its error over fewer coordinates, so it
    // strays further from the mean distortion (D = 128 rows reach 2.8× it in these draws; an ru5
    // row of 256, whose evenly spaced levels clip the tails, 2.75×).
    const double worst = want.size(-1) < 256 ? 3.5 : 3.0;
    EXPECT_TRUE(rel.le(rotated_distortion(code) * worst).all().item<bool>())
        << tag << ": worst relative squared error " << rel.max().item<double>();
    EXPECT_LT(rel.mean().item<double>(), rotated_distortion(code) * 1.3) << tag;
  }
}

// RestoreStore into coded regions (--restored-code): the rows it stores are what quantize_rows
// makes of the dense rows the reference computes (above): side values and codes may differ only
// where the kernel's dense row differs from the reference's by a bf16 rounding (or, rotated, where
// a coordinate falls within rounding of a level boundary), by one step.
TEST_P(CudaOps, RestoreStoreCodedRegion) {
  for (ops::RowCode code : {ops::RowCode{ops::RowKind::Affine, 8}, {ops::RowKind::Affine, 6}, {ops::RowKind::Affine, 4},
                            {ops::RowKind::Rotated, 5}, {ops::RowKind::Rotated, 4}, {ops::RowKind::Rotated, 3},
                            {ops::RowKind::Rotated, 2},
                            {ops::RowKind::Rotated, 5, false, true}, {ops::RowKind::Rotated, 4, false, true},
                            // Split codes: V rows in other bits than K's.
                            {ops::RowKind::Rotated, 5, false, true, 3}, {ops::RowKind::Rotated, 4, false, false, 2}}) {
    for (const auto& [Hkv, D, sink] : {std::tuple<int64_t, int64_t, int64_t>{1, 256, 4}, {2, 64, 3}, {3, 128, 0}}) {
      if (!code_fits(D, code)) continue;
      const int bits = code.bits;
      const int64_t P = 100, kvd = Hkv * D, ring = 11, rest = 23;
      auto positions = at::tensor(std::vector<int64_t>{2, 0, 13, 5, 1, 30, 8}, at::kLong);
      const int64_t N = positions.numel();
      auto k_raw = at::randn({N, kvd + 3}).to(dt()), v_raw = at::randn({N, kvd + 5}).to(dt()) * 3;
      ops::NormSpec ns{1e-6, true};
      RopeParams rp;
      rp.theta = 10000;
      RopeTable rope(rp, D, P, dt(), at::kCPU), grope(rp, D, P, dt(), kCuda);
      auto kw = at::randn({D}) * 0.2 + 1;
      auto exact_k = at::randn({1, Hkv, ring, D}).to(dt()), exact_v = at::randn_like(exact_k);
      auto k = ops::rms_norm(k_raw.slice(-1, 1, 1 + kvd).view({1, N, Hkv, D}), kw, ns);
      auto k_ref = rope.apply(k, positions).transpose(1, 2);                                 // [1, H, N, D]
      auto v_ref = v_raw.slice(-1, 2, 2 + kvd).view({1, N, Hkv, D}).transpose(1, 2).contiguous();
      auto is_sink = positions.lt(sink).view({1, 1, N, 1});
      k_ref = at::where(is_sink, exact_k.index_select(2, positions.remainder(ring)), k_ref);
      v_ref = at::where(is_sink, exact_v.index_select(2, positions.remainder(ring)), v_ref);
      auto bopt = at::TensorOptions().dtype(at::kByte).device(kCuda);
      auto hopt = at::TensorOptions().dtype(at::kHalf).device(kCuda);
      ops::RestoreStore::Layer R;
      R.k_src = 1;
      R.v_src = 2;
      R.args.num_kv_heads = Hkv;
      R.args.head_dim = D;
      R.args.norm = ns;
      R.args.k_norm = kw.to(kCuda);
      R.args.cos = grope.cos();
      R.args.sin = grope.sin();
      R.args.ring = rest;
      R.args.sink = sink;
      R.args.sink_ring = ring;
      R.args.sink_k = exact_k.to(kCuda);
      R.args.sink_v = exact_v.to(kCuda);
      R.codes.code = code;
      R.codes.k_codes = at::zeros({1, Hkv, rest, ops::code_bytes(D, code.k())}, bopt);
      R.codes.v_codes = at::zeros({1, Hkv, rest, ops::code_bytes(D, code.v())}, bopt);
      R.codes.k_side = at::zeros({1, Hkv, rest, ops::side_halves(D, code)}, hopt);
      R.codes.v_side = at::zeros({1, Hkv, rest, ops::side_halves(D, code)}, hopt);
      ops::CodedSlots got = R.codes;
      ops::RestoreStore store({R});
      store.run(k_raw.to(kCuda), v_raw.to(kCuda), positions.to(kCuda));
      const auto slot = positions.remainder(rest);
      for (int kv = 0; kv < 2; ++kv) {
        const std::string tag = std::string(kv ? "v " : "k ") + ops::row_code_name(code) + " D=" + std::to_string(D);
        const ops::RowCode half = kv ? code.v() : code.k();
        auto [want_c, want_s] = ops::quantize_rows(kv ? v_ref : k_ref, half);  // [1, H, N, .]
        auto gc = (kv ? got.v_codes : got.k_codes).cpu().index_select(2, slot);
        auto gs = (kv ? got.v_side : got.k_side).cpu().index_select(2, slot);
        const bool f32 = dt() == at::kFloat;
        EXPECT_GE(gc.eq(want_c).to(at::kFloat).mean().item<double>(), f32 ? 0.99 : 0.95) << tag;
        expect_coded_like(gc, gs, half, kv ? v_ref : k_ref, tag);
        if (code.rotated()) continue;
        auto want = ops::dequantize_rows(want_c, want_s, half, at::kFloat);
        auto have = ops::dequantize_rows(gc, gs, half, at::kFloat);
        auto step = want_s.view({1, Hkv, N, D / 32, 2}).select(-1, 0).to(at::kFloat).repeat_interleave(32, -1).view_as(want);
        auto err = (have - want).abs();
        EXPECT_TRUE(err.le(step * 1.01 + want.abs() * (f32 ? 1e-4 : 2e-2) + 1e-4).all().item<bool>())
            << tag << ": max err " << err.max().item<double>();
      }
    }
  }
}

// RestoreStore::copy (exact restoration): every position's region row is its exact ring row, for
// dense regions as it is, for coded ones what quantize_rows makes of it; nothing else moves.
TEST_P(CudaOps, RestoreStoreCopiesFromTheExactRing) {
  for (ops::RowCode code : {ops::RowCode{}, ops::RowCode{ops::RowKind::Affine, 8}, {ops::RowKind::Affine, 6}, {ops::RowKind::Affine, 4},
                            {ops::RowKind::Rotated, 5}, {ops::RowKind::Rotated, 4, false, true},
                            {ops::RowKind::Rotated, 5, false, true, 3}}) {
    for (const auto& [Hkv, D, sink] : {std::tuple<int64_t, int64_t, int64_t>{1, 256, 4}, {2, 64, 0}, {3, 128, 2}}) {
      if (code.defined() && !code_fits(D, code)) continue;
      const int64_t P = 100, ring = 11, rest = 23;
      // Positions past the sink count and below it, none two on one region or ring slot.
      auto positions = at::tensor(std::vector<int64_t>{2, 0, 13, 5, 1, 30, 8, 17}, at::kLong);
      const int64_t N = positions.numel();
      RopeParams rp;
      rp.theta = 10000;
      RopeTable grope(rp, D, P, dt(), kCuda);
      auto buf_k = at::randn({1, Hkv, ring + rest, D}).to(dt()), buf_v = at::randn_like(buf_k) * 3;
      auto gk = buf_k.to(kCuda), gv = buf_v.to(kCuda);
      ops::RestoreStore::Layer R;
      R.args.num_kv_heads = Hkv;
      R.args.head_dim = D;
      R.args.norm = ops::NormSpec{1e-6, true};
      R.args.k_norm = (at::randn({D}) * 0.2 + 1).to(kCuda);
      R.args.cos = grope.cos();
      R.args.sin = grope.sin();
      R.args.ring = rest;
      R.args.sink = sink;
      R.args.sink_ring = ring;
      R.args.sink_k = gk.narrow(2, 0, ring);
      R.args.sink_v = gv.narrow(2, 0, ring);
      auto bopt = at::TensorOptions().dtype(at::kByte).device(kCuda);
      auto hopt = at::TensorOptions().dtype(at::kHalf).device(kCuda);
      if (code.defined()) {
        R.codes.code = code;
        R.codes.k_codes = at::zeros({1, Hkv, rest, ops::code_bytes(D, code.k())}, bopt);
        R.codes.v_codes = at::zeros({1, Hkv, rest, ops::code_bytes(D, code.v())}, bopt);
        R.codes.k_side = at::zeros({1, Hkv, rest, ops::side_halves(D, code)}, hopt);
        R.codes.v_side = at::zeros({1, Hkv, rest, ops::side_halves(D, code)}, hopt);
      } else {
        R.k_cache = gk.narrow(2, ring, rest);
        R.v_cache = gv.narrow(2, ring, rest);
      }
      ops::CodedSlots got = R.codes;
      ops::RestoreStore store({R});
      store.copy(positions.to(kCuda));
      const auto slot = positions.remainder(rest), from = positions.remainder(ring);
      const std::string tag = (code.defined() ? ops::row_code_name(code) : std::string("dense")) + " D=" + std::to_string(D) +
                              " sink=" + std::to_string(sink);
      for (int kv = 0; kv < 2; ++kv) {
        const at::Tensor& buf = kv ? buf_v : buf_k;
        auto exact = buf.narrow(2, 0, ring).index_select(2, from);  // [1, H, N, D]
        if (!code.defined()) {
          auto want = buf.clone();
          want.narrow(2, ring, rest).index_copy_(2, slot, exact);
          EXPECT_TRUE(at::equal((kv ? gv : gk).cpu(), want)) << tag << (kv ? " v" : " k") << ": region rows != exact rows";
          continue;
        }
        const ops::RowCode half = kv ? code.v() : code.k();
        auto [want_c, want_s] = ops::quantize_rows(exact, half);
        auto gc = (kv ? got.v_codes : got.k_codes).cpu().index_select(2, slot);
        auto gs = (kv ? got.v_side : got.k_side).cpu().index_select(2, slot);
        // The same dense rows in: the codes may differ only where a value sits within rounding of a
        // level boundary (the kernel and quantize_rows sum in other orders).
        EXPECT_GE(gc.eq(want_c).to(at::kFloat).mean().item<double>(), 0.99) << tag << (kv ? " v" : " k");
        expect_coded_like(gc, gs, half, exact, tag + (kv ? " v" : " k"));
      }
      EXPECT_TRUE(at::equal(gk.narrow(2, 0, ring).cpu(), buf_k.narrow(2, 0, ring))) << tag << ": exact ring written";
    }
  }
}

// Bad input to RestoreStore: layers that disagree, raw rows too narrow, a copy without exact
// rings -> a clear error.
TEST_P(CudaOps, RestoreStoreRejectsMismatches) {
  auto opt = at::TensorOptions().dtype(dt()).device(kCuda);
  RopeParams rp;
  rp.theta = 10000;
  RopeTable rope(rp, 64, 50, dt(), kCuda);
  auto layer = [&](int64_t Hkv) {
    ops::RestoreStore::Layer L;
    L.args.num_kv_heads = Hkv;
    L.args.head_dim = 64;
    L.args.cos = rope.cos();
    L.args.sin = rope.sin();
    L.k_cache = at::zeros({1, Hkv, 16, 64}, opt);
    L.v_cache = at::zeros({1, Hkv, 16, 64}, opt);
    return L;
  };
  EXPECT_THROW(ops::RestoreStore({layer(1), layer(2)}), c10::Error);
  ops::RestoreStore store({layer(1)});
  auto pos = at::arange(3, at::TensorOptions().dtype(at::kLong).device(kCuda));
  EXPECT_THROW(store.run(at::zeros({3, 32}, opt), at::zeros({3, 64}, opt), pos), c10::Error);
  EXPECT_NO_THROW(store.run(at::zeros({3, 64}, opt), at::zeros({3, 64}, opt), pos));
  EXPECT_THROW(store.copy(pos), c10::Error);                    // no exact ring to copy from
  EXPECT_ANY_THROW(store.run(at::Tensor(), at::Tensor(), pos));  // run() takes raw rows
}

// Softmax attention in f32, the decode attention tests' reference: q [B, T, Hq, D], k, v [B, Hkv, S, D]
// (any float dtype), mask [T, S] true where visible -> [B, T, Hq·D] in dt. A query that sees nothing
// gets zeros, as from the kernel (softmax gives NaN there).
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                               double scale, double softcap, at::ScalarType dt) {
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.size(1);
  auto qf = q.to(at::kFloat).permute({0, 2, 1, 3}).reshape({B, Hkv, Hq / Hkv, T, D});
  auto s = at::matmul(qf, k.to(at::kFloat).unsqueeze(2).transpose(-1, -2)) * scale;  // [B, Hkv, G, T, S]
  if (softcap > 0) s = at::tanh(s / softcap) * softcap;
  s = s.masked_fill(mask.logical_not(), -INFINITY);
  return at::nan_to_num(at::matmul(at::softmax(s, -1), v.to(at::kFloat).unsqueeze(2)), 0.0)
      .reshape({B, Hq, T, D})
      .permute({0, 2, 1, 3})
      .reshape({B, T, Hq * D})
      .to(dt);
}

// Reference: softmax attention in f32 over the whole cache with the visibility mask
// built as KVCache::visible does (causal/sliding rule, then the copy rule).
TEST_P(CudaOps, DecodeAttention) {
  struct Case {
    int64_t Hq, Hkv, D, S, window;
    double softcap;
    int64_t T;            // queries per sequence (1: a decode step; more: verify / drafter blocks)
    bool shared_qpos;     // one q_pos for all T queries (drafter blocks)
    int64_t rwin;         // copy rule: 0 = plain layer
    int64_t keep_below = -1;  // copy rule: a layer that drops restored positions >= this
  };
  for (auto c : {Case{4, 1, 256, 300, 0, 0.0, 1, false, 0}, Case{6, 2, 64, 37, 16, 0.0, 1, false, 0},
                 Case{8, 8, 128, 129, 0, 30.0, 1, false, 0}, Case{4, 2, 512, 700, 100, 0.0, 1, false, 0},
                 Case{4, 1, 256, 333, 0, 0.0, 16, false, 0}, Case{8, 1, 64, 201, 0, 0.0, 13, true, 0},
                 Case{4, 1, 256, 399, 512, 0.0, 16, false, 64}, Case{6, 3, 128, 250, 0, 0.0, 7, false, 40},
                 Case{4, 2, 64, 517, 0, 0.0, 5, false, 70}, Case{4, 1, 256, 130, 0, 0.0, 1, false, 64},
                 Case{4, 1, 256, 399, 512, 0.0, 3, false, 64, 9}, Case{6, 3, 128, 250, 0, 0.0, 1, false, 40, 77},
                 // Enough query rows x keys for full 64-key blocks (small grids take blocks of 8-32 keys).
                 Case{4, 1, 256, 2049, 0, 0.0, 16, false, 0},
                 // Several queries with a softcap; 8 query heads a KV head x 9 queries under a window.
                 Case{8, 8, 128, 129, 0, 30.0, 4, false, 0}, Case{8, 1, 64, 95, 40, 0.0, 9, false, 0},
                 // Decode steps over long caches: blocks of hundreds of keys (the grid in one wave),
                 // with and without a copy rule.
                 Case{4, 1, 256, 40003, 0, 0.0, 1, false, 0}, Case{4, 1, 256, 20011, 0, 0.0, 1, false, 64},
                 Case{8, 2, 128, 30001, 0, 0.0, 1, false, 0}}) {
    const int64_t B = 2, T = c.T;
    auto q = at::randn({B, T, c.Hq, c.D}).to(dt());
    auto k = at::randn({B, c.Hkv, c.S, c.D}).to(dt()), v = at::randn({B, c.Hkv, c.S, c.D}).to(dt());
    // Slots hold a shuffled ring of positions with a few empty ones.
    auto slot_pos = at::randperm(c.S, at::kLong) + 5;
    slot_pos.index_put_({at::arange(0, c.S, 7)}, -1);
    auto q_pos = c.shared_qpos ? at::full({1}, c.S - 3, at::kLong) : at::arange(c.S - 2 - T, c.S - 2, at::kLong);
    ops::CopyRule rule;
    if (c.rwin > 0) {
      // A random split of the slots into exact ring and restored/coded region.
      rule = {at::rand({c.S}).lt(0.5), c.rwin, 0, c.keep_below};
    }
    const double scale = 1.0 / std::sqrt((double)c.D);
    auto sp = slot_pos.unsqueeze(0), qp = q_pos.expand({T}).unsqueeze(1);  // [1, S], [T, 1]
    auto mask = sp.ge(0).logical_and(sp.le(qp));                          // [T, S]
    if (c.window) mask = mask.logical_and((qp - sp).lt(c.window));
    if (c.rwin > 0) {
      at::Tensor recent = (qp - sp).lt(c.rwin);
      mask = mask.logical_and(recent.ne(rule.in_restored.unsqueeze(0)));
      if (c.keep_below >= 0)
        mask = mask.logical_and(rule.in_restored.logical_and(slot_pos.ge(c.keep_below)).logical_not().unsqueeze(0));
    }
    auto ref = reference_attention(q, k, v, mask, scale, c.softcap, dt());
    ops::CopyRule gpu_rule = rule;
    if (rule.in_restored.defined()) gpu_rule.in_restored = rule.in_restored.to(kCuda);
    auto got = ops::decode_attention(q.to(kCuda), k.to(kCuda), v.to(kCuda), slot_pos.to(kCuda), q_pos.to(kCuda),
                                     c.window, scale, c.softcap, gpu_rule);
    expect_close(got, ref,
                 "decode_attention D=" + std::to_string(c.D) + " S=" + std::to_string(c.S) + " T=" + std::to_string(T) +
                     " rwin=" + std::to_string(c.rwin) +
                     " keep_below=" + std::to_string(c.keep_below));
  }
}

// decode_attention over rows that are independent sequences (a batch of sessions): slot
// positions [B, S] and query positions [B, T] per row. Reference: each row alone through the
// shared-position form, which the test above checks against softmax attention.
TEST_P(CudaOps, DecodeAttentionPerRow) {
  struct Case { int64_t B, Hq, Hkv, D, S, T, window; double softcap; };
  for (auto c : {Case{3, 4, 1, 256, 300, 1, 0, 0.0}, Case{5, 6, 2, 64, 37, 1, 16, 0.0}, Case{2, 8, 8, 128, 129, 4, 0, 30.0},
                 Case{7, 4, 2, 512, 71, 1, 50, 0.0}}) {
    auto o = at::TensorOptions().device(kCuda);
    auto q = at::randn({c.B, c.T, c.Hq, c.D}, o).to(dt());
    auto k = at::randn({c.B, c.Hkv, c.S, c.D}, o).to(dt()), v = at::randn({c.B, c.Hkv, c.S, c.D}, o).to(dt());
    // Each row: its own shuffled positions (a row that wrapped its ring at another step), some
    // slots empty, its own query positions.
    std::vector<at::Tensor> sp, qp;
    for (int64_t b = 0; b < c.B; ++b) {
      auto p = at::randperm(c.S, at::kLong) + 3 * b;
      p.index_put_({at::arange(b % 5, c.S, 5 + b)}, -1);
      sp.push_back(p);
      qp.push_back(at::arange(c.S - 2 - c.T - 4 * b, c.S - 2 - 4 * b, at::kLong));
    }
    const double scale = 1.0 / std::sqrt((double)c.D);
    auto slot_pos = at::stack(sp).to(kCuda), q_pos = at::stack(qp).to(kCuda);
    auto got = ops::decode_attention(q, k, v, slot_pos, q_pos, c.window, scale, c.softcap);
    for (int64_t b = 0; b < c.B; ++b) {
      auto want = ops::decode_attention(q.narrow(0, b, 1), k.narrow(0, b, 1).contiguous(), v.narrow(0, b, 1).contiguous(),
                                        slot_pos.select(0, b).contiguous(), q_pos.select(0, b).contiguous(), c.window,
                                        scale, c.softcap);
      EXPECT_TRUE(at::equal(got.narrow(0, b, 1), want))
          << "decode_attention per row B=" << c.B << " D=" << c.D << " T=" << c.T << " row " << b;
    }
  }
  auto o = at::TensorOptions().device(kCuda);
  auto q = at::randn({2, 1, 4, 64}, o).to(dt()), k = at::randn({2, 1, 9, 64}, o).to(dt());
  auto pos = at::arange(9, o.dtype(at::kLong));
  EXPECT_THROW(ops::decode_attention(q, k, k, pos.expand({3, 9}).contiguous(), pos.narrow(0, 8, 1), 0, 0.125, 0.0),
               c10::Error);  // slot positions for 3 rows, 2 in q
  EXPECT_THROW(ops::decode_attention(q, k, k, pos, at::zeros({2, 2}, o.dtype(at::kLong)), 0, 0.125, 0.0),
               c10::Error);  // 2 query positions per row for T = 1
}

// decode_attention over a layer whose restored region is coded rows: the reference decodes the
// region (dequantize_rows, f32) and attends over [ring ++ region] as above.
TEST_P(CudaOps, DecodeAttentionCodedRegion) {
  using ops::RowKind;
  struct Case { int64_t Hq, Hkv, D, ring, rows, T, window, rwin, keep_below; ops::RowCode code; int64_t code_from = 0; };
  for (auto c : {Case{4, 1, 256, 271, 511, 1, 512, 256, -1, {RowKind::Affine, 4}},
                 Case{4, 1, 256, 40, 77, 16, 0, 33, -1, {RowKind::Affine, 8}},
                 Case{6, 2, 64, 19, 45, 3, 50, 13, -1, {RowKind::Affine, 4}},
                 Case{8, 1, 128, 37, 101, 1, 0, 30, 9, {RowKind::Affine, 4}},
                 Case{4, 2, 512, 23, 59, 5, 70, 21, -1, {RowKind::Affine, 8}},
                 // int6: 6 code bytes a lane at D = 256 (two words), 3 at 128 (one or two), 12 at 512 (three).
                 Case{4, 1, 256, 271, 511, 1, 512, 256, -1, {RowKind::Affine, 6}},
                 Case{8, 1, 128, 37, 101, 16, 0, 30, 9, {RowKind::Affine, 6}},
                 Case{4, 2, 512, 23, 59, 5, 70, 21, -1, {RowKind::Affine, 6}},
                 Case{4, 1, 256, 271, 1023, 1, 0, 256, -1, {RowKind::Rotated, 3}, 4},
                 Case{4, 1, 256, 271, 515, 3, 0, 256, -1, {RowKind::Rotated, 5}, 4},
                 // Evenly spaced levels (ruB): 5 bits read by multiply-adds, 4 bits through the byte table.
                 Case{4, 1, 256, 271, 515, 3, 0, 256, -1, {RowKind::Rotated, 5, false, true}, 4},
                 Case{4, 1, 256, 271, 515, 16, 0, 256, -1, {RowKind::Rotated, 5, false, true}, 4},
                 Case{6, 2, 64, 19, 45, 3, 50, 13, -1, {RowKind::Rotated, 4, false, true}, 30},
                 Case{8, 1, 128, 37, 101, 1, 0, 30, -1, {RowKind::Rotated, 2, false, true}},
                 Case{4, 1, 256, 40, 77, 16, 0, 33, 9, {RowKind::Rotated, 4}},
                 Case{6, 2, 64, 19, 45, 3, 50, 13, -1, {RowKind::Rotated, 4}, 30},
                 Case{8, 1, 128, 37, 101, 1, 0, 30, -1, {RowKind::Rotated, 2}},
                 Case{4, 2, 512, 23, 59, 5, 70, 21, -1, {RowKind::Rotated, 3}},
                 // Weighted rows (pwB): K coded as w ⊙ (k - mean), read as decoded / w + mean.
                 Case{4, 1, 256, 271, 515, 3, 0, 256, -1, {RowKind::Rotated, 4, true}, 4},
                 Case{6, 2, 64, 19, 45, 3, 50, 13, -1, {RowKind::Rotated, 4, true}, 30},
                 Case{8, 1, 128, 37, 101, 16, 0, 30, -1, {RowKind::Rotated, 2, true}},
                 // 64-key blocks over coded rows (the grid is large enough).
                 Case{4, 1, 256, 271, 515, 16, 0, 256, -1, {RowKind::Rotated, 4, true}, 4},
                 // Decode steps over long coded histories (blocks of hundreds of keys; rotated rows past
                 // kAttnGroupCodedRows take grouped blocks, fewer one head per block).
                 Case{4, 1, 256, 64, 30011, 1, 0, 64, -1, {RowKind::Rotated, 4, true}, 4},
                 Case{4, 1, 256, 64, 9001, 1, 0, 64, -1, {RowKind::Rotated, 4, true}, 4},
                 Case{4, 1, 256, 64, 20011, 1, 0, 64, -1, {RowKind::Affine, 8}},
                 Case{4, 1, 256, 64, 20011, 1, 0, 64, -1, {RowKind::Rotated, 5, false, true}, 4},
                 // Split codes: V rows in other bits (their own level tables), K's weighted or uniform.
                 Case{4, 1, 256, 271, 515, 3, 0, 256, -1, {RowKind::Rotated, 5, true, false, 3}, 4},
                 Case{4, 1, 256, 40, 77, 16, 0, 33, 9, {RowKind::Rotated, 5, false, true, 3}},
                 Case{6, 2, 128, 19, 45, 3, 50, 13, -1, {RowKind::Rotated, 4, false, false, 2}, 30},
                 Case{8, 1, 128, 37, 101, 1, 0, 30, -1, {RowKind::Rotated, 2, false, false, 4}}}) {
    const int64_t B = 2, T = c.T, S = c.ring + c.rows;
    auto q = at::randn({B, T, c.Hq, c.D}).to(dt());
    auto k = at::randn({B, c.Hkv, S, c.D}).to(dt()), v = (at::randn({B, c.Hkv, S, c.D}) * 2).to(dt());
    // Rotated codes: rows coded less per-head means (a coded layer's session means), read back plus them.
    at::Tensor km = at::zeros({B, c.Hkv, 1, c.D}), vm = at::zeros({B, c.Hkv, 1, c.D});
    if (c.code.rotated()) {
      km = at::randn({B, c.Hkv, 1, c.D}) * 2;
      vm = at::randn({B, c.Hkv, 1, c.D});
    }
    // Weighted: per-coordinate K weights spanning 16x, as calibrated ones do.
    const at::Tensor kw = c.code.weighted ? at::exp(at::rand({B, c.Hkv, 1, c.D}) * 2.8 - 1.4) : at::ones({B, c.Hkv, 1, c.D});
    auto [kc, ks] = ops::quantize_rows((k.narrow(2, c.ring, c.rows).to(at::kFloat) - km) * kw, c.code.k());
    auto [vc, vs] = ops::quantize_rows(v.narrow(2, c.ring, c.rows).to(at::kFloat) - vm, c.code.v());
    auto kf = at::cat({k.narrow(2, 0, c.ring).to(at::kFloat), ops::dequantize_rows(kc, ks, c.code.k(), at::kFloat) / kw + km}, 2);
    auto vf = at::cat({v.narrow(2, 0, c.ring).to(at::kFloat), ops::dequantize_rows(vc, vs, c.code.v(), at::kFloat) + vm}, 2);
    // Ring slots hold recent positions, region slots older ones (as a restored layer's do), a few empty.
    auto slot_pos = at::cat({at::randperm(c.ring, at::kLong) + c.rows, at::randperm(c.rows, at::kLong)});
    slot_pos.index_put_({at::arange(0, S, 11)}, -1);
    auto q_pos = at::arange(S - T, S, at::kLong);
    auto in_restored = at::arange(S, at::kLong).ge(c.ring);
    auto sp = slot_pos.unsqueeze(0), qp = q_pos.unsqueeze(1);
    auto mask = sp.ge(0).logical_and(sp.le(qp));
    if (c.window) mask = mask.logical_and((qp - sp).lt(c.window));
    mask = mask.logical_and((qp - sp).lt(c.rwin).ne(in_restored.unsqueeze(0)));
    if (c.keep_below >= 0) mask = mask.logical_and(in_restored.logical_and(slot_pos.ge(c.keep_below)).logical_not().unsqueeze(0));
    // Coded rows below code_from are hidden (exact sinks hold them on a coded layer).
    mask = mask.logical_and(in_restored.logical_and(slot_pos.lt(c.code_from)).logical_not().unsqueeze(0));
    const double scale = 1.0 / std::sqrt((double)c.D);
    auto ref = reference_attention(q, kf, vf, mask, scale, 0.0, dt());
    ops::CopyRule rule{in_restored.to(kCuda), c.rwin, c.code_from, c.keep_below};
    rule.codes = {kc.to(kCuda), vc.to(kCuda), ks.to(kCuda), vs.to(kCuda), c.code};
    if (c.code.rotated()) {
      rule.codes.k_mean = km.squeeze(2).contiguous().to(kCuda);
      rule.codes.v_mean = vm.squeeze(2).contiguous().to(kCuda);
    }
    if (c.code.weighted) rule.codes.k_weight = kw.squeeze(2).contiguous().to(kCuda);
    auto got = ops::decode_attention(q.to(kCuda), k.narrow(2, 0, c.ring).contiguous().to(kCuda),
                                     v.narrow(2, 0, c.ring).contiguous().to(kCuda), slot_pos.to(kCuda), q_pos.to(kCuda),
                                     c.window, scale, 0.0, rule);
    expect_close(got, ref, "coded decode_attention D=" + std::to_string(c.D) + " " + ops::row_code_name(c.code) +
                               " T=" + std::to_string(T));
  }
  // A coded region whose rows do not add up to the slot positions: refused, naming the counts.
  auto q = at::randn({1, 1, 4, 64}).to(dt()).to(kCuda);
  auto k = at::randn({1, 1, 8, 64}).to(dt()).to(kCuda);
  const ops::RowCode int4{ops::RowKind::Affine, 4};
  auto [kc, ks] = ops::quantize_rows(at::randn({1, 1, 5, 64}), int4);
  ops::CopyRule rule{at::arange(12, at::kLong).ge(8).to(kCuda), 4, 0, -1};
  rule.codes = {kc.to(kCuda), kc.to(kCuda), ks.to(kCuda), ks.to(kCuda), int4};
  auto pos = at::arange(12, at::TensorOptions().dtype(at::kLong).device(kCuda));
  EXPECT_THROW(ops::decode_attention(q, k, k, pos, pos.narrow(0, 11, 1), 0, 0.125, 0.0, rule), c10::Error);
}

// decode_attention with a tail (a chunk's own keys, not in the cache yet): the same as attending
// over [cache ++ tail] with the tail's rows as exact slots. Reference: the cache's rows decoded
// (a coded region through dequantize_rows) and the tail appended, softmax attention in f32 under
// the visibility rule of the tests above. Plain layers, dense restored regions, coded regions.
TEST_P(CudaOps, DecodeAttentionTail) {
  using ops::RowKind;
  struct Case { int64_t Hq, Hkv, D, ring, rows, T, window, rwin; ops::RowCode code; };  // rwin 0: plain layer
  for (auto c : {Case{4, 1, 256, 300, 0, 64, 512, 0, {}}, Case{6, 2, 64, 37, 0, 13, 40, 0, {}},
                 Case{4, 1, 256, 64, 511, 64, 512, 64, {}}, Case{8, 2, 128, 33, 70, 31, 0, 33, {}},
                 Case{4, 1, 256, 64, 511, 64, 512, 64, {RowKind::Affine, 4}},
                 Case{4, 1, 256, 64, 511, 64, 512, 64, {RowKind::Affine, 6}},
                 Case{4, 1, 256, 64, 511, 64, 512, 64, {RowKind::Rotated, 5}},
                 Case{4, 1, 256, 64, 511, 64, 512, 64, {RowKind::Rotated, 5, false, true}},
                 Case{6, 2, 64, 19, 45, 7, 50, 19, {RowKind::Rotated, 4}}}) {
    const int64_t B = 2, T = c.T, S = c.ring + c.rows, q0 = S + 5;
    auto q = at::randn({B, T, c.Hq, c.D}).to(dt());
    auto k = at::randn({B, c.Hkv, S, c.D}).to(dt()), v = at::randn({B, c.Hkv, S, c.D}).to(dt());
    auto tk = at::randn({B, c.Hkv, T, c.D}).to(dt()), tv = at::randn({B, c.Hkv, T, c.D}).to(dt());
    // The cache: the ring holds the positions just before the chunk, the region older ones, a few
    // slots empty; the tail the chunk's positions in a rotated order (as the fused store leaves them).
    auto slot_pos = at::cat({at::randperm(c.ring, at::kLong) + (q0 - c.ring), at::randperm(c.rows, at::kLong) + (q0 - c.rows)});
    slot_pos.index_put_({at::arange(3, S, 13)}, -1);
    auto q_pos = at::arange(q0, q0 + T, at::kLong);
    auto tail_pos = at::roll(q_pos, 5);
    auto in_restored = at::arange(S, at::kLong).ge(c.ring);
    at::Tensor kf = k.to(at::kFloat), vf = v.to(at::kFloat);
    ops::CopyRule rule;
    if (c.rwin > 0) rule = {in_restored.to(kCuda), c.rwin, 0, -1};
    at::Tensor kd = k, vd = v;  // the dense slots the kernel reads
    if (c.code.defined()) {
      auto [kc, ks] = ops::quantize_rows(k.narrow(2, c.ring, c.rows).to(at::kFloat), c.code);
      auto [vc, vs] = ops::quantize_rows(v.narrow(2, c.ring, c.rows).to(at::kFloat), c.code);
      kf = at::cat({kf.narrow(2, 0, c.ring), ops::dequantize_rows(kc, ks, c.code, at::kFloat)}, 2);
      vf = at::cat({vf.narrow(2, 0, c.ring), ops::dequantize_rows(vc, vs, c.code, at::kFloat)}, 2);
      rule.codes = {kc.to(kCuda), vc.to(kCuda), ks.to(kCuda), vs.to(kCuda), c.code};
      kd = k.narrow(2, 0, c.ring).contiguous();
      vd = v.narrow(2, 0, c.ring).contiguous();
    }
    // [cache ++ tail]: the tail's slots are exact (never in a restored region).
    auto all_pos = at::cat({slot_pos, tail_pos});
    auto all_restored = at::cat({in_restored, at::zeros({T}, at::kBool)});
    auto kall = at::cat({kf, tk.to(at::kFloat)}, 2), vall = at::cat({vf, tv.to(at::kFloat)}, 2);
    auto sp = all_pos.unsqueeze(0), qp = q_pos.unsqueeze(1);
    auto mask = sp.ge(0).logical_and(sp.le(qp));
    if (c.window) mask = mask.logical_and((qp - sp).lt(c.window));
    if (c.rwin > 0) mask = mask.logical_and((qp - sp).lt(c.rwin).ne(all_restored.unsqueeze(0)));
    const double scale = 1.0 / std::sqrt((double)c.D);
    auto ref = reference_attention(q, kall, vall, mask, scale, 0.0, dt());
    auto got = ops::decode_attention(q.to(kCuda), kd.to(kCuda), vd.to(kCuda), slot_pos.to(kCuda), q_pos.to(kCuda),
                                     c.window, scale, 0.0, rule, {tk.to(kCuda), tv.to(kCuda), tail_pos.to(kCuda)});
    expect_close(got, ref, "decode_attention tail D=" + std::to_string(c.D) + " T=" + std::to_string(T) + " rwin=" +
                               std::to_string(c.rwin) + " " + ops::row_code_name(c.code));
  }
  // A tail whose shape or positions do not fit: refused, naming the tail.
  auto o = at::TensorOptions().device(kCuda);
  auto q = at::randn({1, 2, 4, 64}, o).to(dt()), k = at::randn({1, 1, 9, 64}, o).to(dt());
  auto pos = at::arange(9, o.dtype(at::kLong)), qp = at::arange(9, 11, o.dtype(at::kLong));
  auto tk = at::randn({1, 1, 2, 64}, o).to(dt());
  EXPECT_THROW(ops::decode_attention(q, k, k, pos, qp, 0, 0.125, 0.0, {}, {tk, tk, qp.narrow(0, 0, 1)}), c10::Error);
  EXPECT_THROW(ops::decode_attention(q, k, k, pos, qp, 0, 0.125, 0.0, {}, {at::randn({1, 1, 2, 32}, o).to(dt()), tk, qp}),
               c10::Error);
}

// code_rows (the coded full-attention layers' store): the rows at the given ring slots become the
// coded rows quantize_rows makes of them, at the given rows; other rows untouched; rows below the
// sink also copied to their exact slots.
TEST_P(CudaOps, CodeRows) {
  for (ops::RowCode code : {ops::RowCode{ops::RowKind::Affine, 4}, {ops::RowKind::Affine, 6}, {ops::RowKind::Rotated, 5},
                            {ops::RowKind::Rotated, 4}, {ops::RowKind::Rotated, 3}, {ops::RowKind::Rotated, 2}, {ops::RowKind::Rotated, 4, true},
                            {ops::RowKind::Rotated, 5, false, true}, {ops::RowKind::Rotated, 5, true, false, 3}}) {
    for (const auto& [Hkv, D] : {std::pair<int64_t, int64_t>{1, 256}, {2, 128}, {3, 512}, {2, 64}}) {
      if (code.defined() && !code_fits(D, code)) continue;
      const int64_t B = 2, S = 19, R = 37;
      auto k = (at::randn({B, Hkv, S, D}) * 3).to(dt()), v = at::randn({B, Hkv, S, D}).to(dt());
      auto src = at::tensor(std::vector<int64_t>{4, 0, 18, 7, 11}, at::kLong);
      auto dst = at::tensor(std::vector<int64_t>{30, 2, 36, 9, 0}, at::kLong);
      auto bopt = at::TensorOptions().dtype(at::kByte).device(kCuda);
      auto hopt = at::TensorOptions().dtype(at::kHalf).device(kCuda);
      ops::CodedSlots c;
      c.code = code;
      at::Tensor km, vm, kw;  // rotated: rows coded less these means ([B, H, D]); weighted: K times kw
      if (code.rotated()) {
        km = at::randn({B, Hkv, D}) * 2;
        vm = at::randn({B, Hkv, D});
        c.k_mean = km.to(kCuda);
        c.v_mean = vm.to(kCuda);
      }
      if (code.weighted) {
        kw = at::exp(at::rand({B, Hkv, D}) * 2.8 - 1.4);
        c.k_weight = kw.to(kCuda);
      }
      c.k_codes = at::full({B, Hkv, R, ops::code_bytes(D, code.k())}, 7, bopt);
      c.v_codes = at::full({B, Hkv, R, ops::code_bytes(D, code.v())}, 7, bopt);
      c.k_side = at::zeros({B, Hkv, R, ops::side_halves(D, code)}, hopt);
      c.v_side = at::zeros({B, Hkv, R, ops::side_halves(D, code)}, hopt);
      // Rows coded at rows 0 and 2 (< sink 3) are also copied to slots 15 + row: 15 and 17.
      auto gk = k.to(kCuda), gv = v.to(kCuda);
      ops::code_rows(gk, gv, src.to(kCuda), dst.to(kCuda), c, 3, 15);
      for (int kv = 0; kv < 2; ++kv) {
        auto want = (kv ? v : k).clone();
        want.narrow(2, 17, 1).copy_(want.narrow(2, 0, 1));   // dst 2 <- src 0
        want.narrow(2, 15, 1).copy_(want.narrow(2, 11, 1));  // dst 0 <- src 11
        EXPECT_TRUE((kv ? gv : gk).cpu().equal(want)) << "sink copies, " << ops::row_code_name(code) << " D=" << D;
      }
      for (int kv = 0; kv < 2; ++kv) {
        const std::string tag = std::string(kv ? "v " : "k ") + ops::row_code_name(code) + " D=" + std::to_string(D);
        auto dense = (kv ? v : k).index_select(2, src);
        if (code.rotated()) dense = dense.to(at::kFloat) - (kv ? vm : km).unsqueeze(2);
        if (code.weighted && !kv) dense = dense * kw.unsqueeze(2);
        const ops::RowCode half = kv ? code.v() : code.k();
        auto [want_c, want_s] = ops::quantize_rows(dense, half);
        auto gc = (kv ? c.v_codes : c.k_codes).cpu(), gs = (kv ? c.v_side : c.k_side).cpu();
        auto hc = gc.index_select(2, dst), hs = gs.index_select(2, dst);
        EXPECT_GE(hc.eq(want_c).to(at::kFloat).mean().item<double>(), 0.995) << tag;
        auto have = ops::dequantize_rows(hc, hs, half, at::kFloat), want = ops::dequantize_rows(want_c, want_s, half, at::kFloat);
        EXPECT_LT(((have - want).pow(2).sum() / want.pow(2).sum()).item<double>(), 1e-3) << tag;
        expect_coded_like(hc, hs, half, dense, tag);
        EXPECT_TRUE(gc.index_select(2, at::tensor(std::vector<int64_t>{1, 3, 35}, at::kLong)).eq(7).all().item<bool>())
            << tag << ": rows not named were written";
      }
    }
  }
}

// Coded rows decoded on the device (one warp per row; rotated rows rotated back in registers)
// against the reference ops on the host, every code and head dim the kernel takes, odd row counts.
TEST_P(CudaOps, DequantizeRows) {
  for (const char* name : {"int8", "int6", "int4", "lm5", "lm4", "lm3", "lm2", "ru5", "ru4", "ru3", "ru2"}) {
    const ops::RowCode code = ops::parse_row_code(name, "code");
    for (int64_t D : {64, 128, 256, 512}) {
      // Rotated codes need whole bytes per lane, at most 8 (CodedRows.BadInput): lm3 from D = 256,
      // lm2 from 128, lm5 at 256 only; int6 from 128 (whole bytes too).
      if (code.defined() && !code_fits(D, code)) continue;
      const std::string tag = std::string(name) + " D=" + std::to_string(D);
      auto x = at::randn({3, 37, D}) * 1.7 + 0.3;
      auto [c, sd] = ops::quantize_rows(x, code);
      auto want = ops::dequantize_rows(c, sd, code, dt());
      auto have = ops::dequantize_rows(c.to(kCuda), sd.to(kCuda), code, dt());
      ASSERT_EQ(have.sizes(), want.sizes()) << tag;
      EXPECT_EQ(have.scalar_type(), dt()) << tag;
      auto err = (have.cpu().to(at::kFloat) - want.to(at::kFloat)).abs();
      const double rel = dt() == at::kFloat ? 1e-5 : 8e-3;  // bf16: one rounding step apart at most
      EXPECT_TRUE(err.le(want.to(at::kFloat).abs() * rel + 1e-5).all().item<bool>())
          << tag << ": max err " << err.max().item<double>();
    }
  }
}

// Whether ops::linear / linear_act_mul take the tensor-core kernel for M rows of a projection to
// N outputs: bf16, 2 .. 16 rows, N below a vocabulary (mma_gemv_fits); else cuBLAS.
bool mma_rows(at::ScalarType dt, int64_t M, int64_t N) {
  return dt == at::kBFloat16 && M >= 2 && M <= 16 && N < 16384;
}

TEST_P(CudaOps, Linear) {
  // Several rows: the tensor-core kernel in bf16 (2 .. 16 rows; 17 and the vocabulary take cuBLAS).
  for (int64_t M : {1, 2, 3, 8, 13, 16, 17})
    // 16397 x 640: a vocabulary's rows, 4 to a warp, the last warp's partly past N; 1001 x 24 and
    // 7 x 40: tiles of 8 rows partly past N, a chunk of 32 values partly past K
    for (auto nk : {std::pair<int64_t, int64_t>{7, 640}, {1536, 640}, {640, 2048}, {1001, 24}, {7, 40}, {16397, 640}})
      for (bool with_bias : {false, true}) {
        auto x = at::randn({M, nk.second}).to(dt());
        auto w = (at::randn({nk.first, nk.second}) * 0.05).to(dt());
        auto b = with_bias ? at::randn({nk.first}).to(dt()) : at::Tensor();
        auto got = ops::linear(x.to(kCuda), w.to(kCuda), with_bias ? b.to(kCuda) : b);
        const std::string tag = "linear M=" + std::to_string(M) + " N=" + std::to_string(nk.first) +
                                " K=" + std::to_string(nk.second) + (with_bias ? " bias" : "");
        if (M == 1 || mma_rows(dt(), M, nk.first)) {
          // The GEMV kernels: against f32 matmul of the same values, rounded once.
          auto ref = at::linear(x.to(at::kFloat), w.to(at::kFloat), with_bias ? b.to(at::kFloat) : b).to(dt());
          expect_close(got, ref, tag);
        } else {
          EXPECT_TRUE(at::equal(got, at::linear(x.to(kCuda), w.to(kCuda), with_bias ? b.to(kCuda) : b))) << tag;
        }
      }
}

// The greedy lm_head: the argmax of the GEMV's logits (the first of equal maxima), without them.
// Vocabularies of 7 and 16397 rows (a block's 32 rows partly past V), the maximum planted in a row
// that a later row repeats (equal logits: the lower index wins), and the CPU path.
TEST_P(CudaOps, LinearArgmax) {
  for (int64_t V : {7, 16397})
    for (int64_t K : {640, 24}) {
      auto x = at::randn({1, 1, K}).to(dt());
      auto w = (at::randn({V, K}) * 0.05).to(dt());
      const int64_t hot = V / 3;
      w[hot] = x.view({K}) * 0.5;  // the largest logit, and a later copy of it
      w[V - 1] = w[hot];
      auto xc = x.to(kCuda), wc = w.to(kCuda);
      auto got = at::empty({1, 1}, at::TensorOptions().dtype(at::kLong).device(kCuda));
      ops::linear_argmax(xc, wc, got);
      auto want = at::empty({1, 1}, got.options());
      ops::argmax_rows(ops::linear(xc, wc), {}, want);
      const std::string tag = "linear_argmax V=" + std::to_string(V) + " K=" + std::to_string(K);
      EXPECT_EQ(got.item<int64_t>(), want.item<int64_t>()) << tag;
      EXPECT_EQ(got.item<int64_t>(), hot) << tag;
      auto cpu = at::empty({1, 1}, at::kLong);
      ops::linear_argmax(x, w, cpu);
      EXPECT_EQ(cpu.item<int64_t>(), hot) << tag << " (CPU)";
    }
}

// The greedy lm_head through its int8 screen (ops::make_head_screen): the whole head's token, bit for
// bit the same index, over vocabularies of 7, 16,397 and 70,001 rows and K of 48 (one 16-value chunk a
// lane), 640 (Gemma 3), 1,040 (a lane's chunks padded to 4) and 4,096 (8, the most it takes):
//   - random x, some with a few dimensions 50x the rest (a real model's final hidden state has them);
//   - the maximum planted in a row that a later row repeats (equal logits: the lower index wins) and a
//     third row one bf16 step away from it (a near-tie the screen cannot separate);
//   - a NaN in x (every logit NaN: the first row, as the whole head gives);
// and the screen passes few rows to the exact sums when one logit stands out.
TEST_P(CudaOps, ScreenedArgmax) {
  struct Shape {
    int64_t V, K;
  };
  // Every pass-1 geometry (ScreenGeometry: 8 lanes a row with 1-8 chunks each, 16 lanes, 32 lanes),
  // and more pass-1 blocks (4,688 at 300,001 x 640) than pass 2's threads load in one round.
  std::vector<Shape> shapes{{7, 48}, {16397, 640}, {300001, 640}, {16397, 1040}, {16397, 4096}};
  for (const int64_t K : {256, 384, 512, 768, 896, 1024, 2048}) shapes.push_back({3001, K});
  for (const Shape sh : shapes) {
    const int64_t V = sh.V, K = sh.K;
    const std::string tag = "V=" + std::to_string(V) + " K=" + std::to_string(K);
    auto w = (at::randn({V, K}) * 0.05 * (at::rand({V, 1}) + 0.5)).to(dt());
    const int64_t hot = V / 3;
    auto wc = w.to(kCuda);
    const ops::HeadScreen screen = ops::make_head_screen(wc);
    ASSERT_TRUE(screen.defined()) << tag;
    auto got = at::empty({1}, at::TensorOptions().dtype(at::kLong).device(kCuda)), want = at::empty_like(got);
    auto check = [&](const at::Tensor& x, const std::string& what) {
      ops::linear_argmax(x, wc, got, &screen);
      ops::linear_argmax(x, wc, want);
      EXPECT_EQ(got.item<int64_t>(), want.item<int64_t>()) << tag << " " << what;
    };
    for (int i = 0; i < 24; ++i) {
      auto x = at::randn({K}) * 3;
      if (i % 3 == 0) x.index_put_({at::randint(K, {3}, at::kLong)}, 150.0);
      check(x.to(dt()).to(kCuda), "random x " + std::to_string(i));
    }
    // A standout logit: its row is x itself.
    auto x = at::randn({K}).to(dt());
    auto wp = w.clone();
    wp[hot] = x * 0.5;
    wp[V - 1] = wp[hot];
    if (V > 2) {
      wp[hot + 1] = wp[hot];
      wp[hot + 1][0] = wp[hot][0].item<float>() * (1 + 1.0 / 128);  // one bf16 step off in one value
    }
    wc = wp.to(kCuda);
    const ops::HeadScreen planted = ops::make_head_screen(wc);
    ops::linear_argmax(x.to(kCuda), wc, got, &planted);
    ops::linear_argmax(x.to(kCuda), wc, want);
    EXPECT_EQ(got.item<int64_t>(), want.item<int64_t>()) << tag << " planted";
    EXPECT_TRUE(got.item<int64_t>() == hot || got.item<int64_t>() == hot + 1) << tag << " planted";
    const int summed = planted.summed.item<int>();
    EXPECT_GE(summed, 2) << tag << ": the row and its copy are both candidates";
    if (V > 1000) EXPECT_LT(summed, V / 100) << tag << ": the screen passed " << summed << " rows of " << V;
    // NaN: every logit NaN, the first row wins on both paths.
    auto xn = at::randn({K});
    xn[K / 2] = NAN;
    check(xn.to(dt()).to(kCuda), "NaN");
    ops::linear_argmax(xn.to(dt()).to(kCuda), wc, got, &planted);
    EXPECT_EQ(got.item<int64_t>(), 0) << tag << " NaN";
  }
  // K the screen kernel does not take (no multiple of 16; over 4,096): the whole head answers, nothing screened.
  for (const int64_t K : {200, 4112}) {
    auto w = (at::randn({1000, K}) * 0.05).to(dt()).to(kCuda);
    const ops::HeadScreen screen = ops::make_head_screen(w);
    auto x = at::randn({K}).to(dt()).to(kCuda);
    auto got = at::empty({1}, at::TensorOptions().dtype(at::kLong).device(kCuda)), want = at::empty_like(got);
    ops::linear_argmax(x, w, got, &screen);
    ops::linear_argmax(x, w, want);
    EXPECT_EQ(got.item<int64_t>(), want.item<int64_t>()) << "K=" << K;
    EXPECT_EQ(screen.summed.item<int>(), 0) << "K=" << K << " went through the screen";
  }
}

TEST_P(CudaOps, LinearActMul) {
  for (int64_t M : {1, 4, 8, 11, 16, 17})
    for (auto nk : {std::pair<int64_t, int64_t>{2048, 640}, {13, 64}, {2048, 2048}})
      for (bool gelu : {true, false}) {
        auto x = at::randn({M, nk.second}).to(dt());
        auto w = (at::randn({2 * nk.first, nk.second}) * 0.1).to(dt());
        std::string tag = "linear_act_mul M=" + std::to_string(M) + " I=" + std::to_string(nk.first) +
                          " K=" + std::to_string(nk.second);
        auto got = ops::linear_act_mul(x.to(kCuda), w.to(kCuda), {}, gelu);
        if (M == 1 || mma_rows(dt(), M, nk.first)) {
          // The fused kernel: against f32 matmul rounded once (what a GEMM returns), then the activation.
          // Two steps: a gate and an up value each one step off (another summation order) move the
          // product by up to two (16 rows of 2,048 outputs reach it, at K 640 and 2048).
          auto gu = at::linear(x.to(at::kFloat), w.to(at::kFloat)).to(dt());
          expect_close(got, ops::act_mul(gu, gelu), tag, 2);
        } else {
          // Several rows: exactly the unfused cuBLAS path.
          auto want = ops::act_mul(at::linear(x.to(kCuda), w.to(kCuda)), gelu);
          EXPECT_TRUE(at::equal(got, want)) << tag;
        }
      }
}

// The residual step folded into the projection that reads its pre-norm (one kernel for one row):
// the bits of the two CUDA ops it replaces (add_rms_norm, then the GEMV), for plain and gated
// projections, hidden sizes of 640 and 1000 (residual blocks of 640 and 1024 threads, emulated by
// the GEMV's 256), 1152 (past the prologue's 1,024 values: the two ops) and 36 (f32 only: bf16
// leaves it to the two ops, not a multiple of its 8-value loads), with and without the
// post-norm and a bias; h' against the LibTorch reference on the CPU as well. Several rows take
// the two ops.
TEST_P(CudaOps, AddRmsNormLinear) {
  ops::NormSpec ns{1e-6, true};
  for (int64_t M : {1, 3})
    for (int64_t H : {640, 1000, 1152, 36})
      for (auto [N, gated] : {std::pair<int64_t, bool>{1536, false}, {7, false}, {2048, true}, {13, true}})
        for (bool post : {true, false}) {
          const bool bias = N == 7 || N == 13;
          auto h = at::randn({1, M, H}).to(dt()), x = at::randn({1, M, H}).to(dt());
          auto wp = post ? at::randn({H}) * 0.2 + 1 : at::Tensor(), wn = at::randn({H}) * 0.2 + 1;
          auto w = (at::randn({gated ? 2 * N : N, H}) * 0.05).to(dt());
          auto b = bias ? at::randn({gated ? 2 * N : N}).to(dt()) : at::Tensor();
          const std::string tag = "add_rms_norm_linear M=" + std::to_string(M) + " H=" + std::to_string(H) +
                                  " N=" + std::to_string(N) + (gated ? " gated" : "") + (post ? " post" : "");
          auto hc = h.to(kCuda), xc = x.to(kCuda), wnc = wn.to(kCuda), wpc = post ? wp.to(kCuda) : wp;
          ops::Linear lin{w.to(kCuda), bias ? b.to(kCuda) : b, gated, /*gelu_tanh=*/true};
          auto [h_got, y_got] = ops::add_rms_norm_linear(hc, xc, wpc, wnc, ns, lin);
          auto [h2, pre] = ops::add_rms_norm(hc, xc, wpc, wnc, ns);
          auto y_two = gated ? ops::linear_act_mul(pre, lin.w, lin.bias, true) : ops::linear(pre, lin.w, lin.bias);
          EXPECT_TRUE(h_got.equal(h2)) << tag << ": h' differs from add_rms_norm's";
          EXPECT_TRUE(y_got.equal(y_two)) << tag << ": y differs from the two ops'";
          auto h_ref = ops::add_rms_norm_linear(h, x, wp, wn, ns, {w, b, gated, true}).first;
          expect_close(h_got, h_ref, tag + " h'");
        }
}

// A plan of the pairs whose experts are `flat` ([P] int64): every pair exactly once, grouped by
// ascending expert.
void expect_plan(const ops::ExpertPlan& plan, const at::Tensor& flat, const std::string& tag) {
  const int64_t P = flat.numel();
  ASSERT_TRUE(plan.groups.defined()) << tag;
  auto g = plan.groups.to(at::kCPU);
  ASSERT_EQ(g.numel(), 3 * P + 2) << tag;
  const int* pl = g.data_ptr<int>();
  const int U = pl[0];
  EXPECT_EQ(U, std::get<0>(at::_unique(flat)).numel()) << tag;
  std::vector<int> seen(P, 0);
  for (int u = 0; u < U; ++u) {
    if (u > 0) EXPECT_LT(pl[1 + u - 1], pl[1 + u]) << tag;
    for (int b = pl[1 + P + u]; b < pl[1 + P + u + 1]; ++b) {
      const int p = pl[2 + 2 * P + b];
      ++seen[p];
      EXPECT_EQ(flat[p].item<int64_t>(), pl[1 + u]) << tag;
    }
  }
  for (int64_t p = 0; p < P; ++p) EXPECT_EQ(seen[p], 1) << tag << " pair " << p;
}

// Routed experts (mixture-of-experts layers) for decode steps and verify blocks: the plan groups
// (token, expert) pairs by expert on the device and the expert GEMV reads each selected expert
// once. Against f32 products of the gathered experts rounded once (what a GEMM returns), then
// the activation; tokens 1 .. 32, experts shared by many pairs (5 experts, top 3) or all distinct,
// row lengths the kernel takes and one it leaves to the gathered path (20 in bf16).
TEST_P(CudaOps, ExpertLinear) {
  struct Case { int64_t tokens, top_k, experts, inter, hidden; };
  for (const Case c : {Case{1, 8, 128, 40, 264}, Case{3, 3, 5, 24, 64}, Case{16, 8, 128, 40, 264},
                       Case{32, 2, 7, 13 * 8, 48}, Case{5, 2, 4, 16, 20}})
    for (bool gelu : {true, false}) {
      const int64_t P = c.tokens * c.top_k;
      // Distinct experts per token, as top-k gives them.
      auto idx = std::get<1>(at::topk(at::rand({c.tokens, c.experts}), c.top_k, -1));  // [N, K] int64
      auto x = at::randn({c.tokens, c.hidden}).to(dt());
      auto gate_up = (at::randn({c.experts, 2 * c.inter, c.hidden}) * 0.1).to(dt());
      auto down = (at::randn({c.experts, c.hidden, c.inter}) * 0.1).to(dt());
      const std::string tag = "expert_linear N=" + std::to_string(c.tokens) + " K=" + std::to_string(c.top_k) +
                              " E=" + std::to_string(c.experts) + " H=" + std::to_string(c.hidden);
      const auto plan = ops::plan_experts(idx.to(kCuda), c.experts);
      auto act = ops::expert_linear(x.to(kCuda), gate_up.to(kCuda), plan, c.top_k, true, gelu);  // [P, I]
      auto y = ops::expert_linear(act, down.to(kCuda), plan, 1, false, false);                   // [P, H]
      // Reference per pair from the same values: token p / K, expert idx[p].
      auto flat = idx.flatten();
      auto xr = x.to(at::kFloat).repeat_interleave(c.top_k, 0).unsqueeze(-1);                   // [P, H, 1]
      auto gu = at::matmul(gate_up.to(at::kFloat).index_select(0, flat), xr).squeeze(-1).to(dt());
      auto act_ref = ops::act_mul(gu, gelu);
      expect_close(act, act_ref, tag + " gate_up");
      // The down product from the kernel's own activations, so one rounding is compared.
      auto y_ref = at::matmul(down.to(at::kFloat).index_select(0, flat), act.to(at::kCPU, at::kFloat).unsqueeze(-1))
                       .squeeze(-1).to(dt());
      expect_close(y, y_ref, tag + " down");
      ASSERT_EQ(y.size(0), P) << tag;
      expect_plan(plan, flat, tag);
    }
}

// Gemma 4's router on the device (norm, scales, scores, softmax, top-k, renormalise, per-expert
// scale, and the pairs' plan: two launches) against its definition computed here in f32 from
// the same rounded inputs: the chosen experts are the top_k of p (up to values within one
// rounding of the scores when bf16), by descending p, and the weights are their renormalised p ×
// the per-expert scale. Token counts 1 .. 32, the 26B shape's router (128 experts, top 8, 2816),
// odd sizes, a row length the kernels leave to the reference ops (20 in bf16) and a prefill's
// token count (40, also the reference ops).
TEST_P(CudaOps, RouteExperts) {
  struct Case { int64_t tokens, experts, top_k, hidden; };
  const ops::NormSpec ns{1e-6, true};
  for (const Case c : {Case{1, 128, 8, 2816}, Case{16, 128, 8, 2816}, Case{3, 7, 2, 40}, Case{32, 5, 3, 64},
                       Case{9, 33, 4, 1000}, Case{4, 6, 2, 20}, Case{40, 16, 4, 64}}) {
    const std::string tag = "route_experts N=" + std::to_string(c.tokens) + " E=" + std::to_string(c.experts) +
                            " K=" + std::to_string(c.top_k) + " H=" + std::to_string(c.hidden);
    auto h = (at::randn({c.tokens, c.hidden}) * 3).to(dt());
    auto scale = (at::randn({c.hidden}) * 0.3 + 1).to(dt());
    auto proj = at::randn({c.experts, c.hidden}).to(dt());
    auto pes = (at::rand({c.experts}) + 0.5).to(dt());
    const auto r = ops::route_experts(h.to(kCuda), scale.to(kCuda), proj.to(kCuda), pes.to(kCuda), c.top_k, ns, true);
    ASSERT_EQ(r.experts.sizes(), (at::IntArrayRef{c.tokens, c.top_k})) << tag;
    // The definition, in f32 from the rounded inputs: x̂ rounded as the reference rounds it.
    auto hf = h.to(at::kFloat);
    auto x = (hf * at::rsqrt(hf.pow(2).mean(-1, true) + ns.eps)).to(dt());
    x = ((x * scale).to(dt()) * (1.0 / std::sqrt((double)c.hidden))).to(dt());
    auto logits = at::matmul(x.to(at::kFloat), proj.to(at::kFloat).t());  // [N, E]
    auto p = at::softmax(logits, -1);
    auto e = r.experts.cpu();
    auto w = r.weights.cpu();
    const double tol = dt() == at::kBFloat16 ? 2.0 / 128 : 1e-5;  // p moves by ~a score's rounding
    for (int64_t t = 0; t < c.tokens; ++t) {
      auto sorted = std::get<0>(p[t].sort(-1, /*descending=*/true));
      const double kth = sorted[c.top_k - 1].item<double>(), first = sorted[0].item<double>();
      auto pe = p[t].index_select(0, e[t]);  // [K] the definition's p of the chosen experts
      EXPECT_EQ(std::get<0>(at::_unique(e[t])).numel(), c.top_k) << tag << " token " << t << ": repeated experts";
      EXPECT_GE(pe.min().item<double>(), kth - tol * first) << tag << " token " << t << ": " << e[t];
      for (int64_t k = 1; k < c.top_k; ++k)
        EXPECT_LE(pe[k].item<double>(), pe[k - 1].item<double>() + tol * first) << tag << " token " << t;
      auto want = pe / pe.sum() * pes.to(at::kFloat).index_select(0, e[t]);
      EXPECT_TRUE(at::allclose(w[t], want, dt() == at::kBFloat16 ? 3e-2 : 1e-5, 1e-6))
          << tag << " token " << t << ": " << w[t] << " vs " << want;
    }
    if (dt() == at::kFloat) {
      // f32: the same choice as the reference ops (core/kernels/ops.cpp, the CPU path).
      const auto ref = ops::route_experts(h, scale, proj, pes, c.top_k, ns, false);
      EXPECT_TRUE(r.experts.cpu().equal(ref.experts)) << tag << "\n" << r.experts.cpu() << "\nvs\n" << ref.experts;
    }
    // The plan the second launch built: what plan_experts builds from the same indices.
    expect_plan(r.plan, r.experts.flatten().cpu(), tag);
  }
}

// Gemma 4's MoE layer end in one kernel (the experts' weighted sum, three post-norms, the
// residual add, the layer scalar and the next pre-norm) against the reference ops; pair rows with
// route weights and an already-summed branch (no weights), with and without the layer scalar, the
// 26B shape's hidden size and odd ones; and the copy of the new residual rows into a ring.
TEST_P(CudaOps, MoeResidual) {
  const ops::NormSpec ns{1e-6, false};
  for (int64_t H : {2816, 37, 640})
    for (int64_t K : {8, 2, 0})
      for (bool scalar : {true, false}) {
        const int64_t N = H == 37 ? 3 : (K == 2 ? 16 : 1);
        const std::string tag = "moe_residual N=" + std::to_string(N) + " K=" + std::to_string(K) + " H=" +
                                std::to_string(H) + (scalar ? " scalar" : "");
        auto h = at::randn({1, N, H}).to(dt()), f = at::randn({1, N, H}).to(dt());
        auto y = at::randn({N * std::max<int64_t>(K, 1), H}).to(dt());
        auto r = K ? at::rand({N, K}) : at::Tensor();
        auto wt = [&] { return (at::randn({H}) * 0.2 + 1).to(dt()).to(at::kFloat); };
        ops::MoeNorms n{wt(), wt(), wt(), scalar ? at::full({1}, 0.61, dt()) : at::Tensor()};
        auto wn = wt();
        auto [h_ref, x_ref] = ops::moe_residual(h, f, y, r, n, wn, ns);
        ops::MoeNorms nc{n.dense.to(kCuda), n.experts.to(kCuda), n.ffn.to(kCuda),
                         scalar ? n.scalar.to(kCuda) : at::Tensor()};
        auto [h_got, x_got] = ops::moe_residual(h.to(kCuda), f.to(kCuda), y.to(kCuda), K ? r.to(kCuda) : r, nc,
                                                wn.to(kCuda), ns);
        expect_close(h_got, h_ref, tag + " h");
        expect_close(x_got, x_ref, tag + " x");
      }
  // The ring copy: rows at position mod R, columns col.., nothing else touched.
  const int64_t H = 640, N = 3, R = 5, F = 2 * H;
  auto h = at::randn({1, N, H}).to(dt()), f = at::randn({1, N, H}).to(dt()), y = at::randn({N * 2, H}).to(dt());
  auto r = at::rand({N, 2});
  ops::MoeNorms n{at::ones({H}, kCuda), at::ones({H}, kCuda), at::ones({H}, kCuda), {}};
  auto ring = at::full({R, F}, 7.0, at::TensorOptions().dtype(dt()).device(kCuda));
  ops::RowCopy copy{ring, H, at::tensor({6, 7, 8}, at::kLong).to(kCuda)};
  auto [h_got, x_got] = ops::moe_residual(h.to(kCuda), f.to(kCuda), y.to(kCuda), r.to(kCuda), n,
                                          at::ones({H}, kCuda), ns, &copy);
  auto rc = ring.cpu();
  for (int64_t t = 0; t < N; ++t) EXPECT_TRUE(rc[(6 + t) % R].narrow(0, H, H).equal(h_got.cpu()[0][t])) << "row " << t;
  EXPECT_TRUE(rc.narrow(1, 0, H).eq(7).all().item<bool>()) << "columns before col written";
  EXPECT_TRUE(rc[0].eq(7).all().item<bool>() && rc[4].eq(7).all().item<bool>()) << "rows of no position written";
}

// Greedy acceptance of a verify block against the LibTorch reference (core/kernels/ops.cpp, what
// runs on CPU): argmax per row with ties broken towards the lower index, then the leading
// run of drafts equal to the argmax before them. Rows of the real vocabulary size and odd
// ones; planted ties; blocks accepting nothing, a prefix, everything.
TEST_P(CudaOps, GreedyAccept) {
  for (int64_t V : {5, 1001, 262144})
    for (int64_t T : {2, 7, 16}) {
      auto scores = at::randn({T, V}).to(dt());
      // Ties: row 0's maximum repeated at a later and an earlier index than its argmax.
      const int64_t am = scores[0].argmax().item<int64_t>();
      if (V > 3) {
        const int64_t later = (am + 2) % V, earlier = am > 0 ? am - 1 : V - 1;
        scores[0][later] = scores[0][am];
        scores[0][earlier] = scores[0][am];
      }
      auto post = scores.argmax(-1);
      for (int64_t accept : {int64_t(0), T / 2, T - 1}) {
        auto block = at::randint(0, V, {T}, at::kLong);
        for (int64_t i = 1; i <= accept; ++i) block[i] = post[i - 1];  // the first `accept` drafts match
        if (accept + 1 < T) block[accept + 1] = (post[accept].item<int64_t>() + 1) % V;  // and the next does not
        auto want = at::zeros({T + 1}, at::kLong);
        ops::greedy_accept(scores, block, want);
        ASSERT_EQ(want[T].item<int64_t>(), accept + 1) << "reference: V=" << V << " T=" << T;
        auto got = at::full({T + 1}, -7, at::TensorOptions().dtype(at::kLong).device(kCuda));
        ops::greedy_accept(scores.to(kCuda), block.to(kCuda), got);
        EXPECT_TRUE(got.cpu().equal(want)) << "V=" << V << " T=" << T << " accept=" << accept << "\n"
                                           << got.cpu() << "\nvs\n" << want;
      }
    }
}

// The block's advance: carried token = report[n - 1], pos0 += n, qpos = pos0 + 0..T-1, and the
// carried token's draft input row (Drafter::embed: table row × scale, in the table's dtype).
TEST_P(CudaOps, AdvanceBlock) {
  const int64_t V = 301, H = 640;
  auto table = at::randn({V, H}).to(dt());
  for (int64_t T : {2, 16, 33})
    for (int64_t n : {int64_t(1), T / 2 + 1, T}) {
      auto report = at::randint(0, V, {T + 1}, at::kLong);
      report[T] = n;
      auto block = at::randint(0, V, {1, T}, at::kLong), pos0 = at::full({1}, 41, at::kLong);
      auto qpos = at::arange(41, 41 + T, at::kLong);
      auto b_ref = block.clone(), p_ref = pos0.clone(), q_ref = qpos.clone();
      auto row_ref = at::zeros({H}, dt());
      ops::CarriedEmbedding e_ref{table, 25.298221281347036, row_ref};
      ops::advance_block(report, b_ref, p_ref, q_ref, &e_ref);
      const int64_t tok = report[n - 1].item<int64_t>();
      EXPECT_EQ(b_ref[0][0].item<int64_t>(), tok);
      EXPECT_EQ(p_ref.item<int64_t>(), 41 + n);
      EXPECT_TRUE(row_ref.equal((table[tok] * 25.298221281347036).to(dt())));
      auto b = block.to(kCuda), p = pos0.to(kCuda), q = qpos.to(kCuda);
      auto row = at::full({H}, NAN, at::TensorOptions().dtype(dt()).device(kCuda));
      ops::CarriedEmbedding e{table.to(kCuda), 25.298221281347036, row};
      ops::advance_block(report.to(kCuda), b, p, q, &e);
      EXPECT_TRUE(b.cpu().equal(b_ref) && p.cpu().equal(p_ref) && q.cpu().equal(q_ref)) << "T=" << T << " n=" << n;
      EXPECT_TRUE(row.cpu().equal(row_ref)) << "embedding row, T=" << T << " n=" << n;
      // Without the embedding the positions still move.
      auto b2 = block.to(kCuda), p2 = pos0.to(kCuda), q2 = qpos.to(kCuda);
      ops::advance_block(report.to(kCuda), b2, p2, q2);
      EXPECT_TRUE(b2.cpu().equal(b_ref) && p2.cpu().equal(p_ref) && q2.cpu().equal(q_ref));
    }
}

// Greedy drafts: argmax per row through a vocabulary map, written into a slice of a block.
TEST_P(CudaOps, ArgmaxRows) {
  for (int64_t V : {7, 32768, 262144}) {
    auto scores = at::randn({1, 15, V}).to(dt());
    scores[0][3][V / 2] = scores[0][3].max();  // a tie with the row's maximum
    auto map = at::randperm(V, at::kLong) * 3;
    for (bool mapped : {false, true}) {
      auto block = at::full({1, 16}, -5, at::kLong), want = block.clone();
      auto slice_ref = want.narrow(1, 1, 15);
      ops::argmax_rows(scores, mapped ? map : at::Tensor(), slice_ref);
      auto idx = scores.reshape({15, V}).argmax(-1);
      EXPECT_TRUE(want.narrow(1, 1, 15).view({15}).equal(mapped ? map.index_select(0, idx) : idx));
      auto got = block.to(kCuda);
      auto slice = got.narrow(1, 1, 15);
      ops::argmax_rows(scores.to(kCuda), mapped ? map.to(kCuda) : at::Tensor(), slice);
      EXPECT_TRUE(got.cpu().equal(want)) << "V=" << V << " mapped=" << mapped;
    }
  }
}

// Target features gathered from several hidden states into a block buffer and a ring at
// positions mod R (wrapping), bitwise as cat + index_copy_; rows of the ring no position
// maps to stay untouched.
TEST_P(CudaOps, ConcatRows) {
  const int64_t T = 5, R = 7;
  // Odd widths (element-wise copies) and the drafter's features (5 x 640: 16-byte copies).
  for (const std::vector<int64_t>& widths : {std::vector<int64_t>{640, 3, 640, 129}, std::vector<int64_t>(5, 640)}) {
    std::vector<at::Tensor> parts;
    int64_t F = 0;
    for (int64_t w : widths) {
      parts.push_back(at::randn({1, T, w}).to(dt()));
      F += w;
    }
    SCOPED_TRACE("F = " + std::to_string(F));
    auto pos = at::tensor(std::vector<int64_t>{12, 13, 3, 15, 16}, at::kLong);  // 12 mod 7 = 5 ... 16 mod 7 = 2
    auto out_ref = at::zeros({1, T, F}, dt()), ring_ref = at::randn({R, F}).to(dt());
    auto ring0 = ring_ref.clone();
    ops::concat_rows(parts, &out_ref, &ring_ref, pos);
    EXPECT_TRUE(out_ref.equal(at::cat(parts, -1)));
    std::vector<at::Tensor> gparts;
    for (const auto& p : parts) gparts.push_back(p.to(kCuda));
    auto out = at::full({1, T, F}, NAN, at::TensorOptions().dtype(dt()).device(kCuda)), ring = ring0.to(kCuda);
    ops::concat_rows(gparts, &out, &ring, pos.to(kCuda));
    EXPECT_TRUE(out.cpu().equal(out_ref));
    EXPECT_TRUE(ring.cpu().equal(ring_ref));
    EXPECT_TRUE(ring.cpu()[0].equal(ring0[0]) && ring.cpu()[4].equal(ring0[4])) << "rows 0, 4: no position maps there";
    // Either destination alone.
    auto only_ring = ring0.to(kCuda);
    ops::concat_rows(gparts, nullptr, &only_ring, pos.to(kCuda));
    EXPECT_TRUE(only_ring.cpu().equal(ring_ref));
  }
}

// ops::prefetch_l2 asks for bytes, writes nothing: tensors of odd sizes and offsets (views that
// start off a 16-byte boundary, a few bytes, more chunks than its grid has threads) come back
// unchanged and the launch leaves no error; more than 8 tensors or a strided view are refused.
TEST_P(CudaOps, PrefetchL2LeavesTensorsUnchanged) {
  auto opt = at::TensorOptions().dtype(dt()).device(kCuda);
  auto big = at::randn({4099, 1031}, opt);             // ~8 / 16 MB: more chunks than the 64 x 32 threads
  auto odd = at::randn({1001}, opt).narrow(0, 3, 997);  // starts 6 or 12 bytes past an allocation
  auto tiny = at::randn({3}, opt);                      // under one 16-byte unit in bf16
  std::vector<at::Tensor> ts{big, odd, tiny, at::Tensor()};
  std::vector<at::Tensor> before;
  for (const auto& t : ts) before.push_back(t.defined() ? t.clone() : t);
  ops::prefetch_l2(ts);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (size_t i = 0; i < ts.size(); ++i)
    if (ts[i].defined()) EXPECT_TRUE(at::equal(ts[i], before[i])) << "tensor " << i;
  EXPECT_THROW(ops::prefetch_l2(std::vector<at::Tensor>(9, tiny)), c10::Error);
  EXPECT_THROW(ops::prefetch_l2({big.t()}), c10::Error);
  EXPECT_NO_THROW(ops::prefetch_l2({}));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaOps, ::testing::Values(at::kFloat, at::kBFloat16));

}  // namespace

// The safetensors writer takes CUDA tensors (and non-contiguous views) as they come.
TEST(CudaSafetensors, SavesCudaTensors) {
  const at::Tensor t = at::randn({4, 5}, at::TensorOptions().device(kCuda).dtype(at::kBFloat16));
  const std::string path = fs::temp_dir() + "/kakeya_cuda_" + std::to_string(::getpid()) + ".safetensors";
  save_safetensors(path, {{"t", t.t()}});
  const at::Tensor got = SafetensorsFile(path).get("t");
  ::unlink(path.c_str());
  EXPECT_TRUE(at::equal(got, t.t().cpu())) << "t";
}
