#include "infer/server.h"

// Connections that arrive together (a burst of clients) wait in the kernel's queue, not reset:
// the library's default backlog is 5 (effective where the library is header-only).
#ifndef CPPHTTPLIB_LISTEN_BACKLOG
#define CPPHTTPLIB_LISTEN_BACKLOG 1024
#endif
#include <httplib.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/io/chat_template.h"
#include "core/io/text_stream.h"
#include "core/io/tokenizer.h"
#include "core/model/model.h"
#include "infer/batch.h"
#include "infer/session.h"

namespace kakeya {

int64_t serve_capacity(const ServeOptions& opt) {
  return opt.max_context + (opt.decode.mode == DecodeMode::Fused ? opt.decode.restore.window : 0);
}

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

int64_t micros_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
}

// Text we did not write (prompts, generated pieces) may hold invalid UTF-8: never throw on it.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// An answer other than 200, with OpenAI's error body.
struct ApiError : std::exception {
  int status;
  std::string message, param, code, type;
  ApiError(int status, std::string message, std::string param = "", std::string code = "",
           std::string type = "invalid_request_error")
      : status(status), message(std::move(message)), param(std::move(param)), code(std::move(code)),
        type(std::move(type)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

json error_json(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  if (e.status == 429) res.set_header("Retry-After", "1");
  res.set_content(dump(error_json(e)), "application/json");
}

const char* json_type(const json& v) { return v.type_name(); }

// ---- request fields ------------------------------------------------------------------------

bool present(const json& j, const char* key) { return j.contains(key) && !j[key].is_null(); }

std::optional<double> get_number(const json& j, const char* key) {
  if (!present(j, key)) return std::nullopt;
  const json& v = j[key];
  if (!v.is_number())
    throw ApiError(400, std::string("'") + key + "' must be a number, got " + json_type(v), key);
  return v.get<double>();
}

std::optional<int64_t> get_int(const json& j, const char* key) {
  if (!present(j, key)) return std::nullopt;
  const json& v = j[key];
  if (!v.is_number_integer())
    throw ApiError(400, std::string("'") + key + "' must be an integer, got " + (v.is_number() ? v.dump() : json_type(v)),
                   key);
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    throw ApiError(400, std::string("'") + key + "' is too large: " + v.dump(), key);
  return v.get<int64_t>();
}

std::optional<bool> get_bool(const json& j, const char* key) {
  if (!present(j, key)) return std::nullopt;
  const json& v = j[key];
  if (!v.is_boolean()) throw ApiError(400, std::string("'") + key + "' must be a boolean, got " + json_type(v), key);
  return v.get<bool>();
}

// Request ids and the seeds of requests that give none (HTTP threads draw concurrently).
uint64_t random_u64() {
  static std::mutex m;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lk(m);
  return rng();
}

std::string random_hex(size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s(n, '0');
  for (auto& c : s) c = digits[random_u64() & 15];
  return s;
}

std::string format_double(double v) {
  std::ostringstream os;
  os.precision(6);
  os << v;
  return os.str();
}

// ---- HTTP thread pool ----------------------------------------------------------------------

// httplib's ThreadPool has a fixed size and queues connections behind busy threads, so a few
// dozen half-open connections (each holding a thread for the read timeout) would delay every
// other client. This pool starts a thread per connection up to `max` threads (the bound on
// memory); threads beyond `core` exit after `idle` without work. At most `max` more accepted
// connections wait for a thread; beyond that enqueue() blocks httplib's accept loop, so further
// connections wait in the kernel's listen backlog and cost this process nothing.
class ElasticPool final : public httplib::TaskQueue {
 public:
  ElasticPool(size_t core, size_t max, std::chrono::milliseconds idle, const std::atomic<bool>* stopping)
      : core_(std::min(core, max)), max_(std::max<size_t>(max, 1)), idle_timeout_(idle), stopping_(stopping) {
    std::lock_guard<std::mutex> lk(m_);
    for (size_t i = 0; i < core_; ++i) spawn_locked(true);
  }
  ~ElasticPool() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    std::unique_lock<std::mutex> lk(m_);
    // Backpressure on the accept loop (the server's stop flag is set without this lock: poll it).
    while (!shutdown_ && jobs_.size() >= max_ && !(stopping_ && stopping_->load()))
      space_cv_.wait_for(lk, std::chrono::milliseconds(100));
    jobs_.push_back(std::move(fn));
    reap_locked();
    if (jobs_.size() > idle_ && threads_.size() < max_) spawn_locked(false);
    cv_.notify_one();
  }

  void shutdown() override {
    std::list<Worker> threads;
    {
      std::lock_guard<std::mutex> lk(m_);
      shutdown_ = true;
      threads.swap(threads_);
    }
    cv_.notify_all();
    space_cv_.notify_all();
    for (auto& w : threads)
      if (w.thread.joinable()) w.thread.join();
  }

 private:
  struct Worker {
    std::thread thread;
    bool done = false;
  };

  void spawn_locked(bool core) {
    threads_.emplace_back();
    Worker* w = &threads_.back();  // std::list: stable while the thread runs
    w->thread = std::thread([this, w, core] { loop(w, core); });
  }

  void reap_locked() {
    for (auto it = threads_.begin(); it != threads_.end();) {
      if (it->done) {
        it->thread.join();  // it released the lock for good: the join is immediate
        it = threads_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void loop(Worker* w, bool core) {
    std::unique_lock<std::mutex> lk(m_);
    for (;;) {
      ++idle_;
      const auto ready = [&] { return shutdown_ || !jobs_.empty(); };
      bool woke = true;
      if (core) cv_.wait(lk, ready);
      else woke = cv_.wait_for(lk, idle_timeout_, ready);
      --idle_;
      if (jobs_.empty()) {
        if (shutdown_ || !woke) break;  // every accepted connection is served before shutdown ends
        continue;
      }
      auto fn = std::move(jobs_.front());
      jobs_.pop_front();
      space_cv_.notify_one();
      lk.unlock();
      try {
        fn();
      } catch (...) {
      }
      lk.lock();
    }
    if (!shutdown_) w->done = true;  // after shutdown the list belongs to shutdown()
  }

  const size_t core_, max_;
  const std::chrono::milliseconds idle_timeout_;
  const std::atomic<bool>* stopping_;
  std::mutex m_;
  std::condition_variable cv_, space_cv_;
  std::deque<std::function<void()>> jobs_;
  std::list<Worker> threads_;
  size_t idle_ = 0;
  bool shutdown_ = false;
};

// ---- requests ------------------------------------------------------------------------------

// One request for the decode worker, and what it sends back.
struct Job {
  std::vector<int64_t> prompt;
  int64_t max_tokens = 0;
  SamplingOptions sampling;
  std::vector<std::string> stop;
  std::vector<int64_t> stop_ids;
  std::atomic<bool> cancelled{false};  // the client went away

  std::mutex m;
  std::condition_variable cv;
  std::string out;  // text not yet taken by the HTTP thread
  bool done = false;
  std::string finish_reason;
  int error_status = 0;
  std::string error_message, error_type;
  int64_t completion_tokens = 0;

  void fail(int status, const std::string& message, const std::string& type = "server_error") {
    std::lock_guard<std::mutex> lk(m);
    error_status = status;
    error_message = message;
    error_type = type;
    done = true;
    cv.notify_all();
  }
};

struct Params {
  SamplingOptions sampling;
  std::optional<int64_t> max_tokens;
  std::vector<std::string> stop;
  bool stream = false, include_usage = false;
};

const char* const kEndpoints[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"};

std::string endpoint_label(const std::string& path) {
  for (const char* e : kEndpoints)
    if (path == e) return e;
  if (path == "/completions") return "/v1/completions";
  if (path == "/chat/completions") return "/v1/chat/completions";
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{model}";
  return "other";
}

}  // namespace

struct Server::Impl {
  const Model& model;
  const Tokenizer& tok;
  const Drafter* drafter;
  const FTheta* ftheta;
  const ChatTemplate* chat;
  ServeOptions opt;
  std::vector<int64_t> eos_ids, chat_stop_ids;
  std::string bos_text;
  int64_t created = static_cast<int64_t>(std::time(nullptr));

  httplib::Server http;
  std::thread listen_thread, worker_thread;
  int bound_port = -1;
  std::atomic<bool> stopping{false};
  std::mutex life_m;
  std::condition_variable life_cv;
  bool started = false, stop_requested = false, stopped = false;

  // The queue to the decode worker.
  std::mutex qm;
  std::condition_variable qcv;
  std::deque<std::shared_ptr<Job>> queue;
  bool busy = false;

  // Sessions: the worker's alone (start() builds the first before the worker runs).
  struct Slot {
    double temperature = 0, top_p = 1;
    std::unique_ptr<Session> session;
    uint64_t last_used = 0;
    std::string label;
  };
  std::vector<Slot> sessions;
  uint64_t tick = 0;
  std::unique_ptr<BatchDecoder> batcher;  // ServeOptions::batch > 1: the batched worker's rows
  std::atomic<int64_t> batch_sequences{0};  // requests in it now
  std::atomic<int64_t> batch_steps{0}, batch_step_rows{0};  // batched steps, and the rows they decoded
  // Wall microseconds the batched worker spent in steps (every row's token read back) and in joins
  // (a request's prefill and first token): where a batch's time goes.
  std::atomic<int64_t> batch_step_us{0}, batch_join_us{0};

  // Metrics.
  std::mutex mm;
  std::map<std::pair<std::string, int>, int64_t> requests;  // (endpoint, status) -> count
  int64_t generated_tokens = 0, prompt_tokens = 0, reused_tokens = 0, session_reuses = 0, cancelled = 0,
          rejected = 0, decode_errors = 0, last_tokens = 0;
  double last_decode_tps = 0, last_request_tps = 0, last_seconds = 0;
  std::map<std::string, int64_t> kv_bytes;  // session label -> Session::memory().kv_bytes()

  Impl(const Model& m, const Tokenizer& t, const Drafter* d, const FTheta* f, const ChatTemplate* c, ServeOptions o)
      : model(m), tok(t), drafter(d), ftheta(f), chat(c), opt(std::move(o)) {
    eos_ids = model.config().eos_token_ids;
    if (tok.bos_id() >= 0) bos_text = tok.token(tok.bos_id());
    // Chat turns end with the template's end-of-turn token; a base model's config often lists
    // only <eos>, so chat requests stop at these too when the vocabulary has them.
    std::vector<std::string> names = {"<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>"};
    if (chat && !chat->eos_token().empty()) names.push_back(chat->eos_token());
    chat_stop_ids = eos_ids;
    for (const auto& n : names) {
      const int32_t id = tok.token_id(n);
      if (id >= 0 && std::find(chat_stop_ids.begin(), chat_stop_ids.end(), id) == chat_stop_ids.end())
        chat_stop_ids.push_back(id);
    }
  }

  // ---- sessions (worker thread) ----

  Session& session_for(const SamplingOptions& s) {
    const double t = s.temperature > 0 ? s.temperature : 0.0;
    const double p = t > 0 ? s.top_p : 1.0;
    for (auto& slot : sessions)
      if (slot.temperature == t && slot.top_p == p) {
        slot.last_used = ++tick;
        return *slot.session;
      }
    if (static_cast<int64_t>(sessions.size()) >= std::max<int64_t>(opt.max_sessions, 1)) {
      auto lru = std::min_element(sessions.begin(), sessions.end(),
                                  [](const Slot& a, const Slot& b) { return a.last_used < b.last_used; });
      {
        std::lock_guard<std::mutex> lk(mm);
        kv_bytes.erase(lru->label);
      }
      sessions.erase(lru);
    }
    DecodeOptions d = opt.decode;
    d.sampling = {t, p, 0};
    d.on_token = nullptr;
    d.should_stop = nullptr;
    Slot slot;
    slot.temperature = t;
    slot.top_p = p;
    slot.label = t > 0 ? "temperature=" + format_double(t) + ",top_p=" + format_double(p) : "greedy";
    slot.session = std::make_unique<Session>(model, drafter, ftheta, d, serve_capacity(opt));
    slot.last_used = ++tick;
    {
      std::lock_guard<std::mutex> lk(mm);
      kv_bytes[slot.label] = slot.session->memory().kv_bytes();
    }
    sessions.push_back(std::move(slot));
    return *sessions.back().session;
  }

  const std::string& label_of(const Session& s) const {
    static const std::string none;
    for (const auto& slot : sessions)
      if (slot.session.get() == &s) return slot.label;
    return none;
  }

  // ---- decode worker ----

  void worker_loop() {
    if (batcher) return batch_loop();
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lk(qm);
        qcv.wait(lk, [&] { return stopping.load() || !queue.empty(); });
        if (queue.empty()) return;  // stopping
        job = queue.front();
        queue.pop_front();
        busy = true;
      }
      run_job(*job);
      std::lock_guard<std::mutex> lk(qm);
      busy = false;
    }
  }

  // What a running request does with each token: counts it, ends at a stop id, a stop string
  // or when its client leaves, and hands the text to the HTTP thread.
  struct JobOutput {
    Job& job;
    TextStream ts;
    StopFilter sf;
    int64_t n = 0;
    bool hit_stop_id = false;
    Clock::time_point t0 = Clock::now();
    JobOutput(Job& j, const Tokenizer& tok) : job(j), ts(tok), sf(j.stop) {}
    void emit(const std::string& s) {
      if (s.empty()) return;
      std::lock_guard<std::mutex> lk(job.m);
      job.out += s;
      job.cv.notify_all();
    }
    void consume(int64_t t) {
      if (stopped()) return;  // fused: the rest of a block
      ++n;
      if (std::find(job.stop_ids.begin(), job.stop_ids.end(), t) != job.stop_ids.end()) {
        hit_stop_id = true;
        return;
      }
      emit(sf.push(ts.push(t)));
    }
    bool stopped() const { return sf.stopped() || hit_stop_id || job.cancelled.load(); }
    bool ended() const { return stopped() || n >= job.max_tokens; }
    // The text held back (a partial character, a possible stop string's start), then done.
    void complete() {
      if (!sf.stopped()) emit(sf.push(ts.finish()));
      if (!sf.stopped()) emit(sf.finish());
      std::lock_guard<std::mutex> lk(job.m);
      job.completion_tokens = n;
      job.finish_reason = (sf.stopped() || hit_stop_id) ? "stop" : (n >= job.max_tokens ? "length" : "stop");
      job.done = true;
      job.cv.notify_all();
    }
  };

  // False (and the job failed) when it should not run: its client left while it waited, or the
  // server is stopping.
  bool admit(Job& job) {
    if (job.cancelled.load()) {
      {
        std::lock_guard<std::mutex> lk(mm);
        ++cancelled;
      }
      job.fail(499, "the client closed the connection");
      return false;
    }
    if (stopping.load()) {
      job.fail(503, "the server is shutting down");
      return false;
    }
    return true;
  }

  // A finished request's figures. decode_tps: its own decode rate (0: not measured alone).
  void record(const JobOutput& o, double decode_tps, size_t reused, const std::string& label, int64_t kv) {
    const double secs = std::chrono::duration<double>(Clock::now() - o.t0).count();
    const bool was_cancelled = o.job.cancelled.load();
    {
      std::lock_guard<std::mutex> lk(mm);
      generated_tokens += o.n;
      prompt_tokens += static_cast<int64_t>(o.job.prompt.size());
      if (reused > 0) {
        ++session_reuses;
        reused_tokens += static_cast<int64_t>(reused);
      }
      if (was_cancelled) ++cancelled;
      last_tokens = o.n;
      last_seconds = secs;
      last_decode_tps = decode_tps;
      last_request_tps = secs > 0 ? o.n / secs : 0.0;
      kv_bytes[label] = kv;
    }
    std::fprintf(stderr, "[serve] %zu prompt tokens%s, %lld generated in %.2fs (%.1f tok/s %s)%s\n", o.job.prompt.size(),
                 reused ? (" (" + std::to_string(reused) + " reused)").c_str() : "", static_cast<long long>(o.n), secs,
                 decode_tps > 0 ? decode_tps : (secs > 0 ? o.n / secs : 0.0), decode_tps > 0 ? "decode" : "in a batch",
                 was_cancelled ? ", client gone" : "");
  }

  void run_job(Job& job) {
    if (!admit(job)) return;
    JobOutput o(job, tok);
    DecodeOptions d = opt.decode;
    d.max_new_tokens = job.max_tokens;
    d.sampling = job.sampling;
    d.stop_ids = job.stop_ids;
    d.stream = true;
    d.on_token = [&](int64_t t) { o.consume(t); };
    d.should_stop = [&] { return o.stopped() || stopping.load(); };
    try {
      Session& s = session_for(d.sampling);
      const auto& h = s.history();
      const bool reuse = !h.empty() && job.prompt.size() > h.size() && std::equal(h.begin(), h.end(), job.prompt.begin());
      std::vector<int64_t> feed;
      size_t reused = 0;
      if (reuse) {
        reused = h.size();
        feed.assign(job.prompt.begin() + static_cast<std::ptrdiff_t>(h.size()), job.prompt.end());
      } else {
        if (!h.empty()) s.reset();
        feed = job.prompt;
      }
      const DecodeResult r = s.send(feed, d);  // a failed send leaves the session empty
      record(o, r.decode_tokens_per_second(), reused, label_of(s), s.memory().kv_bytes());
      o.complete();
    } catch (const c10::Error& e) {
      decode_failed(job, e.what_without_backtrace());
    } catch (const std::exception& e) {
      decode_failed(job, e.what());
    }
  }

  // ---- batched decode worker (ServeOptions::batch > 1) ----

  // Requests join the batch between steps while rows are free, and leave it when they end;
  // each step produces one token for every request in it (infer/batch.h).
  void batch_loop() {
    struct Running {
      std::shared_ptr<Job> job;
      std::unique_ptr<JobOutput> out;
    };
    std::map<int64_t, Running> running;  // by the batch's sequence id
    // Ends the requests that are done (or all, when the server stops) and frees their rows.
    auto retire = [&](bool all) {
      for (auto it = running.begin(); it != running.end();) {
        Running& r = it->second;
        if (!all && !r.out->ended()) {
          ++it;
          continue;
        }
        batcher->leave(it->first);
        record(*r.out, 0.0, 0, "batch", batcher->kv_bytes());
        if (all && !r.out->ended()) r.job->fail(503, "the server is shutting down");
        else r.out->complete();
        it = running.erase(it);
      }
    };
    for (;;) {
      std::vector<std::shared_ptr<Job>> joining;
      {
        std::unique_lock<std::mutex> lk(qm);
        qcv.wait(lk, [&] { return stopping.load() || !queue.empty() || !running.empty(); });
        if (stopping.load() && queue.empty() && running.empty()) return;
        while (!queue.empty() && (int64_t)(running.size() + joining.size()) < batcher->max_rows()) {
          joining.push_back(queue.front());
          queue.pop_front();
        }
        busy = !running.empty() || !joining.empty();
      }
      if (stopping.load()) {
        for (auto& j : joining) j->fail(503, "the server is shutting down");
        retire(true);
        continue;
      }
      for (auto& j : joining) {
        if (!admit(*j)) continue;
        auto out = std::make_unique<JobOutput>(*j, tok);  // its clock starts before the prefill
        try {
          const auto t0 = Clock::now();
          const auto [id, first] = batcher->join(j->prompt, j->sampling, j->max_tokens);
          batch_join_us += micros_since(t0);
          out->consume(first);
          running.emplace(id, Running{j, std::move(out)});
        } catch (const c10::Error& e) {
          decode_failed(*j, e.what_without_backtrace());
        } catch (const std::exception& e) {
          decode_failed(*j, e.what());
        }
      }
      retire(false);
      batch_sequences = static_cast<int64_t>(running.size());
      if (running.empty()) continue;
      try {
        const auto t0 = Clock::now();
        const auto tokens = batcher->step();
        batch_step_us += micros_since(t0);
        ++batch_steps;
        batch_step_rows += static_cast<int64_t>(tokens.size());
        for (const auto& [id, t] : tokens) running.at(id).out->consume(t);
      } catch (const std::exception& e) {
        // A failed step leaves no row trustworthy: every request in it fails, the rows are freed.
        const std::string what = e.what();
        for (auto& [id, r] : running) {
          batcher->leave(id);
          decode_failed(*r.job, what);
        }
        running.clear();
      }
      retire(false);
      batch_sequences = static_cast<int64_t>(running.size());
    }
  }

  void decode_failed(Job& job, const std::string& what) {
    std::fprintf(stderr, "[serve] decode failed: %s\n", what.c_str());
    {
      std::lock_guard<std::mutex> lk(mm);
      ++decode_errors;
    }
    job.fail(500, "decoding failed: " + what);
  }

  void enqueue(const std::shared_ptr<Job>& job) {
    std::lock_guard<std::mutex> lk(qm);
    if (stopping.load()) throw ApiError(503, "the server is shutting down", "", "", "server_error");
    if (static_cast<int64_t>(queue.size()) >= opt.max_queue) {
      {
        std::lock_guard<std::mutex> lk2(mm);
        ++rejected;
      }
      throw ApiError(429,
                     "the server is busy: " + std::to_string(queue.size()) +
                         " requests are already waiting (--max-queue " + std::to_string(opt.max_queue) +
                         "); retry later",
                     "", "rate_limit_exceeded", "requests");
    }
    queue.push_back(job);
    qcv.notify_one();
  }

  // ---- request parsing (HTTP threads) ----

  void check_model(const json& j) const {
    if (!j.contains("model")) return;
    const json& m = j["model"];
    if (!m.is_string()) throw ApiError(400, std::string("'model' must be a string, got ") + json_type(m), "model");
    if (!opt.model_name.empty() && m.get<std::string>() != opt.model_name)
      throw ApiError(404, "The model '" + m.get<std::string>() + "' does not exist: this server serves '" +
                              opt.model_name + "'",
                     "model", "model_not_found");
  }

  Params parse_params(const json& j, bool chat_request) const {
    Params p;
    p.sampling = opt.decode.sampling;
    if (auto t = get_number(j, "temperature")) {
      if (*t < 0 || *t > 2) throw ApiError(400, "'temperature' must be in [0, 2], got " + format_double(*t), "temperature");
      p.sampling.temperature = *t;
    }
    if (auto tp = get_number(j, "top_p")) {
      if (!(*tp > 0 && *tp <= 1)) throw ApiError(400, "'top_p' must be in (0, 1], got " + format_double(*tp), "top_p");
      p.sampling.top_p = *tp;
    }
    // Greedy reads no top_p: one setting for every greedy request (its session, its batch rows).
    if (p.sampling.temperature <= 0) {
      p.sampling.temperature = 0;
      p.sampling.top_p = 1.0;
    }
    if (present(j, "seed")) {
      const json& v = j["seed"];
      if (!v.is_number_integer()) throw ApiError(400, std::string("'seed' must be an integer, got ") + json_type(v), "seed");
      p.sampling.seed = v.is_number_unsigned() ? v.get<uint64_t>() : static_cast<uint64_t>(v.get<int64_t>());
    } else {
      p.sampling.seed = random_u64();
    }
    const char* max_key = "max_tokens";
    if (chat_request && !present(j, "max_tokens") && present(j, "max_completion_tokens")) max_key = "max_completion_tokens";
    if (auto mt = get_int(j, max_key)) {
      if (*mt <= 0) throw ApiError(400, std::string("'") + max_key + "' must be a positive integer, got " + std::to_string(*mt), max_key);
      p.max_tokens = *mt;
    }
    if (present(j, "stop")) {
      const json& s = j["stop"];
      if (s.is_string()) {
        p.stop.push_back(s.get<std::string>());
      } else if (s.is_array()) {
        if (s.size() > 16) throw ApiError(400, "'stop' holds at most 16 strings, got " + std::to_string(s.size()), "stop");
        for (const auto& x : s) {
          if (!x.is_string()) throw ApiError(400, std::string("'stop' must hold strings, got ") + json_type(x), "stop");
          p.stop.push_back(x.get<std::string>());
        }
      } else {
        throw ApiError(400, std::string("'stop' must be a string or a list of strings, got ") + json_type(s), "stop");
      }
      for (const auto& x : p.stop)
        if (x.empty()) throw ApiError(400, "'stop' strings must not be empty", "stop");
    }
    if (auto s = get_bool(j, "stream")) p.stream = *s;
    if (present(j, "stream_options")) {
      const json& so = j["stream_options"];
      if (!so.is_object()) throw ApiError(400, "'stream_options' must be an object", "stream_options");
      if (auto u = get_bool(so, "include_usage")) p.include_usage = *u;
    }
    // What this server does not do: refused by name rather than ignored.
    if (auto n = get_int(j, "n"))
      if (*n != 1) throw ApiError(400, "'n' must be 1: one choice per request is supported", "n");
    if (auto n = get_int(j, "best_of"))
      if (*n != 1) throw ApiError(400, "'best_of' must be 1: one choice per request is supported", "best_of");
    if (auto e = get_bool(j, "echo"))
      if (*e) throw ApiError(400, "'echo' is not supported", "echo");
    if (present(j, "logprobs")) {
      const json& v = j["logprobs"];
      if (!(v.is_boolean() && !v.get<bool>()) && !(v.is_number_integer() && v.get<int64_t>() == 0))
        throw ApiError(400, "'logprobs' is not supported", "logprobs");
    }
    for (const char* key : {"frequency_penalty", "presence_penalty"})
      if (auto v = get_number(j, key))
        if (*v != 0) throw ApiError(400, std::string("'") + key + "' is not supported (only 0)", key);
    if (present(j, "logit_bias") && !(j["logit_bias"].is_object() && j["logit_bias"].empty()))
      throw ApiError(400, "'logit_bias' is not supported", "logit_bias");
    if (present(j, "suffix") && !(j["suffix"].is_string() && j["suffix"].get<std::string>().empty()))
      throw ApiError(400, "'suffix' is not supported", "suffix");
    if (present(j, "tools") && !(j["tools"].is_array() && j["tools"].empty()))
      throw ApiError(400, "'tools' are not supported", "tools");
    if (present(j, "response_format")) {
      const json& rf = j["response_format"];
      if (!(rf.is_object() && rf.value("type", "") == "text"))
        throw ApiError(400, "'response_format' other than {\"type\": \"text\"} is not supported", "response_format");
    }
    return p;
  }

  std::vector<int64_t> ids_of(const json& arr, const char* param) const {
    std::vector<int64_t> ids;
    const int64_t vocab = std::min<int64_t>(tok.vocab_size(), model.config().vocab_size);
    for (const auto& v : arr) {
      if (!v.is_number_integer()) throw ApiError(400, std::string("'") + param + "' token ids must be integers", param);
      const int64_t id = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX) ? -1 : v.get<int64_t>();
      if (id < 0 || id >= vocab)
        throw ApiError(400, std::string("'") + param + "' holds token id " + v.dump() + ", outside [0, " +
                                std::to_string(vocab) + ")", param);
      ids.push_back(id);
    }
    return ids;
  }

  std::vector<int64_t> encode(const std::string& text, bool add_special) const {
    const auto ids = tok.encode(text, add_special);
    return std::vector<int64_t>(ids.begin(), ids.end());
  }

  std::vector<int64_t> completion_prompt(const json& j) const {
    if (!present(j, "prompt")) throw ApiError(400, "'prompt' is required", "prompt");
    const json& p = j["prompt"];
    const char* shape = "'prompt' must be a string, a list of one string, or a list of token ids (one prompt per request)";
    std::vector<int64_t> ids;
    if (p.is_string()) {
      ids = encode(p.get<std::string>(), true);
    } else if (p.is_array()) {
      if (p.size() == 1 && p[0].is_string()) ids = encode(p[0].get<std::string>(), true);
      else if (p.size() == 1 && p[0].is_array()) ids = ids_of(p[0], "prompt");
      else if (!p.empty() && p[0].is_number()) ids = ids_of(p, "prompt");
      else throw ApiError(400, shape, "prompt");
    } else {
      throw ApiError(400, std::string(shape) + ", got " + json_type(p), "prompt");
    }
    if (ids.empty()) throw ApiError(400, "'prompt' is empty (no tokens)", "prompt");
    return ids;
  }

  std::vector<int64_t> chat_prompt(const json& j) const {
    if (!chat)
      throw ApiError(400,
                     "this server has no chat template: the model directory has none; start it with "
                     "--chat-template FILE (a Jinja chat template, e.g. checkpoints/chat_templates/gemma.jinja), "
                     "or use /v1/completions",
                     "messages");
    if (!present(j, "messages")) throw ApiError(400, "'messages' is required", "messages");
    const json& ms = j["messages"];
    if (!ms.is_array() || ms.empty()) throw ApiError(400, "'messages' must be a non-empty list of messages", "messages");
    std::vector<ChatMessage> messages;
    for (size_t i = 0; i < ms.size(); ++i) {
      const json& m = ms[i];
      const std::string at = "messages[" + std::to_string(i) + "]";
      if (!m.is_object()) throw ApiError(400, "'" + at + "' must be an object", at);
      if (!m.contains("role") || !m["role"].is_string())
        throw ApiError(400, "'" + at + ".role' must be a string", at + ".role");
      ChatMessage cm;
      cm.role = m["role"].get<std::string>();
      if (present(m, "content")) {
        const json& c = m["content"];
        if (c.is_string()) {
          cm.content = c.get<std::string>();
        } else if (c.is_array()) {
          for (const auto& part : c) {
            if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
              throw ApiError(400, "'" + at + ".content' parts must be {\"type\": \"text\", \"text\": ...}: only text is supported",
                             at + ".content");
            cm.content += part["text"].get<std::string>();
          }
        } else {
          throw ApiError(400, "'" + at + ".content' must be a string or a list of text parts, got " + json_type(c),
                         at + ".content");
        }
      }
      messages.push_back(std::move(cm));
    }
    std::string text;
    try {
      text = chat->render(messages, true);
    } catch (const Error& e) {
      throw ApiError(400, std::string("the chat template refused the messages: ") + e.what(), "messages");
    }
    // The template writes BOS itself (most do): do not add a second one.
    const bool has_bos = !bos_text.empty() && text.compare(0, bos_text.size(), bos_text) == 0;
    auto ids = encode(text, !has_bos);
    if (ids.empty()) throw ApiError(400, "the rendered chat prompt is empty", "messages");
    return ids;
  }

  int64_t resolve_max_tokens(const Params& p, size_t prompt_tokens, const char* prompt_param) const {
    const int64_t P = static_cast<int64_t>(prompt_tokens), C = opt.max_context;
    if (P >= C)
      throw ApiError(400,
                     "the prompt is " + std::to_string(P) + " tokens; this server's context is " + std::to_string(C) +
                         " tokens (--max-context), which leaves no room to generate",
                     prompt_param, "context_length_exceeded");
    if (!p.max_tokens) return std::min(opt.max_tokens_default, C - P);
    if (P + *p.max_tokens > C)
      throw ApiError(400,
                     "prompt (" + std::to_string(P) + " tokens) + max_tokens (" + std::to_string(*p.max_tokens) +
                         ") = " + std::to_string(P + *p.max_tokens) + " exceeds this server's context of " +
                         std::to_string(C) + " tokens (--max-context)",
                     "max_tokens", "context_length_exceeded");
    return *p.max_tokens;
  }

  // ---- responses ----

  json usage_json(int64_t prompt, int64_t completion) const {
    return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
  }

  json chunk_json(bool chat_request, const std::string& id, int64_t t, const json& choice, bool include_usage) const {
    json j{{"id", id},
           {"object", chat_request ? "chat.completion.chunk" : "text_completion"},
           {"created", t},
           {"model", opt.model_name},
           {"choices", json::array({choice})}};
    if (include_usage) j["usage"] = nullptr;
    return j;
  }

  static std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

  void handle(const httplib::Request& req, httplib::Response& res, bool chat_request) {
    try {
      if (stopping.load()) throw ApiError(503, "the server is shutting down", "", "", "server_error");
      if (static_cast<int64_t>(req.body.size()) > opt.max_body_bytes)
        throw ApiError(413, "the request body is " + std::to_string(req.body.size()) + " bytes; the limit is " +
                                std::to_string(opt.max_body_bytes));
      json j;
      try {
        j = json::parse(req.body);
      } catch (const json::exception& e) {
        throw ApiError(400, std::string("the body is not valid JSON: ") + e.what());
      }
      if (!j.is_object()) throw ApiError(400, std::string("the body must be a JSON object, got ") + json_type(j));
      check_model(j);
      const Params p = parse_params(j, chat_request);
      auto job = std::make_shared<Job>();
      job->prompt = chat_request ? chat_prompt(j) : completion_prompt(j);
      job->max_tokens = resolve_max_tokens(p, job->prompt.size(), chat_request ? "messages" : "prompt");
      job->sampling = p.sampling;
      job->stop = p.stop;
      job->stop_ids = chat_request ? chat_stop_ids : eos_ids;
      enqueue(job);

      const std::string id = (chat_request ? "chatcmpl-" : "cmpl-") + random_hex(24);
      const int64_t t = static_cast<int64_t>(std::time(nullptr));
      const int64_t prompt_n = static_cast<int64_t>(job->prompt.size());
      if (!p.stream) {
        std::unique_lock<std::mutex> lk(job->m);
        job->cv.wait(lk, [&] { return job->done; });
        if (job->error_status)
          throw ApiError(job->error_status, job->error_message, "", "", job->error_type);
        json choice{{"index", 0}, {"logprobs", nullptr}, {"finish_reason", job->finish_reason}};
        if (chat_request) choice["message"] = {{"role", "assistant"}, {"content", job->out}};
        else choice["text"] = job->out;
        json body{{"id", id},
                  {"object", chat_request ? "chat.completion" : "text_completion"},
                  {"created", t},
                  {"model", opt.model_name},
                  {"choices", json::array({choice})},
                  {"usage", usage_json(prompt_n, job->completion_tokens)}};
        res.set_content(dump(body), "application/json");
        return;
      }
      // Server-sent events: one chunk per piece of text the worker hands over.
      struct StreamState {
        bool role_sent = false;
      };
      auto state = std::make_shared<StreamState>();
      const bool include_usage = p.include_usage;
      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream",
          [this, job, state, id, t, prompt_n, chat_request, include_usage](size_t, httplib::DataSink& sink) {
            std::string text, finish, error_message, error_type;
            bool done = false;
            int error_status = 0;
            int64_t completion = 0;
            {
              std::unique_lock<std::mutex> lk(job->m);
              job->cv.wait_for(lk, std::chrono::seconds(1), [&] { return job->done || !job->out.empty(); });
              text.swap(job->out);
              done = job->done;
              if (done) {
                finish = job->finish_reason;
                error_status = job->error_status;
                error_message = job->error_message;
                error_type = job->error_type;
                completion = job->completion_tokens;
              }
            }
            std::string payload;
            if (chat_request && !state->role_sent) {
              payload += sse(chunk_json(true, id, t,
                                        {{"index", 0},
                                         {"delta", {{"role", "assistant"}, {"content", ""}}},
                                         {"logprobs", nullptr},
                                         {"finish_reason", nullptr}},
                                        include_usage));
              state->role_sent = true;
            }
            if (!text.empty()) {
              json choice{{"index", 0}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
              if (chat_request) choice["delta"] = {{"content", text}};
              else choice["text"] = text;
              payload += sse(chunk_json(chat_request, id, t, choice, include_usage));
            }
            if (done) {
              if (error_status) {
                payload += sse(error_json(ApiError(error_status, error_message, "", "", error_type)));
              } else {
                json choice{{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish}};
                if (chat_request) choice["delta"] = json::object();
                else choice["text"] = "";
                payload += sse(chunk_json(chat_request, id, t, choice, include_usage));
                if (include_usage) {
                  json u = chunk_json(chat_request, id, t, choice, false);
                  u["choices"] = json::array();
                  u["usage"] = usage_json(prompt_n, completion);
                  payload += sse(u);
                }
              }
              payload += "data: [DONE]\n\n";
            }
            // Nothing new for a second (queued, or a long prefill): an SSE comment, which clients
            // ignore, finds out whether the client is still there.
            if (payload.empty()) payload = ": keep-alive\n\n";
            if (!sink.write(payload.data(), payload.size())) {
              job->cancelled = true;
              return false;
            }
            if (done) sink.done();
            return true;
          },
          [job](bool success) {
            if (!success) job->cancelled = true;  // the connection ended before the last event
          });
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const c10::Error& e) {
      send_error(res, ApiError(500, e.what_without_backtrace(), "", "", "server_error"));
    } catch (const std::exception& e) {
      send_error(res, ApiError(500, e.what(), "", "", "server_error"));
    }
  }

  json model_json() const {
    return {{"id", opt.model_name}, {"object", "model"}, {"created", created}, {"owned_by", "kakeya"}};
  }

  std::string metrics_text() {
    std::ostringstream o;
    size_t depth = 0;
    bool is_busy = false;
    {
      std::lock_guard<std::mutex> lk(qm);
      depth = queue.size();
      is_busy = busy;
    }
    std::lock_guard<std::mutex> lk(mm);
    const auto metric = [&](const char* name, const char* type, const char* help) {
      o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
    };
    metric("kakeya_requests_total", "counter", "HTTP requests answered, by endpoint and status.");
    for (const auto& [key, count] : requests)
      o << "kakeya_requests_total{endpoint=\"" << key.first << "\",status=\"" << key.second << "\"} " << count << "\n";
    metric("kakeya_generated_tokens_total", "counter", "Tokens generated.");
    o << "kakeya_generated_tokens_total " << generated_tokens << "\n";
    metric("kakeya_prompt_tokens_total", "counter", "Prompt tokens of decoded requests.");
    o << "kakeya_prompt_tokens_total " << prompt_tokens << "\n";
    metric("kakeya_session_reuses_total", "counter", "Requests that extended the session's conversation.");
    o << "kakeya_session_reuses_total " << session_reuses << "\n";
    metric("kakeya_reused_prompt_tokens_total", "counter", "Prompt tokens already in a session's caches (not prefilled again).");
    o << "kakeya_reused_prompt_tokens_total " << reused_tokens << "\n";
    metric("kakeya_requests_cancelled_total", "counter", "Requests whose client went away before the end.");
    o << "kakeya_requests_cancelled_total " << cancelled << "\n";
    metric("kakeya_requests_rejected_total", "counter", "Requests refused with 429 (queue full).");
    o << "kakeya_requests_rejected_total " << rejected << "\n";
    metric("kakeya_decode_errors_total", "counter", "Requests whose decode threw (answered 500).");
    o << "kakeya_decode_errors_total " << decode_errors << "\n";
    metric("kakeya_last_request_tokens_per_second", "gauge", "Generated tokens / wall time of the last request (prefill included).");
    o << "kakeya_last_request_tokens_per_second " << last_request_tps << "\n";
    metric("kakeya_last_decode_tokens_per_second", "gauge", "Decode tokens/s of the last request (after the first token).");
    o << "kakeya_last_decode_tokens_per_second " << last_decode_tps << "\n";
    metric("kakeya_last_request_seconds", "gauge", "Wall time of the last request's decode.");
    o << "kakeya_last_request_seconds " << last_seconds << "\n";
    metric("kakeya_last_request_generated_tokens", "gauge", "Tokens generated by the last request.");
    o << "kakeya_last_request_generated_tokens " << last_tokens << "\n";
    metric("kakeya_queue_depth", "gauge", "Requests waiting for the decode worker.");
    o << "kakeya_queue_depth " << depth << "\n";
    metric("kakeya_queue_capacity", "gauge", "Most requests that may wait (--max-queue).");
    o << "kakeya_queue_capacity " << opt.max_queue << "\n";
    metric("kakeya_busy", "gauge", "1 while the decode worker runs a request.");
    o << "kakeya_busy " << (is_busy ? 1 : 0) << "\n";
    metric("kakeya_batch_sequences", "gauge", "Requests decoding in the batch now (--batch > 1).");
    o << "kakeya_batch_sequences " << batch_sequences.load() << "\n";
    metric("kakeya_batch_rows", "gauge", "Requests the batch decodes together at most (--batch).");
    o << "kakeya_batch_rows " << opt.batch << "\n";
    metric("kakeya_batch_steps_total", "counter", "Batched decode steps.");
    o << "kakeya_batch_steps_total " << batch_steps.load() << "\n";
    metric("kakeya_batch_step_rows_total", "counter", "Tokens the batched steps produced (rows per step, summed).");
    o << "kakeya_batch_step_rows_total " << batch_step_rows.load() << "\n";
    metric("kakeya_batch_step_seconds_total", "counter", "Wall seconds of the batched steps (tokens read back included).");
    o << "kakeya_batch_step_seconds_total " << batch_step_us.load() * 1e-6 << "\n";
    metric("kakeya_batch_join_seconds_total", "counter", "Wall seconds of joins to the batch (prefill and first token).");
    o << "kakeya_batch_join_seconds_total " << batch_join_us.load() * 1e-6 << "\n";
    metric("kakeya_sessions", "gauge", "Decode sessions (one per sampling setting) holding caches.");
    o << "kakeya_sessions " << kv_bytes.size() << "\n";
    metric("kakeya_session_capacity_positions", "gauge", "Positions each session holds.");
    o << "kakeya_session_capacity_positions " << serve_capacity(opt) << "\n";
    metric("kakeya_kv_bytes", "gauge", "KV bytes of each decode session (Session::memory().kv_bytes()).");
    int64_t total = 0;
    for (const auto& [label, bytes] : kv_bytes) {
      o << "kakeya_kv_bytes{session=\"" << label << "\"} " << bytes << "\n";
      total += bytes;
    }
    metric("kakeya_kv_bytes_total", "gauge", "KV bytes of every decode session.");
    o << "kakeya_kv_bytes_total " << total << "\n";
    return o.str();
  }

  void setup_routes() {
    using httplib::Request;
    using httplib::Response;
    http.Post(R"(/(v1/)?completions)", [this](const Request& req, Response& res) { handle(req, res, false); });
    http.Post(R"(/(v1/)?chat/completions)", [this](const Request& req, Response& res) { handle(req, res, true); });
    http.Get("/v1/models", [this](const Request&, Response& res) {
      res.set_content(dump({{"object", "list"}, {"data", json::array({model_json()})}}), "application/json");
    });
    http.Get(R"(/v1/models/(.+))", [this](const Request& req, Response& res) {
      const std::string name = req.matches[1];
      if (name != opt.model_name)
        return send_error(res, ApiError(404, "The model '" + name + "' does not exist: this server serves '" +
                                                 opt.model_name + "'",
                                        "model", "model_not_found"));
      res.set_content(dump(model_json()), "application/json");
    });
    http.Get("/health", [this](const Request&, Response& res) {
      if (stopping.load()) return send_error(res, ApiError(503, "the server is shutting down", "", "", "server_error"));
      res.set_content(dump({{"status", "ok"}, {"model", opt.model_name}}), "application/json");
    });
    http.Get("/metrics", [this](const Request&, Response& res) {
      res.set_content(metrics_text(), "text/plain; version=0.0.4");
    });
    // Statuses httplib answers itself (unknown path, oversized body, bad request line): an
    // OpenAI error body instead of an empty one.
    http.set_error_handler(httplib::Server::HandlerWithResponse(
        [this](const Request& req, Response& res) -> httplib::Server::HandlerResponse {
          if (!res.body.empty() || res.content_provider_) return httplib::Server::HandlerResponse::Unhandled;
          std::string message;
          switch (res.status) {
            case 404: message = "no such endpoint: " + req.method + " " + req.path; break;
            case 405: message = "method " + req.method + " is not allowed on " + req.path; break;
            case 413:
              message = "the request body exceeds the limit of " + std::to_string(opt.max_body_bytes) + " bytes";
              break;
            default: message = "the request could not be served (HTTP " + std::to_string(res.status) + ")";
          }
          ApiError e(res.status, message, "", "", res.status >= 500 ? "server_error" : "invalid_request_error");
          res.set_content(dump(error_json(e)), "application/json");
          return httplib::Server::HandlerResponse::Handled;
        }));
    http.set_exception_handler([](const Request&, Response& res, std::exception_ptr ep) {
      std::string what = "internal error";
      try {
        if (ep) std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      send_error(res, ApiError(500, what, "", "", "server_error"));
    });
    http.set_logger([this](const Request& req, const Response& res) {
      std::lock_guard<std::mutex> lk(mm);
      ++requests[{endpoint_label(req.path), res.status}];
    });
  }
};

Server::Server(const Model& model, const Tokenizer& tok, const Drafter* drafter, const FTheta* ftheta,
               const ChatTemplate* chat, ServeOptions opt)
    : impl_(std::make_unique<Impl>(model, tok, drafter, ftheta, chat, std::move(opt))) {
  const auto& o = impl_->opt;
  KAKEYA_CHECK(o.max_context > 1, "serve: --max-context must be at least 2, got " << o.max_context);
  KAKEYA_CHECK(o.max_queue >= 1, "serve: --max-queue must be at least 1, got " << o.max_queue);
  KAKEYA_CHECK(o.max_body_bytes >= 1, "serve: the body limit must be positive, got " << o.max_body_bytes);
  KAKEYA_CHECK(o.max_tokens_default >= 1, "serve: the default max_tokens must be positive, got " << o.max_tokens_default);
  KAKEYA_CHECK(o.http_threads >= 1, "serve: --http-threads must be at least 1, got " << o.http_threads);
  KAKEYA_CHECK(o.port >= 0 && o.port <= 65535, "serve: --port must be in [0, 65535], got " << o.port);
  KAKEYA_CHECK(o.batch >= 1, "serve: --batch must be at least 1, got " << o.batch);
  KAKEYA_CHECK(o.batch == 1 || o.decode.mode == DecodeMode::Ar || o.decode.mode == DecodeMode::Restored,
               "serve: --batch " << o.batch << " decodes ar or restored sequences; --mode "
                                 << decode_mode_name(o.decode.mode) << " serves one request at a time (--batch 1)");
  KAKEYA_CHECK(serve_capacity(o) <= model.options().max_positions,
               "serve: a session of " << serve_capacity(o) << " positions (--max-context " << o.max_context
                                      << ") needs the model loaded with max_positions >= that, got "
                                      << model.options().max_positions);
}

Server::~Server() { stop(); }

int Server::start() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lk(s.life_m);
    KAKEYA_CHECK(!s.started, "serve: the server was already started");
  }
  // The default session (or the batch's rows) first: options the decoder refuses fail here,
  // before any client waits.
  if (s.opt.batch > 1) {
    s.batcher = std::make_unique<BatchDecoder>(s.model, s.drafter, s.ftheta, s.opt.decode, s.opt.batch,
                                               serve_capacity(s.opt));
    s.batcher->capture_all();
    std::lock_guard<std::mutex> lk(s.mm);
    s.kv_bytes["batch"] = s.batcher->kv_bytes();
  } else {
    s.session_for(s.opt.decode.sampling);
  }
  s.setup_routes();
  const ServeOptions& o = s.opt;
  const size_t threads = static_cast<size_t>(o.http_threads);
  s.http.new_task_queue = [threads, &s] {
    return new ElasticPool(std::min<size_t>(8, threads), threads, std::chrono::seconds(10), &s.stopping);
  };
  s.http.set_read_timeout(o.read_timeout_s, 0);
  s.http.set_write_timeout(o.write_timeout_s, 0);
  s.http.set_keep_alive_timeout(o.keep_alive_timeout_s);
  s.http.set_keep_alive_max_count(static_cast<size_t>(std::max(1, o.keep_alive_max_requests)));
  s.http.set_payload_max_length(static_cast<size_t>(o.max_body_bytes));
  s.http.set_tcp_nodelay(true);
  errno = 0;
  const int port = o.port == 0 ? s.http.bind_to_any_port(o.host) : (s.http.bind_to_port(o.host, o.port) ? o.port : -1);
  KAKEYA_CHECK(port > 0, "serve: cannot listen on " << o.host << ":" << o.port
                                                   << (errno ? std::string(" (") + std::strerror(errno) + ")" : ""));
  s.bound_port = port;
  {
    std::lock_guard<std::mutex> lk(s.life_m);
    s.started = true;
  }
  s.worker_thread = std::thread([&s] { s.worker_loop(); });
  s.listen_thread = std::thread([&s] { s.http.listen_after_bind(); });
  return port;
}

void Server::wait() {
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lk(s.life_m);
  s.life_cv.wait(lk, [&] { return s.stopped || !s.started; });
}

void Server::stop() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lk(s.life_m);
    if (!s.started || s.stop_requested) return;
    s.stop_requested = true;
  }
  s.stopping = true;  // the running generation ends at its next token
  {
    std::lock_guard<std::mutex> lk(s.qm);
    for (auto& job : s.queue) job->fail(503, "the server is shutting down");
    s.queue.clear();
  }
  s.qcv.notify_all();
  s.http.stop();
  if (s.listen_thread.joinable()) s.listen_thread.join();
  if (s.worker_thread.joinable()) s.worker_thread.join();
  {
    std::lock_guard<std::mutex> lk(s.life_m);
    s.stopped = true;
  }
  s.life_cv.notify_all();
}

int Server::port() const { return impl_->bound_port; }

}  // namespace kakeya
