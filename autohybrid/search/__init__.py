"""Plan search: enumerate candidate plans, price them with the cost model, rank them."""
from .planner import PlanRequest, search

__all__ = ["PlanRequest", "search"]
