"""Merge the Perfetto traces the ranks of a job wrote (`prof/rank0/trace.json`, `prof/rank1/trace.json`, ...) into
one, each rank a process of its own, their times lined up on the system clock the ranks share.

    python tools/merge_traces.py prof                       # every prof/rank*/trace.json -> prof/trace.json
    python tools/merge_traces.py a/trace.json b/trace.json -o both.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hetero.profiler.trace import merge


def _inputs(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for given in paths:
        p = Path(given)
        if p.is_dir():
            ranks = sorted(p.glob("rank*/trace.json"), key=lambda f: int(f.parent.name[4:] or 0))
            if not ranks:
                raise SystemExit(f"merge_traces: no rank*/trace.json under {p}: give memprof's --out folder of a job")
            found += ranks
        elif p.is_file():
            found.append(p)
        else:
            raise SystemExit(f"merge_traces: {p} is neither a trace file nor a folder")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="memprof's --out folder of a job, or trace.json files")
    ap.add_argument("-o", "--out", help="the merged trace (default: trace.json in the folder given)")
    args = ap.parse_args(argv)
    files = _inputs(args.paths)
    if args.out is None and not (len(args.paths) == 1 and Path(args.paths[0]).is_dir()):
        raise SystemExit("merge_traces: give -o OUT when merging files")
    out = Path(args.out) if args.out else Path(args.paths[0]) / "trace.json"
    traces = []
    for f in files:
        try:
            traces.append(json.loads(f.read_text()))
        except (OSError, ValueError) as e:
            raise SystemExit(f"merge_traces: {f} is not a readable trace ({e})") from None
    try:
        merged = merge(traces)
    except ValueError as e:
        raise SystemExit(f"merge_traces: {e}") from None
    out.write_text(json.dumps(merged))
    print(f"merge_traces: {len(files)} ranks -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
