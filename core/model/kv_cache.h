// Per-layer K/V cache with explicit capacity and static shapes (CUDA-graph
// friendly: appends are index_copy_ at device-computed slots, never reallocations).
//
// Full-attention layers hold `capacity` slots; sliding layers hold a ring of
// window + rollback slots, so they never cost more than their window. Each
// layer type keeps the absolute position stored in every slot (-1 = empty);
// attention masks are derived from it, which makes a ring and a linear buffer
// the same thing to the forward pass. truncate(n) only invalidates slots, so it
// is O(1) in host work; a sliding ring can roll back at most `rollback` tokens.
//
// Restoration (RestorePolicy, used by infer/restored.h): on the layer types the
// policy covers, a query at position p reads the exact K/V of the `window`
// most recent positions p - window < j <= p, and *restored* K/V for the older
// positions of its span (its sliding window, or everything on full layers),
// which the caller writes with write_restored() before the forward whose
// queries first need them. Such a layer's buffer is [exact ring | restored
// region]. On sliding layers the exact ring holds window + max(step - 1, rollback)
// slots (step: the longest forward that writes before attending, 1 for decode steps):
// a longer prefill chunk attends over [ring as it was ++ chunk] and is written after,
// so the ring does not grow with the chunk; the restored region holds (sliding window -
// window + chunk - 1) slots. Full-attention layers keep window + max(chunk - 1,
// rollback) exact slots and `capacity` restored ones. A position may sit in both
// parts at once; the mask shows each query exactly one of the two copies.
//
// Coded restored regions (RestorePolicy::region_bits 8 or 4): a restored layer keeps its
// exact ring dense and its restored region as coded rows (core/kernels/ops.h quantize_rows,
// about 0.31x of bf16 in 4 bits): keys()/values() then hold the ring only, the attention
// kernel reads the region's codes itself (copy_rule), and attend_kv() gives the reference
// paths (prefill chunks, CPU) the whole layer decoded.
//
// Coded full-attention layers (RestorePolicy::full_coded_block > 0, the restored
// decoder's --full-attn codec): every position keeps its exact K/V, but stored
// through a KV codec once it is old. Each such layer owns only a dense exact ring
// (window + block + max(chunk - 1, rollback) - 1 slots); positions below
// coded_below(q) (whole codec blocks outside q's window) are read from their
// coded copy. The coded bytes live with the caller (infer/restored.h
// CodedHistory); attention reads ONE scratch buffer [ring | capacity] shared by
// every coded layer, which write() fills for its layer (dense ring copied in,
// coded history decoded by the HistoryLoader) just before that layer attends.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "core/model/config.h"
#include "core/kernels/ops.h"

namespace kakeya {

// Attention visibility [T, S] bool: slot s (holding position slot_pos[s], -1 = empty) is visible
// to the query at q_pos[t] if it holds a position <= the query's and, when window > 0, within
// the window. slot_pos: [S] int64, q_pos: [T] int64. The one rule the cache and the forward share.
at::Tensor causal_visible(const at::Tensor& slot_pos, const at::Tensor& q_pos, int64_t window);

struct RestorePolicy {
  int64_t window = 0;     // exact recent positions per query (the query included); 0: no restoration
  bool sliding = true;    // restore on sliding-attention layers
  bool full = false;      // restore on full-attention layers
  int64_t max_chunk = 1;  // most tokens one forward writes (prefill chunks, verify blocks)
  int64_t max_step = 1;   // most tokens a forward on sliding layers writes before attending (decode
                          // steps 1, verify blocks B); longer ones attend over [ring ++ chunk]
  bool linear = false;    // one slot per position in both regions, no rings (reference decoders)
  int64_t full_coded_block = 0;  // > 0: full-attention layers stored through a codec in blocks of this
                                 // many tokens (exclusive with `full`)
  // Per layer (empty: none): a covered layer that drops its restored positions — its restored
  // region shows only the sinks (positions < sink), so it attends sinks + the exact window
  // (evict-only on that layer). Restoration still writes the region; the mask hides it.
  std::vector<bool> drop;
  int64_t sink = 0;
  int region_bits = 0;    // 8 or 4: restored regions stored as coded rows (0: in the cache dtype)
  bool enabled() const { return window > 0; }
  bool drops(int64_t layer) const { return layer < (int64_t)drop.size() && drop[layer]; }
};

struct KVCacheOptions {
  int64_t batch = 1;
  int64_t capacity = 4096;      // positions a full-attention layer can hold
  int64_t rollback = 64;        // tokens truncate() may remove from sliding rings (speculative blocks)
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  RestorePolicy restore;        // default: off (the model's own attention)
};

class KVCache {
 public:
  KVCache(const ModelConfig& cfg, const KVCacheOptions& opt);

