"""The sharded half of checkpoints: torch.distributed.checkpoint (DCP), read safely.

Strategies that declare ``sharded_checkpoint = True`` (fsdp, pipeline and
ddp+pipeline) save through DCP: every rank writes its own shards (or its own
stage) into one directory, and a checkpoint written by N processes loads into
M where the strategy allows it, because DCP reshards on load.
``get_state_dict``/``set_state_dict`` name parameters by their plain path
(no ``module.`` prefix), so any other strategy can read the same directory.

DCP reads its ``.metadata`` with ``pickle.load`` and its non-tensor items with
``torch.load(weights_only=False)``; both would run code from a crafted file.
`SafeReader` and `SafePlanner` read the same files with a restricted
unpickler and ``weights_only=True``, so a sharded checkpoint is no more
trusted than a file one (docs/guides/security.md).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from torchfleet.checkpoint.strided import restrided, unstrided

_TORCH_KINDS = (torch.dtype, torch.layout, torch.memory_format)
# Exactly what DCP's metadata holds; a dotted name could reach any attribute
# (pickle resolves "os.system" inside an allowed module), so names match whole.
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


# Optimizer state and hyper-parameters keyed by parameter name
# ("state.3.weight.exp_avg", "param_groups.3.weight.lr"), not by group
# position: a pipeline stage's first param group and another stage's would
# otherwise share the key "param_groups.0" and DCP would keep only one.
# Keys by name also let a checkpoint cut into 2 stages load into 4, or 1.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_LENIENT = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's own metadata classes and torch's plain value types."""

    def find_class(self, module: str, name: str):
        allowed = (module, name) in _ALLOWED or (
            module == "torch" and "." not in name and isinstance(getattr(torch, name, None), _TORCH_KINDS)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items load with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            # _traverse defines it (_nested_dict, where this came from before, only imports it)
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _own_entries(strategy, model_state: dict) -> dict:
    """The entries of `model_state` that are the model's own state-dict keys.

    A traced pipeline stage holds more: the tracer registers the model's non-persistent
    buffers (BERT's position_ids) and constants (lifted_tensor_0) as entries of its own,
    named by the cut, which would not load into another cut. Such a strategy says which
    keys are the model's (`is_model_key`); the others keep the values the stage has.
    """
    own = getattr(strategy, "is_model_key", None)
    return model_state if own is None else {k: v for k, v in model_state.items() if own(k)}


def save(strategy, directory: Path) -> None:
    """Every rank writes its shards of model and optimizer into `directory` (collective)."""
    model_state, optimizer_state = get_state_dict(strategy.model, strategy.optimizer, options=_OPTIONS)
    model_state = _own_entries(strategy, model_state)
    # sync_files (the default) fsyncs every shard before DCP reports success.
    try:
        dcp.save(
            unstrided({"model": model_state, "optimizer": optimizer_state}),
            no_dist=not dist.is_initialized(),
            storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True),
        )
    except CheckpointException as exc:
        raise _first_failure(exc) from None


def load(strategy, directory: Path) -> None:
    """Read `directory` into the wrapped model and optimizer, resharding as needed (collective)."""
    # get_state_dict creates the optimizer's state when it has none yet, so
    # DCP has tensors of the right shapes and placements to read into.
    model_state, optimizer_state = get_state_dict(strategy.model, strategy.optimizer, options=_OPTIONS)
    own = _own_entries(strategy, model_state)
    original = {"model": own, "optimizer": optimizer_state}
    state = unstrided(original)
    try:
        dcp.load(
            state, storage_reader=SafeReader(str(directory)), planner=SafePlanner(), no_dist=not dist.is_initialized()
        )
    except CheckpointException as exc:
        raise _first_failure(exc) from None
    state = restrided(state, original)
    # Entries left out above keep their values: only then is a missing key expected.
    options = _OPTIONS if len(own) == len(model_state) else _LENIENT
    set_state_dict(
        strategy.model,
        strategy.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=options,
    )


def _first_failure(exc: CheckpointException) -> BaseException:
    """DCP's failure (a BaseException holding each rank's) as the lowest rank's own exception."""
    failures = getattr(exc, "failures", {}) or {}
    for rank in sorted(failures):
        error = failures[rank]
        error = error[0] if isinstance(error, tuple) else error  # (exception, its traceback)
        if isinstance(error, (OSError, pickle.UnpicklingError)):
            return error
        return RuntimeError(str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__)
    return RuntimeError(str(exc))
