"""The built-in job of `torchfleet train`: the loop (loop.py), its config, data (datasets.py,
and text.py for gpt), what each model learns and is scored by (tasks.py), the summary it
prints (report.py), the hogwild variant, and how many processes it gets (planner.py). The
models themselves are `torchfleet.models` (models.py re-exports them). Fault injection for
drills and tests is faults.py."""
