#include "infer/memory.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "core/error.h"
#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/kv_cache.h"
#include "core/model/model.h"
#include "infer/restorer.h"

namespace kakeya {
namespace {

std::string mib(int64_t b) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f MiB", b / 1048576.0);
  return buf;
}

// Bytes of `slots` positions per layer of one type (-1 all, 0 sliding, 1 full): dense K/V in
// `elem`-byte values, or (code defined) coded rows (ops::quantize_rows).
int64_t region_bytes_for(const ModelConfig& cfg, int64_t elem, int64_t slots, int type, const ops::RowCode& base,
                         const std::vector<ops::RowCode>& layers = {}) {
  int64_t b = 0;
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    if (type >= 0 && cfg.is_sliding(l) != (type == 0)) continue;
    if (cfg.kv_shared(l)) continue;  // reads another layer's K/V
    const int64_t D = cfg.layer_head_dim[l];
    const ops::RowCode& code = ops::layer_code(base, layers, l);
    const int64_t rows = code.defined() ? ops::row_pair_bytes(D, code) : 2 * D * elem;  // a K row and a V row
    b += cfg.kv_heads(l) * slots * rows;
  }
  return b;
}

// Dense K/V bytes of `slots` positions on every layer of one type (or all layers).
int64_t kv_bytes_for(const ModelConfig& cfg, int64_t elem, int64_t slots, int type) {
  return region_bytes_for(cfg, elem, slots, type, {});
}

// The note of a restored region's line: how it is stored.
std::string region_note(const ops::RowCode& code) {
  return code.defined() ? ", stored as " + ops::row_code_name(code) + " coded rows" : "";
}

}  // namespace

const char* memory_part_key(MemoryPart p) {
  switch (p) {
    case MemoryPart::SlidingExact: return "sliding_exact";
    case MemoryPart::SlidingRestored: return "sliding_restored";
    case MemoryPart::FullExact: return "full_exact";
    case MemoryPart::FullRestored: return "full_restored";
    case MemoryPart::FullCoded: return "full_coded";
    case MemoryPart::RestorePending: return "restore_pending";
    case MemoryPart::TrueRaw: return "true_raw";
    case MemoryPart::DrafterContext: return "drafter_context";
    case MemoryPart::VerifierWeights: return "verifier_weights";
    case MemoryPart::DrafterWeights: return "drafter_weights";
    case MemoryPart::FThetaWeights: return "ftheta_weights";
  }
  return "?";
}

bool is_weights(MemoryPart p) {
  return p == MemoryPart::VerifierWeights || p == MemoryPart::DrafterWeights || p == MemoryPart::FThetaWeights;
}

void MemoryReport::add(MemoryLine line) { (is_weights(line.part) ? weights : kv).push_back(std::move(line)); }

void MemoryReport::set(MemoryLine line) {
  auto& lines = is_weights(line.part) ? weights : kv;
  for (auto& l : lines)
    if (l.part == line.part) {
      l = std::move(line);
      return;
    }
  lines.push_back(std::move(line));
}

const MemoryLine* MemoryReport::find(MemoryPart p) const {
  for (const auto* lines : {&kv, &weights})
    for (const auto& l : *lines)
      if (l.part == p) return &l;
  return nullptr;
}

// ---------------------------------------------------------------- memory

int64_t MemoryReport::kv_bytes() const {
  int64_t b = 0;
  for (const auto& l : kv) b += l.bytes;
  return b;
}

int64_t MemoryReport::bounded_bytes() const {
  int64_t b = 0;
  for (const auto& l : kv)
    if (!l.grows) b += l.bytes;
  return b;
}

nlohmann::json MemoryReport::to_json() const {
  nlohmann::json j{{"positions", positions},
                   {"kv_bytes", kv_bytes()},
                   {"full_kv_bytes", full_kv_bytes},
                   {"native_kv_bytes", native_kv_bytes},
                   {"bounded_kv_bytes", bounded_bytes()},
                   {"ratio_vs_full_kv", full_kv_bytes ? (double)kv_bytes() / full_kv_bytes : 0.0},
                   {"ratio_vs_native", native_kv_bytes ? (double)kv_bytes() / native_kv_bytes : 0.0}};
  for (const auto* part : {&kv, &weights}) {
    auto& arr = j[part == &kv ? "kv" : "weights"] = nlohmann::json::array();
    for (const auto& l : *part) arr.push_back({{"part", memory_part_key(l.part)}, {"name", l.name}, {"bytes", l.bytes}, {"note", l.note}, {"grows_with_context", l.grows}});
  }
  return j;
}

