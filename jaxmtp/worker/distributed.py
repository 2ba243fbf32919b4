"""The engine over several processes (one per host) on JAX's multi-controller runtime.

Every process calls jax.distributed.initialize before anything else uses JAX; the mesh
then spans every process's devices, and each jitted step runs on all of them at once
(SPMD), so every process must run the same device work in the same order. Rank 0 runs
the engine (scheduler, tokenizer, HTTP server) and builds each step's device work on
the host (runner.StepInputs, and a masked step's bitmasks after them); its runner's
Leader sends that to the other processes through the distributed runtime's key-value
store, one key per message, and each of them runs it on its own runner in follow().
Tokens are read back on rank 0 only.

Failures end every process: JAX's coordination service ends the others when one stops
sending heartbeats (node_timeout) or when rank 0, which hosts it, exits; a step that
fails on rank 0's devices ends rank 0 (Leader.cache_lost). See docs/multi-host.md."""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import signal
import threading

import jax
import numpy as np
from jax._src import distributed as jax_distributed  # the runtime's key-value store client

from jaxmtp.engine.engine_config import EngineConfig
from jaxmtp.models.config import ModelConfig
from jaxmtp.models.model import check_backend
from jaxmtp.worker.batch import BatchShape
from jaxmtp.worker.runner import ModelRunner
from jaxmtp.worker.step_records import StepInputs

log = logging.getLogger("jaxmtp.worker.distributed")

PREFIX = "jaxmtp"
POLL_MS = 1000  # a follower's wait for the next message, in slices (Ctrl-C is seen between them)


def start_runner(model_dir, config: EngineConfig, model_config: ModelConfig, num_draft_modules: int,
                 max_pages_per_seq: int) -> ModelRunner:
    """This process's runner, the engine's one way to the device: JAX started for this
    node (before anything uses it), the attention backend checked before anything
    loads, the runner built and, with several nodes, joined to the others' (a rank
    other than 0 runs rank 0's steps from here on and never returns)."""
    initialize(config)
    check_backend(model_config, config.attention_backend)
    runner = ModelRunner(model_dir, config, model_config, num_draft_modules, max_pages_per_seq)
    attach(runner, config)
    return runner


def initialize(config: EngineConfig) -> None:
    """jax.distributed.initialize for this node (nothing with one node); then the mesh
    (tensor_parallel_size devices) must be every node's devices together."""
    if config.num_nodes == 1:
        return
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (config.num_nodes, config.node_rank):
            raise ValueError(f"jax.distributed runs {jax.process_count()} processes with this one rank "
                             f"{jax.process_index()}, not num_nodes={config.num_nodes}, node_rank={config.node_rank}")
    else:
        if jax.config.jax_cpu_collectives_implementation in (None, "none"):  # CPU devices need it for collectives
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(
                config.coordinator, config.num_nodes, config.node_rank,
                heartbeat_timeout_seconds=config.node_timeout, shutdown_timeout_seconds=config.node_timeout,
            )
        except RuntimeError as err:  # e.g. JAX already used in this process
            raise ValueError(f"num_nodes={config.num_nodes}: {err}") from err
    if config.tensor_parallel_size != jax.device_count():
        raise ValueError(
            f"with num_nodes={config.num_nodes}, tensor_parallel_size must be every node's devices together, "
            f"{jax.device_count()} ({jax.local_device_count()} here), got {config.tensor_parallel_size}"
        )


