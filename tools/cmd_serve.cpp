// kakeya serve: the OpenAI-compatible HTTP server (infer/server.h) on one model, in one decode
// mode (ar | restored | fused) with the restore flags of tools/restored_flags.h. Prints
// "kakeya serve: listening on http://HOST:PORT (model NAME, mode M)" on stderr and
// "PORT <n>" on stdout (--port 0 picks a free port); SIGINT / SIGTERM stop it cleanly.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <thread>

#include "core/error.h"
#include "core/io/chat_template.h"
#include "infer/server.h"
#include "tools/cli_common.h"
#include "tools/restored_flags.h"

namespace kakeya::cli {

namespace {

int g_signal_pipe[2] = {-1, -1};

extern "C" void on_stop_signal(int sig) {
  const char c = static_cast<char>(sig);
  const ssize_t r = ::write(g_signal_pipe[1], &c, 1);
  (void)r;
}

std::string dir_name(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const auto slash = dir.rfind('/');
  return slash == std::string::npos ? dir : dir.substr(slash + 1);
}

}  // namespace

void register_serve(CLI::App& app) {
  struct Opts {
    RestoreFlags rf;
    ServeOptions so;
    std::string mode = "ar", chat_template;
    double temperature = 0.0, top_p = 1.0;
    int64_t block_size = 0;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("serve", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                        "/v1/models, /health, /metrics) over a decode session");
  o->rf.add(c);
  c->add_option("--model", o->rf.verifier, "model directory (HF layout; the same as --verifier)");
  c->add_option("--mode", o->mode, "ar (full KV) | restored (bounded KV, f_θ restoration) | fused (restored + speculative blocks)")
      ->capture_default_str()
      ->check(CLI::IsMember({"ar", "restored", "fused"}));
  c->add_option("--block-size", o->block_size, "fused: tokens per verify forward (0: the drafter's block_size)")
      ->capture_default_str();
  c->add_option("--host", o->so.host, "address to listen on")->capture_default_str();
  c->add_option("--port", o->so.port, "port (0: a free one, printed as PORT <n> on stdout)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  c->add_option("--model-name", o->so.model_name, "the name /v1/models lists and requests must use (default: the model directory's name)");
  c->add_option("--max-context", o->so.max_context, "prompt + max_tokens of a request, in tokens (each session's caches hold this many positions)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 30));
  c->add_option("--max-queue", o->so.max_queue, "requests that may wait for the decode worker (beyond: 429)")
      ->capture_default_str()
      ->check(positive());
  c->add_option("--max-body-bytes", o->so.max_body_bytes, "largest request body (beyond: 413)")
      ->capture_default_str()
      ->check(positive());
  c->add_option("--max-tokens-default", o->so.max_tokens_default, "max_tokens of a request that gives none")
      ->capture_default_str()
      ->check(positive());
  c->add_option("--max-sessions", o->so.max_sessions, "sampling settings whose decode sessions are kept at once")
      ->capture_default_str()
      ->check(positive());
  c->add_option("--batch", o->so.batch,
                "requests decoded together in one batched step (continuous batching; ar or restored mode, each a row of --max-context positions)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  c->add_option("--http-threads", o->so.http_threads, "most connections served at once")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  c->add_option("--temperature", o->temperature, "temperature of requests that give none (0 = greedy)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 2.0));
  c->add_option("--top-p", o->top_p, "top_p of requests that give none")->capture_default_str();
  c->add_option("--chat-template", o->chat_template,
                "Jinja chat template for /v1/chat/completions (default: the model directory's own, if it has one)");
  c->callback([o] {
    KAKEYA_CHECK(o->top_p > 0 && o->top_p <= 1, "serve: --top-p must be in (0, 1], got " << o->top_p);
    const DecodeMode mode = parse_decode_mode(o->mode);
    ServeOptions so = o->so;
    if (so.model_name.empty()) so.model_name = dir_name(o->rf.verifier);
    RestoreOptions ro = o->rf.options();
    so.decode.mode = mode;
    so.decode.restore = ro;
    so.decode.sampling = {o->temperature, o->top_p, 0};
    so.decode.block_size = o->block_size;
    const bool need_restore = mode != DecodeMode::Ar && (ro.needs_ftheta() || mode == DecodeMode::Fused);
    auto st = load_decode_stack(o->rf, serve_capacity(so), need_restore);

    std::unique_ptr<ChatTemplate> chat;
    if (!o->chat_template.empty()) {
      chat = std::make_unique<ChatTemplate>(ChatTemplate::load(o->rf.verifier, o->chat_template));
    } else {
      try {
        chat = std::make_unique<ChatTemplate>(ChatTemplate::load(o->rf.verifier));
      } catch (const Error& e) {
        std::fprintf(stderr, "kakeya serve: /v1/chat/completions is off (answers 400): %s\n", e.what());
      }
    }

    // SIGINT/SIGTERM: the handler writes the signal to a pipe (async-signal-safe, whichever
    // thread it lands on, torch's included); a watcher thread reads it and stops the server.
    KAKEYA_CHECK(::pipe(g_signal_pipe) == 0, "serve: pipe() failed: " << std::strerror(errno));
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    std::signal(SIGPIPE, SIG_IGN);  // a client that went away is a failed write, not the end of the server

    Server server(*st.model, *st.tok, st.d(), st.f(), chat.get(), so);
    const int port = server.start();
    std::fprintf(stderr, "kakeya serve: listening on http://%s:%d (model %s, mode %s)\n", so.host.c_str(), port,
                 so.model_name.c_str(), decode_mode_name(mode));
    std::cout << "PORT " << port << std::endl;
    std::thread watcher([&] {
      char sig = 0;
      while (::read(g_signal_pipe[0], &sig, 1) < 0 && errno == EINTR) {
      }
      std::fprintf(stderr, "kakeya serve: %s, stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
      server.stop();
    });
    server.wait();
    watcher.join();
    std::fprintf(stderr, "kakeya serve: stopped\n");
  });
}

}  // namespace kakeya::cli
