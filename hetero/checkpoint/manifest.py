"""The checkpoint directory: its manifest, the `latest` pointer, and an index of every saved tensor segment.

[Note: checkpoint layout]
    ROOT/latest                       text: the tag of the newest complete checkpoint (moved atomically)
    ROOT/<tag>/manifest.json          written last, by rank 0: files, sizes, checksums, engine state, layout
    ROOT/<tag>/state.pt               rank 0: param groups, client_state, LR scheduler (loaded weights_only=True)
    ROOT/<tag>/rank-00000.safetensors one per global rank, written in parallel
    ROOT/.tmp-<tag>-<nonce>/          a save in progress (or one killed midway): never read; the next save
                                      deletes one left behind once its rank 0 is gone
    ROOT/.tmp-<tag>-<nonce>.owner     whose save that is (rank 0's process), for the next save to tell a
                                      stopped one from a live one (staging.py)
    ROOT/.stale-<tag>-<nonce>/        the checkpoint <tag> set aside by a save replacing it, for the instant
                                      between its two renames; read in its place if a kill left <tag> missing

HeteroTrainer's checkpoint-N/ folder holds the engine's ROOT in its hetero/ subfolder (NESTED): every reader
(`resolve`) takes the folder for that root.

Tensors are stored by parameter name and element range, not by chunk, so any layout can read them. A key is
"KIND:START:NAME": elements [START, START + numel) of the flattened tensor NAME, where KIND is `master` (fp32 master
weights), `state.<s>` (optimizer state s), `frozen` (values of parameters that are not trained), `grad` (a rank's
pending gradient in the middle of gradient accumulation), `buffer` (a module buffer, whole) or `rng`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import zlib
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from hetero.checkpoint import blocks
from hetero.checkpoint.earlier import choices, damaged, unreadable
from hetero.checkpoint.format import PAD_MAX, TensorReader
from hetero.checkpoint.read_faults import read_latest
from hetero.checkpoint.seal import breaks_seal
from hetero.checkpoint.seal import dumps as dumps  # re-exported: what readers and tests call mf.dumps, mf.sealed
from hetero.checkpoint.seal import sealed as sealed
from hetero.errors import CheckpointError

FORMAT = "hetero-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
STALE = ".stale-"  # ROOT/.stale-<tag>-<nonce>: see [Note: checkpoint layout]
UNFINISHED = ".tmp-"  # ROOT/.tmp-<tag>-<nonce>: a save in progress, or killed (deleted by the next save: staging.py)
NESTED = "hetero"  # HeteroTrainer's checkpoint-N/hetero/ (hetero/integrations/transformers.py)
_RUN_BYTES = 64 << 20  # the most one vectored read asks for
STATE_FILE = "state.pt"
log = logging.getLogger("hetero.checkpoint")


def key(kind: str, name: str, start: int = 0) -> str:
    return f"{kind}:{start}:{name}"


def split_key(k: str) -> tuple[str, int, str]:
    kind, start, name = k.split(":", 2)
    return kind, int(start), name


def rank_file(global_rank: int) -> str:
    return f"rank-{global_rank:05d}.safetensors"


# ---- durable file system steps ---------------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> int:
    """Write a file and fsync it; returns its CRC32."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return zlib.crc32(data)


def replace_atomic(path: str, data: bytes) -> None:
    """Replace `path` with `data` so that a reader sees the old or the new contents, never a mix, even after a
    crash: write a temporary file beside it, fsync, rename over, fsync the directory. A failure before the rename
    removes the temporary file (a full disk is not left fuller) and leaves `path` as it was."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            crc = zlib.crc32(block, crc)
    return crc


# ---- finding and checking a checkpoint -------------------------------------------------------------------------
def latest_tag(root: str) -> str | None:
    """The tag ROOT/latest names, or None where there is no readable pointer."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip()
    except OSError:
        return None


