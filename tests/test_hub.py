"""Models by Hugging Face id, from a cache folder made here (models--org--name/snapshots/
REV and refs/main, as huggingface_hub lays it out), offline."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, STORIES, golden_ids
from jaxmtp import LLM, SamplingParams
from jaxmtp.loading.hub import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A cache holding org/stories at two commits (main -> COMMIT), offline."""
    import huggingface_hub.constants as constants

    repo = tmp_path / "hub" / "models--org--stories"
    for commit in (COMMIT, OTHER):
        shutil.copytree(STORIES, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_an_id_resolves_to_its_cached_snapshot_at_main_or_a_revision(hub_cache):
    assert resolve_model("org/stories") == hub_cache / "models--org--stories" / "snapshots" / COMMIT
    assert resolve_model("org/stories", revision=OTHER).name == OTHER
    llm = LLM("org/stories", max_num_seqs=2, max_num_batched_tokens=16)
    out = llm.generate([[1]], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == golden_ids()[:10]


def test_an_id_not_in_the_cache_offline_is_a_clear_error(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"org/missing .*not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_model("org/missing")
    with pytest.raises(ValueError, match="revision='v2' applies to Hugging Face ids"):
        resolve_model(STORIES, revision="v2")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("no/such/folder")


def test_the_cli_generates_from_an_id_with_hf_hub_cache_and_offline_from_the_environment(tmp_path):
    repo = tmp_path / "models--org--stories"
    shutil.copytree(STORIES, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "jaxmtp.cli", "generate", "Once upon a time", "--model", "org/stories",
         "--max-tokens", "8", "--max-num-seqs", "1", "--max-num-batched-tokens", "16"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("Once upon a time") and len(out.stdout) > len("Once upon a time\n")
    assert str(ROOT) not in out.stdout
