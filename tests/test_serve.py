#!/usr/bin/env python3
"""`kakeya serve` end to end (CTest label `model`: the real Gemma 3 270M, CPU f32).

Starts `kakeya serve --port 0` (the port comes back on stdout as `PORT <n>`) and talks to it
through the real `openai` client and through plain HTTP:
  ar server:        completions == `kakeya decode --mode ar` (text and token counts), chat
                    completions (the template's prompt, BOS not doubled), streaming == non-streamed,
                    stop strings (also while streaming), 8 concurrent clients == their sequential
                    answers, seeded sampling reproducible, multi-turn conversations extending the
                    previous one == a fresh request of the full prompt, a streaming client that goes
                    away stops its generation, bad input (400/404/413 with OpenAI error bodies),
                    200 half-open sockets while a normal request still succeeds, bounded RSS, /metrics,
                    SIGTERM stops cleanly.
  batched server:   --batch 4: 8 concurrent clients == `kakeya decode` of each prompt alone (greedy,
                    f32), the requests shared steps (metrics), streaming, stop strings, one seed
                    sampled side by side gives one answer, bad input, --batch refused in fused mode.
  restored batched: --mode restored --batch 2: 4 concurrent clients == `kakeya decode --mode restored`.
  restored server:  sink 4 + window 8, prompts of ~40 tokens (positions leave the window):
                    completions == `kakeya decode --mode restored` with the same flags, streaming,
                    and a full queue answers 429.
Environment (set by tests/CMakeLists.txt): KAKEYA_BIN, KAKEYA_SOURCE_DIR, KAKEYA_MODEL_DIR.
"""
import concurrent.futures
import functools
import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import openai

SRC = os.environ.get("KAKEYA_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("KAKEYA_BIN", os.path.join(SRC, "build", "kakeya"))
MODEL = os.environ.get("KAKEYA_MODEL_DIR", os.path.join(SRC, "checkpoints", "models", "gemma3-270m"))
TEMPLATE = os.path.join(SRC, "checkpoints", "chat_templates", "gemma.jinja")
DRAFTER = os.path.join(SRC, "checkpoints", "gemma3-270m", "drafter")
FTHETA = os.path.join(SRC, "checkpoints", "gemma3-270m", "ftheta")
MODEL_NAME = os.path.basename(MODEL.rstrip("/"))
CPU = ["--device", "cpu", "--dtype", "f32"]
MAX_CONTEXT = 256
N = 12  # new tokens per request: short, the whole file runs in a few minutes on 2 cores

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
]
CONCURRENT_PROMPTS = [
    "The tallest mountain in the world is",
    "import numpy as np\n",
    "My favourite colour is",
    "Water boils at",
    "The quick brown fox",
    "In 1969, the first person to walk on the moon was",
    "A haiku about autumn:\n",
    "SELECT name FROM users WHERE",
]
# ~40 tokens each: several times sink 4 + window 8, so the restored server really restores.
LONG_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. The result",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light energy "
    "into chemical energy, storing it in sugars built from carbon dioxide and water. In the first stage,",
]
RESTORED_FLAGS = ["--drafter", DRAFTER, "--ftheta", FTHETA, "--sink", "4", "--window", "8"]