def resolve(path: str | os.PathLike) -> str:
    """The checkpoint directory `path` names: a tag directory itself, a root whose `latest` names one, or a folder
    (HeteroTrainer's checkpoint-N/) whose NESTED subfolder is either."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        tag = read_latest(latest)  # its read failing worded: [Note: a disk error reading a checkpoint]
        target = os.path.join(path, tag)
        if not os.path.isfile(os.path.join(target, MANIFEST)):
            aside = set_aside(path, tag)
            if aside is None:
                gone = "its manifest was deleted" if os.path.isdir(target) else "the directory is missing"
                raise CheckpointError(
                    f"{latest} names {tag!r}, but {target} holds no {MANIFEST} ({gone}): the checkpoint was removed "
                    f"or moved. {choices(path)}"
                )
            log.warning(
                "%s is missing: a save replacing it was killed; reading the one it set aside, %s", target, aside
            )
            return aside
        return target
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory{_beside(path)}")
    nested = os.path.join(path, NESTED)
    if _holds_checkpoints(nested):
        return resolve(nested)
    if complete_tags(path):
        # `latest` is the only file a save writes outside its tag directory: a copy of the tag directories alone
        # (or a hand-made one) lacks it. Which of these to resume from is the user's call, not a guess here.
        raise CheckpointError(
            f"{path}: a checkpoint root with no {LATEST} file (lost, or not copied with it). {choices(path)}"
        )
    folders = trainer_checkpoints(path)
    if folders:  # a Trainer's output_dir: which of its checkpoints to take is the user's call, as above
        raise CheckpointError(
            f"{path}: a training output folder holding the checkpoints {', '.join(folders)}: pass one of them, e.g. "
            f"{os.path.join(path, folders[-1])}"
        )
    beside = _beside(path)
    if beside and any(n == STATE_FILE or n.startswith("rank-") for n in os.listdir(path)):  # its manifest gone
        raise CheckpointError(
            f"{path}: holds no {MANIFEST}, so it is no complete checkpoint (its manifest was deleted, or the save that "
            f"wrote it never finished){beside}"
        )
    raise CheckpointError(
        f"{path}: neither a checkpoint (no {MANIFEST}) nor a checkpoint root (no {LATEST} file). A save that was "
        f"interrupted leaves only a .tmp-* directory, which is never complete{beside}"
    )


def _beside(path: str) -> str:
    """For an error about `path`, a tag directory that is no checkpoint: the intact checkpoints of the root holding
    it and how to load one (`choices`); nothing where its parent is no checkpoint root."""
    parent = os.path.dirname(os.path.abspath(path))
    return f". {choices(parent)}" if _holds_checkpoints(parent) else ""


def trainer_checkpoints(path: str) -> list[str]:
    """The folders directly under `path` whose NESTED subfolder holds checkpoints (HeteroTrainer's checkpoint-N/),
    in step order: checkpoint-10 after checkpoint-9."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    found = [n for n in names if _holds_checkpoints(os.path.join(path, n, NESTED))]
    return sorted(found, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def _holds_checkpoints(path: str) -> bool:
    """Whether `path` is a checkpoint, or a root of some (`latest`, or complete tag directories)."""
    return (
        os.path.isfile(os.path.join(path, MANIFEST))
        or os.path.isfile(os.path.join(path, LATEST))
        or bool(complete_tags(path))
    )


def complete_tags(root: str) -> list[str]:
    """The tags of the complete checkpoints directly under `root` (a manifest written: the last step of a save),
    sorted; never a .tmp-* or .stale-* directory."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(n for n in names if not n.startswith(".") and os.path.isfile(os.path.join(root, n, MANIFEST)))


def set_aside(root: str, tag: str) -> str | None:
    """The complete checkpoint of `tag` a save set aside to replace it (see `hetero.checkpoint.save`), if any."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    for name in names:
        if stale_tag(name) == tag and os.path.isfile(os.path.join(root, name, MANIFEST)):
            return os.path.join(root, name)
    return None


def stale_tag(name: str) -> str | None:
    """The tag of a set-aside directory's name (.stale-<tag>-<8 hex digits>), else None. Parsed whole, since a
    prefix match would take step-1's for step-1-micro-2's."""
    if not name.startswith(STALE) or len(name) < len(STALE) + 10 or name[-9] != "-":
        return None
    return name[len(STALE) : -9]


def read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing; {directory} is not a complete checkpoint{_beside(directory)}"
        ) from None
    except OSError as e:  # an I/O error, a permission: the file named, and what to load instead
        raise unreadable(path, e) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise damaged(path, f"not valid JSON ({e}): the manifest is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a hetero checkpoint manifest")
    if breaks_seal(manifest):
        raise damaged(
            path,
            "fails its CRC32 check: the manifest is corrupt (or was edited), and the step counts, random states and "
            "checksums it holds cannot be trusted",
        )
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{path}: format version {manifest['version']} is newer than this hetero reads ({VERSION}): upgrade hetero"
        )
    return manifest


