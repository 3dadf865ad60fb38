"""Bandwidth of the NVMe tier (NvmeStore) against the raw sequential bandwidth of the same disk, measured fairly.

    python benchmarks/nvme_bandwidth.py --dir /mnt/nvme --size 1GiB [--chunk 64MiB] [--json] [--no-verify]

Writes --size bytes as --chunk sized fp32 chunks through NvmeStore from the host tier's memory (all writes queued,
then waited for), reads them all back, and checks a sample bit-exact. The raw disk is measured on the same directory
with the same total size by fio, following the rules of benchmarks/README.md: 8 MiB blocks, iodepth 8, libaio,
direct=1, from huge-page buffers (--iomem=mmaphuge; this benchmark reserves the huge pages fio needs through
/proc/sys/vm/nr_hugepages for the run when it may, and says so when it cannot). That is the fair reference the
ratios use: the tier's buffers are huge pages too, and O_DIRECT into 4 KiB pages is limited by pinning them one by
one. Neither side syncs at the end of its writes: O_DIRECT writes are on the disk when they complete (an end fsync,
a flush of the disk's cache, is no part of the tier's work; on a VM that caches writes it cut fio's 4x). fio from
ordinary 4 KiB-page buffers (--iomem=malloc) is reported beside it, for information only. Without fio
(or with --no-fio) a Python pwrite/preadv loop from huge-page memory stands in, with a warning. Tier and raw passes
are interleaved, alternating which goes first, and medians are reported. GB = 1e9 bytes.

Both ways at once (the traffic of an update streamed from NVMe, which reads one chunk's states while writing back
another's): the tier reads back half of the chunks while writing the other half, against fio reading one file and
writing another in one run, the same total depth (--fio-depth split between the two jobs), from huge pages. Its
ratio is the reference for `benchmarks/update_stream.py` and the races' NVMe traffic. Needs fio; --no-mixed skips it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np
import torch  # noqa: E402

from hetero.device import Device  # noqa: E402
from hetero.io import hugepages  # noqa: E402
from hetero.io.checksum import ALGORITHMS, DEFAULT  # noqa: E402
from hetero.memory.nvme import NvmeStore  # noqa: E402

try:
    from hetero.config import parse_size
except ImportError:  # keep the benchmark usable on its own
    _UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    _UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})

    def parse_size(value: int | float | str, *, key: str = "size") -> int:
        m = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{key}: cannot read {value!r} as a size (try 2GiB, 512MiB, 1e9)")
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


ALIGN = 4096
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"
FIO_MISSING = (
    "fio is not installed: the raw-disk reference falls back to a Python pwrite/preadv loop, which is not the fair "
    "baseline of benchmarks/README.md. Install fio (apt-get install fio, dnf install fio, brew install fio) and run "
    "again"
)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def host_buffer(nbytes: int) -> torch.Tensor:
    """The memory the chunk manager's host tier holds chunks in: page-aligned (pinned with CUDA, mmap without)."""
    return Device().empty_host(nbytes)


# ---------------------------------------------------------------------------------------------- tier


def make_chunks(args: argparse.Namespace, chunk: int, nchunks: int) -> tuple[list, list]:
    numel = chunk // 4
    make = (lambda: torch.empty(numel)) if args.pageable else (lambda: host_buffer(chunk).view(torch.float32))
    srcs = []
    for _ in range(nchunks):
        t = make()
        t.uniform_(-1e3, 1e3)  # also faults the pages in, so the timing does not include first-touch
        srcs.append(t)
    srcs[0].view(torch.int32)[:4] = torch.tensor([0x7FC00001, 0x7F800000, -0x800000, -1])  # NaN/inf bits
    dsts = [make().zero_() for _ in range(nchunks)]
    return srcs, dsts


def _store(args: argparse.Namespace) -> NvmeStore:
    """A fresh store (a fresh swap file, like the raw side) with the benchmark's options."""
    options = {} if args.threads is None else {"io_threads": args.threads}
    return NvmeStore(
        args.dir,
        **options,
        block_bytes=args.block,
        staging_buffers=args.staging,
        direct={"auto": None, "on": True, "off": False}[args.direct],
        verify=not args.no_verify,
        checksum=args.checksum,
    )


