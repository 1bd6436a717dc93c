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
// parts at once; the mask shows each query exactly one of the two copies. Where every layer of
// a type drops its restored positions (evict-only), the region holds sink + 1 slots instead.
// A forward's own positions are read exactly: a chunk of at most `window` tokens holds only
// recent ones, and a longer one (RestorePolicy::exact_copies) has no restored copies of them yet;
// it stores those copies itself as it writes (the restored copy of a position is then its exact
// K/V, through the region's code), and its restored region holds sliding window - 1 slots. A coded
// full-attention layer (below) then attends every forward longer than a step over [its slots ++
// the chunk] and codes the chunk after, so its ring holds window + max_step - 1 slots.
//
// Coded regions (core/kernels/ops.h coded rows): a restored layer with RestorePolicy::
// region_code keeps its exact ring dense and its restored region as coded rows (int4 about
// 0.31x of bf16, lm3 about 0.2x); a full-attention layer with full_code (the restored
// decoder's --full-attn codec) keeps every position's K/V too, but as coded rows, written
// by the forward that computes them (row = position), and a dense exact ring of the recent
// window, which serves the same exactness rule as a restored layer's: positions older
// than the window are read from their coded copy, except the attention sinks (positions <
// RestorePolicy::sink), whose exact K/V the layer keeps in `sink` dense slots after its ring
// (their coded rows are hidden: a sink draws much of the attention, so its coding error would
// cost far more than any other row's). keys()/values() then hold the ring (and sinks) only;
// the attention kernel reads the codes itself (copy_rule), and attend_kv() gives the
// reference paths (prefill chunks, CPU) the whole layer decoded.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "core/model/config.h"
#include "core/kernels/ops.h"

namespace kakeya {

// Attention visibility [T, S] bool: slot s (holding position slot_pos[s], -1 = empty) is visible
// to the query at q_pos[t] if it holds a position <= the query's and, when window > 0, within
// the window. slot_pos: [S] int64, q_pos: [T] int64 (or per row: [B, S] and [B, T] -> [B, T, S]).
// The one rule the cache and the forward share.
at::Tensor causal_visible(const at::Tensor& slot_pos, const at::Tensor& q_pos, int64_t window);

struct RestorePolicy {
  int64_t window = 0;     // exact recent positions per query (the query included); 0: no restoration
  bool sliding = true;    // restore on sliding-attention layers
  bool full = false;      // restore on full-attention layers
  int64_t max_chunk = 1;  // most tokens one forward writes (prefill chunks, verify blocks)
  int64_t max_step = 1;   // most tokens a forward on sliding layers writes before attending (decode
                          // steps 1, verify blocks B); longer ones attend over [ring ++ chunk]
  bool linear = false;    // one slot per position in both regions, no rings (reference decoders)
  ops::RowCode full_code;  // defined: full-attention layers keep every position as coded rows (exclusive with `full`)
  std::vector<ops::RowCode> full_code_layers;  // per layer where defined: its own code instead (ops::layer_code)
  // Per layer (empty: none): a covered layer that drops its restored positions — its restored
  // region shows only the sinks (positions < sink), so it attends sinks + the exact window
  // (evict-only on that layer). Restoration still writes the region; the mask hides it.
  std::vector<bool> drop;
  int64_t sink = 0;
  ops::RowCode region_code;  // defined: restored regions stored as coded rows (else in the cache dtype)
  // Exact restoration: a position's restored copy is its exact K/V (through region_code), so a
  // forward of more than `window` tokens may run (max_chunk > window): write() also stores the
  // copies of its positions that leave the window within it. Restored sliding layers, and coded
  // full-attention ones (full_code: every position is coded as it is written); not `full` (a
  // restored full-attention layer's ring would grow with the chunk).
  bool exact_copies = false;
  // Weighted full-attention codes: per layer, the K weights of its coded rows ([H_kv, D] f32, any device;
  // calib/calibrate.h k_weights); read on the layers whose code is weighted, which must all have one.
  std::vector<at::Tensor> full_k_weight;
  bool enabled() const { return window > 0; }
  bool drops(int64_t layer) const { return layer < (int64_t)drop.size() && drop[layer]; }
};

struct KVCacheOptions {
  int64_t batch = 1;
  // Independent rows: each batch row holds its own sequence at its own positions (a batch of
  // decode sessions, infer/batch.h). Forwards pass positions [B, T]; slot positions are kept
  // per row ([B, S_l]); each row is filled and emptied alone, through its row() view; the
  // cache keeps no common length (the caller tracks each row's). A restore
  // policy applies to every row (not a linear one); restoration itself goes through each row's
  // view (mark_restored / write_restored refuse the rows cache).
  bool rows = false;
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
  int64_t slots(int64_t layer) const { return state(layer).pos.size(-1); }

