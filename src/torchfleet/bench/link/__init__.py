"""`torchfleet bench --nnodes N --node-rank R --master-addr A`: ddp, PowerSGD and diloco over the link between machines.

The same command runs on every machine. Node 0's preflight (launcher/preflight.py) checks the machines
reach each other and agree on versions, and keeps its store open for the whole bench; through it the
machines measure the link (measure.py), take node 0's plan (plan.py), start each cell together and hand
node 0 what they measured (meeting.py). Each cell is a real `torchfleet run` on every machine, one
process each, under `--fault-tolerance step` for diloco and localsgd (cell_process.py starts it, measure_on_machine.py is what
it runs); node 0 shows the table and the verdict and writes results.json (report.py).

- plan.py: the flags, validated once, as the plan every machine runs
- measure.py: the link's Mbit/s, from repeated all-reduces of a known size
- meeting.py: the machines' bench processes talking through node 0's store
- cell_process.py: one cell's `torchfleet run` on this machine, with a deadline and a log
- measure_on_machine.py: the worker: the timed steps, the compute-only probe
- report.py: derived figures, the table, the verdict, results.json
- run.py: the whole command on one machine
"""
