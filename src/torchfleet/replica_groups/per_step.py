"""The worker's side of per-step fault tolerance: one replica group's torchft Manager.

Every step of a strategy under `--fault-tolerance step` goes:

1. `start_step()` (at zero_grad): torchft asks the lighthouse for this step's
   quorum on a thread of its own, while the forward and backward run;
2. the strategy's backward averages the gradients inside the group, as it
   always does (DDP's all-reduce, FSDP's reduce-scatter, a pipeline's stages);
3. `average()`: torchft's Manager all-reduces each rank's gradients (its local
   shards, under fsdp) with the same rank of every other group in the quorum,
   the average over the groups that take part;
4. `commit()`: torchft's should_commit, true when every rank of every group
   got through the step; only then does the optimizer step. A group that
   healed this step has already taken a live peer's weights and optimizer
   state (healing_state.py) and applies the same averaged step as the others.

Two rules of torchfleet's on top. At the job's start a group waits until every
group has joined, so the job starts as a whole (as torchrun's static
rendezvous does) and a group that finds no live peer to heal from says so
instead of training alone from its initial weights; and the groups check
once that they start from the same weights. A group that cannot commit a
step for `join_timeout` seconds stops with a sentence saying why.
"""

from __future__ import annotations

import contextlib
import datetime
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchfleet.env import DistEnv
from torchfleet.env.replicas import ReplicaEnv
from torchfleet.errors import TrainingError, UsageError
from torchfleet.replica_groups import torchft_setup
from torchfleet.stores import bound_store

TIMEOUT = datetime.timedelta(seconds=30)  # a collective across groups, a transfer, a commit
CHUNK = 1 << 24  # elements per all-reduce across groups: several in flight, bounded extra memory
_WAIT_PAUSE = 0.5  # seconds between tries while the groups gather at the start


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@contextlib.contextmanager
def _manager_server_on(address: str):
    """torchft 0.2's Manager starts its server on every address ("[::]:port") and has no option for
    another; the server hands out the quorum's addresses, so it gets the job's interface only here."""
    import torchft.manager

    real = torchft.manager.ManagerServer

    def bound(**kwargs):
        port = kwargs["bind"].rsplit(":", 1)[-1]
        kwargs["bind"] = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        return real(**kwargs)

    torchft.manager.ManagerServer = bound  # type: ignore[assignment]
    try:
        yield
    finally:
        torchft.manager.ManagerServer = real  # type: ignore[assignment]


