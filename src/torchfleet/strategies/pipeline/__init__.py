"""pipeline, ddp+pipeline and fsdp+pipeline: each process holds one stage of the model.

Every preset of the parallel dimensions with ``pp > 1`` runs here
(strategies/dims.py): ``pipeline`` is one pipeline through every process,
``ddp+pipeline`` replicates it (DDP on each stage across replicas), and
``fsdp+pipeline`` shards each stage across its data-parallel group (FSDP2).
An ``nn.Sequential`` is cut into consecutive stages balanced by parameter
count; a model that declares a pipeline plan is cut by it (declared_cut.py), any
other model by tracing it (cutting.py). `torch.distributed.pipelining` runs each batch as `microbatches`
micro-batches under the chosen schedule (schedules.py: GPipe, 1F1B, or with
`stages_per_process` K > 1 interleaved 1F1B, looped BFS or zero bubble over
pp x K stages, K on each process: local_stages.py); the last stage computes the
loss. The stages of one pipeline read the same batch (the first stage uses
the inputs, the last the targets), so a pipeline counts as one data-parallel
rank.

The modules, one job each:

- strategy.py: the `Pipeline` strategy, which wraps the model and drives its stages.
- cutting.py: cutting a model that is not a Sequential by tracing it, and the `Cut` of
  one stage (mp cuts at the same places: `stage_starts`).
- declared_cut.py: cutting a model that declares its own pipeline plan (transformers'
  ``base_model_pp_plan``), without tracing it.
- skips.py: activations that skip stages, carried through the stages in between.
- example_cut.py: this process's stages of a model that is not a Sequential, cut at setup
  (by its plan or by tracing) on one micro-batch of the example, checkpointed and compiled as asked.
- stages.py: a stage that times its compute; sizing micro-batches, sending the loss.
- static_shapes.py: every stage's shapes worked out in one process, for a fake process group
  (plan's traces), which cannot send them.
- local_stages.py: several stages in one process (the multi-stage schedules).
- gradients.py: tied parameters' gradients summed across processes; clipping to the
  whole model's norm.
- schedules.py: which torch class runs each schedule, and what it accepts.
- stage_state.py: the whole model's state gathered from the stages, and back.
- report.py: the pipeline report, with each process's measured bubble.
- transfer.py: tensors between stages outside a schedule; whole states from shards.

Importing the package imports none of them: `torchfleet.strategies` imports
strategy.py when a pipeline strategy is first looked up, and ``plan`` and ``bench``
read schedules.py alone.
"""
