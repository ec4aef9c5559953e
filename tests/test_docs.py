"""The documentation stays true (docs/testing.md, "The documentation"):

* every ``Note [X]`` cited in the package, the docs, the README, the tests or the scripts has its essay in
  the package: a line ``Note [X]`` underlined with ``~~~`` (in a docstring or a ``#`` comment);
* the README stays a front page (at most 300 lines) and no page says how the project was made;
* every code block of the README and docs/ marked as a complete example runs and passes. The marker is
  an HTML comment on the line before the fence: ``<!-- example -->`` (a fresh Python process),
  ``<!-- example: ranks=2 -->`` (2 forked gloo ranks; the block's own ``dist.init_process_group`` is a
  no-op there, the launcher having joined the ranks), ``<!-- example: output -->`` (a ``$ cp-dtensor ...``
  line, then exactly what it prints).
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap
import warnings

import pytest

from _dist import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cp_dtensor"
README = ROOT / "README.md"
MAX_README_LINES = 300

# ----------------------------------------------------------------------------------------------- Notes

NAME = r"((?:[^\[\]\n]|\[[^\[\]\n]*\])+)"  # one level of nested brackets: Note [... a [cp_dtensor] section]
CITE = re.compile(r"Note\s+\[" + NAME + r"\]")
DEFINITION = re.compile(r"^\s*(?:#\s*)?Note \[" + NAME + r"\]\s*$")
UNDERLINE = re.compile(r"^\s*(?:#\s*)?~{3,}\s*$")
PLACEHOLDERS = {"X", "Name", "..."}  # how the docs and this file spell the convention itself


def _files(*roots: pathlib.Path, suffixes=(".py", ".md", ".sh", ".toml", ".yml")) -> list[pathlib.Path]:
    out = []
    for root in roots:
        out += [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in suffixes)
    return [p for p in out if "__pycache__" not in p.parts]


def _flat(path: pathlib.Path) -> str:
    """The file as one line, so a citation broken over lines, ``#`` comments or string literals reads whole."""
    lines = [re.sub(r"^\s*#+\s?", "", line) for line in path.read_text(encoding="utf-8").splitlines()]
    text = " ".join(lines)
    if path.suffix == ".py":  # "... Note [Rank-specialised " f"compiled graphs] ...": implicit concatenation
        text = re.sub(r"[\"']\s+f?[\"']", "", text)
    return re.sub(r"\s+", " ", text)


def cited_notes() -> dict[str, set[str]]:
    cited: dict[str, set[str]] = {}
    for path in _files(PACKAGE, ROOT / "docs", README, ROOT / "tests", ROOT / "scripts"):
        if path == pathlib.Path(__file__).resolve():  # this file's own samples of the convention
            continue
        for m in CITE.finditer(_flat(path)):
            if m.group(1) not in PLACEHOLDERS:
                cited.setdefault(m.group(1), set()).add(str(path.relative_to(ROOT)))
    return cited


def defined_notes() -> dict[str, list[str]]:
    defined: dict[str, list[str]] = {}
    for path in _files(PACKAGE, suffixes=(".py",)):
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines[:-1]):
            if (m := DEFINITION.match(line)) and UNDERLINE.match(lines[i + 1]):
                defined.setdefault(m.group(1), []).append(f"{path.relative_to(ROOT)}:{i + 1}")
    return defined


def test_every_cited_note_is_defined_once_in_the_package():
    cited, defined = cited_notes(), defined_notes()
    missing = {name: sorted(where) for name, where in cited.items() if name not in defined}
    assert not missing, (
        f"Notes cited but not defined in cp_dtensor/: {missing}. Write the essay where the code is, as a line "
        "'Note [Name]' underlined with '~~~', or correct the citation.")
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert not twice, f"Notes defined more than once: {twice}"


