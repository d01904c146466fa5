from mpformer.parallel.layout import ParallelLayout, validate
from mpformer.parallel.topology import Topology

__all__ = ["ParallelLayout", "Topology", "validate"]
