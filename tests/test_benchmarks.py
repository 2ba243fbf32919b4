"""The benchmark scripts' CPU smoke modes (--tiny): the H200 figures in docs/benchmarks
come from these scripts, so they must keep running as the engine changes under them."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from jaxmtp.kernels.mla_prefill import OwnRowsConfig


def run_script(name: str, *args: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def test_e2e_decode_and_mtp_rows_with_outputs_equal_to_plain(tmp_path):
    run_script("e2e.py", "--tiny", "--scenarios", "b1,mtp", "--mtp-k", "1", "--out", str(tmp_path), "--tag", "_smoke")
    results = json.loads((tmp_path / "e2e_smoke.json").read_text())
    rows = {row["scenario"]: row for row in results["rows"]}
    assert any(name.startswith("b1 decode") for name in rows)
    assert all(math.isfinite(row["value"]) and row["value"] > 0 for row in rows.values())
    mtp = [row for name, row in rows.items() if "MTP" in name]
    # k = 1 (random head and oracle drafts); deeper chains: tests/test_mtp.py
    assert len(mtp) == 2 and all("output equal to plain: True" in row["note"] for row in mtp)
    # each timed run's host phases and its median and slowest step
    assert all(re.search(r"host \d+\.\d+ ms; median \d+\.\d+, slowest", row["note"]) for row in mtp)
    oracle = {int(row["scenario"].split("k=")[1][0]): row for row in mtp if "oracle" in row["scenario"]}
    assert sorted(oracle) == [1]
    # drafts taken from the plain run are all accepted: k + 1 tokens a step
    assert all(f"acceptance length {k + 1}.00" in row["note"] for k, row in oracle.items())
    assert results["hlo_cache_copies_b1_plain"] == 0
    # no peer ran: no ratio to it, and no placeholder for one in the table
    assert "None" not in (tmp_path / "e2e_smoke.md").read_text()


def test_gemm_sweep_checks_and_times_xla_and_the_kernels_tilings(tmp_path):
    """The sweep's rows (CPU: interpret mode, one tiny shape): XLA's dot first, then
    kernel tilings, every one checked against the float32 matmul and timed."""
    run_script("gemm_sweep.py", "--tiny", "--m", "8", "--shapes", "q_o", "--out", str(tmp_path))
    results = json.loads((tmp_path / "gemm_sweep.json").read_text())
    rows = results["shapes"]["q_o"]["by_m"]["8"]
    assert rows[0]["config"] is None and len(rows) > 1  # XLA's dot, then the kernel's tilings
    assert all(row["ok"] and row["us"] > 0 for row in rows)
    assert {row["config"]["split_k"] for row in rows[1:]} > {1}  # split-K tilings among them


def test_grouped_sweep_checks_xla_and_the_tilings_and_writes_the_table(tmp_path):
    """The grouped kernel's sweep on a tiny expert shape (interpret mode): XLA's
    ragged_dot, the default tiling and the first stage's, each checked against float32,
    timed, and the table written in the form kernels/grouped_tilings.json takes."""
    run_script("grouped_sweep.py", "--tiny", "--tokens", "1", "--kernels", "down", "--out", str(tmp_path))
    (case,) = json.loads((tmp_path / "grouped_sweep.json").read_text())["cases"]
    variants = case["variants"]
    assert variants[0]["config"] is None and variants[1].get("default") and len(variants) > 2
    assert all(v["ok"] and v["us"] > 0 for v in variants)
    table = json.loads((tmp_path / "grouped_tilings.json").read_text())
    assert all(key.count(",") == 3 for key in table)


def test_grouped_sweep_hopper_only_skips_the_triton_stages(tmp_path):
    """--hopper-only times XLA, the default tiling and the shipped table's (none for the
    tiny shape) and no Triton search; the Hopper kernel's stage is off in --tiny."""
    run_script("grouped_sweep.py", "--tiny", "--tokens", "1", "--kernels", "down", "--hopper-only", "--out",
               str(tmp_path))
    (case,) = json.loads((tmp_path / "grouped_sweep.json").read_text())["cases"]
    variants = case["variants"]
    assert len(variants) == 2 and variants[0]["config"] is None and variants[1].get("default")


