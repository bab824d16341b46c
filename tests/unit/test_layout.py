"""The tree is the architecture: these checks fail when a change crosses one of its lines.

- swarm/server never imports swarm/client, nor the reverse; the shared modules at swarm/ import neither;
- the gateway uses only the swarm's public API: swarm.client's exported names and swarm.protocol;
- config.py is the only reader of the environment;
- modules stay under 400 lines and functions under 50 (in swarm/ and gateway/);
- one class per name across the product's code;
- no import cycles in ACYCLIC_ROOTS: dependencies between modules go one way, even where an import is lazy or
  only for type checking;
- in the gateway, no dialect package (petals, openai, anthropic, ollama) imports another, and the engine never
  reaches Flask, not even through a module it imports.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["swarm", "gateway", "bench", "config.py", "limits.py", "app.py", "gunicorn.conf.py"]
GATEWAY_MAY_IMPORT = {"swarm.client", "swarm.protocol", "swarm.gc_tuning"}  # the last: a process setting, shared
ACYCLIC_ROOTS = ["swarm", "gateway", "bench", "config.py", "limits.py", "app.py", "gunicorn.conf.py"]  # the import graph over them is a DAG


def python_files(*roots: str, base: Path = ROOT) -> list[Path]:
    files = []
    for root in roots:
        path = base / root
        files.extend([path] if path.suffix == ".py" else sorted(path.rglob("*.py")))
    return files


def module_name(path: Path, base: Path = ROOT) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package: str | None = None) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in the file, at any depth (lazy imports inside functions too, and those
    under TYPE_CHECKING). Relative imports are resolved against `package` (the file's own), skipped without it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.level == 0 or package is not None):
            module = node.module or ""
            if node.level:
                parent = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                module = f"{parent}.{module}" if module else parent
            if module:
                found.append((module, [alias.name for alias in node.names]))
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
    shared = [path for path in python_files("swarm") if path.parent in (ROOT / "swarm", ROOT / "swarm" / "families")]
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


# ---------------------------------------------------------------------------------------------- import cycles


def import_graph(files: list[Path], base: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules among `files` that it imports. `from pkg import name` imports the module pkg.name
    if there is one, else pkg (a name defined in pkg/__init__.py, which may re-export it from a submodule);
    an import of something inside a module (a.b.C) counts as an import of that module (a.b)."""
    modules = {module_name(file, base): file for file in files}
    graph = {}
    for module, file in modules.items():
        package = module if file.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for imported, names in imported_modules(file, package):
            for target in [f"{imported}.{name}" if f"{imported}.{name}" in modules else imported
                           for name in names] or [imported]:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                targets.add(target)
        graph[module] = targets - {"", module}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components (Tarjan's algorithm, iterative: no recursion limit), each
    sorted. A component of more than one node is a cycle, or several sharing nodes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node: str) -> tuple[str, Iterator[str]]:
        index[node] = low[node] = len(index)
        stack.append(node)
        return node, iter(sorted(graph[node]))

    for root in sorted(graph):
        if root in index:
            continue
        path = [visit(root)]
        while path:
            node, successors = path[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    path.append(visit(successor))
                elif successor in stack:  # a way back to a node still on the current search's stack
                    low[node] = min(low[node], index[successor])
                continue
            path.pop()
            if path:
                low[path[-1][0]] = min(low[path[-1][0]], low[node])
            if low[node] == index[node]:  # node is the first of its component: the rest lie above it
                component = stack[stack.index(node):]
                del stack[stack.index(node):]
                components.append(sorted(component))
    return components


def import_cycles(files: list[Path], base: Path = ROOT) -> list[str]:
    """Each group of modules that import one another, told as who imports whom within it."""
    graph = import_graph(files, base)
    return ["; ".join(f"{module} imports {', '.join(sorted(graph[module] & set(component)))}"
                      for module in component)
            for component in strongly_connected(graph) if len(component) > 1]


def test_no_import_cycles():
    assert import_cycles(python_files(*ACYCLIC_ROOTS)) == []


def test_the_cycle_check_sees_type_checking_lazy_relative_and_package_imports(tmp_path):
    """A cycle through a TYPE_CHECKING import, a lazy relative one and a package's re-export is found; once
    the dependency goes one way, nothing is."""
    package = tmp_path / "planted"
    package.mkdir()
    (package / "__init__.py").write_text("from planted.first import First\n")  # a re-export
    (package / "first.py").write_text("from planted import second\n\nclass First:\n    pass\n")
    (package / "second.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                       "    from planted.third import Third\n")
    (package / "third.py").write_text("def later():\n    from . import first\n")
    (tmp_path / "tool.py").write_text("import planted\n")  # uses the package: no cycle of its own

    def cycles() -> list[str]:
        return import_cycles(python_files("planted", "tool.py", base=tmp_path), base=tmp_path)

    assert cycles() == ["planted.first imports planted.second; planted.second imports planted.third; "
                        "planted.third imports planted.first"]
    (package / "third.py").write_text("def later():\n    from planted import First\n")  # through __init__
    assert cycles() == ["planted imports planted.first; planted.first imports planted.second; "
                        "planted.second imports planted.third; planted.third imports planted"]
    (package / "third.py").write_text("class Third:\n    pass\n")
    assert cycles() == []


# ------------------------------------------------------------------------------------------ the gateway's packages

DIALECTS = ("petals", "openai", "anthropic", "ollama")  # gateway/<dialect>/: none imports another
FLASK = ("flask", "flask_sock", "flask_cors", "simple_websocket")


def dialect_of(module: str):
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "gateway" and parts[1] in DIALECTS else None


def dialects_importing_dialects(base: Path = ROOT) -> list[str]:
    graph = import_graph(python_files("gateway", base=base), base)
    return [f"{module} imports {target}" for module in sorted(graph) if dialect_of(module)
            for target in sorted(graph[module]) if dialect_of(target) not in (None, dialect_of(module))]


def engine_modules_reaching_flask(base: Path = ROOT) -> list[str]:
    """Engine modules that import Flask, directly or through any module of the gateway they import."""
    files = {module_name(file, base): file for file in python_files("gateway", base=base)}
    graph = import_graph(list(files.values()), base)
    found = []
    for start in sorted(module for module in graph if within(module, "gateway.engine")):
        reached, todo = {start}, [start]
        while todo:
            for target in graph[todo.pop()] - reached:
                reached.add(target)
                todo.append(target)
        found += [f"{start} reaches {imported} through {module}" for module in sorted(reached)
                  for imported, _ in imported_modules(files[module]) if imported.split(".")[0] in FLASK]
    return found


def test_no_dialect_imports_another():
    assert dialects_importing_dialects() == []


def test_the_engine_never_imports_flask():
    assert engine_modules_reaching_flask() == []


def plant(base: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = base / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return base


def test_the_gateway_checks_can_fail(tmp_path):
    """A dialect importing another, and the engine reaching Flask through a module it imports, are both found."""
    base = plant(tmp_path, {
        "gateway/__init__.py": "", "gateway/engine/__init__.py": "", "gateway/web/__init__.py": "",
        "gateway/openai/__init__.py": "", "gateway/ollama/__init__.py": "",
        "gateway/engine/loop.py": "from gateway.web import bodies\n",
        "gateway/web/bodies.py": "def f():\n    from flask import request\n",
        "gateway/ollama/routes.py": "from gateway.openai.format import error_body\nfrom gateway.ollama import format\n",
        "gateway/ollama/format.py": "", "gateway/openai/format.py": "",
    })
    assert dialects_importing_dialects(base) == ["gateway.ollama.routes imports gateway.openai.format"]
    assert engine_modules_reaching_flask(base) == ["gateway.engine.loop reaches flask through gateway.web.bodies"]
    (base / "gateway/engine/loop.py").write_text("import torch\n")
    (base / "gateway/ollama/routes.py").write_text("from gateway.web import bodies\n")
    assert dialects_importing_dialects(base) == [] and engine_modules_reaching_flask(base) == []


# what the engine keeps to itself: the rest of the gateway uses its methods (use_session, saved_state, generate, ...)
ENGINE_INTERNALS = {"sessions", "states", "warm", "models", "draft_models", "_loops", "_client"}


def engine_internals_reached(base: Path = ROOT) -> list[str]:
    """`engine.<internal>` (or `self.engine.<internal>`) read anywhere in the gateway outside gateway/engine."""
    found = []
    for path in python_files("gateway", base=base):
        if within(module_name(path, base), "gateway.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
                owner = node.value
                name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
                if name == "engine":
                    found.append(f"{path.relative_to(base)}:{node.lineno} engine.{node.attr}")
    return found


def test_dialects_use_the_engines_narrow_face_only():
    assert engine_internals_reached() == []


def test_the_narrow_face_check_can_fail(tmp_path):
    (tmp_path / "gateway" / "petals").mkdir(parents=True)
    (tmp_path / "gateway" / "petals" / "routes.py").write_text("def f(engine):\n    return engine.sessions.use(1)\n")
    assert engine_internals_reached(tmp_path) == ["gateway/petals/routes.py:2 engine.sessions"]


HISTORY_WRITER = "gateway.engine.sequences"  # the one module that changes a session's token history


def history_writes(base: Path = ROOT) -> list[str]:
    """Assignments to `<x>.history` / `<x>.pending` (also through a subscript or a tuple, del and augmented), and
    calls of their mutating methods, anywhere in the gateway but the history's one writer."""
    found = []
    for path in python_files("gateway", base=base):
        if module_name(path, base) == HISTORY_WRITER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, ast.AugAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "append", "extend", "insert", "pop", "clear"):
                targets = [node.func.value]
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and part.attr in ("history", "pending"):
                        found.append(f"{path.relative_to(base)}:{node.lineno} {part.attr}")
    return found


def test_one_module_writes_a_sessions_token_history():
    assert history_writes() == []


def test_the_history_check_can_fail(tmp_path):
    (tmp_path / "gateway" / "engine").mkdir(parents=True)
    (tmp_path / "gateway" / "engine" / "warm.py").write_text(
        "def f(session):\n    session.history, session.pending = [], []\n    session.history.extend([1])\n")
    assert history_writes(tmp_path) == ["gateway/engine/warm.py:2 history", "gateway/engine/warm.py:2 pending",
                                        "gateway/engine/warm.py:3 history"]
