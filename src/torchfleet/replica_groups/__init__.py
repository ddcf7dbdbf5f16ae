"""Replica groups on torchft: a lost machine does not stop the job, and diloco's and localsgd's meetings.

Each machine (a replica group) trains as any strategy does; across groups
torchft's Manager averages the gradients every step, after a quorum the
lighthouse (torchft's server) forms. A group that dies leaves the quorum and
the others go on at the next step; a group started again heals by taking the
weights from a live peer (torchft's checkpoint transport), not from a file.
diloco and localsgd run their groups the same way but meet every few steps
instead of every step. torchfleet builds on torchft and adds no quorum,
heartbeat or weight transfer of its own (https://github.com/pytorch/torchft).

- `torchft_setup.py`: whether torchft is installed and loads here, and its
  logs quieted; `lighthouse.py`: starting the lighthouse, bound to the job's
  interface, and checking that it answers before a group starts.
- `per_step.py`: the worker's side of `--fault-tolerance step`, the Manager
  and what torchfleet asks of it each step (start the quorum, average the
  gradients, commit); `healing_state.py`: what a healing group takes from a
  live peer; `quorum_log.py`: the lines about groups that leave, join, heal.
- `sync_methods.py`: diloco's and localsgd's options and defaults (no torch:
  train's launcher and bench read it); `outer_step.py`: their meetings
  (torchft's DiLoCo and LocalSGD); `which_group.py`: which kind of group a
  Fleet is in.
- `on_one_machine.py`: `torchfleet train --strategy diloco -n N`, N groups
  on one machine, one launcher each.

The modules sit on different layers (tests/test_layers.py): `sync_methods`
with the strategies, `on_one_machine` with train, the rest between
checkpoint and the launcher. This file imports none of them.
"""
