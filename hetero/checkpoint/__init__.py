"""Checkpoints: sharded, atomic saves; verified, resharding loads; streamed consolidation to one state_dict.

engine.save_checkpoint(root, client_state=...) and engine.load_checkpoint(root) delegate here; `keep_last(root, n)`
deletes all but a root's newest n; `python -m hetero.checkpoint consolidate CKPT_DIR OUT` writes one plain state_dict.
"""

from hetero.checkpoint.consolidate import consolidate, verify
from hetero.checkpoint.load import load_checkpoint
from hetero.checkpoint.prune import keep_last
from hetero.checkpoint.save import save_checkpoint

__all__ = ["consolidate", "keep_last", "load_checkpoint", "save_checkpoint", "verify"]
