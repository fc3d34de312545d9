"""Python values of a module tree that a captured step bakes in, compared before every step.

A CUDA graph replays the kernels its capture launched; Python values the forward read while it was
captured (``self.training``, ``nn.Dropout.p``, an ``eps``, a flag of the user's own module) and each
parameter's ``requires_grad`` (which decides whether backward computes its gradient) are constants
of the graph. Code between steps that changes one of them (a callback annealing dropout, a
submodule put in ``eval()``, layers frozen or unfrozen for fine-tuning) would be ignored by every
later replay, and training would silently differ from eager.

:class:`ModuleStateWatch` records, per module, ``training`` and every public attribute holding a
plain value (``bool``, ``int``, ``float``, ``str``, ``None``, ``tuple``, ``enum``), and every
parameter's ``requires_grad``. :meth:`ModuleStateWatch.changed` compares them with the recorded
values: one C-level ``itemgetter`` call per module and one attribute read per parameter (about
8 µs, 75 k instructions, for a GPT of 35 watched modules and 52 parameters), no tensor work.

Not watched: private attributes (``_name``: frameworks keep per-call bookkeeping there),
attributes holding objects (configs, tensors; tensors are watched by address elsewhere), attributes
added after the last :meth:`~ModuleStateWatch.rebuild`, hooks registered later, and global flags
(``torch.backends``); a forward reading one of those after capture still reads the captured value.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from operator import attrgetter, call, itemgetter
from typing import Any, Optional

from torch import nn

__all__ = ["ModuleStateWatch"]

_PLAIN = (bool, int, float, str, type(None), tuple, enum.Enum)
# Exactly these classes read no Python attribute of their own in forward (``F.linear(x, self.weight, self.bias)``;
# containers have no forward): skipped, a third of the tiny GPT's modules (53 -> 35). Subclasses are watched.
_STATELESS = frozenset({nn.Linear, nn.Identity, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict})
_requires_grad = attrgetter("requires_grad")
_DELETED = "<deleted>"


def _current(owner: Any, key: str) -> Any:
    return owner.get(key, _DELETED) if isinstance(owner, dict) else getattr(owner, key)


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. a tensor now where a float was
        return False


def _watched_keys(module: nn.Module) -> list[str]:
    return [k for k, v in module.__dict__.items() if (k == "training" or k[0] != "_") and isinstance(v, _PLAIN)]


def _user_name(name: str) -> str:
    """``body._orig_mod.0`` -> ``body.0``: ``torch.compile``'s wrapper forwards attributes to the module it wraps,
    so the user reaches the wrapped module's values without naming ``_orig_mod``."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod") if "_orig_mod" in name else name


class ModuleStateWatch:
    """Watches the plain Python values of ``module`` and its submodules, and ``requires_grad``.

    Args:
        module: the root module (for Lightning, the ``LightningModule``).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.rebuild()

    def rebuild(self) -> None:
        """Walk the module tree again (new submodules, new attributes) and record the values now."""
        # A module with no plain value of its own (``torch.compile``'s ``OptimizedModule``, whose ``training`` is a
        # property reading the wrapped module's) has nothing to watch: the module it wraps is watched instead.
        mods = [(n, m, keys) for n, m in self.module.named_modules()
                if type(m) not in _STATELESS and (keys := _watched_keys(m))]
        self._names = [_user_name(n) for n, _, _ in mods]
        self._keys = [keys for _, _, keys in mods]
        self._dicts = [m.__dict__ for _, m, _ in mods]
        # itemgetter of one key returns the value, of several a tuple: either way one C call per module.
        self._getters = [itemgetter(*keys) for keys in self._keys]
        named = list(self.module.named_parameters())
        self._pnames = [_user_name(n) for n, _ in named]
        self._params = [p for _, p in named]
        self._values, self._grads = self._read()

    def _read(self) -> tuple[list[Any], list[bool]]:
        return list(map(call, self._getters, self._dicts)), list(map(_requires_grad, self._params))

    def rebase(self) -> None:
        """Record the values now (after a step whose Python ran: what it set is the captured state)."""
        try:
            self._values, self._grads = self._read()
        except KeyError:  # an attribute was deleted
            self.rebuild()

    def changed(self) -> Optional[str]:
        """``None`` if nothing changed since the last record; else what changed (and record the new state).

        Runs before every step: only reads, compares and returns on the unchanged path.
        """
        try:
            if list(map(call, self._getters, self._dicts)) == self._values and (
                list(map(_requires_grad, self._params)) == self._grads
            ):
                return None
        except Exception:  # noqa: BLE001 - a deleted attribute, or a value that cannot be compared
            pass
        old = list(self._items())
        self.rebuild()
        diffs = [(what, v, now) for what, v, now in ((w, v, _current(obj, k)) for w, obj, k, v in old) if not _same(v, now)]
        if not diffs:
            return None  # only new attributes or submodules: nothing a captured graph read changed
        what, a, b = diffs[0]
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        return f"{what} changed from {a!r} to {b!r}{more} after the graph was captured"

    def _items(self) -> Iterator[tuple[str, Any, str, Any]]:
        """The recorded values as (name as a user writes it, owner, attribute, value): ``model.blocks.0.drop.p``."""
        for name, d, keys, v in zip(self._names, self._dicts, self._keys, self._values):
            for k, x in zip(keys, (v,) if len(keys) == 1 else v):
                yield f"{name or type(self.module).__name__}.{k}", d, k, x
        for name, p, g in zip(self._pnames, self._params, self._grads):
            yield f"{name}.requires_grad", p, "requires_grad", g

    @property
    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters that require a gradient, as recorded."""
        return [(n, p) for n, p, g in zip(self._pnames, self._params, self._grads) if g]