def _sync(store: NvmeStore) -> None:
    """Buffered: the data must reach the disk inside the timed region (O_DIRECT writes are there already)."""
    if not store.direct:
        fd = os.open(store.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _drop_cache(store: NvmeStore) -> None:
    """Buffered: reads must come from the disk, not the page cache."""
    if not store.direct:
        fd = os.open(store.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_tier(args: argparse.Namespace, srcs: list, dsts: list) -> dict:
    """One pass: a fresh store (a fresh swap file, like the raw side), write all chunks, read all back."""
    total = sum(s.numel() * s.element_size() for s in srcs)
    for d in dsts:
        d.zero_()
    store = _store(args)
    try:
        t0 = time.perf_counter()
        for f in [store.write(i, s) for i, s in enumerate(srcs)]:
            f.result()
        _sync(store)
        t_write = time.perf_counter() - t0
        _drop_cache(store)
        t0 = time.perf_counter()
        for f in [store.read(i, d) for i, d in enumerate(dsts)]:
            f.result()
        t_read = time.perf_counter() - t0
        sample = sorted({0, len(srcs) // 2, len(srcs) - 1})
        for i in sample:
            if not torch.equal(srcs[i].view(torch.uint8), dsts[i].view(torch.uint8)):
                raise SystemExit(f"FAIL: chunk {i} read back differs from what was written")
        return {
            "tier_write_GBps": gbps(total, t_write),
            "tier_read_GBps": gbps(total, t_read),
            # Share of the timed region the I/O threads spent inside pwrite/preadv: near 1 means the
            # tier kept `threads` requests on the device all along (copies and checksums were overlapped).
            "tier_write_queue_busy": store.stats.write_io_seconds / (t_write * store.io_threads),
            "tier_read_queue_busy": store.stats.read_io_seconds / (t_read * store.io_threads),
            "direct": store.direct,
            "threads": store.io_threads,
            "verified_chunks": sample,
        }
    finally:
        store.close()


def bench_tier_mixed(args: argparse.Namespace, srcs: list, dsts: list) -> dict:
    """One pass both ways at once: a fresh store holds the first half of the chunks (written untimed); then the
    second half is written while the first is read back, the requests interleaved as an update issues them."""
    half = len(srcs) // 2
    store = _store(args)
    try:
        for f in [store.write(i, s) for i, s in enumerate(srcs[:half])]:
            f.result()
        _sync(store)
        _drop_cache(store)
        for d in dsts:
            d.zero_()
        settle()
        t0 = time.perf_counter()
        futures = []
        for i in range(half):
            futures += [store.read(i, dsts[i]), store.write(half + i, srcs[half + i])]
        for f in futures:
            f.result()
        _sync(store)
        seconds = time.perf_counter() - t0
        store.read(2 * half - 1, dsts[half]).result()  # the last chunk written, read back untimed
        checks = [(srcs[0], dsts[0]), (srcs[half - 1], dsts[half - 1]), (srcs[2 * half - 1], dsts[half])]
        if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in checks):
            raise SystemExit("FAIL: a chunk read back in the mixed pass differs from what was written")
        return {"tier_mixed_GBps": gbps(2 * half * srcs[0].numel() * srcs[0].element_size(), seconds)}
    finally:
        store.close()


# ---------------------------------------------------------------------------------------------- raw


def _meminfo() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            out[name] = int(rest.split()[0])
    return out


@contextlib.contextmanager
def huge_pages_for(nbytes: int) -> Iterator[str | None]:
    """Make sure fio finds `nbytes` of free huge pages (hugetlbfs) for --iomem=mmaphuge; yields None when it does,
    else the reason why not. fio crashes rather than fall back when it finds too few, so it must not be run then.

    Where /proc/sys/vm/nr_hugepages is writable (root) this adds its own pages to the pool and takes exactly those
    away again, whatever else the pool holds: a benchmark beside it doing the same (two test suites on one machine)
    once saw its fio fail when this one set the pool back to its old size under it. Elsewhere it can only count on
    pages already free."""
    info = _meminfo()
    if "Hugepagesize" not in info:
        yield "this system reports no huge pages (/proc/meminfo)"
        return
    page = info["Hugepagesize"] << 10
    need = -(-nbytes // page) + 4  # fio aligns and pads its buffer area: a few pages to spare
    free = info.get("HugePages_Free", 0)
    try:
        with open(NR_HUGEPAGES) as f:
            before = int(f.read())
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before + need))
    except OSError as e:
        if free >= need:
            yield None
        else:
            yield (
                f"cannot reserve {need} huge pages ({e.strerror or e}): run `sysctl -w vm.nr_hugepages={need}` as "
                "root before the benchmark"
            )
        return
    try:
        got = _meminfo().get("HugePages_Free", 0) - free
        if got < need:  # physical memory too fragmented for that many 2 MiB pages
            yield f"asked the kernel for {need} more free huge pages and got {got} (memory fragmented)"
        else:
            yield None
    finally:
        with contextlib.suppress(OSError):
            with open(NR_HUGEPAGES) as f:
                now = int(f.read())
            with open(NR_HUGEPAGES, "w") as f:
                f.write(str(max(now - need, 0)))


def _fio_jobs(cmd: list[str]) -> list[dict]:
    """Run fio with --output-format=json; its jobs' results, or ValueError where one reported an error."""
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    jobs = json.loads(out[out.index("{") :])["jobs"]
    if errors := [job["error"] for job in jobs if job.get("error")]:
        raise ValueError(f"fio reported error(s) {errors}")
    return jobs


def raw_fio(directory: str, total: int, block: int, depth: int, iomem: str) -> dict:
    """fio's sequential write then read of one fresh file: libaio, direct=1, `depth` blocks in flight, buffers from
    `iomem` (mmaphuge: huge pages; malloc: 4 KiB pages)."""
    path = os.path.join(directory, "raw.fio")
    result = {}
    for rw in ("write", "read"):
        cmd = [
            "fio",
            "--name=raw",
            f"--filename={path}",
            f"--rw={rw}",
            f"--bs={block}",
            f"--size={total}",
            "--direct=1",
            "--ioengine=libaio",
            f"--iodepth={depth}",
            f"--iomem={iomem}",
            "--numjobs=1",
            # No fsync at the end: direct writes are on the disk when they complete, and the tier's (and the Python
            # loop's) are timed without one. On a VM whose disk holds writes in the host's cache, fio's end fsync
            # (a flush of that cache) took its 1 GiB write from 2.8 to 0.6 GB/s: a baseline handicapped 4x.
            "--end_fsync=0" if rw == "write" else "--invalidate=1",
            "--output-format=json",
        ]
        result[rw] = _fio_jobs(cmd)[0][rw]["bw_bytes"] / 1e9
    os.unlink(path)  # the next pass writes a fresh file, as the tier's fresh store does
    return result


def raw_fio_mixed(directory: str, half: int, block: int, depth: int, iomem: str) -> float:
    """fio both ways at once: one job reads a file of `half` bytes (laid out first, untimed) while another writes a
    fresh one of `half` bytes, `depth` blocks in flight between them; GB/s of both together."""
    src, dst = os.path.join(directory, "mixed_src.fio"), os.path.join(directory, "mixed_dst.fio")
    common = ["--direct=1", "--ioengine=libaio", f"--bs={block}", f"--iomem={iomem}", "--output-format=json"]
    lay = ["fio", "--name=lay", f"--filename={src}", "--rw=write", f"--size={half}", f"--iodepth={depth}"]
    _fio_jobs([*lay, *common, "--end_fsync=1"])
    settle()
    each = f"--iodepth={max(depth // 2, 1)}"
    cmd = ["fio", *common, "--name=read", f"--filename={src}", "--rw=read", f"--size={half}", each, "--invalidate=1"]
    cmd += ["--name=write", f"--filename={dst}", "--rw=write", f"--size={half}", each]  # no end fsync: see raw_fio
    try:
        jobs = _fio_jobs(cmd)
    finally:
        for path in (src, dst):
            with contextlib.suppress(OSError):
                os.unlink(path)
    moved = sum(job["read"]["io_bytes"] + job["write"]["io_bytes"] for job in jobs)
    return gbps(moved, max(job["job_runtime"] for job in jobs) / 1e3)


def fair_raw(directory: str, total: int, block: int = 8 << 20, depth: int = 8) -> dict:
    """The raw disk by the rules of benchmarks/README.md, for other benchmarks' I/O bounds: fio (libaio, direct=1,
    `depth` blocks in flight) from huge-page buffers where fio is installed and huge pages can be had, else the
    Python loop from huge-page memory. `raw_method` says which; `raw_warning` (when present) why not fio."""
    why = FIO_MISSING if shutil.which("fio") is None else None
    if why is None:
        with huge_pages_for((depth + 1) * block) as no_huge:
            if no_huge is None:
                try:
                    got = raw_fio(directory, total, block, depth, "mmaphuge")
                except subprocess.CalledProcessError as e:  # e.g. another process took the pages in between
                    no_huge = f"fio failed ({(e.stderr or '').strip()[-300:] or e})"
                else:
                    return {
                        "raw_write_GBps": got["write"],
                        "raw_read_GBps": got["read"],
                        "raw_method": f"fio libaio direct=1 bs={block} iodepth={depth} iomem=mmaphuge",
                    }
            why = f"fio without huge pages: {no_huge}"
    return {**raw_python(directory, total, block, depth), "raw_warning": why}


def raw_python(directory: str, total: int, block: int, threads: int, allow_direct: bool = True) -> dict:
    """Sequential blocks, `threads` in flight, from page-aligned buffers: the disk with no tier logic."""
    path = os.path.join(directory, "raw.bin")
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    direct = True
    fd = -1
    try:
        if not allow_direct:
            raise OSError("buffered I/O requested")
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
        if os.pwrite(fd, mmap.mmap(-1, ALIGN), 0) != ALIGN:
            raise OSError("short probe write")
    except OSError:
        direct = False
        if fd >= 0:
            os.close(fd)
        fd = os.open(path, flags, 0o600)
    nblocks = -(-total // block)
    with contextlib.suppress(OSError):  # like fio's default layout (fallocate=native), outside the timing
        os.posix_fallocate(fd, 0, nblocks * block)
    # The same memory the tier reads into and writes from (page-aligned, huge pages where the kernel gives them):
    # O_DIRECT into scattered 4 KiB pages is measurably slower, and the reference must not be handicapped.
    bufs = [host_buffer(block).numpy() for _ in range(threads)]
    for b in bufs:
        b[:] = np.frombuffer(os.urandom(1 << 16) * (block >> 16), dtype=np.uint8)
    pool = concurrent.futures.ThreadPoolExecutor(threads)

    def run(op, sync: bool) -> float:
        def job(i: int) -> None:
            op(memoryview(bufs[i % threads]), i * block)

        t0 = time.perf_counter()
        # Keep `threads` requests in flight in block order, like the tier's queue.
        list(pool.map(job, range(nblocks)))
        if sync:
            os.fsync(fd)
        return time.perf_counter() - t0

    def write(buf: memoryview, off: int) -> None:
        if os.pwrite(fd, buf, off) != len(buf):
            raise OSError("short write")

    def read(buf: memoryview, off: int) -> None:
        if os.preadv(fd, [buf], off) != len(buf):
            raise OSError("short read")

    try:
        t_write = run(write, sync=not direct)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t_read = run(read, sync=False)
    finally:
        pool.shutdown()
        os.close(fd)
        os.unlink(path)
    mode = "O_DIRECT" if direct else "buffered+fsync+fadvise(DONTNEED)"
    return {
        "raw_write_GBps": gbps(nblocks * block, t_write),
        "raw_read_GBps": gbps(nblocks * block, t_read),
        "raw_method": f"python pwrite/preadv {mode} bs={block} threads={threads}",
    }


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="directory on the disk to test (the nvme_dir)")
    p.add_argument("--size", default="1GiB", help="total bytes to write and read (default 1GiB)")
    p.add_argument("--chunk", default="64MiB", help="chunk size (default 64MiB)")
    p.add_argument("--block", default="8MiB", help="NvmeStore block_bytes and raw block size (default 8MiB)")
    p.add_argument("--threads", type=int, default=None, help="NvmeStore io_threads (default: the store's)")
    p.add_argument("--fio-depth", type=int, default=8, help="fio iodepth, and the Python raw loop's threads (8)")
    p.add_argument("--staging", type=int, default=8, help="NvmeStore staging buffers (default 8)")
    p.add_argument("--direct", choices=["auto", "on", "off"], default="auto", help="NvmeStore O_DIRECT mode")
    p.add_argument("--checksum", choices=ALGORITHMS, default=DEFAULT, help=f"NvmeStore checksum (default {DEFAULT})")
    p.add_argument(
        "--pageable",
        action="store_true",
        help="chunks in plain torch.empty memory (staged through aligned buffers) instead of the host tier's "
        "page-aligned buffers",
    )
    p.add_argument("--no-verify", action="store_true", help="NvmeStore(verify=False): no checksum per block")
    p.add_argument("--no-fio", action="store_true", help="measure the raw disk with the Python loop")
    p.add_argument("--no-mixed", action="store_true", help="skip the pass both ways at once (tier and fio)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved tier/raw passes; medians are reported (3)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object instead of text")
    args = p.parse_args(argv)
    args.size, args.chunk, args.block = (parse_size(v) for v in (args.size, args.chunk, args.block))
    if args.chunk <= 0 or args.chunk % 4 or args.size < args.chunk:
        p.error("--chunk must be a positive multiple of 4 bytes and no larger than --size")
    return args


def settle() -> None:
    """Let the disk finish what the previous side left behind before the next one is timed: deleting its file frees
    gigabytes, which a file system mounted with online discard trims at its next journal commit."""
    os.sync()
    time.sleep(0.5)


def measure(args: argparse.Namespace, total: int, srcs: list, dsts: list, warnings: list[str]) -> list[dict]:
    """The interleaved passes: tier, fio from huge pages (or the Python loop), fio from 4 KiB pages."""
    # With --direct off the tier runs buffered, so the raw side does too (and fio, always direct=1, is skipped).
    allow_direct = args.direct != "off"
    use_fio = allow_direct and not args.no_fio
    if use_fio and shutil.which("fio") is None:
        warnings.append(FIO_MISSING)
        use_fio = False
    runs: list[dict] = []
    workdir = tempfile.mkdtemp(prefix="hetero-bench-", dir=args.dir)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        # Two fio jobs at once in the mixed pass: a few blocks more for the second job's alignment.
        no_huge = stack.enter_context(huge_pages_for((args.fio_depth + 2) * args.block)) if use_fio else None
        if no_huge is not None:
            warnings.append(f"fio without huge pages: {no_huge}; the raw reference uses 4 KiB pages and is handicapped")
        iomem = "malloc" if no_huge is not None else "mmaphuge"
        sides = ["tier", "raw", "raw_4k"] if use_fio else ["tier", "raw"]
        if not args.no_mixed and len(srcs) < 2:
            warnings.append("both ways at once needs two chunks or more: skipped")
        elif not args.no_mixed and not use_fio:
            warnings.append("both ways at once needs fio (O_DIRECT) as its reference: skipped")
        elif not args.no_mixed:
            sides += ["tier_mixed", "raw_mixed"]
        for r in range(args.repeat):
            # Cloud and shared disks drift from second to second: rotate which side goes first.
            run: dict = {}
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                settle()
                if side == "tier":
                    run.update(bench_tier(args, srcs, dsts))
                elif side == "tier_mixed":
                    run.update(bench_tier_mixed(args, srcs, dsts))
                elif side == "raw_mixed":
                    half = len(srcs) // 2 * args.chunk
                    run["raw_mixed_GBps"] = raw_fio_mixed(workdir, half, args.block, args.fio_depth, iomem)
                elif side == "raw_4k":
                    got = raw_fio(workdir, total, args.block, args.fio_depth, "malloc")
                    run.update(raw_4k_write_GBps=got["write"], raw_4k_read_GBps=got["read"])
                elif use_fio:
                    got = raw_fio(workdir, total, args.block, args.fio_depth, iomem)
                    run.update(raw_write_GBps=got["write"], raw_read_GBps=got["read"])
                    run["raw_method"] = f"fio libaio direct=1 bs={args.block} iodepth={args.fio_depth} iomem={iomem}"
                else:
                    run.update(raw_python(workdir, total, args.block, args.fio_depth, allow_direct))
            runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    nchunks = args.size // args.chunk
    total = nchunks * args.chunk
    load_before = os.getloadavg()
    warnings: list[str] = []
    srcs, dsts = make_chunks(args, args.chunk, nchunks)
    runs = measure(args, total, srcs, dsts, warnings)
    keys = ["tier_write_GBps", "tier_read_GBps", "raw_write_GBps", "raw_read_GBps"]
    keys += [k for k in ("raw_4k_write_GBps", "raw_4k_read_GBps", "tier_mixed_GBps", "raw_mixed_GBps") if k in runs[0]]
    res: dict = {k: statistics.median(run[k] for run in runs) for k in keys}
    for k in ("tier_write_queue_busy", "tier_read_queue_busy"):
        res[k] = statistics.median(run[k] for run in runs)
    res["write_ratio"] = res["tier_write_GBps"] / res["raw_write_GBps"]
    res["read_ratio"] = res["tier_read_GBps"] / res["raw_read_GBps"]
    if "tier_mixed_GBps" in res:
        res["mixed_ratio"] = res["tier_mixed_GBps"] / res["raw_mixed_GBps"]
    res.update(direct=runs[0]["direct"], raw_method=runs[-1]["raw_method"], size_bytes=total)
    res.update(verify=not args.no_verify, checksum=args.checksum, chunk_bytes=args.chunk, block_bytes=args.block)
    res.update(threads=runs[0]["threads"], fio_depth=args.fio_depth, pageable=args.pageable, repeat=args.repeat)
    res["verified_chunks"] = runs[0]["verified_chunks"]
    res["tier_huge_pages"] = hugepages.report()  # the tier's buffers: did the kernel give them huge pages?
    res["loadavg"] = {"before": list(load_before), "after": list(os.getloadavg())}
    res["warnings"] = warnings
    res["runs"] = [{k: round(run[k], 3) for k in keys} for run in runs]
    for w in warnings:
        print(f"WARNING: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps(res))
        return 0
    report(args, res, nchunks)
    return 0


def report(args: argparse.Namespace, res: dict, nchunks: int) -> None:
    mode = "O_DIRECT" if res["direct"] else "buffered (fsync after writes, fadvise DONTNEED before reads)"
    hp = res["tier_huge_pages"]
    share = "unknown" if hp["huge_share"] is None else f"{hp['huge_share']:.0%}"
    print(f"dir {args.dir}: {res['size_bytes'] / 1e9:.2f} GB in {nchunks} chunks of {args.chunk / 2**20:g} MiB")
    print(
        f"tier: {mode}, verify={res['verify']} ({res['checksum']}), {res['threads']} threads x "
        f"{args.block / 2**20:g} MiB blocks, host buffers on huge pages: {share} (THP {hp['thp']})"
    )
    print(f"raw : {res['raw_method']}")
    for rw in ("write", "read"):
        line = (
            f"{rw:6s} tier {res[f'tier_{rw}_GBps']:6.2f} GB/s   raw {res[f'raw_{rw}_GBps']:6.2f} GB/s   "
            f"ratio {res[f'{rw}_ratio']:.2f}"
        )
        if f"raw_4k_{rw}_GBps" in res:
            line += f"   (fio from 4 KiB pages, for information: {res[f'raw_4k_{rw}_GBps']:.2f} GB/s)"
        print(line)
    if "mixed_ratio" in res:
        print(
            f"both   tier {res['tier_mixed_GBps']:6.2f} GB/s   raw {res['raw_mixed_GBps']:6.2f} GB/s   ratio "
            f"{res['mixed_ratio']:.2f}   (half read back while half is written; fio: two jobs, one file each)"
        )
    print(
        f"tier I/O threads busy in pwrite/preadv: {res['tier_write_queue_busy']:.0%} of the write time, "
        f"{res['tier_read_queue_busy']:.0%} of the read time"
    )
    load = res["loadavg"]
    print(
        f"medians of {args.repeat} interleaved passes; verified bit-exact: chunks {res['verified_chunks']}; "
        f"load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after"
    )
    for i, run in enumerate(res["runs"]):
        print(f"  pass {i}: " + "  ".join(f"{k[:-5]} {v:.2f}" for k, v in run.items()))


if __name__ == "__main__":
    sys.exit(main())
