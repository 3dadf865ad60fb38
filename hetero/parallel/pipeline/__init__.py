"""Pipeline parallelism: split a model into stages (split.py, balanced by time in balance.py), order each rank's
work (schedule.py; Chimera's two directions in chimera.py), run it with point-to-point activations and gradients
(runtime.py)."""
