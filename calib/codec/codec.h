// KV codec: encode/decode one layer's K or V (per KV head, in blocks of tokens)
// into a byte-exact stored form, so every ratio we report counts every byte.
//
// Our codec ("kakeya"), per (layer, stream, KV head, block of tokens):
//   K only, optional: Q-preconditioning  K̃ = K·L  (Σ_q = L·Lᵀ, from the bundle), so that
//        squared error in K̃ is the query-weighted logit error E_q[(qᵀe)²] = ‖eL‖²
//   centring on the block mean (f16 per block; softmax ignores a common K offset)
//   optional PCA basis: none | per block (exact SVD or randomized, f16, stored per block)
//        | calibrated (bundle, shared by every block: the "shared basis")
//   optional spherical k-means on the coefficients (centroids per block, index + scale per token)
//   bit groups: consecutive PCA coordinates coded at their own bits (e.g. 128 at 4 bits, the
//        rest at 1 bit or dropped), given explicitly or allocated per layer by reverse
//        water-filling on the calibrated PCA spectrum (alloc=average bits per coordinate)
//   per group and token: rotation (randomized Walsh–Hadamard for power-of-two widths, a
//        seeded random orthogonal matrix otherwise: no padding, so no coded zeros), norm
//        (f16 relative to an f32 block scale), Lloyd-Max scalar quantization of the
//        unit-variance coordinates (Gaussian or calibrated tables), outliers |u| > T kept as
//        (i32 index, f16 value), norm correction (decoded group rescaled to the stored norm)
//   boundary layers kept exact.
// Baselines in the same code path: TurboQuant-style (raw K/V, WHT, Gaussian Lloyd-Max,
// per-token norm with norm correction), int8/int4 per-group affine (group 64, f16 scale +
// zero), fp8 e4m3 (f32 scale per block and head), exact.
//
// Shapes: x [H_kv, N, D] f32 per layer and stream (pre-RoPE K after k_norm, or V); H_kv and D
// are the layer's own (ModelConfig::kv_heads(l), layer_head_dim[l]).
//
// For a KV cache that stores layers through the codec (the restored decoder's
// --full-attn codec), use encode_kv / decode_kv: post-RoPE K in, post-RoPE K out.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "calib/codec/calib_bundle.h"
#include "core/model/config.h"
#include "core/model/rope.h"

namespace kakeya {

enum class CodecKind { Exact, Kakeya, Turbo, Affine, Fp8 };
enum class Stream { K = 0, V = 1 };
enum class BasisSource { None, Block, Calib };
const char* stream_name(Stream s);  // "k" / "v"

// Consecutive coordinates coded with one Lloyd-Max table; bits 0 = dropped (decoded as 0).
struct BitGroup {
  int64_t width = 0;
  int bits = 0;
};

struct StreamOptions {
  bool coded = true;                  // false: the stream stays exact (accounted as bf16)
  int bits = 4;                       // bits of the leading group, 1..4
  int64_t d_eff = 0;                  // leading group width (PCA rank); 0: all D coordinates
  int tail_bits = 0;                  // bits of coordinates past d_eff (0: dropped), 0..4
  std::vector<BitGroup> groups;       // explicit groups (override bits/d_eff/tail_bits); widths sum to D
  double alloc = 0;                   // > 0: per-layer groups by water-filling to this many bits per
                                      // coordinate on average (needs basis=calib: its eigenvalues)
  int64_t alloc_quantum = 16;         // allocation unit (coordinates); group widths are multiples
  BasisSource basis = BasisSource::None;
  bool rsvd = false;                  // per-block PCA: randomized SVD instead of exact
  int64_t rsvd_oversample = 8;
  int64_t rsvd_power_iters = 2;
  int64_t kmeans = 0;                 // spherical k-means clusters per block (0: off)
  int64_t kmeans_iters = 8;
  bool wht = true;                    // randomized Walsh–Hadamard rotation of each piece
  double outlier_t = 0.0;             // |u| > T stored exactly (0: off)
  bool norm_correction = true;
  bool calibrated = false;            // Lloyd-Max tables from the bundle (else Gaussian)
  bool center = true;                 // subtract the block mean
  bool q_precond = false;             // K only: whiten with Σ_q's Cholesky factor
  // Groups after defaults: explicit ones, else {d_eff: bits, D - d_eff: tail_bits}.
  std::vector<BitGroup> resolved_groups(int64_t D) const;
};

struct CodecOptions {
  CodecKind kind = CodecKind::Exact;
  std::string label;                   // name in tables (default: the spec)
  StreamOptions k, v;
  int64_t block = 512;                 // tokens per block; blocks are coded independently
  std::vector<int64_t> boundary_layers;  // kept exact
  int64_t sink = 0;                    // the first `sink` positions of the sequence kept exact (attention sinks)
  int affine_bits = 4;                 // Affine: 2..8
  int64_t affine_group = 64;           // Affine: values per (scale, zero) pair along D
  uint64_t seed = 0x9E3779B97F4A7C15ull;  // WHT signs, k-means/RSVD init

