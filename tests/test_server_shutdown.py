"""A real `python server.py` process: it serves while its shapes compile in the
background, connections that never send a whole request are closed, a non-streaming
client that disconnects is aborted without tracebacks, and SIGTERM drains: running
requests finish within --shutdown-timeout, every other stream (running or queued) ends
with finish_reason "abort" and [DONE] or gets a 503 before its first byte, no
connection is reset, and the process exits with status 0 without waiting on a compile."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import time

import httpx
import pytest

from test_server import ServerProcess, assert_openai_error, sse_events

MODEL_ID = "stories260K-mtp"
READ_TIMEOUT = 1.0
SHUTDOWN_TIMEOUT = 1.0
LONG = dict(model=MODEL_ID, prompt="Once upon a time", max_tokens=480, ignore_eos=True, temperature=0)
PROMPT_TOKENS = 5  # LONG's prompt: BOS and four tokens
# Each engine step of the module's server takes at least this long, so that how far a
# request gets is bounded whatever the machine's speed: a step emits at most k + 1 = 3
# tokens, so LONG's 480 need at least 160 steps, 4.8 s, which its first token, the
# queued requests' arrival and the drain's SHUTDOWN_TIMEOUT do not reach.
STEP_SECONDS = 0.03
SLOW_STEPS = ("-c", f"""
import runpy, sys, time
from jaxmtp.engine.llm_engine import LLMEngine
step = LLMEngine.step
def slow_step(self):
    time.sleep({STEP_SECONDS})
    return step(self)
