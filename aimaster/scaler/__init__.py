from aimaster.scaler.api import (NodeInfo, NodeState, ScalePlan, ScaleResult, Scaler,
                                 ScalerError, create_scaler, register_scaler)


def _local(**kwargs):
    from aimaster.scaler.local import LocalProcessScaler
    return LocalProcessScaler(**kwargs)


register_scaler("local", _local)

__all__ = ["NodeInfo", "NodeState", "ScalePlan", "ScaleResult", "Scaler", "ScalerError",
           "create_scaler", "register_scaler"]
