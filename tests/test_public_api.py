"""The public surface: ``cp_dtensor.__all__`` matches the lazy table and the ``TYPE_CHECKING`` imports (what
IDEs and the API reference see), no module is named like a public function, and every old name -- module
paths, renamed functions and keywords, the old argument orders -- still works and warns exactly once.

The old names are checked in one fresh interpreter (a name warns once per process), each result compared
with the new name's on the same input (a formula, not the code under test: shard/unshard round trips)."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest
from _tiers import slow  # noqa: F401

import cp_dtensor
from cp_dtensor import _extras
from cp_dtensor._deprecated import MOVED_MODULES

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "cp_dtensor"


def _type_checking_names() -> set[str]:
    tree = ast.parse((PKG / "__init__.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in ast.walk(node):
                if isinstance(imp, ast.ImportFrom):
                    names |= {a.asname or a.name for a in imp.names}
    return names


def test_all_is_the_lazy_table_and_type_checking_imports():
    assert cp_dtensor.__all__ == sorted(["LAYOUTS", *cp_dtensor._EXPORTS])
    assert _type_checking_names() == set(cp_dtensor._EXPORTS)
    for name in cp_dtensor.__all__:  # each resolves to an object whose home is the module the table names
        obj = getattr(cp_dtensor, name)
        if name != "LAYOUTS":
            assert obj.__module__ == f"cp_dtensor.{cp_dtensor._EXPORTS[name]}", name


def test_no_module_shares_its_name_with_a_public_function():
    public = set(cp_dtensor.__all__)
    for pkg in ("hf", "checkpoint"):
        if pkg == "hf" and not _extras.installed("hf"):
            continue
        public |= set(__import__(f"cp_dtensor.{pkg}", fromlist=["__all__"]).__all__)
    modules = {p.stem for p in PKG.rglob("*.py") if "_legacy" not in p.parts} | {
        p.name for p in PKG.rglob("*") if p.is_dir() and "_legacy" not in p.parts}
    assert not (modules & public), sorted(modules & public)


def test_package_root_holds_a_handful_of_modules():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 6, root


_CHECK = r"""
import json, sys, warnings
warnings.simplefilter("always")
caught = []
warnings.showwarning = lambda message, category, *a, **k: caught.append((category.__name__, str(message)))
import torch
import cp_dtensor
out = {}
def run(fn):
    before = len(caught)
    fn()
    fn()  # a second use: no second warning
    return [m for c, m in caught[before:] if c == "FutureWarning" and m.startswith("cp_dtensor")]
"""


# Every test's snippet runs in ONE fresh interpreter (an import of torch and the package each costs ~8 s on 2
# cores), each in its own namespace with its own ``out``, in the order they are listed: no two snippets use
# the same old name (each warns once per process), and the last one silences warnings for the rest.
_SNIPPETS: dict[str, str] = {}

_MAIN = r"""
import traceback
results = {}
for name, code in snippets:
    out = {}
    try:
        exec(code, {"torch": torch, "cp_dtensor": cp_dtensor, "run": run, "caught": caught, "out": out})
        results[name] = out
    except BaseException:
        results[name] = {"__error__": traceback.format_exc()[-3000:]}
print(json.dumps(results))
"""


def _snippet(name: str, code: str) -> str:
    _SNIPPETS[name] = code
    return name


@pytest.fixture(scope="module")
def fresh_results() -> dict:
    program = _CHECK + f"snippets = {list(_SNIPPETS.items())!r}\n" + _MAIN
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fresh(results: dict, name: str) -> dict:
    got = results[name]
    assert "__error__" not in got, got.get("__error__")
    return got


def _old_module_paths_code() -> str:
    olds = [o for o in MOVED_MODULES if not o.startswith("cp_dtensor.titan.")]
    code = "import importlib\nfor old, new in %r:\n" % [(o, MOVED_MODULES[o]) for o in olds] + """
    warned = run(lambda: importlib.import_module(old))
    same = importlib.import_module(old) is importlib.import_module(new) or old == "cp_dtensor.relayout"
    out[old] = [len(warned), same, new in (warned or [""])[0]]
