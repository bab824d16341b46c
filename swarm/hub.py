"""Models named by their Hugging Face Hub id (ORG/NAME): the files a process needs, fetched into the Hub's cache.

huggingface_hub does the fetching, with its own settings: its cache (HF_HOME, HF_HUB_CACHE), HF_TOKEN for gated
models, HF_HUB_OFFLINE=1 for the cache alone, HF_ENDPOINT, its progress bars, and a download cut midway resumed
from where it stopped (a Range request). This module decides what to fetch, checks what it can before any
weight moves (the model's family, the disk's room), and says each of the Hub's refusals in one line.

A Hub model's folder is its snapshot in that cache (.../models--ORG--NAME/snapshots/COMMIT). `fetch_model` puts its
config, tokenizer and the weights' index there; the weights follow a file at a time as `load_tensors` asks for
tensors (`fetch_weight_files`), so that a block server fetches only the shards that hold its span and a gateway
only those that hold its embeddings, final norm and LM head.
"""

from __future__ import annotations

import fnmatch
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional

from swarm.protocol import HUB_ID, UnknownModelError

logger = logging.getLogger(__name__)

# what a process reads besides the weights: the config, the weights' index, the tokenizer and its chat template
SMALL_FILES = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken")
WEIGHTS_INDEX, SINGLE_WEIGHTS = "model.safetensors.index.json", "model.safetensors"
LOGGED_FILE_BYTES = 100_000_000  # a file this large gets a line of its own in the log as its download starts


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a Hub id; the caller has ruled out a local folder of that name first."""
    return HUB_ID.fullmatch(name) is not None and not name.endswith((".", "/"))


def fetch_model(repo_id: str, revision: str = "main") -> Path:
    """A Hub model's snapshot folder holding its config, tokenizer and weights' index (not the weights); its family
    is checked before anything but the config is fetched. With HF_HUB_OFFLINE=1, the cache's snapshot as it is."""
    from huggingface_hub import hf_hub_download

    with hub_errors(repo_id, revision):
        folder = Path(hf_hub_download(repo_id, "config.json", revision=revision)).parent
        _check_family(folder / "config.json", repo_id)
        if not _offline():
            _download(repo_id, folder, _small_files(repo_id, folder.name))
    return folder


def fetch_weight_files(folder: Path, filenames: Iterable[str]) -> None:
    """The files of a Hub snapshot folder that are not there yet, fetched into it (their sizes, from the Hub, checked
    against the free disk first); any other folder is left as it is."""
    repo_id = repo_of(folder)
    missing = sorted(name for name in set(filenames) if not (folder / name).is_file())
    if repo_id is None or not missing:
        return
    with hub_errors(repo_id, folder.name):
        sizes = {name: 0 for name in missing} if _offline() else _remote_sizes(repo_id, folder.name, missing)
        _download(repo_id, folder, sizes)


def repo_of(folder: Path) -> Optional[str]:
    """ORG/NAME of a snapshot folder of the Hub's cache layout (CACHE/models--ORG--NAME/snapshots/COMMIT), else None."""
    repo_folder = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo_folder.startswith("models--"):
        return None
    return "/".join(repo_folder.split("--")[1:])


# ------------------------------------------------------------------------------------------------- fetching


def _download(repo_id: str, folder: Path, sizes: dict[str, int]) -> None:
    """Fetch the files of `sizes` not in `folder` yet, into the cache that holds it, once the disk has room for all."""
    from huggingface_hub import hf_hub_download

    missing = {name: size for name, size in sizes.items() if not (folder / name).is_file()}
    if not missing:
        return
    cache = folder.parent.parent.parent  # the snapshot's own cache, whichever HF_HUB_CACHE made it
    if not _offline():
        _check_room(repo_id, cache, sum(missing.values()))
        logger.info("fetching %d file(s) of %s from the Hugging Face Hub: %s", len(missing), repo_id,
                    _bytes(sum(missing.values())))
    for name in sorted(missing):
        if missing[name] >= LOGGED_FILE_BYTES:  # huggingface_hub's progress bars show on a terminal only
            logger.info("fetching %s of %s (%s)", name, repo_id, _bytes(missing[name]))
        hf_hub_download(repo_id, name, revision=folder.name, cache_dir=cache)


