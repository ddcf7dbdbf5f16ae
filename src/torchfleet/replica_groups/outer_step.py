"""diloco and localsgd across replica groups: torchft's `DiLoCo` and `LocalSGD`, driven step by step.

Each group takes `sync_every` steps with its own (inner) optimizer, as ddp
inside the group; then the groups meet:

1. torchft's quorum, asked for and waited on at once (the Manager without its
   asynchronous quorum, as torchft's DiLoCo requires): a group that left since
   the last meeting is not in it, and one that was started again takes its
   state from a live peer here (the weights, both optimizers, the step count);
2. torchft's exchange: DiLoCo all-reduces each group's pseudo-gradient (the
   weights at the last meeting minus the weights now), puts the weights back,
   and steps the outer optimizer with the average; LocalSGD averages the
   weights themselves;
3. torchft's commit: when a group failed during the exchange, no group applies
   it, and DiLoCo's groups go back to the weights of the last meeting.

torchfleet calls the three parts itself rather than through the optimizer
hooks torchft's classes install, for three things of its own: the groups meet
first before any step (every group present, the same weights, as under
--fault-tolerance step), a group started again meets the others at once
instead of training `sync_every` steps it would throw away, and a checkpoint
taken between meetings resumes bit for bit. The parts it calls are in torchft
0.2 (`_StreamingDiLoCoFragment.prepare_sync` and `perform_sync`,
`LocalSGD._perform_sync`); pyproject pins torchft below 0.3 for them.
"""

from __future__ import annotations

import time

import torch

from torchfleet.env import DistEnv
from torchfleet.env.replicas import ReplicaEnv
from torchfleet.errors import TrainingError
from torchfleet.replica_groups.per_step import ReplicaGroup
from torchfleet.replica_groups.sync_methods import SyncOptions


