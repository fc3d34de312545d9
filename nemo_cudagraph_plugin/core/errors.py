"""Errors raised by the capture engine, and the helper that points them at the user's code.

Every error here says what went wrong *and what to change*. Capture failures name the first
frame of user code (not torch, Lightning or this package) so the message reads
``my_model.py:42: `.item()` forces a host sync ...`` instead of a raw CUDA error.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from types import TracebackType
from typing import Optional

__all__ = [
    "CaptureError",
    "NonFiniteError",
    "ParityError",
    "CAPTURE_RULES",
    "KNOWN_LIBRARY_SITES",
    "classify_capture_error",
    "is_sync_error",
    "root_cause",
    "locate_frames",
    "user_location",
]


class CaptureError(RuntimeError):
    """The training step cannot be captured into a CUDA graph.

    Attributes:
        rule: short name of the rule that was broken (``"host-sync"``, ``"cpu-tensor"``, ...).
        location: ``"file.py:LINE"`` of the user's code that broke it, when it could be found.
    """

    def __init__(self, message: str, rule: str = "unknown", location: Optional[str] = None) -> None:
        super().__init__(message)
        self.rule = rule
        self.location = location


class NonFiniteError(FloatingPointError):
    """A NaN/Inf loss or gradient was seen by the NaN guard.

    Attributes:
        parameter: name of the first parameter whose gradient was non-finite (``None`` if only the
            loss was non-finite).
        step: the global step at which it was first seen (device-side record), when known.
    """

    def __init__(self, message: str, parameter: Optional[str] = None, step: Optional[int] = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.step = step


class ParityError(AssertionError):
    """A graphed step differed from the same step run eagerly (``verify_steps``)."""


# Rule name -> (what the user did, what to change). Matched against the exception text.
CAPTURE_RULES: dict[str, tuple[str, str]] = {
    "host-sync": (
        "a host synchronisation inside the captured step (`.item()`, `.cpu()`, `.tolist()`, `print(tensor)`,"
        " `float(tensor)`, or a Python `if`/`while` on a tensor value)",
        "keep values on the device (log the tensor itself with self.log, use torch.where instead of a Python"
        " branch), or move that code to a hook outside the step (on_train_batch_end, validation)",
    ),
    "cpu-tensor": (
        "a CPU tensor created inside the step and copied to the GPU (torch.tensor(...), .to('cuda'), .cuda())",
        "create the tensor once outside the step (e.g. register_buffer in __init__) or build it on the device"
        " with torch.full/torch.zeros(..., device=...)",
    ),
    "dynamic-shape": (
        "an operation whose output shape depends on tensor values (torch.nonzero, boolean-mask indexing,"
        " torch.unique)",
        "use fixed-shape alternatives (torch.where, masked_fill, multiplication by a mask)",
    ),
    "unsupported-op": (
        "a CUDA operation that cannot be captured (e.g. a synchronising library call or a new CUDA stream"
        " without waiting on the capture stream)",
        "move it out of training_step, or run this model with on_capture_error='eager'",
    ),
}


# Host reads inside installed model libraries that users meet: (path pattern, function or "" for any, what the library
# does there, what to change). The message names the library's line next to the user's one, and says this instead of
# a generic fix. The first entry that matches the innermost library frame wins.
_HF_MOE_FILES = r"transformers/models/[^/]*(moe|mixtral|deepseek|gpt_oss|dbrx|jamba|granitemoe|minimax)[^/]*/modeling_[^/]+\.py$"
KNOWN_LIBRARY_SITES: tuple[tuple[str, str, str, str], ...] = (
    (r"transformers/masking_utils\.py$", "find_packed_sequence_indices",
     "Hugging Face asks the host whether the position_ids pack several sequences into a row (passed without an "
     "attention_mask)",
     "pass an attention_mask with the position_ids, or leave position_ids out when each row is one sequence "
     "(the model numbers the tokens itself)"),
    (r"transformers/masking_utils\.py$", "",
     "Hugging Face asks the host whether the attention_mask pads anything (to use SDPA's is_causal)",
     "keep hf_attention='graph_safe' (the default of CudaGraphCallback and CudaGraphStrategy), or call "
     "nemo_cudagraph_plugin.hf.graph_safe_attention(model) before training when you capture by other means"),
    (r"transformers/cache_utils\.py$", "",
     "the model builds a KV cache (use_cache=True) inside the training step",
     "pass use_cache=False to the model in training_step, or set model.config.use_cache = False for training"),
    (r"transformers/integrations/moe\.py$", "",
     "the mixture-of-experts layer runs Hugging Face's experts in a form that reads the host (an FP32 grouped GEMM "
     "copies its offsets to the host; under torch.compile a loop over offs.tolist())",
     "keep hf_experts='graph_safe' (the default of CudaGraphCallback and CudaGraphStrategy): the experts then run "
     "as grouped GEMMs in the autocast dtype with their offsets on the device"),
    (_HF_MOE_FILES, "",
     "the mixture-of-experts layer gathers each expert's tokens, a number that depends on the data",
     "on transformers >= 5 keep hf_experts='graph_safe' (the default of CudaGraphCallback and CudaGraphStrategy), "
     "which runs every expert as one grouped GEMM with no host read; transformers 4.x has no experts interface, "
     "so upgrade to transformers 5, or use a mixture-of-experts layer with a fixed token capacity per expert"),
)


def _known_site(path: str, function: str) -> Optional[tuple[str, str]]:
    """(what the library does, what to change) for a library frame, from :data:`KNOWN_LIBRARY_SITES`."""
    return next(((did, fix) for pattern, fn, did, fix in KNOWN_LIBRARY_SITES
                 if re.search(pattern, path) and fn in ("", function)), None)


_SYNC_MARKERS = (
    "synchronizing cuda operation",
    "operation not permitted when stream is capturing",
    "cudaerrorstreamcaptureunsupported",
    "stream is capturing",
    "capture_invalidated",
    "operation failed due to a previous error during capture",
    "cudaerrorstreamcaptureinvalidated",
)


_COMPARISON = re.compile(r"(>=?|<=?|==|!=|\bmask\b)")


def _mask_indexing(code: str) -> bool:
    """True if a comparison or a ``mask`` appears inside square brackets: ``x[x > 0]``, ``x[m["a"] == 1]``."""
    depth, inside = 0, []
    for ch in code:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        inside.append(ch if depth > 0 else " ")
    return bool(_COMPARISON.search("".join(inside)))


def _code_only(line: str) -> str:
    """The source line without its comment (a ``#`` inside a string literal stays)."""
    import io
    import tokenize

    try:
        toks = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return line.split("#", 1)[0]
    cut = next((t.start[1] for t in toks if t.type == tokenize.COMMENT), None)
    return line if cut is None else line[:cut]


def classify_capture_error(exc: BaseException) -> str:
    """Map an exception raised while checking or capturing a step to a rule name.

    The message says *that* the step synced; the code of the offending line (comments removed)
    says *why*.
    """
    text = f"{type(exc).__name__}: {exc}".lower()
    if "nonzero" in text or "boolean index" in text or "unique" in text or "masked_select" in text:
        return "dynamic-shape"
    frame = _located_frame(exc.__traceback__)[0]
    if frame is None and exc.__traceback__ is not None:
        frames = traceback.extract_tb(exc.__traceback__)
        frame = frames[-1] if frames else None
    code = _code_only(frame.line or "").lower() if frame is not None else ""
    if any(m in text for m in _SYNC_MARKERS):
        if "nonzero" in code or "unique(" in code or "masked_select" in code or _mask_indexing(code):
            return "dynamic-shape"
        if any(tok in code for tok in ("torch.tensor(", ".cuda(", ".to(", "torch.as_tensor(", "from_numpy(")):
            return "cpu-tensor"
        return "host-sync"
    return "unsupported-op"


def _framework_dirs() -> tuple[str, ...]:
    """Code that is never the answer to "where did *you* do it": torch, this package, the stdlib."""
    import torch

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return (pkg, os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.__file__))


