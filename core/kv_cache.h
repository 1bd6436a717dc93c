// Per-layer K/V cache with explicit capacity and static shapes (CUDA-graph
// friendly: appends are index_copy_ at device-computed slots, never reallocations).
//
// Full-attention layers hold `capacity` slots; sliding layers hold a ring of
// window + rollback slots, so they never cost more than their window. Each
// layer type keeps the absolute position stored in every slot (-1 = empty);
// attention masks are derived from it, which makes a ring and a linear buffer
// the same thing to the forward pass. truncate(n) only invalidates slots, so it
// is O(1) in host work; a sliding ring can roll back at most `rollback` tokens.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "core/config.h"

namespace kakeya {

struct KVCacheOptions {
  int64_t batch = 1;
  int64_t capacity = 4096;      // positions a full-attention layer can hold
  int64_t rollback = 64;        // tokens truncate() may remove from sliding rings (speculative blocks)
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
};

class KVCache {
 public:
  KVCache(const ModelConfig& cfg, const KVCacheOptions& opt);

  int64_t length() const { return length_; }        // positions committed so far
  int64_t capacity() const { return opt_.capacity; }
  int64_t num_layers() const { return (int64_t)k_.size(); }
  int64_t slots(int64_t layer) const { return k_[layer].size(2); }

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

  const at::Tensor& keys(int64_t layer) const { return k_[layer]; }     // [B, H_kv_l, S_l, D_l]
  const at::Tensor& values(int64_t layer) const { return v_[layer]; }   // [B, H_kv_l, S_l, D_l]
  // Writable buffers for kernels that store K/V themselves (slot = position mod S_l).
  at::Tensor& k_mut(int64_t layer) { return k_[layer]; }
  at::Tensor& v_mut(int64_t layer) { return v_[layer]; }
  // Absolute position held by each slot of this layer's buffers, -1 if empty: [S_l] int64.
  const at::Tensor& slot_positions(int64_t layer) const;
  // True when T new tokens can be written before attending (no ring slot that a
  // query of the chunk still needs gets overwritten); otherwise attend over
  // [cache ++ new] and write afterwards.
  bool write_first(int64_t layer, int64_t t) const;

  int64_t bytes() const;                 // allocated K/V bytes (what the cache costs)
  int64_t bytes_per_layer_type(LayerType t) const;
  int64_t full_kv_bytes(int64_t n) const;  // what an unbounded cache would hold for n positions

 private:
  const ModelConfig& cfg_;
  KVCacheOptions opt_;
  std::vector<at::Tensor> k_, v_;       // per layer [B, H_kv_l, S_l, D_l]
  at::Tensor pos_full_, pos_sliding_;   // [S_full], [S_sliding] int64
  int64_t length_ = 0;
  int64_t max_evicted_ = -1;            // highest position overwritten in a sliding ring
};

}  // namespace kakeya
