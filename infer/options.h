// The options every decode mode reads (one struct, no per-mode copies) and the restore
// options of the restored modes. infer/result.h holds the one result type they return.
#pragma once
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/kernels/ops.h"
#include "core/model/sampling.h"

namespace kakeya {

enum class DecodeMode { Ar, RestoredReforward, Restored, Fused };
const char* decode_mode_name(DecodeMode m);               // "ar" | "restored-reforward" | "restored" | "fused"
DecodeMode parse_decode_mode(const std::string& name);    // throws on anything else

enum class FullAttn { Exact, Restored, Codec };
const char* full_attn_name(FullAttn f);                   // "exact" | "restored" | "codec"
FullAttn parse_full_attn(const std::string& name);

// How the restored modes treat positions that leave the exact window (infer/restorer.h
// states the rules).
struct RestoreOptions {
  int64_t sink = 4;          // first positions whose exact K/V are kept wherever they are in span
  // Exact recent positions per query (the query included). 256: the smallest window of 64, 128, 192
  // and 256 whose restored perplexity stays within 1% of the full cache's at 8k and 16k on held-out
  // documents with the shipped f_θ (kakeya eval-long; bench/results/README.md, 2026-11-26).
  int64_t window = 256;
  FullAttn full_attn = FullAttn::Exact;
  // Restored raw K/V = a·true + (1-a)·f_θ. 0 < a < 1 keeps the true raw K/V (research mode); a = 1
  // (exact restoration) copies each position's exact K/V from the exact ring as it leaves the window,
  // through the region's code: no drafter, no f_θ, nothing pending (the baseline f_θ must beat at
  // the same region bytes).
  double mix_alpha = 0.0;
  // Prefill tokens per forward, 1..window (0: window); longer with long_chunks(): exact restoration
  // has no restored copy of a chunk's own positions to wait for, so a chunk reads them exactly and
  // stores their copies as it writes them (core/model/kv_cache.h RestorePolicy::exact_copies), and
  // 0 then means kLongChunk.
  int64_t chunk = 0;
  bool kernels = true;       // CUDA: restore through the fused store kernel where it applies (false: reference ops)
  bool stats = false;        // relative error of restored vs true K/V (keeps true raw K/V too)
  // FullAttn::Codec: every position of the full-attention layers stored as these coded rows
  // (--full-code; core/kernels/ops.h), the exact window beside them; the attention kernel reads the codes.
  ops::RowCode full_code{ops::RowKind::Rotated, 4};
  // Per full-attention layer where defined: its own code instead (--full-code pw4+17=pw5v4;
  // ops::layer_code): where the bytes go furthest, e.g. more bits on the layer that loses most.
  std::vector<ops::RowCode> full_code_layers;
  // A calibration bundle holding K weights (kakeya calibrate k-weights): read when a full-attention
  // layer's code is weighted (pwB), refused when made for another model.
  std::string calib;
  // Restored regions stored as coded rows (--restored-code; undefined: in the model dtype).
  ops::RowCode region_code;
  // Which of the covered layers read their restored positions (beyond the sinks); the others drop
  // them (evict-only on that layer: sinks + the exact window, nothing older). "auto": the layers
  // f_θ's config lists as measured better than eviction (every covered layer when f_θ was never
  // measured; nothing when the measurement kept none, which settle_auto_layers() turns into "none"),
  // "all", "none" (evict-only everywhere: the StreamingLLM baseline, needs no f_θ), or a
  // comma-separated list of verifier layers. resolve_restore_layers() turns it into a per-layer mask.
  std::string layers = "auto";
  // Covered layers whose K/V are a function of the position's token alone (token_layer(): the
  // first layer, whose input is the token's embedding) are restored from the token, exactly: their
  // restored K/V are what the verifier computed for that token, copied from the exact ring as the
  // position leaves it (as a = 1 does), so f_θ's error there is gone and a region restored on the
  // fly would need only the token id. false: f_θ restores them too (what this is measured against).
  // Only with f_θ (a < 1); evict-only drops them like every covered layer.
  bool token_layers = true;
  // Exact restoration's prefill chunk when --chunk is 0. Chunks of the window run ~330 small kernels
  // per 64 tokens (0.19x AR's prefill at 8k, window 64, int8 regions, H200); longer ones run eagerly:
  // 1024 tokens 0.26x, 2048 0.60-0.79x, 4096 1.03-1.06x (2.45x at 32k; coded full-attention layers
  // 0.81-0.83x with int8 regions, 0.76x with lm5), 8192 0.77x, for an attention scratch that grows
  // with the chunk (bench/results/README.md, stops 51 and 52).
  static constexpr int64_t kLongChunk = 4096;
  int64_t resolved_chunk() const { return chunk > 0 ? chunk : long_chunks() ? kLongChunk : window; }
  // The chunk capped at the window: what a restored region is sized for (a longer chunk reads it as
  // a chunk of the window does), and the chunks of scoring and the reforward reference, which
  // measure what a decode step sees.
  int64_t window_chunk() const { return std::min(resolved_chunk(), window); }
  bool needs_true_raw() const { return (mix_alpha > 0.0 && mix_alpha < 1.0) || stats; }
  bool evict_only() const { return layers == "none"; }
  // Whether a full-attention layer's code (full_code or its own) is weighted: K weights from --calib.
  bool full_code_weighted() const;
  bool needs_ftheta() const { return mix_alpha < 1.0 && !evict_only(); }
  // Prefill chunks may exceed the window: exact restoration (a = 1, no statistics) with exact or
  // coded full-attention layers (a coded layer attends such a chunk over [its rows ++ the chunk] and
  // codes it after; a restored full layer would need restored copies of the chunk itself).
  bool long_chunks() const {
    return mix_alpha >= 1.0 && !stats && !evict_only() && full_attn != FullAttn::Restored;
  }
  nlohmann::json to_json() const;
};

// Without streaming, stop tokens are looked for every this many steps: the steps after a
// stop inside a batch are wasted work, but none of them waits on the host.
constexpr int64_t kStopCheckEvery = 8;

// Every decode mode's options. A persistent decoder fixes the fields its caches and graphs
// depend on when it is built (mode, restore, sampling temperature/top-p, cuda_graph, megakernel,
// head_screen, block_size) and refuses a run that changes them, by name.
struct DecodeOptions {
  DecodeMode mode = DecodeMode::Ar;
  RestoreOptions restore;               // restored modes
  int64_t max_new_tokens = 64;
  SamplingOptions sampling;             // temperature 0: greedy
  std::vector<int64_t> stop_ids;        // generation ends after emitting one of these
  std::function<void(int64_t)> on_token;  // each generated token, in order
  // Asked after each token is read back: true ends the generation there (a client went away,
  // a stop string matched). Implies streaming reads.
  std::function<bool()> should_stop;
  bool stream = true;                   // read each token as it comes (one host sync per token); otherwise
                                        // stops are checked every kStopCheckEvery steps (one sync each)
  bool cuda_graph = true;               // CUDA: replay the decode step (fused: the block's parts) as graphs
  // CUDA graphs, AR: the step's kernels run as programs of one persistent kernel (ops::StepProgram,
  // experimental: same tokens, 0.73x the speed today); a step it cannot record
  // (DecodeResult::step_program says why) keeps its kernels.
  bool megakernel = false;
  // CUDA greedy steps: the lm_head's argmax through the model's int8 screen when it has one
  // (ModelOptions::head_screen; the same tokens); false reads the whole head (the baseline).
  bool head_screen = true;
  int64_t block_size = 0;               // fused / speculative: tokens per verify forward (0: the drafter's block_size)
  bool time_split = true;               // fused: per-part times (CUDA events: no extra sync)
  // Tokens are read one at a time (streaming, or someone may stop the generation early).
  bool reads_each_token() const { return stream || static_cast<bool>(should_stop); }
};

}  // namespace kakeya