@functools.lru_cache(maxsize=None)
def run_decode(mode, prompts, max_new, extra=()):
    """Reference answers: `kakeya decode --mode MODE --temperature 0` over a prompts file (once per
    argument set: test classes serving the same prompts share them)."""
    with tempfile.TemporaryDirectory() as d:
        pf, out = os.path.join(d, "prompts.jsonl"), os.path.join(d, "out.json")
        with open(pf, "w") as f:
            for i, p in enumerate(prompts):
                f.write(json.dumps({"id": str(i), "prompt": p}) + "\n")
        cmd = [BIN, "decode", "--mode", mode, "--verifier", MODEL, "--prompts", pf, "--max-new-tokens", str(max_new),
               "--temperature", "0", "--json", out, *CPU, *extra]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)["prompts"]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def metric(text, name, labels=None):
    """The value of one Prometheus sample (labels: dict that must all match), or None."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([a-z_]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if labels and any(got.get(k) != v for k, v in labels.items()):
            continue
        return float(m.group(3))
    return None


class Server:
    """A `kakeya serve` process on 127.0.0.1 and a free port."""

    def __init__(self, extra):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kakeya-serve-", suffix=".log", delete=False)
        cmd = [BIN, "serve", "--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--chat-template", TEMPLATE,
               "--max-context", str(MAX_CONTEXT), *CPU, *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=SRC)
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in self.proc.stdout], daemon=True).start()
        deadline = time.time() + 300
        self.port = None
        while time.time() < deadline and self.port is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            m = re.match(r"^PORT (\d+)$", line.strip())
            if m:
                self.port = int(m.group(1))
        if self.port is None:
            self.proc.kill()
            raise RuntimeError(f"kakeya serve did not start:\n{self.log_text()}")
        self.base = f"http://127.0.0.1:{self.port}/v1"
        self.client = openai.OpenAI(base_url=self.base, api_key="unused", max_retries=0, timeout=300)

    def log_text(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-6000:]

    def http(self, method, path, body=None, headers=None, timeout=120):
        """(status, parsed JSON or text) over a fresh plain HTTP connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
            conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read().decode("utf-8", "replace")
            try:
                return r.status, json.loads(data)
            except ValueError:
                return r.status, data
        finally:
            conn.close()

    def metrics(self):
        status, text = self.http("GET", "/metrics")
        assert status == 200, status
        return text

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return rc


class ServeTestBase(unittest.TestCase):
    """A server of FLAGS, and the reference answers `kakeya decode` gives for REF = (mode, prompts, flags)."""
    server = None
    REF = None
    FLAGS = []

    @classmethod
    def setUpClass(cls):
        mode, prompts, extra = cls.REF
        cls.ref = run_decode(mode, tuple(prompts), N, tuple(extra))
        cls.server = Server(cls.FLAGS)

    @classmethod
    def tearDownClass(cls):
        if cls.server:
            rc = cls.server.stop()
            log = cls.server.log_text()
            cls.server.log.close()
            os.unlink(cls.server.log.name)
            cls.server = None
            assert rc == 0, f"kakeya serve exited with {rc} on SIGTERM:\n{log}"
            assert "kakeya serve: stopped" in log, log

    def complete(self, prompt, max_tokens=N, **kw):
        return self.server.client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=kw.pop("temperature", 0), **kw)

    def stream_text(self, **kw):
        """Concatenated streamed text and the finish_reason of the last chunk."""
        chat = "messages" in kw
        create = self.server.client.chat.completions.create if chat else self.server.client.completions.create
        text, finish = "", None
        for chunk in create(model=MODEL_NAME, stream=True, **kw):
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            piece = (c.delta.content if chat else c.text) or ""
            self.assertIsNone(finish, "a chunk after the one with finish_reason")
            text += piece
            finish = c.finish_reason
        return text, finish

    def assert_error(self, status, body, want_status, param=None, code=None):
        self.assertEqual(status, want_status, body)
        self.assertIsInstance(body, dict, body)
        err = body.get("error")
        self.assertIsInstance(err, dict, body)
        self.assertIsInstance(err.get("message"), str)
        self.assertTrue(err["message"])
        self.assertIn("type", err)
        self.assertIn("code", err)
        self.assertIn("param", err)
        if param is not None:
            self.assertEqual(err["param"], param, body)
            self.assertIn(param.split("[")[0], err["message"], body)
        if code is not None:
            self.assertEqual(err["code"], code, body)
        return err


