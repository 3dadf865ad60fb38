"""ZeRO on chunks: parameter layout, per-chunk sharded buffers, hooks, the optimizer update, precision."""
