"""The kernels a decode step launches on an H200, counted without a GPU: the engine's step
compiled by XLA's GPU compiler for the H200 (a compile-only device built from
benchmarks/configs/h200_target.txtpb, the device's public figures), its optimised
program read instruction by instruction.

At batch 1 a MoE model's step is mostly small kernels: on the H200 (2026-12-03,
`profile_step.py --model moonlight --batch 1`) about 40 of 1-2 us a layer beside the
expert and projection GEMMs. Each kernel a layer sheds saves about that much times the
layers, so this counts them where no GPU is lent: every launched instruction of the
step (fusions, library GEMMs, Pallas kernels, copies), by kind and by part of the step,
for two layer counts, and their difference: the kernels of one decoder layer; and the
step's arguments (the host handles each at every call).

What it cannot see: XLA's autotuning needs the device, so GEMM fusions keep their
default tilings (split-K partial sums may differ from the H200's choice), and no
kernel is timed. The CPU builds the runner (dummy weights at full width, `--layers`
decoder layers); the kernels' choices are the GPU's (jax.default_backend reads "gpu"
while the runner is built and the step traced).

    python benchmarks/step_kernels.py [--model moonlight|llama3_8b|llama3_8b_fp8|glm45_air_fp8]
        [--batch 1] [--k 0] [--layers 2,3] [--out DIR]

Needs the CUDA plugin of jax (`pip install "jax[cuda12]"`, or jax-cuda13-plugin and
jax-cuda13-pjrt at the installed jax's version), no GPU. Writes step_kernels.json (the
counts, and each compiled step's launched instructions in order: name, kind, op_name)
and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

TARGET = ROOT / "benchmarks" / "configs" / "h200_target.txtpb"
# instructions that launch nothing: views, tuples and the program's own arguments
NOT_LAUNCHED = frozenset({"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all",
                          "opt-barrier", "partition-id", "replica-id"})


def launched(hlo_text: str) -> list[dict]:
    """The entry computation's launched instructions, in order: [{name, kind, op_name}];
    kind: "gemm" (XLA's GEMM fusions and cuBLAS calls), "pallas" (a Pallas kernel),
    "custom-call" (another), "fusion" (XLA's other kernels), or the opcode (copy, sort,
    while, conditional...)."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    entry = entry[: entry.index("\n}\n")]
    out = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][\w-]*)\(", line)
        if not m or m.group(2) in NOT_LAUNCHED:
            continue
        name, opcode = m.groups()
        target = re.search(r'custom_call_target="([^"]*)"', line)
        op_name = re.search(r'op_name="([^"]*)"', line)
        if opcode == "fusion":
            kind = "gemm" if name.startswith(("gemm_fusion", "cublas")) else "fusion"
        elif opcode == "custom-call":
            target = target.group(1) if target else ""
            kind = "gemm" if "gemm" in target else "pallas" if "triton" in target or "mosaic" in target else opcode
        else:
            kind = opcode
        out.append({"name": name, "kind": kind, "op_name": op_name.group(1) if op_name else ""})
    return out


def arguments(hlo_text: str) -> int:
    """The entry computation's parameters: the arrays the host hands the program at
    every call (on the H200's host about 3 us each, docs/benchmarks/README.md)."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    return len(re.findall(r" parameter\(\d+\)", entry[: entry.index("\n}\n")]))


def summary(kernels: list[dict]) -> dict:
    """Counts by kind and by the step's part (jaxmtp.worker.step.STEP_PARTS, from each
    instruction's op_name; "other" where none names it)."""
    from jaxmtp.worker.step import STEP_PARTS

    def part(op_name: str) -> str:
        return next((p for p in op_name.split("/") if p in STEP_PARTS), "other")

    return {"kernels": len(kernels), "by_kind": dict(collections.Counter(k["kind"] for k in kernels).most_common()),
            "by_part": dict(collections.Counter(part(k["op_name"]) for k in kernels).most_common())}


@contextlib.contextmanager
def gpu_choices():
    """jax.default_backend() reads "gpu" inside: the engine picks its GPU kernels and
    layouts (it asks nothing else of the backend)."""
    import jax

    actual = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = actual


def h200_mesh(target: Path):
    """A one-device mesh of a compile-only H200 (XLA compiles for it; nothing runs)."""
    import jax
    import numpy as np
    from jax.experimental import topologies

    from jaxmtp.worker.sharding import TP

    topology = topologies.get_topology_desc(platform="cuda", target_config=target.read_text(), topology="1x1x1")
    return jax.sharding.Mesh(np.array(topology.devices[:1]), (TP,), axis_types=(jax.sharding.AxisType.Auto,))


def step_hlo(config: dict, batch: int, k: int, mesh) -> str:
    """The optimised HLO of the decode step (batch sequences, k drafts each) of a dummy
    model of `config`, compiled for `mesh`'s device."""
    import jax
    from jax.sharding import NamedSharding

    from jaxmtp.engine.engine_config import EngineConfig
    from jaxmtp.models.registry import load_config
    from jaxmtp.worker.runner import ModelRunner

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    engine_config = EngineConfig(load_format="dummy", max_model_len=4096, max_num_seqs=max(batch, 8), num_pages=1024,
                                 max_num_batched_tokens=2048, num_speculative_tokens=k)
    model_config = load_config(folder, engine_config.dtype)
    with gpu_choices():
        runner = ModelRunner(folder, engine_config, model_config, min(k, model_config.num_mtp_modules),
                             4096 // engine_config.page_size + 2)
        # the runner's compile specs moved to the H200's mesh: what the step is traced for
        runner._state_specs = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, s.sharding.spec)),
            runner._state_specs)
        runner.step_config = dataclasses.replace(runner.step_config, mesh=mesh)
        runner.mesh = mesh
        shape = runner.buckets.shape_for(batch * (k + 1), batch, True, 8, False, False, k + 1)
        return runner.lower_step(shape).compile().as_text()