class ArServerTest(ServeTestBase):
    REF = ("ar", PROMPTS, ())
    FLAGS = ["--mode", "ar", "--max-queue", "16", "--max-body-bytes", "65536"]

    def test_health_and_models(self):
        status, body = self.server.http("GET", "/health")
        self.assertEqual(status, 200)
        self.assertEqual(body["status"], "ok")
        models = self.server.client.models.list()
        self.assertEqual([m.id for m in models.data], [MODEL_NAME])
        self.assertEqual(self.server.client.models.retrieve(MODEL_NAME).id, MODEL_NAME)

    def test_completions_match_decode(self):
        for prompt, ref in zip(PROMPTS, self.ref):
            r = self.complete(prompt)
            self.assertEqual(r.object, "text_completion")
            self.assertEqual(r.model, MODEL_NAME)
            self.assertTrue(r.id)
            self.assertIsInstance(r.created, int)
            self.assertEqual(r.choices[0].text, ref["text"], f"prompt {prompt!r}")
            self.assertEqual(r.usage.prompt_tokens, len(ref["prompt_ids"]))
            self.assertEqual(r.usage.completion_tokens, len(ref["generated_ids"]))
            self.assertEqual(r.usage.total_tokens, len(ref["prompt_ids"]) + len(ref["generated_ids"]))
            self.assertEqual(r.choices[0].finish_reason, "length" if len(ref["generated_ids"]) == N else "stop")
        # A prompt given as token ids is used as is.
        r = self.complete(self.ref[0]["prompt_ids"])
        self.assertEqual(r.choices[0].text, self.ref[0]["text"])

    def test_streaming_equals_non_streamed(self):
        for prompt, ref in zip(PROMPTS[:2], self.ref):
            text, finish = self.stream_text(prompt=prompt, max_tokens=N, temperature=0)
            self.assertEqual(text, ref["text"])
            self.assertIn(finish, ("stop", "length"))
        msgs = [{"role": "user", "content": "Name three primary colours."}]
        full = self.server.client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=N, temperature=0)
        text, finish = self.stream_text(messages=msgs, max_tokens=N, temperature=0)
        self.assertEqual(text, full.choices[0].message.content)
        self.assertEqual(finish, full.choices[0].finish_reason)
        # stream_options.include_usage: a last chunk with the usage and no choices.
        usage = None
        for chunk in self.server.client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=N,
                                                           temperature=0, stream=True,
                                                           stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
        self.assertIsNotNone(usage)
        self.assertEqual(usage.completion_tokens, len(self.ref[0]["generated_ids"]))

    def test_chat_completions(self):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(MODEL, "tokenizer.json"))
        content = "What is the capital of Italy?"
        r = self.server.client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=N,
                                                       messages=[{"role": "user", "content": content}])
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertIsInstance(r.choices[0].message.content, str)
        # The prompt is the template's (checkpoints/chat_templates/gemma.jinja), which writes <bos>
        # itself: tokenized without adding a second BOS.
        rendered = f"<bos><start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n"
        ids = tok.encode(rendered, add_special_tokens=False).ids
        self.assertEqual(ids[0], 2)
        self.assertNotEqual(ids[1], 2)
        self.assertEqual(r.usage.prompt_tokens, len(ids))
        # The same tokens through /v1/completions: same text (chat also stops at <end_of_turn>).
        c = self.complete(ids)
        if r.choices[0].finish_reason == "length":
            self.assertEqual(r.choices[0].message.content, c.choices[0].text)
        else:
            self.assertTrue(c.choices[0].text.startswith(r.choices[0].message.content))
        # Content as a list of text parts.
        r2 = self.server.client.chat.completions.create(
            model=MODEL_NAME, temperature=0, max_tokens=N,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                                   {"type": "text", "text": "of Italy?"}]}])
        self.assertEqual(r2.choices[0].message.content, r.choices[0].message.content)
        # The template's own refusal (system role) is a 400 naming messages.
        status, body = self.server.http("POST", "/v1/chat/completions",
                                        {"model": MODEL_NAME, "messages": [{"role": "system", "content": "x"}]})
        self.assert_error(status, body, 400, param="messages")

    def test_stop_strings(self):
        full = self.ref[2]["text"]  # "Once upon a time ..." continuation
        k = next(i for i in range(3, len(full) - 3) if full.find(full[i:i + 3]) == i and full[i:i + 3].strip())
        stop = full[k:k + 3]
        r = self.complete(PROMPTS[2], stop=stop)
        self.assertEqual(r.choices[0].text, full[:k])
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertLess(r.usage.completion_tokens, N + 1)
        text, finish = self.stream_text(prompt=PROMPTS[2], max_tokens=N, temperature=0, stop=[stop, "\u2603never"])
        self.assertEqual(text, full[:k])
        self.assertEqual(finish, "stop")
        r = self.complete(PROMPTS[2], stop=["\u2603never", "zzzzqq"])
        self.assertEqual(r.choices[0].text, full)

    def test_concurrent_clients(self):
        sequential = [self.complete(p, max_tokens=6).choices[0].text for p in CONCURRENT_PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT_PROMPTS)) as ex:
            futures = [ex.submit(self.complete, p, 6) for p in CONCURRENT_PROMPTS]
            concurrent_answers = [f.result().choices[0].text for f in futures]
        self.assertEqual(concurrent_answers, sequential)

    def test_seeded_sampling(self):
        kw = dict(temperature=0.9, top_p=0.95)
        a = self.complete(PROMPTS[0], seed=1234, **kw).choices[0].text
        b = self.complete(PROMPTS[0], seed=1234, **kw).choices[0].text
        self.assertEqual(a, b)
        others = {self.complete(PROMPTS[0], seed=s, **kw).choices[0].text for s in (1, 2)}
        self.assertGreater(len(others | {a}), 1, "different seeds gave the same text every time")
        # Greedy answers are unaffected by the sampling session next to them.
        self.assertEqual(self.complete(PROMPTS[0]).choices[0].text, self.ref[0]["text"])
        m = self.server.metrics()
        self.assertGreaterEqual(metric(m, "kakeya_sessions"), 2)
        self.assertGreater(metric(m, "kakeya_kv_bytes", {"session": "greedy"}), 0)

    def test_multi_turn(self):
        before = metric(self.server.metrics(), "kakeya_session_reuses_total")
        # Completions: the next prompt is the previous prompt + its answer + more text.
        p1 = "Q: What is the largest planet?\nA:"
        a1 = self.complete(p1).choices[0].text
        p2 = p1 + a1 + "\nQ: And the smallest?\nA:"
        a2 = self.complete(p2).choices[0].text
        self.complete("An unrelated prompt resets the session.", max_tokens=2)
        self.assertEqual(self.complete(p2).choices[0].text, a2)
        # Chat: a second user turn after the assistant's answer.
        msgs = [{"role": "user", "content": "Tell me a fact about cats."}]
        r1 = self.server.client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=N, temperature=0)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "And one about dogs?"}]
        r2 = self.server.client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=N, temperature=0)
        self.complete("Another unrelated prompt.", max_tokens=2)
        fresh = self.server.client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=N, temperature=0)
        self.assertEqual(r2.choices[0].message.content, fresh.choices[0].message.content)
        self.assertEqual(r2.usage.prompt_tokens, fresh.usage.prompt_tokens)
        after = metric(self.server.metrics(), "kakeya_session_reuses_total")
        print(f"\n[test_serve] session reuses in the multi-turn checks: {after - before:.0f}", file=sys.stderr)
        self.assertGreaterEqual(after - before, 1, "no turn extended the previous conversation's session")

    def test_client_disconnect_stops_generation(self):
        before = metric(self.server.metrics(), "kakeya_requests_cancelled_total")
        stream = self.server.client.completions.create(model=MODEL_NAME, prompt="Count: 1, 2, 3,", max_tokens=200,
                                                       temperature=0, stream=True)
        got = 0
        for chunk in stream:
            got += 1
            if got == 2:
                break
        stream.close()
        deadline = time.time() + 30
        while time.time() < deadline:
            m = self.server.metrics()
            if metric(m, "kakeya_requests_cancelled_total") > before and metric(m, "kakeya_busy") == 0:
                break
            time.sleep(0.2)
        m = self.server.metrics()
        self.assertGreater(metric(m, "kakeya_requests_cancelled_total"), before, "the generation did not stop")
        self.assertLess(metric(m, "kakeya_last_request_generated_tokens"), 200)

    def test_bad_input(self):
        s = self.server
        post = lambda body, path="/v1/completions": s.http("POST", path, body)
        ok = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
        status, body = post("{not json")
        err = self.assert_error(status, body, 400)
        self.assertEqual(err["type"], "invalid_request_error")
        self.assertIn("JSON", err["message"])
        self.assert_error(*post("[1, 2]"), 400)
        self.assert_error(*post({"model": MODEL_NAME, "max_tokens": 2}), 400, param="prompt")
        self.assert_error(*post({**ok, "prompt": 5}), 400, param="prompt")
        self.assert_error(*post({**ok, "max_tokens": "16"}), 400, param="max_tokens")
        self.assert_error(*post({**ok, "max_tokens": -3}), 400, param="max_tokens")
        self.assert_error(*post({**ok, "max_tokens": 0}), 400, param="max_tokens")
        self.assert_error(*post({**ok, "temperature": 3.5}), 400, param="temperature")
        self.assert_error(*post({**ok, "temperature": "hot"}), 400, param="temperature")
        self.assert_error(*post({**ok, "top_p": 0}), 400, param="top_p")
        self.assert_error(*post({**ok, "stop": 7}), 400, param="stop")
        self.assert_error(*post({**ok, "stream": "yes"}), 400, param="stream")
        self.assert_error(*post({**ok, "n": 2}), 400, param="n")
        self.assert_error(*post({**ok, "model": "gpt-4"}), 404, param="model", code="model_not_found")
        self.assert_error(*post({**ok, "prompt": "word " * 400}), 400, param="prompt", code="context_length_exceeded")
        self.assert_error(*post({**ok, "max_tokens": MAX_CONTEXT}), 400, param="max_tokens",
                          code="context_length_exceeded")
        self.assert_error(*post({**ok, "prompt": [1, -5]}), 400, param="prompt")
        chat = "/v1/chat/completions"
        self.assert_error(*post({"model": MODEL_NAME, "messages": "hi"}, chat), 400, param="messages")
        self.assert_error(*post({"model": MODEL_NAME, "messages": []}, chat), 400, param="messages")
        self.assert_error(*post({"model": MODEL_NAME, "messages": [{"content": "hi"}]}, chat), 400,
                          param="messages[0].role")
        # Through the openai client: its typed errors.
        with self.assertRaises(openai.NotFoundError):
            s.client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        with self.assertRaises(openai.BadRequestError):
            s.client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=-1)
        # Oversized body (--max-body-bytes 65536): 413 with an error body.
        status, body = post({**ok, "prompt": "a" * 100000})
        self.assert_error(status, body, 413)
        # Unknown endpoint.
        self.assert_error(*s.http("GET", "/v1/nothing"), 404)
        # Still serving.
        status, body = post(ok)
        self.assertEqual(status, 200, body)
        m = s.metrics()
        self.assertGreaterEqual(metric(m, "kakeya_requests_total", {"endpoint": "/v1/completions", "status": "400"}), 10)
        self.assertGreaterEqual(metric(m, "kakeya_requests_total", {"endpoint": "/v1/completions", "status": "404"}), 1)
        self.assertGreaterEqual(metric(m, "kakeya_requests_total", {"endpoint": "/v1/completions", "status": "413"}), 1)

    def test_metrics(self):
        self.complete(PROMPTS[0], max_tokens=4)
        m = self.server.metrics()
        self.assertGreaterEqual(metric(m, "kakeya_requests_total", {"endpoint": "/v1/completions", "status": "200"}), 1)
        self.assertGreater(metric(m, "kakeya_generated_tokens_total"), 0)
        self.assertGreater(metric(m, "kakeya_last_request_tokens_per_second"), 0)
        self.assertEqual(metric(m, "kakeya_queue_depth"), 0)
        self.assertEqual(metric(m, "kakeya_queue_capacity"), 16)
        self.assertGreaterEqual(metric(m, "kakeya_sessions"), 1)
        self.assertGreater(metric(m, "kakeya_kv_bytes", {"session": "greedy"}), 0)
        self.assertIn("# TYPE kakeya_requests_total counter", m)

    def test_zz_half_open_connections(self):
        # Runs last in this class (unittest sorts by name): it measures memory after the others.
        s = self.server
        self.complete(PROMPTS[0], max_tokens=2)
        time.sleep(1)
        before = rss_kib(s.proc.pid)
        socks = []
        try:
            for _ in range(200):
                k = socket.create_connection(("127.0.0.1", s.port), timeout=10)
                k.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
                socks.append(k)
            t0 = time.time()
            r = self.complete(PROMPTS[0])
            took = time.time() - t0
            self.assertEqual(r.choices[0].text, self.ref[0]["text"])
            self.assertLess(took, 30, "a normal request waited behind the half-open connections")
            status, _ = s.http("GET", "/health", timeout=30)
            self.assertEqual(status, 200)
        finally:
            for k in socks:
                k.close()
        time.sleep(2)
        after = rss_kib(s.proc.pid)
        grown_mib = (after - before) / 1024
        print(f"\n[test_serve] 200 half-open connections: normal request {took:.2f}s, RSS {before / 1024:.0f} -> "
              f"{after / 1024:.0f} MiB ({grown_mib:+.1f})", file=sys.stderr)
        self.assertLess(grown_mib, 64, "RSS grew by more than 64 MiB under 200 half-open connections")
        self.assertEqual(self.complete(PROMPTS[1]).choices[0].text, self.ref[1]["text"])


