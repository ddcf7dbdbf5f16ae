"""Reference jobs on models someone else shaped: the built-in gpt and gpt-moe, Hugging Face's GPT-2, resnet18.

Each trains a few steps under a strategy and returns the whole model's state
(or, for `memory_job`, what each rank holds), so the tests can compare them
with serial's. Module-level, so `launch` can start them in new processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchfleet.errors import UsageError
from torchfleet.fleet import Fleet
from torchfleet.train.datasets import synthetic
from torchfleet.train.models import build_model, build_optimizer

if TYPE_CHECKING:
    from torchfleet.models import GPTConfig


def real_model(name: str, tie: bool = False) -> nn.Module:
    """A small model someone else's code shapes: our `gpt` (`gpt-moe`: 4 experts, top-2, in every block),
    or Hugging Face's GPT-2 from a config.

    No dropout, so every strategy computes the same function as serial; no download.
    """
    from torchfleet.models.gpt import GPT, GPTConfig

    if name in ("gpt", "gpt-moe"):
        experts = 4 if name == "gpt-moe" else 0
        return GPT(
            GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, tie_embeddings=tie, experts=experts)
        )
    if name == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=64,
            n_positions=16,
            n_embd=32,
            n_layer=4,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            tie_word_embeddings=tie,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(config)
    raise ValueError(f"no reference model {name!r}")


def _lm_loss(output, targets):
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def train_real_model(
    strategy: str,
    model: str = "gpt",
    steps: int = 5,
    batch_size: int = 8,
    seed: int = 0,
    lr: float = 1e-2,
    tie: bool = False,
    keywords: bool = False,
    optimizer: str = "sgd",
    fleet_options: dict | None = None,
    compile_after_setup: bool = False,
    **strategy_options,
) -> dict | None:
    """{name: weight} of `model` after `steps` steps on random tokens (None on ranks without them).

    `keywords` feeds the inputs as ``model(input_ids=...)``, as Hugging Face models are called.
    `compile_after_setup` holds a ``torch.compile`` of the module setup returned, as a user
    would, while train_step trains.
    """
    fleet = Fleet(strategy=strategy, **(fleet_options or {}), **strategy_options)
    torch.manual_seed(seed)
    net = real_model(model, tie)
    tokens = torch.randint(0, 64, (batch_size * steps, 17), generator=torch.Generator().manual_seed(seed))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    opt = build_optimizer(optimizer, net.parameters(), lr)
    loader = fleet.dataloader(data, batch_size, shuffle=False)
    first = next(iter(loader))[0]
    module, _ = fleet.setup(net, opt, example_inputs={"input_ids": first} if keywords else first)
    compiled = torch.compile(module) if compile_after_setup else None  # noqa: F841 (alive, as a user's is)
    for inputs, targets in loader:
        fleet.train_step({"input_ids": inputs} if keywords else inputs, targets, _lm_loss)
    state, _ = fleet.strategy.state_dicts()
    if not fleet.is_main or not state:
        return None
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def tp_job(strategy: str, cases: list[dict]) -> tuple[list[dict | None], str | None]:
    """`train_real_model`'s cases under a tp preset, then what a model with no plan is told at setup."""
    results = [train_real_model(strategy, **case) for case in cases]
    fleet = Fleet(strategy=strategy)
    net = build_model("mlp", (1, 8, 8), 10)
    said = None
    try:
        fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    except UsageError as error:
        said = str(error)
    torch.distributed.barrier()  # see Fleet.close: tear down together
    torch.distributed.destroy_process_group()
    return results, said


def real_model_matrix(jobs: list[tuple[str, list[dict]]]) -> list[list[dict | None]]:
    """`train_real_model` for each (strategy, cases) of `jobs`, in one set of processes.

    One launch for many strategies: they share the process group, each building its own mesh.
    """
    results = [[train_real_model(strategy, **case) for case in cases] for strategy, cases in jobs]
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # see Fleet.close: tear down together
        torch.distributed.destroy_process_group()
    return results


