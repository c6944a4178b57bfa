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
                        "examples", "bench", "scripts") for p in (ROOT / d).rglob("*.py")]
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