def _library_dirs() -> tuple[str, ...]:
    """Training frameworks the user called into (a frame there is library code, not theirs)."""
    dirs = []
    for name in ("lightning", "pytorch_lightning", "lightning_fabric", "transformer_engine", "megatron", "nemo",
                 "transformers"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(mod.__file__)))
    return tuple(dirs)


def _located_frame(tb: Optional[TracebackType]) -> tuple[Optional[traceback.FrameSummary], bool]:
    """The innermost frame of the user's own code; else the innermost frame outside torch, this
    package and the standard library (library code: an installed model, Lightning's demo module).

    Returns ``(frame, is_library_code)``.
    """
    if tb is None:
        return None, False
    return locate_frames(traceback.extract_tb(tb))


def locate_frames(frames: list[traceback.FrameSummary]) -> tuple[Optional[traceback.FrameSummary], bool]:
    """:func:`_located_frame` for a list of frames (a traceback or ``traceback.extract_stack()``)."""
    framework, libraries = _framework_dirs(), _library_dirs()
    user = library = None
    for frame in frames:
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or path.startswith(framework):
            continue
        if path.startswith(libraries) or "site-packages" in path or "dist-packages" in path:
            library = frame
        else:
            user = frame
    if user is not None:
        return user, False
    return library, library is not None