std::string MemoryReport::table() const {
  std::ostringstream os;
  char buf[512];
  auto row = [&](const std::string& name, int64_t b, const std::string& note) {
    std::snprintf(buf, sizeof buf, "  %-50s %12s  %s\n", name.c_str(), mib(b).c_str(), note.c_str());
    os << buf;
  };
  os << "memory at " << positions << " positions (K/V-like state):\n";
  for (const auto& l : kv) row(l.name, l.bytes, l.note);
  const int64_t total = kv_bytes();
  row("total", total, "");
  auto ratio = [&](int64_t base) {
    const double r = base ? (double)total / base : 0.0;
    if (r <= 1.0) std::snprintf(buf, sizeof buf, "ours = %.3fx of it (%.2fx smaller)", r, r > 0 ? 1.0 / r : 0.0);
    else std::snprintf(buf, sizeof buf, "ours = %.3fx of it (LARGER)", r);
    return std::string(buf);
  };
  row("baseline: full KV (every layer, every position)", full_kv_bytes, ratio(full_kv_bytes));
  row("baseline: native cache (sliding layers: window)", native_kv_bytes, ratio(native_kv_bytes));
  os << "weights:\n";
  for (const auto& l : weights) row(l.name, l.bytes, l.note);
  return os.str();
}

int64_t tensor_bytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

int64_t ftheta_weight_bytes(const FTheta& f) {
  int64_t b = 0;
  for (const auto& [name, t] : f.named_parameters()) b += tensor_bytes(t);
  return b;
}

namespace {

void add_weights(MemoryReport& m, const Model& v, const Drafter* d, const FTheta* f, const RestoreOptions* o) {
  m.add({MemoryPart::VerifierWeights, "verifier weights", v.weight_bytes(), ""});
  const bool uses_drafter = o && o->needs_ftheta();
  if (d && uses_drafter)
    m.add({MemoryPart::DrafterWeights, "drafter weights", d->weight_bytes(), "embedding and lm_head shared with the verifier"});
  if (f && uses_drafter) m.add({MemoryPart::FThetaWeights, "f_θ weights", ftheta_weight_bytes(*f), ""});
}

void add_baselines(MemoryReport& m, const ModelConfig& cfg, int64_t elem, int64_t positions) {
  m.positions = positions;
  m.full_kv_bytes = kv_bytes_for(cfg, elem, positions, -1);
  m.native_kv_bytes = kv_bytes_for(cfg, elem, positions, 1) +
                      kv_bytes_for(cfg, elem, cfg.sliding_window > 0 ? std::min(positions, cfg.sliding_window) : positions, 0);
}

}  // namespace

MemoryReport ar_memory_report(const Model& v, int64_t capacity) {
  MemoryReport m = ar_memory_plan(v.config(), v.dtype(), capacity);
  add_weights(m, v, nullptr, nullptr, nullptr);
  return m;
}

MemoryReport ar_memory_plan(const ModelConfig& cfg, at::ScalarType dtype, int64_t capacity) {
  MemoryReport m;
  const int64_t elem = c10::elementSize(dtype);
  bool has_sliding = false;
  for (int64_t l = 0; l < cfg.num_layers; ++l) has_sliding |= cfg.is_sliding(l);
  // generate()'s cache: sliding rings of min(capacity, window) slots (rollback 0), full layers capacity.
  if (has_sliding)
    m.add({MemoryPart::SlidingExact, "verifier sliding layers: native ring",
                    kv_bytes_for(cfg, elem, std::min(capacity, cfg.sliding_window), 0), "exact, sliding window slots"});
  m.add({MemoryPart::FullExact, "verifier full-attention layers: exact", kv_bytes_for(cfg, elem, capacity, 1), "every position", true});
  add_baselines(m, cfg, elem, capacity);
  return m;
}

