#include "calib/codec/codec.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "core/error.h"
#include "calib/codec/lloyd_max.h"
#include "calib/codec/wht.h"

#include <ATen/CPUGeneratorImpl.h>

namespace kakeya {

const char* stream_name(Stream s) { return s == Stream::K ? "k" : "v"; }

// ---------------------------------------------------------------- options

std::vector<BitGroup> StreamOptions::resolved_groups(int64_t D) const {
  if (!groups.empty()) return groups;
  const int64_t lead = d_eff > 0 ? std::min(d_eff, D) : D;
  std::vector<BitGroup> g{{lead, bits}};
  if (lead < D) g.push_back({D - lead, tail_bits});
  return g;
}

namespace {

bool parse_bool(const std::string& spec, const std::string& key, const std::string& v) {
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  KAKEYA_FAIL("codec '" << spec << "': " << key << " expects 0/1, got '" << v << "'");
}

int64_t parse_int(const std::string& spec, const std::string& key, const std::string& v) {
  try {
    size_t n = 0;
    long long x = std::stoll(v, &n, 0);
    if (n == v.size()) return x;
  } catch (...) {
  }
  KAKEYA_FAIL("codec '" << spec << "': " << key << " expects an integer, got '" << v << "'");
}

double parse_double(const std::string& spec, const std::string& key, const std::string& v) {
  try {
    size_t n = 0;
    double x = std::stod(v, &n);
    if (n == v.size()) return x;
  } catch (...) {
  }
  KAKEYA_FAIL("codec '" << spec << "': " << key << " expects a number, got '" << v << "'");
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\n"), b = s.find_last_not_of(" \t\n");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

const std::set<std::string> kStreamKeys = {"b",   "deff", "tb", "g",  "alloc", "aq",     "basis", "rsvd", "os", "pi",
                                           "km",  "kmi",  "wht", "t", "nc",    "cal",    "center", "qp",   "on"};
const std::set<std::string> kGlobalKeys = {"block", "skip", "sink", "seed", "group", "abits", "label"};

void set_stream_key(const std::string& spec, StreamOptions& so, const std::string& key, const std::string& full,
                    const std::string& v) {
  auto bits_in = [&](int lo, int hi) {
    int64_t b = parse_int(spec, full, v);
    KAKEYA_CHECK(b >= lo && b <= hi, "codec '" << spec << "': " << full << " must be in " << lo << ".." << hi
                                               << " bits, got " << b);
    return (int)b;
  };
  if (key == "b") so.bits = bits_in(1, 4);
  else if (key == "deff") {
    so.d_eff = parse_int(spec, full, v);
    KAKEYA_CHECK(so.d_eff >= 0, "codec '" << spec << "': " << full << " must be >= 0");
  } else if (key == "tb") so.tail_bits = bits_in(0, 4);
  else if (key == "g") {
    so.groups.clear();
    for (const auto& part : split(v, '+')) {
      auto wb = split(part, ':');
      KAKEYA_CHECK(wb.size() == 2, "codec '" << spec << "': " << full << " expects WIDTH:BITS+WIDTH:BITS..., got '" << v << "'");
      BitGroup g{parse_int(spec, full, wb[0]), (int)parse_int(spec, full, wb[1])};
      KAKEYA_CHECK(g.width > 0, "codec '" << spec << "': " << full << " group width must be > 0");
      KAKEYA_CHECK(g.bits >= 0 && g.bits <= 4, "codec '" << spec << "': " << full << " group bits must be in 0..4, got " << g.bits);
      so.groups.push_back(g);
    }
  } else if (key == "alloc") {
    so.alloc = parse_double(spec, full, v);
    KAKEYA_CHECK(so.alloc >= 0 && so.alloc <= 4, "codec '" << spec << "': " << full << " (average bits) must be in 0..4, got " << v);
  } else if (key == "aq") {
    so.alloc_quantum = parse_int(spec, full, v);
    KAKEYA_CHECK(so.alloc_quantum >= 1, "codec '" << spec << "': " << full << " must be >= 1");
  } else if (key == "basis") {
    if (v == "none") so.basis = BasisSource::None;
    else if (v == "block") so.basis = BasisSource::Block;
    else if (v == "calib" || v == "shared") so.basis = BasisSource::Calib;
    else KAKEYA_FAIL("codec '" << spec << "': " << full << " expects none|block|calib, got '" << v << "'");
  } else if (key == "rsvd") so.rsvd = parse_bool(spec, full, v);
  else if (key == "os") so.rsvd_oversample = parse_int(spec, full, v);
  else if (key == "pi") so.rsvd_power_iters = parse_int(spec, full, v);
  else if (key == "km") {
    so.kmeans = parse_int(spec, full, v);
    KAKEYA_CHECK(so.kmeans >= 0 && so.kmeans <= 256, "codec '" << spec << "': " << full << " must be in 0..256");
  } else if (key == "kmi") so.kmeans_iters = parse_int(spec, full, v);
  else if (key == "wht") so.wht = parse_bool(spec, full, v);
  else if (key == "t") {
    so.outlier_t = parse_double(spec, full, v);
    KAKEYA_CHECK(so.outlier_t >= 0, "codec '" << spec << "': " << full << " must be >= 0 (0: off)");
  } else if (key == "nc") so.norm_correction = parse_bool(spec, full, v);
  else if (key == "cal") so.calibrated = parse_bool(spec, full, v);
  else if (key == "center") so.center = parse_bool(spec, full, v);
  else if (key == "qp") so.q_precond = parse_bool(spec, full, v);
  else if (key == "on") so.coded = parse_bool(spec, full, v);
}

std::string basis_name(BasisSource b) {
  return b == BasisSource::None ? "none" : b == BasisSource::Block ? "block" : "calib";
}

}  // namespace

CodecOptions CodecOptions::parse(const std::string& spec_in) {
  const std::string spec = trim(spec_in);
  CodecOptions o;
  o.label = spec;
  auto colon = spec.find(':');
  const std::string name = trim(spec.substr(0, colon));
  const std::string args = colon == std::string::npos ? "" : spec.substr(colon + 1);
  if (name == "exact" || name == "none" || name == "bf16") {
    o.kind = CodecKind::Exact;
    o.k.coded = o.v.coded = false;
  } else if (name == "kakeya" || name == "ours") {
    o.kind = CodecKind::Kakeya;
  } else if (name == "turbo") {
    // TurboQuant-style: the raw vector, rotated, per-token norm, Gaussian tables.
    o.kind = CodecKind::Turbo;
    for (StreamOptions* so : {&o.k, &o.v}) {
      so->center = false;
      so->basis = BasisSource::None;
      so->wht = true;
      so->norm_correction = true;
    }
  } else if (name == "int4" || name == "int8" || name == "affine") {
    o.kind = CodecKind::Affine;
    o.affine_bits = name == "int8" ? 8 : 4;
  } else if (name == "fp8") {
    o.kind = CodecKind::Fp8;
  } else {
    KAKEYA_FAIL("codec '" << spec << "': unknown codec '" << name << "' (expected exact, kakeya, turbo, int4, int8, fp8)");
  }
  if (!trim(args).empty()) {
    for (const auto& kv_raw : split(args, ',')) {
      const std::string kv = trim(kv_raw);
      if (kv.empty()) continue;
      auto eq = kv.find('=');
      KAKEYA_CHECK(eq != std::string::npos, "codec '" << spec << "': expected key=value, got '" << kv << "'");
      const std::string key = trim(kv.substr(0, eq)), v = trim(kv.substr(eq + 1));
      if (kGlobalKeys.count(key)) {
        if (key == "block") {
          o.block = parse_int(spec, key, v);
          KAKEYA_CHECK(o.block >= 0, "codec '" << spec << "': block must be >= 0 (0: one block per layer)");
        } else if (key == "skip") {
          o.boundary_layers.clear();
          if (!v.empty() && v != "none")
            for (const auto& l : split(v, '/')) o.boundary_layers.push_back(parse_int(spec, key, l));
        } else if (key == "sink") {
          o.sink = parse_int(spec, key, v);
          KAKEYA_CHECK(o.sink >= 0, "codec '" << spec << "': sink must be >= 0");
        } else if (key == "seed") {
          o.seed = (uint64_t)parse_int(spec, key, v);
        } else if (key == "group") {
          o.affine_group = parse_int(spec, key, v);
          KAKEYA_CHECK(o.affine_group > 0, "codec '" << spec << "': group must be > 0");
        } else if (key == "abits") {
          o.affine_bits = (int)parse_int(spec, key, v);
          KAKEYA_CHECK(o.affine_bits >= 2 && o.affine_bits <= 8, "codec '" << spec << "': abits must be in 2..8, got " << o.affine_bits);
        } else if (key == "label") {
          o.label = v;
        }
      } else if (kStreamKeys.count(key)) {
        set_stream_key(spec, o.k, key, key, v);
        set_stream_key(spec, o.v, key, key, v);
      } else if ((key[0] == 'k' || key[0] == 'v') && kStreamKeys.count(key.substr(1))) {
        set_stream_key(spec, key[0] == 'k' ? o.k : o.v, key.substr(1), key, v);
      } else {
        KAKEYA_FAIL("codec '" << spec << "': unknown key '" << key
                              << "' (global: block skip sink seed group abits label; per stream, k/v-prefixed or not: "
                                 "b deff tb g alloc aq basis rsvd os pi km kmi wht t nc cal center qp on)");
      }
    }
  }
  KAKEYA_CHECK(!o.v.q_precond, "codec '" << spec << "': qp (Σ_q preconditioning) applies to K only: V does not contract with q");
  if (o.kind == CodecKind::Turbo || o.kind == CodecKind::Exact || o.kind == CodecKind::Affine || o.kind == CodecKind::Fp8)
    KAKEYA_CHECK(!o.k.q_precond, "codec '" << spec << "': qp is a kakeya option");
  return o;
}

bool CodecOptions::is_boundary(int64_t layer) const {
  return std::find(boundary_layers.begin(), boundary_layers.end(), layer) != boundary_layers.end();
}

std::string CodecOptions::describe() const {
  std::ostringstream os;
  switch (kind) {
    case CodecKind::Exact: return "exact";
    case CodecKind::Affine: os << "affine:abits=" << affine_bits << ",group=" << affine_group; break;
    case CodecKind::Fp8: os << "fp8:e4m3,scale=per-block-f32"; break;
    case CodecKind::Kakeya:
    case CodecKind::Turbo: {
      os << (kind == CodecKind::Kakeya ? "kakeya:" : "turbo:") << "block=" << block;
      for (Stream s : {Stream::K, Stream::V}) {
        const auto& so = stream(s);
        const std::string p = stream_name(s);
        if (!so.coded) {
          os << "," << p << "on=0";
          continue;
        }
        os << "," << p << "g=";
        auto g = so.resolved_groups(-1);
        if (so.alloc > 0) {
          os << "alloc" << so.alloc << "/q" << so.alloc_quantum;
        } else if (so.groups.empty()) {
          os << (so.d_eff > 0 ? std::to_string(so.d_eff) : std::string("D")) << ":" << so.bits;
          if (so.d_eff > 0) os << "+rest:" << so.tail_bits;
        } else {
          for (size_t i = 0; i < g.size(); ++i) os << (i ? "+" : "") << g[i].width << ":" << g[i].bits;
        }
        os << "," << p << "basis=" << basis_name(so.basis);
        if (so.basis == BasisSource::Block && so.rsvd)
          os << "," << p << "rsvd=1," << p << "os=" << so.rsvd_oversample << "," << p << "pi=" << so.rsvd_power_iters;
        os << "," << p << "km=" << so.kmeans << "," << p << "wht=" << so.wht << "," << p << "t=" << so.outlier_t << ","
           << p << "nc=" << so.norm_correction << "," << p << "cal=" << so.calibrated << "," << p << "center="
           << so.center;
        if (s == Stream::K) os << ",kqp=" << so.q_precond;
      }
    }
  }
  if (sink > 0) os << ",sink=" << sink;
  if (!boundary_layers.empty()) {
    os << ",skip=";
    for (size_t i = 0; i < boundary_layers.size(); ++i) os << (i ? "/" : "") << boundary_layers[i];
  }
  return os.str();
}

// ---------------------------------------------------------------- encoded data

int64_t EncodedBlock::bytes() const {
  int64_t b = 0;
  for (const auto& f : fields) b += f.first == "raw" ? f.second.numel() * 2 : f.second.numel() * f.second.element_size();
  return b;
}

const at::Tensor& EncodedBlock::get(const std::string& name) const {
  for (const auto& f : fields)
    if (f.first == name) return f.second;
  KAKEYA_FAIL("encoded block: no field '" << name << "'");
}

bool EncodedBlock::has(const std::string& name) const {
  for (const auto& f : fields)
    if (f.first == name) return true;
  return false;
}

int64_t EncodedLayer::bytes() const {
  int64_t b = 0;
  for (const auto& blk : blocks) b += blk.bytes();
  return b;
}

std::map<std::string, int64_t> EncodedLayer::bytes_by_field() const {
  std::map<std::string, int64_t> m;
  for (const auto& blk : blocks)
    for (const auto& f : blk.fields) {
      std::string n = f.first.substr(0, f.first.find('.'));
      m[n] += f.first == "raw" ? f.second.numel() * 2 : f.second.numel() * f.second.element_size();
    }
  return m;
}

// ---------------------------------------------------------------- bit packing

at::Tensor pack_bits(const at::Tensor& idx, int bits) {
  KAKEYA_CHECK(bits >= 1 && bits <= 8, "pack_bits: bits must be in 1..8, got " << bits);
  auto v = idx.reshape({-1}).to(at::kLong);
  const int64_t m = v.numel(), mp = (m + 7) / 8 * 8;
  if (mp != m) v = at::constant_pad_nd(v, {0, mp - m}, 0);
  // Eight values -> one integer of 8·bits bits -> `bits` bytes.
  auto shifts = at::arange(8, v.options()) * bits;                  // [8]
  auto acc = at::bitwise_left_shift(v.view({mp / 8, 8}), shifts).sum(1);                // [mp/8] int64, < 2^(8·bits)
  auto bshift = at::arange(bits, v.options()) * 8;                  // [bits]
  auto bytes = at::bitwise_and(at::bitwise_right_shift(acc.unsqueeze(1), bshift), 255).to(at::kByte);  // [mp/8, bits]
  return bytes.reshape({-1}).slice(0, 0, (m * bits + 7) / 8).contiguous();
}

at::Tensor unpack_bits(const at::Tensor& packed, int64_t count, int bits) {
  KAKEYA_CHECK(bits >= 1 && bits <= 8, "unpack_bits: bits must be in 1..8, got " << bits);
  const int64_t mp = (count + 7) / 8 * 8;
  KAKEYA_CHECK(packed.numel() == (count * bits + 7) / 8,
               "unpack_bits: " << packed.numel() << " bytes cannot hold " << count << " values of " << bits << " bits");
  auto b = packed.reshape({-1}).to(at::kLong);
  const int64_t nb = mp / 8 * bits;
  if (b.numel() != nb) b = at::constant_pad_nd(b, {0, nb - b.numel()}, 0);
  auto bshift = at::arange(bits, b.options()) * 8;
  auto acc = at::bitwise_left_shift(b.view({mp / 8, bits}), bshift).sum(1);  // [mp/8]
  auto shifts = at::arange(8, b.options()) * bits;
  auto v = at::bitwise_and(at::bitwise_right_shift(acc.unsqueeze(1), shifts), (1 << bits) - 1);  // [mp/8, 8]
  return v.reshape({-1}).slice(0, 0, count).to(at::kByte);
}

// ---------------------------------------------------------------- codec

namespace {

// Top-r principal directions of the rows of y [n, D] (already centred): [D, r] f32.
at::Tensor block_pca(const at::Tensor& y, int64_t r, const StreamOptions& so, uint64_t seed) {
  const int64_t D = y.size(1);
  if (!so.rsvd) {
    auto eh = at::linalg_eigh(at::matmul(y.t(), y));  // ascending eigenvalues
    return std::get<1>(eh).flip({1}).slice(1, 0, r).contiguous();
  }
  // Halko–Martinsson–Tropp: range finder with power iterations, then an SVD of the small projection.
  const int64_t k = std::min(D, r + so.rsvd_oversample);
  auto gen = at::detail::createCPUGenerator(seed);
  auto omega = at::randn({D, k}, gen, at::TensorOptions().dtype(at::kFloat)).to(y.device());
  auto Y = at::matmul(y, omega);  // [n, k]
  auto Q = std::get<0>(at::linalg_qr(Y));
  for (int64_t i = 0; i < so.rsvd_power_iters; ++i) {
    Q = std::get<0>(at::linalg_qr(at::matmul(y, at::matmul(y.t(), Q))));
  }
  auto B = at::matmul(Q.t(), y);  // [k, D]
  auto vh = std::get<2>(at::linalg_svd(B, /*full_matrices=*/false));  // [k, D]
  auto U = vh.slice(0, 0, r).t().contiguous();  // [D, r]
  if (U.size(1) < r) U = at::constant_pad_nd(U, {0, r - U.size(1)}, 0);
  return U;
}

// Reverse water-filling: integer bits (0..4) per unit of `quantum` consecutive
// PCA coordinates, greedily giving the next bit where it removes the most
// expected squared error (unit energy × Gaussian Lloyd-Max MSE step) per bit,
// until avg_bits · D bits are spent; equal neighbours merge into groups.
std::vector<BitGroup> waterfill(const at::Tensor& eig, double avg_bits, int64_t quantum) {
  auto e = eig.to(at::kDouble).cpu().clamp_min(0);
  const int64_t D = e.numel(), nu = (D + quantum - 1) / quantum;
  std::vector<double> E(nu);
  std::vector<int64_t> w(nu);
  for (int64_t u = 0; u < nu; ++u) {
    w[u] = std::min(quantum, D - u * quantum);
    E[u] = e.slice(0, u * quantum, u * quantum + w[u]).sum().item<double>();
  }
  double m[6] = {1.0, 0, 0, 0, 0, 0};
  for (int b = 1; b <= 4; ++b) m[b] = gaussian_mse(gaussian_codebook(b));
  std::vector<int> bits(nu, 0);
  int64_t budget = std::llround(avg_bits * D), used = 0;
  while (true) {
    int64_t best = -1;
    double gain = 0;
    for (int64_t u = 0; u < nu; ++u)
      if (bits[u] < 4 && used + w[u] <= budget) {
        double g = E[u] * (m[bits[u]] - m[bits[u] + 1]) / w[u];
        if (g > gain) {
          gain = g;
          best = u;
        }
      }
    if (best < 0) break;
    ++bits[best];
    used += w[best];
  }
  std::vector<BitGroup> out;
  for (int64_t u = 0; u < nu; ++u) {
    if (!out.empty() && out.back().bits == bits[u]) out.back().width += w[u];
    else out.push_back({w[u], bits[u]});
  }
  return out;
}

int ceil_log2(int64_t k) {
  int b = 0;
  while ((int64_t(1) << b) < k) ++b;
  return std::max(b, 1);
}

}  // namespace

KVCodec::KVCodec(const CodecOptions& opt, const ModelConfig& cfg, const CalibBundle* bundle, at::Device device)
    : opt_(opt), cfg_(cfg), bundle_(bundle), device_(device) {
  const bool lm = opt.kind == CodecKind::Kakeya || opt.kind == CodecKind::Turbo;
  const int64_t L = cfg.num_layers;
  auto need_bundle = [&](const std::string& what) {
    KAKEYA_CHECK(bundle != nullptr, "codec '" << opt.label << "' needs " << what
                                              << " from a calibration bundle: pass --bundle DIR (made by `kakeya calibrate`)");
  };
  if (!lm) return;
  for (Stream s : {Stream::K, Stream::V}) {
    const auto& so = opt.stream(s);
    groups_[(int)s].resize(L);
    pieces_[(int)s].resize(L);
    if (!so.coded) continue;
    const std::string kind = s == Stream::V ? "v" : (so.q_precond ? "kw" : "k");
    if (so.alloc > 0) {
      KAKEYA_CHECK(so.basis == BasisSource::Calib, "codec '" << opt.label << "': " << stream_name(s)
                                                             << "alloc needs " << stream_name(s)
                                                             << "basis=calib (the allocation reads its eigenvalues)");
      need_bundle("PCA eigenvalues for the bit allocation (alloc)");
    }
    for (int64_t l = 0; l < L; ++l) {
      const int64_t D = cfg.layer_head_dim[l];
      KAKEYA_CHECK(so.d_eff <= D, "codec '" << opt.label << "': " << stream_name(s) << "deff=" << so.d_eff
                                            << " exceeds layer " << l << "'s head_dim " << D);
      auto groups = so.alloc > 0 ? waterfill(bundle->basis_eig(l, kind).mean(0), so.alloc, so.alloc_quantum)
                                 : so.resolved_groups(D);
      int64_t sum = 0;
      for (const auto& g : groups) sum += g.width;
      KAKEYA_CHECK(sum == D, "codec '" << opt.label << "': " << stream_name(s) << " bit groups cover " << sum
                                       << " coordinates but layer " << l << " has head_dim " << D);
      int64_t off = 0;
      for (const auto& g : groups) {
        if (g.bits > 0) pieces_[(int)s][l].push_back({off, g.width, g.bits});
        off += g.width;
      }
      groups_[(int)s][l] = groups;
    }
  }
  if (opt.k.coded && opt.k.q_precond) {
    need_bundle("Σ_q (kqp=1)");
    for (int64_t l = 0; l < L; ++l) {
      const auto& sig = bundle->sigma(l);  // [H, D, D]
      const int64_t D = cfg.layer_head_dim[l];
      // Whiten with Σ_q normalised to unit mean eigenvalue: the scale carries no
      // information and keeps whitened values in the range of the raw ones.
      auto s = (at::diagonal(sig, 0, -2, -1).sum(-1) / D).sqrt().view({-1, 1, 1});  // [H, 1, 1]
      wk_.push_back((bundle->chol(l) / s).to(device));
      wk_inv_.push_back((bundle->inv_chol(l) * s).to(device));
      if (!opt.is_boundary(l)) shared_bytes_ += 2 * bundle->chol(l).numel() * 4;
    }
  }
  for (Stream s : {Stream::K, Stream::V}) {
    const auto& so = opt.stream(s);
    if (!so.coded) continue;
    if (so.basis == BasisSource::Calib) {
      need_bundle("a calibrated PCA basis (basis=calib)");
      const std::string kind = s == Stream::V ? "v" : (so.q_precond ? "kw" : "k");
      for (int64_t l = 0; l < L; ++l) {
        basis_[(int)s].push_back(bundle->basis(l, kind).to(device));
        if (!opt.is_boundary(l)) shared_bytes_ += cfg.kv_heads(l) * cfg.layer_head_dim[l] * coded_width(l, s) * 4;
      }
    }
    for (int64_t l = 0; l < L; ++l) {
      const auto& ps = pieces(l, s);
      std::set<int> bits_used;
      for (size_t i = 0; i < ps.size(); ++i) {
        bits_used.insert(ps[i].bits);
        const uint64_t sd = opt.seed ^ (0x100000001b3ull * (uint64_t)(l * 4 + (int)s + 1)) ^ (0x9E3779B1ull * (i + 1));
        const int64_t w = ps[i].width;
        if (is_pow2(w)) {
          rot_[{l, (int)s, (int64_t)i}] = random_signs(w, sd, device);
        } else {
          // No WHT of this width: a seeded Haar-random orthogonal matrix (QR of a
          // Gaussian, signs fixed by diag(R)), regenerated by the decoder from the seed.
          auto gen = at::detail::createCPUGenerator(sd);
          auto qr = at::linalg_qr(at::randn({w, w}, gen, at::TensorOptions().dtype(at::kDouble)));
          auto Q = std::get<0>(qr) * at::sign(at::diagonal(std::get<1>(qr))).unsqueeze(0);
          rot_[{l, (int)s, (int64_t)i}] = Q.to(at::kFloat).to(device);
        }
      }
      for (int b : bits_used) {
        const ScalarCodebook* cb;
        if (so.calibrated) {
          need_bundle("calibrated Lloyd-Max tables (cal=1)");
          cb = &bundle->codebook(stream_name(s)[0], b, l);
          if (!opt.is_boundary(l)) shared_bytes_ += (int64_t(4) << b);
        } else {
          cb = &gaussian_codebook(b);
        }
        tables_[{l, (int)s, b}] = Table{cb->centroids_tensor(device), cb->boundaries_tensor(device)};
      }
    }
  }
}

int64_t KVCodec::coded_width(int64_t layer, Stream s) const {
  int64_t w = 0;
  for (const auto& p : pieces(layer, s)) w = std::max(w, p.offset + p.width);
  return w;
}

at::Tensor KVCodec::rotate(int64_t layer, Stream s, int64_t piece, const at::Tensor& x, bool inverse) const {
  if (!opt_.stream(s).wht) return x;
  const auto& r = rot_.at({layer, (int)s, piece});
  if (r.dim() == 1) return inverse ? rht_inverse(x, r) : rht(x, r);
  return at::matmul(x, inverse ? r.t() : r);
}

const KVCodec::Table& KVCodec::table(int64_t layer, Stream s, int bits) const {
  auto it = tables_.find({layer, (int)s, bits});
  KAKEYA_CHECK(it != tables_.end(), "codec: no table for layer " << layer << " stream " << stream_name(s) << " bits " << bits);
  return it->second;
}


EncodedLayer KVCodec::encode(int64_t layer, Stream s, const at::Tensor& x_in, const ResidualSink& sink,
                             int64_t pos0) const {
  KAKEYA_CHECK(layer >= 0 && layer < cfg_.num_layers, "codec: layer " << layer << " outside [0, " << cfg_.num_layers << ")");
  const int64_t H = cfg_.kv_heads(layer), D = cfg_.layer_head_dim[layer];
  KAKEYA_CHECK(x_in.dim() == 3 && x_in.size(0) == H && x_in.size(2) == D,
               "codec: layer " << layer << " stream " << stream_name(s) << " expects [H_kv=" << H << ", N, D=" << D
                               << "], got " << x_in.sizes());
  EncodedLayer e;
  e.layer = layer;
  e.stream = s;
  e.heads = H;
  e.tokens = x_in.size(1);
  e.dim = D;
  const bool exact = opt_.kind == CodecKind::Exact || !opt_.stream(s).coded || opt_.is_boundary(layer);
  const int64_t N = e.tokens, blk = opt_.block > 0 ? opt_.block : std::max<int64_t>(N, 1);
  // Attention-sink positions (< opt.sink) form a leading exact block.
  const int64_t n_sink = std::clamp<int64_t>(opt_.sink - pos0, 0, N);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t st = 0; st < N;) {
      const int64_t n = st < n_sink ? n_sink - st : std::min(blk, N - st);
      at::Tensor xb = x_in[h].slice(0, st, st + n);
      EncodedBlock b;
      if (exact || st < n_sink) {
        b.put("raw", xb);  // kept as is; accounted as bf16
      } else {
        KAKEYA_CHECK(at::isfinite(xb).all().item<bool>(),
                     "codec: layer " << layer << " stream " << stream_name(s) << " head " << h << " holds NaN or Inf");
        b = encode_block(layer, s, h, xb.to(device_, at::kFloat), sink);
      }
      b.head = h;
      b.start = st;
      b.tokens = n;
      e.blocks.push_back(std::move(b));
      st += n;
    }
  }
  return e;
}