def attach(runner: ModelRunner, config: EngineConfig) -> None:
    """Once every process has built its runner: check that they are alike, then give
    rank 0's runner its Leader (and return), while any other rank follows rank 0's
    steps here until rank 0 stops, and then ends its process (SystemExit(0)). Nothing
    with one node."""
    if config.num_nodes == 1:
        return
    client = jax_distributed.global_state.client
    facts = json.dumps(_facts(runner, config), default=str)
    if config.node_rank == 0:
        try:
            client.key_value_set(f"{PREFIX}/facts", facts)
        except jax.errors.JaxRuntimeError as err:
            raise ValueError("with num_nodes > 1 a process runs one engine, and this one has one already") from err
        for rank in range(1, config.num_nodes):
            answer = _receive(client, f"{PREFIX}/ready/{rank}").decode()
            if answer:
                raise ValueError(f"node {rank} cannot run this engine: {answer}")
        runner.peers = Leader(client, config.num_nodes)
        atexit.register(runner.peers.stop)  # before JAX's own exit handler leaves jax.distributed
        return
    leader, mine = json.loads(_receive(client, f"{PREFIX}/facts")), json.loads(facts)
    differences = ", ".join(f"{name} is {mine.get(name)!r}, rank 0's {value!r}"
                            for name, value in leader.items() if mine.get(name) != value)
    client.key_value_set(f"{PREFIX}/ready/{config.node_rank}", differences)
    if differences:
        raise ValueError(f"node {config.node_rank} cannot run rank 0's engine: {differences}")
    log.info("node %d of %d: running rank 0's steps", config.node_rank, config.num_nodes)
    if threading.current_thread() is threading.main_thread():
        # JAX's preemption service would catch SIGTERM and leave this loop running
        signal.signal(signal.SIGTERM, lambda *_: _end(f"node {config.node_rank}: SIGTERM", 128 + signal.SIGTERM))
    try:
        follow(runner, client, config.num_nodes)
    except BaseException:  # noqa: BLE001 - rank 0 may wait in a collective: end now, and JAX ends it
        log.exception("node %d failed", config.node_rank)
        _end(f"node {config.node_rank} failed", 1)
    raise SystemExit(0)  # at exit JAX leaves jax.distributed, with every node


def _facts(runner: ModelRunner, config: EngineConfig) -> dict:
    """What must be equal on every node for their steps to be one program."""
    facts = {f"option {k}": v for k, v in dataclasses.asdict(config).items() if k != "node_rank"}
    facts.update({f"model {k}": v for k, v in dataclasses.asdict(runner.model_config).items()})
    facts.update({name: getattr(runner, name) for name in ("num_pages", "max_pages_per_seq", "num_draft_modules")})
    return facts


# ----- messages -------------------------------------------------------------------------


def encode(kind: str, meta: dict | None = None, arrays: dict[str, np.ndarray] | None = None) -> bytes:
    """A message: a JSON header (its kind, meta, the arrays' names, dtypes and shapes),
    then the arrays' bytes."""
    arrays = {name: np.ascontiguousarray(a) for name, a in (arrays or {}).items()}
    header = json.dumps({"kind": kind, "meta": meta or {},
                         "arrays": [[name, a.dtype.str, a.shape] for name, a in arrays.items()]}).encode()
    return b"".join([len(header).to_bytes(4, "little"), header] + [a.tobytes() for a in arrays.values()])