class ReplicaGroup:
    """This process's place in a job of replica groups, and torchft's Manager once `attach` made it."""

    def __init__(self, env: ReplicaEnv, dist_env: DistEnv, device: torch.device):
        reason = torchft_setup.unavailable()
        if reason:
            raise UsageError(f"--fault-tolerance step cannot run here: {reason}")
        self.env, self.dist_env, self.device = env, dist_env, device
        self.manager = None
        self.lines: list[str] = []  # what happened to the groups, for the main rank to print
        self.joined = False  # every group met (or this one healed from a live peer)
        self._in_step = False
        self._start_step: int | None = None
        self._last_progress = time.monotonic()
        self._waiting_since: float | None = None

    # -- set-up ---------------------------------------------------------------
    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision=None) -> None:
        """Start torchft's Manager for the wrapped model: its heartbeats begin here, so as late as set-up allows."""
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        from torchfleet.env.name_lookup import absorb_failed_lookup_warning
        from torchfleet.replica_groups.healing_state import TrainingState
        from torchfleet.replica_groups.quorum_log import Account, RecordedTransport, recording

        torchft_setup.skip_noop_calls()
        self.state = TrainingState(model, optimizer, precision)
        self.account = Account(self.env.group, self.env.groups)
        base = ProcessGroupNCCL if self.device.type == "cuda" else ProcessGroupGloo
        self.pg = recording(base)(timeout=TIMEOUT)
        self.transport = RecordedTransport(self.pg, timeout=TIMEOUT, device=self.device)
        # Before the group's first socket (its store, torchft's): a group of one process (diloco's -n 1) opens
        # no process group of its own, so nothing else has taken c10d's failed-lookup warning in this process.
        absorb_failed_lookup_warning(self.env.addr)
        port = self._store_port()
        try:
            with _manager_server_on(self.env.addr):
                self.manager = Manager(
                    pg=self.pg,
                    load_state_dict=self.state.load,
                    state_dict=self.state.state,
                    min_replica_size=1,
                    rank=self.dist_env.rank,
                    world_size=self.dist_env.world_size,
                    store_addr=self.env.addr,
                    store_port=port,
                    lighthouse_addr=self.env.lighthouse,
                    replica_id=self.env.replica_id,
                    hostname=self.env.addr,
                    checkpoint_transport=self.transport,
                    timeout=TIMEOUT,
                    quorum_timeout=datetime.timedelta(seconds=self.env.join_timeout),
                    connect_timeout=TIMEOUT,
                    # torchfleet seeds every group's model alike and checks it (_check_same_weights); torchft's
                    # initial sync would instead count the syncing groups as zeros in the first step's average.
                    init_sync=False,
                    **self._manager_options(),
                )
        except RuntimeError as exc:  # the lighthouse gone (the job ended, node 0 lost), or rank 0's store
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TrainingError(
                f"replica group {self.env.group} could not start torchft's manager ({first}); is the"
                f" lighthouse at {self.env.lighthouse} still up? It stops when the job ends or its"
                " machine is lost"
            ) from None

    def _manager_options(self) -> dict:
        """More of torchft Manager's options, for a kind of group that needs them (replica_groups/outer_step.py)."""
        return {}

    def _store_port(self) -> int:
        """The group's store for torchft (its rank 0 opens it on the job's interface; a new one per start of the
        workers, so nothing of a previous attempt's keys is read), its port told to the group's other ranks."""
        port = [0]
        if self.dist_env.rank == 0:
            self._store = bound_store(self.env.addr, 0)
            port[0] = self._store.port
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(port, src=0)
        return port[0]

    # -- each step --------------------------------------------------------------
    def start_step(self) -> None:
        """Ask for this step's quorum (torchft does it on its own thread)."""
        if self._in_step:
            return
        assert self.manager is not None, "attach() first"
        if self._start_step is None:
            self._start_step = self.manager.current_step()
        self.manager.start_quorum()
        self._in_step = True

    def _wait_quorum(self) -> None:
        """This step's quorum; a sentence, not torchft's traceback, when the lighthouse gives none."""
        assert self.manager is not None
        try:
            self.manager.wait_quorum()
        except Exception as exc:  # torchft's TimeoutError after join_timeout, or the lighthouse's refusal
            raise self._no_quorum(exc) from None

    def _no_quorum(self, exc: Exception) -> TrainingError:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return TrainingError(
            f"replica group {self.env.group} got no quorum at step {self.step} ({first}): the lighthouse at"
            f" {self.env.lighthouse} does not answer (its machine lost, or the job ended); restart the job"
            " with --resume from the newest checkpoint"
        )

    @torch.no_grad()
    def average(self, optimizer: torch.optim.Optimizer) -> None:
        """Average this rank's gradients with the same rank of every group in the quorum."""
        self.start_step()
        self._wait_quorum()
        assert self.manager is not None
        grads = [_local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for grad in grads:
            by_kind.setdefault((grad.dtype, grad.device), []).append(grad)
        for same in by_kind.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            works = [self.manager.allreduce(chunk) for chunk in flat.split(CHUNK)]
            for work in works:
                work.wait()
            for grad, value in zip(same, flat.split([g.numel() for g in same]), strict=True):
                grad.copy_(value.view_as(grad))

    def commit(self) -> bool:
        """torchft's verdict on this step: True when the optimizer may step (every group's every rank is fine)."""
        assert self.manager is not None
        manager = self.manager
        self.start_step()  # a hand-written loop that went straight to the step
        self._in_step = False
        self._wait_quorum()
        participants = manager.num_participants()
        members = self.pg.members
        if not self.joined:
            self._gather(participants, members)
        ok = manager.should_commit()
        now = time.monotonic()
        if ok:
            self._last_progress = now
            if self.joined:
                self.lines += self.account.committed(manager.current_step(), members, self.transport, self.pg.quorum_id)
        elif now - self._last_progress > self.env.join_timeout:
            error = manager.errored()
            raise TrainingError(
                f"replica group {self.env.group} has not completed a step for {now - self._last_progress:.0f} s"
                f" (at step {manager.current_step()}, with {_members(members)} in the quorum"
                + (f"; last error: {str(error.original_exception).strip().splitlines()[0]}" if error else "")
                + "); check the other groups' output, or restart the job with --resume from the newest checkpoint"
            )
        return ok

    def _gather(self, participants: int, members: tuple[int, ...]) -> None:
        """The start: go on once every group is here, or at once after healing from a live peer."""
        assert self.manager is not None
        now = time.monotonic()
        if self.manager.current_step() != self._start_step:  # a peer was ahead: this group healed from it
            self.joined = True
            return
        if len(members) >= self.env.groups and participants >= self.env.groups:
            self._check_same_weights()
            self.joined = True
            self.account.members, self.account.quorum_id = members, self.pg.quorum_id
            return
        if self._waiting_since is None:
            self._waiting_since = now
            self.lines.append(
                f"group {self.env.group} waits for the other groups at step {self._start_step}"
                f" ({_members(members)} here of {self.env.groups})"
            )
        waited = now - self._waiting_since
        if waited > self.env.join_timeout:
            raise TrainingError(
                f"replica group {self.env.group} waited {waited:.0f} s at step {self._start_step} and only"
                f" {_members(members)} of {self.env.groups} joined: no live peer is ahead to heal from, so it"
                " stops rather than train alone from its initial weights; start the missing groups (the same"
                " command with their --node-rank), or restart every group with --resume from the newest checkpoint"
            )
        self._last_progress = now  # waiting at the start is not a failure to commit
        self.manager.report_error(RuntimeError("waiting for the other replica groups"))  # this step does not count
        time.sleep(_WAIT_PAUSE)

    @torch.no_grad()
    def _check_same_weights(self) -> None:
        """Once, when all groups first meet: do they hold the same weights? (A model built without a fixed seed
        would train apart forever, each group stepping its own weights with the common gradients.)"""
        from torch.distributed import ReduceOp

        assert self.manager is not None
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for p in self._shared():
            total[0] += _local(p).double().sum()
        total[1] = -total[0]
        self.manager.allreduce(total, reduce_op=ReduceOp.MAX).wait()
        differ = torch.tensor([float(total[0] != -total[1])], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(differ, op=dist.ReduceOp.MAX)  # every rank of the group stops, or none
        if differ.item():
            raise TrainingError(
                f"the replica groups start from different weights (group {self.env.group}'s sum"
                f" {float(total[0]):.6g} is not every group's): build the model after torch.manual_seed(...)"
                " with the same seed in every group, or load the same checkpoint"
            )

    def stepped(self) -> None:
        """After the optimizer stepped: nothing more, when the groups average every step."""

    def finish(self) -> None:
        """After the last step: nothing more, when the groups average every step."""

    def _shared(self) -> list[torch.Tensor]:
        """What every group holds alike at the start: the weights, when the groups average every step."""
        return [p for _, p in self.state.params]

    # -- what the job reads ---------------------------------------------------
    @property
    def step(self) -> int:
        """Steps committed by the job so far (a healed group takes its peers' count)."""
        return self.manager.current_step() if self.manager is not None else 0

    @property
    def participants(self) -> int:
        """Groups taking part in the newest quorum."""
        return self.manager.num_participants() if self.manager is not None and self._start_step is not None else 0

    own_checkpoints = False  # every group holds the same state: one writes for all

    @property
    def writes_checkpoints(self) -> bool:
        """One group saves each checkpoint: the first in the quorum (every rank of a group agrees)."""
        return self.manager is None or self.manager.participating_rank() == 0

    def state_dict(self) -> dict:
        assert self.manager is not None
        return self.manager.state_dict()

    def load_state_dict(self, state: dict) -> None:
        assert self.manager is not None
        self.manager.load_state_dict(state)

    def take_lines(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines

    def close(self) -> None:
        """Stop torchft's threads and servers and drop the groups' process group and store now, in this
        thread: left to the interpreter's exit, a C++ thread among them was still running when its
        object was destroyed, and the process aborted after a run that succeeded (1 run in 30 here)."""
        if self.manager is not None:
            self.manager.shutdown(wait=True)
            self.manager = None
            self.pg.shutdown()
            self._store = None


def _members(members: tuple[int, ...]) -> str:
    if not members:
        return "no group"
    return ("group " if len(members) == 1 else "groups ") + ", ".join(map(str, sorted(members)))
