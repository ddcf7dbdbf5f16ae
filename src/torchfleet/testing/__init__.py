"""Reference jobs and test helpers, shipped so users can check their own set-up the way the suite does.

- `equivalence`: train K steps of a small model under a strategy, return the
  weights; on every strategy that computes what serial computes they match
  serial's within float tolerance.
- `real_models`: the same on models someone else shaped (the built-in gpt,
  Hugging Face's GPT-2, resnet18), and what each rank holds in memory.
- `devices`: the device and backend a Fleet picks, the CPU run a GPU run is
  compared with, fp16 with an overflowing step.
- `cli`: the command line in a process of its own, forked from a server that
  imported torch once.
"""