class BatchedServerTest(ServeTestBase):
    """`--batch 4`: requests decode together in one batched step (continuous batching)."""
    REF = ("ar", CONCURRENT_PROMPTS, ())
    FLAGS = ["--mode", "ar", "--batch", "4", "--max-queue", "16"]

    def test_concurrent_clients_equal_decode(self):
        # 8 clients at once through 4 rows: they join and leave between steps, and each answer
        # (the same greedy tokens in f32) equals `kakeya decode` of its prompt alone.
        with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT_PROMPTS)) as ex:
            futures = [ex.submit(self.complete, p, N) for p in CONCURRENT_PROMPTS]
            answers = [f.result() for f in futures]
        for prompt, ref, r in zip(CONCURRENT_PROMPTS, self.ref, answers):
            self.assertEqual(r.choices[0].text, ref["text"], f"prompt {prompt!r}")
            self.assertEqual(r.usage.completion_tokens, len(ref["generated_ids"]))
        m = self.server.metrics()
        self.assertEqual(metric(m, "kakeya_batch_rows"), 4)
        steps, rows = metric(m, "kakeya_batch_steps_total"), metric(m, "kakeya_batch_step_rows_total")
        self.assertGreater(rows / steps, 1.5, f"{rows:.0f} rows in {steps:.0f} steps: the requests did not share steps")
        self.assertGreater(metric(m, "kakeya_kv_bytes", {"session": "batch"}), 0)
        self.assertGreater(metric(m, "kakeya_batch_step_seconds_total"), 0)
        self.assertGreater(metric(m, "kakeya_batch_join_seconds_total"), 0)

    def test_streaming_stop_and_sampling(self):
        text, finish = self.stream_text(prompt=CONCURRENT_PROMPTS[0], max_tokens=N, temperature=0)
        self.assertEqual(text, self.ref[0]["text"])
        self.assertIn(finish, ("stop", "length"))
        full = self.ref[1]["text"]
        k = next(i for i in range(3, len(full) - 3) if full.find(full[i:i + 3]) == i and full[i:i + 3].strip())
        r = self.complete(CONCURRENT_PROMPTS[1], stop=full[k:k + 3])
        self.assertEqual(r.choices[0].text, full[:k])
        self.assertEqual(r.choices[0].finish_reason, "stop")
        kw = dict(temperature=0.9, top_p=0.95, seed=77)
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            texts = list(ex.map(lambda _: self.complete(CONCURRENT_PROMPTS[2], **kw).choices[0].text, range(3)))
        self.assertEqual(len(set(texts)), 1, f"one seed, three answers side by side: {texts}")

    def test_bad_input(self):
        status, body = self.server.http("POST", "/v1/completions",
                                        {"model": MODEL_NAME, "prompt": "x " * 400, "max_tokens": 8})
        self.assert_error(status, body, 400)
        status, body = self.server.http("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1})
        self.assert_error(status, body, 400, param="max_tokens")
        self.assertEqual(self.complete(CONCURRENT_PROMPTS[3]).choices[0].text, self.ref[3]["text"])

    def test_batch_needs_ar_or_restored(self):
        r = subprocess.run([BIN, "serve", "--model", MODEL, "--port", "0", "--mode", "fused", *RESTORED_FLAGS,
                            "--batch", "4", *CPU], capture_output=True, text=True, timeout=300)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--batch 4 decodes ar or restored sequences; --mode fused serves one request at a time",
                      r.stderr)


