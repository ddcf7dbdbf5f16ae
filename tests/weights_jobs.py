"""Jobs of tests/weights/test_weights.py, run in `torchfleet.launch`'s processes (imported by name, as zoo.py is).

Each case builds a zoo model on the meta device (`fleet.init_module()`), sets it up under a strategy,
from a directory (`weights=`, `adapters=`) or from scratch, and reports what the main rank (or, for
the logits, the rank holding the last stage) sees. Many cases share one launch: the tiny models set up
in well under a second each, and starting processes is what costs.
"""

from __future__ import annotations

import hashlib
import traceback
from pathlib import Path

import torch

import zoo

BUILDERS = {
    "llama": lambda: zoo.hf_llama(False),
    "llama-tied": lambda: zoo.hf_llama(True),
    "qwen2-moe": zoo.hf_qwen2_moe,
    "peft-llama": zoo.peft_llama,
    "dict-out": lambda: zoo.ZOO["dict-out"].build(),
}
INPUTS = torch.randint(0, zoo.VOCAB, (4, zoo.SEQ), generator=torch.Generator().manual_seed(1))


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return BUILDERS[name]()


def case_job(strategy: str, name: str, weights: str | None, adapters: str | None, save_to: str | None) -> dict:
    """One case on this rank: {"logits", "state" (the whole model's, on the main rank), "read"} or {"refused"}."""
    from torchfleet import Fleet
    from torchfleet.errors import UsageError

    fleet = Fleet(strategy=strategy)
    try:
        with fleet.init_module():
            net = build(name)
        opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
        example = {"input_ids": INPUTS}
        model, _ = fleet.setup(net, opt, example_inputs=example, weights=weights, adapters=adapters)
    except UsageError as error:
        return {"refused": str(error)}
    model.eval()
    out = fleet.predict(example)
    logits = None if out is None else out.logits.detach().clone()
    state, _ = fleet.strategy.state_dicts()
    if save_to:
        fleet.save_model(save_to)
    report = fleet.weights_report or {}
    return {
        "logits": logits,
        "state": {k: v.detach().float().cpu().clone() for k, v in state.items()} if fleet.is_main else None,
        "read": report.get("read_bytes"),
        "mapped": report.get("mapped_bytes"),
        "files": report.get("file_bytes"),
        "held": sum(
            (t.to_local() if hasattr(t, "to_local") else t).nbytes for t in fleet.strategy.unwrapped().parameters()
        ),
    }


def cases_job(cases: list[tuple]) -> list[dict]:
    """`case_job` for each case in one set of processes; a failure is returned (as its traceback's end), not raised."""
    import torch.distributed as dist

    results = []
    for case in cases:
        try:
            results.append(case_job(*case))
        except Exception:  # noqa: BLE001 (the test names the case and shows the traceback)
            results.append({"error": traceback.format_exc()[-3000:]})
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return results


def _digest(directory: str) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(directory).rglob("*.safetensors")))).hexdigest()


def save_over_job(directory: str, adapters: str) -> dict:
    """A peft Llama read from `directory` and `adapters` under fsdp (its base frozen, its weights mapped), one
    step trained, saved over `directory` itself: the logits before and after the save, and what the files saw."""
    from torchfleet import Fleet

    fleet = Fleet(strategy="fsdp")
    with fleet.init_module():
        net = build("peft-llama")
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.5)
    example = {"input_ids": INPUTS}
    model, opt = fleet.setup(net, opt, example_inputs=example, weights=directory, adapters=adapters)
    adapters_before = _digest(adapters)
    model.eval()
    start = fleet.predict(example).logits.detach().clone()
    model.train()
    fleet.train_step(example, INPUTS.roll(-1, 1), zoo._lm_loss)
    fleet.barrier()
    adapters_after = _digest(adapters)  # the step wrote the mapped adapters: their file must not change
    model.eval()
    before = fleet.predict(example).logits.detach().clone()
    fleet.save_model(directory)
    after = fleet.predict(example).logits.detach().clone()
    report = fleet.weights_report or {}
    fleet.close()
    return {
        "start": start,
        "before": before,
        "after": after,
        "mapped": report.get("mapped_bytes"),
        "read": report.get("read_bytes"),
        "adapter_file_kept": adapters_before == adapters_after,
    }