int64_t KVCodec::coded_bytes(int64_t layer, Stream s, int64_t N, int64_t pos0) const {
  const int64_t H = cfg_.kv_heads(layer), D = cfg_.layer_head_dim[layer];
  const bool exact = opt_.kind == CodecKind::Exact || !opt_.stream(s).coded || opt_.is_boundary(layer);
  const int64_t blk = opt_.block > 0 ? opt_.block : std::max<int64_t>(N, 1);
  const int64_t n_sink = std::clamp<int64_t>(opt_.sink - pos0, 0, N);
  auto packed = [](int64_t count, int bits) { return (count * bits + 7) / 8; };
  const auto& so = opt_.stream(s);
  KAKEYA_CHECK(exact || so.outlier_t <= 0.0,
               "codec: coded_bytes of stream " << stream_name(s) << " with outliers (t=" << so.outlier_t
                                               << "): their count depends on the data");
  int64_t per_head = 0;
  for (int64_t st = 0; st < N;) {
    const int64_t n = st < n_sink ? n_sink - st : std::min(blk, N - st);
    if (exact || st < n_sink) {
      per_head += n * D * 2;  // "raw", accounted as bf16
    } else if (opt_.kind == CodecKind::Affine) {
      per_head += packed(n * D, opt_.affine_bits) + 2 * 2 * n * (D / opt_.affine_group);
    } else if (opt_.kind == CodecKind::Fp8) {
      per_head += n * D + 4;
    } else {
      const int64_t r = coded_width(layer, s);
      if (so.center) per_head += 2 * D;
      if (so.basis == BasisSource::Block) per_head += 2 * D * r;
      if (so.kmeans > 0) {
        const int64_t k = std::min<int64_t>(so.kmeans, n);
        per_head += 2 * k * r + packed(n, ceil_log2(k)) + 2 * n;
      }
      for (const auto& p : pieces(layer, s)) per_head += packed(n * p.width, p.bits) + 4 + 2 * n;
    }
    st += n;
  }
  return H * per_head;
}

