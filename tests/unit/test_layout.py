"""The tree is the architecture: these checks fail when a change crosses one of its lines.

- swarm/server never imports swarm/client, nor the reverse; the shared modules at swarm/ import neither;
- the gateway uses only the swarm's public API: swarm.client's exported names and swarm.protocol;
- config.py is the only reader of the environment;
- modules stay under 400 lines and functions under 50 (in swarm/ and gateway/);
- one class per name across the product's code.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["swarm", "gateway", "bench", "config.py", "app.py", "gunicorn.conf.py"]
GATEWAY_MAY_IMPORT = {"swarm.client", "swarm.protocol"}


def python_files(*roots: str) -> list[Path]:
    files = []
    for root in roots:
        path = ROOT / root
        files.extend([path] if path.suffix == ".py" else sorted(path.rglob("*.py")))
    return files


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in the file, at any depth (lazy imports inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def import_violations(files: list[Path], forbidden: str) -> list[str]:
    return [f"{shown(file)} imports {module}" for file in files
            for module, names in imported_modules(file)
            if within(module, forbidden) or any(within(f"{module}.{name}", forbidden) for name in names)]


def test_the_server_never_imports_the_client_nor_the_client_the_server():
    assert import_violations(python_files("swarm/server"), "swarm.client") == []
    assert import_violations(python_files("swarm/client"), "swarm.server") == []


def test_the_shared_swarm_modules_import_neither_side():
    shared = [path for path in python_files("swarm") if path.parent == ROOT / "swarm"]
    assert len(shared) >= 8
    assert import_violations(shared, "swarm.client") + import_violations(shared, "swarm.server") == []


def test_the_gateway_uses_only_the_swarm_client_public_api():
    import swarm.client

    violations = []
    for file in python_files("gateway"):
        for module, names in imported_modules(file):
            if not within(module, "swarm"):
                continue
            if module not in GATEWAY_MAY_IMPORT or (module == "swarm.client" and set(names) - set(swarm.client.__all__)):
                violations.append(f"{file.relative_to(ROOT)} imports {module} {names}")
    assert violations == []


def test_the_checks_above_can_fail(tmp_path):
    """The import scan sees lazy imports and from-imports of submodules alike."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from swarm import server\n    import swarm.client.remote_session\n")
    assert len(import_violations([sample], "swarm.server")) == 1
    assert len(import_violations([sample], "swarm.client")) == 1


def test_only_config_reads_the_environment():
    readers = []
    for file in python_files(*PRODUCT):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") \
                    and isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(str(file.relative_to(ROOT)))
    # the environment handed on to child processes (the local swarm's peers to gunicorn's workers), never
    # read for a setting
    handed_on = {"swarm/local.py", "bench/gateway.py", "gunicorn.conf.py"}
    assert set(readers) - {"config.py"} - handed_on == set()


@pytest.mark.parametrize("root", ["swarm", "gateway"])
def test_modules_and_functions_stay_small(root):
    too_long = []
    for file in python_files(root):
        text = file.read_text()
        if text.count("\n") > 400:
            too_long.append(f"{file.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50:
                too_long.append(f"{file.relative_to(ROOT)}:{node.lineno} {node.name}: "
                                f"{node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_one_class_per_name():
    where = defaultdict(list)
    for file in python_files(*PRODUCT):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{module_name(file)}:{node.lineno}")
    assert {name: places for name, places in where.items() if len(places) > 1} == {}


def test_no_two_modules_differ_by_one_letter():
    names = sorted({path.stem for path in python_files("swarm", "gateway") if path.stem != "__init__"})

    def one_letter_apart(a: str, b: str) -> bool:
        if abs(len(a) - len(b)) > 1 or a == b:
            return False
        if len(a) == len(b):
            return sum(x != y for x, y in zip(a, b)) == 1
        short, long = sorted((a, b), key=len)
        return any(long[:index] + long[index + 1:] == short for index in range(len(long)))

    assert [(a, b) for a in names for b in names if a < b and one_letter_apart(a, b)] == []


# ------------------------------------------------------------------------------------------ the gateway's packages

DIALECTS = ("petals", "openai", "anthropic", "ollama")  # gateway/<dialect>/: none imports another
FLASK = ("flask", "flask_sock", "flask_cors", "simple_websocket")


def modules_under(root: Path, *packages: str) -> dict[str, Path]:
    """module name -> file, for every module of the packages (paths relative to `root`)."""
    files = [path for package in packages
             for path in ([root / package] if package.endswith(".py") else sorted((root / package).rglob("*.py")))]
    return {".".join(path.relative_to(root).with_suffix("").parts[:-1] if path.name == "__init__.py"
                     else path.relative_to(root).with_suffix("").parts): path for path in files}


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """What a file imports: the known modules it names (a from-import of a submodule counts as that submodule),
    and the top-level names of everything else (flask, torch, ...)."""
    found = set()
    for module, names in imported_modules(path):
        submodules = {f"{module}.{name}" for name in names} & known.keys()
        found |= submodules or ({module} if module in known else {module.split(".")[0]})
    return found


def dialect_of(module: str):
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "gateway" and parts[1] in DIALECTS else None


def dialects_importing_dialects(root: Path) -> list[str]:
    known = modules_under(root, "gateway")
    return [f"{module} imports {target}" for module, path in known.items() if dialect_of(module)
            for target in imports_of(path, known) if dialect_of(target) not in (None, dialect_of(module))]


def engine_modules_reaching_flask(root: Path) -> list[str]:
    """Engine modules that import Flask, directly or through any module of the gateway they import."""
    known = modules_under(root, "gateway")
    edges = {module: imports_of(path, known) for module, path in known.items()}
    found = []
    for start in (module for module in known if module.startswith("gateway.engine")):
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            for target in edges.get(module, ()):
                if target in FLASK:
                    found.append(f"{start} reaches {target} through {module}")
                elif target in known and target not in seen:
                    seen.add(target)
                    todo.append(target)
    return found


def test_no_dialect_imports_another():
    assert dialects_importing_dialects(ROOT) == []


def test_the_engine_never_imports_flask():
    assert engine_modules_reaching_flask(ROOT) == []


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_gateway_checks_can_fail(tmp_path):
    """A dialect importing another, and the engine reaching Flask through a module it imports, are both found."""
    root = plant(tmp_path, {
        "gateway/__init__.py": "", "gateway/engine/__init__.py": "", "gateway/web/__init__.py": "",
        "gateway/openai/__init__.py": "", "gateway/ollama/__init__.py": "",
        "gateway/engine/loop.py": "from gateway.web import bodies\n",
        "gateway/web/bodies.py": "def f():\n    from flask import request\n",
        "gateway/ollama/routes.py": "from gateway.openai.format import error_body\nfrom gateway.ollama import format\n",
        "gateway/ollama/format.py": "", "gateway/openai/format.py": "",
    })
    assert dialects_importing_dialects(root) == ["gateway.ollama.routes imports gateway.openai.format"]
    assert engine_modules_reaching_flask(root) == ["gateway.engine.loop reaches flask through gateway.web.bodies"]
    (root / "gateway/engine/loop.py").write_text("import torch\n")
    (root / "gateway/ollama/routes.py").write_text("from gateway.chat import plan\n")
    assert dialects_importing_dialects(root) == [] and engine_modules_reaching_flask(root) == []
