"""SIGTERM under load: how every stream ends and how long the process takes to exit.

Starts `python server.py` (the shipped model, --max-num-seqs 4, --shutdown-timeout 3),
opens N streams at once (more than --max-num-seqs: most wait in the queue) and sends
SIGTERM at a moment: as the clients connect, once the first prompts prefill, or after
four seconds of decoding. Prints how each stream ended (finish reason and [DONE], a 503,
a refused or a reset connection) and the seconds from the signal to the exit.

    python benchmarks/shutdown.py [--moment connecting|prefill|decode] [--streams 48]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_server import ServerProcess  # noqa: E402
from test_server_shutdown import stream_outcome  # noqa: E402

SHUTDOWN_TIMEOUT = 3.0


def outcome(url: str, body: dict) -> str:
    """How one stream ended, in words: the shutdown test's stream_outcome, whose
    failures (a reset connection, a stream without [DONE]) are counted here."""
    try:
        ended = stream_outcome(url, body)
    except httpx.TransportError as err:
        return f"connection broken ({type(err).__name__})"
    except AssertionError as err:
        return f"not ended cleanly ({str(err).splitlines()[0]})"
    if ended[0] == "done":
        return f"[DONE], finish_reason {ended[1][-1] if ended[1] else None}"
    return {"503": "status 503", "refused": "connection refused"}[ended[0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moment", choices=("connecting", "prefill", "decode"), default="decode")
    parser.add_argument("--streams", type=int, default=48)
    args = parser.parse_args()
    server = ServerProcess(Path(tempfile.mkdtemp()) / "server.log", "--max-num-seqs", "4", "--max-num-batched-tokens",
                           "16", "--compilation-cache-dir", "", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
    server.wait_ready()
    body = dict(prompt="Once upon a time " * 20, max_tokens=200, ignore_eos=True, temperature=0, stream=True)
    with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
        streams = [pool.submit(outcome, server.url, body) for _ in range(args.streams)]
        deadline = time.monotonic() + 30
        if args.moment == "prefill":
            while server.metric("jaxmtp_requests_running") < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        elif args.moment == "decode":
            time.sleep(4.0)
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = server.proc.wait(120)
        exit_s = time.monotonic() - sent
        ends = collections.Counter(stream.result() for stream in streams)
    print(json.dumps({"moment": args.moment, "streams": args.streams, "shutdown_timeout_s": SHUTDOWN_TIMEOUT,
                      "exit_status": code, "exit_s_after_sigterm": round(exit_s, 2), "streams_ended": ends}, indent=1))


if __name__ == "__main__":
    main()
