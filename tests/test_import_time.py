"""`import hetero` pulls in no heavy package that torch itself leaves out: every command line pays its import.

`hetero.parallel.tp_rng` decorated its methods with `torch.compiler.disable` at class definition, which imports
torch._dynamo (and through it inductor and sympy): `import hetero` took 3.2 s of CPU against torch's 1.5 s, and
`tools/estimate.py --help` waited as long. The compiler is imported where a compile or the feature needs it instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Packages hetero may import only where a feature needs them: the compiler stack and what it drags in, DTensor,
# transformers.
HEAVY = (
    "torch._dynamo",
    "torch._inductor",
    "torch.fx.experimental.symbolic_shapes",
    "sympy",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "transformers",
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a fresh interpreter: modules this test process imported earlier (another test's compile) would hide them.
_PROBE = """
import json, sys
import torch
before = set(sys.modules)
{code}
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _added(code: str) -> list[str]:
    """The modules `code` imports beyond a bare `import torch`, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    probe = _PROBE.format(code=code)
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"the probe failed:\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def _heavy(added: list[str]) -> list[str]:
    """The HEAVY packages among `added` (or any of their modules)."""
    return [h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in added)]


@pytest.mark.parametrize(
    "code",
    [
        "import hetero",
        # A command line's --help: the estimator's imports hetero's profiler and planner.
        "import runpy, contextlib, io\n"
        "sys.argv = ['tools/estimate.py', '--help']\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    runpy.run_path('tools/estimate.py', run_name='__main__')",
    ],
    ids=["import-hetero", "estimate-help"],
)
def test_no_heavy_import_beyond_torch(code: str) -> None:
    added = _added(code)
    assert any(m.startswith("hetero") for m in added), "the probe imported no hetero module"
    heavy = _heavy(added)
    assert not heavy, (
        f"{code.splitlines()[-1].strip()!r} imports {', '.join(heavy)} beyond `import torch`: find the module "
        "level import with `python -X importtime -c 'import hetero'` and import it inside the function that needs it"
    )
