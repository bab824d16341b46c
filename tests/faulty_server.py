"""A block server that fails its compute rounds on demand: a real `python -m swarm.server` process whose span
raises after a number of rounds, so that tests see a server's own failure (internal_error) from the outside;
or one whose sessions' steps answer with what cannot be outputs (another shape, another dtype, NaN), or with noise
on one-position steps only (decode_noise: a liar honest on prompts, hence on audits' prefills); or one that lies
as a file says at each step (--attack-file: noise at a scale, on 1% of steps, a skipped block; ATTACKS).
Nothing in the server knows: the fault is patched in here, never by a flag of the server's.

    python tests/faulty_server.py --fail-after N [block server options]   # rounds N+1, N+2, ... fail
    python tests/faulty_server.py --malformed shape|dtype|nan|decode_noise [block server options]
    python tests/faulty_server.py --attack-file PATH [block server options]

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


def add_faulty_server(swarm, args, fail_after: int = 0, wait: bool = True, malformed: str = "",
                      attack_file: str = ""):
    """One more block server of a LocalSwarm, started through this script: rounds past `fail_after` fail; or,
    with `malformed`, every step's outputs are malformed so; or, with `attack_file`, each step lies as the file
    says then (ATTACKS, or skip_block)."""
    from swarm.local import READY_TIMEOUT, ChildProcess

    name = f"server{len(swarm.servers)}"
    fault = (["--malformed", malformed] if malformed else ["--attack-file", attack_file] if attack_file
             else ["--fail-after", str(fail_after)])
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


def _noise(scale: float, share: float = 1.0):
    """Gaussian noise of `scale` times the outputs' size, on a `share` of the steps (the others honest)."""
    import random

    import torch

    def lie(output):
        if random.random() >= share:
            return output
        return output + scale * output.float().pow(2).mean().sqrt() * torch.randn_like(output)

    return lie


ATTACKS = {  # a liar's steps, switched at run time through --attack-file (prompts and decode steps alike)
    "honest": lambda output: output,
    "noise_1e-1": _noise(1e-1), "noise_1e-2": _noise(1e-2), "noise_1e-3": _noise(1e-3),
    "rare_lies": _noise(1e-1, share=0.01),  # one step in a hundred
    "decode_noise": _noise_on_decode,
}


def _attacks_from(path: str) -> None:
    """Each step's outputs pass through the attack the file names when the step ends; `skip_block` runs the span
    without its second block instead (a server that saves a layer's compute)."""
    from swarm.server.backend import Backend
    from swarm.server.span import BlockSpan

    attack = lambda: Path(path).read_text().strip()  # noqa: E731 (read per step: a test switches it)
    original_steps, original_batch = Backend.run_steps, BlockSpan.forward_batch

    async def run_steps(self, items):
        lie = ATTACKS.get(attack(), ATTACKS["honest"])
        return [result if isinstance(result, BaseException) else lie(result)
                for result in await original_steps(self, items)]

    def forward_batch(self, hidden, batch, start, end):  # span.py's, less the second layer (and adapters)
        if attack() != "skip_block":
            return original_batch(self, hidden, batch, start, end)
        layers = list(self.layers)[start - self.start : end - self.start]
        self.family.batch_inputs(self.position_state, hidden, batch)
        batch.build_masks({layer.attention_window for layer in layers}, self.dtype)
        for index, layer in enumerate(layers):
            if index != 1:
                hidden = self.family.layer_forward(layer, hidden, batch, index)
        return hidden

    Backend.run_steps, BlockSpan.forward_batch = run_steps, forward_batch


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not (argv[0] == "--fail-after" and argv[1].isdigit()
                             or argv[0] == "--malformed" and argv[1] in MALFORMED or argv[0] == "--attack-file"):
        sys.exit("usage: python tests/faulty_server.py --fail-after N | --malformed shape|dtype|nan|decode_noise "
                 "| --attack-file PATH [block server options]")
    sys.path.insert(0, str(ROOT))
    if argv[0] == "--malformed":
        _malformed_outputs(argv[1])
    elif argv[0] == "--attack-file":
        _attacks_from(argv[1])
    else:
        _fail_rounds_after(int(argv[1]))
    from swarm.server.main import main as serve

    serve(argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
