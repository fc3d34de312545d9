"""Count the non-finite elements of many tensors in one kernel launch (the NaN guard's gradient check).

Why: the guard reads every gradient once per step. ``torch._foreach_norm(grads, inf)`` does that in one
launch per ~100 tensors plus a clean-up kernel per launch and a ``stack``; on an H200 it ran at about
1.9 TB/s on the small GPT preset's 148 gradients (91 us, 3.6 % of the step with its follow-up kernels).
This kernel walks every ``(tensor, chunk)`` of one dtype in a single launch, reads each element once at
streaming bandwidth and adds, per tensor, the number of NaN/Inf elements it found into a slot of a device
accumulator. Finite chunks write nothing (no atomics in the common case).

Metadata: one int64 table per set of tensors (their addresses, sizes, first program and accumulator slot,
and each program's tensor), built on the host once per set. A :class:`FiniteCheck` must live as long as any graph
that launched it (the graph reads its table). A check built during a capture (gradients the graph allocates
itself) needs its table in memory that no node of the graph writes. Memory handed out *during* a capture may have
belonged to a tensor freed earlier in the same capture, whose kernels the graph replays: a table allocated there
and filled once afterwards is overwritten on every replay (it faulted; docs/design.md, the hazard of metadata allocated during a capture).
So such a check takes a ``table`` allocated before the capture and :meth:`FiniteCheck.fill` writes it after the
capture; without one, the table is copied in by the graph (a host-to-device node on every replay).

Without Triton, on the CPU, or for tensors that are not contiguous and 16-byte aligned, :meth:`FiniteCheck.run` does the same with
``torch._foreach_norm(inf)`` (one multi-tensor reduction per dtype) and an ``index_add_``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from ._torch_compat import foreach_max_abs

__all__ = ["FiniteCheck", "arm", "capturing", "table_length", "triton_available", "BLOCK", "ITERS", "NUM_WARPS"]

# Elements per load (BLOCK), loads per program (ITERS), warps per program: the fastest of the shapes tried on
# an H200 for the small preset's gradients (benchmarks/nan_guard.py prints the sweep).
BLOCK, ITERS, NUM_WARPS = 2048, 8, 8
# Widened to float32 exactly (so Inf/NaN keep their exponent bits); float64 would overflow to Inf: fallback.
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when a CUDA device is visible and Triton imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a Triton that does not match this torch
        return False
    return True


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (never on a CPU device)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=1)
def _chunk_counter() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def count_chunk(table, n_tensors, c, acc, ref, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """Count the non-finite elements of chunk ``c`` (BLOCK * ITERS elements of one tensor) into that tensor's
        slot of ``acc``; return the count (float32). Inlined into both kernels: one body for the chunk walk."""
        # table (int64): n_tensors addresses, numels, first chunks, accumulator slots; then each chunk's tensor.
        t = tl.load(table + 4 * n_tensors + c)
        numel = tl.load(table + n_tensors + t)
        # The address as a pointer to this group's dtype; 16-byte aligned (FiniteCheck admits only such
        # tensors), which with a whole chunk in range lets the loads below be 16-byte vector loads.
        base = tl.multiple_of(tl.load(table + t).to(ref.dtype), 16)
        start = (c - tl.load(table + 2 * n_tensors + t)) * (BLOCK * ITERS)  # int64: tensors may exceed 2**31
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        if start + BLOCK * ITERS <= numel:  # a whole chunk: no mask (a mask of unknown alignment splits vectors)
            for i in tl.static_range(ITERS):
                x = tl.load(base + (start + i * BLOCK + tl.arange(0, BLOCK))).to(tl.float32)
                # NaN/Inf <=> all exponent bits set: a bit test, not a float comparison a compiler may fold away.
                bad += ((x.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000).to(tl.int32)
        else:  # the tensor's last, partial chunk
            for i in tl.static_range(ITERS):
                offs = start + i * BLOCK + tl.arange(0, BLOCK)
                x = tl.load(base + offs, mask=offs < numel, other=0.0).to(tl.float32)
                bad += ((x.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000).to(tl.int32)
        n_bad = tl.sum(bad, axis=0).to(tl.float32)
        tl.atomic_add(acc + tl.load(table + 3 * n_tensors + t), n_bad, mask=n_bad > 0)  # finite: no atomic
        return n_bad

    return count_chunk


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    count_chunk = _chunk_counter()  # a closure variable of the kernel: Triton inlines it

    # Not specialised on the tensor count: a capture must never meet a new variant of the kernel (compiling
    # and loading a module while a graph captures); the eager warm-up compiled the one the run uses.
    @triton.jit(do_not_specialize=["n_tensors"])
    def count_nonfinite_kernel(
        table, n_tensors, acc, step_acc, ref, BLOCK: tl.constexpr, ITERS: tl.constexpr, HAS_STEP: tl.constexpr,
    ):
        n_bad = count_chunk(table, n_tensors, tl.program_id(0), acc, ref, BLOCK, ITERS)  # one chunk per program
        if HAS_STEP:
            tl.atomic_add(step_acc, n_bad, mask=n_bad > 0)

    return count_nonfinite_kernel


@functools.lru_cache(maxsize=1)
def _watch_kernel() -> Any:
    import triton
    import triton.language as tl

    count_chunk = _chunk_counter()

    @triton.jit(do_not_specialize=["n_tensors", "n_chunks"])
    def watch_nonfinite_kernel(
        table, n_tensors, n_chunks, acc, loss, loss_sum, state, ref,
        BLOCK: tl.constexpr, ITERS: tl.constexpr, ADD_LOSS: tl.constexpr,
    ):
        # state: [stage, done, found] (float32). Stage 2 = armed: a non-finite loss makes every program walk its
        # chunks (grid-stride) and count non-finite elements like count_nonfinite_kernel. Stage 1 = the first
        # non-finite loss found every tensor finite (the loss went bad first): count at the next call, whatever its
        # loss, what that step's update spoiled. Stage 0 = done until re-armed. The last program to finish sets the
        # next stage: each program reads the stage before its atomic increment of `done`, so none can miss it.
        pid = tl.program_id(0)
        n_prog = tl.num_programs(0)
        x = tl.load(loss).to(tl.float32)
        stage = tl.load(state)
        if ADD_LOSS:
            if pid == 0:
                tl.store(loss_sum, tl.load(loss_sum) + x)
        loss_bad = (x.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000
        if (loss_bad & (stage == 2.0)) | (stage == 1.0):
            found = 0.0
            for c in range(pid, n_chunks, n_prog):
                found += count_chunk(table, n_tensors, c, acc, ref, BLOCK, ITERS)
            tl.atomic_add(state + 2, found, mask=found > 0)
            if tl.atomic_add(state + 1, 1.0) == n_prog - 1:
                total = tl.atomic_add(state + 2, 0.0)
                tl.store(state, tl.where((stage == 2.0) & (total == 0.0), 1.0, 0.0))
                tl.store(state + 1, 0.0)
                tl.store(state + 2, 0.0)

    return watch_nonfinite_kernel


def arm(state: Tensor) -> None:
    """Arm a :meth:`FiniteCheck.watch` state (device op): the next non-finite loss counts the tensors."""
    state[:, 0].fill_(2.0)


@functools.cache
def _programs(device: torch.device) -> int:
    """Programs of a watch launch: one per SM, so the common case (a finite loss) is a single short wave."""
    return torch.cuda.get_device_properties(device).multi_processor_count


class _Launch:
    """One dtype group of tensors checked by the Triton kernel."""

    __slots__ = ("host", "table", "n", "grid", "ref", "filled")

    def __init__(self, tensors: list[Tensor], slots: list[int], per_program: int, table: Optional[Tensor]) -> None:
        rows: list[list[int]] = [[], [], [], [], []]
        for j, (t, s) in enumerate(zip(tensors, slots)):
            rows[0].append(t.data_ptr())
            rows[1].append(t.numel())
            rows[2].append(len(rows[4]))
            rows[3].append(s)
            rows[4].extend([j] * -(-t.numel() // per_program))
        self.n = len(tensors)
        self.grid = (len(rows[4]),)
        host = torch.tensor([v for row in rows for v in row], dtype=torch.int64)
        self.host = host.pin_memory() if tensors[0].device.type == "cuda" else host
        # Its dtype selects the kernel's pointer type (never read through). A one-element stand-in, not tensors[0]:
        # a check kept for later steps must not keep the memory of tensors it checked alive (an eager step's
        # gradients, freed by the next zero_grad, would otherwise stay allocated with every cached check).
        self.ref = tensors[0].new_empty(1)
        if table is not None:
            # Memory allocated outside any capture (see the module docstring): written by fill(), after the capture.
            self.table = table[: self.host.numel()]
            self.filled = False
        else:
            # Pinned + non_blocking: no host sync (this may run in a sync-checked step). Inside a capture this copy
            # is a graph node re-run by every replay; the pinned source stays alive with this object.
            self.table = self.host.to(tensors[0].device, non_blocking=True)
            self.filled = True

    def fill(self) -> None:
        if not self.filled:
            self.table.copy_(self.host, non_blocking=True)
            self.filled = True


def table_length(numels: Sequence[int], block: int = BLOCK, iters: int = ITERS) -> int:
    """int64 entries of the metadata of a check over tensors of these sizes (all in one group: an upper bound)."""
    per_program = block * iters
    return 4 * len(numels) + sum(-(-n // per_program) for n in numels)


class FiniteCheck:
    """Per-tensor count of non-finite elements, added into ``acc[slots[i]]``; build once per tensor set.

    Args:
        tensors: the tensors to check (their current memory: the check reads these addresses).
        slots: for each tensor, its slot in the accumulator passed to :meth:`run`.
        use_triton: ``None`` picks Triton on CUDA when it imports; ``False`` forces the
            ``_foreach_norm`` path (what runs on the CPU).
        block, iters, num_warps: elements per load, loads per program, warps per program.
        table: int64 device memory allocated *outside* any graph capture, at least :func:`table_length` long,
            for a check built during a capture: its metadata then goes there and :meth:`fill` writes it after
            the capture, before the first replay (the graph holds no copy node). Without it (or when too short)
            the metadata is copied in by the graph.
    """

    def __init__(
        self,
        tensors: Sequence[Tensor],
        slots: Sequence[int],
        *,
        use_triton: Optional[bool] = None,
        block: int = BLOCK,
        iters: int = ITERS,
        num_warps: int = NUM_WARPS,
        table: Optional[Tensor] = None,
    ) -> None:
        if len(tensors) != len(slots) or not tensors:
            raise ValueError("FiniteCheck needs one slot per tensor and at least one tensor")
        if block < 16 or block & (block - 1) or iters < 1:
            raise ValueError(f"FiniteCheck(block={block}, iters={iters}): block must be a power of two >= 16, iters >= 1")
        self.block, self.iters, self.num_warps = block, iters, num_warps
        device = self._device = tensors[0].device
        want = triton_available() if use_triton is None else use_triton
        fused = bool(want and device.type == "cuda")
        groups: dict[torch.dtype, list[int]] = {}
        rest: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            ok = fused and t.dtype in _FUSED_DTYPES and t.is_contiguous() and t.numel() > 0 and t.data_ptr() % 16 == 0
            (groups if ok else rest).setdefault(t.dtype, []).append(i)
        self.launches = []
        offset = 0
        for ids in groups.values():
            need = table_length([tensors[i].numel() for i in ids], block, iters)
            part = table[offset: offset + need] if table is not None and offset + need <= table.numel() else None
            offset += need if part is not None else 0
            self.launches.append(_Launch([tensors[i] for i in ids], [slots[i] for i in ids], block * iters, part))
        self._fallback: list[tuple[list[Tensor], Optional[Tensor], Optional[Tensor]]] = []
        for ids in rest.values():
            ts = [tensors[i] for i in ids]
            slot_ids = [slots[i] for i in ids]
            host = None
            index = None
            if slot_ids != list(range(len(slot_ids))):
                # Copied from pinned memory without a host sync (safe inside a sync-checked step); inside a
                # capture the copy is a graph node, so the index never depends on memory a later graph reuses.
                host = torch.tensor(slot_ids, dtype=torch.long)
                if device.type == "cuda":
                    host = host.pin_memory()
                index = host.to(device, non_blocking=True)
            self._fallback.append((ts, index, host))
        self.uses_triton = bool(self.launches)

    @property
    def filled(self) -> bool:
        return all(launch.filled for launch in self.launches)

    def fill(self) -> None:
        """Write the metadata of a check built during a capture into its ``table`` (after the capture)."""
        for launch in self.launches:
            launch.fill()

    def watch_state(self) -> Tensor:
        """The state :meth:`watch` keeps: one row ``[stage, done, found]`` (float32) per launch and one for the torch
        ops, armed (stage 2). Allocate it outside any capture; :func:`arm` re-arms it."""
        state = torch.zeros(len(self.launches) + 1, 3, dtype=torch.float32, device=self._device)
        arm(state)
        return state

    @staticmethod
    def can_watch(loss: Tensor) -> bool:
        """Whether the Triton launches of :meth:`watch` can read this loss (else build the check with
        ``use_triton=False``)."""
        return loss.numel() == 1 and loss.dtype in _FUSED_DTYPES

    def watch(self, acc: Tensor, loss: Tensor, loss_sum: Tensor, state: Tensor) -> None:
        """``loss_sum += loss``, and count each tensor's non-finite elements into its slot of ``acc`` only where it
        tells what went bad first: at the first NaN/Inf ``loss`` after :func:`arm`; and, when every tensor was finite
        then (the loss went bad first), once more at the next call, which sees what that step's update spoiled.

        One launch per dtype group with Triton, whose programs read the loss and the stage and return (a few
        microseconds per step); the tensors are read at those one or two calls only. Without Triton the torch ops
        read the tensors on every call (branch-free: no host sync). Safe inside a capture.
        """
        loss = loss.detach()
        if self.launches:
            if not self.can_watch(loss):
                raise ValueError("FiniteCheck.watch: a 1-element float32/bf16/fp16 loss is needed for the Triton launches")
            if not capturing(self._device):
                self.fill()
                stream = torch.cuda.current_stream(self._device)
                for launch in self.launches:
                    launch.table.record_stream(stream)
            kernel = _watch_kernel()
            for j, launch in enumerate(self.launches):
                kernel[(min(launch.grid[0], _programs(self._device)),)](
                    launch.table, launch.n, launch.grid[0], acc, loss, loss_sum, state[j], launch.ref,
                    BLOCK=self.block, ITERS=self.iters, ADD_LOSS=j == 0, num_warps=4,
                )
        else:
            loss_sum.add_(loss.reshape(()))
        if self._fallback:
            stage = state[-1, 0]
            fire = (torch.isfinite(loss.reshape(()).float()).logical_not_() & (stage == 2)) | (stage == 1)
            found = torch.zeros((), dtype=acc.dtype, device=acc.device)
            for tensors, index, _ in self._fallback:
                bad = torch.isfinite(torch.stack(foreach_max_abs(tensors))).logical_not_().to(acc.dtype) * fire
                if index is None:
                    acc[: len(tensors)].add_(bad)
                else:
                    acc.index_add_(0, index, bad)
                found = found + bad.sum()
            nxt = torch.where((stage == 2) & (found == 0), 1.0, 0.0)
            state[-1, 0].copy_(torch.where(fire, nxt, stage))

    def run(self, acc: Tensor, step_acc: Optional[Tensor] = None) -> None:
        """Add each tensor's non-finite count into ``acc`` (float32); also their total into ``step_acc``.

        Device work only (one launch per dtype with Triton): safe inside a capture and a sync-checked step.
        """
        if self.launches and not capturing(self.launches[0].table.device):
            self.fill()  # used outside the capture it was built in: the copy runs first, in stream order
            stream = torch.cuda.current_stream(self.launches[0].table.device)
            for launch in self.launches:
                # Used on a stream other than the one it was allocated on (warm-up side stream, main stream):
                # an evicted eager check's table must not be handed out again before this kernel ran.
                launch.table.record_stream(stream)
        kernel = _kernel() if self.launches else None
        for launch in self.launches:
            kernel[launch.grid](
                launch.table, launch.n, acc, step_acc if step_acc is not None else acc, launch.ref,
                BLOCK=self.block, ITERS=self.iters, HAS_STEP=step_acc is not None,
                num_warps=self.num_warps,
            )
        for tensors, index, _ in self._fallback:
            vals = torch.stack(foreach_max_abs(tensors))
            bad = torch.isfinite(vals).logical_not_().to(acc.dtype)
            if index is None:
                acc[: len(tensors)].add_(bad)
            else:
                acc.index_add_(0, index, bad)
            if step_acc is not None:
                step_acc.add_(bad.sum())