class RestoredBatchedServerTest(ServeTestBase):
    """`--mode restored --batch 2`: restored sequences decode together, each row restoring its own
    evicted positions (sink 4 + window 8 on ~40-token prompts)."""
    REF = ("restored", LONG_PROMPTS, RESTORED_FLAGS)
    FLAGS = ["--mode", "restored", *RESTORED_FLAGS, "--batch", "2", "--max-queue", "8"]

    def test_concurrent_clients_equal_decode(self):
        # Each prompt twice, four clients at once through two rows: every answer equals
        # `kakeya decode --mode restored` of its prompt alone (greedy, f32).
        jobs = [0, 1, 1, 0]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            answers = list(ex.map(lambda i: self.complete(LONG_PROMPTS[i]), jobs))
        for i, r in zip(jobs, answers):
            self.assertGreater(self.ref[i]["restored_positions"], 0)
            self.assertEqual(r.choices[0].text, self.ref[i]["text"], f"prompt {i}")
            self.assertEqual(r.usage.completion_tokens, len(self.ref[i]["generated_ids"]))
        m = self.server.metrics()
        steps, rows = metric(m, "kakeya_batch_steps_total"), metric(m, "kakeya_batch_step_rows_total")
        self.assertGreater(rows / steps, 1.3, f"{rows:.0f} rows in {steps:.0f} steps: the requests did not share steps")


