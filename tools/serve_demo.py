#!/usr/bin/env python3
"""`make demo`'s serving job: starts `kakeya serve` (the flags after `--`) on a free loopback
port, asks it for one completion, one streamed chat answer and a second chat turn through the
`openai` client (when the second turn's tokens extend the first conversation the server reuses
the session's cache: /metrics counts it), prints them and the server's /metrics, and stops it.

Usage: serve_demo.py --kakeya build/kakeya -- [serve flags...]
"""
import argparse, subprocess, sys, time, urllib.request

import openai


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kakeya", default="build/kakeya")
    ap.add_argument("serve", nargs=argparse.REMAINDER, help="-- then the flags of kakeya serve")
    a = ap.parse_args()
    flags = a.serve[1:] if a.serve[:1] == ["--"] else a.serve
    srv = subprocess.Popen([a.kakeya, "serve", "--port", "0", *flags], stdout=subprocess.PIPE, text=True)
    try:
        port = None
        for line in srv.stdout:  # the server prints "PORT <n>" once it listens
            if line.startswith("PORT "):
                port = int(line.split()[1])
                break
        if port is None:
            sys.exit(f"serve_demo: the server exited with {srv.wait()} before listening")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
        model = client.models.list().data[0].id
        t0 = time.time()
        c = client.completions.create(model=model, prompt="The three primary colours are", max_tokens=24, temperature=0)
        print(f"completion ({time.time() - t0:.1f}s, {c.usage.completion_tokens} tokens): {c.choices[0].text!r}")
        messages = [{"role": "user", "content": "Name one planet of the solar system."}]
        print("chat (streamed): ", end="", flush=True)
        answer = ""
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                                    stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                answer += chunk.choices[0].delta.content
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And another one?"}]
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
        print(f"chat, second turn: {r.choices[0].message.content!r}")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        print("\n".join(l for l in metrics.splitlines() if l.startswith("kakeya_") and "bucket" not in l))
    finally:
        srv.terminate()
        srv.wait(timeout=60)


if __name__ == "__main__":
    main()