def test_mla_sweep_checks_the_tilings_and_writes_the_table_the_engine_reads(tmp_path):
    """The MLA decode sweep on tiny heads (interpret mode, one decode case): XLA's
    absorbed form and the kernel's tilings, each checked against the default tiling and
    timed, and a table in kernels/mla_paths.json's form that the kernel's lookup reads:
    the case's context bucket, and a width it lacks through the nearest one measured."""
    from jaxmtp.kernels import mla_attention as mk
    from jaxmtp.kernels.tiling_table import read_tilings

    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"_note": "an earlier run", "4,32,16,1,8": {"2": "xla"}}))
    run_script("mla_sweep.py", "--tiny", "--rows", "", "--table", str(earlier), "--out", str(tmp_path))
    (case,) = json.loads((tmp_path / "mla_sweep.json").read_text())["cases"]
    variants = case["variants"]
    assert "xla" in variants and len(variants) > 2
    assert all(v["ok"] and v["us"] > 0 for v in variants.values())
    assert {v["config"]["block_kv"] for v in variants.values() if v["config"]} == {32, 64}
    table = read_tilings(tmp_path / "mla_paths.json", mk.MLAKernelConfig)
    assert set(table) == {(4, 32, 16, 1, 8), (4, 32, 16, 1, 64)} and list(table[(4, 32, 16, 1, 64)]) == [2]
    assert "over the table of an earlier run" in json.loads((tmp_path / "mla_paths.json").read_text())["_note"]
    del table[(4, 32, 16, 1, 8)]  # the earlier run's width, for the lookups below
    entry = table[(4, 32, 16, 1, 64)][2]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mk, "MEASURED_PATHS", table)
        assert mk.measured_decode_path(4, 32, 16, 1, 2, 40) == entry
        assert mk.measured_decode_path(4, 32, 16, 1, 2, 4000) == entry  # nearest width measured
        assert mk.measured_decode_path(4, 32, 16, 1, 8, 40) is None  # a batch bucket it lacks
        assert mk.measured_decode_path(4, 32, 16, 2, 2, 40) is None  # verify rows: none measured


def test_gated_delta_times_both_forms_and_writes_the_table_the_engine_reads(tmp_path):
    """The gated delta benchmark on tiny heads (interpret mode): per case XLA's form and
    the kernel's tilings, each checked against XLA's and timed, and a table in
    kernels/gated_delta_paths.json's form whose buckets are those the engine looks up
    (2 requests; 20 rows in 2 request slots: (20 + 2 x 15) // 16 = 3 chunks, bucket 4),
    under the key of a device's share of the heads (--tp; at TP=1 the same code divides
    by 1)."""
    from jaxmtp.kernels.gated_delta import DeltaKernelConfig

    run_script("gated_delta.py", "--tiny", "--batches", "2", "--rows", "2", "--prefill", "20", "--prefill-seqs", "2",
               "--tp", "2", "--out", str(tmp_path))
    models = json.loads((tmp_path / "gated_delta.json").read_text())["cases"]
    assert sorted(models) == ["tiny tp2"]  # one device's share at TP=2: 2 of the 4 value heads
    for cases in models.values():
        assert sorted(cases) == ["chunks B=2 rows=20", "rows B=2 rows=2"]
        for case in cases.values():
            assert case["variants"][0]["config"] is None and len(case["variants"]) > 1
            assert all(v["ok"] and v["us"] > 0 for v in case["variants"])
    table = json.loads((tmp_path / "gated_delta_paths.json").read_text())
    assert sorted(k for k in table if not k.startswith("_")) == ["0,2,16,16", "1,2,16,16"]
    assert list(table["0,2,16,16"]) == ["2"] and list(table["1,2,16,16"]) == ["4"]
    for entry in (entry for key, buckets in table.items() if not key.startswith("_") for entry in buckets.values()):
        assert entry == "xla" or DeltaKernelConfig(*entry)


