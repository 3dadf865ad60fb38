"""Host I/O primitives shared by the NVMe tier (`hetero.memory.nvme`) and the checkpoint files
(`hetero.checkpoint.format`): direct I/O (`direct`), checksums (`checksum`) and huge-page host memory (`hugepages`);
and two storages exchanging their memory (`swap`), for the device's transient chunks.

The lowest layer of hetero: it imports nothing else of hetero, so `device.py`, `memory/` and everything above may use
it.
"""