namespace {

// Every K/V-like part of a restored decode, measured (restored_memory_report) or planned
// (restored_memory_plan); memory_lines names them once for both.
struct KvParts {
  bool has_sliding = false, has_full = false;
  int64_t sliding_ring = 0, sliding_ring_slots = 0, sliding_rest = 0, sliding_rest_slots = 0;
  int64_t full_exact = 0, full_exact_slots = 0;  // every position (exact), or the exact ring (restored, codec)
  int64_t full_rest = 0, full_rest_slots = 0;    // restored region (restored), coded rows (codec)
  int64_t pending = 0, true_raw = 0;
};

MemoryReport memory_lines(const KvParts& p, const ModelConfig& cfg, int64_t elem, const RestoreOptions& o,
                          int64_t positions) {
  MemoryReport m;
  auto slots = [](int64_t n) { return std::to_string(n) + " slots"; };
  if (p.has_sliding) {
    m.add({MemoryPart::SlidingExact, "verifier sliding: exact window ring", p.sliding_ring,
                    slots(p.sliding_ring_slots) + " (window; prefill chunks attend over [ring ++ chunk]); sinks sit in the restored region"});
    m.add({MemoryPart::SlidingRestored, "verifier sliding: restored K/V", p.sliding_rest,
                    slots(p.sliding_rest_slots) +
                        (o.evict_only() ? " (the sinks, and one for the dropped positions: evict-only)"
                                        : o.resolved_chunk() > o.window ? " (sliding window - 1: chunks past the window read their own positions exactly)"
                                                                          : " (sliding window - window + chunk - 1)") +
                        region_note(o.region_code)});
  }
  if (p.has_full) {
    switch (o.full_attn) {
      case FullAttn::Exact:
        m.add({MemoryPart::FullExact, "verifier full-attention: exact (S5)", p.full_exact, slots(p.full_exact_slots) + " (every position)",
                        true});
        break;
      case FullAttn::Restored:
        m.add({MemoryPart::FullExact, "verifier full-attention: exact window ring", p.full_exact, slots(p.full_exact_slots)});
        m.add({MemoryPart::FullRestored, "verifier full-attention: restored K/V", p.full_rest,
                        slots(p.full_rest_slots) +
                            (o.evict_only() ? " (the sinks, and one for the dropped positions: evict-only)"
                                            : " (every position: not bounded)") +
                            region_note(o.region_code),
                        !o.evict_only()});
        break;
      case FullAttn::Codec:
        m.add({MemoryPart::FullExact, "verifier full-attention: exact window ring + sinks", p.full_exact,
                        slots(p.full_exact_slots) + (o.long_chunks() ? " (window + sink)" : " (window + chunk - 1 + sink)")});
        m.add({MemoryPart::FullCoded, "verifier full-attention: coded K/V", p.full_rest,
                        std::to_string(p.full_rest_slots) + " positions (every one) as " + ops::layer_codes_name(o.full_code, o.full_code_layers) +
                            " coded rows", true});
        break;
    }
  }
  if (p.pending > 0)
    m.add({MemoryPart::RestorePending, "f_θ inputs: drafter raw K/V + target features not yet restored", p.pending,
                    "rings of window positions"});
  if (p.true_raw > 0)
    m.add({MemoryPart::TrueRaw, "true raw K/V kept (research mode)", p.true_raw,
                    o.mix_alpha > 0 && o.mix_alpha < 1 ? "--mix-alpha in (0, 1) blends the verifier's own K/V: not a bounded-memory result"
                                    : "relative-error statistics"});
  m.add({MemoryPart::DrafterContext, "drafter context cache", 0, "not kept: this mode does not draft"});
  add_baselines(m, cfg, elem, positions);
  return m;
}

}  // namespace

MemoryReport restored_memory_report(const Model& v, const Drafter* d, const FTheta* f, const KVCache& cache,
                                    const Restorer& r, const RestoreOptions& o, int64_t positions) {
  const auto& cfg = v.config();
  int64_t first_sliding = -1, first_full = -1;
  for (int64_t l = cfg.num_layers - 1; l >= 0; --l) (cfg.is_sliding(l) ? first_sliding : first_full) = l;
  KvParts p;
  p.has_sliding = first_sliding >= 0;
  p.has_full = first_full >= 0;
  if (p.has_sliding) {
    p.sliding_ring = cache.exact_bytes(LayerType::Sliding);
    p.sliding_ring_slots = cache.exact_slots(first_sliding);
    p.sliding_rest = cache.restored_bytes(LayerType::Sliding);
    p.sliding_rest_slots = cache.restored_slots(first_sliding);
  }
  if (p.has_full && cache.plain(first_full)) {
    p.full_exact = cache.bytes_per_layer_type(LayerType::Full);
    p.full_exact_slots = cache.slots(first_full);
  } else if (p.has_full) {
    p.full_exact = cache.exact_bytes(LayerType::Full);
    p.full_exact_slots = cache.dense_slots(first_full);
    p.full_rest = cache.restored_bytes(LayerType::Full);
    p.full_rest_slots = cache.restored_slots(first_full);
    if (cache.coded(first_full)) p.full_rest = cache.coded_bytes();
  }
  p.pending = r.pending_bytes();
  p.true_raw = r.true_raw_bytes();
  MemoryReport m = memory_lines(p, cfg, c10::elementSize(v.dtype()), o, positions);
  add_weights(m, v, d, f, &o);
  return m;
}