namespace {
// Inverse of RopeTable::apply for x: [H, N, D] at positions pos0 .. pos0 + N - 1, in f32:
// R⁻¹y = y·cos − rotate_half(y)·sin (cos and sin are equal on the two halves of each pair).
at::Tensor unrope(const at::Tensor& y, const RopeTable& rope, int64_t pos0) {
  const int64_t N = y.size(1), rot = rope.cos().size(1), h = rot / 2;
  KAKEYA_CHECK(pos0 >= 0 && pos0 + N <= rope.max_positions(),
               "codec: positions [" << pos0 << ", " << pos0 + N << ") exceed the RoPE table (" << rope.max_positions() << ")");
  auto cos = rope.cos().slice(0, pos0, pos0 + N).to(y.device(), at::kFloat).unsqueeze(0);  // [1, N, rot]
  auto sin = rope.sin().slice(0, pos0, pos0 + N).to(y.device(), at::kFloat).unsqueeze(0);
  auto x = y.to(at::kFloat);
  auto xr = x.slice(-1, 0, rot);
  auto out = xr * cos - at::cat({-xr.slice(-1, h), xr.slice(-1, 0, h)}, -1) * sin;
  return rot == x.size(-1) ? out : at::cat({out, x.slice(-1, rot)}, -1);
}
}  // namespace

