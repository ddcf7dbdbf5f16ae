"""What runs inside the training processes rather than in the launcher: a script's entry under
`torchfleet run` (bootstrap.py), leaving cleanly when preempted (preemption.py, with the spot
notices' watcher, spot_notices.py), and the hang watchdog (hang_watchdog.py).

The launcher's side of the same contracts stays in launcher/: the failure records the workers
write and the launcher summarizes (failures.py), and the preemption signals and note it hands
on (preempt_relay.py). Nothing is imported here, so that a worker's start pays only for what
it uses.
"""
