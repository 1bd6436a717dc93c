// KV codec: WHT, Lloyd-Max, Cholesky whitening, encode/decode error vs bits,
// byte accounting on hand-computed cases, calibration bundles, bad input, and
// a CPU end-to-end run of the calibration jobs + Scenario A on the tiny random
// Gemma 3 of the model_parity fixtures.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>

#include "calib/calibrate.h"
#include "calib/codec_eval.h"
#include "calib/codec/calib_bundle.h"
#include "calib/codec/codec.h"
#include "core/error.h"
#include "core/io/fs.h"
#include "calib/codec/lloyd_max.h"
#include "core/io/safetensors.h"
#include "calib/codec/wht.h"
#include "tests/test_util.h"

using namespace kakeya;
using json = nlohmann::json;

namespace {

// A small Gemma-3-shaped config (2 KV heads of 16 dims, 3 layers) for codec-only tests.
ModelConfig tiny_config(int64_t head_dim = 16) {
  json j = {{"model_type", "gemma3_text"},
            {"vocab_size", 101},
            {"hidden_size", 48},
            {"intermediate_size", 80},
            {"num_hidden_layers", 3},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 2},
            {"head_dim", head_dim},
            {"max_position_embeddings", 256},
            {"rms_norm_eps", 1e-6},
            {"sliding_window", 6},
            {"query_pre_attn_scalar", 24},
            {"layer_types", {"sliding_attention", "full_attention", "sliding_attention"}},
            {"rope_parameters",
             {{"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
              {"full_attention", {{"rope_type", "default"}, {"rope_theta", 1000000.0}}}}}};
  return ModelConfig::from_json(j, "tiny_config");
}

std::string temp_dir(const std::string& name) {
  std::string d = fs::temp_dir() + "/kakeya_test_codec_" + std::to_string(getpid()) + "_" + name;
  int rc = std::system(("rm -rf '" + d + "'").c_str());
  (void)rc;
  fs::make_dirs(d);
  return d;
}

// A tiny random model of tests/fixtures/make_model_fixtures.py ("gemma3", "gemma4").
Model tiny_model(const std::string& name, int64_t max_positions) {
  ModelOptions mo;
  mo.max_positions = max_positions;
  return Model::load(test::fixtures_dir("model_parity") + "/" + name, mo);
}

// n random token ids (past the special ones) of the model's vocabulary.
std::vector<int64_t> random_ids(const ModelConfig& cfg, int64_t n, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  auto rid = at::randint(3, cfg.vocab_size, {n}, g, at::kLong);
  return std::vector<int64_t>(rid.data_ptr<int64_t>(), rid.data_ptr<int64_t>() + n);
}

// Correlated, anisotropic data with a large common offset, like post-norm K: [H, N, D].
at::Tensor kv_like(int64_t H, int64_t N, int64_t D, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  auto mix = at::randn({D, D}, g) * at::exp(-at::arange(D, at::kFloat) / (D / 4.0)).unsqueeze(0);
  auto x = at::matmul(at::randn({H, N, D}, g), mix.t()) + 3.0 * at::randn({1, 1, D}, g);
  return x;
}

double rel_err(const at::Tensor& x, const at::Tensor& y) {
  return (x - y).pow(2).sum().item<double>() / x.pow(2).sum().item<double>();
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

// ---------------------------------------------------------------- WHT

TEST(Wht, OrthonormalAndSelfInverse) {
  for (int64_t n : {1, 2, 4, 16, 256}) {
    auto I = at::eye(n, at::kDouble);
    auto H = wht(I);  // rows of H/√n
    EXPECT_TRUE(at::allclose(at::matmul(H, H.t()), I, 1e-12, 1e-12)) << "n=" << n;
    EXPECT_TRUE(at::allclose(H, H.t())) << "symmetric, n=" << n;
    auto x = at::randn({3, 5, n}, at::kDouble);
    EXPECT_TRUE(at::allclose(wht(wht(x)), x, 1e-12, 1e-12)) << "self-inverse, n=" << n;
    EXPECT_NEAR(wht(x).norm().item<double>(), x.norm().item<double>(), 1e-9);
    auto s = random_signs(n, 7, at::kCPU);
    auto xf = x.to(at::kFloat);
    EXPECT_TRUE(at::allclose(rht_inverse(rht(xf, s), s), xf, 1e-5, 1e-5));
  }
  // Entries of H_4 (Sylvester order), scaled by 1/2.
  auto H4 = wht(at::eye(4, at::kDouble)) * 2;
  auto want = at::tensor({1., 1., 1., 1., 1., -1., 1., -1., 1., 1., -1., -1., 1., -1., -1., 1.}, at::kDouble).view({4, 4});
  EXPECT_TRUE(at::equal(H4, want));
}

TEST(Wht, NonPowerOfTwoIsPaddedOrRefused) {
  auto x = at::randn({2, 12});
  EXPECT_NE(what_of([&] { wht(x); }).find("power of two"), std::string::npos);
  auto p = pad_pow2(x);
  EXPECT_EQ(p.size(1), 16);
  EXPECT_TRUE(at::allclose(wht(wht(p)).slice(1, 0, 12), x, 1e-5, 1e-5));
  EXPECT_EQ(next_pow2(12), 16);
  EXPECT_EQ(next_pow2(16), 16);
}

// ---------------------------------------------------------------- Lloyd-Max

TEST(LloydMax, GaussianTablesMatchKnownValues) {
  const auto& b1 = gaussian_codebook(1);
  EXPECT_NEAR(b1.centroids[1], std::sqrt(2.0 / M_PI), 1e-6);  // 0.7979
  EXPECT_NEAR(b1.centroids[0], -std::sqrt(2.0 / M_PI), 1e-6);
  const auto& b2 = gaussian_codebook(2);
  EXPECT_NEAR(b2.centroids[2], 0.4528, 1e-4);
  EXPECT_NEAR(b2.centroids[3], 1.5104, 1e-4);
  EXPECT_NEAR(b2.centroids[0], -1.5104, 1e-4);
  const double mse[] = {0.3634, 0.1175, 0.03454, 0.009497};
  for (int b = 1; b <= 4; ++b) EXPECT_NEAR(gaussian_mse(gaussian_codebook(b)), mse[b - 1], mse[b - 1] * 2e-3) << b;
  EXPECT_NE(what_of([] { gaussian_codebook(0); }).find("1..8"), std::string::npos);
  EXPECT_NE(what_of([] { gaussian_codebook(9); }).find("1..8"), std::string::npos);
}

TEST(LloydMax, FitConvergesToGaussianTable) {
  auto g = at::detail::createCPUGenerator(1);
  auto x = at::randn({1 << 21}, g);
  for (int b = 1; b <= 4; ++b) {
    auto cb = lloyd_max_fit(x, b);
    const auto& ref = gaussian_codebook(b);
    // Sampling noise grows with the level count (16 cells of 2M samples, tails of a few thousand).
    const double tol = b < 4 ? 0.01 : 0.025;
    for (size_t i = 0; i < cb.centroids.size(); ++i) EXPECT_NEAR(cb.centroids[i], ref.centroids[i], tol) << b << " " << i;
    EXPECT_NEAR(empirical_mse(x, cb), gaussian_mse(ref), 0.02 * gaussian_mse(ref));
  }
  // Heavier tails (Laplace): the fitted table beats the Gaussian one on its own data.
  auto u = (at::rand({1 << 20}, g) - 0.5).clamp(-0.4999, 0.4999);
  auto lap = -u.sign() * at::log1p(-2 * u.abs()) / std::sqrt(2.0);  // unit variance
  auto cb = lloyd_max_fit(lap, 3);
  EXPECT_LT(empirical_mse(lap, cb), 0.95 * empirical_mse(lap, gaussian_codebook(3)));
}

TEST(LloydMax, RefusesNonFiniteAndBadBits) {
  auto x = at::randn({1000});
  x[17] = NAN;
  EXPECT_NE(what_of([&] { lloyd_max_fit(x, 2); }).find("NaN or Inf"), std::string::npos);
  EXPECT_NE(what_of([&] { lloyd_max_fit(at::randn({1000}), 0); }).find("1..8"), std::string::npos);
}

// ---------------------------------------------------------------- bit packing

TEST(Codec, PackUnpackRoundTrip) {
  for (int bits = 1; bits <= 8; ++bits)
    for (int64_t n : {1, 7, 8, 9, 1001}) {
      auto v = at::randint(0, 1 << bits, {n}, at::kLong).to(at::kByte);
      auto p = pack_bits(v, bits);
      EXPECT_EQ(p.numel(), (n * bits + 7) / 8);
      EXPECT_TRUE(at::equal(unpack_bits(p, n, bits), v)) << bits << " " << n;
    }
}

// ---------------------------------------------------------------- whitening

TEST(Codec, CholeskyWhiteningRoundTripsAndWeighsLogitError) {
  // Σ_q from random anisotropic queries, through the real accumulator and finish.
  auto cfg = tiny_config();
  calib::SigmaQAccumulator acc(cfg, at::kCPU);
  auto g = at::detail::createCPUGenerator(3);
  auto scale = at::exp(-at::arange(16, at::kFloat) / 3.0);
  auto q = at::randn({1, 400, 4, 16}, g) * scale;  // [B, T, H_q, D]
  at::Tensor pos = at::arange(400, at::kLong);
  for (int64_t l = 0; l < 3; ++l) acc.on_tap(Tap::QNorm, TapContext{l, cfg.layer_types[l], pos}, q);
  auto r = calib::finish_sigma_q(acc, cfg, {});
  ASSERT_EQ(r.chol[0].sizes(), (std::vector<int64_t>{2, 16, 16}));
  for (int64_t h = 0; h < 2; ++h) {
    auto L = r.chol[1][h].to(at::kDouble), Li = r.inv_chol[1][h].to(at::kDouble), S = r.sigma[1][h].to(at::kDouble);
    const double mu = S.diagonal().mean().item<double>();
    EXPECT_TRUE(at::allclose(at::matmul(L, L.t()), S + 1e-3 * mu * at::eye(16, at::kDouble), 1e-4, 1e-6));
    EXPECT_TRUE(at::allclose(at::matmul(L, Li), at::eye(16, at::kDouble), 1e-4, 1e-4));
    auto k = at::randn({50, 16}, at::kDouble);
    EXPECT_TRUE(at::allclose(at::matmul(at::matmul(k, L), Li), k, 1e-6, 1e-6));
    // ‖e·L‖² = eᵀ Σ_r e: the whitened squared error is the query-weighted logit error.
    auto e = at::randn({16}, at::kDouble);
    auto Sr = at::matmul(L, L.t());
    EXPECT_NEAR(at::matmul(e, L).pow(2).sum().item<double>(), at::dot(e, at::mv(Sr, e)).item<double>(), 1e-6);
    // Queries were pooled over the GQA group: heads 0,1 -> KV head 0; 2,3 -> KV head 1.
    auto qh = q[0].slice(1, 2 * h, 2 * h + 2).reshape({-1, 16}).to(at::kDouble);
    EXPECT_TRUE(at::allclose(S, at::matmul(qh.t(), qh) / qh.size(0), 1e-4, 1e-6));
  }
  EXPECT_GT(r.diagnostics["layers"][0]["heads"][0]["anisotropy"].get<double>(), 2.0);
}

TEST(Codec, RopeAveragedSigmaMatchesExplicitRotations) {
  // E_Δ[R_Δ Σ R_Δᵀ] against rotation matrices built by the model's own RoPE table.
  RopeParams rp;
  rp.theta = 100.0;
  const int64_t D = 8, M = 5;
  RopeTable rt(rp, D, 16, at::kDouble, at::kCPU);
  auto A = at::randn({D, D}, at::kDouble);
  auto sigma = at::matmul(A, A.t()).unsqueeze(0);  // [1, D, D]
  auto want = at::zeros({D, D}, at::kDouble);
  for (int64_t d = 0; d < M; ++d) {
    // Row i of apply(I) is R e_i, so R = apply(I)ᵀ.
    auto R = rt.apply(at::eye(D, at::kDouble).view({1, D, 1, D}), at::full({D}, d, at::kLong)).view({D, D}).t();
    want += at::matmul(at::matmul(R, sigma[0]), R.t()) / (double)M;
  }
  // The model's table computes angles in f32 (as HF does), rope_average in f64: agree to f32 rounding.
  auto got = calib::rope_average(sigma, rp, M)[0];
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5)) << (got - want).abs().max().item<double>();
  EXPECT_GT((got - sigma[0]).abs().max().item<double>(), 0.1);  // the average really differs from Σ
  // Offsets 0 only: Σ itself.
  EXPECT_TRUE(at::allclose(calib::rope_average(sigma, rp, 1), sigma, 1e-12, 1e-12));
}