import cp_dtensor.relayout as legacy
from cp_dtensor.dtensor import sharding
out["relayout"] = [legacy.layout_moves is sharding.layout_moves, callable(cp_dtensor.relayout)]
"""
    return code


_snippet("old_module_paths", _old_module_paths_code())


def test_old_module_paths_warn_once_and_are_the_new_modules(fresh_results):
    olds = [o for o in MOVED_MODULES if not o.startswith("cp_dtensor.titan.")]
    got = _fresh(fresh_results, "old_module_paths")
    assert got.pop("relayout") == [True, True]
    assert got == {o: [1, True, True] for o in olds}


def _old_titan_module_paths_code() -> str:
    olds = [o for o in MOVED_MODULES if o.startswith("cp_dtensor.titan.")]
    code = "import importlib\nfor old, new in %r:\n" % [(o, MOVED_MODULES[o]) for o in olds] + """
    warned = run(lambda: importlib.import_module(old))
    out[old] = [len(warned), importlib.import_module(old) is importlib.import_module(new)]
import cp_dtensor.titan as titan
out["check_job_config"] = [len(run(lambda: titan.check_job_config)), titan.check_job_config is titan.check_config]
import cp_dtensor.titan.config as cfg
out["config"] = [hasattr(cfg, "JobConfig")]
"""
    return code


if _extras.installed_version("titan")[:2] == (0, 2):
    _snippet("old_titan_module_paths", _old_titan_module_paths_code())


@pytest.mark.skipif(_extras.installed_version("titan")[:2] != (0, 2), reason="torchtitan 0.2.x paths")
def test_old_titan_module_paths_warn_once(fresh_results):
    olds = [o for o in MOVED_MODULES if o.startswith("cp_dtensor.titan.")]
    got = _fresh(fresh_results, "old_titan_module_paths")
    assert got.pop("check_job_config") == [1, True]
    assert got.pop("config") == [True]
    assert got == {o: [1, True] for o in olds}


def test_the_old_paths_finder_answers_its_table_only():
    """Note [Old module paths]: the finder answers the table's names only (any other name, in cp_dtensor or
    not, imports as it would without it), sits once in sys.meta_path, leaves the new module's own spec alone,
    and ``python -m OLD`` runs the new module as the program."""
    from cp_dtensor._deprecated import OldPaths, install_old_paths

    assert OldPaths.find_spec("json") is None and OldPaths.find_spec("cp_dtensor.core.no_such_module") is None
    assert OldPaths.find_spec("cp_dtensor.core.ring").name == "cp_dtensor.core.ring"
    install_old_paths()
    assert sum(f is OldPaths for f in sys.meta_path) == 1
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "import cp_dtensor.core.ring as old, cp_dtensor.core.exchange.ring as new, cp_dtensor.core as core\n"
            "print(old is new is core.ring, new.__name__, new.__spec__.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.stdout.split() == ["True", "cp_dtensor.core.exchange.ring", "cp_dtensor.core.exchange.ring"], out.stderr
    run = subprocess.run([sys.executable, "-m", "cp_dtensor.cli", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0 and "usage: cp-dtensor" in run.stdout, run.stderr
    assert "cp_dtensor.cli is deprecated" in run.stderr and "cp_dtensor.tools.cli" in run.stderr


def _old_calls_code() -> str:
    code = r"""
import os, tempfile
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/rdv", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
x = torch.arange(24.).view(2, 12)
new = cp_dtensor.shard_batch((x, x + 1), mesh)
old = []
out["shard_batch"] = [len(run(lambda: old.append(cp_dtensor.shard_batch(mesh, x, x + 1)))),
                      all(torch.equal(a, b) for a, b in zip(old[0], new)), isinstance(old[0], tuple)]
local = []
out["unshard_sequence"] = [len(run(lambda: local.append(cp_dtensor.unshard_sequence(x, mesh, layout="headtail", dim=1)))),
                           torch.equal(local[0], cp_dtensor.unshard_batch(x, mesh, layout="headtail"))]
s = []
out["shard_tensor"] = [len(run(lambda: s.append(cp_dtensor.shard_tensor(x, dim=1, layout="striped", rank=1, cp_size=3)))),
                       torch.equal(s[0], x[:, 1::3])]
u = []
parts = [x[:, r::3] for r in range(3)]
out["unshard_tensor"] = [len(run(lambda: u.append(cp_dtensor.unshard_tensor(parts, dim=1, layout="striped")))),
                         torch.equal(u[0], x)]
d = []
out["shard_sequence"] = [len(run(lambda: d.append(cp_dtensor.shard_sequence(x, mesh, dim=1)))),
                         torch.equal(d[0].full_tensor(), x), torch.equal(cp_dtensor.unshard_sequence(d[0]), x)]
try:
    cp_dtensor.shard_sequence(x, mesh, dim=1, seq_dim=1)
    out["both"] = "no error"
except TypeError as e:
    out["both"] = str(e)