  // "name[:key=value,...]". Names: exact | kakeya (alias ours) | turbo | int4 | int8 | fp8.
  // Keys: global  block, skip (boundary layers "0/17"), sink, seed, group, abits, label;
  //       stream  b, deff, tb, g ("128:4+128:1"), basis (none|block|calib), rsvd, os, pi,
  //               km, kmi, wht, t, nc, cal, center, qp, on — prefixed k or v for one stream
  //               ("kb=4", "vdeff=128"), unprefixed for both ("wht=0").
  static CodecOptions parse(const std::string& spec);
  std::string describe() const;  // every knob, normalised
  const StreamOptions& stream(Stream s) const { return s == Stream::K ? k : v; }
  StreamOptions& stream(Stream s) { return s == Stream::K ? k : v; }
  bool is_boundary(int64_t layer) const;
};

// One (head, block) as stored: named tensors. bytes() counts numel · element size
// of every field, except "raw" (exact data), which counts as bf16, the format every
// compression ratio is measured against.
struct EncodedBlock {
  int64_t head = 0, start = 0, tokens = 0;
  std::vector<std::pair<std::string, at::Tensor>> fields;
  int64_t bytes() const;
  const at::Tensor& get(const std::string& name) const;
  bool has(const std::string& name) const;
  void put(const std::string& name, const at::Tensor& t) { fields.emplace_back(name, t); }
};

struct EncodedLayer {
  int64_t layer = 0;
  Stream stream = Stream::K;
  int64_t heads = 0, tokens = 0, dim = 0;
  std::vector<EncodedBlock> blocks;
  int64_t bytes() const;
  int64_t values() const { return heads * tokens * dim; }
  double bits_per_value() const { return values() ? 8.0 * bytes() / values() : 0.0; }
  std::map<std::string, int64_t> bytes_by_field() const;  // "codes", "norm", "mean", ... (suffixes merged)
};

// One layer's K and V block as coded by KVCodec::encode_kv (pre-RoPE K inside).
struct CodedKV {
  EncodedLayer k, v;
  int64_t pos0 = 0;  // absolute position of token 0; the block holds pos0 .. pos0 + N - 1
  int64_t bytes() const { return k.bytes() + v.bytes(); }  // every stored byte, side information included
};

// Receives the unit-variance coordinates u [N, w] of every piece before quantization
// (what `calibrate codebook` fits Lloyd-Max tables to).
using ResidualSink = std::function<void(int64_t layer, Stream s, const at::Tensor& u)>;

class KVCodec {
 public:
  // bundle may be null when the options need nothing from it; otherwise its
  // tensors are copied to `device` once.
  KVCodec(const CodecOptions& opt, const ModelConfig& cfg, const CalibBundle* bundle, at::Device device);

  // x: [H_kv, N, D] of `layer` (any float dtype, any device); row i holds absolute
  // position pos0 + i (only the `sink` option looks at positions). N may be any length.
  EncodedLayer encode(int64_t layer, Stream s, const at::Tensor& x, const ResidualSink& sink = nullptr,
                      int64_t pos0 = 0) const;
  at::Tensor decode(const EncodedLayer& e) const;  // -> [H_kv, N, D] f32 on the codec device