def test_a_trace_parts_into_its_variants_at_the_longest_idle_gaps():
    """The sweeps' trace timing: variants parted at the longest gaps, so a host stall
    inside one variant's run (3 ms here, past the 2 ms that once parted them) stays in
    it; too few kernels, or variants not parted by more than GAP_US, give None."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gemm_sweep import GAP_US, idle_separated

    def kernels(start_us, count, us=5.0, stall_after=None):
        out = []
        t = start_us
        for i in range(count):
            out.append({"ts": t, "us": us})
            t += us + (1.5 * GAP_US if i == stall_after else 1.0)
        return out

    first, second, third = kernels(0, 4), kernels(20_000, 6, stall_after=2), kernels(40_000, 3)
    events = third + first + second  # a trace's events come in no particular order
    groups = idle_separated(events, 3)
    assert [len(g) for g in groups] == [4, 6, 3] and groups[1][0]["ts"] == 20_000
    assert idle_separated(events, 14) is None
    assert idle_separated(kernels(0, 4), 2) is None  # one run, no gap past GAP_US to part it


def test_gated_delta_table_entry_is_the_tiling_fastest_over_every_case_of_its_bucket():
    """Decode and verify rows of one batch size share a bucket: its entry is the tiling
    fastest over both cases, not the last case's winner, and XLA's where it is faster
    over both."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gated_delta import bucket_choice

    def case(xla_us, **tilings_us):
        return [{"config": None, "us": xla_us}] + [
            {"config": {"block_dv": int(name[1:]), "num_warps": 4, "num_stages": 1}, "ok": True, "us": us}
            for name, us in tilings_us.items()]

    decode, verify = case(30.0, b16=10.0, b32=20.0), case(40.0, b16=31.0, b32=30.0)
    assert bucket_choice([decode]) == [16, 4, 1]
    assert bucket_choice([decode, verify]) == [16, 4, 1]  # 41 us against 50; verify alone picks 32
    assert bucket_choice([verify]) == [32, 4, 1]
    assert bucket_choice([case(30.0, b16=10.0), case(12.0, b16=30.0)]) == "xla"  # 40 us against 42: not 5% faster
    failed = case(30.0, b16=10.0) + [{"config": {"block_dv": 32, "num_warps": 4, "num_stages": 1}, "error": "smem"}]
    assert bucket_choice([failed, case(40.0, b32=5.0)]) == "xla"  # no tiling ran in both


def test_grouped_sweep_times_a_steps_padded_mix_at_the_same_tilings(tmp_path):
    """--step-tokens: 1 and 40 real tokens in a step of 40 (the rest padding routed to no
    expert, as an engine step pads to its bucket): both cases have the step's rows and
    time the same tilings, the two first stages together (1 token's alone has no 32-row
    blocks), and their bucket gets one table entry, merged into --update's table."""
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"8,32,64,0": {"8": "xla"}, "2,16,32,1": {"8": "xla"}}))
    run_script("grouped_sweep.py", "--tiny", "--tokens", "1,40", "--step-tokens", "40", "--kernels", "down",
               "--update", str(earlier), "--out", str(tmp_path))
    one, full = json.loads((tmp_path / "grouped_sweep.json").read_text())["cases"]
    assert (one["rows"], one["padding"], full["rows"], full["padding"]) == (80, 78, 80, 0)  # top-2
    tilings = [{tuple(v["config"].values()) for v in case["variants"] if v["config"]} for case in (one, full)]
    assert tilings[0] == tilings[1] and {16, 32} <= {t[0] for t in tilings[0]}
    assert all(v["ok"] and v["us"] > 0 for case in (one, full) for v in case["variants"])
    merged = json.loads((tmp_path / "grouped_tilings.json").read_text())  # over --update's, whose buckets stay
    assert merged["2,16,32,1"] == {"8": "xla"} and set(merged["8,32,64,0"]) in ({"8"}, {"8", "128"})


