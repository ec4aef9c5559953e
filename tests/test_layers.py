"""The package's import graph (every import, function-level ones included, read with ast): no circle, and
every module imports only from its own layer or the layers below (README: "One idea per file")."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "cp_dtensor"

# Bottom to top. A module may import modules of its own layer or a lower one; the cycle check keeps
# each layer's own imports a DAG.
# (_extras, decode, hf_generate: on main, from the work beside this one; listed so the merge needs no edit.)
LAYERS: list[tuple[str, set[str]]] = [
    ("private torch touch points and torch-free layout facts", {"_compat", "_manifest", "_extras", "layout", "kernels"}),
    ("pure math; the network", {"masks", "wire", "comm", "debug", "_agree"}),
    ("kernels as ops, payloads, validation, placements, the cost model", {"ops", "payload", "checks", "placement", "plan"}),
    ("one step against one K/V block; the heads all-to-all", {"blocks", "ulysses"}),
    ("the exchanges; linear attention's state passing", {"ring", "allgather", "linear_attention"}),
    ("the front door; the SDPA-on-DTensor rule; decoding against a sharded cache", {"attention", "dispatch", "decode"}),
    ("DTensor entry points", {"relayout"}),
    ("integrations", {"hf", "hf_generate", "hf_linear", "hf_state", "checkpoint"} | {f"titan.{m}" for m in (
        "_cpu", "config", "data", "flex", "float8", "resume", "validate", "attention", "families", "spec", "train",
        "config_registry", "v03", "v03._cpu", "v03.attention", "v03.main", "v03.trainer", "v03.linear")}
     | {"titan"}),
    ("whole models (hands transformers models to hf.py)", {"module"}),
    ("the package and the CLI", {"", "cli"}),
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file ('' is the package itself)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "cp_dtensor" or node.module.startswith("cp_dtensor.")):
                target = node.module.removeprefix("cp_dtensor").removeprefix(".")
            else:
                continue
            subs = [f"{target}.{a.name}".lstrip(".") for a in node.names]
            named = [s for s in subs if s in modules]
            found |= set(named) if len(named) == len(subs) else {target, *named}
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "cp_dtensor" or a.name.startswith("cp_dtensor."):
                    found.add(a.name.removeprefix("cp_dtensor").removeprefix("."))
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    placed = [m for _, ms in LAYERS for m in ms]
    assert len(placed) == len(set(placed)), "a module in two layers"
    missing = set(_graph()) - set(placed)
    assert not missing, f"modules without a layer: {sorted(missing)}"


def test_no_import_circle():
    graph, state, stack = _graph(), {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_imports_point_down():
    layer = {m: i for i, (_, ms) in enumerate(LAYERS) for m in ms}  # See test_every_module_has_a_layer
    up = [f"{m or 'cp_dtensor'} (layer {layer[m]}) imports {d} (layer {layer[d]})"
          for m, deps in _graph().items() for d in sorted(deps) if layer[d] > layer[m]]
    assert not up, "\n".join(up)
