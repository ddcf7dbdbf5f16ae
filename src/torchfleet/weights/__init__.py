"""A model's weights at the size users run them: built without memory, read and written shard by shard.

- deferred.py: a model built on the meta device given storage and values only where a process holds them.
- files.py: a Hugging Face directory of safetensors files, read a region and written a tensor at a time.
- keys.py: which of a directory's keys hold each of the model's tensors, checked for the whole model at once.
- start.py: what `Fleet.setup` does around the strategy for a meta model or a directory.
- saving.py: `save_model` of a transformers model as a Hugging Face directory, written by every rank.
"""

from torchfleet.weights.keys import KeyMap
from torchfleet.weights.saving import Pretrained
from torchfleet.weights.start import Start

__all__ = ["KeyMap", "Pretrained", "Start"]