def test_a_grouped_bucket_takes_the_tiling_fastest_over_its_mix():
    """grouped_sweep.table: cases that share a bucket give it the tiling with the least
    summed time (not the last case's winner), where that beats XLA and the default by 5%;
    XLA where it beats that tiling by 5%; nothing (the default) in between."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from grouped_sweep import table

    def case(rows, xla_us, default_us, **tilings_us):
        variants = [{"config": None, "us": xla_us},
                    {"config": {"block_m": 16, "block_n": 8, "block_k": 8}, "ok": True, "us": default_us,
                     "default": True}]
        variants += [{"config": {"block_m": 16, "block_n": int(name[1:]), "block_k": 64}, "ok": True, "us": us}
                     for name, us in tilings_us.items()]
        return {"kernel": "down", "groups": 8, "k": 32, "n": 64, "rows": rows, "variants": variants}

    few, full = case(12, 50.0, 40.0, n32=10.0, n64=12.0), case(16, 60.0, 45.0, n32=30.0, n64=20.0)
    assert table({"cases": [few]}) == {"8,32,64,0": {"16": [16, 32, 64]}}
    assert table({"cases": [full]}) == {"8,32,64,0": {"16": [16, 64, 64]}}
    assert table({"cases": [few, full]}) == {"8,32,64,0": {"16": [16, 64, 64]}}  # 32 us against 40
    assert table({"cases": [full, few]}) == {"8,32,64,0": {"16": [16, 64, 64]}}
    assert table({"cases": [case(8, 9.6, 40.0, n32=10.0)]}) == {}  # within 5% of each other: the default stands
    assert table({"cases": [case(8, 8.0, 40.0, n32=10.0)]}) == {"8,32,64,0": {"8": "xla"}}
    # the Hopper kernel's rows (path "wgmma") enter the table as {"wgmma": fields}
    hopper = case(16, 60.0, 45.0, n32=30.0)
    hopper["variants"].append({"config": {"block_m": 64, "block_n": 64, "block_k": 64, "max_concurrent_steps": 4},
                               "ok": True, "us": 12.0, "path": "wgmma"})
    assert table({"cases": [hopper]}) == {"8,32,64,0": {"16": {"wgmma": [64, 64, 64, 4]}}}


def test_grouped_sweep_of_fp8_experts_keys_its_table_by_the_scale_block(tmp_path):
    run_script("grouped_sweep.py", "--tiny", "--fp8", "--tokens", "1", "--kernels", "down", "--out", str(tmp_path))
    (case,) = json.loads((tmp_path / "grouped_sweep.json").read_text())["cases"]
    assert case["scale_k"] == 16 and all(v["ok"] and v["us"] > 0 for v in case["variants"])
    assert all(v["config"] is None or v["config"]["block_k"] <= 16 for v in case["variants"])
    table = json.loads((tmp_path / "grouped_tilings.json").read_text())
    assert all(key.endswith(",0,16") for key in table)


def test_fp8_sweep_checks_each_path_and_merges_its_table_into_a_measured_one(tmp_path):
    """The fp8 sweep on a tiny shape (interpret mode): the dequantized dot, the bf16 dot
    and the kernel's tilings, each checked against float32 and timed; the table written
    with this run's buckets over those of --update's table, the others kept."""
    before = tmp_path / "before.json"
    before.write_text(json.dumps({"_about": "earlier", "64,1,96,16,32": {"1": "x", "512": "y"}, "1,1,1,1,1": {"1": "z"}}))
    run_script("fp8_sweep.py", "--tiny", "--m", "1", "--shapes", "q_o", "--update", str(before), "--out", str(tmp_path))
    rows = json.loads((tmp_path / "fp8_sweep.json").read_text())["shapes"]["q_o"]["by_m"]["1"]
    assert [r.get("path") for r in rows if r.get("path")] == ["dequantize", "bf16"]
    assert len(rows) > 2 and all(r["ok"] and r["us"] > 0 for r in rows)
    # fp8 x: checked at e4m3's rounding of x (about 2e-2 here), the rest at bfloat16's
    assert {bool(r["config"] and r["config"]["x_fp8"]) for r in rows} == {False, True}
    assert all(r["rel_err"] < 1e-2 for r in rows if not (r["config"] and r["config"]["x_fp8"]))
    table = json.loads((tmp_path / "fp8_tilings.json").read_text())
    assert table["_about"] == "earlier" and table["1,1,1,1,1"] == {"1": "z"}
    assert table["64,1,96,16,32"]["512"] == "y" and table["64,1,96,16,32"]["1"] != "x"


def test_decode_step_times_each_tiling_against_the_default(tmp_path):
    run_script("decode_step.py", "--tiny", "--shapes", "1x48,8x64", "--tilings", "num_splits=1", "--out", str(tmp_path))
    runs = json.loads((tmp_path / "decode_step.json").read_text())["runs"]
    assert [(r["batch"], r["overrides"]) for r in runs] == [(1, {}), (1, {"num_splits": 1}), (8, {}), (8, {"num_splits": 1})]
    assert all(r["step_ms"] > 0 and r["tiling"]["num_splits"] >= 1 for r in runs)
    assert [r["vs_default"] for r in runs[::2]] == [1.0, 1.0]


def test_profile_step_replays_the_engines_step(tmp_path):
    out = tmp_path / "not-yet"  # the script makes its --out folder
    run_script("profile_step.py", "--tiny", "--k", "0,1", "--context", "40", "--steps", "3", "--out", str(out))
    configs = json.loads((out / "profile.json").read_text())["configs"]
    assert set(configs) == {"b=1 k=0", "b=1 k=1"}
    assert all({"main_forward", "verify"} <= {p["part"] for p in c["parts"]} for c in configs.values())
    assert all(c["replayed_step_ms"] > 0 and c["replayed_step_requests"] == 1 for c in configs.values())


def test_defaults_starts_a_131072_context_model_with_every_default(tmp_path):
    """Issue 18's new user: a 131072-token config, no options. The CPU pool is the
    kv_cache_memory_bytes default's, capped at max_num_seqs requests of max_model_len."""
    run_script("defaults.py", "--tiny", "--out", str(tmp_path))
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("*_defaults_tiny.json")]
    assert result["max_model_len"] == 131072 and result["sized_by"] == "kv_cache_memory_bytes"
    assert result["pool_tokens"] >= 131072 and result["pool_gib"] <= 2.0
    assert result["peak_rss_gib"] < 8  # it was 17.8 GiB before the pool was sized from memory