def check_files(directory: str, manifest: dict[str, Any], names: list[str] | None = None) -> None:
    """Every listed file (or `names`) exists with its recorded size; whole-file CRC for small files, header CRC for
    tensor files (their tensors are checked one by one as they are read)."""
    for name, info in manifest["files"].items():
        if names is not None and name not in names:
            continue
        path = os.path.join(directory, name)
        try:
            _check_file(path, info)
        except FileNotFoundError:
            raise damaged(path, "missing; the checkpoint is incomplete") from None
        except OSError as e:  # an I/O error, a permission: the file named, and what to load instead
            raise unreadable(path, e) from None


def _check_file(path: str, info: dict[str, Any]) -> None:
    """One file of `check_files`: its size, and its CRC32 (of the whole file, or of a tensor file's header)."""
    size = os.path.getsize(path)
    if size != info["size"]:
        what = "truncated" if size < info["size"] else "longer than written"
        raise damaged(path, f"{what} ({size} bytes, the manifest says {info['size']})")
    if "crc32" in info and file_crc(path) != info["crc32"]:
        raise damaged(path, "fails its CRC32 check: the file is corrupt")
    if "header_crc32" in info:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            raw = head + f.read(n) if 0 <= n <= size else b""
        if zlib.crc32(raw) != info["header_crc32"]:
            raise damaged(path, "its header fails its CRC32 check: the file is corrupt")


# ---- the index of segments -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    file: str
    key: str
    start: int  # first element of the flattened tensor
    end: int
    crc: int
    blocks: tuple[int, ...] = ()  # the checksum of each block, for a segment longer than one ([Note: block checksums])
    block_bytes: int = 0  # their size (blocks.py)


