"""What a kernel derives from a tensor, made once and kept while the tensor lives unchanged.

The CPU paths turn the same tensors into something else at every step: `fused.linear` multiplies a
weight through oneDNN in a packed layout, `cpu_kernels`' loops read a norm's weight (and a step's
cos and sin, in every layer) as numpy arrays. Making either again at each call costs what the call
saves: packing a weight is a copy of it, and in a decode step even a view costs microseconds, on a
host whose caches the layer's weights have just streamed through. So each keeps what it made in a
`DerivedCache`, by the tensor's identity:

* an entry is used only for the very tensor it was made from (a weak reference says so: a new
  tensor that reuses a freed one's `id` is not mistaken for it), and goes when that tensor does;
* a tensor changed in place since (its `_version` moved on) gets its entry made again. A tensor
  made in inference mode has no version: it is trusted as it was made -- the engine's are made by
  the step (cos and sin) and not changed after.

(Not a `weakref.WeakKeyDictionary`: that compares its keys with `==`, elementwise on tensors.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch

Derived = TypeVar("Derived")


class DerivedCache(Generic[Derived]):
    """id(tensor) -> (a weak reference to it, its version when made, what was made from it)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int | None, Derived]] = {}
        # The keys, as a set made anew at every change: what `holds` reads in a graph torch.compile
        # traces. dynamo reads a dict by walking it, and a weak reference's callback may drop an
        # entry mid-walk (a collection during the trace frees some old tensor): "dictionary
        # changed size during iteration". Nothing changes a frozenset in place.
        self._keys: frozenset[int] = frozenset()

    def get(self, tensor: torch.Tensor, make: Callable[[torch.Tensor], Derived]) -> Derived:
        """What `make(tensor)` made, from the cache, or made (again) where it is not there for
        this tensor as it is now."""
        entry = self._entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor or entry[1] != _version(tensor):
            return self.put(tensor, make(tensor))
        return entry[2]

    def put(self, tensor: torch.Tensor, derived: Derived) -> Derived:
        """Keep `derived` as `tensor`'s entry (as it is now), until `tensor` goes."""
        key = id(tensor)
        gone = weakref.ref(tensor, lambda _, key=key: self._drop(key))
        self._entries[key] = (gone, _version(tensor), derived)
        self._keys = frozenset(self._entries)
        return derived

    def _drop(self, key: int) -> None:
        """The entry under `key` gone, with its tensor."""
        if self._entries.pop(key, None) is not None:
            self._keys = frozenset(self._entries)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether an entry was made from this very tensor (perhaps before an in-place change). In a
        graph being traced: whether one was made from a tensor of its `id` (see `_keys`)."""
        if torch.compiler.is_compiling():
            return id(tensor) in self._keys
        entry = self._entries.get(id(tensor))
        return entry is not None and entry[0]() is tensor

    def values(self) -> Iterator[Derived]:
        """Everything held now."""
        return (entry[2] for entry in list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place change counter; None for an inference tensor, which has none."""
    return None if tensor.is_inference() else tensor._version
