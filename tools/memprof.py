"""Run a training script under hetero's memory profiler, without editing it.

    python tools/memprof.py [--out DIR] [--steps N] [--exit] -- python examples/train_gpt.py --steps 50
    python tools/memprof.py --steps 3 -- python -m mypackage.train --config run.yaml     # a module, as python -m

The script runs in this process (runpy, with its own sys.argv). Every engine `hetero.initialize` creates is wrapped
in `hetero.profile` from its creation; recording stops after N optimizer steps of that engine (or when the engine is
closed, or when the script ends, whichever is first) and the outputs are written to DIR (summary.txt, summary.json,
timeline.png, trace.json). A second engine writes to DIR/engine1, and so on; under torchrun each rank writes to
DIR/rankR. The script then runs on to its normal end, unprofiled; with --exit the process ends cleanly as soon as the
last profile is written (exit status 0; the script's own cleanup, such as engine.close, still runs through
SystemExit unwinding).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import hetero  # noqa: E402
import hetero.engine  # noqa: E402
from hetero.profiler import Profile  # noqa: E402
from hetero.profiler.recorder import check_writable  # noqa: E402


class _Stop(SystemExit):
    """Raised (with --exit) once every profile is written: unwinds the script, running its cleanup."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        usage="memprof.py [-h] [--out DIR] [--steps N] [--exit] -- python (SCRIPT | -m MODULE) [ARGS...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="memprof", help="output directory (default: ./memprof)")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps to record per engine (default 5)")
    ap.add_argument("--exit", action="store_true", help="end the run once the profiles are written")
    if "--" not in argv:
        ap.parse_args(argv)  # --help prints the help; anything else is an unknown argument or the missing `--`
        ap.error("give the command to profile after --, e.g. -- python examples/train_gpt.py --steps 50")
    cut = argv.index("--")
    args = ap.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    if command and Path(command[0]).name.startswith("python"):
        command = command[1:]  # `-- python script.py ...`: the interpreter is this one
    if not command:
        ap.error("nothing to run after --")
    if args.steps < 1:
        ap.error(f"--steps: expected an integer >= 1, got {args.steps}")
    if command[0] == "-m":
        if len(command) < 2:
            ap.error("-m needs a module name")
    elif not Path(command[0]).is_file():
        ap.error(f"no such script: {command[0]}")

    out = Path(args.out)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        out = out / f"rank{os.environ.get('RANK', '0')}"
    try:  # before the script runs: a bad --out stops here, not after the steps it was to profile
        check_writable(out, what="--out")
    except hetero.ConfigError as e:
        ap.error(str(e))
    profiles: list[Profile] = []
    original = hetero.engine.initialize

    def wrote(prof: Profile) -> None:
        # tqdm.write: on a line of its own, above any progress bar the script is drawing
        tqdm.write(f"memprof: wrote {prof.out_dir}/summary.txt, timeline.png, trace.json", file=sys.stderr)

    def on_stop(prof: Profile) -> None:
        wrote(prof)
        if args.exit and all(p.finished for p in profiles):
            raise _Stop(0)

    def initialize(*a: object, **kw: object) -> hetero.Engine:
        engine = original(*a, **kw)
        target = out if not profiles else out / f"engine{len(profiles)}"
        prof = Profile(engine, target, max_steps=args.steps, on_stop=on_stop, per_rank=False)  # rankR: above
        profiles.append(prof)
        prof.start()
        return engine

    hetero.initialize = hetero.engine.initialize = initialize
    saved_argv = sys.argv
    try:
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            sys.path.insert(0, os.getcwd())  # as `python -m module` would
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(command)
            sys.path.insert(0, str(Path(command[0]).resolve().parent))  # as `python script.py` would
            runpy.run_path(command[0], run_name="__main__")
    except _Stop:
        pass
    finally:
        sys.argv = saved_argv
        hetero.initialize = hetero.engine.initialize = original
        for prof in profiles:  # the script ended (or failed) before N steps: write what was recorded
            if prof.active:
                prof.on_stop = None  # no _Stop raised here: the script has ended already
                prof.stop()
                wrote(prof)  # as at the N-th step: where to look
        if not profiles:  # the script ended, or raised, before making an engine
            with contextlib.suppress(OSError):
                out.rmdir()  # made above; left empty
    if not profiles:
        print("memprof: the script created no hetero engine; nothing was profiled", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
