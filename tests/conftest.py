"""Shared test helpers: the shipped model, its golden output, tiny Hugging Face models."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The repository's kernels/ folder (installed as jaxmtp.kernels) would shadow PyPI's
# `kernels`, which transformers >= 5.25 imports when it is installed: `python -m pytest`
# puts the repository root on the import path, so the tests take it off again.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]
# A benchmark module a test imports in-process puts the root back, first: PyPI's
# `kernels` (where installed) is imported now, so that a later transformers import in
# the same worker still finds it and not our folder.
with contextlib.suppress(ImportError):
    import kernels  # noqa: F401


def _fast_compile_flags() -> str:
    """XLA CPU flags for a suite whose time is XLA compile time: LLVM at optimisation
    level 0, the loop emitters in place of the fusion emitters, which halves the compile
    time of a step on jax 0.10, and LLVM's code generation on one thread (the suite runs
    a process per core already). They change how fast a program compiles and runs, not
    what it computes (every test holds either way). Flags this jaxlib does not know are
    left out: XLA exits on unknown flags."""
    flags = "--xla_backend_optimization_level=0"
    candidate = flags + " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1).block_until_ready()"],
                           env={**os.environ, "XLA_FLAGS": candidate, "JAX_PLATFORMS": "cpu"}, capture_output=True)
    return candidate if probe.returncode == 0 else flags


# Set once, by the run's first process; xdist workers and the processes tests start
# inherit it (tests that force several CPU devices add their flag to CPU_XLA_FLAGS).
os.environ.setdefault("JAXMTP_TEST_XLA_FLAGS", os.environ.get("XLA_FLAGS") or _fast_compile_flags())
CPU_XLA_FLAGS = os.environ["JAXMTP_TEST_XLA_FLAGS"]
os.environ.setdefault("XLA_FLAGS", CPU_XLA_FLAGS)
# One persistent compilation cache for the whole run, its xdist workers and the
# processes tests start (benchmark scripts, servers, nodes): modules build the same
# engines and kernels, and each program compiles once. num_compiles counts a program
# loaded from it as one compiled, so the no-compile-in-a-step tests see it either way.
# The run's first process names it; the xdist workers it starts inherit the name. It
# keeps programs that took 0.2 s or more to compile (every step; the suite's hundreds of
# eager operations compile faster than they are written and read back).
_OWN_XLA_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
_XLA_CACHE = Path(os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                                        str(Path(tempfile.gettempdir()) / f"jaxmtp-tests-xla-{os.getpid()}")))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import functools  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

STORIES = ROOT / "checkpoints" / "stories260K"
MTP_MODEL = ROOT / "checkpoints" / "stories260K-mtp"  # stories260K with its trained MTP head


def run_on_cpu_devices(argv: list[str], num_devices: int, *, timeout: int = 600, path: tuple = ()) -> dict:
    """`python *argv` on num_devices forced CPU devices, with this checkout's jaxmtp (and
    `path`) on its import path, whatever is installed; returns the JSON object its last
    line of output prints. (The repository root on the path puts our kernels/ folder
    where PyPI's `kernels` would be found: such a script must not import transformers.)"""
    import json

    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices} {CPU_XLA_FLAGS}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, path)])}
    done = subprocess.run([sys.executable, *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def golden_ids() -> list[int]:
    """The first 200 greedy ids from BOS, pinned by transformers and llama2.c (see the
    model's README.md, copied from the project's shared models)."""
    text = (STORIES / "README.md").read_text()
    block = re.search(r"first 200 generated ids:\s*\n\s*\n(.*?)\n\s*\n", text, re.S).group(1)
    return [int(t) for t in block.split()]


def fresh_rng() -> np.random.Generator:
    """Random inputs, fresh per test. A failing test reports every seed it drew (see
    pytest_runtest_makereport below); JAXMTP_TEST_SEED=N replays one. The seed is also
    rng.bit_generator.seed_seq.entropy, for assertion messages."""
    env = os.environ.get("JAXMTP_TEST_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    _SEEDS.append(seed)
    return np.random.default_rng(seed)


def greedy(n: int, **kwargs):
    """Greedy sampling of exactly n tokens (eos ignored)."""
    from jaxmtp import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def random_prompts(rng, lengths) -> list[list[int]]:
    """BOS, then random ids of the stories260K vocabulary (past the specials)."""
    return [[1] + rng.integers(3, 512, size=n - 1).tolist() for n in lengths]


def assert_no_leaks(llm):
    """Nothing is left in the engine (an LLM's, or an LLMEngine), and every page is
    unheld and either free or cached (parked) exactly once."""
    engine = getattr(llm, "engine", llm)
    allocator = engine.allocator
    assert not engine.has_unfinished_requests()
    assert allocator.num_free == allocator.num_pages and not any(allocator.ref_counts)
    assert sorted([*allocator.free_pages, *allocator.evictable]) == list(range(allocator.num_pages))
    assert set(allocator.evictable) == set(engine.prefix_cache.by_page if engine.prefix_cache else ())


def until_prefill_emits(engine, prompt: list[int], request_id: str = "probe", max_tokens: int = 64):
    """Add a greedy request and step until its prefill has emitted a token; returns its
    sequence, still in the engine (abort it when done)."""
    engine.add_request(request_id, prompt, greedy(max_tokens))
    seq = None
    while seq is None or not seq.output_token_ids:
        engine.step()
        seq = engine.requests[request_id].seqs[0]
    return seq


def prompt_logits(engine, ids: list[int]) -> np.ndarray:
    """Logits at every prompt position through the engine's real paged path, in one
    compiled program per model and multiple of 16 rows (the rows past the prompt are
    padding, as the engine pads a batch)."""
    from jaxmtp.worker.batch import BatchShape, build_batch
    from jaxmtp.engine.sampling_params import SamplingParams
    from jaxmtp.engine.scheduler import ScheduledRows
    from jaxmtp.engine.sequence import Sequence

    pages = engine.allocator.allocate(math.ceil(len(ids) / engine.page_size))
    seq = Sequence("score", list(ids), SamplingParams(), 0, 0, frozenset(), pages=pages)
    batch = build_batch(
        [ScheduledRows(seq, 0, list(ids), 0, True)], BatchShape(-(-len(ids) // 16) * 16, 1),
        engine.max_pages_per_seq, engine.page_size, engine.cache.num_slots, 0,
    )
    out = _forward_logits()(engine.params, engine.cache, batch, engine.model_config)
    engine.allocator.free(pages)
    return np.asarray(out)[: len(ids)]


@functools.cache
def _forward_logits():
    """The jitted forward and LM head (made on first use: conftest imports no JAX)."""
    import jax

    from jaxmtp.models import model

    def forward_logits(params, cache, batch, cfg):
        hidden, _ = model.forward(params, cfg, batch, cache, model.layer_ops(cfg, "reference"))
        return model.logits(params.head(), params.final_norm, cfg, hidden)

    return jax.jit(forward_logits, static_argnames=("cfg",))


# stories260K: decoder layers, and the widest sum a layer makes (the MLP's; the tests'
# contexts are shorter), its vocabulary
STORIES_LAYERS, STORIES_WIDEST_SUM, STORIES_VOCAB = 5, 172, 512


def stories_logprob_bound(logits) -> float:
    """How far our float32 logprobs of stories260K lie from the float64 log_softmax of
    logits computed in another evaluation (tolerances.logprob_bound)."""
    from tolerances import logprob_bound

    return logprob_bound(logits, STORIES_LAYERS, STORIES_WIDEST_SUM)


_STORIES_ENGINE = []


def stories_logprob_bound_of(sequences) -> float:
    """stories_logprob_bound at the logits of these token sequences (each position's,
    the last one's included), computed here by one plain engine per process: for runs
    whose logits are not at hand (other processes' and devices')."""
    from jaxmtp import LLM

    if not _STORIES_ENGINE:
        _STORIES_ENGINE.append(LLM(STORIES, max_num_seqs=1, max_num_batched_tokens=64))
    engine = _STORIES_ENGINE[0].engine
    return stories_logprob_bound(np.concatenate([prompt_logits(engine, list(s)) for s in sequences]))


def draft_kv_bound(ref_kv, num_modules: int) -> float:
    """How far the draft KV of stories260K-mtp may move between two chunkings or cache
    hits (tolerances.reordered_model_bound): its 5 layers and num_modules MTP modules,
    sums of at most 172 terms (the MLP's width; the tests' contexts are shorter)."""
    from tolerances import reordered_model_bound

    return reordered_model_bound(float(np.abs(ref_kv).max()), STORIES_LAYERS + num_modules, STORIES_WIDEST_SUM)


def make_modules_model(folder: Path, num_modules: int) -> Path:
    """stories260K-mtp with num_modules MTP modules: its trained module, then copies of it
    with every weight scaled by 1 + 5% noise (fixed seed). Module j reads module j-1's
    output and the token j ahead, much as the trained module's own chain does, so deeper
    drafts are accepted often enough to exercise verification."""
    import dataclasses

    import jax

    from jaxmtp.models.registry import load_config
    from jaxmtp.loading.loader import load_params, save_checkpoint

    cfg = load_config(MTP_MODEL)
    params = load_params(MTP_MODEL, cfg)
    leaves, tree = jax.tree.flatten(params.mtp[0])
    modules = [params.mtp[0]]
    for j in range(1, num_modules):
        keys = jax.random.split(jax.random.key(j), len(leaves))
        modules.append(tree.unflatten([x * (1 + 0.05 * jax.random.normal(key, x.shape)) for x, key in zip(leaves, keys)]))
    return save_checkpoint(folder, dataclasses.replace(params, mtp=modules), cfg, MTP_MODEL)


FAMILIES = {
    "llama": dict(model_type="llama"),
    "llama3-rope-tied": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=24),
    "mistral-sliding": dict(model_type="mistral", sliding_window=7),
}


# make_hf_model's shape: decoder layers, and the widest sum a layer makes (the MLP's;
# the tests' contexts are shorter)
HF_MODEL_LAYERS, HF_MODEL_WIDEST_SUM = 2, 80


def hf_logits_bound(expected) -> float:
    """How far our float32 logits of a make_hf_model model may lie from transformers'
    (tolerances.logits_bound)."""
    from tolerances import logits_bound

    return logits_bound(expected, HF_MODEL_LAYERS, HF_MODEL_WIDEST_SUM)


def make_hf_model(path: Path, family: str, seed: int, dtype: str = "float32", **overrides) -> Path:
    """Save a tiny random model of one family with transformers; returns its folder."""
    import torch
    import transformers

    spec = {**FAMILIES[family], **overrides}
    model_type = spec.pop("model_type")
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    shape = dict(
        vocab_size=97, hidden_size=48, intermediate_size=HF_MODEL_WIDEST_SUM, num_hidden_layers=HF_MODEL_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2,
    )
    config = config_cls(**{**shape, **spec})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms away from 1 so that a missed norm shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    return path


@pytest.fixture
def rng() -> np.random.Generator:
    return fresh_rng()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. The suite compiles thousands
    of steps in one process, and each XLA CPU executable keeps memory mappings: left
    alone they reach the kernel's limit (vm.max_map_count, 65530) and the next
    compilation aborts the process. Tests share compiled steps within a module."""
    yield
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


_SEEDS: list[int] = []  # the seeds fresh_rng drew for the running test


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _SEEDS.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report names the seeds its random inputs came from."""
    report = (yield).get_result()
    if report.failed and _SEEDS:
        seeds = ", ".join(map(str, _SEEDS))
        report.sections.append(("random seeds", f"seeds {seeds}; replay with JAXMTP_TEST_SEED={_SEEDS[0]}"))


# The files that take 40 s or more of a worker on 2 cores (`--durations=0`, summed per
# file, 2026-12-03), largest first: they start the run, so that under `--dist loadfile`
# (files handed to workers in collection order) the short files fill its end.
LONGEST_FILES = ("test_mtp.py", "test_benchmarks.py", "test_multi_host.py", "test_moe_mla_pallas.py",
                 "test_engine.py", "test_hybrid_engine.py", "test_server_guards.py", "test_moe_mtp.py",
                 "test_tensor_parallel.py", "test_structured_outputs.py", "test_fp8.py",
                 "test_gated_delta_kernels.py", "test_train.py", "test_prefix_cache.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: files keep their order


def pytest_unconfigure(config):
    if _OWN_XLA_CACHE:  # the process that named it: the run's controller, or a run without workers
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption(
        "--seed-loop", type=int, default=0, metavar="N",
        help="run each selected test N times, fresh_rng's seed 1..N (JAXMTP_TEST_SEED), in one process: a randomized "
             "test's tolerance must hold for every seed",
    )


def pytest_generate_tests(metafunc):
    if metafunc.config.getoption("seed_loop"):
        metafunc.fixturenames.append("_loop_seed")
        metafunc.parametrize("_loop_seed", range(1, metafunc.config.getoption("seed_loop") + 1))


@pytest.fixture(autouse=True)
def _seed_of_the_loop(request, monkeypatch):
    """Under --seed-loop, the seed of this repetition, set before any fixture draws."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "_loop_seed" in callspec.params:
        monkeypatch.setenv("JAXMTP_TEST_SEED", str(callspec.params["_loop_seed"]))


def record_drafts(engine) -> list:
    """Wrap engine.step to record, after each step read, the proposals of every request
    that has output: (its prompt, tokens so far, drafts)."""
    history, step = [], engine.step

    def recording():
        steps = engine.stats.steps
        outputs = step()
        if engine.stats.steps != steps:
            history.extend((tuple(r.seq.prompt_token_ids), len(r.seq.output_token_ids), tuple(r.seq.drafts))
                           for r in engine.last_schedule if r.seq.output_token_ids)
        return outputs

    engine.step = recording
    return history
