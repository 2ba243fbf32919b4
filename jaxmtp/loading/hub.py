"""Model names as users give them: a folder, or a Hugging Face id ("org/name") resolved
through huggingface_hub: its local cache first (HF_HOME / HF_HUB_CACHE), a download only
when online and allowed (HF_HUB_OFFLINE=1 forbids it)."""

from __future__ import annotations

import os
import re
from pathlib import Path

# what the engine reads from a tokenizer's repository, and from a model's; nothing else is downloaded
TOKENIZER_FILES = [
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "additional_chat_templates/*.jinja",
    "special_tokens_map.json",
]
MODEL_FILES = [
    "config.json", "generation_config.json", *TOKENIZER_FILES, "*.safetensors", "model.safetensors.index.json",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def written_as_path(name: str | Path) -> bool:
    """Whether name is a path rather than a Hugging Face id: a Path, a name from the root,
    the home folder or the current or parent folder, or one under a folder that exists
    here ("checkpoints/stories260K")."""
    if isinstance(name, Path):
        return True
    if name.startswith(("/", "./", "../", "~")):
        return True
    return os.sep in name and Path(name.split(os.sep)[0]).is_dir()


def resolve_model(model: str | Path, revision: str | None = None, files: list[str] = MODEL_FILES,
                  what: str = "model") -> Path:
    """The local folder of `model`: the folder itself if it exists, else the snapshot of
    the Hugging Face repository of that id at `revision` (default: main), of which only
    `files` are downloaded. `what` names the folder in errors."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hugging Face ids, and {model!s} is a local folder")
        return path
    if written_as_path(model) or not _REPO_ID.match(str(model)):  # a mistyped folder: nothing to look up on the Hub
        hint = "" if written_as_path(model) else " (and it is no Hugging Face id, org/name)"
        raise FileNotFoundError(f"{what} folder {model!s} does not exist{hint}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(str(model), revision=revision, allow_patterns=files))
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise FileNotFoundError(
            f"{what} {model!s} (revision {revision or 'main'}) is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and {where}"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError, HfHubHTTPError) as err:
        raise FileNotFoundError(f"{what} {model!s} (revision {revision or 'main'}): {err}") from None


def resolve_tokenizer(tokenizer: str | Path, revision: str | None = None) -> Path:
    """The local folder of a tokenizer given apart from its model, as resolve_model finds
    a model's (only the tokenizer's files are downloaded)."""
    return resolve_model(tokenizer, revision, TOKENIZER_FILES, "tokenizer")
