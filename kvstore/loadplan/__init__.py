"""Load or recompute: a per-request, cost-aware decision of how much cached KV to fetch (issue 17).

Pure logic plus one helper around the public client; no dependency on a model, a worker or vLLM.

- ``planner.Planner``: ``plan(tiers, prompt_tokens, ...) -> Plan`` (how many cached blocks to load and
  how many to compute while they load), ``observe(plan, Outcome)``, ``snapshot()``.
- ``costs.ComputeCosts`` / ``costs.LoadCosts``: the online, decaying cost models it plans with.
- ``partial.get_leading``: a Get that keeps the leading blocks that arrived intact.
"""

from kvstore.loadplan.costs import ComputeCosts, ComputePrior, LoadCosts
from kvstore.loadplan.partial import Leading, get_leading
from kvstore.loadplan.planner import CHOICES, POLICIES, Outcome, Plan, Planner, PlannerConfig

__all__ = [
    "CHOICES",
    "POLICIES",
    "ComputeCosts",
    "ComputePrior",
    "Leading",
    "LoadCosts",
    "Outcome",
    "Plan",
    "Planner",
    "PlannerConfig",
    "get_leading",
]
