"""Pipeline parallelism: split a model into stages (split.py), order each rank's work (schedule.py), run it with
point-to-point activations and gradients (runtime.py)."""
