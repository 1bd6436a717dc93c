"""Load generator for `kakeya serve`: aggregate decode throughput under concurrent clients.

For each concurrency level N, N threads released together (a barrier) each send
--requests-per-client non-streamed /v1/completions requests (greedy, max_tokens=--new-tokens, no
stop, a distinct random-word prompt of about --prompt-tokens tokens). It measures the wall time from
the barrier to the last finish, the aggregate throughput (completion tokens actually generated /
wall s; a generation may end early at EOS), each request's latency and decode tok/s
(completion_tokens / request s), and the errors (HTTP status + message; 429/503 are counted, not
raised). The ratio to the concurrency-1 aggregate shows what batching buys. After the run the
kakeya_* series of GET /metrics are recorded (labelled ones under their name with labels). Client: the openai package when installed
(one client per thread, no retries), else plain urllib POSTs of the same JSON body.

  python tools/serve_load.py --url http://127.0.0.1:8000/v1 --model gemma3-270m --concurrency 1,4,16,64 --json out.json
"""
import argparse, json, random, sys, threading, time, urllib.error, urllib.request
from collections import Counter

try:
    import openai
except ImportError:
    openai = None

VOCAB = """the of and to in is was that for on with as by at from his her they we you this have had not but
which one all were when there can been their more will would about out many then them these some what
time people water words number way long day made part over new sound take only little work know place
year live back give most very after thing our just name good sentence man think say great where help
through much before line right too mean old any same tell boy follow came want show also around form
three small set put end does another well large must big even such because turn here why ask went men
read need land different home us move try kind hand picture again change off play spell air away animal
house point page letter mother answer found study still learn should world high every near add food
between own below country plant last school father keep tree never start city earth eye light thought
head under story saw left few while along might close something seem next hard open example begin life
always those both paper together got group often run important until children side feet car mile night
walk white sea began grow took river four carry state once book hear stop without second later miss idea
enough eat face watch far really almost let above girl sometimes mountain cut young talk soon list song
being leave family""".split()


def words_for(tokens):
    """Words of VOCAB for a prompt of about `tokens` tokens: each is one token to Gemma's tokenizer
    (measured: 394 words -> 396 tokens with BOS and the final period)."""
    return max(1, tokens - 2)


def make_prompt(seed, tag, n_words):
    rng = random.Random(f"{seed}/{tag}")  # str seeds are deterministic: the same tag gives the same prompt
    words = [rng.choice(VOCAB) for _ in range(n_words)]
    return " ".join(words).capitalize() + "."


