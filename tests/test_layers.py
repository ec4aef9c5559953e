"""The package's import graph (every import, function-level ones included, read with ast): no circle,
every module imports only from its own layer or the layers below (docs/architecture.md), and no module
uses an underscore name of another subpackage's module (integrations use the core's public names)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "cp_dtensor"

# Bottom to top. A module may import modules of its own layer or a lower one; the cycle check keeps
# each layer's own imports a DAG. A package's __init__ sits with its modules' top layer.
_V02 = ("pipeline_checks", "config", "dynamic", "attention", "families", "flex", "pipeline", "resume", "spec", "validate",
        "trainer")
_V03 = ("_cpu", "attention", "dynamic", "linear", "trainer", "main", "tiling")
LAYERS: list[tuple[str, set[str]]] = [
    ("private torch touch points, deprecation, torch-free layout facts",
     {"_compat", "_compat.torch_versions", "_deprecated", "_extras", "checkpoint.manifest", "core.plan.layout",
      "core.compute.kernels", "core.linear.linear_plan", "core.plan.documents", "core.plan.doc_plan", "core.plan.doc_recut",
      "core.plan", "core.compute", "core.exchange", "core.linear"}),  # the subpackages' __init__s import nothing
    ("pure math; the network; a ring call's spec",
     {"core.plan.masks", "core.plan.wire", "core.exchange.comm", "tools.debug", "core.agreement", "core.plan.spec",
      "core.tiling", "core.vocab_parallel", "core.linear.linear_steps"}),
    ("kernels as ops, payloads, validation, placements, the cost model",
     {"core.compute.ops", "core.compute.varlen", "core.compute.ordering", "core.exchange.payload", "core.checks",
      "dtensor.placements", "tools.plan", "tools.plan_ring", "tools.plan_exchanges", "tools.plan_documents",
      "tools.plan_model"}),
    ("one step against one K/V block; the heads all-to-all", {"core.compute.blocks", "core.exchange.ulysses"}),
    ("a document layout's blocks", {"core.exchange.doc_blocks"}),
    ("the exchanges; linear attention's state passing",
     {"core.exchange.ring", "core.exchange.allgather", "core.exchange.doc_exchange", "core.exchange.doc_op",
      "core.linear.linear_attention", "core.linear.linear_runs", "core.linear.linear_conv"}),
    ("the front door; a batch's shards; the SDPA-on-DTensor rule; decoding against a sharded cache",
     {"core.attention", "core.batch", "core.dynamic", "dtensor.sdpa", "core.decode", "core"}),
    ("DTensor entry points", {"dtensor.sharding", "dtensor"}),
    ("own models: the SDPA mode's hooks", {"nn.sdpa_mode", "nn"}),
    ("integrations", {"hf.attention", "hf.cache", "hf.documents", "hf.tiling", "hf.logits", "hf.served", "hf.families", "hf.tiled_families", "hf.generate", "hf.turns", "hf.pass_kv", "hf.linear", "hf.sparse_attend", "hf.sparse", "hf.latent", "hf.latent_attend", "hf.sparse_rows", "hf.sparse_generate", "hf.sparse_turn", "hf.router", "hf.pads", "hf.state", "hf.trainer", "hf.collator", "hf.grid", "hf",
                      "checkpoint.dcp", "checkpoint"}
     | {f"titan.shared.{m}" for m in ("options", "cpu", "replica", "compile_check", "data", "dynamic", "float8", "heads", "inner", "plan", "tiling")} | {"titan.shared"}
     | {f"titan.v02.{m}" for m in _V02} | {"titan.v02"}
     | {f"titan.v03.{m}" for m in _V03} | {"titan.v03"} | {"titan", "titan.config", "titan.config_registry",
                                                          "titan.train"}),
    ("the one door for whole models (hf/ or nn/); torch's context-parallel API",
     {"doors", "torch_api"}),
    ("the package and the CLI", {"", "tools.cli", "tools"}),
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _package(module: str, path: pathlib.Path) -> str:
    """The subpackage a module belongs to ('' for the package root's modules)."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _import_target(node: ast.ImportFrom, package: str) -> str | None:
    """The package module a ``from X import ...`` names ('' the package itself), resolved from the importing
    module's ``package``; None for an import from outside cp_dtensor."""
    if node.level:
        base = package.split(".") if package else []
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))
    if node.module and (node.module == "cp_dtensor" or node.module.startswith("cp_dtensor.")):
        return node.module.removeprefix("cp_dtensor").removeprefix(".")
    return None


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file ('' is the package itself)."""
    package = _package(name, path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _import_target(node, package)
            if target is None:
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


# root modules every package may use, private names included: the touch points of torch's internals,
# the extras, the deprecations
SHARED = {"_compat", "_deprecated", "_extras"}


def _private_uses(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[str]:
    """``from X import _y`` and ``m._y`` (m a module bound by an import) where X / m is a module of
    another subpackage than ``name``'s, outside ``SHARED``."""
    package = _package(name, path)
    bound: dict[str, str] = {}  # local name -> the package module it binds
    found = []

    def foreign(target: str) -> bool:
        return target in modules and target not in SHARED and _package(target, modules[target]) != package

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _import_target(node, package)
            if target is None:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}".lstrip(".")
                if sub in modules:  # a module: private if its own name is
                    bound[a.asname or a.name] = sub
                    if a.name.startswith("_") and foreign(sub):
                        found.append(f"from {target or 'cp_dtensor'} import {a.name}")
                elif a.name.startswith("_") and not a.name.startswith("__") and foreign(target):
                    found.append(f"from {target} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.startswith("cp_dtensor."):
                    bound[a.asname] = a.name.removeprefix("cp_dtensor.")
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__") and foreign(bound[node.value.id])):
            found.append(f"{node.value.id}.{node.attr} ({bound[node.value.id]})")
    return found


def test_no_private_name_across_packages():
    modules = _modules()
    bad = [f"{m or 'cp_dtensor'}: {use}" for m, p in modules.items() for use in _private_uses(m, p, modules)]
    assert not bad, "underscore names used across subpackages (make them public in their module):\n" + "\n".join(bad)


def test_the_private_name_check_sees_a_violation(tmp_path):
    """The check itself: a cross-package private import and attribute are found, a same-package one is not."""
    modules = {"core.compute.ops": tmp_path / "ops.py", "core.compute.blocks": tmp_path / "blocks.py",
               "hf.attention": tmp_path / "a.py", "_compat": tmp_path / "_compat.py"}
    code = ("from ..core.compute.ops import _row_segments, tie\nfrom ..core.compute import ops\nfrom .._compat import _StridedShard\n"
            "ops._Fresh\n")
    modules["hf.attention"].write_text(code)
    assert _private_uses("hf.attention", modules["hf.attention"], modules) == [
        "from core.compute.ops import _row_segments", "ops._Fresh (core.compute.ops)"]
    modules["core.compute.blocks"].write_text("from .ops import _row_segments\nfrom . import ops\nops._Fresh\n")
    assert _private_uses("core.compute.blocks", modules["core.compute.blocks"], modules) == []