  // Cache entry point: a block of N consecutive tokens of one layer as a KV cache holds them.
  // k_rope: [H_kv, N, D] post-RoPE K (KVCache::keys(l)[b] over the block's slots), v: [H_kv, N, D],
  // any float dtype; rope: that layer's table (Model::rope(l)). K is coded pre-RoPE: RoPE is
  // undone here (x·cos − rotate_half(x)·sin in f32, exact up to the table's rounding) and
  // re-applied by decode_kv, because everything the codec learns from calibration (Σ_q,
  // shared PCA basis, Lloyd-Max tables) describes pre-RoPE K; RoPE turns each position by a
  // different angle, so post-RoPE K has no fixed low-rank basis. The `sink` option counts
  // from pos0 (the attention-sink tokens of the sequence stay exact).
  CodedKV encode_kv(int64_t layer, const at::Tensor& k_rope, const at::Tensor& v, int64_t pos0,
                    const RopeTable& rope) const;
  // -> {K̂ post-RoPE [H_kv, N, D], V̂ [H_kv, N, D]} in `dtype` on the codec device; RoPE is applied
  // in `dtype` exactly as the model's forward does, so K̂ can be written back with KVCache::write.
  std::pair<at::Tensor, at::Tensor> decode_kv(const CodedKV& c, const RopeTable& rope, at::ScalarType dtype) const;

  // Bytes encode() stores for n tokens of `layer` starting at absolute position pos0, from the
  // layout alone (every field's size follows from the options and shapes); refused with
  // outliers on (t > 0), whose count depends on the data. What a coded cache's memory plan uses.
  int64_t coded_bytes(int64_t layer, Stream s, int64_t n, int64_t pos0) const;

  const CodecOptions& options() const { return opt_; }
  // The per-layer bit groups actually used (after alloc), for reports.
  const std::vector<BitGroup>& layer_groups(int64_t layer, Stream s) const { return groups_[(int)s].at(layer); }
  // Bytes of bundle data the codec reads (Σ_q factors, shared bases, calibrated
  // tables), counted once per bundle, not per block.
  int64_t shared_bytes() const { return shared_bytes_; }

 private:
  EncodedBlock encode_block(int64_t layer, Stream s, int64_t head, const at::Tensor& x, const ResidualSink& sink) const;
  at::Tensor decode_block(int64_t layer, Stream s, int64_t D, const EncodedBlock& b) const;  // [N, D] f32
  struct Table {
    at::Tensor centroids, boundaries;  // [2^bits], [2^bits - 1] f32 on the codec device
  };
  const Table& table(int64_t layer, Stream s, int bits) const;
  // Coded groups of a layer (bits > 0): offset, width, bits.
  struct Piece {
    int64_t offset, width;
    int bits;
  };
  const std::vector<Piece>& pieces(int64_t layer, Stream s) const { return pieces_[(int)s].at(layer); }
  int64_t coded_width(int64_t layer, Stream s) const;  // coordinates covered by pieces (prefix of the basis)
  at::Tensor rotate(int64_t layer, Stream s, int64_t piece, const at::Tensor& x, bool inverse) const;

  CodecOptions opt_;
  const ModelConfig& cfg_;
  const CalibBundle* bundle_;
  at::Device device_;
  std::vector<at::Tensor> wk_, wk_inv_;      // per layer [H, D, D]: normalised L and L⁻¹ (K precond)
  std::vector<at::Tensor> basis_[2];         // per stream, per layer [H, D, D] calibrated bases
  std::map<std::tuple<int64_t, int, int>, Table> tables_;           // (layer, stream, bits)
  std::map<std::tuple<int64_t, int, int64_t>, at::Tensor> rot_;     // (layer, stream, piece) -> signs [w] or Q [w, w]
  std::vector<std::vector<Piece>> pieces_[2];                        // per stream, per layer: coded groups
  std::vector<std::vector<BitGroup>> groups_[2];                     // per stream, per layer: all groups
  int64_t shared_bytes_ = 0;
};

// Bit packing (little-endian within a byte group): idx uint8 [M] with values < 2^bits
// -> uint8 [ceil(M·bits/8)]; unpack needs M.
at::Tensor pack_bits(const at::Tensor& idx, int bits);
at::Tensor unpack_bits(const at::Tensor& packed, int64_t count, int bits);

// Applies a codec to a whole layer stream and reports what it cost.
struct CodecStats {
  int64_t bytes = 0, values = 0;
  double sq_err = 0, sq_ref = 0;  // Σ (x - x̂)², Σ x²  (relative MSE = sq_err / sq_ref)
};

}  // namespace kakeya
