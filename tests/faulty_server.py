"""A block server that fails its compute rounds on demand: a real `python -m swarm.server` process whose span
raises after a number of rounds, so that tests see a server's own failure (internal_error) from the outside;
or one whose sessions' steps answer with what cannot be outputs (another shape, another dtype, NaN), or with noise
on one-position steps only (decode_noise: a liar honest on prompts, hence on audits' prefills).
Nothing in the server knows: the fault is patched in here, never by a flag of the server's.

    python tests/faulty_server.py --fail-after N [block server options]   # rounds N+1, N+2, ... fail
    python tests/faulty_server.py --malformed shape|dtype|nan|decode_noise [block server options]

From a test (the server stops with the swarm):

    from faulty_server import add_faulty_server
    server = add_faulty_server(tiny_swarm, ["--blocks", "0:4", "--dht-prefix", "faulty"], fail_after=0)

Only rounds of the compute thread count (the start-up's throughput measurement runs elsewhere); a failing
round raises RuntimeError("injected fault ..."), as a bug or an out-of-memory error would.
"""

from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAULT = "injected fault: tests/faulty_server.py fails this compute round on purpose"


def add_faulty_server(swarm, args, fail_after: int = 0, wait: bool = True, malformed: str = ""):
    """One more block server of a LocalSwarm, started through this script: rounds past `fail_after` fail; or,
    with `malformed`, every step's outputs are malformed so."""
    from swarm.local import READY_TIMEOUT, ChildProcess

    name = f"server{len(swarm.servers)}"
    fault = ["--malformed", malformed] if malformed else ["--fail-after", str(fail_after)]
    command = [str(Path(__file__).resolve()), *fault, "--model", swarm.model,
               *swarm.server_args, *args, "--initial-peers", *swarm.initial_peers]
    server = ChildProcess(name, command, swarm.log_dir, swarm.env)
    swarm.servers.append(server)
    if wait:
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), READY_TIMEOUT)
    return server


def _fail_rounds_after(count: int) -> None:
    from swarm.server.span import BlockSpan

    original, rounds = BlockSpan.forward_packed, itertools.count()

    def forward_packed(self, *args, **kwargs):
        if threading.current_thread().name == "compute" and next(rounds) >= count:
            raise RuntimeError(FAULT)
        return original(self, *args, **kwargs)

    BlockSpan.forward_packed = forward_packed


def _noise_on_decode(output):
    """A liar that serves prompts (and so audits' prefills) honestly: noise of about 10% on each one-position step."""
    import torch

    return output + 0.1 * output.abs().mean() * torch.randn_like(output) if output.shape[-2] == 1 else output


MALFORMED = {  # what a step's outputs become
    "shape": lambda output: output[..., :-1],
    "dtype": lambda output: output.double(),
    "nan": lambda output: output.fill_(float("nan")),
    "decode_noise": _noise_on_decode,
}


def _malformed_outputs(kind: str) -> None:
    from swarm.server.backend import Backend

    original, malform = Backend.run_steps, MALFORMED[kind]

    async def run_steps(self, items):
        return [result if isinstance(result, BaseException) else malform(result)
                for result in await original(self, items)]

    Backend.run_steps = run_steps


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not (argv[0] == "--fail-after" and argv[1].isdigit()
                             or argv[0] == "--malformed" and argv[1] in MALFORMED):
        sys.exit("usage: python tests/faulty_server.py --fail-after N | --malformed shape|dtype|nan|decode_noise "
                 "[block server options]")
    sys.path.insert(0, str(ROOT))
    if argv[0] == "--malformed":
        _malformed_outputs(argv[1])
    else:
        _fail_rounds_after(int(argv[1]))
    from swarm.server.main import main as serve

    serve(argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
