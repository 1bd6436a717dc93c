#!/usr/bin/env bash
# The session API and `kakeya serve` on the GPU machine, after the model is staged
# (tools/device/remote.sh recv … model) and build-cuda/ holds kakeya and the gpu tests:
#   1. the gpu-labelled tests (kernels, restored decoders, graphs) — behaviour unchanged
#   2. kakeya bench decode --restored at 512 and 8k (ar vs restored tok/s in one run, HF peer
#      skipped: the regression check of the decoder refactor)
#   3. kakeya serve on CUDA (bf16): greedy completions == kakeya decode text for ar and restored,
#      streamed == non-streamed, a multi-turn conversation == a fresh request with the whole prompt,
#      sequential throughput of the one decode worker
# Env: MODEL (/tmp/models/gemma3-270m), OUT ($OUT or /tmp/serve-out), B (build-cuda), DTYPE (bf16; f32: the
#      token-for-token comparisons without bf16 rounding), STEPS ("tests bench serve").
set -euo pipefail
MODEL=${MODEL:-/tmp/models/gemma3-270m}
B=${B:-build-cuda}
OUT=${OUT:-/tmp/serve-out}
mkdir -p "$OUT"
K=$B/kakeya
DTYPE=${DTYPE:-bf16}
STEPS=${STEPS:-tests bench serve}
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
if has tests; then
# The tests that read the real model find it where `make model` puts it.
mkdir -p checkpoints/models
[ -e checkpoints/models/gemma3-270m ] || ln -s "$MODEL" checkpoints/models/gemma3-270m
rc=0
(cd "$B" && ctest -L gpu --output-on-failure > "$OUT/gpu-tests.log" 2>&1) || rc=$?
echo "gpu tests exit $rc" >> "$OUT/gpu-tests.log"
tail -4 "$OUT/gpu-tests.log"
fi
if has bench; then
for n in 512 8192; do
  $K bench decode --model "$MODEL" --device cuda --prompt-len $n --new-tokens 256 --repeats 3 --no-peer --restored \
    --json "$OUT/bench-decode-$n.json" 2>&1 | tail -12 | tee "$OUT/bench-decode-$n.log"
done
fi
has serve || exit 0
python3 - "$K" "$MODEL" "$OUT" "$DTYPE" <<'PY'
import json, subprocess, sys, time, urllib.request
K, MODEL, OUT, DTYPE = sys.argv[1:5]
res = {}
prompts = ["The history of the printing press begins", "def fibonacci(n):\n    \"\"\"Return", "In 1969 the first humans"]

def decode_text(mode, prompt, n):
    j = f"{OUT}/decode-{mode}-{DTYPE}.json"
    subprocess.run([K, "decode", "--verifier", MODEL, "--device", "cuda", "--dtype", DTYPE, "--mode", mode, "--prompt", prompt,
                    "--max-new-tokens", str(n), "--temperature", "0", "--window", "16", "--json", j],
                   check=True, capture_output=True)
    return json.load(open(j))

def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()

for mode in ["ar", "restored"]:
    srv = subprocess.Popen([K, "serve", "--model", MODEL, "--device", "cuda", "--dtype", DTYPE, "--mode", mode, "--port", "0",
                            "--window", "16", "--max-context", "1024"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = None
    for line in srv.stdout:
        if line.startswith("PORT "):
            port = int(line.split()[1]); break
    r = {"same_as_decode": [], "stream_equal": [], "multi_turn_equal": None}
    for p in prompts:
        want = decode_text(mode, p, 48)
        got = json.loads(post(port, {"prompt": p, "max_tokens": 48, "temperature": 0}))
        text = got["choices"][0]["text"]
        r["same_as_decode"].append(text == want["prompts"][0]["text"])
        sse = post(port, {"prompt": p, "max_tokens": 48, "temperature": 0, "stream": True})
        parts = [json.loads(l[6:])["choices"][0]["text"] for l in sse.splitlines()
                 if l.startswith("data: {") and json.loads(l[6:])["choices"]]
        r["stream_equal"].append("".join(parts) == text)
    first = json.loads(post(port, {"prompt": prompts[0], "max_tokens": 32, "temperature": 0}))["choices"][0]["text"]
    follow = prompts[0] + first + " Later,"
    turn2 = json.loads(post(port, {"prompt": follow, "max_tokens": 32, "temperature": 0}))["choices"][0]["text"]
    srv.terminate(); srv.wait(timeout=30)
    srv2 = subprocess.Popen([K, "serve", "--model", MODEL, "--device", "cuda", "--dtype", DTYPE, "--mode", mode, "--port", "0",
                             "--window", "16", "--max-context", "1024"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in srv2.stdout:
        if line.startswith("PORT "):
            port2 = int(line.split()[1]); break
    fresh = json.loads(post(port2, {"prompt": follow, "max_tokens": 32, "temperature": 0}))["choices"][0]["text"]
    r["multi_turn_equal"] = turn2 == fresh
    t0 = time.time(); n = 0
    for i in range(8):
        n += json.loads(post(port2, {"prompt": prompts[i % 3] + f" ({i})", "max_tokens": 256, "temperature": 0,
                                     "stop": []}))["usage"]["completion_tokens"]
    r["sequential_tokens_per_second"] = n / (time.time() - t0)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port2}/metrics", timeout=10).read().decode()
    r["metrics_lines"] = [l for l in metrics.splitlines() if l and not l.startswith("#")][:12]
    srv2.terminate(); srv2.wait(timeout=30)
    res[mode] = r
    print(mode, json.dumps(r, indent=1))
json.dump(res, open(f"{OUT}/serve-check-{DTYPE}.json", "w"), indent=1)
PY