dist.destroy_process_group()
"""
    return code


_snippet("old_calls", _old_calls_code())


def test_old_calls_warn_once_and_equal_the_new_ones(fresh_results):
    """shard_batch(mesh, *tensors), unshard_sequence(local, mesh), shard_tensor/unshard_tensor/shard_sequence
    with dim=, against the new calls and against the striped formula (local i of rank r is global i*P + r)."""
    got = _fresh(fresh_results, "old_calls")
    assert got.pop("both").startswith("cp_dtensor.shard_sequence got both seq_dim= and its deprecated spelling dim=")
    assert got == {"shard_batch": [1, True, True], "unshard_sequence": [1, True], "shard_tensor": [1, True],
                   "unshard_tensor": [1, True], "shard_sequence": [1, True, True]}


def _vocabulary_code() -> str:
    code = r"""
import inspect, tempfile
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/rdv", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
x = torch.arange(24.).view(2, 12)
q = torch.randn(1, 2, 8, 4)
def same(old, new):
    got = []
    if isinstance(new(), torch.Tensor):  # float results to rounding: another kernel computes the reference
        return [len(run(lambda: got.append(old()))), torch.allclose(got[0].double(), new().double(), atol=1e-6)]
    return [len(run(lambda: got.append(old()))), got[0] == new()]
out["ring_attention(group=)"] = same(lambda: cp_dtensor.ring_attention(q, q, q, group=mesh, is_causal=True),
                                     lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
out["shard_tensor(world=)"] = same(lambda: cp_dtensor.shard_tensor(x, seq_dim=1, layout="striped", rank=1, world=3),
                                   lambda: x[:, 1::3])
out["local_positions(positional)"] = same(lambda: cp_dtensor.local_positions("striped", 1, 3, 12),
                                          lambda: torch.arange(1, 12, 3))
out["local_positions(world=)"] = same(lambda: cp_dtensor.local_positions(layout="headtail", rank=0, world=2, seq_len=8),
                                      lambda: torch.tensor([0, 1, 6, 7]))
out["Striped(cp=)"] = same(lambda: cp_dtensor.Striped(1, seq_len=12, cp=3), lambda: cp_dtensor.Striped(1, seq_len=12, cp_size=3))
out["sequence_placement(layout, dim)"] = same(lambda: cp_dtensor.sequence_placement("striped", 1, seq_len=12, cp_size=3),
                                              lambda: cp_dtensor.Striped(1, seq_len=12, cp_size=3))
out["sequence_placement(cp=)"] = same(lambda: cp_dtensor.sequence_placement(1, layout="headtail", seq_len=12, cp=3),
                                      lambda: cp_dtensor.HeadTail(1))
pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
out["document_ids_from_positions(cp_mesh=)"] = same(
    lambda: cp_dtensor.document_ids_from_positions(pos, cp_mesh=mesh),
    lambda: torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3]]))
model = nn.Linear(2, 2)
model.weight.grad = torch.ones(2, 2)
out["reduce_gradients(cp_mesh=)"] = same(lambda: cp_dtensor.reduce_gradients(model, cp_mesh=mesh), lambda: None)
out["apply_context_parallel(cp_mesh=)"] = [len(run(lambda: cp_dtensor.apply_context_parallel(nn.Linear(2, 2), cp_mesh=mesh))), True]
kp = torch.arange(8)[None]
out["sharded_cache_attention(group=)"] = same(
    lambda: cp_dtensor.sharded_cache_attention(q[:, :, -1:], q, q, q_positions=kp[:, -1:], k_positions=kp, group=mesh),
    lambda: F.scaled_dot_product_attention(q[:, :, -1:], q, q))
try:
    cp_dtensor.ring_attention(q, q, q, group=mesh, mesh=mesh)
    out["both"] = "no error"
except TypeError as e:
    out["both"] = str(e)
old_names = {"group", "cp_mesh", "world", "cp"}
sigs = {}
for name in cp_dtensor.__all__:
    obj = getattr(cp_dtensor, name)
    if callable(obj) and not isinstance(obj, type):
        params = inspect.signature(obj).parameters
        sigs[name] = sorted(n for n in params if n in old_names)
        if "layout" in params and params["layout"].kind is not inspect.Parameter.KEYWORD_ONLY:
            sigs[name].append("layout not keyword-only")
