from deeprec_ext.client.client import PSClient
from deeprec_ext.client.routing import RoutingTable

__all__ = ["PSClient", "RoutingTable"]
