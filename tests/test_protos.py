"""The committed gRPC stubs must match the .proto files."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_stubs_are_current(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(tmp_path)],
                   check=True, cwd=ROOT)
    for gen in sorted((tmp_path / "deeprec_ext" / "proto").glob("*.py")):
        committed = ROOT / "deeprec_ext" / "proto" / gen.name
        assert committed.read_text() == gen.read_text(), \
            f"{committed} is stale: run python scripts/gen_protos.py"