class Index:
    """Every saved segment by (kind, tensor name), and readers for the files, opened on first use."""

    def __init__(self, directory: str, manifest: dict[str, Any]) -> None:
        self.directory = directory
        self.manifest = manifest
        self.segments: dict[tuple[str, str], list[Segment]] = defaultdict(list)
        for fname, info in manifest["files"].items():
            size, sums = blocks.from_entry(info)  # none in files saved before block checksums
            for k, (numel, crc) in info.get("tensors", {}).items():
                kind, start, name = split_key(k)
                self.segments[(kind, name)].append(
                    Segment(fname, k, start, start + numel, crc, tuple(sums.get(k, ())), size)
                )
        for segs in self.segments.values():
            segs.sort(key=lambda s: s.start)
        self._readers: dict[str, TensorReader] = {}
        self._pool: ThreadPoolExecutor | None = None  # the reading thread of fill_async, made on first use
        self._check_pool: ThreadPoolExecutor | None = None  # its checksumming thread

    def reader(self, fname: str) -> TensorReader:
        if fname not in self._readers:
            self._readers[fname] = TensorReader(os.path.join(self.directory, fname))
        return self._readers[fname]

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.segments

    def fill(self, kind: str, name: str, lo: int, out: torch.Tensor, *, grad_file: str | None = None) -> None:
        """Fill the flat CPU-or-device tensor `out` with elements [lo, lo + out.numel()) of tensor `name`'s `kind`,
        from whatever segments cover them, checking each segment's checksum (of a segment read in part, the blocks
        read, [Note: block checksums] in blocks.py; one saved without blocks is read whole into scratch memory
        first). grad_file: take only segments from that file (a rank's own)."""
        hi = lo + out.numel()
        segs = [s for s in self.segments.get((kind, name), ()) if grad_file is None or s.file == grad_file]
        covered = 0
        for seg in segs:
            a, b = max(seg.start, lo), min(seg.end, hi)
            if a >= b:
                continue
            covered += b - a
            reader = self.reader(seg.file)
            dtype = reader.entry(seg.key).dtype
            whole = a == seg.start and b == seg.end
            target = out[a - lo : b - lo]
            if whole and target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
                reader.read_into(seg.key, target, crc=seg.crc)
            elif seg.blocks and not whole:
                blocks.read_checked(reader, seg, a, target)
            else:
                tmp = torch.empty(seg.end - seg.start, dtype=dtype)
                reader.read_into(seg.key, tmp, crc=seg.crc)
                target.copy_(tmp[a - seg.start : b - seg.start])
        if covered != hi - lo:
            raise CheckpointError(
                f"{self.directory}: the checkpoint covers {covered} of elements [{lo}, {hi}) of {kind} {name!r}: "
                "files are missing from it or it was not written by a complete save"
            )

    def fill_async(self, requests: list[tuple[str, str, int, torch.Tensor]]) -> list[Future]:
        """`fill` for many (kind, name, lo, out) at once; returns at once with futures to wait on. Whole segments
        bound for CPU memory are sorted by file offset and read in runs of adjacent segments (or with only padding
        between), each run in large requests on an I/O thread, in order, and checksummed on a second one (preadv and
        the checksums release the GIL), so checking run k overlaps reading run k+1; the rest goes through `fill` on the
        reading thread. One thread reads through the page cache, so that the disk sees one sequential stream: two
        threads at two offsets of one file descriptor share its read-ahead state, which then takes them for random
        reads. Files read with O_DIRECT ([Note: direct reads] in format.py) get two reading threads: no read-ahead
        to confuse, and the disk stays busy while one request completes. With the layout that saved the checkpoint,
        every request is a whole segment: the file is read front to back in large requests."""
        direct: dict[str, list[tuple[int, int, str, torch.Tensor, int]]] = defaultdict(list)
        rest = []
        for kind, name, lo, out in requests:
            segs = self.segments.get((kind, name), ())
            hi = lo + out.numel()
            whole = [s for s in segs if s.start == lo and s.end == hi]
            if len(whole) == 1 and out.device.type == "cpu" and out.is_contiguous():
                seg = whole[0]
                entry = self.reader(seg.file).entry(seg.key)
                if entry.dtype == out.dtype:
                    direct[seg.file].append((entry.begin, entry.end, seg.key, out, seg.crc))
                    continue
            rest.append((kind, name, lo, out))
        runs = []
        for fname, items in direct.items():
            items.sort(key=lambda it: it[0])
            run: list = []
            for it in items:
                if run and (not 0 <= it[0] - run[-1][1] < PAD_MAX or it[1] - run[0][0] > _RUN_BYTES):
                    runs.append((fname, run))
                    run = []
                run.append(it)
            if run:
                runs.append((fname, run))
        for fname in {f for f, _ in runs} | {s.file for k, n, _, _ in rest for s in self.segments.get((k, n), ())}:
            self.reader(fname)  # opened here: the reader cache is not shared between threads
        if self._pool is None:
            # Direct reads keep no read-ahead state, and a second one in flight keeps the disk busy while the first
            # completes: two threads then. Through the page cache, one (see above).
            uncached = any(self.reader(f).direct for f, _ in runs)
            self._pool = ThreadPoolExecutor(2 if uncached else 1, thread_name_prefix="hetero-ckpt-read")
            self._check_pool = ThreadPoolExecutor(1, thread_name_prefix="hetero-ckpt-check")
        futures = []
        for fname, run in runs:
            items = [(key, out.view(-1), crc) for _, _, key, out, crc in run]
            read = self._pool.submit(self.reader(fname).read_many, items, check=False)
            # Done once read (its error, if any, re-raised) and checked: waiting on it waits for both.
            futures.append(self._check_pool.submit(_check_after, read, self.reader(fname), items))
        return futures + [self._pool.submit(self.fill, *r) for r in rest]

    def fill_all(self, requests: list[tuple[str, str, int, torch.Tensor]]) -> None:
        """`fill_async`, waited for."""
        wait_all(self.fill_async(requests))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._check_pool.shutdown()
            self._pool = None
        for r in self._readers.values():
            with contextlib.suppress(Exception):
                r.close()
        self._readers.clear()


def loads(data: bytes | str) -> Any:
    return json.loads(data)


def _check_after(read: Future, reader: TensorReader, items: list[tuple[str, torch.Tensor, int]]) -> None:
    read.result()
    reader.check_many(items)


def wait_all(futures: list[Future]) -> None:
    """Wait for every future (none is left writing into a buffer), then raise the first error."""
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
