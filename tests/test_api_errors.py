"""Bad input: each a ValueError or FileNotFoundError naming the problem, and the engine
stays usable for other requests."""

from __future__ import annotations

import json

import pytest

from conftest import STORIES
from jaxmtp import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(STORIES, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ([1, 512], SamplingParams(), "out of vocabulary"),
        ([1, -3], SamplingParams(), "out of vocabulary"),
        ([1] * 500, SamplingParams(max_tokens=20), "exceeds the model's context of 512"),
        ([1], SamplingParams(logprobs=21), "logprobs must be <= 20"),
        ([1], SamplingParams(logit_bias={5: 1.0, 512: 2.0}), r"logit_bias has token ids out of vocabulary \(size 512\): \[512\]"),
        ([1], SamplingParams(allowed_token_ids=[3, 600]), r"allowed_token_ids has token ids out of vocabulary"),
    ],
)
def test_bad_requests_raise_and_engine_stays_usable(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params, use_tqdm=False)
    out = llm.generate([[1]], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def test_one_bad_prompt_in_a_batch_rejects_the_batch_before_anything_runs(llm):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([[1, 5], [1, 9999]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(min_p=1.5), "min_p must be in"),
        (dict(n=0), "n must be an integer >= 1"),
        (dict(seed=-1), "seed must be a non-negative integer"),
        (dict(stop=[""]), "stop must be"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_missing_model_folder_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(tmp_path / "empty")
    folder = tmp_path / "noweights"
    folder.mkdir()
    (folder / "config.json").write_text((STORIES / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        LLM(folder)


def test_unknown_architecture_and_missing_tensor(tmp_path):
    import shutil

    folder = tmp_path / "gpt"
    shutil.copytree(STORIES, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        LLM(folder)
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6}))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.5\."):  # layer 5's first tensor read
        LLM(folder)


def test_speculation_without_mtp_weights_is_an_error():
    with pytest.raises(ValueError, match="needs MTP weights"):
        LLM(STORIES, num_speculative_tokens=1)


def test_vllm_prompt_dicts_and_get_tokenizer(llm):
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    plain = llm.generate(["Once upon a time", [1, 403]], greedy, use_tqdm=False)
    dicts = llm.generate([{"prompt": "Once upon a time"}, {"prompt_token_ids": [1, 403]}], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_tokenizer() is llm.engine.tokenizer
    with pytest.raises(ValueError, match=r"prompt fields \['multi_modal_data'\] are not supported"):
        llm.generate([{"prompt": "x", "multi_modal_data": {}}], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of prompt and prompt_token_ids"):
        llm.generate([{"prompt": "x", "prompt_token_ids": [1]}], greedy, use_tqdm=False)


def test_speculative_config_in_vllm_form():
    from jaxmtp.engine.engine_config import EngineConfig

    assert EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 3}).num_speculative_tokens == 3
    for bad, message in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
        ({"num_speculative_tokens": 2, "draft_model": "x"}, r"keys \['draft_model'\] are not supported"),
        ({"method": "mtp"}, "needs num_speculative_tokens"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="disagree"):
        EngineConfig(num_speculative_tokens=1, speculative_config={"num_speculative_tokens": 2})
