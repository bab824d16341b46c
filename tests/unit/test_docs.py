"""The docs name only what exists: every command and `--flag` that README.md, docs/*.md and deploy/'s unit files
show, every `make` target, every relative link; and each page stays short enough to read.

The docs are what an operator types. A flag renamed in the code but not in the docs fails here, not on their box.
Parsers are read, never run: a subprocess imports each command's entry point with argparse's parsing replaced by a
capture, so the flags checked are exactly those `--help` would list, and nothing starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
UNIT_FILES = sorted((ROOT / "deploy").glob("*.service"))  # command lines too, though not Markdown
README_MAX_LINES, PAGE_MAX_LINES = 200, 600  # README: one screen of what and how; a docs page: one topic

# The console commands `pip install .` installs (pyproject.toml) run the same entry points as these: one parser
# each, so a flag shown with either spelling must exist in it.
ALIASES = {"swarm-dht": "python -m swarm.dht", "swarm-server": "python -m swarm.server",
           "swarm-gateway": "python app.py"}

# `make TARGET ARGS='...'` hands ARGS to a command (Makefile): its flags are that command's
MAKE_COMMANDS = {"run": "python app.py", "bench": "python -m bench"}

# Flags the docs already show that other branches of issue 40 are adding to the parsers. Empty this set once they
# are merged: test_pending_flags_are_still_missing fails for each one that exists by then.
PENDING_FLAGS: set[tuple[str, str]] = set()  # --revision of the Hub's branch has arrived

# where a command starts: at a line's start or after a space, a path's slash (/opt/.../bin/swarm-server) or an
# `=` (ExecStart=...); what follows, up to a shell operator, is its arguments
COMMAND = re.compile(r"(?:^|(?<=[\s/=]))"
                     r"(python3? -m (?:swarm|bench)[\w.]*|python3? app\.py|swarm-(?:dht|server|gateway)|make)"
                     r"(?=\s|$)([^;|&]*)")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")

# Each command's entry point run as `python -m` (or `python app.py`) runs it, argparse stopped at its first parse:
# the parser's option strings are printed as JSON. An entry point that fails to import reports its error instead.
CAPTURE = r"""
import argparse, json, runpy, sys

class Captured(Exception):
    pass

def capture(parser, *args, **kwargs):
    raise Captured(sorted(parser._option_string_actions))

argparse.ArgumentParser.parse_known_args = capture
found = {}
for command in json.loads(sys.argv[1]):
    sys.argv = [command]
    try:
        if command == "python app.py":
            runpy.run_path("app.py", run_name="__main__")
        else:
            runpy.run_module(command.split()[-1], run_name="__main__", alter_sys=True)
        found[command] = "ran to its end without parsing flags"
    except Captured as captured:
        found[command] = captured.args[0]
    except BaseException as error:
        found[command] = f"does not start: {error!r}"
print(json.dumps(found))
"""


def canonical(command: str) -> str:
    """One spelling per entry point: `python3 -m x` is `python -m x`, `swarm-server` is `python -m swarm.server`."""
    command = re.sub(r"^python3 ", "python ", command)
    return ALIASES.get(command, command)


def command_lines(text: str) -> list[str]:
    """The lines of shell a page shows: its fenced blocks' lines (continuations joined, comments cut) and its
    inline code spans."""
    lines = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [re.sub(r"(^|\s)#.*", "", line) for line in joined.splitlines()]
    prose = FENCE.sub("", text)
    lines += [span.replace("\n", " ") for span in INLINE.findall(prose) if "\n\n" not in span]
    return lines


def invocations(text: str) -> list[tuple[str, str]]:
    """(command as written, its arguments) for every command line of `text` that runs one of ours or make."""
    return [(match.group(1), match.group(2)) for line in command_lines(text) for match in COMMAND.finditer(line)]


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))


def problems_of(text: str, options: dict, targets: set[str]) -> list[str]:
    """Each command, flag or make target `text` shows that does not exist: `options` maps a canonical command to
    its option strings (or to why it has none); flags of PENDING_FLAGS are not problems yet."""
    problems = []
    for written, arguments in invocations(text):
        if written == "make":
            target = next((word for word in arguments.split() if "=" not in word), None)
            if target is not None and target not in targets:
                problems.append(f"make: no target {target}")
            elif target in MAKE_COMMANDS:
                problems += flag_problems(f"make {target}", FLAG.findall(arguments), options[MAKE_COMMANDS[target]])
            continue
        problems += flag_problems(written, FLAG.findall(arguments), options[canonical(written)])
    return problems


def flag_problems(written: str, flags: list[str], known) -> list[str]:
    """Why `written` with `flags` would not run: `known` is its parser's option strings, or why it has none."""
    if isinstance(known, str):  # the entry point fails to import, or reads no flags while some are given
        return [f"{written}: {known}"] if known.startswith("does not start") or flags else []
    return [f"{written}: no flag {flag}" for flag in flags
            if flag not in known and (canonical(written), flag) not in PENDING_FLAGS]