CodedKV KVCodec::encode_kv(int64_t layer, const at::Tensor& k_rope, const at::Tensor& v, int64_t pos0,
                           const RopeTable& rope) const {
  KAKEYA_CHECK(k_rope.dim() == 3 && v.sizes() == k_rope.sizes(),
               "codec: encode_kv expects k and v of one shape [H_kv, N, D], got " << k_rope.sizes() << " and " << v.sizes());
  CodedKV c;
  c.pos0 = pos0;
  c.k = encode(layer, Stream::K, unrope(k_rope.to(device_), rope, pos0), nullptr, pos0);
  c.v = encode(layer, Stream::V, v, nullptr, pos0);
  return c;
}

std::pair<at::Tensor, at::Tensor> KVCodec::decode_kv(const CodedKV& c, const RopeTable& rope, at::ScalarType dtype) const {
  auto k = decode(c.k).to(dtype).permute({1, 0, 2}).unsqueeze(0);  // [1, N, H, D] as the forward applies RoPE
  auto pos = at::arange(c.pos0, c.pos0 + c.k.tokens, at::TensorOptions().dtype(at::kLong).device(rope.cos().device()));
  auto kr = rope.apply(k.to(rope.cos().device()), pos).squeeze(0).permute({1, 0, 2}).to(device_);  // [H, N, D]
  return {kr, decode(c.v).to(dtype)};
}

