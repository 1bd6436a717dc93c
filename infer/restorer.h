// Restoration: the rules every restored mode implements, and the Restorer that keeps a
// KV cache's restored region up to date around the forwards on it.
//
// Restoration semantics (the definition every mode below implements). On a
// layer the policy covers (every sliding-attention layer; full-attention layers
// too with --full-attn restored), a query at position p attends to the
// positions j of its span (p - sliding_window < j <= p on sliding layers, j <= p
// on full ones) through
//   exact K/V     when p - j < window            (the `window` most recent positions, p included)
//   restored K/V  otherwise:
//       j <  sink: the exact K/V of j (attention sinks are never approximated)
//       j >= sink: finish_kv(a · true_raw(j) + (1 - a) · f_θ(drafter_raw(j)))
//       on a token layer (token_layer(), RestoreOptions::token_layers, a < 1): j's exact K/V,
//                  a function of j's token alone
// where drafter_raw(j) = the drafter's raw context K/V at j (what Tap::KProj/VProj of
// Drafter::context_kv see, computed for all drafter layers in one GEMM by
// Drafter::context_raw_kv_rows, on the verifier's hidden states at j, which are themselves
// computed under these rules), true_raw(j) = the verifier's own raw K/V at j
// (Tap::KProj/VProj), a = --mix-alpha (0: pure f_θ; at 1 the restored K/V of j is j's exact
// K/V, copied from the exact ring as j leaves it: the same values finish_kv(true_raw(j)) gives,
// without keeping the raw K/V), and finish_kv = the
// verifier's own k_norm/v_norm + RoPE (Model::finish_kv). Full-attention layers
// under --full-attn exact keep every position exact (the seeds' S5). Under
// --full-attn codec they keep every position's K/V as coded rows (--full-code,
// core/kernels/ops.h), written by the forward that computes them, and the exact K/V of
// the window: the query at p reads j exactly when p - j < window, else its coded row.
//
// Modes:
//   ar                  the full-KV oracle (infer/generate.h), nothing restored.
//   restored-reforward  the slow reference: per generated token, the whole prefix
//                       again from an empty cache with one slot per position (no
//                       rings), in chunks of <= window tokens. A chunk never needs
//                       restored K/V of itself (p - j < window inside it), and j's
//                       restoration only needs drafter_raw(j), known once j's chunk
//                       ran, so chunking breaks the circularity. O(T²).
//   restored            incremental (Gap-A): restored K/V are written ONCE per
//                       position and layer into the KV cache's restored region
//                       (core/model/kv_cache.h RestorePolicy), at the latest just before the
//                       first forward whose queries need them (when the position leaves
//                       the exact window); the prompt is prefilled in chunks of <= window
//                       tokens (longer at a = 1: such a chunk reads its own positions
//                       exactly and the cache stores their copies as it writes them), then
//                       one forward per token, and every ~window/2 steps one batch projects
//                       the drafter context and restores ahead the next ~window/2 positions
//                       (Restorer::next_upkeep; on CUDA beside the steps, infer/upkeep.h).
//                       O(1) per token.
//   fused               `restored` accelerated by speculative decoding with the drafter
//                       (infer/fused.h): blocks verified on the restored cache, same tokens.
// Both restored modes run the unmodified Model::forward: restoration lives in
// taps (Restorer subscribes to Tap::LayerOut for the drafter's features and to
// Tap::KProj/VProj for the true raw K/V) and cache writes.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/kv_cache.h"
#include "core/model/model.h"
#include "core/model/taps.h"
#include "infer/options.h"
#include "infer/result.h"
#include "infer/upkeep.h"