def read_options(commands: set[str]) -> dict:
    """Each canonical command's option strings, read from its parser in a fresh interpreter (see CAPTURE): app.py's
    module code sets up logging and the entry points import torch, none of which belongs in the test's process."""
    done = subprocess.run([sys.executable, "-c", CAPTURE, json.dumps(sorted(commands))], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def all_texts() -> dict[Path, str]:
    """Each page's text; a unit file's is one fenced block, all of it shell-like lines (its comments cut as such)."""
    return {**{path: path.read_text() for path in PAGES},
            **{path: f"```\n{path.read_text()}```\n" for path in UNIT_FILES}}


@pytest.fixture(scope="module")
def options() -> dict:
    """The parsers of every command the docs show, and of every command PENDING_FLAGS and the tests below name."""
    commands = {canonical(written) for text in all_texts().values() for written, _ in invocations(text)}
    commands |= {command for command, _ in PENDING_FLAGS} | set(ALIASES.values()) | set(MAKE_COMMANDS.values())
    return read_options(commands - {"make"})


def test_every_command_flag_and_make_target_the_docs_show_exists(options):
    targets = make_targets()
    problems = [f"{path.relative_to(ROOT)}: {problem}" for path, text in all_texts().items()
                for problem in problems_of(text, options, targets)]
    assert not problems, "\n".join(problems)


def test_a_made_up_flag_a_made_up_target_and_a_missing_command_fail(options):
    """The check above can fail: a snippet as a page would show it, with one real use of each kind beside."""
    snippet = ("```sh\n"
               "swarm-server --model ORG/NAME --made-up-flag 3 \\\n    --initial-peers $MADDR\n"
               "python -m swarm.dht --port 31337 --identity bootstrap.key   # --not-a-flag in a comment\n"
               "make run ARGS='--port 8000 --no-such' && make deploy\n"
               "```\n"
               "Or `python app.py --nope`.\n")
    assert problems_of(snippet, options, make_targets()) == [
        "swarm-server: no flag --made-up-flag", "make run: no flag --no-such", "make: no target deploy",
        "python app.py: no flag --nope"]
    missing = read_options({"python -m swarm.no_such_module"})
    assert missing["python -m swarm.no_such_module"].startswith("does not start")


def test_pending_flags_are_still_missing_and_shown(options):
    """A pending flag that exists now is to be dropped from PENDING_FLAGS (so a later typo of it is caught); one
    the docs no longer show was left there by mistake."""
    arrived = sorted(pair for pair in PENDING_FLAGS if pair[1] in options[pair[0]])
    assert not arrived, f"now in the parsers, remove them from PENDING_FLAGS: {arrived}"
    shown = {(canonical(written), flag) for text in all_texts().values()
             for written, arguments in invocations(text) for flag in FLAG.findall(arguments)}
    assert PENDING_FLAGS <= shown, f"not shown by any page: {sorted(PENDING_FLAGS - shown)}"


def anchors(text: str) -> set[str]:
    """The ids GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, repeats -1, -2."""
    slugs, seen = set(), {}
    for heading in re.findall(r"^#+\s+(.*?)\s*$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def link_problems(path: Path, text: str) -> list[str]:
    """Each relative link of the page (to a file, a page or a heading) that leads nowhere."""
    problems = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not the repository's to check
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            problems.append(f"{target}: no such heading")
    return problems


def test_every_relative_link_resolves():
    problems = [f"{path.relative_to(ROOT)}: {problem}" for path in PAGES
                for problem in link_problems(path, path.read_text())]
    assert not problems, "\n".join(problems)


def test_a_broken_link_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[fine](#title), [gone](other.md), [no heading](#nowhere), [web](https://x.org)\n")
    assert link_problems(page, page.read_text()) == ["other.md: no such file", "#nowhere: no such heading"]


def test_pages_stay_short():
    lengths = {path.relative_to(ROOT): len(path.read_text().splitlines()) for path in PAGES}
    assert lengths[Path("README.md")] < README_MAX_LINES, lengths
    long_pages = {page: lines for page, lines in lengths.items() if lines >= PAGE_MAX_LINES}
    assert not long_pages, f"over {PAGE_MAX_LINES} lines, split them: {long_pages}"
