"""Lower layers never import higher ones; the PS never imports TensorFlow."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# package -> top-level packages of ours it must not import
FORBIDDEN = {
    "deeprec_ext": {"aimaster", "gazer", "graph_opt", "checkpoint", "tfjob_crd", "examples"},
    "checkpoint": {"aimaster", "gazer", "graph_opt", "tfjob_crd", "examples"},
    "graph_opt": {"aimaster", "gazer", "checkpoint", "tfjob_crd", "examples"},
    "gazer": {"aimaster", "graph_opt", "checkpoint", "tfjob_crd", "examples"},
}


# The PS server writes checkpoints (it owns the rows); nothing else in deeprec_ext may.
ALLOWED = {("deeprec_ext/ps/server.py", "checkpoint")}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_layers():
    problems = []
    for pkg, banned in FORBIDDEN.items():
        for f in (ROOT / pkg).rglob("*.py"):
            rel = str(f.relative_to(ROOT))
            bad = {b for b in _imports(f) & banned if (rel, b) not in ALLOWED}
            if bad:
                problems.append(f"{f.relative_to(ROOT)} imports {sorted(bad)}")
    ours = [p for d in ("deeprec_ext", "aimaster", "gazer", "graph_opt", "checkpoint", "tfjob_crd",
                        "examples", "bench", "scripts") for p in (ROOT / d).rglob("*.py")
            if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]  # venvs
    for f in ours:
        rel = f.relative_to(ROOT)
        if "kubernetes" in _imports(f) and not (str(rel).startswith("tfjob_crd")
                                                or str(rel).startswith("aimaster/scaler/kubernetes")):
            problems.append(f"{rel} imports kubernetes")
    assert not problems, "\n".join(problems)


def test_ps_process_never_loads_tensorflow():
    code = ("import sys, deeprec_ext.ps.__main__, deeprec_ext.ps.server, deeprec_ext; "
            "import deeprec_ext.client, deeprec_ext.worker; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_aimaster_process_never_loads_tensorflow():
    """The AIMaster runs exports in a child process: importing its modules (the export
    module included) must not load TensorFlow."""
    code = ("import sys, aimaster.master, aimaster.cli, aimaster.export, aimaster.config, "
            "checkpoint, checkpoint.load; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _module_imports(path: pathlib.Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports (anywhere in it, lazily too), except
    under ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(package + "."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == package:
                out.update(f"{package}.{a.name}" for a in node.names)
            elif node.module.startswith(package + "."):
                out.add(node.module)
    return out


def _aimaster_graph() -> dict[str, set[str]]:
    graph = {}
    for f in (ROOT / "aimaster").rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        graph[name] = {m for m in _module_imports(f, "aimaster") if m != name}
    return graph


def test_aimaster_has_no_import_cycle():
    graph = _aimaster_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif state.get(nxt) is None:
                visit(nxt, path + [nxt])
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_only_the_entry_points_import_the_job_master():
    """Plugins, the servicer and the policy see the job through JobView, never JobMaster."""
    users = sorted(n for n, deps in _aimaster_graph().items() if "aimaster.master" in deps)
    assert users == ["aimaster.cli"], users


def test_no_module_reaches_into_another_objects_private_state():
    """In the control plane, ``x._name`` (x not self/cls) is allowed only for a name the
    same module defines (its own helper classes), never another module's internals."""
    problems = []
    for f in (ROOT / "aimaster").rglob("*.py"):
        tree = ast.parse(f.read_text())
        own = {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
               if isinstance(t, ast.Attribute)}
        own |= {n.name for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and node.attr not in own):
                problems.append(f"{f.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not problems, "\n".join(problems)