MemoryReport restored_memory_plan(const ModelConfig& cfg, const DrafterConfig* dc, const FThetaConfig* fc,
                                  const RestoreOptions& o, at::ScalarType dtype, int64_t n) {
  check_window_chunk(o, "memory plan");
  // A chunk longer than the window (exact copies) reads the region, and a coded layer's ring, as a
  // chunk of `window` does.
  const int64_t elem = c10::elementSize(dtype), w = o.window, c = o.window_chunk();
  KvParts p;
  int64_t first_full = -1;
  for (int64_t l = cfg.num_layers - 1; l >= 0; --l) {
    if (cfg.is_sliding(l)) p.has_sliding = true;
    else first_full = l;
  }
  p.has_full = first_full >= 0;
  // The KVCache layout (core/model/kv_cache.cpp), rollback 0, written out again on purpose: tests compare the two.
  if (p.has_sliding) {
    p.sliding_ring_slots = std::min(n, w);  // decode steps write first (max_step 1)
    // Evict-only: every sliding layer drops its restored positions, so the region holds the sinks
    // and one slot for the rest (KVCache sinks_only).
    p.sliding_rest_slots =
        o.evict_only() ? o.sink + 1 : std::min(n, std::max<int64_t>(1, cfg.sliding_window - w + c - 1));
    p.sliding_ring = kv_bytes_for(cfg, elem, p.sliding_ring_slots, 0);
    p.sliding_rest = region_bytes_for(cfg, elem, p.sliding_rest_slots, 0, o.region_code);
  }
  if (p.has_full) {
    if (o.full_attn == FullAttn::Exact) {
      p.full_exact_slots = n;
    } else {
      // Restored: a restored region of every position; codec: every position as coded rows.
      // Codec: the exact sinks beside the ring, which holds the window only where prefill chunks
      // attend over [slots ++ chunk] (exact copies; decode steps write first).
      const bool step_ring = o.full_attn == FullAttn::Codec && o.long_chunks();
      p.full_exact_slots = std::min(n, w + (step_ring ? 0 : c - 1)) + (o.full_attn == FullAttn::Codec ? o.sink : 0);
      p.full_rest_slots = o.evict_only() && o.full_attn == FullAttn::Restored ? o.sink + 1 : n;
      const bool codec = o.full_attn == FullAttn::Codec;
      p.full_rest = codec ? region_bytes_for(cfg, elem, p.full_rest_slots, 1, o.full_code, o.full_code_layers)
                          : region_bytes_for(cfg, elem, p.full_rest_slots, 1, o.region_code);
      // Rotated codes on coded layers: the session's K and V means (and K weights, weighted codes), f32.
      if (codec)
        for (int64_t l = 0; l < cfg.num_layers; ++l) {
          const ops::RowCode& code = ops::layer_code(o.full_code, o.full_code_layers, l);
          if (cfg.stores_full_kv(l) && code.rotated())
            p.full_rest += (code.weighted ? 3 : 2) * cfg.kv_heads(l) * cfg.layer_head_dim[l] * 4;
        }
    }
    p.full_exact = kv_bytes_for(cfg, elem, p.full_exact_slots, 1);
  }
  // The Restorer's rings: window positions (drafter raw K/V in the verifier dtype; true raw K/V).
  const int64_t ring = w;
  if (o.needs_ftheta()) {
    KAKEYA_CHECK(dc && fc, "memory plan: --mix-alpha < 1 needs the drafter and f_θ configs");
    // Target features (Restorer::start_upkeep); an f_θ that reads the drafter's raw K/V keeps those too.
    p.pending = ring * dc->num_features() * cfg.hidden_size * elem;
    if (!fc->reads_features()) p.pending += 2 * ring * dc->num_layers * dc->num_kv_heads * dc->head_dim * elem;
  }
  if (o.needs_true_raw())
    p.true_raw = kv_bytes_for(cfg, elem, ring, o.full_attn == FullAttn::Restored ? -1 : 0);
  return memory_lines(p, cfg, elem, o, n);
}


nlohmann::json BudgetFit::to_json() const {
  return {{"budget_bytes", budget},          {"longest_context", longest},
          {"limited_by_model", limited_by_model}, {"context", context},
          {"session_kv_bytes", session_bytes}, {"sessions", sessions}};
}

BudgetFit fit_budget(const std::function<int64_t(int64_t)>& kv_bytes_at, int64_t budget, int64_t max_context,
                     int64_t context) {
  KAKEYA_CHECK(budget > 0, "memory budget expected > 0 bytes, got " << budget);
  KAKEYA_CHECK(context >= 1 && context <= max_context,
               "memory fit: context " << context << " outside [1, the model's " << max_context << "]");
  BudgetFit f;
  f.budget = budget;
  f.context = context;
  f.session_bytes = kv_bytes_at(context);
  f.sessions = f.session_bytes > 0 ? budget / f.session_bytes : 0;
  if (kv_bytes_at(max_context) <= budget) {
    f.longest = max_context;
    f.limited_by_model = true;
    return f;
  }
  int64_t lo = 0, hi = max_context;  // bytes(lo) <= budget (lo = 0: nothing), bytes(hi) > budget
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (kv_bytes_at(mid) <= budget ? lo : hi) = mid;
  }
  f.longest = lo;
  return f;
}

}  // namespace kakeya
