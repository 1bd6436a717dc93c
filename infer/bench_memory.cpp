#include "infer/bench_memory.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>

#include "core/error.h"
#include "infer/long_eval.h"
#include "infer/memory.h"

namespace kakeya {
namespace {

double median(std::vector<double> v) {
  KAKEYA_CHECK(!v.empty(), "bench: no timed runs");
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string mb(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", b / 1e6);
  return buf;
}

}  // namespace

double TimedDecoder::median_decode_tps() const { return median(decode_tps); }
double TimedDecoder::median_e2e_tps() const { return median(e2e_tps); }
double TimedDecoder::median_prefill_tps() const { return median(prefill_tps); }

double copy_bandwidth(at::Device device) {
  const int64_t bytes = device.is_cuda() ? (int64_t{1} << 30) : (int64_t{256} << 20);
  auto src = at::ones({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
  auto dst = at::empty_like(src);
  dst.copy_(src);  // warm-up
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    dst.select(0, 0).item<uint8_t>();  // SYNC: nothing queued before the clock starts
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 4; ++k) dst.copy_(src);
    dst.select(0, 0).item<uint8_t>();  // SYNC: the copies are done
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 4);
  }
  return 2.0 * bytes / best;
}

void time_in_rounds(std::vector<TimedDecoder>& ds, const std::vector<int64_t>& prompt, int64_t repeats,
                    int64_t new_tokens) {
  for (auto& d : ds) d.decoder->run(prompt, d.options);  // warm-up
  for (int64_t r = 0; r < repeats; ++r)
    for (auto& d : ds) {
      d.last = d.decoder->run(prompt, d.options);
      KAKEYA_CHECK((int64_t)d.last.tokens.size() == new_tokens,
                   "bench: generated " << d.last.tokens.size() << " tokens, expected " << new_tokens);
      d.decode_tps.push_back(d.last.decode_tokens_per_second());
      d.e2e_tps.push_back(new_tokens / (d.last.prefill_seconds + d.last.decode_seconds));
      d.prefill_tps.push_back(prompt.size() / d.last.prefill_seconds);
    }
}

nlohmann::json bench_memory(const ModelConfig& cfg, at::ScalarType dtype, const DrafterConfig* drafter,
                            const FThetaConfig* ftheta, const BenchMemoryOptions& o, const BenchMemoryModels& m) {
  const int64_t limit = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : o.context;
  const int64_t max_context = o.max_context > 0 ? o.max_context : limit;
  KAKEYA_CHECK(max_context <= limit, "--max-context " << max_context << " exceeds the model's " << limit << " positions");
  KAKEYA_CHECK(o.context >= 1 && o.context <= max_context,
               "--context " << o.context << ": expected 1 .. " << max_context << " (--max-context / the model's limit)");
  KAKEYA_CHECK(!o.budgets.empty(), "--budget-mb: expected at least one budget");
  const auto configs = parse_long_eval_configs(o.configs, o.restore);

  // Per-session K/V bytes of each config at n positions, from the plans.
  auto bytes_at = [&](const LongEvalConfig& c) {
    return [&, c](int64_t n) -> int64_t {
      if (c.oracle()) return ar_memory_plan(cfg, dtype, n).kv_bytes();
      return restored_memory_plan(cfg, drafter, ftheta, c.restore, dtype, n).kv_bytes();
    };
  };
  const int64_t native = ar_memory_plan(cfg, dtype, o.context).native_kv_bytes;

  // Timing: every config's decoder (AR first: the ratios' reference), in rounds.
  const bool timed = m.verifier != nullptr;
  std::vector<std::unique_ptr<Decoder>> owned;
  std::vector<TimedDecoder> timers;
  std::vector<size_t> timer_of(configs.size(), 0);  // per config its timer (the oracle: AR's, the first)
  if (timed) {
    KAKEYA_CHECK((int64_t)m.prompt.size() + o.new_tokens == o.context,
                 "bench memory: the timed prompt has " << m.prompt.size() << " tokens; expected --context - --new-tokens = "
                                                       << o.context - o.new_tokens);
    auto add = [&](const LongEvalConfig& c) {
      DecodeOptions d;
      d.mode = c.mode;
      d.restore = c.restore;
      d.max_new_tokens = o.new_tokens;
      d.stream = false;  // no stop tokens either: every run generates exactly new_tokens
      owned.push_back(make_decoder(*m.verifier, m.drafter, m.ftheta, d, o.context));
      timers.push_back({owned.back().get(), d});
    };
    add(parse_long_eval_config("oracle", o.restore));
    for (size_t i = 0; i < configs.size(); ++i)
      if (!configs[i].oracle()) {
        timer_of[i] = timers.size();
        add(configs[i]);
      }
    std::fprintf(stderr, "[bench memory] timing %zu decoders at %lld positions, %lld rounds\n", timers.size(),
                 (long long)o.context, (long long)o.repeats);
    time_in_rounds(timers, m.prompt, o.repeats, o.new_tokens);
  }

  // The contexts the curves are drawn at: 256 · 2^k up to the longest considered, and that one.
  std::vector<int64_t> ladder;
  for (int64_t n = 256; n < max_context; n *= 2) ladder.push_back(n);
  ladder.push_back(max_context);
  nlohmann::json native_curve = nlohmann::json::array();
  for (int64_t n : ladder) native_curve.push_back({{"context", n}, {"kv_bytes", ar_memory_plan(cfg, dtype, n).native_kv_bytes}});

  nlohmann::json rows = nlohmann::json::array();
  for (size_t i = 0; i < configs.size(); ++i) {
    const LongEvalConfig& c = configs[i];
    const auto f = bytes_at(c);
    const int64_t at_context = f(o.context);
    nlohmann::json row{{"config", c.name},
                       {"restore", c.oracle() ? nlohmann::json(nullptr) : c.restore.to_json()},
                       {"kv_bytes_at_context", at_context},
                       {"ratio_vs_native_at_context", (double)at_context / native}};
    for (int64_t b : o.budgets) row["budgets"].push_back(fit_budget(f, b, max_context, o.context).to_json());
    for (int64_t n : ladder) row["curve"].push_back({{"context", n}, {"kv_bytes", f(n)}});
    if (timed) {
      const TimedDecoder& t = timers[timer_of[i]];
      row["decode_tps"] = t.median_decode_tps();
      row["e2e_tps"] = t.median_e2e_tps();
      row["decode_runs"] = t.decode_tps;
      row["decode_ratio_vs_ar"] = t.median_decode_tps() / timers.front().median_decode_tps();
      row["prefill_tps"] = t.median_prefill_tps();
      row["prefill_ratio_vs_ar"] = t.median_prefill_tps() / timers.front().median_prefill_tps();
      row["memory_measured"] = t.decoder->memory().to_json();
    }
    rows.push_back(row);
  }
  return {{"bench", "memory"},
          {"context", o.context},
          {"max_context", max_context},
          {"budgets_bytes", o.budgets},
          {"native_kv_bytes_at_context", native},
          {"native_curve", native_curve},
          {"new_tokens", timed ? nlohmann::json(o.new_tokens) : nlohmann::json(nullptr)},
          {"repeats", timed ? nlohmann::json(o.repeats) : nlohmann::json(nullptr)},
          {"ar_decode_tps", timed ? nlohmann::json(timers.front().median_decode_tps()) : nlohmann::json(nullptr)},
          {"configs", rows}};
}

std::string bench_memory_table(const nlohmann::json& r) {
  std::ostringstream os;
  char buf[256];
  const int64_t ctx = r["context"];
  int name_w = 22;  // the config column fits the longest name
  for (const auto& row : r["configs"]) name_w = std::max(name_w, (int)row["config"].get<std::string>().size());
  std::snprintf(buf, sizeof buf, "%-*s %12s %9s", name_w, "config", ("KV @" + std::to_string(ctx)).c_str(), "vs native");
  os << buf;
  for (int64_t b : r["budgets_bytes"]) {
    const std::string name = std::to_string(b >> 20) + " MiB";
    std::snprintf(buf, sizeof buf, " %14s %10s", (name + ": ctx").c_str(), "sessions");
    os << buf;
  }
  os << (r["ar_decode_tps"].is_null() ? "" : "   decode tok/s  vs AR  prefill tok/s  vs AR") << "\n";
  for (const auto& row : r["configs"]) {
    std::snprintf(buf, sizeof buf, "%-*s %12s %8.3fx", name_w, row["config"].get<std::string>().c_str(),
                  mb(row["kv_bytes_at_context"]).c_str(), row["ratio_vs_native_at_context"].get<double>());
    os << buf;
    for (const auto& f : row["budgets"]) {
      const std::string longest = std::to_string(f["longest_context"].get<int64_t>()) + (f["limited_by_model"] ? "+" : "");
      std::snprintf(buf, sizeof buf, " %14s %10lld", longest.c_str(), (long long)f["sessions"].get<int64_t>());
      os << buf;
    }
    if (row.contains("decode_tps")) {
      std::snprintf(buf, sizeof buf, "   %12.1f %6.3fx %14.0f %6.3fx", row["decode_tps"].get<double>(),
                    row["decode_ratio_vs_ar"].get<double>(), row["prefill_tps"].get<double>(),
                    row["prefill_ratio_vs_ar"].get<double>());
      os << buf;
    }
    os << "\n";
  }
  os << "ctx: the longest context one session fits in the budget ('+': the model's limit, " << r["max_context"].get<int64_t>()
     << ", came first); sessions: how many sessions of " << ctx << " positions fit side by side\n";
  return os.str();
}

}  // namespace kakeya