namespace kakeya {

// Clear errors for inputs the decoder cannot serve: sink/window/chunk/alpha out of
// range, sink + window >= the model's sliding window (sliding layers would never
// restore anything), window >= the context (nothing would be restored), a prompt
// plus new tokens beyond the model's limit or the loaded RoPE table, missing
// drafter/f_θ, an f_θ for another verifier/drafter pair.
void validate_restore(const Model& verifier, const Drafter* drafter, const FTheta* ftheta, const RestoreOptions& opt,
                      int64_t n_prompt, int64_t max_new_tokens, const std::string& ftheta_origin = "f_theta");

// The codes a restored region takes, "int8 | int6 | int4 | lm5 | ...": the unweighted row codes (a
// weighted pwB code's K weights are calibrated for full-attention rows, --full-code).
std::string region_code_names();
// Throws unless `code` is one a restored region takes (none or unweighted), naming `flag` and
// region_code_names(). validate_restore calls it; the CLI calls it while parsing, so that a run
// with several decoders refuses the flag before the first one starts.
void check_region_code(const ops::RowCode& code, const std::string& flag);
// The window and chunk a restored decoder can run: window >= 1, chunk in [0, window] (0: window; a
// longer chunk would need restored K/V of itself). who: the command, for the message ("decode").
void check_window_chunk(const RestoreOptions& o, const std::string& who);

// For one-off measurements (a decode, a NIAH ladder, an evaluation, scoring): a context the
// window covers whole restores nothing, so the run would measure the plain model; throws naming
// --window. The decoders themselves accept it: a conversation (a session, the server) may start
// that short and grow past the window later.
void check_restores_something(const RestoreOptions& o, int64_t n_prompt, int64_t max_new_tokens);

// RestoreOptions::layers per verifier layer: true where the layer reads its restored positions
// (false on layers the policy does not cover). Throws naming --restore-layers on a bad list.
std::vector<bool> resolve_restore_layers(const ModelConfig& cfg, const FTheta* f, const RestoreOptions& o);
// --restore-layers auto against the f_θ that will serve it: an f_θ whose per-layer measurement
// kept no layer (none beat evict-only there) restores nothing, so the options become evict-only
// ("none") and the decoder loads and runs neither the drafter nor f_θ for it. True when it changed
// them. Only f_θ-restored decoding (needs_ftheta()) reads the list; exact restoration keeps "auto".
bool settle_auto_layers(RestoreOptions& o, const FThetaConfig& f);
// Whether verifier layer l's raw K/V are a function of the position's token alone (the first
// layer): RestoreOptions::token_layers restores such layers from the token, exactly.
bool token_layer(int64_t l);
// The cache policy's per-layer drop mask (covered layers that do not restore) and sink.
void set_dropped_layers(RestorePolicy& p, const ModelConfig& cfg, const FTheta* f, const RestoreOptions& o);


// Keeps the cache's restored region up to date around every forward on it.
//   restorer.prepare(p0, t);                       // before a forward of t tokens at p0
//   model.forward(ids, pos, cache, {.taps = restorer.verifier_taps()});
//   restorer.commit(p0, n);                         // its first n positions are committed
// commit() runs the drafter's context projection on the committed positions
// (or extends `dcache` with them, for a caller that drafts) and keeps their raw
// K/V (Tap::KProj/VProj) until the positions leave the window; prepare() restores
// every position the forward's queries see as "old" and that is not restored yet.
class Restorer : public TapSubscriber {
 public:
  // drafter/ftheta may be null when a = 1 (exact restoration needs neither).
  Restorer(const Model& verifier, const Drafter* drafter, const FTheta* ftheta, const RestoreOptions& opt,
           KVCache& cache);
  Restorer(const Restorer&) = delete;
  Restorer& operator=(const Restorer&) = delete;