def test_moe_tp_times_both_ways_of_meeting_the_experts(tmp_path):
    """The gathered form (the engine's) and the all-to-all alternative agree (the script
    checks it) and are both timed."""
    run_script("moe_tp.py", "--tiny", "--out", str(tmp_path))
    rows = json.loads(next(tmp_path.glob("*_cpu_moe_tp.json")).read_text())["rows"]
    assert [(r["devices"], r["tokens"]) for r in rows] == [(2, 8)]
    assert rows[0]["gathered (psum) ms"] > 0 and rows[0]["all-to-all ms"] > 0


def test_moe_floors_from_shapes_alone(tmp_path):
    """--floors-only: each model's batch-1 plain and MTP k=1 steps' bytes from its shapes,
    with no weights made. The MTP step reads more than the plain one (the experts of a
    second row, the MTP module, the LM head again) and less than twice it (the dense
    weights are read once for both rows), so the tokens/s ratio at the floors lies
    strictly between 1 and 2."""
    run_script("moe.py", "--tiny", "--floors-only", "--models", "moonlight,glm45_air_fp8", "--out", str(tmp_path))
    floors = json.loads((tmp_path / "moe_floors.json").read_text())["floors"]
    assert [f["model"] for f in floors] == ["moonlight", "glm45_air_fp8"]
    for f in floors:
        assert f["plain_bytes"] < f["mtp_k1_bytes"] < 2 * f["plain_bytes"]
        assert f["mtp_k1_over_plain_at_floors"] == pytest.approx(2 * f["plain_bytes"] / f["mtp_k1_bytes"])


