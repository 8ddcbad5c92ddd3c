"""The transformers cache layer that starts from kvtier's cached prefix, taken from a loader
(:mod:`kvtier.engines.layerwise`) when attention reaches the layer."""

from __future__ import annotations

from transformers.cache_utils import DynamicLayer

from kvtier.engines.layerwise import LayerwiseLoader
from kvtier.engines.truncation import ShiftedLoader


class PreloadedLayer(DynamicLayer):
    """A DynamicLayer whose first ``update`` prepends the cached prefix from the loader."""

    def __init__(self, loader: LayerwiseLoader | ShiftedLoader, index: int) -> None:
        super().__init__()
        self._loader: LayerwiseLoader | ShiftedLoader | None = loader
        self._index = index
        self._prefix = loader.tokens

    def get_seq_length(self) -> int:
        if self._loader is not None:
            return self._prefix
        return super().get_seq_length()

    def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self._loader is not None:
            keys, values = self._loader.wait(self._index)
            self.lazy_initialization(key_states, value_states)
            self.keys = keys.to(key_states.device)
            self.values = values.to(value_states.device)
            self._loader = None
        return super().update(key_states, value_states, *args, **kwargs)
