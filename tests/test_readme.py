"""The README's code is documentation that runs.

Every fenced ```python block of README.md is self-contained (its own imports, model and synthetic data) and runs as-is
in a fresh namespace, in README order; a traceback points at README.md's own line numbers.  A block whose fence is
preceded by ``<!-- test: slow (...) -->`` runs with the slow tests (`.ci/run`), as does one that starts Ray.  The
set-up commands are the two ```bash blocks, the test command being exactly the one `.ci/run` runs.
"""

import linecache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_LINES = README.read_text(encoding="utf-8").splitlines()


def fenced_blocks(lang: str) -> list[tuple[int, str]]:
    """``(line of the opening fence, code)`` of every ```lang block of README.md, in order (lines 1-based)."""
    lines = README_LINES
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == f"```{lang}":
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise ValueError(f"README.md:{i + 1}: unclosed ```{lang} block")
            blocks.append((i + 1, "\n".join(lines[i + 1:j]) + "\n"))
            i = j
        i += 1
    return blocks


PYTHON_BLOCKS = fenced_blocks("python")


def test_readme_has_python_blocks():
    assert PYTHON_BLOCKS, "no ```python block found in README.md"


SLOW_MARK = "<!-- test: slow"  # on the line above a block's opening fence: the block runs with the slow tests


def runs_with_the_slow_tests(line: int, code: str) -> bool:
    """A block that starts Flower's simulation engine (Ray), or whose fence is preceded by ``<!-- test: slow ... -->``
    (heavy demos whose engines and options the default run tests by name; `.ci/run` runs them)."""
    above = README_LINES[line - 2] if line >= 2 else ""
    return "flower.simulate(" in code or above.strip().startswith(SLOW_MARK)


def _block_params():
    """One param per block, marked slow where :func:`runs_with_the_slow_tests` says so."""
    return [pytest.param(line, code, id=f"line{line}", marks=[pytest.mark.slow] if runs_with_the_slow_tests(line, code)
                         else []) for line, code in PYTHON_BLOCKS]


@pytest.mark.parametrize("line, code", _block_params())
def test_readme_python_block_runs(line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)               # whatever a snippet writes lands in a tmp dir
    monkeypatch.setenv("MPLBACKEND", "Agg")   # no display for a snippet that plots
    filename = f"README.md:{line}"
    source = "\n" * line + code               # line numbers in tracebacks are README.md's own
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)  # shown in tracebacks
    exec(compile(source, filename, "exec"), {"__name__": "__main__"})


def test_readme_bash_blocks_and_ci_command():
    bash = fenced_blocks("bash")
    assert len(bash) == 2, [line for line, _ in bash]
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("python3 -m venv")]
    assert len(ci) == 1, ci
    test_block = bash[1][1].strip()
    assert test_block == ci[0].strip(), (test_block, ci[0])


def where_things_live() -> list[tuple[str, str]]:
    """``(module, name)`` for every backticked identifier in the README's "Where things live" table."""
    import re

    text = README.read_text(encoding="utf-8").split("## Where things live", 1)[1].split("\n## ", 1)[0]
    pairs = []
    for row in text.splitlines():
        cells = row.split("|")
        if len(cells) < 3 or not cells[1].strip().startswith("`numpyro_fedvi"):
            continue
        module = cells[1].strip().strip("`")
        for name in re.findall(r"`([A-Za-z_][A-Za-z_0-9]*)`", cells[2]):
            pairs.append((module, name))
    return pairs


def test_readme_module_map_names_exist():
    """Every name the module map lists is importable from the module it names (a module, or an attribute)."""
    import importlib

    pairs = where_things_live()
    assert len(pairs) > 50, pairs
    missing = []
    for module, name in pairs:
        mod = importlib.import_module(module)
        if hasattr(mod, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            missing.append(f"{module}.{name}")
    assert not missing, missing