def test_moe_kernels_and_an_fp8_moe_model_end_to_end(tmp_path):
    """The MoE/MLA benchmark's rows: the kernels (interpret mode; the expert layer also
    with fp8 experts) and the tiny GLM-4.5-Air-FP8-shaped engine (fp8 weights and
    experts; the Moonlight one runs the same code), MTP k=1 with oracle drafts accepting
    every draft, a long prompt's time to its first token."""
    run_script("moe.py", "--tiny", "--parts", "experts,mla,e2e", "--fp8", "--models", "glm45_air_fp8", "--out",
               str(tmp_path), "--tag", "_smoke")
    results = json.loads((tmp_path / "moe_smoke.json").read_text())
    rows = {row["scenario"]: row for row in results["rows"]}
    assert {row["part"] for row in rows.values()} == {"experts", "mla", "e2e"}
    assert all(math.isfinite(row["value"]) and row["value"] > 0 for row in rows.values())
    assert any(name.startswith("expert layer, 8 tokens") for name in rows)
    assert any(name.startswith("fp8 expert layer, 8 tokens") for name in rows)
    assert any(name.startswith("MLA verify k+1=2") for name in rows)
    assert any(name.startswith("MLA decode beside a 12-row prefill chunk") for name in rows)
    assert any(name.startswith("MLA prefill, a 12-row chunk") for name in rows)
    assert any(name.startswith("MLA prefill, split form, a 12-row chunk") for name in rows)
    # (heads, R, Dr, Dn, Dv, context bucket) -> {row bucket: an own-rows tiling or "absorbed"}
    (entry,) = json.loads((tmp_path / "mla_prefill_paths.json").read_text())["4,32,16,16,16,64"].values()
    assert entry == "absorbed" or OwnRowsConfig(*entry)
    assert any(name.startswith("fp8 expert layer by pairs, 8 tokens") for name in rows)
    assert any(name.startswith("fp8 expert layer dequantized first, 8 tokens") for name in rows)
    experts = json.loads((tmp_path / "expert_paths.json").read_text())  # read as kernels/expert_paths.json is
    assert set(experts["8,32,16"]) == set(experts["8,32,16,16"]) == {"2", "16"}
    mtp = rows["glm45_air_fp8 b1 MTP k=1 oracle drafts: tokens/s over plain"]
    assert "acceptance length 2.00" in mtp["note"] and "output equal to plain: True" in mtp["note"]
    assert not results.get("failed_parts") and not results.get("skipped_over_budget")
    assert "| e2e | glm45_air_fp8 b3 decode" in (tmp_path / "moe_smoke.md").read_text()
    ttft = rows["glm45_air_fp8 prefill 40 tokens, chunk 16: TTFT"]  # 3 chunks, against the FLOP floor
    assert 0 < ttft["floor_ratio"] < 1 and "GFLOP" in ttft["note"]


def test_host_measures_both_output_kinds_and_the_stream(tmp_path):
    """benchmarks/host.py (CPU by design): the step's host time with a cumulative output
    every step and with one at the end, and the stream's per-token times."""
    run_script("host.py", "--steps", "5", "--stream-tokens", "700", "--batch", "2", "--out", str(tmp_path))
    results = json.loads((tmp_path / "host.json").read_text())
    for step in (results["step"], results["step"]["final_only"]):
        assert 0 < step["host_ms"] <= step["step_ms"] and step["device_wait_ms"] >= 0 and step["host_cpu_ms"] > 0
        assert step["tokens_per_request_step"] == 1
    assert results["stream"]["tokens"] == 700 and results["stream"]["late_over_early"] > 0


def test_host_measures_mtp_steps_with_every_oracle_draft_accepted(tmp_path):
    """--mtp-k 1: the same step measurements with MTP and oracle drafts, 2 tokens a step."""
    run_script("host.py", "--steps", "5", "--stream-tokens", "700", "--batch", "2", "--mtp-k", "1", "--out", str(tmp_path))
    results = json.loads((tmp_path / "host.json").read_text())
    assert results["mtp_k"] == 1
    for step in (results["step"], results["step"]["final_only"]):
        assert 0 < step["host_ms"] <= step["step_ms"] and step["tokens_per_request_step"] == 2


def tiny_tekken(num_special: int = 3) -> dict:
    """A tekken file of the 256 bytes ranked by value, then "ab", "abc", " {" and "é"
    (two bytes); a token's id is its rank after the specials."""
    import base64

    pieces = [bytes([b]) for b in range(256)] + [b"ab", b"abc", b" {", "é".encode()]
    return {"config": {"pattern": r"\s?\S+|\s+", "default_vocab_size": num_special + len(pieces),
                       "default_num_special_tokens": num_special},
            "vocab": [{"rank": r, "token_bytes": base64.b64encode(p).decode()} for r, p in enumerate(pieces)]}