def memory_job(
    strategies: list[str], config: GPTConfig | str = "tiny", steps: int = 2, sequences: int = 2
) -> dict | None:
    """What each rank holds after fp32 AdamW steps of the built-in gpt, per strategy, in one launch.

    {strategy: {"parameters": P, "held": {rank: {params, grads, optimizer}},
    "peak": [each rank's peak tensor bytes over the steps],
    "resident": [each rank's growth of its peak resident set from just before the model was
    built]}}. `sequences` per rank. A process's resident peak cannot be reset, so "resident"
    reads true only for the first strategy of a launch (benchmarks/fsdp_memory.py runs one).
    """
    import resource

    from torchfleet.models import GPT, gpt_config, lm_loss
    from torchfleet.strategies.fsdp import memory_per_rank
    from torchfleet.tensor_memory import TensorMemory

    def resident_peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    config = gpt_config(config) if isinstance(config, str) else config

    def measure(strategy: str) -> dict:  # a function: one strategy's model and optimizer are gone at the next's
        fleet = Fleet(strategy=strategy)
        before = resident_peak()
        torch.manual_seed(0)
        net = GPT(config)
        params = sum(p.numel() for p in net.parameters())
        model, opt = fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
        tokens = torch.randint(
            0,
            config.vocab_size,
            (sequences, config.block_size + 1),
            generator=torch.Generator().manual_seed(fleet.rank),
        )
        with TensorMemory(model, opt, whole_process=True) as memory:
            for _ in range(steps):
                fleet.train_step(tokens[:, :-1], tokens[:, 1:], lm_loss)
        held = fleet.strategy.memory_report()
        if held is None:  # whole copies (ddp): counted the same way
            local = list(model.parameters())
            held = memory_per_rank(local, [p.grad for p in local], opt)
        mine = torch.tensor([memory.peak_bytes(fleet.device), resident_peak() - before], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(fleet.world_size)]
        torch.distributed.all_gather(every, mine)
        return {
            "parameters": params,
            "held": held,
            "peak": [int(e[0]) for e in every],
            "resident": [int(e[1]) for e in every],
        }

    figures = {strategy: measure(strategy) for strategy in strategies}
    main = torch.distributed.get_rank() == 0
    torch.distributed.barrier()  # see Fleet.close: tear down together
    torch.distributed.destroy_process_group()
    return figures if main else None


def train_resnet(
    strategy: str,
    steps: int = 5,
    batch_size: int = 32,
    seed: int = 0,
    lr: float = 1e-3,
    float64: bool = False,
    **strategy_options,
) -> dict | None:
    """{name: tensor} of the built-in resnet18 (BatchNorm: running statistics too) after `steps`
    SGD steps on random 3x32x32 images, in float32 (float64 with `float64`); None on ranks without them.

    `float64`: the reference. torch's fp32 BatchNorm kernel on CPU is itself far from
    exact where a layer normalises few values (layer4 sees 1x1 maps here): against
    float64 its gradients were 1e-2 to 1.4e-1 off (relative to their largest), the
    synchronised layer's 7e-6.
    """
    from torchfleet.models import resnet18

    fleet = Fleet(strategy=strategy, **strategy_options)
    torch.manual_seed(seed)
    net = resnet18(in_shape=(3, 32, 32), num_classes=10).to(torch.float64 if float64 else torch.float32)
    data = synthetic(batch_size * steps, shape=(3, 32, 32), seed=seed)
    if float64:
        data = torch.utils.data.TensorDataset(data.tensors[0].double(), data.tensors[1])
    fleet.setup(net, torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9))
    for inputs, targets in fleet.dataloader(data, batch_size, shuffle=False):
        fleet.train_step(inputs, targets, nn.functional.cross_entropy)
    state, _ = fleet.strategy.state_dicts()
    fleet.close()
    if not fleet.is_main or not state:
        return None
    dtype = torch.float64 if float64 else torch.float32  # the integer step count too, for one comparison
    return {k: v.detach().to(dtype).cpu().clone() for k, v in state.items()}