  const RestoreOptions& options() const { return opt_; }
  const Taps* verifier_taps() const { return &vtaps_; }  // every forward on the cache
  const Taps* drafter_taps() const { return &dtaps_; }   // Drafter::extend / context_kv on committed positions
  void prepare(int64_t p0, int64_t t);
  void commit(int64_t p0, int64_t n, DrafterCache* dcache = nullptr);
  // After a forward of n > window positions at p0 (exact copies; commit() does it): the copies of
  // its positions that left the window, which the cache stored as it wrote them, are restored.
  void note_own_copies(int64_t p0, int64_t n);
  // The device work of prepare() for positions js [N] on the device (capturable: run_chunks'
  // chunk graph), without its host bookkeeping: the caller reports them with note_restored().
  // Only where commits need no host work (commits_on_device()).
  void restore_at(const at::Tensor& js);
  // Every position <= j is restored (or in a batch in flight): the host bookkeeping of a
  // restoration the device ran from a graph.
  void note_restored(int64_t j);
  // The forwards' stash_step() leaves nothing for commit() to do: f_θ reads the target features
  // the forward stores (start_upkeep + stash_in_forward), or restoration needs no f_θ inputs.
  bool commits_on_device() const;
  // Restoring ahead, in batches: a committed position may get its restored copy before it
  // leaves the window (the mask shows each query one copy), as long as the restored region's
  // ring does not overwrite a slot a later query still reads there: a forward whose first
  // query is q may find every position <= q - 1 - ahead_gap() restored.
  int64_t ahead_gap() const;
  // Batched restoration for forwards whose positions live on the device (decode steps, fused
  // blocks), so CUDA graphs can capture them. start_upkeep(span) first (before the prefill: it
  // allocates the ring of target features the commits fill; forwards on the device store theirs
  // with stash_step / stash_features): a forward the host launches knowing it starts at s or
  // later has its queries within s .. s + span - 1 (1 for decode steps, B for fused blocks, 2B - 1
  // for a block enqueued before the previous one's report is read). Before such a forward,
  // next_upkeep(s) is asked until it answers from < 0: each batch restores the upkeep_len()
  // positions from restored_upto() + 1 once s - 1 - ahead_gap() covers them (every position < s
  // is committed, so nothing it reads can change while it runs), and is first read by a forward
  // launched at s' >= read_at. With L = upkeep_len() at most half of window - gap - span + 1,
  // every position a forward reads restored was in a batch due at least L positions earlier,
  // which is what lets a batch overlap the forwards (infer/upkeep.h). The batch's device work:
  // upkeep_from(from) (stores the argument on the device, outside any graph), then upkeep()
  // (capturable): f_θ's drafter inputs projected from the stored features, then restoration.
  void start_upkeep(int64_t span);
  int64_t upkeep_len() const { return upkeep_len_; }
  UpkeepBatch next_upkeep(int64_t s);
  void upkeep_from(int64_t from);
  void upkeep();
  void stash_step(const at::Tensor& pos);  // the last forward's target features at pos [T]
  // From now on the verifier's forwards write the target features into the ring themselves
  // (TargetFeatureCapture::store_into: inside the residual kernel), so stash_step has no work.
  void stash_in_forward();
  // Target features feats [1, T, n·H] of positions pos [T] (device) into the feature ring
  // (no-op without one): a caller that runs its own forwards (fused blocks) stores them so
  // upkeep() can project the drafter context at restoration time; or it writes them there
  // itself (TargetFeatureCapture::take_into) through feature_ring() (null without one).
  void stash_features(const at::Tensor& feats, const at::Tensor& pos);
  at::Tensor* feature_ring() { return feat_.defined() ? &feat_ : nullptr; }  // [ring, n·H], row = position mod ring
  // The feature ring moves into `ring` (same shape and dtype; e.g. one row's part of a ring that a
  // batch of sessions shares, infer/batch.h): after start_upkeep, before stash_in_forward.
  void use_feature_ring(at::Tensor ring);
  // A new session on the same cache (which the caller clear()s): nothing restored, no statistics.
  void reset();
  int64_t restored_upto() const { return restored_upto_; }  // every position <= this is restored
  int64_t pending_bytes() const;   // f_θ inputs of positions not restored yet (drafter raw K/V, target features)
  int64_t true_raw_bytes() const;  // true raw K/V kept for --mix-alpha / stats
  RestoreStats stats() const;      // SYNC: reads the device accumulators
  void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) override;
  // The verifier's raw K/V only when they are kept (mix-alpha / stats): otherwise the
  // forward keeps its fused q/k-norm + RoPE + store kernel (core/model/taps.h).
  bool reads(Tap tap) const override {
    return (tap == Tap::KProj || tap == Tap::VProj) && opt_.needs_true_raw();
  }

