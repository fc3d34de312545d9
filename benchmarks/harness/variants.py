"""The variants of the step-time table: what runs in one child process. Pure Python (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Variant:
    """``compile``: the ``torch.compile`` mode applied to the model in ``configure_model`` (None: not compiled);
    ``ours``: ``CudaGraphCallback()`` attached; ``nemo``: NeMo 3.0.0's ``CUDAGraphCallback`` from its wheel;
    ``prepared``: no graphs, the optimizer prepared as ours prepares it (``OptimizerPrep``: capturable AdamW, the
    learning rate a device tensor), so the run executes the kernels a graph replay of ours executes."""

    name: str
    label: str
    description: str
    compile: Optional[str] = None
    ours: bool = False
    nemo: bool = False
    prepared: bool = False
    #: the same run without CUDA graphs: the reference of this variant's peak memory
    reference: str = "eager"
    #: the run whose losses this variant's must equal (the same kernels, no graphs); None: it is the reference
    loss_reference: Optional[str] = None
    #: ``CudaGraphCallback``'s options in this variant (``ours`` only)
    options: tuple[tuple[str, object], ...] = ()

    @property
    def graphs(self) -> bool:
        """Whether the step runs as CUDA graph replays (ours, NeMo's, or torch.compile's own)."""
        return self.ours or self.nemo or self.compile == "reduce-overhead"


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("eager", "eager", "Lightning, no graphs: the reference for the losses"),
    Variant("reference", "eager, optimizer prepared",
            "eager, optimizer prepared as ours: Lightning without graphs, the optimizer prepared by "
            "`OptimizerPrep` (what `CudaGraphCallback()` does to it) at train start and its hyperparameters synced "
            "before every step: ours' losses must equal these bitwise", prepared=True, loss_reference="eager"),
    Variant("ours", "ours", "`CudaGraphCallback()`", ours=True, loss_reference="reference"),
    Variant("ours_noguard", "ours, NaN guard off", "`CudaGraphCallback(nan_guard=False)`: what the guard costs",
            ours=True, loss_reference="reference", options=(("nan_guard", False),)),
    Variant("ours_capturable", "ours, capturable optimizer math",
            "`CudaGraphCallback(optimizer_math=\"capturable\")`: the optimizer prepared capturable (bias corrections "
            "on the device in float32, the group-scalar update of `fast_adam`) instead of the user's own update: what "
            "the user's own math costs or saves; its losses differ from eager's by that math",
            ours=True, loss_reference="eager", options=(("optimizer_math", "capturable"),)),
    Variant("ours_torch_adam", "ours, torch's AdamW step",
            "`CudaGraphCallback(optimizer_math=\"capturable\", fast_adam=False)`: the graph replays torch's own "
            "capturable AdamW update (one division kernel per parameter, twice): what `fast_adam` saves",
            ours=True, loss_reference="eager", options=(("optimizer_math", "capturable"), ("fast_adam", False))),
    Variant("ours_modules", "ours, partial graphs",
            "`CudaGraphCallback(scope=\"modules\")`: the forward and backward of the largest submodules that capture, "
            "and the optimizer side, as graphs; the rest eagerly (what a step that cannot be one graph gets)",
            ours=True, loss_reference="reference", options=(("scope", "modules"),)),
    Variant("ours_auto", "ours, auto",
            "`CudaGraphCallback(scope=\"auto\")`: the whole step where it captures, else partial graphs",
            ours=True, loss_reference="reference", options=(("scope", "auto"),)),
    Variant("compile", "compile", "`torch.compile(model)` (mode `default`) in `configure_model`", compile="default",
            loss_reference="eager"),
    Variant("compile_reference", "compile, optimizer prepared",
            "`torch.compile(model)` (mode `default`), the optimizer prepared as ours, no graphs: compile + ours' "
            "losses must equal these bitwise", compile="default", prepared=True, reference="compile",
            loss_reference="compile"),
    Variant("compile_ro", "compile `reduce-overhead`",
            "`torch.compile(model, mode='reduce-overhead')`: torch's own CUDA graphs (cudagraph trees)",
            compile="reduce-overhead", reference="compile", loss_reference="compile"),
    Variant("compile_ours", "compile + ours", "`torch.compile(model)` (mode `default`) + `CudaGraphCallback()`",
            compile="default", ours=True, reference="compile", loss_reference="compile_reference"),
    Variant("compile_ours_capturable", "compile + ours, capturable optimizer math",
            "`torch.compile(model)` (mode `default`) + `CudaGraphCallback(optimizer_math=\"capturable\")`",
            compile="default", ours=True, reference="compile", loss_reference="compile",
            options=(("optimizer_math", "capturable"),)),
    Variant("compile_ours_torch_adam", "compile + ours, torch's AdamW step",
            "`torch.compile(model)` (mode `default`) + `CudaGraphCallback(optimizer_math=\"capturable\", "
            "fast_adam=False)`", compile="default", ours=True, reference="compile", loss_reference="compile",
            options=(("optimizer_math", "capturable"), ("fast_adam", False))),
    Variant("nemo", "NeMo 3.0.0 callback",
            "NeMo 3.0.0's `CUDAGraphCallback(capture_iteration=12)` from its wheel, optimizer built with "
            "`capturable=True` and a device-tensor learning rate, the schedule an `_LRScheduler` subclass (NeMo "
            "needs all three and sets none): its loss reference is eager with the optimizer prepared as ours, the "
            "nearest run without graphs", nemo=True,
            loss_reference="reference"),
)}

#: the table's variants; ``ours_noguard``, ``ours_capturable``, ``ours_torch_adam`` and their compiled forms, and the
#: partial tier's ``ours_modules`` and ``ours_auto``, run when asked for (``--variants``)
DEFAULT_VARIANTS = ["eager", "reference", "ours", "compile", "compile_reference", "compile_ro", "compile_ours",
                    "nemo"]
EAGER, COMPILED_EAGER = "eager", "compile"
NEMO_CAPTURE_ITERATION = 12


def variants_for(workload_nemo: bool, chosen: list[str]) -> list[str]:
    """``chosen`` in table order; NeMo's callback only where the workload runs it."""
    return [v for v in VARIANTS if v in chosen and (workload_nemo or not VARIANTS[v].nemo)]
