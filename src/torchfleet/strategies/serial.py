"""serial: one process, one device. The baseline every figure is compared with."""

from torchfleet.strategies.base import Strategy


class Serial(Strategy):
    name = "serial"
