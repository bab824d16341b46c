"""The product's entry point: the gateway (Petals Chat HTTP and WebSocket APIs) in front of a swarm.

    gunicorn app:app --bind HOST:PORT          (gunicorn.conf.py: gthread, headers read without a thread)
    python app.py [--host 127.0.0.1] [--port 5000] [--initial-peers MADDR ...] [--model NAME] [--revision REV]
                  [--device cpu|cuda|cuda:N] [--dtype float32|bfloat16|float16] [--embedding-models FOLDER ...]

With no initial peers configured (--initial-peers or INITIAL_PEERS), it starts an embedded local swarm:
a bootstrap peer and two block servers per served model, as child processes stopped when it exits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from config import Settings
from gateway import create_app
from gateway.engine.encoders import EmbeddingModelError
from gateway.engine.session_store import SessionStoreError
from gateway.errors import APIError
from gateway.web.request_ids import configure_logging
from swarm import gc_tuning
from swarm.cli import fail, settings_from_env


APP_LOAD_ERROR = 4  # gunicorn's master stops on a worker exiting with this, rather than starting it again


def device_problem(device: str) -> Optional[str]:
    """Why this machine cannot run the gateway's half of the models on `device` (None: it can). torch is loaded
    only for a GPU: a CPU gateway's master process stays light."""
    if device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return f"{device} asked for, but CUDA is not available on this machine"
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        return f"{device} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def gateway_device(text: str) -> str:
    """A --device value, checked against this machine before anything starts."""
    from config import GATEWAY_DEVICE_PATTERN

    if not GATEWAY_DEVICE_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    problem = device_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def load_embedding_models(engine) -> None:
    """EMBEDDING_MODELS loaded as gunicorn's worker imports the app, before it serves. Loaded by a request instead,
    the first load (importing sentence-transformers and the model's code: 2 s for a tiny encoder) held the GIL up
    to 0.3 s at a time, and every other request meanwhile, /health included, waited (measured: see tests/e2e/
    test_encoder_loads.py). An encoder that fails here is logged, and tried again by a request naming it."""
    for encoder in engine.encoders:
        try:
            encoder.load()
        except APIError:  # logged by the encoder, with why; the request naming it gets the error
            pass


_settings = settings_from_env(Settings.from_env)  # a malformed variable: one line, not a traceback
_device_problem = device_problem(_settings.gateway.device)
if _device_problem:  # one line now, rather than a 500 on the first request that needs a model
    fail(f"bad environment: GATEWAY_DEVICE={_settings.gateway.device}: {_device_problem}", status=2)
configure_logging(_settings.gateway.log_level)  # every log line with its request id
if __name__ != "__main__":  # `python app.py` only reads its flags and runs gunicorn, which imports app:app anew
    try:
        app = create_app(_settings)  # cheap: the swarm client is built in the worker, on the first request needing it
    except SessionStoreError as _error:  # corrupt or unreadable: one line, and no start that would lose its sessions
        fail(str(_error), status=APP_LOAD_ERROR)
    except EmbeddingModelError as _error:  # an EMBEDDING_MODELS folder that cannot be served: one line, no start
        fail(str(_error), status=APP_LOAD_ERROR)
    load_embedding_models(app.extensions["engine"])
    gc_tuning.serving_process()  # the imports and the embedding models: out of every later collection