TEST(Codec, SigmaQRefusesNonFiniteQueries) {
  auto cfg = tiny_config();
  calib::SigmaQAccumulator acc(cfg, at::kCPU);
  auto q = at::randn({1, 10, 4, 16});
  q[0][3][1][2] = INFINITY;
  at::Tensor pos = at::arange(10, at::kLong);
  for (int64_t l = 0; l < 3; ++l) acc.on_tap(Tap::QNorm, TapContext{l, cfg.layer_types[l], pos}, q);
  auto msg = what_of([&] { calib::finish_sigma_q(acc, cfg, {}); });
  EXPECT_NE(msg.find("layer 0 KV head 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("NaN or Inf"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- encode/decode

TEST(Codec, ErrorDecreasesWithBits) {
  auto cfg = tiny_config(64);
  auto x = kv_like(2, 96, 64, 5);
  for (const std::string base : {"turbo:", "kakeya:", "kakeya:basis=block,", "kakeya:km=4,"}) {
    double prev = 1e9;
    for (int b = 1; b <= 4; ++b) {
      KVCodec c(CodecOptions::parse(base + "b=" + std::to_string(b)), cfg, nullptr, at::kCPU);
      auto e = c.encode(0, Stream::K, x);
      double err = rel_err(x, c.decode(e));
      EXPECT_LT(err, prev) << base << " b=" << b;
      prev = err;
    }
    EXPECT_LT(prev, 0.02) << base << " at 4 bits";
  }
  // Affine and fp8.
  auto err_of = [&](const std::string& s) {
    KVCodec c(CodecOptions::parse(s), cfg, nullptr, at::kCPU);
    return rel_err(x, c.decode(c.encode(1, Stream::V, x)));
  };
  EXPECT_LT(err_of("int8"), err_of("int4"));
  EXPECT_LT(err_of("int4"), err_of("affine:abits=2"));
  EXPECT_LT(err_of("fp8"), 1e-3);
  EXPECT_EQ(err_of("exact"), 0.0);
  // Centring removes the common offset TurboQuant spends bits on.
  EXPECT_LT(err_of("kakeya:b=2"), err_of("turbo:b=2"));
}

TEST(Codec, OutliersAndSinkAreExact) {
  auto cfg = tiny_config(64);
  auto x = kv_like(2, 40, 64, 9);
  KVCodec plain(CodecOptions::parse("kakeya:b=2"), cfg, nullptr, at::kCPU);
  KVCodec out(CodecOptions::parse("kakeya:b=2,t=1.0"), cfg, nullptr, at::kCPU);
  EXPECT_LT(rel_err(x, out.decode(out.encode(0, Stream::V, x))), rel_err(x, plain.decode(plain.encode(0, Stream::V, x))));
  KVCodec sink(CodecOptions::parse("kakeya:b=1,sink=4"), cfg, nullptr, at::kCPU);
  auto y = sink.decode(sink.encode(0, Stream::K, x, nullptr, /*pos0=*/1));
  EXPECT_TRUE(at::equal(y.slice(1, 0, 3), x.slice(1, 0, 3)));    // positions 1..3 < sink
  EXPECT_FALSE(at::equal(y.slice(1, 3, 4), x.slice(1, 3, 4)));   // position 4 is coded
}

TEST(Codec, SideInformationBytesHandComputed) {
  auto cfg = tiny_config(16);
  auto x = kv_like(2, 8, 16, 11);  // H=2, N=8, D=16
  auto bytes = [&](const std::string& s) {
    KVCodec c(CodecOptions::parse(s), cfg, nullptr, at::kCPU);
    auto e = c.encode(0, Stream::K, x);
    EXPECT_EQ(e.values(), 2 * 8 * 16);
    return e.bytes();
  };
  // TurboQuant, 3 bits, one block per head: codes 8·16·3/8 = 48, norms 8·2 = 16, norm scale 4 -> 68 per head.
  EXPECT_EQ(bytes("turbo:b=3,block=0"), 2 * 68);
  // + per-block f16 mean (16·2 = 32).
  EXPECT_EQ(bytes("kakeya:b=3,block=0"), 2 * 100);
  // Per-block PCA basis f16 [16, 16] = 512; groups 8 dims at 4 bits + 8 at 2 bits:
  // codes 8·8·4/8 + 8·8·2/8 = 48, two pieces' norms 2·(16 + 4) = 40, mean 32 -> 632.
  EXPECT_EQ(bytes("kakeya:basis=block,deff=8,b=4,tb=2,block=0"), 2 * 632);
  // Dropping the tail: basis only [16, 8] = 256; codes 32; norms 20; mean 32 -> 340.
  EXPECT_EQ(bytes("kakeya:basis=block,deff=8,b=4,tb=0,block=0"), 2 * 340);
  // A 12-wide group (random orthogonal rotation, no padding): codes 8·12·3/8 = 36, norm 20, mean 32 -> 88.
  EXPECT_EQ(bytes("kakeya:deff=12,b=3,block=0"), 2 * 88);
  // Blocks of 3 tokens: 3 + 3 + 2; each block: mean 32 + nscale 4 + norms 2n + codes ceil(n·16·3/8) = 6n.
  EXPECT_EQ(bytes("kakeya:b=3,block=3"), 2 * ((36 + 6 + 18) * 2 + (36 + 4 + 12)));
  // Spherical k-means, 4 clusters: centroids f16 [4, 16] = 128, index 2 bits · 8 = 2 bytes, scales 16 -> +146.
  EXPECT_EQ(bytes("kakeya:b=3,km=4,block=0"), 2 * (100 + 146));
  // int4, group 8: codes 8·16·4/8 = 64, f16 scale + zero per group: 8·2·2·2 = 64 -> 128 per head.
  EXPECT_EQ(bytes("int4:group=8"), 2 * 128);
  // int8, group 16: 128 + 8·1·4 = 160. fp8: 128 + 4.
  EXPECT_EQ(bytes("int8:group=16"), 2 * 160);
  EXPECT_EQ(bytes("fp8"), 2 * 132);
  // Exact counts as bf16; a sink of 2 positions is exact too.
  EXPECT_EQ(bytes("exact"), 2 * 8 * 16 * 2);
  EXPECT_EQ(bytes("turbo:b=3,block=0,sink=2"), 2 * (2 * 16 * 2 + 6 * 6 + 12 + 4));
  // Outliers: 4-byte index + 2-byte value each.
  KVCodec c(CodecOptions::parse("turbo:b=3,block=0,t=1.5"), cfg, nullptr, at::kCPU);
  auto e = c.encode(0, Stream::K, x);
  int64_t n_out = 0;
  for (const auto& b : e.blocks) n_out += b.get("out_idx.0").numel();
  EXPECT_GT(n_out, 0);
  EXPECT_EQ(e.bytes(), 2 * 68 + 6 * n_out);
  EXPECT_NEAR(e.bits_per_value(), 8.0 * e.bytes() / 256, 1e-12);
}

TEST(Codec, BadSpecsAndShapesAreRefused) {
  auto cfg = tiny_config(16);
  EXPECT_NE(what_of([] { CodecOptions::parse("kakeya:kb=5"); }).find("kb must be in 1..4"), std::string::npos);
  EXPECT_NE(what_of([] { CodecOptions::parse("kakeya:vb=0"); }).find("vb must be in 1..4"), std::string::npos);
  EXPECT_NE(what_of([] { CodecOptions::parse("turbo:frobnicate=1"); }).find("unknown key 'frobnicate'"), std::string::npos);
  EXPECT_NE(what_of([] { CodecOptions::parse("zip"); }).find("unknown codec 'zip'"), std::string::npos);
  EXPECT_NE(what_of([] { CodecOptions::parse("kakeya:vqp=1"); }).find("K only"), std::string::npos);
  // Wrong head dims: a [H, N, 8] tensor for a layer with head_dim 16.
  KVCodec c(CodecOptions::parse("turbo:b=2"), cfg, nullptr, at::kCPU);
  auto msg = what_of([&] { c.encode(0, Stream::K, at::randn({2, 4, 8})); });
  EXPECT_NE(msg.find("expects [H_kv=2, N, D=16]"), std::string::npos) << msg;
  msg = what_of([&] { KVCodec(CodecOptions::parse("kakeya:deff=32"), cfg, nullptr, at::kCPU); });
  EXPECT_NE(msg.find("exceeds layer 0's head_dim 16"), std::string::npos) << msg;
  msg = what_of([&] { KVCodec(CodecOptions::parse("kakeya:g=8:4+4:2"), cfg, nullptr, at::kCPU); });
  EXPECT_NE(msg.find("cover 12 coordinates"), std::string::npos) << msg;
  // Needing a bundle without one.
  msg = what_of([&] { KVCodec(CodecOptions::parse("kakeya:kqp=1"), cfg, nullptr, at::kCPU); });
  EXPECT_NE(msg.find("--bundle"), std::string::npos) << msg;
  auto x = at::randn({2, 4, 16});
  x[1][2][3] = NAN;
  EXPECT_NE(what_of([&] { c.encode(0, Stream::V, x); }).find("NaN or Inf"), std::string::npos);
}

// ---------------------------------------------------------------- bundles

TEST(CalibBundle, RefusesAnotherModelAndWrongShapes) {
  auto cfg = tiny_config(16), other = tiny_config(32);
  auto dir = temp_dir("bundle");
  CalibBundle::prepare_dir(dir, cfg);
  // Σ_q with the right shapes loads; Another model's config is refused by name and field.
  std::map<std::string, at::Tensor> t;
  for (int l = 0; l < 3; ++l) {
    auto p = "layer_" + std::to_string(l) + "_";
    t[p + "chol"] = at::eye(16).expand({2, 16, 16}).contiguous();
    t[p + "inv_chol"] = t[p + "chol"];
    t[p + "sigma"] = t[p + "chol"];
  }
  save_safetensors(dir + "/q_calib.safetensors", t);
  CalibBundle::update_manifest(dir, cfg, "sigma_q", {{"file", "q_calib.safetensors"}});
  auto b = CalibBundle::load(dir, cfg);
  EXPECT_TRUE(b.has_sigma_q());
  auto msg = what_of([&] { CalibBundle::load(dir, other); });
  EXPECT_NE(msg.find(dir + "/manifest.json: field 'model.config_hash'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("another model"), std::string::npos) << msg;
  EXPECT_NE(what_of([&] { CalibBundle::prepare_dir(dir, other); }).find("another model"), std::string::npos);
  // A manifest that claims this model but tensors of other head dims: error names file and tensor.
  t["layer_1_chol"] = at::eye(8).expand({2, 8, 8}).contiguous();
  save_safetensors(dir + "/q_calib.safetensors", t);
  msg = what_of([&] { CalibBundle::load(dir, cfg); });
  EXPECT_NE(msg.find("q_calib.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("layer_1_chol"), std::string::npos) << msg;
  // Codebook tables: wrong byte size and non-ascending entries are refused.
  CalibBundle::update_manifest(dir, cfg, "sigma_q", {{"file", "q_calib.safetensors"}});
  t["layer_1_chol"] = t["layer_0_chol"];
  save_safetensors(dir + "/q_calib.safetensors", t);
  CalibBundle::update_manifest(dir, cfg, "codebook", {{"streams", {"k"}}, {"bits", {1}}});
  CalibBundle::write_f32(dir + "/codebook_k_b1.f32", {-1, 1, -1, 1});  // 2 rows short
  msg = what_of([&] { CalibBundle::load(dir, cfg); });
  EXPECT_NE(msg.find("codebook_k_b1.f32: expected 6 little-endian f32 values"), std::string::npos) << msg;
  CalibBundle::write_f32(dir + "/codebook_k_b1.f32", {-1, 1, -1, 1, 1, -1});
  msg = what_of([&] { CalibBundle::load(dir, cfg); });
  EXPECT_NE(msg.find("row 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ascending"), std::string::npos) << msg;
  CalibBundle::write_f32(dir + "/codebook_k_b1.f32", {-1, 1, -2, 2, -0.5f, 0.5f});
  b = CalibBundle::load(dir, cfg);
  EXPECT_EQ(b.codebook('k', 1, 1).centroids[1], 2.0f);
  EXPECT_NE(what_of([&] { b.codebook('v', 1, 0); }).find("no calibrated v codebook"), std::string::npos);
  // Little-endian on disk, whatever the host.
  std::ifstream f(dir + "/codebook_k_b1.f32", std::ios::binary);
  unsigned char raw[4];
  f.read((char*)raw, 4);
  EXPECT_EQ(raw[3], 0xBF);  // -1.0f = 0xBF800000
  EXPECT_EQ(raw[2], 0x80);
}

// ---------------------------------------------------------------- end to end

// The tiny random Gemma 3 of tests/fixtures/make_model_fixtures.py: calibrate
// Σ_q, bases and codebooks through the taps, then Scenario A on random tokens.
TEST(CodecEval, EndToEndOnTinyModel) {
  auto model = tiny_model("gemma3", 128);
  const auto& cfg = model.config();
  auto ids = random_ids(cfg, 600, 21);
  auto dir = temp_dir("e2e");

  calib::SigmaQAccumulator acc(cfg, at::kCPU);
  Taps taps;
  taps.subscribe(&acc);
  EXPECT_EQ(calib::run_windows(model, ids, 40, 400, cfg.bos_token_id, taps), 400);
  calib::save_sigma_q(dir, cfg, calib::finish_sigma_q(acc, cfg, {}), {{"data", "random ids"}});

  calib::KVCapture cap(cfg);
  Taps t2;
  t2.subscribe(&cap);
  calib::run_windows(model, ids, 40, 400, cfg.bos_token_id, t2);
  EXPECT_EQ(cap.k(0).size(), 11u);  // ceil(400 / 39) windows (each BOS + 39 tokens)
  auto b0 = CalibBundle::load(dir, cfg);
  calib::BasisOptions bo;
  bo.block = 16;
  calib::fit_bases(dir, cfg, cap, b0, bo, {});
  auto b1 = CalibBundle::load(dir, cfg);
  auto spec = CodecOptions::parse("kakeya:kqp=1,kbasis=calib,kdeff=8,kb=4,vbasis=calib,vb=3,block=16");
  KVCodec fit_codec(spec, cfg, &b1, at::kCPU);
  // Water-filling on the calibrated spectrum: groups cover D, spend at most alloc·D bits,
  // and bits never increase along the (descending) spectrum.
  KVCodec wf(CodecOptions::parse("kakeya:vbasis=calib,valloc=2.5,vaq=2"), cfg, &b1, at::kCPU);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    int64_t width = 0, bits = 0, prev = 4;
    for (const auto& g : wf.layer_groups(l, Stream::V)) {
      width += g.width;
      bits += g.width * g.bits;
      EXPECT_LE(g.bits, prev);
      prev = g.bits;
    }
    EXPECT_EQ(width, 16);
    EXPECT_LE(bits, 40);
    EXPECT_GE(bits, 36);
  }
  EXPECT_NE(what_of([&] { KVCodec(CodecOptions::parse("kakeya:valloc=2"), cfg, &b1, at::kCPU); }).find("vbasis=calib"),
            std::string::npos);
  calib::CodebookOptions cbo;
  auto summary = calib::fit_codebooks(dir, cfg, cap, fit_codec, cbo, {});
  EXPECT_GT(summary["streams"]["k"]["b2"]["gain_mean"].get<double>(), 0.9);
  auto bundle = CalibBundle::load(dir, cfg);
  EXPECT_TRUE(bundle.has_codebooks('k') && bundle.has_codebooks('v') && bundle.has_basis());

  std::vector<std::vector<int64_t>> passages;
  for (int p = 0; p < 2; ++p) {
    std::vector<int64_t> ps{cfg.bos_token_id};
    ps.insert(ps.end(), ids.begin() + 400 + 40 * p, ids.begin() + 400 + 40 * p + 37);
    passages.push_back(ps);
  }
  calib::CodecEvalOptions ev;
  ev.context = 24;
  ev.n_eval = 12;
  ev.chunk = 5;
  std::vector<CodecOptions> codecs;
  for (const char* s : {"exact", "kakeya:kqp=1,kbasis=calib,kdeff=8,kb=4,vbasis=calib,valloc=3,block=16,cal=1,sink=1", "turbo:kb=4,vb=4",
                        "turbo:kb=1,vb=1", "int4:group=16", "int8:group=16", "fp8"})
    codecs.push_back(CodecOptions::parse(s));
  auto res = calib::codec_eval(model, passages, codecs, &bundle, ev);
  ASSERT_EQ(res.rows.size(), codecs.size());
  EXPECT_EQ(res.rebuild_max_abs_logit_diff, 0.0);  // the rebuilt uncoded cache is the prefill cache
  const auto& exact = res.rows[0];
  EXPECT_EQ(exact.pooled().dppl(), 0.0);
  EXPECT_EQ(exact.pooled().top1, 1.0);
  EXPECT_NEAR(exact.ratio(), 1.0, 1e-12);
  EXPECT_GT(res.rows[1].ratio(), 2.0);
  EXPECT_GT(res.rows[1].shared_bytes, 0);
  // 1-bit TurboQuant disturbs the model more than 8-bit affine does.
  EXPECT_GT(res.rows[3].pooled().kl, res.rows[5].pooled().kl);
  EXPECT_GT(res.rows[3].ratio(), res.rows[2].ratio());
  auto j = res.to_json();
  EXPECT_EQ(j["rows"].size(), codecs.size());
  EXPECT_EQ(j["rows"][0]["passages"].size(), 2u);
  // --streams k leaves V exact.
  ev.streams = "k";
  auto rk = calib::codec_eval(model, {passages[0]}, {codecs[2]}, &bundle, ev);
  EXPECT_GT(rk.rows[0].bytes_by_field["v.raw"], 0);
  EXPECT_EQ(rk.rows[0].bytes_by_field.count("k.raw"), 0u);
}

// ---------------------------------------------------------------- cache entry point

// encode_kv/decode_kv take and return post-RoPE K as a KV cache holds it and code it pre-RoPE.
TEST(Codec, CacheEntryPointCodesPreRopeK) {
  auto cfg = tiny_config(16);
  const int64_t l = 1, pos0 = 5, N = 20;
  RopeTable rope(cfg.rope(l), 16, 64, at::kFloat, at::kCPU);
  auto k = kv_like(2, N, 16, 31), v = kv_like(2, N, 16, 32);                                  // [H, N, D] pre-RoPE
  auto pos = at::arange(pos0, pos0 + N, at::kLong);
  auto k_rope = rope.apply(k.permute({1, 0, 2}).unsqueeze(0), pos).squeeze(0).permute({1, 0, 2});  // as cached
  KVCodec exact(CodecOptions::parse("exact"), cfg, nullptr, at::kCPU);
  auto e = exact.encode_kv(l, k_rope, v, pos0, rope);
  EXPECT_EQ(e.bytes(), 2 * 2 * N * 16 * 2);  // bf16 accounting
  auto [k0, v0] = exact.decode_kv(e, rope, at::kFloat);
  EXPECT_TRUE(at::allclose(k0, k_rope, 1e-5, 1e-5));
  EXPECT_TRUE(at::equal(v0, v));
  // A lossy codec sees exactly the pre-RoPE K it would see from the taps (codec-eval's path).
  KVCodec c(CodecOptions::parse("kakeya:b=3,sink=7"), cfg, nullptr, at::kCPU);
  auto ce = c.encode_kv(l, k_rope, v, pos0, rope);
  auto ek = c.encode(l, Stream::K, k, nullptr, pos0), ev = c.encode(l, Stream::V, v, nullptr, pos0);
  EXPECT_EQ(ce.bytes(), ek.bytes() + ev.bytes());
  auto [kh, vh] = c.decode_kv(ce, rope, at::kFloat);
  auto want = rope.apply(c.decode(ek).permute({1, 0, 2}).unsqueeze(0), pos).squeeze(0).permute({1, 0, 2});
  EXPECT_TRUE(at::allclose(kh, want, 1e-4, 1e-4));
  EXPECT_TRUE(at::allclose(vh, c.decode(ev), 1e-6, 1e-6));
  // sink=7 counts from pos0 = 5: the block's first two tokens are exact.
  EXPECT_TRUE(at::allclose(kh.slice(1, 0, 2), k_rope.slice(1, 0, 2), 1e-5, 1e-5));
  EXPECT_GT(rel_err(k_rope.slice(1, 2), kh.slice(1, 2)), 1e-4);
  EXPECT_NE(what_of([&] { c.encode_kv(l, k_rope, v.slice(1, 1), pos0, rope); }).find("one shape"), std::string::npos);
  EXPECT_NE(what_of([&] { c.encode_kv(l, k_rope, v, 60, rope); }).find("RoPE table"), std::string::npos);
}

// Gemma 4: full layers have their own KV head count and head dim (tiny fixture: sliding 2 × 16,
// full 1 × 32). Σ_q, bases, codebooks and Scenario A all follow the layer's shapes.
TEST(CodecEval, PerLayerKVHeadsGemma4) {
  auto model = tiny_model("gemma4", 64);
  const auto& cfg = model.config();
  ASSERT_NE(cfg.kv_heads(0), cfg.kv_heads(2));
  ASSERT_NE(cfg.layer_head_dim[0], cfg.layer_head_dim[2]);
  auto ids = random_ids(cfg, 300, 22);
  auto dir = temp_dir("g4");
  calib::SigmaQAccumulator acc(cfg, at::kCPU);
  calib::KVCapture cap(cfg);
  Taps taps;
  taps.subscribe(&acc);
  taps.subscribe(&cap);
  calib::run_windows(model, ids, 32, 200, cfg.bos_token_id, taps);
  calib::SigmaQOptions so;
  so.rope_offsets = 16;  // proportional partial RoPE on the full layers
  calib::save_sigma_q(dir, cfg, calib::finish_sigma_q(acc, cfg, so), {});
  calib::fit_bases(dir, cfg, cap, CalibBundle::load(dir, cfg), {}, {});
  auto b1 = CalibBundle::load(dir, cfg);
  KVCodec fit(CodecOptions::parse("kakeya:kqp=1,kbasis=calib,kalloc=3,vbasis=calib,vb=3"), cfg, &b1, at::kCPU);
  calib::fit_codebooks(dir, cfg, cap, fit, {}, {});
  auto bundle = CalibBundle::load(dir, cfg);
  for (int64_t l : {0, 2}) {
    const int64_t H = cfg.kv_heads(l), D = cfg.layer_head_dim[l];
    EXPECT_EQ(bundle.chol(l).sizes(), (std::vector<int64_t>{H, D, D})) << l;
    EXPECT_EQ(bundle.basis(l, "kw").sizes(), (std::vector<int64_t>{H, D, D})) << l;
  }
  std::vector<std::vector<int64_t>> passages{std::vector<int64_t>(ids.begin() + 200, ids.begin() + 240)};
  passages[0][0] = cfg.bos_token_id;
  calib::CodecEvalOptions ev;
  ev.context = 24;
  ev.n_eval = 12;
  auto res = calib::codec_eval(model, passages,
                               {CodecOptions::parse("exact"),
                                CodecOptions::parse("kakeya:kqp=1,kbasis=calib,kalloc=3,vbasis=calib,vb=3,cal=1")},
                               &bundle, ev);
  EXPECT_EQ(res.rows[0].pooled().dppl(), 0.0);
  EXPECT_GT(res.rows[1].ratio(), 3.0);
  EXPECT_TRUE(std::isfinite(res.rows[1].pooled().kl));
  EXPECT_GT(res.rows[1].pooled().kl, 0.0);
}

// K weights of weighted row codes (pwB) on the tiny Gemma 3: the accumulator's taps against the
// queries and keys captured on their own (Σ_q's diagonal; pre-RoPE K through the model's RoPE,
// less each window's mean past the sink), then the bundle round trip.
TEST(Codec, KWeightsMatchCapturedQueriesAndKeys) {
  auto model = tiny_model("gemma3", 128);
  const auto& cfg = model.config();
  auto ids = random_ids(cfg, 300, 5);
  const int64_t sink = 2;
  calib::KWeightAccumulator acc(model, sink);
  calib::SigmaQAccumulator sq(cfg, at::kCPU);
  calib::KVCapture cap(cfg);
  Taps taps;
  taps.subscribe(&acc);
  taps.subscribe(&sq);
  taps.subscribe(&cap);
  calib::run_windows(model, ids, 50, 300, cfg.bos_token_id, taps);
  const double power = 0.75;
  auto r = calib::finish_k_weights(acc, cfg, power);
  int64_t full = 0;
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    if (cfg.is_sliding(l)) {
      EXPECT_FALSE(r.weight[l].defined()) << "sliding layer " << l;
      continue;
    }
    ++full;
    const int64_t D = cfg.layer_head_dim[l], h = D / 2;
    auto q = at::diagonal(sq.sum(l), 0, 1, 2) / (double)sq.count(l);  // [H, D]
    at::Tensor k = at::zeros_like(q);
    int64_t n = 0;
    for (const at::Tensor& kw : cap.k(l)) {  // [H, T, D] pre-RoPE
      const int64_t T = kw.size(1);
      auto kr = model.rope(l).apply(kw.permute({1, 0, 2}).unsqueeze(0), at::arange(T, at::kLong))[0].to(at::kDouble);  // [T, H, D]
      auto kept = kr.slice(0, sink, T);
      k += (kept - kept.mean(0, true)).pow(2).sum(0);
      n += T - sink;
    }
    k = k / (double)n;
    auto pair = [&](const at::Tensor& e) { auto s = e.slice(1, 0, h) + e.slice(1, h, D); return at::cat({s, s}, 1); };
    auto w = (pair(q) / pair(k)).pow(power / 4);
    w = w / w.pow(2).mean(1, true).sqrt();
    EXPECT_TRUE(at::allclose(r.weight[l].to(at::kDouble), w, 1e-4, 1e-5)) << "layer " << l;
    EXPECT_TRUE(r.weight[l].slice(1, 0, h).equal(r.weight[l].slice(1, h, D))) << "RoPE pairs share a weight";
    EXPECT_GT((r.weight[l].max() / r.weight[l].min()).item<double>(), 1.05) << "weights that weigh nothing";
  }
  ASSERT_GT(full, 0) << "the fixture has no full-attention layer";
  auto dir = temp_dir("kw");
  CalibBundle::prepare_dir(dir, cfg);
  test::expect_error([&] { CalibBundle::load_k_weights(dir, cfg); }, "bundle has no K weights");
  calib::save_k_weights(dir, cfg, r, {{"data", "random ids"}});
  auto b = CalibBundle::load(dir, cfg);
  ASSERT_TRUE(b.has_k_weights());
  const auto alone = CalibBundle::load_k_weights(dir, cfg);  // what the decoder reads
  ASSERT_EQ((int64_t)alone.size(), cfg.num_layers);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    if (cfg.is_sliding(l)) {
      test::expect_error([&] { b.k_weight(l); }, "no K weights for layer " + std::to_string(l));
      EXPECT_FALSE(alone[l].defined());
    } else {
      EXPECT_TRUE(b.k_weight(l).equal(r.weight[l]));
      EXPECT_TRUE(alone[l].equal(r.weight[l]));
    }
  }
  test::expect_error([&] { calib::finish_k_weights(acc, cfg, 0.0); }, "--power expected in (0, 4]");
}

// The shipped bundle (checkpoints/gemma3-270m/calib, made on the H100) loads for the real model,
// and the release recipe it names codes that model's K/V shapes at its advertised ratio.
TEST(CalibBundle, ShippedBundleLoadsAndCodesTheReleaseRecipe) {
  auto cfg = ModelConfig::from_file(test::real_model_dir() + "/config.json");
  const std::string dir = test::shipped_dir("calib");
  auto bundle = CalibBundle::load(dir, cfg);
  EXPECT_TRUE(bundle.has_basis());
  const std::string recipe = "kakeya:sink=1,kbasis=calib,kalloc=3.3,vbasis=calib,valloc=3";
  EXPECT_EQ(bundle.manifest()["entries"]["release"]["recipe"], "ours");
  KVCodec c(CodecOptions::parse(recipe), cfg, &bundle, at::kCPU);
  const int64_t l = 3, N = 512, D = cfg.layer_head_dim[l], H = cfg.kv_heads(l);
  auto v = at::randn({H, N, D}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));  // [H, N, D]
  auto e = c.encode(l, Stream::V, v, nullptr, 0);
  const double ratio = (double)(H * N * D * 2) / (double)e.bytes();  // vs bf16
  EXPECT_GT(ratio, 4.5) << "release ratio was 4.74x";
  EXPECT_LT(rel_err(v, c.decode(e)), 0.5);
}