def _small_files(repo_id: str, commit: str) -> dict[str, int]:
    """The commit's small files (see _listed_small_files); with the Hub out of reach, none: the cache serves as it is
    (hf_hub_download fell back to it for the config), as it would with HF_HUB_OFFLINE=1, rather than a gateway
    failing to load a model whose files it has because the Hub is down for a moment."""
    import httpx2

    try:
        return _listed_small_files(repo_id, commit)
    except (ConnectionError, httpx2.TransportError) as error:
        logger.warning("cannot reach the Hugging Face Hub to list the files of %s (%s): using the cache's", repo_id,
                       error)
        return {}


def _listed_small_files(repo_id: str, commit: str) -> dict[str, int]:
    """The commit's top-level files a process reads besides the weights, by size; a model without safetensors
    weights (model.safetensors, or shards and their index) is refused here, before anything else is fetched."""
    from huggingface_hub import HfApi

    siblings = {sibling.rfilename: sibling.size or 0
                for sibling in HfApi().model_info(repo_id, revision=commit, files_metadata=True).siblings or ()}
    if WEIGHTS_INDEX not in siblings and SINGLE_WEIGHTS not in siblings:
        raise UnknownModelError(f"{repo_id} has no safetensors weights ({SINGLE_WEIGHTS} or {WEIGHTS_INDEX}): only "
                                "safetensors checkpoints are served")
    return {name: size for name, size in siblings.items()
            if "/" not in name and any(fnmatch.fnmatch(name, pattern) for pattern in SMALL_FILES)}


def _remote_sizes(repo_id: str, commit: str, filenames: list[str]) -> dict[str, int]:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    return {name: get_hf_file_metadata(hf_hub_url(repo_id, name, revision=commit)).size or 0 for name in filenames}


def _check_room(repo_id: str, cache: Path, needed: int) -> None:
    """Refuse a download the disk cannot hold before it starts, rather than fail partway with the disk full."""
    place = next(path for path in (cache, *cache.parents) if path.exists())
    free = shutil.disk_usage(place).free
    if needed > free:
        raise UnknownModelError(
            f"not enough disk space for {repo_id}: the files still to download take {_bytes(needed)}, and {place} has "
            f"{_bytes(free)} free: free some space, or set HF_HUB_CACHE (or HF_HOME) to a folder on a larger disk")


def _check_family(config_file: Path, repo_id: str) -> None:
    """A model of a family the swarm does not serve is refused before its weights are fetched (families' message)."""
    import json
    from types import SimpleNamespace

    from swarm.families import family_of

    fields = json.loads(config_file.read_text())
    try:
        family_of(SimpleNamespace(**{**fields, "model_type": fields.get("model_type")}))
    except UnknownModelError as error:
        raise UnknownModelError(f"{repo_id}: {error}") from None


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _bytes(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


# --------------------------------------------------------------------------------------------------- errors


@contextmanager
def hub_errors(repo_id: str, revision: str):
    """The Hub's refusals as UnknownModelError, one line each, saying what to do (a server exits with it, a gateway
    does not start)."""
    import httpx2
    from huggingface_hub import constants, errors

    hub = constants.ENDPOINT
    try:
        yield
    except errors.GatedRepoError:  # before RepositoryNotFoundError: it is one
        raise UnknownModelError(f"{repo_id} is a gated model: accept its terms at {hub}/{repo_id} and set HF_TOKEN to "
                                "an access token of that account") from None
    except errors.RevisionNotFoundError:
        raise UnknownModelError(f"{repo_id} has no revision {revision!r}: give --revision a branch, tag or commit "
                                "of it (default: main)") from None
    except errors.RepositoryNotFoundError:
        raise UnknownModelError(f"unknown model {repo_id!r}: no such local folder, nor model on the Hugging Face Hub "
                                f"({hub}; a private one needs HF_TOKEN)") from None
    except (errors.LocalEntryNotFoundError, ConnectionError, httpx2.TransportError):
        if _offline():
            raise UnknownModelError(f"{repo_id} (revision {revision}) is not all in the Hugging Face cache "
                                    f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE=1 forbids fetching it: run "
                                    "once online first") from None
        raise UnknownModelError(f"cannot reach the Hugging Face Hub ({hub}) to fetch {repo_id}, and its files are not "
                                "in the cache: check the network (or HF_ENDPOINT)") from None
    except errors.EntryNotFoundError as error:
        raise UnknownModelError(f"{repo_id} lacks a file it needs ({_first_line(error)}): not a transformers model "
                                "folder?") from None
    except errors.HfHubHTTPError as error:
        raise UnknownModelError(f"the Hugging Face Hub refused {repo_id}: {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]
