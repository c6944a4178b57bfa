"""What a full window of push request ids (200,000, a long job's) costs where a PS hands
it over, in-process, this tree against ``--base DIR`` (e.g. ``git archive`` of an older
commit), alternated, each round in a fresh process:

- ``promote``: a promotion takes the dead PS's ids from the copy its peer held (what
  ``Promote`` does between adopting the rows and applying the routing, inside the
  recovery), into a PS whose own window is full;
- ``round``: one migration round carrying a full window of ids: encoded, parsed
  (``rowwire``) and recorded by the destination (a first round; before the ids went
  round by round, the fenced last one). ``*_own_ids_kept``: the share of the receiving
  PS's own latest 1,000 ids it still knows after taking the other's window.

    python bench/bench_request_ids.py --base /tmp/base --repeat 5
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(ids: int) -> dict:
    from deeprec_ext import rowwire
    from deeprec_ext.ps.replication import AppliedRequests, ReplicaCopy
    from deeprec_ext.store import EmbeddingStore

    own = [f"{i:08x}-own-{'a' * 20}" for i in range(ids)]
    dead = [f"{i:08x}-dead-{'b' * 20}" for i in range(ids)]
    out = {}
    applied = AppliedRequests()
    applied.add_many(own)
    copy = ReplicaCopy(EmbeddingStore(track_changes=False), 0, dead)
    t = time.perf_counter()
    if hasattr(applied, "adopt"):  # what Promote calls in this tree ...
        applied.adopt(copy.applied, ship=True)
    else:  # ... and before
        applied.add_many(copy.applied, ship=True)
    out["promote_ms"] = round((time.perf_counter() - t) * 1000, 2)
    assert applied.seen(dead[-1])
    # the promoted PS's own latest ids: recorded one by one, the dead PS's window pushed
    # them out of its own
    out["own_ids_kept"] = sum(applied.seen(r) for r in own[-1000:]) / 1000

    dst = AppliedRequests()
    dst.add_many(own)
    t = time.perf_counter()
    wire = rowwire.encode(applied_request_ids=dead)
    t_enc = time.perf_counter()
    batch = rowwire.parse(wire)
    t_parse = time.perf_counter()
    if hasattr(dst, "adopt"):  # what ImportRows does with a full window in this tree
        dst.adopt(dict.fromkeys(batch.applied_request_ids), ship=True)
    else:
        dst.add_many(batch.applied_request_ids, ship=True)
    t_end = time.perf_counter()
    assert dst.seen(dead[-1])
    out["dst_own_ids_kept"] = sum(dst.seen(r) for r in own[-1000:]) / 1000
    out.update(round_ms=round((t_end - t) * 1000, 2),
               encode_ms=round((t_enc - t) * 1000, 2),
               parse_ms=round((t_parse - t_enc) * 1000, 2),
               record_ms=round((t_end - t_parse) * 1000, 2))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--base", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.ids <= 0 or a.repeat <= 0:
        ap.error("--ids and --repeat must be positive")
    if a.child:
        print(json.dumps(measure(a.ids)))
        return 0
    trees = ([("base", a.base)] if a.base else []) + [("this", ROOT)]
    runs: dict[str, list] = {name: [] for name, _ in trees}
    for r in range(a.repeat):
        for name, root in trees:
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--ids", str(a.ids),
                                  "--child"], capture_output=True, text=True, check=True,
                                 env=dict(os.environ, PYTHONPATH=root), timeout=600)
            got = json.loads(res.stdout.strip().splitlines()[-1])
            runs[name].append(got)
            print(f"round {r + 1} {name}: {got}", flush=True)
    summary = {name: {k: round(sorted(x[k] for x in rs)[len(rs) // 2], 3) for k in rs[0]}
               for name, rs in runs.items()}
    if a.base:
        summary["ratio_base_over_this"] = {
            k: round(summary["base"][k] / max(summary["this"][k], 1e-3), 1)
            for k in ("promote_ms", "round_ms")}
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadavg": os.getloadavg(),
                       "ids": a.ids, "runs": runs, "summary_median": summary}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