at::Tensor KVCodec::decode(const EncodedLayer& e) const {
  auto out = at::empty({e.heads, e.tokens, e.dim}, at::TensorOptions().dtype(at::kFloat).device(device_));
  for (const auto& b : e.blocks) {
    at::Tensor y = b.has("raw") ? b.get("raw").to(device_, at::kFloat) : decode_block(e.layer, e.stream, e.dim, b);
    out[b.head].slice(0, b.start, b.start + b.tokens).copy_(y);
  }
  return out;
}

EncodedBlock KVCodec::encode_block(int64_t l, Stream s, int64_t h, const at::Tensor& x, const ResidualSink& sink) const {
  // x: [n, D] f32 on device_.
  EncodedBlock b;
  const int64_t n = x.size(0), D = x.size(1);
  if (opt_.kind == CodecKind::Affine) {
    const int64_t G = opt_.affine_group, bits = opt_.affine_bits, levels = (1 << bits) - 1;
    KAKEYA_CHECK(D % G == 0, "codec '" << opt_.label << "': head_dim " << D << " is not a multiple of group " << G);
    auto xg = x.view({n, D / G, G});
    auto mn = std::get<0>(xg.min(-1)), mx = std::get<0>(xg.max(-1));  // [n, D/G]
    auto scale16 = ((mx - mn) / (double)levels).to(at::kHalf), zero16 = mn.to(at::kHalf);
    auto sc = scale16.to(at::kFloat), z = zero16.to(at::kFloat);
    sc = at::where(sc > 0, sc, at::ones_like(sc));
    auto q = ((xg - z.unsqueeze(-1)) / sc.unsqueeze(-1)).round().clamp(0, (double)levels).to(at::kByte);
    b.put("codes", pack_bits(q, bits));
    b.put("scale", scale16);
    b.put("zero", zero16);
    return b;
  }
  if (opt_.kind == CodecKind::Fp8) {
    auto scale = (x.abs().max() / 448.0).clamp_min(1e-30).reshape({1});  // [1] f32: e4m3's largest finite is 448
    b.put("codes", (x / scale).to(at::kFloat8_e4m3fn));
    b.put("scale", scale);
    return b;
  }
  const auto& so = opt_.stream(s);
  at::Tensor y = x;
  if (s == Stream::K && so.q_precond) y = at::matmul(y, wk_[l][h]);
  if (so.center) {
    auto mu = y.mean(0).to(at::kHalf);  // [D]
    KAKEYA_CHECK(at::isfinite(mu).all().item<bool>(), "codec: layer " << l << " block mean overflows f16");
    b.put("mean", mu);
    y = y - mu.to(at::kFloat);
  }
  const int64_t r = coded_width(l, s);
  at::Tensor U;  // [D, r]
  if (so.basis == BasisSource::Block) {
    auto u16 = block_pca(y, r, so, opt_.seed + l).to(at::kHalf);
    b.put("basis", u16);
    U = u16.to(at::kFloat);
  } else if (so.basis == BasisSource::Calib) {
    U = basis_[(int)s][l][h].slice(1, 0, r);
  }
  at::Tensor c = U.defined() ? at::matmul(y, U) : y.slice(1, 0, r);  // [n, r]
  if (so.kmeans > 0) {
    const int64_t k = std::min<int64_t>(so.kmeans, n);
    auto dirs = c / c.norm(2, 1, true).clamp_min(1e-30);  // [n, r]
    auto C = dirs.index_select(0, at::linspace(0, n - 1, k, at::TensorOptions().device(device_)).round().to(at::kLong));
    at::Tensor a;
    for (int64_t it = 0; it < so.kmeans_iters; ++it) {
      a = at::matmul(dirs, C.t()).argmax(1);  // [n]
      auto sums = at::zeros_like(C).index_add_(0, a, dirs);
      auto nrm = sums.norm(2, 1, true);
      C = at::where(nrm > 0, sums / nrm.clamp_min(1e-30), C);
    }
    auto C16 = C.to(at::kHalf);
    auto Cf = C16.to(at::kFloat);
    a = at::matmul(dirs, Cf.t()).argmax(1);
    auto Ca = Cf.index_select(0, a);                // [n, r]
    auto sc16 = (c * Ca).sum(1).to(at::kHalf);      // [n] projection on the unit centroid
    b.put("km_centroids", C16);
    b.put("km_index", pack_bits(a.to(at::kByte), ceil_log2(k)));
    b.put("km_scale", sc16);
    c = c - sc16.to(at::kFloat).unsqueeze(1) * Ca;
  }
  const auto& ps = pieces(l, s);
  for (size_t i = 0; i < ps.size(); ++i) {
    const auto& p = ps[i];
    const std::string sfx = "." + std::to_string(i);
    auto seg = c.slice(1, p.offset, p.offset + p.width);
    auto z = rotate(l, s, i, seg, false);                                  // [n, w]
    auto nrm = z.norm(2, 1);                                               // [n]
    auto nscale = nrm.max().clamp_min(1e-30).reshape({1});                 // [1] f32 block scale of the norms
    auto nrel16 = (nrm / nscale).to(at::kHalf);                            // [n] f16 in [0, 1]
    auto nr = nrel16.to(at::kFloat) * nscale;
    auto u = z * (std::sqrt((double)p.width) / nr.clamp_min(1e-30)).unsqueeze(1);  // unit-variance coordinates
    if (sink) sink(l, s, u);
    const auto& t = table(l, s, p.bits);
    b.put("codes" + sfx, pack_bits(lm_quantize(u, t.boundaries), p.bits));
    b.put("nscale" + sfx, nscale);
    b.put("norm" + sfx, nrel16);
    if (so.outlier_t > 0) {
      auto flat = u.reshape({-1});
      auto idx = flat.abs().gt(so.outlier_t).nonzero().squeeze(1);  // [m]
      b.put("out_idx" + sfx, idx.to(at::kInt));
      b.put("out_val" + sfx, flat.index_select(0, idx).to(at::kHalf));
    }
  }
  return b;
}