def test_the_note_scanner_reads_the_forms_the_package_uses(tmp_path):
    # a definition in a docstring and in comments; citations split over lines, comments and literals
    src = tmp_path / "m.py"
    src.write_text(textwrap.dedent('''\
        """A module.

        Note [Docstring form]
        ~~~~~~~~~~~~~~~~~~~~~
        """
        # Note [Comment form]
        # ~~~~~~~~~~~~~~~~~~~
        x = 1  # See Note [Comment
        # form]
        raise ValueError("see Note [Docstring "
                         f"form] and Note [Stock torchtitan.train with a [cp_dtensor] section]")
        '''))
    lines = src.read_text().splitlines()
    found = [DEFINITION.match(line).group(1) for i, line in enumerate(lines[:-1])
             if DEFINITION.match(line) and UNDERLINE.match(lines[i + 1])]
    assert found == ["Docstring form", "Comment form"]
    assert [m.group(1) for m in CITE.finditer(_flat(src))] == [
        "Docstring form", "Comment form", "Comment form", "Docstring form",
        "Stock torchtitan.train with a [cp_dtensor] section"]


# ------------------------------------------------------------------------------------ the pages' words


def test_readme_is_a_front_page():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines; the front page keeps at most {MAX_README_LINES}. Move the detail to a page "
        "under docs/ and link it.")


# Words about how the project was made, not about what it does. State facts instead: "measured on
# 2026-12-01 on a 2-core CPU", "not run on a GPU yet".
HOW_IT_WAS_MADE = [r"\bsessions?\b", r"\bwas lent\b", r"\bwere lent\b", r"\bseed exercise", r"\bthe seed's\b",
                   r"\bexercise \d", r"\bthis stop\b", r"\blast stop\b", r"\bnot drawn\b", r"\bby hand \(an earlier"]


def test_no_words_about_how_the_project_was_made():
    found = []
    for path in _files(README, ROOT / "docs", PACKAGE, ROOT / "mkdocs.yml"):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for w in HOW_IT_WAS_MADE
                      if re.search(w, line, re.IGNORECASE)]
    assert not found, "say what the code does and what was measured, not how it was made:\n" + "\n".join(found)


PATH = re.compile(r"`((?:cp_dtensor|tests|scripts|titan_configs|docs|requirements|\.ci)/[\w./-]*\w)`")


def test_paths_the_docs_name_exist():
    missing = []
    for path in _files(README, ROOT / "docs", suffixes=(".md",)):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            missing += [f"{path.relative_to(ROOT)}:{i}: {m.group(1)}" for m in PATH.finditer(line)
                        if not (ROOT / m.group(1)).exists()]
    assert not missing, "the docs name files that do not exist (moved?):\n" + "\n".join(missing)


# -------------------------------------------------------------------------------------------- examples

MARKER = re.compile(r"^<!--\s*example(?::\s*(ranks=(\d+)|output))?\s*-->\s*$")
FENCE = re.compile(r"^(```+)\s*([\w-]*)\s*$")


def examples() -> list[tuple[str, str, str]]:
    """(kind, 'file:line', code) of every marked block: kind is 'python', 'ranks=N' or 'output'."""
    out = []
    for path in _files(README, ROOT / "docs", suffixes=(".md",)):
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not (m := MARKER.match(line)):
                continue
            where = f"{path.relative_to(ROOT)}:{i + 2}"
            fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            assert fence, f"{where}: an example marker must sit on the line right before a ``` fence"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == fence.group(1))
            kind = m.group(1) or "python"
            assert kind == "output" or fence.group(2) == "python", f"{where}: a runnable example is a python block"
            out.append((kind, where, "\n".join(lines[i + 2:end]) + "\n"))
    return out


def code_blocks() -> list[tuple[str, str]]:
    """('file:line', code) of every fenced block of the README and docs/, marked or not."""
    out = []
    for path in _files(README, ROOT / "docs", suffixes=(".md",)):
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            if fence := FENCE.match(lines[i]):
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == fence.group(1))
                out.append((f"{path.relative_to(ROOT)}:{i + 2}", "\n".join(lines[i + 1:end])))
                i = end
            i += 1
    return out