  int64_t length() const { return length_; }        // positions committed so far
  int64_t capacity() const { return opt_.capacity; }
  const KVCacheOptions& options() const { return opt_; }
  int64_t num_layers() const { return (int64_t)k_.size(); }
  int64_t slots(int64_t layer) const { return state(layer).pos.size(0); }

  // Writes K/V of T new tokens at absolute `positions` for one layer.
  // k, v: [B, H_kv, T, D] (post-RoPE k). positions: [T] int64 on the cache device.
  void write(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions);
  // Marks the slot positions of every layer type for `positions` (once per forward, before write()).
  void mark(const at::Tensor& positions);
  // Commits T positions after a forward (host bookkeeping only).
  void advance(int64_t t);
  // Drops every position >= n. Throws if a sliding ring already overwrote what n needs.
  void truncate(int64_t n);
  void clear() { truncate(0); }

  // The dense slots: [B, H_kv_l, S_l, D_l], or the exact ring only ([B, H_kv_l, exact_slots, D_l])
  // on a layer whose restored region is coded (region_coded).
  const at::Tensor& keys(int64_t layer) const { return k_[layer]; }
  const at::Tensor& values(int64_t layer) const { return v_[layer]; }
  // Every slot dense, {k, v} [B, H_kv_l, S_l, D_l]: keys()/values(), or on a coded-region layer
  // the ring followed by the decoded region (a temporary: the reference attention path).
  std::pair<at::Tensor, at::Tensor> attend_kv(int64_t layer) const;
  // Writable buffers for kernels that store K/V themselves (slot = position mod S_l;
  // only on layers without restoration, see plain()).
  at::Tensor& k_mut(int64_t layer) { return k_[layer]; }
  at::Tensor& v_mut(int64_t layer) { return v_[layer]; }
  // Absolute position held by each slot of this layer's buffers, -1 if empty: [S_l] int64.
  const at::Tensor& slot_positions(int64_t layer) const;
  // True when T new tokens can be written before attending (no ring slot that a
  // query of the chunk still needs gets overwritten); otherwise attend over
  // [cache ++ new] and write afterwards.
  bool write_first(int64_t layer, int64_t t) const;
  // Which slots of `layer` each query at q_pos [T] attends to: [T, S_l] bool (the
  // layer's causal/sliding rule, and the restoration rule where the policy applies).
  at::Tensor visible(int64_t layer, const at::Tensor& q_pos) const;
  // The same over [slots as old_pos [S_l] held them before this forward's mark() ++ the
  // forward's own positions q_pos [T]] ([T, S_l + T] bool): a chunk that !write_first.
  at::Tensor visible_concat(int64_t layer, const at::Tensor& old_pos, const at::Tensor& q_pos) const;
  // The restoration / coding rule of visible() for the attention kernel, which applies
  // it per query on the device (core/kernels/ops.h CopyRule; in_restored undefined on plain layers).
  ops::CopyRule copy_rule(int64_t layer) const;

