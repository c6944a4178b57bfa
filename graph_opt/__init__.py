"""Graph passes over a model before its first step: ``estimate`` (tables, FLOPs, a PS and
worker plan; ``aimaster estimate``). Importing this package does not import TensorFlow."""
from graph_opt.api import Estimate, EstimateError, Plan, RolePlan, TableEstimate
from graph_opt.plan import CostModel, PlanInputs


def estimate(target: str, **kwargs) -> Estimate:
    """See :func:`graph_opt.estimation.estimate`."""
    from graph_opt.estimation import estimate as _estimate
    return _estimate(target, **kwargs)


__all__ = ["estimate", "Estimate", "EstimateError", "Plan", "RolePlan", "TableEstimate",
           "PlanInputs", "CostModel"]
