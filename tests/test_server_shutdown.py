"""A real `python server.py` process: it serves while its shapes compile in the
background, connections that never send a whole request are closed, a
non-streaming client that disconnects is aborted without tracebacks, and SIGTERM drains (running requests finish within --shutdown-timeout, the rest end
cleanly) before the process exits with status 0."""

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Tiny engine shapes, so that warm-up is quick. Not stopped by the fixture: the
    last test of the module sends it SIGTERM."""
    process = ServerProcess(
        tmp_path_factory.mktemp("shutdown") / "server.log",
        "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--compilation-cache-dir", "",
        "--read-timeout", str(READ_TIMEOUT), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
    )
    try:
        yield process.wait_ready()
    finally:
        if process.proc.poll() is None:
            process.stop()


def test_the_port_opens_before_the_shapes_compile_and_a_bar_counts_them(server):
    """Eight plain shapes (8 or 16 rows, 1 or 2 requests, greedy or not), eight with
    prompt logprobs, four constrained and four constrained with prompt logprobs (those
    always sample): the largest plain one compiles first, the port opens, the other 23
    compile in the background."""
    log = server.log_path.read_text()
    assert "serving on the step's largest batch shape while 23 more compile in the background" in log, log[-3000:]
    assert "compiling the step:" in log and "/23 [" in log
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
    start = time.monotonic()
    for sock in sockets:
        sock.settimeout(READ_TIMEOUT + 4)
        with sock:
            while sock.recv(4096):  # b"" once the server closes it; a timeout fails the test
                pass
    assert time.monotonic() - start < READ_TIMEOUT + 4
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_client_that_leaves_before_its_response_is_aborted_cleanly(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=0.5)
    assert server.wait_for_metric("jaxmtp_kv_pages_used", 0, timeout=5) == 0
    log = server.log_path.read_text()
    assert "Traceback" not in log and "InvalidStateError" not in log, log[-3000:]


def test_sigterm_drains_then_exits(server):
    short = {**LONG, "max_tokens": 30, "stream": True}
    with httpx.Client(timeout=60) as http, concurrent.futures.ThreadPoolExecutor(2) as pool:
        with http.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as long_stream, \
                http.stream("POST", server.url + "/v1/completions", json=short) as short_stream:
            long_events, short_events = sse_events(long_stream), sse_events(short_stream)
            first_long, _ = next(long_events), next(short_events)  # both are running
            # a third request, without streaming, waits (two sequences at most): SIGTERM
            # once the engine holds it
            admitted = server.metric("jaxmtp_prompt_tokens_total")
            waiting = pool.submit(httpx.post, server.url + "/v1/completions", json=LONG, timeout=60)
            deadline = time.monotonic() + 20
            while server.metric("jaxmtp_prompt_tokens_total") == admitted and time.monotonic() < deadline:
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            short_rest = list(short_events)
            long_rest = list(long_events)
        interrupted = waiting.result()
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
    assert server.proc.wait(30) == 0
    assert time.monotonic() - sent < SHUTDOWN_TIMEOUT + 10
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")
    log = server.log_path.read_text()
    assert "Traceback" not in log and "draining" in log, log[-3000:]
