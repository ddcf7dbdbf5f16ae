"""bench's link mode: the machines' bench processes talking through node 0's store.

Node 0's preflight opened a TCPStore on --master-port (launcher/preflight.py); node 0 keeps it for the
whole bench and the others join it as clients. Through it node 0 sends its plan, every machine says it
is ready for the next cell (so the cells start together, and no machine knocks on a port node 0 has not
opened yet), each posts what its own process measured, and node 0 says when the table is written and
keeps the store open until the others have read that.
"""

from __future__ import annotations

import datetime
import json

from torchfleet.errors import TrainingError

KEY = "torchfleet/bench/"
GOODBYE_SECONDS = 5.0  # how long node 0 keeps the store for the others to read the verdict


class Meeting:
    def __init__(self, store, node: int, nodes: int):
        self.store, self.node, self.nodes = store, node, nodes

    def _wait(self, keys: list[str], seconds: float, what: str, senders: tuple[int, ...] = (0,)) -> None:
        """Wait for `keys`, set by `senders` (one each, in order); TrainingError naming who is late."""
        try:
            self.store.wait(keys, datetime.timedelta(seconds=seconds))
        except RuntimeError as exc:  # DistStoreError on a timeout, DistNetworkError when node 0 is gone
            late = [str(n) for n, k in zip(senders, keys, strict=True) if not self._has(k)] or [str(n) for n in senders]
            cause = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
            raise TrainingError(
                f"node {self.node}: node {', '.join(late)} did not send the bench's {what} within"
                f" {seconds:.0f} s ({cause}); see that machine's output"
            ) from None

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except RuntimeError:
            return False

    # -- node 0's plan ----------------------------------------------------------------
    def send_plan(self, plan: dict) -> None:
        self.store.set(KEY + "plan", json.dumps(plan))

    def receive_plan(self, seconds: float) -> dict:
        self._wait([KEY + "plan"], seconds, "plan")
        return json.loads(self.store.get(KEY + "plan"))

    # -- each cell --------------------------------------------------------------------
    def together(self, name: str, seconds: float) -> None:
        """Return when every machine has called this with `name`."""
        self.store.set(f"{KEY}{name}/ready/{self.node}", "1")
        self._wait(
            [f"{KEY}{name}/ready/{n}" for n in range(self.nodes)],
            seconds,
            f"ready signal for {name}",
            tuple(range(self.nodes)),
        )

    def post(self, name: str, value: dict) -> None:
        self.store.set(f"{KEY}{name}/result/{self.node}", json.dumps(value))

    def gather(self, name: str, seconds: float) -> list[dict | None]:
        """On node 0: every machine's post for `name`, in node order; None for one that posted nothing in time."""
        keys = [f"{KEY}{name}/result/{n}" for n in range(self.nodes)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=seconds))
        except RuntimeError:
            pass  # those missing are None below: the cell's row says which machine said nothing
        return [json.loads(self.store.get(k)) if self._has(k) else None for k in keys]

    # -- the end ----------------------------------------------------------------------
    def goodbye(self, verdict: str) -> None:
        """On node 0: the verdict for the others, and the store kept until they have read it."""
        self.store.set(KEY + "verdict", verdict)
        try:
            self.store.wait(
                [f"{KEY}read/{n}" for n in range(1, self.nodes)], datetime.timedelta(seconds=GOODBYE_SECONDS)
            )
        except RuntimeError:
            pass  # a machine that went away cannot be told; node 0 has written everything

    def verdict(self, seconds: float) -> str:
        """On the others: node 0's verdict, once it has written the table."""
        self._wait([KEY + "verdict"], seconds, "verdict")
        text = self.store.get(KEY + "verdict").decode()
        self.store.set(f"{KEY}read/{self.node}", "1")
        return text
