// `kakeya serve`: an OpenAI-compatible HTTP server, a thin layer over infer/session.h (no
// decoding logic here). Endpoints:
//   POST /v1/completions       {prompt, max_tokens, temperature, top_p, seed, stop, stream, ...}
//   POST /v1/chat/completions  {messages, ...same knobs}: prompt = ChatTemplate::render(messages)
//   GET  /v1/models, /v1/models/{name}, /health, /metrics (Prometheus text)
// Streaming answers are server-sent events in OpenAI's format (`data: {chunk}` ..., then
// `data: [DONE]`). Errors are OpenAI error bodies ({"error": {message, type, param, code}}):
// 400 bad input (naming the field), 404 unknown model, 413 body too large, 429 queue full,
// 500 a decode failed (the server keeps serving), 503 shutting down.
//
// With ServeOptions::batch > 1 (ar or restored mode) the decode worker decodes up to that many requests
// together (infer/batch.h: continuous batching, one token for each per batched forward; requests
// join and leave between steps, in arrival order, from the bounded queue); every request is
// prefilled afresh. With batch 1 one decode worker runs the requests one at a time, in arrival
// order, from a bounded queue. It keeps a Session per sampling setting (greedy, and each
// temperature/top-p a request asked for: a session's sampling is fixed when it is built; at most
// ServeOptions::max_sessions, least recently used dropped) and reuses a session's caches when a
// request's prompt tokens extend its conversation (session.history(): the earlier prompt and
// the tokens generated after it), feeding only the new tokens; otherwise it resets the session.
// A streaming client that goes away stops its generation at the next token
// (DecodeOptions::should_stop); so does a stop string in the text. The model's EOS ids always
// stop (chat requests also stop at the template's end-of-turn token when the vocabulary has one).
//
// HTTP: connections are served by a bounded, elastic thread pool (ServeOptions::http_threads:
// a thread per connection up to that many, then as many accepted connections waiting, then the
// kernel's listen backlog) with read/write timeouts and a keep-alive limit, so slow or half-open
// clients hold a thread for at most the read timeout and never reach the decode worker; memory
// stays bounded by the thread count and the queue (max_queue waiting requests, max_body_bytes each).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "infer/options.h"

namespace kakeya {

class Model;
class Tokenizer;
class Drafter;
class FTheta;
class ChatTemplate;

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                      // 0: a free port (Server::start returns it)
  std::string model_name;               // what /v1/models lists; a request's "model" must equal it
  int64_t max_context = 2048;           // prompt + max_tokens of one request (and of a reused conversation)
  int64_t max_queue = 64;               // requests waiting for the worker; beyond: 429
  int64_t max_body_bytes = 1 << 20;     // beyond: 413
  int64_t max_tokens_default = 256;     // max_tokens when a request gives none (cut to fit max_context)
  // Mode and restore options of every request, and the default sampling (temperature/top-p of a
  // request that gives none; 0 = greedy). max_new_tokens, stop_ids, on_token and should_stop are
  // set per request.
  DecodeOptions decode;
  int64_t max_sessions = 3;             // sampling settings whose sessions (caches) are kept at once
  int64_t batch = 1;                    // > 1: requests decoded together (ar or restored; rows of max_context positions)
  int http_threads = 256;               // most connections served at once (threads; 8 stay, the rest exit when idle)
  int read_timeout_s = 5;               // a client that sends nothing for this long is dropped
  int write_timeout_s = 5;              // a client that reads nothing for this long is dropped
  int keep_alive_timeout_s = 5;         // idle keep-alive connections are closed after this
  int keep_alive_max_requests = 100;    // requests per connection
};

// Positions a session of these options holds (the verifier's RoPE table must cover them):
// max_context, plus the window for fused mode (its last verify block may reach past the budget).
int64_t serve_capacity(const ServeOptions& opt);

class Server {
 public:
  // Everything passed by reference or pointer must outlive the server. drafter/ftheta as
  // opt.decode.mode needs them (infer/decoder.h); chat: null answers /v1/chat/completions
  // with 400 (start the server with --chat-template). Nothing is allocated before start().
  Server(const Model& model, const Tokenizer& tok, const Drafter* drafter, const FTheta* ftheta,
         const ChatTemplate* chat, ServeOptions opt);
  ~Server();  // stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Builds the default session (throws on options the decoder refuses), binds host:port
  // (throws when it cannot), starts the HTTP threads and the decode worker; returns the port.
  int start();
  void wait();  // until stop() (from another thread, e.g. a signal watcher)
  // Refuses new requests (503), ends the running generation and fails the queued ones, closes
  // the listening socket and joins every thread. Idempotent.
  void stop();
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kakeya
