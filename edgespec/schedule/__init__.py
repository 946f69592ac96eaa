"""How many tokens to draft and verify each cycle (`-k auto`): the costs (costs.py), what is learned
of acceptance (acceptance.py), the rate maximised over γ (rate.py), the scheduler (scheduler.py), a
chain's scheduling over its members (chain.py) and the price phase that builds them (pricing.py).
The engine uses `Scheduler` or `ChainScheduler` through the same four calls: draft, observe,
emitted, new_generation."""

from edgespec.schedule.chain import ChainScheduler
from edgespec.schedule.costs import K_MAX, CostModel
from edgespec.schedule.pricing import Pricing
from edgespec.schedule.rate import Decision
from edgespec.schedule.scheduler import Scheduler, check_num_draft

__all__ = ["K_MAX", "ChainScheduler", "CostModel", "Decision", "Pricing", "Scheduler", "check_num_draft"]
