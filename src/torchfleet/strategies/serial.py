"""serial: one process, one device. The baseline every figure is compared with."""

from torchfleet.strategies.base import Strategy


class Serial(Strategy):
    """The default step, on one device."""
