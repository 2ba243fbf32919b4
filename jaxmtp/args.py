"""Command-line options derived from config dataclasses: each field of EngineConfig (and
of the server's ServerConfig) is an option --kebab-name with the field's type, default,
choices and help text, so that these are written once, in the dataclass. `jaxmtp
generate` and `jaxmtp serve` share the engine's options."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from jaxmtp.engine.engine_config import EngineConfig

# The shipped models: checkpoints/ beside the package in a checkout (and an editable
# install), jaxmtp/checkpoints/ inside it when installed from a wheel (pyproject's package-dir).
_PACKAGE = Path(__file__).resolve().parent
CHECKPOINTS = next((p for p in (_PACKAGE.parent / "checkpoints", _PACKAGE / "checkpoints") if p.is_dir()),
                   _PACKAGE.parent / "checkpoints")
DEFAULT_MODEL = str(CHECKPOINTS / "stories260K-mtp")  # stories260K with its trained MTP head
DEFAULT_BASE = str(CHECKPOINTS / "stories260K")

# Where the command line's defaults differ from EngineConfig's (the library's): serving
# workloads share prefixes (system prompts, chat turns), so prefix caching is on, and a
# model that ships MTP weights drafts with them.
CLI_ENGINE_DEFAULTS = {"enable_prefix_caching": True, "num_speculative_tokens": None}
DEFAULT_SPECULATIVE_TOKENS = 2
CLI_ENGINE_HELP = {
    "num_speculative_tokens": (
        f"MTP draft tokens per step (default: {DEFAULT_SPECULATIVE_TOKENS} if the model has MTP weights, else 0)"
    ),
}


def json_value(text: str):
    """A dict option's value, JSON as vLLM's command line takes it (--speculative-config '{...}')."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}") from None


TYPES = {"str": str, "int": int, "float": float, "dict": json_value}


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already states it
    ("(default...", "no default"); a subcommand has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        states_it = "(default" in text or "no default" in text
        subcommand = not action.option_strings and action.default is None  # a command's line, no option
        if not states_it and action.default is not argparse.SUPPRESS and not subcommand:
            text += " (default: %(default)s)"
        return text


def add_options(parser: argparse.ArgumentParser, cls: type, defaults: dict | None = None, helps: dict | None = None):
    """One option per field of the dataclass `cls` whose metadata does not say cli=False;
    `defaults` and `helps` replace a field's default and help text on the command line."""
    defaults, helps = defaults or {}, helps or {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        default = defaults.get(f.name, f.default)
        text = helps.get(f.name, f.metadata["help"]).replace("%", "%%")
        flag = "--" + f.name.replace("_", "-")
        kind = f.type.split(" ")[0]  # "int | None" -> "int"
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif kind.startswith("list["):
            parser.add_argument(flag, nargs="+", type=TYPES[kind[5:-1]], default=default, help=text)
        else:
            metavar = "JSON" if kind == "dict" else None
            parser.add_argument(flag, type=TYPES[kind], default=default, choices=f.metadata["choices"], metavar=metavar,
                                help=text)


def option_values(args: argparse.Namespace, cls: type) -> dict:
    """The parsed values of the options add_options made for `cls`, by field name."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.metadata.get("cli", True)}


def add_model_args(parser: argparse.ArgumentParser, positional: bool = False) -> None:
    """--model, and with `positional` also MODEL as the first argument (as `vllm serve`)."""
    if positional:
        text = f"model folder or Hugging Face id, as --model (default: {DEFAULT_MODEL})"
        parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL", help=text)
    parser.add_argument("--model", default=None, help=f"model folder or Hugging Face id (default: {DEFAULT_MODEL})")


def resolve_model(args: argparse.Namespace) -> str:
    """The model the command line names; a ValueError if MODEL and --model disagree."""
    positional = getattr(args, "model_positional", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"MODEL ({positional}) and --model ({args.model}) name different models: give one")
    return positional or args.model or DEFAULT_MODEL


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    add_model_args(parser, model_positional)
    add_options(parser, EngineConfig, CLI_ENGINE_DEFAULTS, CLI_ENGINE_HELP)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's keyword arguments from the parsed engine options."""
    kwargs = option_values(args, EngineConfig)
    if kwargs["num_speculative_tokens"] is None and kwargs["speculative_config"] is not None:
        kwargs["num_speculative_tokens"] = 0  # speculative_config gives it
    if kwargs["num_speculative_tokens"] is None:
        from jaxmtp.loading import hub
        from jaxmtp.models.registry import load_config

        cfg = load_config(hub.resolve_model(resolve_model(args), kwargs["revision"]))
        kwargs["num_speculative_tokens"] = DEFAULT_SPECULATIVE_TOKENS if cfg.num_mtp_modules else 0
    return kwargs