  // Writes K/V of T new tokens at absolute `positions` for one layer.
  // k, v: [B, H_kv, T, D] (post-RoPE k). positions: [T] int64 on the cache device ([B, T] with rows).
  void write(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions);
  // Marks the slot positions of every layer type for `positions` (once per forward, before write()).
  void mark(const at::Tensor& positions);
  // Commits T positions after a forward (host bookkeeping only).
  void advance(int64_t t);
  // Drops every position >= n. Throws if a sliding ring already overwrote what n needs.
  void truncate(int64_t n);
  void clear() { truncate(0); }

  // ---- independent rows (KVCacheOptions::rows) ----
  // Row b as a cache of one sequence (batch 1, no rows) sharing this cache's buffers: what a
  // session does alone on its row — its prefill, its restorer's writes — lands in the row. The
  // view keeps its own length; a row is emptied with the view's clear().
  KVCache row(int64_t b) const;
  // The first n rows as a cache of batch n sharing these buffers (a forward over the rows in use).
  KVCache first_rows(int64_t n) const;

  // The dense slots: [B, H_kv_l, S_l, D_l], or the exact ring only ([B, H_kv_l, exact_slots, D_l])
  // on a layer with a coded region (region_coded, coded).
  const at::Tensor& keys(int64_t layer) const { return k_[layer]; }
  const at::Tensor& values(int64_t layer) const { return v_[layer]; }
  // Every slot dense, {k, v} [B, H_kv_l, S_l, D_l]: keys()/values(), or on a layer with a coded
  // region the ring followed by the decoded region (a temporary: the reference attention path).
  std::pair<at::Tensor, at::Tensor> attend_kv(int64_t layer) const;
  // Writable buffers for kernels that store K/V themselves (slot = position mod exact_slots;
  // on a coded layer, code_stored() must follow).
  at::Tensor& k_mut(int64_t layer) { return k_[layer]; }
  at::Tensor& v_mut(int64_t layer) { return v_[layer]; }
  // Absolute position held by each slot of this layer's buffers, -1 if empty: [S_l] int64 ([B, S_l] with rows).
  const at::Tensor& slot_positions(int64_t layer) const;
  // True when T new tokens can be written before attending (no ring slot that a
  // query of the chunk still needs gets overwritten); otherwise attend over
  // [cache ++ new] and write afterwards.
  bool write_first(int64_t layer, int64_t t) const;
  // Which slots of `layer` each query at q_pos [T] attends to: [T, S_l] bool (the
  // layer's causal/sliding rule, and the restoration rule where the policy applies);
  // with rows, q_pos [B, T] -> [B, T, S_l].
  at::Tensor visible(int64_t layer, const at::Tensor& q_pos) const;
  // The same over [slots as old_pos [S_l] held them before this forward's mark() ++ the
  // forward's own positions q_pos [T]] ([T, S_l + T] bool): a chunk that !write_first. Its own
  // positions are read exactly at every distance within the span.
  at::Tensor visible_concat(int64_t layer, const at::Tensor& old_pos, const at::Tensor& q_pos) const;
  // The restoration / coding rule of visible() for the attention kernel, which applies
  // it per query on the device (core/kernels/ops.h CopyRule; in_restored undefined on plain layers).
  ops::CopyRule copy_rule(int64_t layer) const;

