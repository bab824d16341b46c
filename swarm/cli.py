"""What every command-line tool of the swarm shares: one-line errors and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Callable, NoReturn, Optional, TypeVar

from swarm.protocol import SwarmError

T = TypeVar("T")


# What each tool is called in a checkout, and as the command `pip install .` puts on the PATH (pyproject.toml)
COMMANDS = {"python -m swarm.dht": "swarm-dht", "python -m swarm.server": "swarm-server",
            "python app.py": "swarm-gateway"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a wrong flag prints one line (the error), not the usage block; run as its installed command,
    the tool calls itself by that command's name in its usage and errors."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        command = COMMANDS.get(self.prog)
        if command is not None and Path(sys.argv[0]).name == command:
            self.prog = command

    def error(self, message: str) -> NoReturn:
        fail(f"{self.prog}: {message} (see --help)", status=2)


def fail(message: str, status: int = 1) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def settings_from_env(load: Optional[Callable[[], T]] = None) -> T:
    """config's settings from the environment (default: SwarmSettings); a malformed variable is one line."""
    from config import SwarmSettings

    try:
        return (load or SwarmSettings.from_env)()
    except ValueError as error:
        fail(f"bad environment: {error}", status=2)


def parse_block_range(text: str) -> tuple[int, int]:
    """"0:15" -> (0, 15), a half-open range of blocks, as in Python slices."""
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--blocks must look like START:END (e.g. 0:15), got {text!r}")
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"--blocks must satisfy 0 <= START < END, got {text!r}")
    return start, end


def multiaddr(text: str) -> str:
    """An --initial-peers value (e.g. /ip4/127.0.0.1/tcp/31337/p2p/Qm...), checked before anything starts: the
    error names what is wrong."""
    try:
        address = _multiaddr_type()(text)
    except Exception as error:  # multiaddr raises several unrelated types for bad input
        raise argparse.ArgumentTypeError(f"malformed multiaddr {text!r}: {error}") from None
    if not any(protocol.name in ("p2p", "ipfs") for protocol in address.protocols()):
        raise argparse.ArgumentTypeError(f"multiaddr {text!r} lacks the peer id part (/p2p/...)")
    return text


_MULTIADDR_ALONE = "swarm_multiaddr"  # its name in sys.modules when loaded so (its codecs import relative to it)


def _multiaddr_type() -> type:
    """hivemind's copy of py-multiaddr, loaded as a package of its own: `import hivemind.utils.multiaddr` would run
    hivemind's package first, which imports torch (over a second), and a tool checks its flags before anything heavy
    loads. Once hivemind is loaded, its own."""
    loaded = sys.modules.get("hivemind.utils.multiaddr") or sys.modules.get(_MULTIADDR_ALONE)
    if loaded is None:
        hivemind = importlib.util.find_spec("hivemind")  # a top-level name: found, not imported
        folder = Path(hivemind.submodule_search_locations[0]) / "utils" / "multiaddr"
        spec = importlib.util.spec_from_file_location(_MULTIADDR_ALONE, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        loaded = sys.modules[_MULTIADDR_ALONE] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
    return loaded.Multiaddr


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # hivemind logs every connection at INFO, and httpx2 (huggingface_hub's) every request to the Hugging Face Hub;
    # an operator wants to see our lines, not the transport's (a download shows its progress bars meanwhile).
    for noisy in ("hivemind", "p2pd", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_main(body: Callable[[], object]) -> None:
    """Run a tool's body, turning the errors a user can act on into one line and an exit status."""
    try:
        body()
    except SwarmError as error:
        fail(str(error))
    except KeyboardInterrupt:
        raise SystemExit(130)
