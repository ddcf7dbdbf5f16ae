"""The run's services, offered alike to a user's Fleet script and to `torchfleet train`.

rank_figures.py  each rank's data, compute and communication seconds and memory per log window
stragglers.py    the verdicts that name a slow rank, its host and its phase
metrics.py       the --metrics-out file and TensorBoard's events
rank_view.py     what the main rank does with each window's records: rows, verdicts, the --dashboard page
in_fleet.py      the same for a Fleet script, switched on by `torchfleet run` (no line in the script)
"""
