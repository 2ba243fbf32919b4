"""vLLM's engine options with vLLM's spellings (issue 35, items 4-6): each honoured, or
refused with a ValueError that names it, or accepted and logged where it changes nothing
for a JAX engine. Engines are small (max_model_len 128) and built without a warm-up."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest

from conftest import MTP_MODEL, ROOT, STORIES, golden_ids, greedy
from jaxmtp import LLM, SamplingParams
from jaxmtp.engine.engine_config import EngineConfig
from jaxmtp.loading.hub import resolve_model

ENGINE = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)
# what a generation_config.json may recommend, and the SamplingParams it makes
RECOMMENDED = {"temperature": 0.0, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.3,
               "max_new_tokens": 5}
RECOMMENDED_PARAMS = SamplingParams(temperature=0.0, top_p=0.9, top_k=7, min_p=0.05, repetition_penalty=1.3,
                                    max_tokens=5)
HELLO = [{"role": "user", "content": "Hi"}]


def stories_with(folder, generation: dict):
    """A copy of stories260K whose generation_config.json also holds `generation`."""
    shutil.copytree(STORIES, folder)
    shipped = json.loads((STORIES / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**shipped, **generation}))
    return folder


@pytest.fixture(scope="module")
def recommended(tmp_path_factory):
    return stories_with(tmp_path_factory.mktemp("models") / "recommended", RECOMMENDED)


@pytest.fixture(scope="module")
def llm(recommended):
    return LLM(recommended, **ENGINE)


# ----- generation_config ------------------------------------------------------------------


def test_generation_config_auto_makes_the_models_sampling_fields_the_defaults(llm):
    assert llm.engine.generation_defaults == {
        "temperature": 0.0, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.3, "max_tokens": 5}
    assert llm.get_default_sampling_params() == RECOMMENDED_PARAMS
    default = llm.generate([[1]], use_tqdm=False)[0].outputs[0]
    assert len(default.token_ids) == 5  # max_new_tokens, not SamplingParams' 16
    assert default.token_ids == llm.generate([[1]], RECOMMENDED_PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    chat = llm.chat(HELLO, use_tqdm=False)[0].outputs[0]  # chat generates as generate does
    assert chat.token_ids == llm.chat(HELLO, RECOMMENDED_PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert len(chat.token_ids) == 5
    *_, streamed = llm.stream([1])  # the engine's own default, for a request without SamplingParams
    assert streamed.outputs[0].token_ids == default.token_ids


def test_the_server_takes_the_generation_config_for_the_fields_a_request_leaves_out(llm, monkeypatch):
    """Over HTTP, as vLLM's: the request's own fields win, the generation config fills in
    the rest, and its max_new_tokens caps max_tokens."""
    from fastapi.testclient import TestClient

    from jaxmtp.server import ServerConfig, create_app

    made, add_request = [], llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda rid, prompt, params, **kw: (made.append(params),
                                                                                     add_request(rid, prompt, params, **kw)))
    with TestClient(create_app(llm.engine, "recommended", ServerConfig(disable_log_stats=True))) as http:
        assert http.post("/v1/completions", json=dict(prompt="Hi", top_k=3, max_tokens=50)).status_code == 200
        assert http.post("/v1/chat/completions", json=dict(messages=HELLO, temperature=0.5)).status_code == 200
    completion, chat = made
    assert (completion.top_k, completion.temperature, completion.top_p, completion.max_tokens) == (3, 0.0, 0.9, 5)
    assert (chat.temperature, chat.top_k, chat.repetition_penalty, chat.max_tokens) == (0.5, 7, 1.3, 5)


def test_generation_config_vllm_leaves_them_out_and_a_folder_gives_its_own(recommended, llm):
    plain = LLM(recommended, generation_config="vllm", **ENGINE)
    assert plain.engine.generation_defaults == {} and plain.get_default_sampling_params() == SamplingParams()
    # SamplingParams()'s 16 tokens at temperature 1 (a story from BOS, seeded by the engine's seed), not 5
    assert len(plain.generate([[1]], use_tqdm=False)[0].outputs[0].token_ids) > 5
    other = LLM(STORIES, generation_config=str(recommended), **ENGINE)
    assert other.get_default_sampling_params() == RECOMMENDED_PARAMS
    # the shipped models recommend nothing: their outputs stay SamplingParams()'s
    for model in (STORIES, MTP_MODEL):
        assert LLM(model, **ENGINE).get_default_sampling_params() == SamplingParams()


def test_generation_config_refusals(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"generation_config {re.escape(str(tmp_path))}: no such folder"):
        LLM(STORIES, generation_config=str(tmp_path), **ENGINE)
    bad = stories_with(tmp_path / "bad", {"temperature": -1.0})
    with pytest.raises(ValueError, match="generation_config's sampling defaults .*temperature must be >= 0"):
        LLM(bad, **ENGINE)


# ----- tokenizer, quantization --------------------------------------------------------------


def test_tokenizer_is_used_instead_of_the_models(tmp_path):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    shutil.copy(STORIES / "tokenizer.json", folder)
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    template = "{{ bos_token }}[own] {% for m in messages %}{{ m['content'] }}{% endfor %} ->"
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    own = LLM(STORIES, tokenizer=str(folder), **ENGINE)
    assert own.chat(HELLO, greedy(2), use_tqdm=False)[0].prompt == "<s>[own] Hi ->"
    assert LLM(STORIES, **ENGINE).get_tokenizer().apply_chat_template(HELLO, tokenize=False) == "<s>user: Hi\n"
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"tokenizer folder {re.escape(str(folder))} has no tokenizer.json"):
        LLM(STORIES, tokenizer=str(folder), **ENGINE)
    with pytest.raises(FileNotFoundError, match="tokenizer folder ./no-such-tokenizer does not exist"):
        LLM(STORIES, tokenizer="./no-such-tokenizer", **ENGINE)


def test_tokenizer_by_hugging_face_id_at_a_revision(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    repo = tmp_path / "models--org--tokenizer"
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    for commit, template in (("a" * 40, None), ("b" * 40, "{{ bos_token }}[b] {{ messages[0]['content'] }}")):
        (repo / "snapshots" / commit).mkdir(parents=True)
        shutil.copy(STORIES / "tokenizer.json", repo / "snapshots" / commit)
        (repo / "snapshots" / commit / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    at_b = LLM(STORIES, tokenizer="org/tokenizer", tokenizer_revision="b" * 40, **ENGINE)
    assert at_b.get_tokenizer().apply_chat_template(HELLO, tokenize=False) == "<s>[b] Hi"
    at_main = LLM(STORIES, tokenizer="org/tokenizer", **ENGINE)
    assert at_main.get_tokenizer().apply_chat_template(HELLO, tokenize=False) == "<s>user: Hi\n"


def test_quantization_fp8_takes_an_fp8_checkpoint_and_refuses_the_rest(tmp_path):
    for value in (None, "auto"):
        assert LLM(STORIES, quantization=value, **ENGINE).engine.model_config.quantization is None
    with pytest.raises(ValueError, match="quantization='fp8' needs an fp8 checkpoint.* does not quantize"):
        LLM(STORIES, quantization="fp8", **ENGINE)
    for value in ("awq", "gptq", "bitsandbytes"):
        with pytest.raises(ValueError, match=f"quantization must be one of .*got '{value}'"):
            LLM(STORIES, quantization=value, **ENGINE)
    hf = json.loads((STORIES / "config.json").read_text())
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    (tmp_path / "config.json").write_text(json.dumps({**hf, "quantization_config": fp8}))
    llm = LLM(tmp_path, quantization="fp8", load_format="dummy", **ENGINE)
    assert llm.engine.model_config.quantization is not None


# ----- options that change nothing here ---------------------------------------------------

NO_EFFECT = dict(trust_remote_code=True, enforce_eager=True, swap_space=8, disable_custom_all_reduce=True,
                 max_seq_len_to_capture=1024, compilation_config={"level": 3}, disable_log_stats=False)


def test_options_without_effect_are_accepted_logged_once_and_change_no_output(caplog):
    with caplog.at_level(logging.INFO, logger="jaxmtp"):
        llm = LLM(STORIES, **NO_EFFECT, **ENGINE)
    said = [r.getMessage() for r in caplog.records if "has no effect here" in r.getMessage()]
    assert sorted(message.split("=")[0] for message in said) == sorted(NO_EFFECT), said
    assert llm.generate([[1]], greedy(20), use_tqdm=False)[0].outputs[0].token_ids == golden_ids()[:20]
    with caplog.at_level(logging.INFO, logger="jaxmtp"):
        caplog.clear()
        LLM(STORIES, trust_remote_code=False, **ENGINE)  # the defaults say nothing
    assert not [r for r in caplog.records if "has no effect" in r.getMessage()]
    with pytest.raises(ValueError, match="swap_space must be a number >= 0"):
        LLM(STORIES, swap_space=-1, **ENGINE)


# ----- speculative_config -----------------------------------------------------------------


def test_speculative_config_takes_vllms_mtp_method_names():
    for method in ("mtp", "deepseek_mtp", "glm4_moe_mtp", "mimo_mtp"):
        spec = {"method": method, "num_speculative_tokens": 2}
        assert EngineConfig(speculative_config=spec).num_speculative_tokens == 2
    for method in ("ngram", "eagle", "eagle3", "medusa", "draft_model", "mlp_speculator"):
        with pytest.raises(ValueError, match=f"method '{method}' is not supported.*mtp, deepseek_mtp, .*glm4_moe_mtp"):
            EngineConfig(speculative_config={"method": method, "num_speculative_tokens": 2})
    for key in ("draft_tensor_parallel_size", "disable_by_batch_size", "prompt_lookup_max"):
        with pytest.raises(ValueError, match=rf"speculative_config keys \['{key}'\] are not supported"):
            EngineConfig(speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2, key: 1})


def test_deepseek_mtp_drafts_with_the_models_mtp_layers_and_the_start_is_logged(caplog):
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2, "model": str(MTP_MODEL)}
    with caplog.at_level(logging.INFO, logger="jaxmtp"):
        llm = LLM(MTP_MODEL, speculative_config=spec, **ENGINE)
    assert (llm.engine.config.num_speculative_tokens, llm.engine.num_draft_modules) == (2, 1)
    out = llm.generate([[1]], greedy(20), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == golden_ids()[:20] and out.spec_stats["drafted"] > 0
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model ")]
    assert len(started) == 1 and all(
        part in started[0] for part in (str(MTP_MODEL), "dtype float32", "method mtp", "num_speculative_tokens 2")
    ), started
    with pytest.raises(ValueError, match="speculative_config model 'org/draft' is not supported"):
        LLM(MTP_MODEL, speculative_config={**spec, "model": "org/draft"}, **ENGINE)


# ----- max_model_len, folders ---------------------------------------------------------------


def test_max_model_len_past_max_position_embeddings_needs_the_environment(monkeypatch):
    from jaxmtp.engine.model_options import ALLOW_LONG_MAX_MODEL_LEN, max_model_len
    from jaxmtp.models.registry import load_config

    for name in ALLOW_LONG_MAX_MODEL_LEN:
        monkeypatch.delenv(name, raising=False)
    long = dict(ENGINE, max_model_len=1024)
    refusal = r"max_model_len=1024 .* max_position_embeddings=512 .*VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 \(or JAXMTP_ALLOW"
    with pytest.raises(ValueError, match=refusal):
        LLM(STORIES, **long)
    for name in ALLOW_LONG_MAX_MODEL_LEN:
        with monkeypatch.context() as env:
            env.setenv(name, "1")
            assert max_model_len(EngineConfig(**long), load_config(STORIES)) == 1024
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert LLM(STORIES, **long).engine.max_model_len == 1024


@pytest.mark.parametrize("name", ["./checkpoints/storie260K", "checkpoints/storie260K", "../storie260K",
                                  "~/no-such-folder/storie260K", "/no-such-folder/storie260K"])
def test_a_mistyped_folder_is_a_missing_folder(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # where checkpoints/ is a folder
    with pytest.raises(FileNotFoundError, match=f"^model folder {re.escape(name)} does not exist$"):
        resolve_model(name)


def test_a_mistyped_folder_given_to_llm(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(FileNotFoundError, match="^model folder checkpoints/storie260K does not exist$"):
        LLM("checkpoints/storie260K", **ENGINE)


# ----- the command line ---------------------------------------------------------------------

SPEC_JSON = '{"method": "deepseek_mtp", "num_speculative_tokens": 2}'


def test_speculative_config_flag_parses_as_json(capsys):
    from jaxmtp.args import engine_kwargs
    from jaxmtp.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "--model", str(MTP_MODEL), "--speculative-config", SPEC_JSON])
    assert args.speculative_config == {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    assert EngineConfig(**engine_kwargs(args)).num_speculative_tokens == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculative-config", "{method: mtp}"])
    assert "argument --speculative-config: not valid JSON" in capsys.readouterr().err


def test_a_vllm_launch_line_parses_and_its_chat_template_renders_chats(tmp_path):
    from jaxmtp.cli import build_parser
    from jaxmtp.server.launch import launch_settings, load_engine

    template = tmp_path / "chat.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    args = build_parser().parse_args([
        "serve", str(MTP_MODEL), "--tokenizer", str(STORIES), "--trust-remote-code", "--enforce-eager",
        "--swap-space", "4", "--generation-config", "vllm", "--speculative-config", SPEC_JSON,
        "--chat-template", str(template), "--disable-log-stats", "--max-model-len", "128",
    ])
    config, model, kwargs, chat_template = launch_settings(args)
    assert model == str(MTP_MODEL) and config.disable_log_stats and "disable_log_stats" not in kwargs
    assert chat_template == template.read_text()
    given = {"tokenizer": str(STORIES), "trust_remote_code": True, "enforce_eager": True, "swap_space": 4.0,
             "generation_config": "vllm"}
    assert {name: kwargs[name] for name in given} == given
    assert EngineConfig(**kwargs).num_speculative_tokens == 2
    engine = load_engine(model, kwargs, chat_template)
    assert engine.tokenizer.apply_chat_template(HELLO, tokenize=False) == "<s><user>Hi"


def test_chat_template_as_a_string_or_a_file():
    from jaxmtp.server.launch import chat_template_source

    assert chat_template_source(None) is None
    # the option's own text, its escapes read as vLLM reads them
    assert chat_template_source("{% for m in messages %}{{ m['content'] }}\\n{% endfor %}é中") == \
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}é中"
    with pytest.raises(ValueError, match="chat_template file no/such/template.jinja does not exist"):
        chat_template_source("no/such/template.jinja")
    with pytest.raises(ValueError, match="chat_template does not compile"):
        chat_template_source("{% for m in messages %}")
