"""Memory tools: the estimator (before a run: will it fit, and where?) and the profiler (during a run: where did
every byte live, when, and what moved?)."""

from hetero.profiler.estimator import Candidate, Estimate, estimate
from hetero.profiler.machine import Machine
from hetero.profiler.plan_result import Option, Plan
from hetero.profiler.planner import plan
from hetero.profiler.rates import Rates
from hetero.profiler.recorder import Profile, profile

__all__ = ["Candidate", "Estimate", "Machine", "Option", "Plan", "Profile", "Rates", "estimate", "plan", "profile"]