out["signatures"] = {k: v for k, v in sigs.items() if v}
dist.destroy_process_group()
"""
    return code


_snippet("vocabulary", _vocabulary_code())


def test_one_vocabulary_old_keywords_warn_once_and_equal_the_new_ones(fresh_results):
    """One name for the CP group (``mesh``) and one for its size (``cp_size``) across the public API;
    ``layout`` keyword-only. The old spellings (``group=``, ``cp_mesh=``, ``world=``, ``cp=``, a positional
    ``layout``) warn once each and give what the new call gives; they are not in the signatures (issue 41)."""
    got = _fresh(fresh_results, "vocabulary")
    assert got.pop("both").startswith("cp_dtensor.ring_attention got both mesh= and its deprecated spelling group=")
    assert got.pop("signatures") == {}
    assert got == {k: [1, True] for k in got} and len(got) == 11, got


def _apply_context_parallel_hf_code() -> str:
    code = """
import cp_dtensor.hf as hf
out["doc"] = "cp_dtensor.hf.apply_context_parallel" in hf.apply_context_parallel_hf.__doc__
out["wrapped"] = hf.apply_context_parallel_hf.__wrapped__ is hf.apply_context_parallel
try:  # a bad call reaches the new function's own check (not a transformers model)
    run(lambda: hf.apply_context_parallel_hf(torch.nn.Linear(2, 2), None))
except Exception as e:
    out["error"] = type(e).__name__
out["warned"] = sum(m.startswith("cp_dtensor.hf.apply_context_parallel_hf") for _, m in caught)
"""
    return code


if _extras.installed("hf"):
    _snippet("apply_context_parallel_hf", _apply_context_parallel_hf_code())


@pytest.mark.skipif(not _extras.installed("hf"), reason="transformers not installed")
def test_apply_context_parallel_hf_warns_once_and_is_the_new_function(fresh_results):
    got = _fresh(fresh_results, "apply_context_parallel_hf")
    assert got["doc"] and got["wrapped"] and got["warned"] == 1 and got["error"] in ("ValueError", "TypeError")


def test_every_deprecated_name_is_listed():
    """The deprecations this file checks are the ones _deprecated.py declares (a new rename adds a test)."""
    text = (PKG / "_deprecated.py").read_text()
    assert json.loads(json.dumps(sorted(MOVED_MODULES))) == sorted(MOVED_MODULES)
    assert "renamed_keyword" in text and "seq_dim_argument" in text


def _every_name_code() -> str:
    snapshot = json.loads((ROOT / "tests" / "_public_names.json").read_text())["names"]
    titan = _extras.installed_version("titan")[:2] if _extras.installed("titan") else None
    wanted = {}
    for module, names in snapshot.items():
        if module.startswith("cp_dtensor.titan.v03") and titan != (0, 3):
            continue
        if module.startswith("cp_dtensor.titan") and not module.startswith("cp_dtensor.titan.v03") and titan is None:
            continue
        if module.startswith("cp_dtensor.titan.") and not module.startswith("cp_dtensor.titan.v03") and \
                module != "cp_dtensor.titan.config_registry" and titan != (0, 2):
            continue
        if (module.startswith("cp_dtensor.hf") and not _extras.installed("hf")) or module == "cp_dtensor.titan.float8" \
                and not _extras.installed("float8"):
            continue
        wanted[module] = names
    code = "import importlib, warnings\nwarnings.simplefilter('ignore')\nfor module, names in %r.items():\n" % wanted + """
    m = importlib.import_module(module)
    missing = [n for n in names if not hasattr(m, n)]
    if missing:
        out[module] = missing
"""
    global EVERY_NAME_MODULES
    EVERY_NAME_MODULES = wanted
    return code


_snippet("every_name", _every_name_code())


def test_every_name_released_before_the_subpackages_still_resolves(fresh_results):
    """tests/_public_names.json: every module's ``__all__`` (and the package's lazy names) as released before
    the move into subpackages. Each name must still resolve through its old module path (warning or not).
    torchtitan modules are checked under the torchtitan version they belong to; extras that are not installed
    skip their modules."""
    assert _fresh(fresh_results, "every_name") == {}
    assert len(EVERY_NAME_MODULES) >= 30


def test_messages_show_the_current_calls():
    """No error message or docstring outside _legacy/ tells users to call the deprecated
    ``shard_batch(mesh, tokens, ...)`` order: they show ``shard_batch((tokens, ...), cp_mesh)`` (issue 40)."""
    import re

    old_order = re.compile(r"shard_batch\((cp_)?mesh, (tokens|input|t1|\*?tensors\b(?!\)))")
    package = pathlib.Path(cp_dtensor.__file__).parent
    found = [f"{path.relative_to(package)}:{i}: {line.strip()}"
             for path in package.rglob("*.py") if "_legacy" not in path.parts
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if old_order.search(line) and "old" not in line]
    assert not found, "\n".join(found)
