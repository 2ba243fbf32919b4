"""The `jaxmtp` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, STORIES, greedy


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "jaxmtp.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_generate_prints_a_story():
    result = run_cli("generate", "Once upon a time", "--max-tokens", "40")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Once upon a time, there was a little girl named Lily.")


def test_generate_samples_as_the_models_generation_config_says_unless_told(tmp_path, capsys):
    """generation_config.json's fields are the defaults of the options left out (as the
    Python API's and the server's); an option given wins; neither: greedy, 128 tokens."""
    import json
    import shutil

    from jaxmtp import LLM
    from jaxmtp.cli import main

    folder = tmp_path / "stories"
    shutil.copytree(STORIES, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    # top_k 1: greedy, whatever the temperature
    (folder / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 6, "top_k": 1}))
    llm = LLM(folder, max_num_seqs=1)
    greedy_text = [llm.generate(["Once"], greedy(n), use_tqdm=False)[0].outputs[0].text for n in (6, 9)]
    for extra, want in (([], greedy_text[0]), (["--max-tokens", "9"], greedy_text[1])):
        assert main(["generate", "Once", "--model", str(folder), "--max-num-seqs", "1", "--temperature", "1.5",
                     *extra]) == 0
        assert capsys.readouterr().out == "Once" + want + "\n"


def test_generate_reports_bad_input_without_a_traceback():
    result = run_cli("generate", "Once", "--max-tokens", "0")
    assert result.returncode == 2
    assert "max_tokens must be an integer >= 1" in result.stderr
    assert "Traceback" not in result.stderr


# ----- options derived from EngineConfig and ServerConfig (no model is loaded) ----------


def subcommand_parsers():
    import argparse

    from jaxmtp.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_every_option_has_help_with_its_default():
    import argparse

    from jaxmtp.args import HelpFormatter

    from jaxmtp.cli import build_parser

    parsers = dict(subcommand_parsers())
    while parsers:
        name, parser = parsers.popitem()
        assert parser.formatter_class is HelpFormatter, name  # it appends the default a help leaves out
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):  # `jaxmtp bench latency` and the others
                parsers.update({f"{name} {mode}": sub for mode, sub in action.choices.items()})
            elif not isinstance(action, argparse._HelpAction):
                text = formatter._expand_help(action)
                assert ("(default" in text or "no default" in text) and "(default: None)" not in text, (name, action.dest, text)
    assert "(default: None)" not in build_parser().format_help()
    rendered = " ".join(subcommand_parsers()["serve"].format_help().split())
    assert "tokens per KV cache page (default: 16)" in rendered
    assert "shared prefixes (default: True)" in rendered.split("--no-enable-prefix-caching")[-1][:80]


def test_engine_options_are_engine_config_fields_with_their_defaults():
    import dataclasses

    from jaxmtp.args import CLI_ENGINE_DEFAULTS
    from jaxmtp.engine.engine_config import EngineConfig
    from jaxmtp.server.config import ServerConfig

    parsers = subcommand_parsers()
    server_options = {f.name for f in dataclasses.fields(ServerConfig)}
    for name in ("generate", "serve"):
        by_dest = {a.dest: a for a in parsers[name]._actions}
        for f in dataclasses.fields(EngineConfig):
            if not f.metadata["cli"]:
                # (disable_log_stats: LLM(...)'s; serve's --disable-log-stats is the server's own)
                assert f.name not in by_dest or (name == "serve" and f.name in server_options), (name, f.name)
                continue
            action = by_dest[f.name]
            assert action.option_strings == ["--" + f.name.replace("_", "-")] + (
                ["--no-" + f.name.replace("_", "-")] if f.type == "bool" else []
            ), (name, f.name)
            assert action.default == CLI_ENGINE_DEFAULTS.get(f.name, f.default), (name, f.name)
            if f.metadata["choices"] is not None:
                assert tuple(action.choices) == f.metadata["choices"], (name, f.name)


def test_engine_kwargs_keep_the_command_lines_own_defaults():
    from conftest import MTP_MODEL, STORIES
    from jaxmtp.args import engine_kwargs
    from jaxmtp.cli import build_parser
    from jaxmtp.engine.engine_config import EngineConfig

    parser = build_parser()
    kwargs = engine_kwargs(parser.parse_args(["generate", "--model", str(MTP_MODEL)]))
    assert kwargs["enable_prefix_caching"] is True and kwargs["num_speculative_tokens"] == 2
    EngineConfig(**kwargs)  # every option the command line passes is a field
    assert engine_kwargs(parser.parse_args(["generate", "--model", str(STORIES)]))["num_speculative_tokens"] == 0
    off = parser.parse_args(["serve", "--model", str(MTP_MODEL), "--no-enable-prefix-caching", "--no-async-scheduling",
                             "--num-speculative-tokens", "1", "--max-logprobs", "5"])
    kwargs = engine_kwargs(off)
    assert (kwargs["enable_prefix_caching"], kwargs["async_scheduling"]) == (False, False)
    assert (kwargs["num_speculative_tokens"], kwargs["max_logprobs"]) == (1, 5)


def test_serve_takes_the_model_as_its_first_argument_or_as_model():
    import pytest

    from jaxmtp.args import DEFAULT_MODEL, resolve_model
    from jaxmtp.cli import build_parser

    parser = build_parser()
    assert resolve_model(parser.parse_args(["serve", "some/folder", "--port", "1"])) == "some/folder"
    assert resolve_model(parser.parse_args(["serve", "--model", "some/folder"])) == "some/folder"
    assert resolve_model(parser.parse_args(["serve", "a", "--model", "a"])) == "a"
    assert resolve_model(parser.parse_args(["serve"])) == DEFAULT_MODEL
    assert resolve_model(parser.parse_args(["generate"])) == DEFAULT_MODEL
    with pytest.raises(ValueError, match="name different models"):
        resolve_model(parser.parse_args(["serve", "a", "--model", "b"]))


def test_the_cli_and_the_server_do_not_import_each_other():
    code = (
        "import sys, jaxmtp.server.launch, jaxmtp.server; assert 'jaxmtp.cli' not in sys.modules, 'server imports cli'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