def _parser():
    from config import GATEWAY_DTYPES, Limits
    from swarm.cli import ArgumentParser, multiaddr

    parser = ArgumentParser(prog="python app.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--initial-peers", nargs="*", type=multiaddr, help="join this swarm instead of a local one")
    parser.add_argument("--model", help="the model to serve: a known name, a local Hugging Face folder, or a Hugging "
                        "Face Hub id (ORG/NAME: its config, tokenizer and the weight files of the embeddings and LM "
                        "head only are fetched into the Hub's cache before the gateway starts serving) (MODEL)")
    parser.add_argument("--revision", help="of a Hub model: the branch, tag or commit (MODEL_REVISION; default: main)")
    parser.add_argument("--embedding-models", nargs="+", metavar="FOLDER", help="also serve these local "
                        "sentence-transformers folders as embedding models, each under its folder's name, run in the "
                        "gateway (EMBEDDING_MODELS)")
    parser.add_argument("--device", type=gateway_device, help="where the gateway's embeddings, final norm and LM "
                        "head run: cpu, cuda or cuda:N (GATEWAY_DEVICE; default: cpu)")
    parser.add_argument("--dtype", choices=GATEWAY_DTYPES, help="their weights' dtype (GATEWAY_DTYPE; default: "
                        "float32); logits reach sampling as float32 whatever it is")
    # MLC's server flags (and its older --allow-* spellings)
    parser.add_argument("--api-key", action="append", help="require this API key (repeatable)")
    parser.add_argument("--api-key-file", help="require one of the keys in this file (one per line)")
    parser.add_argument("--allowed-origins", "--allow-origins", nargs="+", help="CORS origins (default: *)")
    parser.add_argument("--allowed-methods", "--allow-methods", nargs="+", help="CORS methods (default: *)")
    parser.add_argument("--allowed-headers", "--allow-headers", nargs="+", help="CORS headers (default: *)")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--keyless-sharing", action="store_true", help="without API keys, everyone who reaches the "
                        "gateway is one trusted user (a laptop's own gateway): saved states, MLC's stateful chat and "
                        "prefix reuse across requests are on (KEYLESS_SHARING)")
    parser.add_argument("--trusted-proxies", type=int, help="reverse proxies in front whose X-Forwarded-For "
                        "names the client (default: 0)")
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default: INFO")
    parser.add_argument("--session-store", metavar="PATH", help="the SQLite file that keeps inference sessions "
                        "(token ids and settings) across restarts, or off: memory only (SESSION_STORE; default: "
                        "SWARM_CACHE_DIR/sessions.sqlite3)")
    limits = parser.add_argument_group("limits", "each also an environment variable, named in capitals")
    for name, field in Limits.__dataclass_fields__.items():
        limits.add_argument("--" + name.replace("_", "-"), type=type(field.default), metavar="N",
                            help=f"{name.upper()} (default: {field.default})")
    return parser


def main(argv=None) -> None:
    from config import Limits

    args = _parser().parse_args(argv)

    # handed to gunicorn, which sets them before the master's hooks and the worker read config.py
    settings = {
        "INITIAL_PEERS": " ".join(args.initial_peers or []),
        "MODEL": args.model,
        "MODEL_REVISION": args.revision,
        "EMBEDDING_MODELS": " ".join(args.embedding_models or []),
        "GATEWAY_DEVICE": args.device,
        "GATEWAY_DTYPE": args.dtype,
        "API_KEYS": ",".join(args.api_key or []),
        "API_KEY_FILE": args.api_key_file,
        "ALLOWED_ORIGINS": ",".join(args.allowed_origins or []),
        "ALLOWED_METHODS": ",".join(args.allowed_methods or []),
        "ALLOWED_HEADERS": ",".join(args.allowed_headers or []),
        "ALLOW_CREDENTIALS": "true" if args.allow_credentials else "",
        "KEYLESS_SHARING": "1" if args.keyless_sharing else "",
        "TRUSTED_PROXIES": args.trusted_proxies,
        "LOG_LEVEL": args.log_level,
        "SESSION_STORE": args.session_store,
        **{name.upper(): getattr(args, name) for name in Limits.__dataclass_fields__},
    }
    environment = [part for name, value in settings.items() if value is not None and value != ""
                   for part in ("--env", f"{name}={value}")]
    sys.argv = [
        "gunicorn", "--config", str(Path(__file__).with_name("gunicorn.conf.py")),
        "--bind", f"{args.host}:{args.port}", *environment, "app:app",
    ]
    from gunicorn.app.wsgiapp import run

    run()


if __name__ == "__main__":
    main()