class OuterGroup(ReplicaGroup):
    """A replica group that meets the others every `sync_every` steps instead of every step."""

    def __init__(self, env: ReplicaEnv, dist_env: DistEnv, device: torch.device, options: SyncOptions):
        super().__init__(env, dist_env, device)
        self.options = options
        self.position = 0  # steps the job has taken, the same in every group: what the loaders read next
        self.local = 0  # steps since the last meeting
        self.outer_optimizer: torch.optim.Optimizer | None = None
        self._fragment = None  # diloco's torchft fragment: the whole model is one
        self._localsgd = None  # localsgd's torchft object
        self._healed_this_step = False

    def _manager_options(self) -> dict:
        return {"use_async_quorum": False}  # torchft's DiLoCo refuses a Manager without it

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision=None) -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD

        super().attach(model, optimizer, precision)
        assert self.manager is not None
        every = self.options.sync_every
        if self.options.outer_step:
            momentum = self.options.outer_momentum
            trained = [p for p in model.parameters() if p.requires_grad]
            self.outer_optimizer = torch.optim.SGD(
                trained, lr=self.options.outer_lr, momentum=momentum, nesterov=momentum > 0
            )
            # pin_memory: the copy of the weights at the last meeting stays in pageable memory, as the
            # model itself does on a CPU (pinning needs an accelerator). use_bucketization: the
            # pseudo-gradients cross in one flat all-reduce, not one per tensor: a meeting pays one
            # collective's latency, not one per tensor (docs/benchmarks/history.md, "Slow links with diloco").
            diloco = DiLoCo(
                self.manager,
                [model],
                optimizer,
                self.outer_optimizer,
                sync_every=every,
                pin_memory=False,
                use_bucketization=True,
            )
            (self._fragment,) = diloco._fragments
        else:
            self._localsgd = LocalSGD(self.manager, model, optimizer, sync_every=every)
        # A group that heals takes the job's position with the weights (its loaders follow it).
        self.manager.register_state_dict_fn(
            "torchfleet_position", self._load_position, lambda: {"position": self.position}
        )

    def _load_position(self, state: dict) -> None:
        self.position = int(state["position"])

    # -- each step --------------------------------------------------------------
    def start_step(self) -> None:
        """Before the first step: meet the other groups (or heal from them)."""
        if not self.joined:
            before = self.position
            self._meet_first()
            # A group that healed took its peers' position; the batch of this step was read for its own
            # (step 0), so the step does not count and the loop reads the peers' batch next. At the job's
            # last meeting that ends the run here, instead of one more step and a meeting nobody attends.
            self._healed_this_step = self.position != before

    def average(self, optimizer: torch.optim.Optimizer) -> None:
        """Between meetings the gradients stay inside the group."""

    def commit(self) -> bool:
        healed, self._healed_this_step = self._healed_this_step, False
        return not healed

    def stepped(self) -> None:
        self.position += 1
        self.local += 1
        if self.local >= self.options.sync_every:
            self._meet()

    def finish(self) -> None:
        """After the last step: a last meeting, so every group ends with the same weights."""
        if self.joined and self.local:
            self._meet()

    def _quorum(self) -> None:
        assert self.manager is not None
        try:
            self.manager.start_quorum()  # with a synchronous quorum this waits for it, and heals
        except Exception as exc:
            raise self._no_quorum(exc) from None

    def _exchange(self) -> bool:
        """torchft's exchange and commit for this meeting; True when it committed."""
        assert self.manager is not None
        at = self.manager.current_step()
        if self._fragment is not None:
            self._fragment.prepare_sync()
            self._fragment.perform_sync()
        else:
            assert self._localsgd is not None
            self._localsgd._perform_sync()
        self.local = 0  # committed or not: torchft put the weights where the next steps start from
        return self.manager.current_step() > at

    def _meet(self) -> None:
        assert self.manager is not None
        self._quorum()
        members = self.pg.members
        if self._exchange():
            self._last_progress = time.monotonic()
            self._account(members)
            return
        waited = time.monotonic() - self._last_progress
        if waited > self.env.join_timeout:
            error = self.manager.errored()
            raise TrainingError(
                f"replica group {self.env.group} has not completed a meeting of the groups for {waited:.0f} s"
                f" (at step {self.position}"
                + (f"; last error: {str(error.original_exception).strip().splitlines()[0]}" if error else "")
                + "); check the other groups' output, or restart the job with --resume from the newest checkpoint"
            )
        self.lines.append(
            f"the meeting at step {self.position} did not complete (a group failed during it):"
            f" {self.options.method} goes on from the weights of the last one"
        )

    def _account(self, members: tuple[int, ...]) -> None:
        """The lines for a meeting that committed, its steps counted as the job's (torchft counts meetings)."""
        if self.transport.received is not None:
            source, _, seconds = self.transport.received
            self.transport.received = (source, self.position, seconds)
        self.lines += self.account.committed(self.position + 1, members, self.transport, self.pg.quorum_id)

    def _meet_first(self) -> None:
        """Every group present with the same weights, or this group healed from a live peer's meeting."""
        assert self.manager is not None
        self._start_step = self.manager.current_step()
        self._last_progress = time.monotonic()
        while not self.joined:
            self._quorum()
            healed = self.manager.current_step() != self._start_step
            members = self.pg.members
            self._gather(self.manager.num_participants(), members)  # joined, or waits a moment
            if healed:  # the others are at a meeting: take part in its exchange, with their state
                self._exchange()
                self._account(members)
            else:
                self.manager.should_commit()  # the meeting at the start changes no weights
        self._last_progress = time.monotonic()

    def _shared(self) -> list[torch.Tensor]:
        """What the groups hold alike at the start: the weights at the last meeting (diloco keeps them; after
        a resume between meetings each group's own weights differ), the weights themselves at a meeting."""
        if self._fragment is not None:
            return list(self._fragment.original_parameters.values())
        return super()._shared() if self.local == 0 else []

    # -- checkpoints ----------------------------------------------------------
    # Between meetings each group's weights are its own, and its inner optimizer's state always is
    # (torchft's DiLoCo averages neither): every group writes its own checkpoint, in its own directory.
    own_checkpoints = True

    @property
    def writes_checkpoints(self) -> bool:
        return True

    def state_dict(self) -> dict:
        assert self.manager is not None
        state = {"manager": self.manager.state_dict(), "position": self.position, "local": self.local}
        if self._fragment is not None and self.outer_optimizer is not None:  # diloco: the weights at the
            # last meeting, the outer momentum
            state["at_meeting"] = [t.clone() for t in self._fragment.original_parameters.values()]
            state["outer_optimizer"] = self.outer_optimizer.state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if "position" not in state:
            raise TrainingError(
                f"this checkpoint was not written by {self.options.method} (it has no position"
                f" between meetings); resume it with the strategy that wrote it"
            )
        assert self.manager is not None
        self.manager.load_state_dict(state["manager"])
        self.position, self.local = int(state["position"]), int(state["local"])
        if self._fragment is not None and self.outer_optimizer is not None:
            for mine, saved in zip(self._fragment.original_parameters.values(), state["at_meeting"], strict=True):
                mine.copy_(saved)
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])

    @property
    def step(self) -> int:
        """Steps the job has taken (a healed group takes its peers')."""
        return self.position
