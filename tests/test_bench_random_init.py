#!/usr/bin/env python3
"""`kakeya bench decode --random-init` end to end (CTest label `unit`, CPU f32): the tiny Gemma 4
MoE config of the model_parity fixtures, random weights drawn by kakeya and, in the HF peer
(tools/hf_bench.py), the same weights drawn by tools/random_weights.py; in f32 the greedy tokens
of the two agree on every step (the bench's own comparison). Bad input: --random-init with
--restored, a missing config, a config of an unknown family, a shape too large for the host's
memory, a negative seed -> clear errors.
Environment (set by tests/CMakeLists.txt): KAKEYA_BIN, KAKEYA_FIXTURES, KAKEYA_PYTHON."""
import json, os, subprocess, sys, tempfile

BIN = os.environ["KAKEYA_BIN"]
CFG = os.path.join(os.environ["KAKEYA_FIXTURES"], "model_parity", "gemma4_moe_random", "config.json")
PY = os.environ["KAKEYA_PYTHON"]


def run(*args):
    return subprocess.run([BIN, "bench", "decode", *args], capture_output=True, text=True, timeout=600)


def main():
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        r = run("--random-init", CFG, "--seed", "5", "--prompt-len", "24", "--new-tokens", "12", "--repeats", "1",
                "--python", PY, "--json", out)
        assert r.returncode == 0, r.stdout + r.stderr
        j = json.load(open(out))
        assert j["greedy_tokens_agreeing_with_hf"] == 12, j
        assert j["seed"] == 5 and j["model"].startswith("random weights of"), j
        assert j["hf"]["static_decode_tps"] > 0 and j["kakeya_decode_tps"] > 0, j
        assert 0 < j["active_weight_bytes_per_token"] < j["weight_bytes"], j  # 2 of 6 experts read
        assert "agree on the first 12 of 12" in r.stdout, r.stdout
        # The memory plans of the same shape, bytes only (no weights): every config, the native cache.
        mem = os.path.join(d, "mem.json")
        r = subprocess.run([BIN, "bench", "memory", "--random-init", CFG, "--drafter", "random", "--ftheta", "random",
                            "--configs", "oracle,evict:8,restored:8,restored-int4:8", "--context", "40",
                            "--budget-mb", "1", "--json", mem], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        m = json.load(open(mem))
        assert [c["config"] for c in m["configs"]] == ["oracle", "evict:8", "restored:8", "restored-int4:8"], m
        oracle = m["configs"][0]
        assert oracle["kv_bytes_at_context"] == m["native_kv_bytes_at_context"] > 0, m
        assert m["configs"][3]["kv_bytes_at_context"] < m["configs"][2]["kv_bytes_at_context"], m  # int4 region
        r = subprocess.run([BIN, "bench", "memory", "--random-init", CFG, "--speed"], capture_output=True, text=True)
        assert r.returncode != 0 and "bytes only" in r.stderr, r.stderr
        # Bad input.
        r = run("--random-init", CFG, "--restored")
        assert r.returncode != 0 and "--random-init: times AR" in r.stderr, r.stderr
        # A shape too large for the host: refused before its first tensor is drawn, naming it.
        huge = os.path.join(d, "huge.json")
        cfg = json.load(open(CFG))
        cfg["vocab_size"] = 1 << 40
        json.dump(cfg, open(huge, "w"))
        r = run("--random-init", huge, "--no-peer")
        assert r.returncode != 0 and "too large for the CPU" in r.stderr and "embed_tokens" in r.stderr, r.stderr
        r = run("--random-init", CFG, "--seed", "-1")
        assert r.returncode != 0 and "--seed" in r.stderr, r.stderr
        r = run("--random-init", os.path.join(d, "missing.json"))
        assert r.returncode != 0 and "--random-init" in r.stderr, r.stderr
        bad = os.path.join(d, "bad.json")
        json.dump({"model_type": "not_a_model"}, open(bad, "w"))
        r = run("--random-init", bad, "--no-peer")
        assert r.returncode != 0 and "model_type" in r.stderr, r.stderr
    print("test_bench_random_init: ok")


if __name__ == "__main__":
    sys.exit(main())