def test_tekken_tokenizer_keeps_tiktoken_ranks_as_ids_after_the_specials():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tekken_tokenizer import convert

    tokenizer = convert(tiny_tekken())
    ab, abc, brace, e_acute = (3 + 256 + i for i in range(4))
    # merges by rank: "abc" whole, then "ab"; bytes outside any merge as themselves
    assert tokenizer.encode("abcab").ids == [abc, ab]
    assert tokenizer.encode("ba {é").ids == [3 + ord("b"), 3 + ord("a"), brace, e_acute]
    assert tokenizer.encode("x\x00").ids == [3 + ord("x"), 3]
    assert tokenizer.token_to_id("</s>") == 2 and tokenizer.get_vocab_size() == 3 + 260
    text = 'ab {"é": abc}\n'
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_structured_outputs_constrained_against_free_with_a_given_tokenizer(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tekken_tokenizer import convert

    convert(tiny_tekken()).save(str(tmp_path / "tokenizer.json"))
    run_script("structured.py", "--tiny", "--k", "0", "--tokenizer", str(tmp_path / "tokenizer.json"),
               "--temperature", "0.7", "--out", str(tmp_path))
    (saved,) = tmp_path.glob("*_structured_tiny_tokenizer_t0.7.json")
    results = json.loads(saved.read_text())
    assert results["tokenizer"].endswith("tokenizer.json") and results["temperature"] == 0.7
    constrained = results["rows"]["k=0 json_schema"]
    assert constrained["tokens"] == results["rows"]["k=0 unconstrained"]["tokens"] > 0
    same = results["rows"]["k=0 unconstrained, same lengths"]
    assert same["tokens"] == constrained["tokens"] and constrained["vs_same_lengths"] > 0
    assert 0 < constrained["vs_unconstrained"] and constrained["grammar_alone_ms_per_step"] > 0
    assert all(max(out) < 3 + 260 for out in constrained["outputs"])
    # when each step's fill reached llguidance, after its start, and when the engine came for it
    timeline = constrained["fill_timeline"]
    assert timeline["fills"] > 0 and 0 < timeline["ms_start_to_llguidance"] and 0 < timeline["ms_start_to_wanted"]
    assert 0 <= timeline["share_in_llguidance_before_wanted"] <= 1
    # the replay takes the run's own vocabulary: its tokens walk the grammar as they did
    run_script("grammar_replay.py", str(saved), "--threads", "1", "--families", "1,2")
    replay = json.loads(saved.with_name(f"{saved.stem}_grammar_replay.json").read_text())
    assert replay["single_masks"]["masks"] == sum(map(len, constrained["outputs"]))
    assert set(replay["families"]) == {"1", "2"} and all(r["1"]["fill_ms_per_step"] > 0 for r in replay["families"].values())


def test_dispatch_times_a_bare_program_and_the_engines_step_per_argument(tmp_path):
    run_script("dispatch.py", "--leaves", "4", "--layers", "1,2", "--steps", "4", "--sampling", "0:1,json",
               "--out", str(tmp_path))
    results = json.loads((tmp_path / "dispatch.json").read_text())
    assert [row["arguments"] for row in results["leaves"]] == [5]
    one, one_masked, two, _ = results["engine"]
    assert two["arguments"] > one["arguments"]  # a layer's weights and cache arrays are arguments of their own
    assert all(row["us_per_argument"] > 0 for row in results["leaves"] + results["engine"])
    assert all(row["idle_dispatch_ms"] > 0 and row["arguments_alone_ms"] > 0 for row in results["engine"])
    # a constrained step's second program is timed apart, in the loop and with the device idle
    assert one_masked["finish_dispatch_ms"] > 0 and one_masked["idle_finish_ms"] > 0
    assert one["finish_dispatch_ms"] == one["idle_finish_ms"] == 0


def test_sampling_stages_timed_for_every_batch_and_row_count(tmp_path):
    run_script("sampling.py", "--batches", "1,3", "--rows", "1,2", "--vocab", "300", "--calls", "2", "--out", str(tmp_path),
               "--stages", "argmax,restrict,top_logprobs_chunks_512,verify")
    results = json.loads((tmp_path / "sampling.json").read_text())
    stages = {"argmax", "restrict", "restrict_sort", "restrict_search_1", "restrict_search_2", "restrict_search_4",
              "top_logprobs_chunks_512", "verify_and_sample"}
    for b, r in ((1, 1), (1, 2), (3, 1), (3, 2)):
        rows = [row for row in results["rows"] if (row["batch"], row["rows"]) == (b, r)]
        assert {row["stage"] for row in rows} == stages
        assert all(row["us_queued"] > 0 and row["us_alone_median"] > 0 for row in rows)
    assert results["vocab"] == 300 and "RESTRICT_SEARCH_FROM_ROWS entry: " in (tmp_path / "sampling.md").read_text()


def test_step_kernels_counts_what_an_optimised_gpu_program_launches():
    """benchmarks/step_kernels.py's reading of XLA:GPU's optimised HLO: the entry's
    arguments, and every entry instruction that launches work, by kind (XLA's GEMM fusions and cuBLAS calls as
    gemm, Pallas' Triton and Mosaic GPU calls as pallas, other fusions, copies, sorts),
    none of the views, tuples and arguments that launch nothing, charged to the step's
    part its op_name names. The program below is written by hand, as XLA prints one."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_kernels import arguments, launched, summary

    hlo = """HloModule jit_step

%fused_computation (param_0: f32[8]) -> f32[8] {
  ROOT %param_0 = f32[8]{0} parameter(0)
}

ENTRY %main.9 (p0: bf16[8,64], p1: bf16[64,64]) -> (bf16[8,64], s32[8]) {
  %p0 = bf16[8,64]{1,0} parameter(0), metadata={op_name="x"}
  %p1 = bf16[64,64]{1,0} parameter(1)
  %constant.1 = s32[] constant(0)
  %bitcast.2 = bf16[8,1,64]{2,1,0} bitcast(%p0)
  %gemm_fusion_dot.3 = bf16[8,64]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%g, metadata={op_name="jit(step)/main_forward/dot_general"}
  %cublas-gemm.1.0 = (bf16[8,64]{1,0}, s8[0]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/verify/dot_general"}
  %get-tuple-element.4 = bf16[8,64]{1,0} get-tuple-element(%cublas-gemm.1.0), index=0
  %pallas_call.5 = bf16[8,64]{1,0} custom-call(%p0), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/main_forward/jit(kernel)/pallas_call"}
  %pallas_call.6 = bf16[8,64]{1,0} custom-call(%p0), custom_call_target="triton_kernel_call_ffi", metadata={op_name="jit(step)/draft/draft_layer/pallas_call"}
  %loop_add_fusion = bf16[8,64]{1,0} fusion(%pallas_call.5, %pallas_call.6), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/main_forward/add"}
  %sort.7 = s32[8]{0} sort(%constant.1), dimensions={0}, to_apply=%c, metadata={op_name="jit(step)/carry_out/sort"}
  %copy.8 = s32[8]{0} copy(%sort.7)
  ROOT %tuple.9 = (bf16[8,64]{1,0}, s32[8]{0}) tuple(%loop_add_fusion, %copy.8)
}
"""
    got = launched(hlo)
    assert [(k["name"], k["kind"]) for k in got] == [
        ("gemm_fusion_dot.3", "gemm"), ("cublas-gemm.1.0", "gemm"), ("pallas_call.5", "pallas"),
        ("pallas_call.6", "pallas"), ("loop_add_fusion", "fusion"), ("sort.7", "sort"), ("copy.8", "copy")]
    assert summary(got) == {"kernels": 7, "by_kind": {"gemm": 2, "pallas": 2, "fusion": 1, "sort": 1, "copy": 1},
                            "by_part": {"main_forward": 3, "verify": 1, "draft": 1, "carry_out": 1, "other": 1}}
    assert arguments(hlo) == 2  # the entry's parameters, not the fused computation's


def test_route_sweep_checks_both_routings_and_writes_the_table_the_engine_reads(tmp_path):
    """route_sweep.py on the CPU (interpret mode): both paths agree, and its table
    names a path for every measured (experts, k) and pairs bucket, in the format
    kernels/route.py reads; --update keeps the earlier table's other entries."""
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"_note": "x", "64,6": {"64": "kernel"}}))
    run_script("route_sweep.py", "--tiny", "--rows", "2,8", "--update", str(earlier), "--out", str(tmp_path))
    rows = json.loads((tmp_path / "route_sweep.json").read_text())["rows"]
    assert {(r["model"], r["rows"]) for r in rows} == {(m, n) for m in ("moonlight", "glm45_air_fp8") for n in (2, 8)}
    assert all(r["kernel_ok"] for r in rows)
    written = json.loads((tmp_path / "route_paths.json").read_text())
    assert written["64,6"]["64"] == "kernel" and set(written["8,2"]) == {"4", "16"}
    assert all(v in ("kernel", "xla") for k, b in written.items() if not k.startswith("_") for v in b.values())