def model_configs() -> dict:
    from e2e import FP8_BLOCK_SCALED, LLAMA3_8B
    from moe import MODELS

    return {"llama3_8b": LLAMA3_8B, "llama3_8b_fp8": {**LLAMA3_8B, "quantization_config": FP8_BLOCK_SCALED},
            "moonlight": MODELS["moonlight"][0], "glm45_air_fp8": MODELS["glm45_air_fp8"][0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="moonlight", choices=sorted(model_configs()))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--k", type=int, default=0)
    parser.add_argument("--layers", default="2,3", help="two decoder-layer counts; their difference is one layer")
    parser.add_argument("--target", type=Path, default=TARGET, help="the GPU's GpuTargetConfigProto, text format")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()

    import jax

    config = model_configs()[args.model]
    mesh = h200_mesh(args.target)
    counts, instructions = {}, {}
    for layers in map(int, args.layers.split(",")):
        text = step_hlo({**config, "num_hidden_layers": layers}, args.batch, args.k, mesh)
        instructions[layers] = launched(text)
        counts[layers] = {**summary(instructions[layers]), "arguments": arguments(text)}
    low, high = sorted(counts)
    layers_more = config["num_hidden_layers"] - low

    def whole_model(key: str) -> tuple[float, float]:  # a layer's, and the model's step's
        per_layer = (counts[high][key] - counts[low][key]) / (high - low)
        return per_layer, counts[low][key] + per_layer * layers_more

    per_layer, total = whole_model("kernels")
    arguments_per_layer, arguments_total = whole_model("arguments")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "jax": jax.__version__, "target": args.target.name, "model": args.model, "batch": args.batch,
              "k": args.k, "counts": counts, "kernels_per_layer": per_layer,
              "kernels_per_step": total, "arguments_per_layer": arguments_per_layer,
              "arguments_per_step": arguments_total, "layers": config["num_hidden_layers"],
              "instructions": instructions}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "step_kernels.json").write_text(json.dumps(result, indent=1))
    print(f"{args.model} batch {args.batch} k={args.k} ({args.target.name}, jax {jax.__version__}): "
          f"{per_layer:g} kernels a decoder layer, {total:g} a step of {config['num_hidden_layers']} layers; "
          f"{arguments_per_layer:g} arguments a layer, {arguments_total:g} a step")
    for layers, c in counts.items():
        print(f"  {layers} layers: {c['kernels']} kernels; by kind {c['by_kind']}; by part {c['by_part']}")


if __name__ == "__main__":
    main()
