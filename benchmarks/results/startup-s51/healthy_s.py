"""Seconds from `llmserve serve` to a healthy /health, and to the first answer: start-up as a user meets it; and
the server's resident memory then (VmRSS) and at its peak so far (VmHWM), from /proc (session 52).

Usage: healthy_s.py LABEL [--model M] [--rounds 1] [extra serve flags after --]
Run from the checkout to measure (PYTHONPATH picks the build); the server is stopped after each round.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resident_gb(pid: int) -> str:
    """VmRSS and VmHWM of a process, GB ("?" where /proc has none)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return "?"
    return "rss {:.2f} GB, peak {:.2f} GB".format(*(int(fields[k].split()[0]) / 1e6 for k in ("VmRSS", "VmHWM")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("label")
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=1)
    args, extra = parser.parse_known_args()
    for _ in range(args.rounds):
        port = free_port()
        cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--port", str(port)]
        cmd += ["--model", args.model] if args.model else []
        start = time.perf_counter()
        proc = subprocess.Popen(cmd + [a for a in extra if a != "--"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=os.environ)
        try:
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited with {proc.returncode}")
                time.sleep(0.05)
            healthy = time.perf_counter() - start
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                model = json.load(r)["data"][0]["id"]
            body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
            answered = time.perf_counter() - start
            memory = resident_gb(proc.pid)
        finally:
            proc.terminate()
            proc.wait()
        print(f"{args.label} {args.model or 'default'}: healthy {healthy:.1f} s, first answer {answered:.1f} s, "
              f"{memory}", flush=True)


if __name__ == "__main__":
    main()
