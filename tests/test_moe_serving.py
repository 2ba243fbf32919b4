"""A DeepSeek-V3 checkpoint folder laid out as the real ones ship (config.json, the
tokenizer files, sharded safetensors listed in model.safetensors.index.json, the MTP
layer at model.layers.{num_hidden_layers} with its copies of the embedding and head in
a shard of its own) loads and serves with MTP through LLM, `jaxmtp generate` and the
OpenAI-compatible server (the official openai client). One tiny checkpoint for the
module, built with transformers; its vocabulary is stories260K's, whose tokenizer it
ships."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import openai
import pytest

from conftest import ROOT, STORIES
from jaxmtp import LLM, SamplingParams
from test_moe_mtp import L, make_mtp_checkpoint
from test_server import ServerProcess

PROMPT = "Once upon a time"
MAX_TOKENS = 24
# the same engine shapes everywhere: LLM, the command and the server (whose step the
# command compiled into the shared XLA cache)
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=8, num_speculative_tokens=2, enable_prefix_caching=True)
ENGINE_ARGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "8", "--num-speculative-tokens", "2"]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)  # eos stops it, as it stops the server


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-serving") / "deepseek-v3-tiny"
    make_mtp_checkpoint(folder, "deepseek-qlora-yarn", vocab_size=512, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xla-cache")


@pytest.fixture(scope="module")
def served(checkpoint):
    """What LLM gives with MTP: the request's output, and the engine's params."""
    llm = LLM(checkpoint, **ENGINE)
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0], llm.engine.params


def test_the_folder_is_laid_out_as_the_real_checkpoints(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert config["num_hidden_layers"] == L and config["q_lora_rank"] and config["rope_parameters"]["rope_type"] == "yarn"
    weight_map = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 3 and not (checkpoint / "model.safetensors").exists()
    mtp = f"model.layers.{L}"
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens",
                 "self_attn.kv_b_proj", "mlp.experts.7.down_proj", "mlp.gate.e_score_correction_bias"):
        key = f"{mtp}.{name}" if name.endswith("bias") else f"{mtp}.{name}.weight"
        assert key in weight_map, key


def test_llm_serves_it_with_mtp_and_the_text_of_plain_decoding(checkpoint, served):
    out, params = served
    assert params.mtp[0].block.moe is not None and params.mtp[0].block.mla is not None
    assert params.mtp[0].lm_head is None  # the layer's copy of the head is the main model's
    plain = LLM(checkpoint, **{**ENGINE, "num_speculative_tokens": 0}).generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids and out.outputs[0].text == plain.outputs[0].text
    assert len(out.outputs[0].token_ids) > 4 and out.outputs[0].text
    assert out.spec_stats["accepted_per_position"][0] > 0  # drafts are accepted


def test_the_generate_command_serves_it(checkpoint, served, xla_cache):
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(xla_cache)}
    done = subprocess.run(
        [sys.executable, "-m", "jaxmtp.cli", "generate", PROMPT, "--model", str(checkpoint),
         "--max-tokens", str(MAX_TOKENS), *ENGINE_ARGS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == PROMPT + served[0].outputs[0].text + "\n"
    assert "[mtp] mean acceptance length" in done.stderr


def test_the_server_serves_it_to_the_openai_client(checkpoint, served, xla_cache, tmp_path):
    server = ServerProcess(tmp_path / "server.log", "--model", str(checkpoint), *ENGINE_ARGS,
                           "--compilation-cache-dir", str(xla_cache))
    try:
        client = openai.OpenAI(base_url=server.wait_ready().url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [checkpoint.name]
        full = client.completions.create(model=checkpoint.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        choice = full.choices[0]
        assert choice.text == served[0].outputs[0].text
        assert full.usage.completion_tokens == len(served[0].outputs[0].token_ids)
        spec = choice.model_extra["spec_stats"]
        assert len(spec["accepted_per_position"]) == 2 and spec["accepted"] > 0
        chunks = client.completions.create(model=checkpoint.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    finally:
        server.stop()