def test_code_blocks_use_no_deprecated_spelling():
    # the old module paths, and the renamed names a static read can see (the runs below catch the rest)
    from cp_dtensor._deprecated import MOVED_MODULES

    # not a flag (--cp_dtensor.layout), not the function cp_dtensor.relayout(x, ...)
    old = [r"(?<![\w-])" + re.escape(m) + r"(?![\w(])" for m in MOVED_MODULES]
    old += [r"\bapply_context_parallel_hf\b", r"\bcheck_job_config\b", r"\bshard_batch\(\s*(cp_)?mesh\b"]
    found = [f"{where}: {m.group(0)}" for where, code in code_blocks() for w in old for m in re.finditer(w, code)]
    assert not found, "the docs' code uses deprecated spellings (docs/architecture.md, Where things moved):\n" + "\n".join(found)


def test_the_docs_have_examples():
    kinds = {kind for kind, _, _ in examples()}
    assert {"python", "ranks=2", "output"} <= kinds, kinds


# an example that uses an old name fails: cp_dtensor's deprecation warnings become errors
DEPRECATED = r"cp_dtensor.* is deprecated and will be removed"

_RUN_ONE = """
import sys, traceback, warnings
warnings.filterwarnings("error", message=DEPRECATED, category=FutureWarning)
failed = []
for where, code in BLOCKS:
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed.append(where + ":\\n" + traceback.format_exc())
if failed:
    sys.exit("\\n".join(failed))
"""


def test_single_process_examples_run():
    blocks = [(where, code) for kind, where, code in examples() if kind == "python"]
    # one fresh interpreter for all of them (one torch import); each block in its own namespace
    proc = subprocess.run([sys.executable, "-c", f"BLOCKS, DEPRECATED = {blocks!r}, {DEPRECATED!r}\n{_RUN_ONE}"], cwd=ROOT,
                          capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]


def _run_blocks(rank: int, world: int, blocks: list[tuple[str, str]]) -> list[str]:
    import torch.distributed as dist

    from cp_dtensor import _deprecated

    joined = lambda *a, **k: None  # the launcher joined the ranks; the block's own init/destroy are no-ops
    # and set what torchrun sets (accelerate's Trainer reads it; the process group is up already)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    dist.init_process_group, dist.destroy_process_group = joined, joined
    _deprecated._warned.clear()  # warn (here: raise) even if the parent process has warned already
    warnings.filterwarnings("error", message=DEPRECATED, category=FutureWarning)
    done = []
    for where, code in blocks:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, where, "exec"), {"__name__": "__main__"})
        dist.barrier()
        done.append(where)
    return done


def test_multi_rank_examples_run():
    by_world: dict[int, list[tuple[str, str]]] = {}
    for kind, where, code in examples():
        if kind.startswith("ranks="):
            by_world.setdefault(int(kind.removeprefix("ranks=")), []).append((where, code))
    if any("transformers" in code for blocks in by_world.values() for _, code in blocks):
        pytest.importorskip("transformers")
        import cp_dtensor.hf  # noqa: F401 -- imported once here, inherited by the forked ranks
    for world, blocks in sorted(by_world.items()):
        done = run_ranks(world, _run_blocks, blocks, timeout=240)
        assert done == [[where for where, _ in blocks]] * world


def test_output_examples_match():
    from cp_dtensor.tools.cli import main

    for kind, where, block in examples():
        if kind != "output":
            continue
        command, *want = block.splitlines()
        argv = shlex.split(command.removeprefix("$ "))
        assert argv[0] == "cp-dtensor", f"{where}: an output example runs cp-dtensor; got {command!r}"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(argv[1:])
        assert out.getvalue().splitlines() == want, f"{where}: `{command}` prints\n{out.getvalue()}"
