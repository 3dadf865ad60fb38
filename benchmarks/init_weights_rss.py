"""Peak host memory of initialising a model larger than the host from pretrained weights, and the bytes a rank reads.

    python benchmarks/init_weights_rss.py [--dir /tmp/init_weights] [--nvme-dir /tmp]

A Llama of 136 MiB in fp32 (vocabulary 8192, hidden 512, intermediate 1536, 8 layers, untied embeddings: 35.7M
parameters) is built under `hetero.lazy_init()` and initialised at ZeRO stage 3 with parameters and AdamW states on
NVMe under a 32 MiB host budget and a 16 MiB device budget (4.25x the host budget; on the CPU the device tier is RAM
too), each case in a fresh process: by its own initialiser, from sharded .safetensors, from one torch.save
`pytorch_model.bin` read by TorchZipFile ([Note: reading torch's zip format without torch.load]), and from the same
.bin through torch.load(mmap=True), the path every .bin took before. Reported: the growth of the process's peak RSS
(VmHWM) across `hetero.initialize`, and at stage 3 over two gloo ranks the bytes each rank read by positioned
reads and the peak of its file-backed resident memory (RssFile: the mapped pages it touched).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CFG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
CASES = ("own", "safetensors", "bin", "bin-mmap")


def _make(folder: Path) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG))
    (folder / "st").mkdir(parents=True, exist_ok=True)
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder / "st", max_shard_size="40MB")
    torch.save(model.state_dict(), folder / "bin" / "pytorch_model.bin")


def _weights(folder: Path, case: str) -> Path | None:
    if case == "own":
        return None
    if case == "bin-mmap":  # the path before TorchZipFile: torch.load(mmap=True)
        from hetero.zero import weights
        from hetero.zero.torch_zip_file import NotServed

        def old(f: Path) -> None:
            raise NotServed("measuring the mmap path")

        weights.TorchZipFile = old
    return folder / ("st" if case == "safetensors" else "bin")


def _model():
    import transformers

    import hetero

    torch.manual_seed(0)
    with hetero.lazy_init():
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG))


def _config(nvme_dir: str) -> dict:
    return {
        "zero_stage": 3,
        "chunk_size": 1 << 20,
        "offload": {"params": "nvme", "optimizer": "nvme"},
        "memory": {"host_budget": 32 << 20, "device_budget": 16 << 20, "nvme_dir": nvme_dir},
    }


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes. VmHWM, the peak RSS, is this process's own: ru_maxrss carries a parent's
    peak across fork and exec, which hid the growth (the parent had built the model to save it)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))


def _one(folder: Path, case: str, nvme_dir: str) -> dict:
    import hetero

    torch.set_num_threads(1)
    path = _weights(folder, case)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    base = _status("VmHWM")
    engine = hetero.initialize(model, opt, _config(nvme_dir), weights=path)
    grew = _status("VmHWM") - base
    n = sum(p.numel() for p in model.parameters())
    engine.close()
    return {"case": case, "params": n, "grew": grew}


def _rank(rank: int, world: int, folder: str, case: str) -> dict:
    import hetero

    torch.set_num_threads(1)
    path = _weights(Path(folder), case)
    model = _model()
    read, plain = [0], os.preadv

    def counted(fd: int, buffers: list, offset: int) -> int:
        got = plain(fd, buffers, offset)
        read[0] += got
        return got

    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _status("RssFile"))
            stop.wait(0.002)

    before = _status("RssFile")
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    os.preadv = counted
    try:
        config = {"zero_stage": 3, "chunk_size": 1 << 20}
        engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config, weights=path)
    finally:
        os.preadv = plain
        stop.set()
        sampler.join()
    engine.close()
    return {"read": read[0], "rss_file": peak[0] - before}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/init_weights")
    parser.add_argument("--nvme-dir", default="/tmp")
    parser.add_argument("--one", choices=CASES)  # internal: one case in this process
    args = parser.parse_args()
    folder = Path(args.dir)
    if args.one:
        print(json.dumps(_one(folder, args.one, args.nvme_dir)))
        return
    if not (folder / "bin" / "pytorch_model.bin").exists():
        _make(folder)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    mib = 1 << 20
    for case in CASES:
        out = subprocess.run(
            [sys.executable, __file__, "--dir", str(folder), "--nvme-dir", args.nvme_dir, "--one", case],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{case:12s} {r['params'] * 4 / mib:.0f} MiB fp32: peak RSS grew {r['grew'] / mib:.0f} MiB", flush=True)
    sys.path.insert(0, str(ROOT))
    from tests.dist import run_distributed

    size = (folder / "bin" / "pytorch_model.bin").stat().st_size
    for case in ("bin", "bin-mmap", "safetensors"):
        res = run_distributed(_rank, 2, str(folder), case, timeout=600)
        parts = ", ".join(
            f"rank {i}: read {x['read'] / mib:.1f} MiB, file pages resident {x['rss_file'] / mib:.1f} MiB"
            for i, x in enumerate(res)
        )
        print(f"stage 3, world 2, {case:12s} (file {size / mib:.1f} MiB): {parts}", flush=True)


if __name__ == "__main__":
    main()
