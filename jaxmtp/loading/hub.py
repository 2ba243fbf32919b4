"""Model names as users give them: a folder, or a Hugging Face id ("org/name") resolved
through huggingface_hub: its local cache first (HF_HOME / HF_HUB_CACHE), a download only
when online and allowed (HF_HUB_OFFLINE=1 forbids it)."""

from __future__ import annotations

import re
from pathlib import Path

# what the engine reads from a model repository; nothing else is downloaded
MODEL_FILES = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
    "special_tokens_map.json", "*.safetensors", "model.safetensors.index.json",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def resolve_model(model: str | Path, revision: str | None = None) -> Path:
    """The local folder of `model`: the folder itself if it exists, else the snapshot of
    the Hugging Face repository of that id at `revision` (default: main)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hugging Face ids, and {model!s} is a local folder")
        return path
    if not _REPO_ID.match(str(model)):
        raise FileNotFoundError(f"model folder {model!s} does not exist (and it is no Hugging Face id, org/name)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(str(model), revision=revision, allow_patterns=MODEL_FILES))
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise FileNotFoundError(
            f"model {model!s} (revision {revision or 'main'}) is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and {where}"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError, HfHubHTTPError) as err:
        raise FileNotFoundError(f"model {model!s} (revision {revision or 'main'}): {err}") from None