  // ---- restoration (layers the policy covers) ----
  bool restored(int64_t layer) const;            // the policy restores this layer (f_θ / exact copies)
  bool coded(int64_t layer) const;               // full-attention layer stored as coded rows (full_code)
  bool plain(int64_t layer) const;               // neither: slot = position mod S_l
  bool region_coded(int64_t layer) const;        // a restored or coded layer whose region is coded rows
  int64_t exact_slots(int64_t layer) const;      // exact ring (all slots on plain layers)
  int64_t dense_slots(int64_t layer) const;      // the ring and a coded layer's exact sinks
  int64_t restored_slots(int64_t layer) const;   // restored region (0 on plain layers)
  // Every layer of this one's type drops its restored positions (evict-only, RestorePolicy::drop):
  // its region holds sink + 1 slots, not a ring of old positions.
  bool sinks_only(int64_t layer) const;
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
  // After a kernel stored `positions` [T] into the exact ring (k_mut/v_mut), their coded rows
  // (row = position); write() does this itself (a chunk longer than the ring a ring's worth at a time).
  void code_stored(int64_t layer, const at::Tensor& positions);
  int64_t coded_bytes() const;            // the coded rows of the coded full-attention layers

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
    int64_t held = 0;             // exact sink slots after the ring (coded layers)
    at::Tensor held_pos;          // [held] int64: 0 .. held - 1, what they hold
    // Coded layers: the positions of the last mark() ([T] or [B, T]) and their ring slots, which
    // code_stored reads for those same positions instead of one remainder kernel per layer.
    at::Tensor marked, marked_slot;
    int64_t rest = 0;             // restored region slots
    bool policy = false;
    bool coded = false;           // coded full-attention layers (policy is set too: same visibility machinery)
    int64_t window = 0;           // recent window of the exactness rule (policy) / the layer's own window
    int64_t max_evicted = -1;     // highest position overwritten in the exact ring
    bool sinks_only = false;      // every layer of the type drops (evict-only): the region holds the sinks
  };
  // A restored position's row of the region: position mod its slots, or on a sinks-only region
  // the sink itself (< sink) or the one slot past them (every other position, never shown).
  at::Tensor region_slot(const TypeState& s, const at::Tensor& positions) const;
  TypeState& state(int64_t layer) { return cfg_.is_sliding(layer) ? sliding_ : full_; }
  const TypeState& state(int64_t layer) const { return cfg_.is_sliding(layer) ? sliding_ : full_; }
  // visible() over the slots of `pos` (in_restored: which of them are restored copies; slots from
  // own_from on: the forward's own positions, exact at every distance; -1: none).
  at::Tensor visible_over(int64_t layer, const at::Tensor& pos, const at::Tensor& in_restored,
                          const at::Tensor& q_pos, int64_t own_from = -1) const;
  KVCache slice_rows(int64_t b, int64_t n, bool rows) const;  // row() and first_rows()
  int64_t layer_bytes(int64_t layer) const;
  int64_t region_code_bytes(int64_t layer) const;  // a coded region's codes and side values
  int64_t slot_bytes(int64_t layer) const;         // one dense slot of K and V
  // A coded layer's means, set by a session's first forward from k, v [B, H_kv, T, D] at positions [T].
  void set_means(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions);

  const ModelConfig& cfg_;
  KVCacheOptions opt_;
  std::vector<at::Tensor> k_, v_;       // per layer [B, H_kv_l, S_l, D_l] (the ring only where codes_ holds the region)
  std::vector<ops::CodedSlots> codes_;  // per layer with a coded region: its rows (else undefined)
  TypeState full_, sliding_;
  int64_t length_ = 0;
};

}  // namespace kakeya