class RestoredServerTest(ServeTestBase):
    REF = ("restored", LONG_PROMPTS, RESTORED_FLAGS)
    FLAGS = ["--mode", "restored", *RESTORED_FLAGS, "--max-queue", "2"]

    def test_completions_match_decode(self):
        for prompt, ref in zip(LONG_PROMPTS, self.ref):
            self.assertGreater(len(ref["prompt_ids"]), 2 * (4 + 8), "the prompt should leave the window")
            self.assertGreater(ref["restored_positions"], 0)
            r = self.complete(prompt)
            self.assertEqual(r.choices[0].text, ref["text"])
            self.assertEqual(r.usage.prompt_tokens, len(ref["prompt_ids"]))
            self.assertEqual(r.usage.completion_tokens, len(ref["generated_ids"]))
            text, _ = self.stream_text(prompt=prompt, max_tokens=N, temperature=0)
            self.assertEqual(text, ref["text"])
        self.assertGreater(metric(self.server.metrics(), "kakeya_kv_bytes", {"session": "greedy"}), 0)

    def test_queue_full_answers_429(self):
        body = {"model": MODEL_NAME, "prompt": LONG_PROMPTS[0], "max_tokens": 8, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            results = list(ex.map(lambda _: self.server.http("POST", "/v1/completions", body), range(8)))
        statuses = sorted(st for st, _ in results)
        self.assertIn(200, statuses)
        self.assertIn(429, statuses, statuses)
        self.assertEqual(set(statuses), {200, 429})
        for st, b in results:
            if st == 429:
                self.assert_error(st, b, 429, code="rate_limit_exceeded")
            else:
                self.assertEqual(b["choices"][0]["text"], self.ref[0]["text"][: len(b["choices"][0]["text"])])
        self.assertGreater(metric(self.server.metrics(), "kakeya_requests_rejected_total"), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
