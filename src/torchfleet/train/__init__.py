"""The built-in job of `torchfleet train`: the loop (loop.py), its config, models, data,
the summary it prints (report.py), the hogwild variant, and how many processes it gets
(planner.py). Fault injection for drills and tests is faults.py."""
