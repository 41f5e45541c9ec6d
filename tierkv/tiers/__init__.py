"""tierkv.tiers: where blocks live. L1 (DevicePool), L2 (HostPool), and the L3 stores.

Tiers hold bytes and free slots; which block goes where is decided above them, in the index.
"""

from .gpu import DevicePool
from .host import HostPool

__all__ = ["DevicePool", "HostPool"]