  // ---- restoration (layers the policy covers) ----
  bool restored(int64_t layer) const;            // the policy restores this layer (f_θ / exact copies)
  bool coded(int64_t layer) const;               // full-attention layer stored through a codec
  bool plain(int64_t layer) const;               // neither: slot = position mod S_l
  bool region_coded(int64_t layer) const;        // a restored layer whose restored region is coded rows
  int64_t exact_slots(int64_t layer) const;      // exact ring (all slots on plain layers)
  int64_t restored_slots(int64_t layer) const;   // restored region (0 on plain layers)
  // Restored K/V of positions that left the exact window: k (post-RoPE), v: [B, H_kv, N, D].
  // Mark once per position set (per layer type) with mark_restored, then write every layer.
  void mark_restored(LayerType type, const at::Tensor& positions);
  void write_restored(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions);
  // The exact K/V the ring still holds for `positions` (attention sinks keep theirs): {k, v} [B, H_kv, N, D].
  std::pair<at::Tensor, at::Tensor> exact_kv(int64_t layer, const at::Tensor& positions) const;
  // Writable views {k, v} [B, H_kv, n, D] of a restored (not coded) layer's two regions, slot =
  // position mod n: the exact ring (n = exact_slots) and the restored region (n = restored_slots),
  // for a kernel that stores restored K/V itself (what write_restored and exact_kv address).
  std::pair<at::Tensor, at::Tensor> exact_ring(int64_t layer);
  std::pair<at::Tensor, at::Tensor> restored_region(int64_t layer);  // not on coded-region layers:
  ops::CodedSlots region_codes(int64_t layer);                       // theirs, row = position mod n

  // ---- coded full-attention layers ----
  // Positions < coded_below(q) are read by the query at q from their coded copy (whole
  // codec blocks that left its exact window): floor(max(q - window + 1, 0) / block) · block.
  int64_t coded_below(int64_t q) const;
  // Fills the coded region of the shared scratch for `layer`: k, v [B, H_kv, capacity, D],
  // slot = position; only positions marked with mark_restored(Full, ...) are read.
  using HistoryLoader = std::function<void(int64_t layer, at::Tensor& k, at::Tensor& v)>;
  void set_history_loader(HistoryLoader f) { loader_ = std::move(f); }
  int64_t scratch_bytes() const;         // the shared scratch (0 without coded layers)

  int64_t bytes() const;                 // allocated K/V bytes (what the cache costs)
  int64_t bytes_per_layer_type(LayerType t) const;
  // Allocated bytes of the exact rings / restored regions of one layer type.
  int64_t exact_bytes(LayerType t) const;
  int64_t restored_bytes(LayerType t) const;
  int64_t full_kv_bytes(int64_t n) const;  // what an unbounded cache would hold for n positions
  // What the model's own cache needs for n positions: sliding layers min(n, sliding window), full layers n.
  int64_t native_kv_bytes(int64_t n) const;

 private:
  struct TypeState {
    at::Tensor pos;               // [S] slot positions: [ring | restored region]
    at::Tensor in_restored;       // [S] bool: slot belongs to the restored region (policy only)
    int64_t ring = 0;             // exact ring slots
    int64_t rest = 0;             // restored region slots
    bool policy = false;
    bool coded = false;           // coded full-attention layers (policy is set too: same visibility machinery)
    int64_t block = 0;            // codec block (coded only)
    int64_t window = 0;           // recent window of the exactness rule (policy) / the layer's own window
    int64_t max_evicted = -1;     // highest position overwritten in the exact ring
  };
  TypeState& state(int64_t layer) { return cfg_.is_sliding(layer) ? sliding_ : full_; }
  const TypeState& state(int64_t layer) const { return cfg_.is_sliding(layer) ? sliding_ : full_; }
  // visible() over the slots of `pos` (in_restored: which of them are restored copies).
  at::Tensor visible_over(int64_t layer, const at::Tensor& pos, const at::Tensor& in_restored,
                          const at::Tensor& q_pos) const;
  int64_t layer_bytes(int64_t layer) const;
  int64_t region_code_bytes(int64_t layer) const;  // a coded restored region's codes and side values
  int64_t slot_bytes(int64_t layer) const;         // one dense slot of K and V

  const ModelConfig& cfg_;
  KVCacheOptions opt_;
  std::vector<at::Tensor> k_, v_;       // per layer [B, H_kv_l, S_l, D_l] (coded layers: the shared scratch)
  std::vector<at::Tensor> dk_, dv_;     // per coded layer [B, H_kv, ring, D] dense exact ring (else undefined)
  std::vector<ops::CodedSlots> codes_;  // per coded-region layer: its restored region (else bits 0)
  at::Tensor scratch_k_, scratch_v_;    // [B, H_kv, ring + capacity, D] shared by the coded layers
  HistoryLoader loader_;
  TypeState full_, sliding_;
  int64_t length_ = 0;
};

}  // namespace kakeya
