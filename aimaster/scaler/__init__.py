from aimaster.scaler.api import (NodeInfo, NodeState, ScalePlan, ScaleResult, Scaler,
                                 ScalerError, create_scaler, register_scaler)


def _local(**kwargs):
    from aimaster.scaler.local import LocalProcessScaler
    return LocalProcessScaler(**kwargs)


def _kubernetes(**kwargs):
    from aimaster.scaler.kubernetes import KubernetesScaler  # the kubernetes client: only there
    return KubernetesScaler(**kwargs)


# backends by name; each creator imports its implementation (and heavy client) lazily
register_scaler("local", _local)
register_scaler("kubernetes", _kubernetes)

__all__ = ["NodeInfo", "NodeState", "ScalePlan", "ScaleResult", "Scaler", "ScalerError",
           "create_scaler", "register_scaler"]
