"""Debug check: is every cached FP8 transpose byte-for-byte the transpose of its FP8 data?

For tests, and for users chasing a divergence between graphed and eager training. It reads
device memory on the host (one synchronisation per device), so it is never captured: calling it
while a CUDA graph is capturing raises. Call it between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from . import _te_compat as te
from . import refresh as _refresh
from .refresh import ParamsOrModule, named_fp8_params

__all__ = ["Fp8VerifyReport", "StaleTransposeError", "verify_fp8_transposes"]


class StaleTransposeError(AssertionError):
    """Raised by ``verify_fp8_transposes(..., raise_on_mismatch=True)`` when a transpose is stale."""


@dataclass
class Fp8VerifyReport:
    """Result of :func:`verify_fp8_transposes`.

    Attributes:
        checked: names of the transposes compared.
        stale: name -> number of differing bytes (``-1``: shape mismatch) for each stale transpose.
        flagged: names whose cache TE has flagged invalid (``_transpose_invalid``); eager TE would
            rebuild those before use, a CUDA graph captured while the flag was clear would not.
        skipped: name -> reason for tensors that could not be compared.
    """

    checked: list[str] = field(default_factory=list)
    stale: dict[str, int] = field(default_factory=dict)
    flagged: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when every compared transpose matches its data exactly."""
        return not self.stale

    @property
    def matched(self) -> list[str]:
        """Names of the transposes that match."""
        return [n for n in self.checked if n not in self.stale]

    def __str__(self) -> str:
        head = f"FP8 transposes: {len(self.checked)} checked, {len(self.stale)} stale, {len(self.skipped)} skipped"
        lines = [head]
        for name, n in self.stale.items():
            what = "shape mismatch" if n < 0 else f"{n} bytes differ"
            flag = (
                " (flagged invalid: eager TE rebuilds it, a graph does not)" if name in self.flagged else ""
            )
            lines.append(f"  stale: {name}: {what}{flag}")
        for name, why in self.skipped.items():
            lines.append(f"  skipped: {name}: {why}")
        return "\n".join(lines)


def _expected_and_actual(data: Tensor, buf: Tensor) -> Optional[tuple[Tensor, Tensor]]:
    n_cols = data.shape[-1] if data.dim() else 1
    if buf.numel() != data.numel() or (buf.dim() and buf.shape[0] != n_cols):
        return None
    # TE layout: data [*M, N] -> transpose [N, *M]; compare as 2-D bytes.
    want = data.reshape(-1, n_cols).t()
    got = buf.reshape(n_cols, -1)
    if want.element_size() == 1 and want.dtype != torch.uint8:
        want = want.view(torch.uint8)
    if got.element_size() == 1 and got.dtype != torch.uint8:
        got = got.view(torch.uint8)
    return want, got


def verify_fp8_transposes(
    params_or_module: ParamsOrModule,
    *,
    include_flagged: bool = True,
    raise_on_mismatch: bool = False,
) -> Fp8VerifyReport:
    """Compare each FP8 parameter's cached transpose with the transpose of its data, byte for byte.

    Args:
        params_or_module: a module, a tensor, or an iterable of tensors/modules.
        include_flagged: also compare caches TE has flagged invalid (default). A graph captured
            while the flag was clear reads the buffer whatever the flag says, so under CUDA graphs
            a flagged mismatch is a real bug. ``False`` skips them (eager-only view).
        raise_on_mismatch: raise :class:`StaleTransposeError` (with the report) instead of
            returning a report that is not ``ok``.

    Returns:
        An :class:`Fp8VerifyReport`.

    Raises:
        RuntimeError: called while a CUDA graph is capturing (this check syncs with the host).
    """
    if _refresh._capturing():
        raise RuntimeError(
            "verify_fp8_transposes() reads device memory on the host and cannot run inside a CUDA graph capture; "
            "call it between training steps (e.g. in on_train_batch_end)."
        )
    report = Fp8VerifyReport()
    pending: dict[torch.device, list[tuple[str, Tensor]]] = {}
    with torch.no_grad():
        for name, t in named_fp8_params(params_or_module):
            data, buf = te.rowwise_data(t), te.transpose_buffer(t)
            if data is None:
                report.skipped[name] = "no row-wise data (column-wise-only storage)"
                continue
            if buf is None:
                report.skipped[name] = "no transpose cache"
                continue
            flagged = te.transpose_flagged_invalid(t)
            if flagged:
                if not include_flagged:
                    report.skipped[name] = "cache flagged invalid (include_flagged=False)"
                    continue
                report.flagged.append(name)
            report.checked.append(name)
            pair = _expected_and_actual(data, buf)
            if pair is None:
                report.stale[name] = -1
                continue
            want, got = pair
            pending.setdefault(want.device, []).append((name, (want != got).sum()))
        for items in pending.values():  # one host read per device
            counts = torch.stack([c for _, c in items]).tolist()
            for (name, _), n in zip(items, counts):
                if n:
                    report.stale[name] = int(n)
    if raise_on_mismatch and not report.ok:
        raise StaleTransposeError(str(report))
    return report