def decode(payload: bytes) -> tuple[str, dict, dict[str, np.ndarray]]:
    size = int.from_bytes(payload[:4], "little")
    header = json.loads(payload[4 : 4 + size])
    arrays, offset = {}, 4 + size
    for name, dtype, shape in header["arrays"]:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        arrays[name] = np.frombuffer(payload, dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
        offset += n
    return header["kind"], header["meta"], arrays


def step_message(inputs: StepInputs) -> bytes:
    arrays = {f"state.{name}": row for name, row in (inputs.state_rows or {}).items()}
    if inputs.page_copies:
        arrays["copy_src"], arrays["copy_dst"] = (np.stack(side) for side in zip(*inputs.page_copies))
    for name in ("state_slots", "ints", "floats"):
        if getattr(inputs, name) is not None:
            arrays[name] = getattr(inputs, name)
    for name in ("state_restores", "state_saves"):
        if getattr(inputs, name) is not None:
            arrays[f"{name}.src"], arrays[f"{name}.dst"] = getattr(inputs, name)
    shape = None if inputs.shape is None else dataclasses.asdict(inputs.shape)
    return encode("step", {"shape": shape}, arrays)


def step_inputs(meta: dict, arrays: dict[str, np.ndarray]) -> StepInputs:
    copies = list(zip(arrays["copy_src"], arrays["copy_dst"])) if "copy_src" in arrays else []
    rows = {name.split(".", 1)[1]: a for name, a in arrays.items() if name.startswith("state.")}
    shape = None if meta["shape"] is None else BatchShape(**meta["shape"])
    restores, saves = ((arrays[f"{name}.src"], arrays[f"{name}.dst"]) if f"{name}.src" in arrays else None
                       for name in ("state_restores", "state_saves"))
    return StepInputs(copies, restores, saves, arrays.get("state_slots"), rows or None, arrays.get("ints"),
                      arrays.get("floats"), shape)


@dataclasses.dataclass
class ChannelStats:
    messages: int = 0
    bytes: int = 0  # payloads, as handed to the key-value store (it compresses them on the wire)
    step_messages: int = 0
    step_bytes: int = 0
    mask_messages: int = 0  # a masked step's second message: its bitmasks


class Leader:
    """Rank 0's side: sends its runner's device work to the other processes, in order,
    message n under the key jaxmtp/msg/n (the followers delete what they have read)."""

    def __init__(self, client, num_nodes: int):
        self.client, self.num_nodes = client, num_nodes
        self.stats = ChannelStats()
        self._next = 0
        self._stopped = False

    def send(self, payload: bytes) -> None:
        self.client.key_value_set_bytes(f"{PREFIX}/msg/{self._next}", payload)
        self._next += 1
        self.stats.messages += 1
        self.stats.bytes += len(payload)

    def send_step(self, inputs: StepInputs) -> None:
        payload = step_message(inputs)
        self.send(payload)
        self.stats.step_messages += 1
        self.stats.step_bytes += len(payload)

    def send_masks(self, token_bitmask: np.ndarray) -> None:
        """A masked step's token bitmasks: its second program (ModelRunner.apply_masks)."""
        self.send(encode("masks", arrays={"token_bitmask": token_bitmask}))
        self.stats.mask_messages += 1

    def send_oracle_tokens(self, table: np.ndarray | None) -> None:
        self.send(encode("oracle_tokens", arrays={} if table is None else {"table": table}))

    def send_warmup(self, num_threads: int, with_page_copies: bool, background: bool) -> None:
        self.send(encode("warmup", {"num_threads": num_threads, "with_page_copies": with_page_copies,
                                    "background": background}))

    def stop(self) -> None:
        """Tell the others to stop (at exit; JAX's own exit handler then leaves
        jax.distributed with them)."""
        if not self._stopped:
            self._stopped = True
            self.send(encode("stop"))

    def cache_lost(self) -> None:
        """A step failed on this process's devices after the others were sent it: they
        wait in its collectives or ran it, and no message can bring the caches back in
        step. End this process, which ends the others (its coordinator goes with it)."""
        _end(f"a step failed on rank 0's devices after the other {self.num_nodes - 1} node(s) were sent it, and "
             "the nodes' KV caches cannot be brought back in step", 70)


def _end(why: str, status: int) -> None:
    """End this process now, which ends every node (JAX's coordination service): it
    may not wait for the others at jax.distributed's shutdown, as a normal exit does."""
    log.critical("%s: ending this process, and with it every node", why)
    logging.shutdown()
    os._exit(status)


def _receive(client, key: str) -> bytes:
    """The value of key once it is set, however long that takes: a node that dies ends
    this process through JAX's coordination service, not here."""
    while True:
        try:
            return client.blocking_key_value_get_bytes(key, POLL_MS)
        except jax.errors.JaxRuntimeError as err:
            if "DEADLINE_EXCEEDED" not in str(err):
                raise


def follow(runner: ModelRunner, client, num_nodes: int) -> None:
    """Run rank 0's messages on this process's runner, in order, until it says stop."""
    readers = num_nodes - 1
    for n in range(2**62):
        key = f"{PREFIX}/msg/{n}"
        kind, meta, arrays = decode(_receive(client, key))
        if kind == "step":
            runner.apply(step_inputs(meta, arrays))
        elif kind == "masks":
            runner.apply_masks(arrays["token_bitmask"])
        elif kind == "oracle_tokens":
            runner.oracle_tokens = arrays.get("table")
        elif kind == "warmup":
            runner.warmup(**meta)
        elif kind != "stop":
            raise ValueError(f"rank 0 sent a message this node does not know: {kind!r}")
        # the last of the readers deletes it (after dispatching: off the step's path)
        if readers == 1 or client.key_value_increment(f"{PREFIX}/read/{n}", 1) == readers:
            client.key_value_delete(key)
            if readers > 1:
                client.key_value_delete(f"{PREFIX}/read/{n}")
        if kind == "stop":
            return
