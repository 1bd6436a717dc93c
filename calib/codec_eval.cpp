#include "calib/codec_eval.h"

#include <chrono>
#include <cmath>
#include <memory>
#include <sstream>

#include "calib/calibrate.h"
#include "core/error.h"

namespace kakeya::calib {

using json = nlohmann::json;

PassageScore CodecEvalRow::pooled() const {
  PassageScore p;
  for (const auto& s : passages) {
    p.tokens += s.tokens;
    p.nll_ref += s.nll_ref * s.tokens;
    p.nll += s.nll * s.tokens;
    p.top1 += s.top1 * s.tokens;
    p.kl += s.kl * s.tokens;
  }
  if (p.tokens) {
    p.nll_ref /= p.tokens;
    p.nll /= p.tokens;
    p.top1 /= p.tokens;
    p.kl /= p.tokens;
  }
  return p;
}

json CodecEvalRow::to_json() const {
  auto p = pooled();
  json ps = json::array();
  for (const auto& s : passages)
    ps.push_back({{"tokens", s.tokens}, {"ppl_ref", std::exp(s.nll_ref)}, {"ppl", std::exp(s.nll)},
                  {"dppl", s.dppl()}, {"top1", s.top1}, {"kl", s.kl}});
  const int64_t np = std::max<size_t>(passages.size(), 1);
  return {{"label", label},
          {"spec", spec},
          {"bits_per_value", bits_per_value()},
          {"ratio", ratio()},
          {"bytes_per_cache", bytes / np},
          {"values_per_cache", values / np},
          {"bytes_by_field_per_cache", [&] {
             json j;
             for (const auto& kv : bytes_by_field) j[kv.first] = kv.second / np;
             return j;
           }()},
          {"shared_bytes", shared_bytes},
          {"ratio_incl_shared", bytes + shared_bytes * np ? 2.0 * values / (bytes + shared_bytes * np) : 0.0},
          {"dppl", p.dppl()},
          {"ppl_ref", std::exp(p.nll_ref)},
          {"ppl", std::exp(p.nll)},
          {"top1", p.top1},
          {"kl", p.kl},
          {"rel_mse_k", sq_ref_k > 0 ? sq_err_k / sq_ref_k : 0.0},
          {"rel_mse_v", sq_ref_v > 0 ? sq_err_v / sq_ref_v : 0.0},
          {"codec_seconds", codec_seconds},
          {"passages", ps}};
}

json CodecEvalResult::to_json() const {
  json r = json::array();
  for (const auto& row : rows) r.push_back(row.to_json());
  return {{"ppl_ref", ppl_ref}, {"rebuild_max_abs_logprob_diff", rebuild_max_abs_logit_diff}, {"rows", r}};
}

CodecEvalResult codec_eval(const Model& model, const std::vector<std::vector<int64_t>>& passages,
                           const std::vector<CodecOptions>& codecs, const CalibBundle* bundle,
                           const CodecEvalOptions& opt) {
  const auto& cfg = model.config();
  const int64_t C = opt.context, E = opt.n_eval, L = cfg.num_layers;
  KAKEYA_CHECK(C >= 2, "codec-eval: --context must be >= 2, got " << C);
  KAKEYA_CHECK(E >= 1, "codec-eval: --n-eval must be >= 1, got " << E);
  KAKEYA_CHECK(opt.chunk >= 1, "codec-eval: --chunk must be >= 1");
  KAKEYA_CHECK(opt.streams == "k" || opt.streams == "v" || opt.streams == "kv",
               "codec-eval: --streams expects k, v or kv, got '" << opt.streams << "'");
  KAKEYA_CHECK(!passages.empty(), "codec-eval: no passages");
  KAKEYA_CHECK(C + E + 1 <= model.options().max_positions,
               "codec-eval: context + n-eval exceeds the model's position table (" << model.options().max_positions << ")");
  for (size_t i = 0; i < passages.size(); ++i)
    KAKEYA_CHECK((int64_t)passages[i].size() >= C + E + 1, "codec-eval: passage " << i << " has " << passages[i].size()
                                                                                 << " tokens, needs context + n-eval + 1 = "
                                                                                 << C + E + 1);
  const auto dev = model.device();
  const auto dt = model.dtype();
  auto log = [&](const std::string& s) {
    if (opt.log) opt.log(s);
  };

  CodecEvalResult res;
  std::vector<std::unique_ptr<KVCodec>> kc;
  for (auto o : codecs) {
    if (opt.streams == "k") o.v.coded = false;
    if (opt.streams == "v") o.k.coded = false;
    kc.push_back(std::make_unique<KVCodec>(o, cfg, bundle, dev));
    CodecEvalRow row;
    row.label = o.label;
    row.spec = o.describe();
    row.shared_bytes = kc.back()->shared_bytes();
    res.rows.push_back(row);
  }

  const KVCacheOptions co = model.cache_options(C + E);
  auto iopt = at::TensorOptions().dtype(at::kLong).device(dev);
  // Tokens each layer's cache holds after the prefill: sliding rings only their last slots.
  std::vector<int64_t> held(L);
  {
    KVCache probe(cfg, co);
    for (int64_t l = 0; l < L; ++l) held[l] = cfg.is_sliding(l) ? std::min(C, probe.slots(l)) : C;
  }

  for (size_t pi = 0; pi < passages.size(); ++pi) {
    const auto& p = passages[pi];
    auto ids = at::tensor(std::vector<int64_t>(p.begin(), p.begin() + C + E + 1), at::kLong).to(dev).view({1, C + E + 1});
    auto targets = ids[0].slice(0, C + 1, C + E + 1);  // [E]

    // Clean prefill, K/V captured pre-RoPE through the taps.
    KVCapture cap(cfg);
    Taps taps;
    taps.subscribe(&cap);
    KVCache pre(cfg, co);
    ForwardOptions fo;
    fo.taps = &taps;
    fo.skip_logits = true;
    model.forward(ids.slice(1, 0, C), pre, fo);
    std::vector<at::Tensor> k_pre(L), v_pre(L);  // [H, held_l, D] model dtype
    for (int64_t l = 0; l < L; ++l) {
      k_pre[l] = cap.k(l).at(0).slice(1, C - held[l]);
      v_pre[l] = cap.v(l).at(0).slice(1, C - held[l]);
    }

    // Teacher-forced continuation: log-probs [E, V] f32 of the next tokens.
    auto continue_from = [&](KVCache& cache) {
      std::vector<at::Tensor> out;
      for (int64_t c = 0; c < E; c += opt.chunk) {
        const int64_t len = std::min(opt.chunk, E - c);
        auto lg = model.forward(ids.slice(1, C + c, C + c + len), cache).squeeze(0);  // [len, V] f32
        out.push_back(at::log_softmax(lg, -1));
      }
      return at::cat(out);
    };
    // A fresh cache holding the given (decoded) pre-RoPE K and V at their positions.
    auto rebuild = [&](const std::vector<at::Tensor>& kh, const std::vector<at::Tensor>& vh) {
      KVCache cache(cfg, co);
      cache.mark(at::arange(0, C, iopt));
      for (int64_t l = 0; l < L; ++l) {
        auto pos = at::arange(C - held[l], C, iopt);
        auto k = model.rope(l).apply(kh[l].to(dt).permute({1, 0, 2}).unsqueeze(0), pos).transpose(1, 2);  // [1, H, n, D]
        cache.write(l, k, vh[l].to(dt).unsqueeze(0), pos);
      }
      cache.advance(C);
      return cache;
    };

    KVCache ref_cache = rebuild(k_pre, v_pre);
    auto lp_ref = continue_from(ref_cache);  // [E, V]
    if (pi == 0) {
      auto lp_direct = continue_from(pre);
      res.rebuild_max_abs_logit_diff = (lp_direct - lp_ref).abs().max().item<double>();
    }
    auto am_ref = lp_ref.argmax(-1);                                                   // [E]
    const double nll_ref = -lp_ref.gather(1, targets.unsqueeze(1)).mean().item<double>();
    res.ppl_ref.push_back(std::exp(nll_ref));
    auto p_ref = lp_ref.exp();
    {
      std::ostringstream os;
      os << "[codec-eval] passage " << pi + 1 << "/" << passages.size() << ": ppl " << std::exp(nll_ref);
      log(os.str());
    }

    for (size_t ci = 0; ci < kc.size(); ++ci) {
      auto& row = res.rows[ci];
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<at::Tensor> kh(L), vh(L);
      for (int64_t l = 0; l < L; ++l) {
        for (Stream s : {Stream::K, Stream::V}) {
          const auto& x = s == Stream::K ? k_pre[l] : v_pre[l];
          auto e = kc[ci]->encode(l, s, x, nullptr, C - held[l]);
          auto xh = kc[ci]->decode(e);  // [H, n, D] f32
          row.bytes += e.bytes();
          row.values += e.values();
          for (const auto& kv : e.bytes_by_field()) row.bytes_by_field[std::string(stream_name(s)) + "." + kv.first] += kv.second;
          auto xf = x.to(at::kFloat);
          const double err = (xf - xh).pow(2).sum().item<double>();
          const double ref = (xf - xf.mean(1, true)).pow(2).sum().item<double>();
          (s == Stream::K ? row.sq_err_k : row.sq_err_v) += err;
          (s == Stream::K ? row.sq_ref_k : row.sq_ref_v) += ref;
          (s == Stream::K ? kh : vh)[l] = xh;
        }
      }
      row.codec_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      KVCache cache = rebuild(kh, vh);
      auto lp = continue_from(cache);
      PassageScore ps;
      ps.tokens = E;
      ps.nll_ref = nll_ref;
      ps.nll = -lp.gather(1, targets.unsqueeze(1)).mean().item<double>();
      ps.top1 = lp.argmax(-1).eq(am_ref).to(at::kDouble).mean().item<double>();
      ps.kl = (p_ref * (lp_ref - lp)).sum(-1).mean().item<double>();
      row.passages.push_back(ps);
      std::ostringstream os;
      os << "[codec-eval]   " << row.label << ": " << 8.0 * row.bytes / row.values << " bits/value, dppl "
         << 100 * ps.dppl() << "%, top-1 " << 100 * ps.top1 << "%, KL " << ps.kl;
      log(os.str());
    }
  }
  return res;
}

}  // namespace kakeya::calib