LLMEngine.step = slow_step
sys.argv = ["server.py", *sys.argv[1:]]
runpy.run_path("server.py", run_name="__main__")
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Tiny engine shapes, so that warm-up is quick, and steps of STEP_SECONDS. Not
    stopped by the fixture: the last test of the module sends it SIGTERM."""
    process = ServerProcess(
        tmp_path_factory.mktemp("shutdown") / "server.log",
        "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--compilation-cache-dir", "",
        "--read-timeout", str(READ_TIMEOUT), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), program=SLOW_STEPS,
    )
    try:
        yield process.wait_ready()
    finally:
        if process.proc.poll() is None:
            process.stop()


def test_the_port_opens_before_the_shapes_compile_and_a_bar_counts_them(server):
    """Eight shapes of each kind (8 or 16 rows, 1 or 2 requests, greedy or not): plain,
    with prompt logprobs, constrained, and constrained with prompt logprobs; the largest
    plain one compiles first, the port opens, the other 31 compile in the background."""
    log = server.log_path.read_text()
    assert "serving on the step's largest batch shape while 31 more compile in the background" in log, log[-3000:]
    assert "compiling the step:" in log and "/31 [" in log
    reply = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_connections_that_send_no_whole_request_are_closed(server):
    """Slow-loris: idle connections, half-sent headers, and a body that never ends."""
    sockets = []
    for i in range(30):
        sock = socket.create_connection(("127.0.0.1", server.port))
        if i % 3 == 1:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        if i % 3 == 2:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        sockets.append(sock)
    for sock in sockets:
        sock.settimeout(READ_TIMEOUT + 4)
        with sock:
            while sock.recv(4096):  # b"" once the server closes it; a socket left open times out
                pass
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_client_that_leaves_before_its_response_is_aborted_cleanly(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=0.5)
    # (the server compiles its shapes in the background meanwhile, on a CPU the suite's
    # other worker shares: an abort has taken over 5 s there, so the bound is generous)
    assert server.wait_for_metric("jaxmtp_kv_pages_used", 0, timeout=30) == 0
    log = server.log_path.read_text()
    assert "Traceback" not in log and "InvalidStateError" not in log, log[-3000:]


def stream_outcome(url: str, body: dict) -> tuple:
    """How one stream ended: ("done", each choice's finish_reason) when its events end
    with [DONE]; ("503",) for a 503 with an OpenAI error body, before any byte of a
    stream; ("refused",) when the connection was refused (the server had stopped
    listening). Anything else (a reset, a stream without [DONE]) raises."""
    try:
        with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as reply:
            if reply.status_code == 503:
                reply.read()
                assert assert_openai_error(reply, 503)["code"] == "server_shutting_down"
                return ("503",)
            assert reply.status_code == 200, reply.status_code
            events = list(sse_events(reply))
    except httpx.ConnectError:
        return ("refused",)
    assert events and events[-1] == "[DONE]", events[-3:]
    return ("done", [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]])


def assert_drained(server, outcomes) -> None:
    """Every stream ended with [DONE] (finish_reason "length", or "abort" for the ones
    the drain interrupted) or got a 503 or a refused connection; the process exits with
    status 0, also while a shape compiles in the background (the compile is abandoned:
    one that never ends would hold the wait past its limit). How soon after the drain
    it exits: benchmarks/shutdown.py."""
    for outcome in outcomes:
        assert outcome[0] in ("503", "refused") or outcome[1] in (["length"], ["abort"]), outcome
    assert server.proc.wait(30) == 0
    log = server.log_path.read_text()
    assert "Traceback" not in log and "draining" in log, log[-3000:]


def test_sigterm_drains_then_exits(server):
    """Mid-decode, with more streams than --max-num-seqs: two run, eight wait."""
    short = {**LONG, "max_tokens": 30, "stream": True}
    with httpx.Client(timeout=60) as http, concurrent.futures.ThreadPoolExecutor(9) as pool:
        with http.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as long_stream, \
                http.stream("POST", server.url + "/v1/completions", json=short) as short_stream:
            long_events, short_events = sse_events(long_stream), sse_events(short_stream)
            first_long, _ = next(long_events), next(short_events)  # both are running
            # the others wait (two sequences at most): SIGTERM once the engine holds all
            # nine (their prompts counted), whether or not the short one has finished
            admitted = server.metric("jaxmtp_prompt_tokens_total")
            waiting = pool.submit(httpx.post, server.url + "/v1/completions", json=LONG, timeout=60)
            streams = [pool.submit(stream_outcome, server.url, short) for _ in range(8)]
            deadline = time.monotonic() + 30
            while server.metric("jaxmtp_prompt_tokens_total") < admitted + 9 * PROMPT_TOKENS:
                assert time.monotonic() < deadline, "the nine requests never reached the engine"
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            short_rest = list(short_events)
            long_rest = list(long_events)
        interrupted = waiting.result()
        outcomes = [stream.result() for stream in streams]
    # the short stream finished within --shutdown-timeout
    assert short_rest[-1] == "[DONE]"
    assert json.loads(short_rest[-2])["choices"][0]["finish_reason"] == "length"
    # the long one was ended: finish_reason "abort", then [DONE]
    assert long_rest[-1] == "[DONE]"
    assert json.loads(long_rest[-2])["choices"][0]["finish_reason"] == "abort"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in [first_long, *long_rest[:-1]])
    assert text.startswith(", there was a little girl")
    # the one without streaming got a proper error body
    assert assert_openai_error(interrupted, 503)["code"] == "server_shutting_down"
    assert all(outcome[0] == "done" for outcome in outcomes), outcomes  # queued streams end too
    assert_drained(server, outcomes)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")


# server.py, where the background compilation never ends, as one can take minutes on a GPU
STUCK_COMPILE = ("-c", """
import runpy, sys, threading
from jaxmtp.worker.programs import StepPrograms
compile_each = StepPrograms._compile_each
def never_ending(self, shapes, num_threads, background):
    if background:
        threading.Event().wait()
    compile_each(self, shapes, num_threads, background)
StepPrograms._compile_each = never_ending
sys.argv = ["server.py", *sys.argv[1:]]
runpy.run_path("server.py", run_name="__main__")
""")


@pytest.mark.parametrize("moment", ["connecting", "prefill"])
def test_sigterm_at_any_moment_ends_every_stream(tmp_path, moment):
    """Sixteen streams against two sequences at most, SIGTERM as the clients connect
    (the listening socket must not reset connections the event loop has not accepted
    yet) or while the first prompts prefill (long prompts, chunks of 16 tokens), with a
    background compilation that never ends: the process exits all the same."""
    server = ServerProcess(
        tmp_path / "server.log", "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--compilation-cache-dir",
        "", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), program=STUCK_COMPILE,
    )
    try:
        server.wait_ready()
        body = {**LONG, "prompt": "Once upon a time " * 60, "max_tokens": 8, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            streams = [pool.submit(stream_outcome, server.url, body) for _ in range(16)]
            deadline = time.monotonic() + 20
            while moment == "prefill" and server.metric("jaxmtp_requests_running") < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            server.proc.send_signal(signal.SIGTERM)
            outcomes = [stream.result() for stream in streams]
        assert_drained(server, outcomes)
        assert "abandoning the shape being compiled" in server.log_path.read_text()
    finally:
        if server.proc.poll() is None:
            server.stop()
