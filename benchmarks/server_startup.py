"""Seconds from `python server.py` to its port accepting connections, and to the first
completion it answers: cold (an empty persistent compilation cache) and then warm (the
same cache again), a few times each.

    python benchmarks/server_startup.py [--repeats 3] [-- extra server options]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def first_completion(port: int) -> None:
    body = json.dumps({"model": "x", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=300).read()


def start_once(cache_dir: str, extra: list[str], timeout: float = 600) -> tuple[float, float]:
    """(seconds to the open port, seconds to the first completion) of one server start."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "server.py"), "--port", str(port), "--compilation-cache-dir", cache_dir,
           "--served-model-name", "x", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not port_open(port):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode}")
            if time.perf_counter() - start > timeout:
                raise TimeoutError("the port did not open")
            time.sleep(0.05)
        opened = time.perf_counter() - start
        first_completion(port)
        return opened, time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache_dir:
            for kind in ("cold", "warm"):
                opened, answered = start_once(cache_dir, extra)
                print(f"run {repeat}: {kind}: port open after {opened:.1f} s, first completion after {answered:.1f} s",
                      flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} (2 cores are shared)")


if __name__ == "__main__":
    main()
