"""The run's services in a Fleet script: per-rank figures, straggler verdicts, the metrics file and the
--dashboard page, with no line in the script.

`torchfleet run` asks for them through the environment its workers inherit (`RunOptions.exported`), with
train's flag names: --log-every, --metrics-out, --dashboard. A script under another launcher (torchrun,
Slurm) gets them with TORCHFLEET_RANK_VIEW=1 and the other variables set by hand; with
TORCHFLEET_RANK_VIEW=0 `torchfleet run` starts none. Fleet then times each
rank's steps as train does (rank_figures.PhaseClock): `fleet.dataloader`'s fetches are the data phase,
`train_step` the compute and communication. Every --log-every steps the ranks' figures travel in one
all-gather (every rank calls train_step as often, so every rank meets it at the same step), and the main
rank writes and judges them (rank_view.RankView) and says any verdict. One process has no others to be
slower than, and replica groups may leave between reads: neither gets them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from torchfleet.config import at_least
from torchfleet.run_services.metrics import MetricsLog, check_metrics_out
from torchfleet.run_services.rank_figures import PhaseClock, gather_rows, hosts, share_host, windows
from torchfleet.run_services.rank_view import RankView, start_dashboard

ON = "TORCHFLEET_RANK_VIEW"
LOG_EVERY, METRICS_OUT, DASHBOARD = "TORCHFLEET_LOG_EVERY", "TORCHFLEET_METRICS_OUT", "TORCHFLEET_DASHBOARD"


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What the launcher asked of a Fleet script's services (train's flags of the same names)."""

    log_every: int = 10
    metrics_out: str | None = None
    dashboard: str | None = None  # the port, as --dashboard's value

    def __post_init__(self) -> None:
        at_least("--log-every", self.log_every, 1)
        if self.metrics_out:
            check_metrics_out(self.metrics_out)

    @classmethod
    def from_environment(cls) -> RunOptions | None:
        """The options in this process's environment; None unless TORCHFLEET_RANK_VIEW is 1."""
        if os.environ.get(ON) != "1":
            return None
        every = os.environ.get(LOG_EVERY, "10")
        if not every.strip().isdigit():
            from torchfleet.errors import UsageError

            raise UsageError(f"{LOG_EVERY}={every!r} is not a number of steps; give one from 1 up")
        return cls(int(every), os.environ.get(METRICS_OUT) or None, os.environ.get(DASHBOARD) or None)

    def exported(self) -> dict[str, str]:
        """The variables that carry these options to the workers (TORCHFLEET_RANK_VIEW=0 given stays: none)."""
        found = {ON: "0" if os.environ.get(ON) == "0" else "1", LOG_EVERY: str(self.log_every)}
        if self.metrics_out:
            found[METRICS_OUT] = self.metrics_out
        if self.dashboard is not None:
            found[DASHBOARD] = self.dashboard
        return found


class FleetServices:
    """One rank's share of the services, from its Fleet's setup to its close."""

    @classmethod
    def start(cls, fleet: Any) -> FleetServices | None:
        """The services `fleet.run_options` asks for, now that setup has the model and optimizer; None when not
        asked, on one process and under replica groups."""
        if fleet.run_options is None or fleet.world_size < 2 or fleet.replicas is not None:
            return None
        return cls(fleet, fleet.run_options)

    def __init__(self, fleet: Any, options: RunOptions):
        strategy = fleet.strategy
        self.options, self.device = options, strategy.runtime.device
        self.main, self.world = fleet.is_main, fleet.world_size
        self.clock = PhaseClock(strategy.model, strategy.optimizer, self.device)
        self.step = 0
        share_host()
        self._hosts: list[str] = []  # every rank's, read at the first window
        self.view = (  # the main rank's: the metrics file, the verdicts, the page
            RankView(MetricsLog(options.metrics_out, per_rank=True), start_dashboard(options.dashboard))
            if self.main
            else None
        )

    def batches(self, loader: Iterable) -> Iterator:
        """`loader`'s batches, each fetch timed (the data phase)."""
        return self.clock.batches(loader)

    def starting(self) -> None:
        """A train step starts (a batch from a loader not Fleet's: no data phase)."""
        self.clock.starting()

    def trained(self) -> None:
        """A train step returned: its phases added; every log_every steps, every rank's sent and judged."""
        self.clock.trained()
        self.step += 1
        if self.step % self.options.log_every == 0:
            self._read()

    def _read(self) -> None:
        payload = torch.tensor(self.clock.take(), dtype=torch.float64, device=self.device)
        start = time.perf_counter()
        sent = gather_rows(payload).tolist()
        self.clock.blocked(time.perf_counter() - start)  # as train's read of its loss window: communication
        if self.view is None:
            return
        if not self._hosts:
            self._hosts = hosts(self.world)
        kind = "cuda_max_allocated" if self.device.type == "cuda" else "rss"
        lines, _, _ = self.view.show(windows(self.step, sent, self._hosts, kind))
        for line in lines:
            print(line, flush=True)

    def close(self) -> None:
        self.clock.close()
        if self.view is not None:
            self.view.metrics.close()
            self.view.close(self.options.metrics_out)


def timed_loader(dataloader: Callable) -> Callable:
    """Fleet.dataloader, its loader `timed`."""

    @functools.wraps(dataloader)
    def made(fleet: Any, *args: Any, **kwargs: Any) -> Any:
        return timed(dataloader(fleet, *args, **kwargs), fleet)

    return made


@contextlib.contextmanager
def timed_step(services: FleetServices | None) -> Iterator[None]:
    """Around Fleet.train_step's strategy step: its phases added to the window, and every log_every steps every
    rank's read (nothing without services)."""
    if services is not None:
        services.starting()
    yield
    if services is not None:
        services.trained()


def close(services: FleetServices | None) -> None:
    if services is not None:
        services.close()


def timed(loader: Any, fleet: Any) -> Any:
    """`loader`, whose passes go through `fleet.services`' clock once setup has started them: the same object,
    its class a subclass of its own that only times each fetch (isinstance, len and the rest are as they were)."""
    if fleet.run_options is None:
        return loader
    base = type(loader)
    if base not in _TIMED:

        def __iter__(self):  # noqa: N807 - the loader's own
            batches = base.__iter__(self)  # what super() gives: the subclass's only parent is `base`
            services = self._torchfleet_fleet.services
            return batches if services is None else services.batches(batches)

        _TIMED[base] = type(base.__name__, (base,), {"__iter__": __iter__, "__qualname__": base.__qualname__})
    loader._torchfleet_fleet = fleet
    loader.__class__ = _TIMED[base]
    return loader


_TIMED: dict[type, type] = {}
