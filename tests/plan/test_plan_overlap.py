"""What a collective hidden behind compute still costs between GPUs (plan/overlap.py): the compute it overlaps
runs 18.9% slower for each second hidden (Lee et al. 2025, arXiv 2507.03114), in the rows at scale and in the
plans of a profiled model for a GPU cluster; between CPU processes nothing is added."""

from __future__ import annotations

import pytest

from torchfleet.plan import comm, predict
from torchfleet.plan.hardware import Target
from torchfleet.plan.layouts import layout
from torchfleet.plan.profile import Profile
from torchfleet.plan.scale_rows import fsdp_overlapped


def test_fsdps_hidden_collectives_slow_the_compute_they_overlap():
    # 4 s of collectives over 4 blocks behind 10 s of compute: one block's second waits, three hide.
    t = fsdp_overlapped(10.0, 4.0, 4, tp=0.5)
    assert t["overlap"] == pytest.approx(0.189 * 3.0)
    assert t["exposed"] == pytest.approx(1.0 + 0.189 * 3.0 + 0.5)
    assert t["step"] == pytest.approx(10.0 + t["exposed"])
    # More collectives than compute: what exceeds it waits as well, and only what the compute covers hides.
    t = fsdp_overlapped(2.0, 4.0, 4)
    assert t["overlap"] == pytest.approx(0.189 * (4.0 - 1.0 - 2.0))
    assert t["step"] == pytest.approx(2.0 + 1.0 + 2.0 + 0.189 * 1.0)
    # Nothing hidden, nothing slowed: a single block's collectives all wait.
    assert fsdp_overlapped(10.0, 4.0, 1)["overlap"] == 0.0


def _profile() -> Profile:
    params = 375_000_000
    return Profile("m", params, params, params // 12, 13, 1e5, 1024, 6 * 125_000_000 * 1024, "adamw", 1e6, 0.0, 0.0)


def test_ddp_between_gpus_pays_for_the_buckets_its_backward_hides(h100_nodes):
    """DDP's buckets but the last hide behind backward on 2 x 8 H100s; the step is the compute, the last
    bucket's all-reduce and 0.189 of the hidden ones' seconds."""
    target = h100_nodes(2)
    profile, batch = _profile(), 16 * 16
    times = predict.step_time(profile, layout("ddp", 16, batch, profile), batch, target, 1, None)
    whole, last = comm.bucketed_all_reduce_s(
        4 * profile.parameters, 16, target.link_for(16), predict.DDP_BUCKET_BYTES, predict.DDP_FIRST_BUCKET_BYTES
    )
    backward = predict.BACKWARD_SHARE * times["compute"]
    waits = max(last, whole - backward)
    assert waits < whole  # some of it hides
    assert times["communication"] == pytest.approx(waits + 0.189 * (whole - waits), rel=1e-9)
    assert times["step"] == pytest.approx(times["compute"] + times["communication"], rel=1e-12)


def test_between_cpu_processes_overlap_adds_nothing():
    link = comm.Link(1e9, 0.0)
    target = Target("2 hosts", 2, 1, 1e12, link, link, rate=1e11)
    profile, batch = _profile(), 32
    times = predict.step_time(profile, layout("ddp", 2, batch, profile), batch, target, 1, None)
    whole, last = comm.bucketed_all_reduce_s(
        4 * profile.parameters, 2, link, predict.DDP_BUCKET_BYTES, predict.DDP_FIRST_BUCKET_BYTES
    )
    assert times["communication"] == pytest.approx(max(last, whole - predict.BACKWARD_SHARE * times["compute"]))