def make_sender(args, client_kind):
    """A function prompt -> result dict; each thread makes its own (one openai client per thread)."""
    if client_kind == "openai":
        cl = openai.OpenAI(base_url=args.url, api_key="none", timeout=args.timeout_s, max_retries=0)

        def call(prompt):
            r = cl.completions.create(model=args.model, prompt=prompt, max_tokens=args.new_tokens, temperature=0, stream=False)
            u = r.usage
            return (u.prompt_tokens, u.completion_tokens) if u else (None, 0)
    else:
        def call(prompt):
            body = {"model": args.model, "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0, "stream": False}
            req = urllib.request.Request(args.url.rstrip("/") + "/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=args.timeout_s) as resp:
                u = json.loads(resp.read()).get("usage") or {}
            return u.get("prompt_tokens"), u.get("completion_tokens", 0)

    def send(prompt):
        t0 = time.perf_counter()
        try:
            pt, ct = call(prompt)
            return {"ok": True, "prompt_tokens": pt, "completion_tokens": ct or 0, "seconds": time.perf_counter() - t0}
        except Exception as e:  # an HTTP error (429, 503, ...) or a connection failure is a result, not a crash
            status = getattr(e, "status_code", None) or getattr(e, "code", None)
            msg = getattr(e, "message", None) or str(e)
            if isinstance(e, urllib.error.HTTPError):
                try:
                    msg = json.loads(e.read())["error"]["message"]
                except Exception:
                    pass
            return {"ok": False, "status": status, "error": f"{type(e).__name__}: {msg}"[:300],
                    "seconds": time.perf_counter() - t0}
    return send


def run_level(args, n, client_kind):
    n_words = words_for(args.prompt_tokens)
    results, finishes, lock = [], [], threading.Lock()
    barrier = threading.Barrier(n + 1)

    def worker(i):
        prompts = [make_prompt(args.seed, f"c{n}-{i}-{r}", n_words) for r in range(args.requests_per_client)]
        try:
            send = make_sender(args, client_kind)
        finally:
            barrier.wait()
        for p in prompts:
            res = send(p)
            with lock:
                results.append(res)
        with lock:
            finishes.append(time.perf_counter())

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    deadline = t0 + args.timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    with lock:  # a snapshot: threads still running after a timeout append to the old lists
        timed_out = len(finishes) < n
        res, wall = list(results), (time.perf_counter() if timed_out else max(finishes)) - t0
    ok = [r for r in res if r["ok"]]
    tokens = sum(r["completion_tokens"] for r in ok)
    pts = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]
    errs = Counter(f"{r['status'] or 'no status'}: {r['error']}" for r in res if not r["ok"])
    return {"concurrency": n, "requests": n * args.requests_per_client, "completed": len(ok), "timed_out": timed_out,
            "unfinished": n * args.requests_per_client - len(res),
            "completion_tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall if wall > 0 else 0.0,
            "mean_latency_s": sum(r["seconds"] for r in ok) / len(ok) if ok else None,
            "max_latency_s": max((r["seconds"] for r in ok), default=None),
            "mean_decode_tok_s": sum(r["completion_tokens"] / r["seconds"] for r in ok) / len(ok) if ok else None,
            "mean_prompt_tokens": sum(pts) / len(pts) if pts else None,
            "errors": len(res) - len(ok), "error_counts": dict(errs)}


def fetch_metrics(url):
    base = url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    out = {}
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            parts = line.split()
            if line.startswith("kakeya_") and len(parts) == 2:  # labelled series keep their labels in the key
                try:
                    out[parts[0]] = float(parts[1])
                except ValueError:
                    pass
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="base URL of the API, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True, help="model name to put in the requests")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels (default 1,4,16,64)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="approximate prompt length in tokens")
    ap.add_argument("--new-tokens", type=int, default=256, help="max_tokens of each request")
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=300, help="bound on each concurrency level (and each request)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts' words")
    ap.add_argument("--client", choices=["auto", "openai", "urllib"], default="auto")
    a = ap.parse_args(argv)
    if not a.url.startswith(("http://", "https://")):
        ap.error(f"--url must start with http:// or https://, got {a.url!r}")
    try:
        a.levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--concurrency must be comma-separated integers, got {a.concurrency!r}")
    if not a.levels:
        ap.error("--concurrency names no level")
    if any(x <= 0 for x in a.levels):
        ap.error(f"--concurrency levels must be positive, got {a.concurrency!r}")
    for name in ["prompt_tokens", "new_tokens", "requests_per_client", "timeout_s"]:
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.client == "openai" and openai is None:
        ap.error("--client openai: the openai package is not installed")
    return a


def main(argv):
    args = parse_args(argv)
    client_kind = "openai" if args.client == "auto" and openai is not None else ("urllib" if args.client == "auto" else args.client)
    print(f"client {client_kind}; warm-up request ...", flush=True)
    warm = make_sender(args, client_kind)(make_prompt(args.seed, "warmup", words_for(args.prompt_tokens)))
    print(f"warm-up: {'ok' if warm['ok'] else warm['error']} in {warm['seconds']:.2f} s", flush=True)
    levels = []
    for n in args.levels:
        levels.append(run_level(args, n, client_kind))
    base = next((l["aggregate_tok_s"] for l in levels if l["concurrency"] == 1), None)
    ratio = {str(l["concurrency"]): l["aggregate_tok_s"] / base for l in levels} if base else {}
    print(f"{'conc':>5} {'reqs':>5} {'tokens':>7} {'wall s':>8} {'agg tok/s':>10} {'vs 1':>6} {'lat s':>7} {'dec tok/s':>9} {'errors':>6}")
    for l in levels:
        f = lambda v, spec: format(v, spec) if v is not None else "-"
        print(f"{l['concurrency']:>5} {l['requests']:>5} {l['completion_tokens']:>7} {l['wall_s']:>8.2f} {l['aggregate_tok_s']:>10.1f} "
              f"{f(ratio.get(str(l['concurrency'])), '6.2f'):>6} {f(l['mean_latency_s'], '7.2f'):>7} {f(l['mean_decode_tok_s'], '9.1f'):>9} "
              f"{l['errors']:>6}{'  TIMED OUT' if l['timed_out'] else ''}")
        for msg, c in l["error_counts"].items():
            print(f"      {c} x {msg}")
    out = {"command": " ".join([sys.executable] + sys.argv), "url": args.url, "model": args.model, "client": client_kind,
           "prompt_tokens_target": args.prompt_tokens, "new_tokens": args.new_tokens, "requests_per_client": args.requests_per_client,
           "timeout_s": args.timeout_s, "seed": args.seed, "warmup": warm, "levels": levels, "ratio_vs_1": ratio}
    try:
        out["metrics"] = fetch_metrics(args.url)
    except Exception as e:
        out["metrics"], out["metrics_error"] = {}, f"{type(e).__name__}: {e}"
        print(f"metrics: {out['metrics_error']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0 if warm["ok"] and not any(l["timed_out"] for l in levels) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