def user_location(tb: Optional[TracebackType]) -> Optional[str]:
    """Return ``"path:line"`` of the innermost traceback frame of user code.

    User code is anything outside torch, Lightning, TransformerEngine, Megatron, NeMo, the
    standard library, site-packages and this package. When the step only runs library code (an
    installed model), the innermost frame outside torch, this package and the standard library
    is returned with `` (library code)`` appended. ``None`` when there is no such frame.
    """
    frame, library = _located_frame(tb)
    if frame is None:
        return None
    return f"{frame.filename}:{frame.lineno}" + (" (library code)" if library else "")


def _library_site(tb: Optional[TracebackType]) -> Optional[traceback.FrameSummary]:
    """The innermost frame of installed library code that the user's code called into (a model library's line,
    not Lightning's call of ``training_step``), or ``None``."""
    if tb is None:
        return None
    frames = traceback.extract_tb(tb)
    user, _ = locate_frames(frames)
    framework, libraries = _framework_dirs(), _library_dirs()
    deeper = frames[frames.index(user) + 1:] if user is not None and user in frames else frames
    for frame in reversed(deeper):
        path = os.path.abspath(frame.filename)
        if not frame.filename.startswith("<") and not path.startswith(framework) and (
            path.startswith(libraries) or "site-packages" in path or "dist-packages" in path
        ):
            return frame
    return None


def is_sync_error(exc: BaseException) -> bool:
    """``exc`` is torch's error for a host sync (sync debug mode "error") or an operation not allowed in a capture."""
    text = str(exc).lower()
    return "synchroniz" in text or "capturing" in text


def root_cause(exc: BaseException) -> BaseException:
    """The exception raised inside the captured body, not capture_end's follow-up error."""
    ctx = exc.__context__
    if ctx is not None and "captur" in str(exc).lower() and ctx is not exc:
        return ctx
    return exc


def capture_error_from(exc: BaseException, what: str) -> CaptureError:
    """Build the one user-facing :class:`CaptureError` for an exception raised during ``what``."""
    rule = classify_capture_error(exc)
    did, fix = CAPTURE_RULES[rule]
    site = _library_site(exc.__traceback__)
    inside = ""
    if site is not None:
        path = site.filename.replace(os.sep, "/")
        known = _known_site(path, site.name)
        if known is not None:
            did, fix = known
        inside = f"\n  Inside: {site.filename}:{site.lineno} (`{(site.line or '').strip()}`)"
    where = user_location(exc.__traceback__)
    head = f"{where}: " if where else ""
    if where is not None and where.endswith(" (library code)"):
        where = where[: -len(" (library code)")]
        head = (f"{where}: in installed library code (not your file; the model or module you use does this, "
                "so the fix is in how it is configured or a different implementation): ")
    msg = (
        f"{head}cannot capture the training step into a CUDA graph ({what}): {did}.{inside}\n"
        f"  Fix: {fix}.\n"
        f"  Or pass on_capture_error='eager' to train this model without graphs.\n"
        f"  Original error: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    )
    return CaptureError(msg, rule=rule, location=where)
