"""Where a `torchfleet train` run stands, and what happens after each of its steps and epochs.

train/loop.py holds the loop itself; this holds what the loop would
otherwise carry as a dozen local variables: the step, the newest loss, the
last checkpointed step, samples and training seconds, the loss window, the
metrics files, the progress bar and the hang watchdog. Each method is one
thing the loop does at one point of a step or an epoch.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

import torch

from torchfleet import checkpoint
from torchfleet.data import DataError
from torchfleet.fleet import Fleet
from torchfleet.run_services.metrics import MetricsLog
from torchfleet.run_services.rank_figures import PhaseClock, gather_rows, hosts, share_host, windows
from torchfleet.run_services.rank_view import RankView, start_dashboard
from torchfleet.train import faults, link_probe, report
from torchfleet.train.checkpoints import resume, save
from torchfleet.train.config import TrainConfig
from torchfleet.train.job import Job, evaluate
from torchfleet.train.losses import LossWindow
from torchfleet.worker import preemption
from torchfleet.worker.hang_watchdog import Watchdog


class Run:
    """One run's state on one rank, from its first step (or a checkpoint's) to its last."""

    def __init__(self, cfg: TrainConfig, fleet: Fleet, job: Job, listener: preemption.Listener):
        self.cfg, self.fleet, self.job, self.listener = cfg, fleet, job, listener
        self.replicas = fleet.replicas  # under --fault-tolerance step: this machine's replica group
        self.step = self.saved = 0
        self.loss = torch.tensor(float("nan"))  # the newest step's; a resumed run starts with its checkpoint's
        # After a restart by torchrun's agent (--max-restarts) the group resumes on its own; a replica group
        # heals from a live peer instead, which is ahead of any checkpoint.
        restarted = fleet.env.restart_count > 0 and self.replicas is None
        if cfg.checkpoint_dir and (cfg.resume or cfg.resume_fallback or restarted):
            self.step, saved_loss = resume(fleet, cfg, job.sampler)
            self.saved = self.step
            if saved_loss is not None:
                self.loss = torch.tensor(saved_loss)
        self.total_steps = len(job.sampler) * cfg.epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.watchdog = Watchdog(fleet.rank, fleet.world_size, cfg.hang_timeout).start() if cfg.hang_timeout else None
        # The loss reaches the host every --log-every steps, not every step (train/losses.py), and each
        # rank's step phases and memory ride with it to every rank (run_services/rank_figures.py).
        self.window = LossWindow(
            cfg.log_every,
            fleet.rank,
            fleet.strategy.runtime.precision.scaler,
            lambda t: gather_rows(t.to(fleet.device)),
        )
        self.clock = PhaseClock(fleet.strategy.model, fleet.strategy.optimizer, fleet.strategy.runtime.device)
        self.per_rank = fleet.world_size > 1  # one rank has no others to be slower than
        if self.per_rank:
            share_host()
        # Every rank's copy of the rule that probes the links (the same figures reach every rank); None for one
        # process, which shares its host with itself.
        self.links = link_probe.watch(fleet.env, replica_groups=self.replicas is not None)
        slow = faults.slow_compute(fleet.rank)
        if slow is not None:  # a test's slow rank: its busy thread takes each forward's start, inside the timed step
            fleet.strategy.model.register_forward_pre_hook(lambda *_: slow(self.step + 1))
        self._hosts: list[str] = []  # every rank's, read at the first window
        # The validation figures' names (a tally of nothing gives them) are the file's columns.
        self.metrics = (
            MetricsLog(
                cfg.metrics_out,
                cfg.tensorboard,
                tuple(job.task.figures(0.0, 0.0)),
                start_step=self.step,
                extras=("participants",) if self.replicas else (),
                per_rank=self.per_rank,
            )
            if fleet.is_main
            else MetricsLog()
        )
        # The rows, verdicts and --dashboard page of every window, on the main rank: as a Fleet script's.
        self.view = RankView(self.metrics, start_dashboard(cfg.dashboard) if fleet.is_main else None)
        self.val: dict = {}  # the newest validation figures (evaluate's)
        self.samples = 0
        self.train_seconds = 0.0
        self.start = time.perf_counter()
        self.bar: report.StepBar  # while shown()

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    @contextlib.contextmanager
    def shown(self) -> Iterator[None]:
        """The progress bar (main rank, unless --no-progress) and the metrics files, open for the run."""
        with (
            report.progress(
                enabled=self.cfg.progress and self.fleet.is_main,
                total=self.total_steps,
                done=self.step,
                groups=self.replicas is not None,
            ) as bar,
            self.metrics,
        ):
            self.bar = bar
            yield

    def took_peers_step(self) -> bool:
        """Whether the step just taken was not this run's next one: torchft's count says otherwise.

        A step that did not commit is done again on the same batch, and a group that healed goes on at its
        peers' step; Fleet has moved the loader to its batch (step k reads batch k, everywhere).
        """
        if self.replicas is None or self.replicas.step == self.step + 1:
            return False
        self.step = self.replicas.step
        if self.watchdog:
            self.watchdog.beat(self.step)
        self.bar.at(self.step)
        return True

    def batches(self) -> Iterator:
        """The loader's batches, each fetch timed. Bad data found on the way (data/__init__.py's DataError) stops
        the run in one sentence that also says which checkpoint to resume from: one rank cannot save alone
        (the others wait in a collective), so this rank leaves and the launcher stops the others."""
        try:
            yield from self.clock.batches(self.job.loader, self.slow_fetch)
        except DataError as exc:
            if not self.cfg.checkpoint_dir:
                raise
            newest = checkpoint.step_path(self.cfg.checkpoint_dir, self.saved) if self.saved else None
            where = f"--resume goes on from {newest}" if newest else "no checkpoint was saved before it"
            raise DataError(f"{exc} (read for step {self.step + 1}; {where})") from None

    def slow_fetch(self) -> None:
        """Inside each timed fetch of a batch: the fault hook's slow loader, when a test asks for one."""
        faults.slow_fetch(self.fleet.rank, self.step + 1)

    def stepped(self, epoch: int) -> None:
        """After a step: count it, read the losses every --log-every steps, checkpoint every
        --checkpoint-every, and leave if told to."""
        cfg = self.cfg
        self.step += 1
        self.samples += cfg.batch_size
        if self.watchdog:
            self.watchdog.beat(self.step)
        self.window.add(self.loss, self.step, injected=faults.maybe_fire(self.fleet.rank, self.step))
        saving = cfg.checkpoint_dir and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
        shown = None
        if self.step % cfg.log_every == 0 or saving:  # read before saving: never a diverged checkpoint
            shown = self._log(epoch)
        groups = f"{self.replicas.participants}/{self.replicas.env.groups}" if self.replicas else None
        self.bar.advance(epoch=epoch + 1, loss=shown, groups=groups)
        if saving:
            self._save()
        self.leave_if_asked()

    def epoch_read(self, epoch: int) -> None:
        """At an epoch's end: the losses read, a leave acted on, and after the last step diloco's and
        localsgd's last meeting (before the final evaluation)."""
        self.bar.advance(epoch=epoch + 1, loss=self._log(epoch), steps=0)
        self.leave_if_asked()  # before the evaluation, which the time left may not allow
        if self.done:
            self.fleet.finish()

    def evaluated(self, epoch: int) -> None:
        """After an epoch: the validation figures, shown and written; a checkpoint when saving per epoch."""
        beat = functools.partial(self.watchdog.beat, self.step, "evaluate") if self.watchdog else None
        self.val = evaluate(self.fleet, self.job.val_set, beat, self.job.task)
        self.bar.epoch_done(epoch + 1, self.val)
        self.metrics.epoch(self.step, epoch + 1, self.val)
        if self.cfg.checkpoint_dir and not self.cfg.checkpoint_every:
            self._save()

    def ended(self) -> float:
        """After the loop: the final weights saved whatever the interval, a finished run's figures, the
        watchdog stopped. The run's wall time."""
        if self.cfg.checkpoint_dir and self.saved != self.step:
            self._save()
        if self.step == self.total_steps and not self.samples:  # resumed a run that had finished: no step ran
            self.fleet.print(
                f"note: the checkpoint is at the run's last step ({self.step}): nothing is left to"
                " train, and the final loss is the checkpoint's"
            )
            self.val = evaluate(self.fleet, self.job.val_set, task=self.job.task)
        if self.watchdog:
            self.watchdog.stop()
        self.view.close(self.cfg.metrics_out)  # the page readable after the run, which takes the server away
        return time.perf_counter() - self.start

    def leave_if_asked(self) -> None:
        """After a step or an epoch's read: when told to leave, save (unless just saved) and go.
        One process acts on its own flag at once; many act on the flag their last read agreed on
        (LossWindow.read), at most --log-every steps after the signal, all at the same step."""
        single = self.fleet.world_size == 1
        if not (self.listener.requested if single else self.window.leave):
            return
        if self.saved != self.step:
            if single:  # the read that checks the losses: never a diverged checkpoint
                self._log(self.job.sampler.epoch)
            self._save()
        if self.watchdog:
            self.watchdog.stop()
        assert self.cfg.checkpoint_dir is not None  # listening only with --checkpoint-dir
        raise preemption.leave(
            self.listener,
            self.fleet.env.local_rank,
            self.fleet.is_main,
            self.step,
            checkpoint.step_path(self.cfg.checkpoint_dir, self.step),
        )

    def _log(self, epoch: int) -> float | None:
        """Read the loss window (the host sync of a log interval) and record its mean; None if it was empty.
        This rank's preemption flag is agreed on in the same read (window.leave), and its step phases sent."""
        payload = self.clock.take() if self.window.pending else []
        start = time.perf_counter()
        loss = self.window.read(self.listener.requested, payload)
        self.clock.blocked(time.perf_counter() - start)
        if loss is not None:
            extras = {"participants": self.replicas.participants} if self.replicas else {}
            self.metrics.step(
                self.step, epoch + 1, loss, self.job.optimizer.param_groups[0]["lr"], self.samples, **extras
            )
            if self.per_rank:
                self._judge_ranks()
        return loss

    def _judge_ranks(self) -> None:
        """Every rank's window: on every rank, the link probe when every rank's gradient sync rose together;
        on the main rank, the rows in the metrics files and any straggler named."""
        fleet = self.fleet
        if fleet.is_main and not self._hosts:
            self._hosts = hosts(fleet.world_size)
        kind = "cuda_max_allocated" if fleet.strategy.runtime.device.type == "cuda" else "rss"
        records = windows(self.step, self.window.payloads, self._hosts or [""] * fleet.world_size, kind)
        links = self._probe_links(records)
        if not fleet.is_main:
            return
        groups = self.replicas  # under replica groups, who is in the quorum: a verdict, the page's membership chart
        more = list(links)
        if groups is not None:
            more += self.view.stragglers.membership(self.step, groups.participants, fleet.rank, self._hosts[fleet.rank])
        page = [{"kind": "train", "step": self.step, "participants": groups.participants}] if groups else []
        lines, rows, named = self.view.show(records, more, page)
        for line in lines:
            self.bar.note(line)
        self.bar.ranks(rows, named)

    def _probe_links(self, records: list) -> list:
        """The ranks behind a slow link (train/link_probe.py); every rank decides the same and probes together."""
        before = self.links.rose(records) if self.links is not None else None
        if before is None:
            return []
        if self.fleet.is_main:
            least = min(r.comm_s for r in records)
            self.bar.note(
                f"torchfleet: every rank's gradient sync rose together, from {before * 1e3:.1f} ms a step to"
                f" {least * 1e3:.1f} ms or more: probing each rank's link"
            )
        device = self.fleet.strategy.runtime.device
        sends = link_probe.send_seconds(device)
        named = link_probe.verdicts(records, sends, before)
        if self.fleet.is_main:
            self.bar.note(f"torchfleet: {link_probe.found(sends, named)}")
        return named

    def _save(self) -> None:
        self.saved = save(self.fleet, self.cfg, self.step, self.job.sampler, self.loss)