 private:
  struct DrafterTap : TapSubscriber {
    Restorer* self = nullptr;
    void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) override;
    // The raw K/V only: Drafter::store_context keeps its fused kernel.
    bool reads(Tap tap) const override { return tap == Tap::KProj || tap == Tap::VProj; }
  };
  // Restores positions js [N] (device, each restored once); sinks get their exact copy and stay
  // out of the error statistics. dk, dv [N, L_d, H_d, D_d]: the drafter raw K/V of js (undefined at a = 1).
  void restore(const at::Tensor& js, const at::Tensor& dk, const at::Tensor& dv);
  // restore() on CUDA in two GEMMs per stream and one store launch: f_θ's fused outputs, then
  // ops::RestoreStore k-norms, RoPEs and stores them into every layer's restored region (sinks
  // copied from the exact ring): what finish_kv + write_restored do, without ~a dozen ops per layer.
  // The token layers (and at a = 1 every layer, with no f_θ) take a second store's copy from the
  // exact ring (RestoreStore::copy).
  void restore_kernel(const at::Tensor& js, const at::Tensor& dk, const at::Tensor& dv);
  at::Tensor take_features(int64_t n);

  const Model& model_;
  const Drafter* drafter_;
  const FTheta* ftheta_;
  RestoreOptions opt_;
  KVCache& cache_;
  std::vector<int64_t> layers_;                  // verifier layers the policy covers
  bool has_sliding_ = false, has_full_ = false;  // layer types among them
  std::unique_ptr<TargetFeatureCapture> capture_;
  DrafterTap dtap_;
  Taps vtaps_, dtaps_;
  int64_t ring_ = 0;                             // positions the pending rings hold
  at::Tensor dk_, dv_;                           // [ring, L_d, H_d, D_d] drafter raw K/V
  at::Tensor feat_;                              // [ring, n·H] target features of committed positions (start_upkeep)
  int64_t upkeep_len_ = 0, upkeep_span_ = 0;     // batch length, a forward's reach past its known start (start_upkeep)
  at::Tensor upkeep_off_;                        // [L] 0 .. L-1: a batch's positions from its first
  at::Tensor upkeep_first_;                      // [1] the batch's first position (upkeep_from)
  std::vector<at::Tensor> tk_, tv_;              // per verifier layer [ring, H_kv, D] true raw K/V (or undefined)
  at::Tensor acc_;                               // [2 raw|cache, 2 type, 2 stream, 2 err|ref] f64 accumulators
  int64_t stat_positions_ = 0;
  int64_t restored_upto_ = -1;
  bool kernel_ = false;                          // restore() runs restore_kernel()
  bool features_in_ = false;                     // f_θ reads the target features (feat_) instead of dk_/dv_
  std::vector<bool> from_token_;                 // per verifier layer: restored from the token (token_layers)
  std::unique_ptr<ops::RestoreStore> store_;     // restore_kernel()'s store of f_θ's rows (kernel_ only)
  std::unique_ptr<ops::RestoreStore> copy_store_;  // its copies from the exact ring: every layer at a = 1, else the token layers
};
// The cache a restored decode of `capacity` positions runs on (linear: one slot per position,
// no rings: the reforward reference).
KVCacheOptions restored_cache_options(const Model& verifier, const FTheta* ftheta, const RestoreOptions& o,
                                      int64_t capacity, bool linear);

// A prefill chunk is launch-bound when run op by op: ~500 small kernels per 256 tokens, each
// launched from the host. On CUDA this keeps one graph of a *steady* chunk, captured by the
// first prefill that reaches one and replayed by every later steady chunk, of that prefill and
// of the later ones on the same cache and Restorer (the graph reads their buffers in place).
// A chunk at q0 is steady when it is `chunk` tokens long and every position before
// q0 - window is restored: then its prepare() restores exactly q0 - window .. q0 - window +
// chunk - 1, which the graph does from the chunk's positions on the device (Restorer::
// restore_at), before the forward and the stash of its target features. Other chunks (the
// first window, a short tail, an extend() that does not start on the chunk grid) run eagerly.
// Empty off CUDA, and where the Restorer's commits need the host (!commits_on_device()). Every
// ChunkGraph of the process captures into one memory pool: a graph's temporaries are held once
// per process, not once per decoder (which is why two prefills must not run at the same time).
class ChunkGraph {
 public:
  ChunkGraph();
  ~ChunkGraph();
  ChunkGraph(const ChunkGraph&) = delete;
  ChunkGraph& operator=(const ChunkGraph&) = delete;
  bool captured() const;
  double capture_seconds() const;  // wall seconds the capture took (0 before it)

 private:
  friend at::Tensor run_chunks(const Model&, KVCache&, Restorer&, const at::Tensor&, int64_t, int64_t, bool,
                               ChunkGraph*);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs ids [1, n] at positions [p0, p0 + n) through the restored cache in chunks of <= chunk
// tokens (prepare / forward / commit each, or a replay of `graph`); the logits [1, 1, V] of the
// last position when want_logits.
at::Tensor run_chunks(const Model& verifier, KVCache& cache, Restorer& r, const at::Tensor& ids, int64_t p0,
                      int64_t chunk, bool want_logits, ChunkGraph* graph = nullptr);

// Share of the span of the query at q that each layer type sees through exactly one copy per
// position (1.0 = nothing lost, nothing twice); -1 without such layers. SYNC: diagnostics.
double attention_fraction(const KVCache& cache, const ModelConfig& cfg, bool sliding, int64_t q);

}  // namespace kakeya