at::Tensor KVCodec::decode_block(int64_t l, Stream s, int64_t D, const EncodedBlock& b) const {
  const int64_t n = b.tokens;
  if (opt_.kind == CodecKind::Affine) {
    const int64_t G = opt_.affine_group, bits = opt_.affine_bits;
    auto q = unpack_bits(b.get("codes"), n * D, bits).to(device_).to(at::kFloat).view({n, D / G, G});
    auto sc = b.get("scale").to(at::kFloat), z = b.get("zero").to(at::kFloat);
    sc = at::where(sc > 0, sc, at::ones_like(sc));
    return (q * sc.unsqueeze(-1) + z.unsqueeze(-1)).view({n, D});
  }
  if (opt_.kind == CodecKind::Fp8) return b.get("codes").to(at::kFloat) * b.get("scale");
  const auto& so = opt_.stream(s);
  const int64_t r = coded_width(l, s);
  auto c = at::zeros({n, r}, at::TensorOptions().dtype(at::kFloat).device(device_));
  const auto& ps = pieces(l, s);
  for (size_t i = 0; i < ps.size(); ++i) {
    const auto& p = ps[i];
    const std::string sfx = "." + std::to_string(i);
    const auto& t = table(l, s, p.bits);
    auto uh = lm_dequantize(unpack_bits(b.get("codes" + sfx), n * p.width, p.bits), t.centroids).view({n, p.width});
    if (b.has("out_idx" + sfx)) {
      auto flat = uh.reshape({-1});
      flat.index_copy_(0, b.get("out_idx" + sfx).to(at::kLong), b.get("out_val" + sfx).to(at::kFloat));
      uh = flat.view({n, p.width});
    }
    auto nr = b.get("norm" + sfx).to(at::kFloat) * b.get("nscale" + sfx);  // [n]
    // Norm correction: rescale the decoded piece to the stored norm (removes the
    // shrinkage of Lloyd-Max reconstruction, which would scale attention logits).
    auto zh = so.norm_correction ? uh * (nr / uh.norm(2, 1).clamp_min(1e-30)).unsqueeze(1)
                                 : uh * (nr / std::sqrt((double)p.width)).unsqueeze(1);
    auto seg = rotate(l, s, i, zh, true);
    c.slice(1, p.offset, p.offset + p.width).copy_(seg);
  }
  if (so.kmeans > 0) {
    auto C = b.get("km_centroids").to(at::kFloat);  // [k, r]
    auto a = unpack_bits(b.get("km_index"), n, ceil_log2(C.size(0))).to(at::kLong);
    c = c + b.get("km_scale").to(at::kFloat).unsqueeze(1) * C.index_select(0, a);
  }
  at::Tensor y;
  if (so.basis == BasisSource::Block) {
    y = at::matmul(c, b.get("basis").to(at::kFloat).t());
  } else if (so.basis == BasisSource::Calib) {
    y = at::matmul(c, basis_[(int)s][l][b.head].slice(1, 0, r).t());
  } else {
    y = r < D ? at::constant_pad_nd(c, {0, D - r}, 0.0) : c;
  }
  if (so.center) y = y + b.get("mean").to(at::kFloat);
  if (s == Stream::K && so.q_precond) y = at::matmul(y, wk_inv_[l][b.head]);
  return y;
}

}  // namespace kakeya
