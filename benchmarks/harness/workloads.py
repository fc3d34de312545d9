"""The workloads of the step-time table: model, batch shape, step counts, and the model FLOPs of one step.

Pure Python (no torch): the plan, the report and the CPU tests read these without a GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

#: The H200's dense bf16 tensor-core peak from NVIDIA's datasheet (SXM; 1,979 TFLOP/s is the sparse figure).
PEAK_BF16_TFLOPS = 989.4


@dataclass(frozen=True)
class Workload:
    """One row group of the table.

    ``kind`` is ``"llama"`` (Hugging Face ``LlamaForCausalLM`` built from a config, nothing downloaded), ``"moe"``
    (Hugging Face ``Qwen3MoeForCausalLM``, a mixture of ``experts`` experts of width ``expert_intermediate``, ``top_k``
    of them per token, in every layer; transformers 5) or ``"gpt"`` (a preset of ``recipes/gpt.py``). The run trains ``steps`` steps, times ``measure_from`` to
    ``steps - profile_steps - 1`` (a host sync at the window's two edges only) and profiles the last
    ``profile_steps`` for the kernel floor.
    """

    name: str
    title: str
    kind: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int
    intermediate: int = 0  # llama: the MLP width; gpt: 4 x hidden
    experts: int = 0  # moe: routed experts per layer
    top_k: int = 0  # moe: experts per token
    expert_intermediate: int = 0  # moe: each expert's MLP width
    preset: str = ""  # gpt: the recipe's preset
    #: a read of the host inside the step, so it cannot be one graph: "layer" (a user's module around decoder layer 1
    #: asks the host whether the hidden states are large), "loss" (the loss is read with ``.item()`` every step) or
    #: "packed" (two documents per row, ``position_ids`` restarting at each and no mask: transformers 5 asks the host
    #: where the documents start while it builds the attention mask)
    host_read: str = ""
    steps: int = 120
    measure_from: int = 50
    profile_steps: int = 5
    nemo: bool = False  # NeMo's CUDAGraphCallback among the variants
    bound: str = "gpu"  # "host" where eager Lightning's host path is longer than the GPU's step (the goals differ)
    why: str = ""
    #: planning figures: eager ms/step and one cold torch.compile of the step on an H200 (seconds)
    est_step_ms: float = 20.0
    est_compile_s: float = 40.0
    est_build_s: float = 2.0
    extra: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("llama156m-2x512", "HF Llama 156 M, batch 2 × 512", "llama", hidden=1024, layers=8, heads=16,
             kv_heads=4, vocab=32000, intermediate=2816, batch=2, seq=512, steps=120, measure_from=50,
             bound="host", why="host-bound: the GPU's step is shorter than eager Lightning's host path",
             est_step_ms=45.0, est_compile_s=45.0, est_build_s=3.0),
    Workload("llama156m-8x1024", "HF Llama 156 M, batch 8 × 1024", "llama", hidden=1024, layers=8, heads=16,
             kv_heads=4, vocab=32000, intermediate=2816, batch=8, seq=1024, steps=100, measure_from=40,
             why="GPU-bound", est_step_ms=40.0, est_compile_s=45.0, est_build_s=3.0),
    Workload("llama1b-4x2048", "HF Llama 1.1 B, batch 4 × 2048", "llama", hidden=2048, layers=16, heads=32,
             kv_heads=8, vocab=32000, intermediate=8192, batch=4, seq=2048, steps=40, measure_from=20,
             profile_steps=3,
             why="8,192 tokens per GPU and step: data-parallel 1 B training runs a global batch of about 0.5 M "
                 "tokens (64 GPUs × 4 × 2048) without accumulation, and 4 sequences of 2048 keep the GPU's matmuls "
                 "large with room for bf16-mixed AdamW state (16 bytes a parameter) and activations",
             est_step_ms=260.0, est_compile_s=80.0, est_build_s=10.0),
    Workload("qwen3moe1b-2x512", "HF Qwen3-MoE 1.1 B (32 experts, top-4), batch 2 × 512", "moe", hidden=1024,
             layers=16, heads=16, kv_heads=4, vocab=32000, experts=32, top_k=4, expert_intermediate=640, batch=2,
             seq=512, steps=120, measure_from=50, bound="host",
             why="host-bound: 16 mixture-of-experts layers launch their routing, grouped GEMMs and gathers for 1,024 "
                 "tokens, less GPU work than eager Lightning's host path",
             est_step_ms=40.0, est_compile_s=60.0, est_build_s=8.0),
    Workload("qwen3moe1b-8x1024", "HF Qwen3-MoE 1.1 B (32 experts, top-4), batch 8 × 1024", "moe", hidden=1024,
             layers=16, heads=16, kv_heads=4, vocab=32000, experts=32, top_k=4, expert_intermediate=640, batch=8,
             seq=1024, steps=80, measure_from=30,
             why="GPU-bound: 8,192 tokens, about 1,000 per expert and layer (top-4 of 32)",
             est_step_ms=100.0, est_compile_s=60.0, est_build_s=8.0),
    Workload("llama156m-hostcheck-2x512", "HF Llama 156 M with a host read around layer 1, batch 2 × 512", "llama",
             hidden=1024, layers=8, heads=16, kv_heads=4, vocab=32000, intermediate=2816, batch=2, seq=512,
             steps=120, measure_from=50, host_read="layer", bound="host",
             why="host-bound, and no whole-step graph: a user's module around decoder layer 1 asks the host "
                 "`if hidden_states.abs().max() > 1e4` every step (the partial tier's case)",
             est_step_ms=45.0, est_compile_s=45.0, est_build_s=3.0),
    Workload("llama156m-itemloss-2x512", "HF Llama 156 M whose loss is read with .item(), batch 2 × 512", "llama",
             hidden=1024, layers=8, heads=16, kv_heads=4, vocab=32000, intermediate=2816, batch=2, seq=512,
             steps=120, measure_from=50, host_read="loss", bound="host",
             why="host-bound, and no whole-step graph: `training_step` reads its loss on the host every step "
                 "(the partial tier's case)",
             est_step_ms=45.0, est_compile_s=45.0, est_build_s=3.0),
    Workload("llama156m-packed-2x512", "HF Llama 156 M on packed sequences (2 documents a row), batch 2 × 512",
             "llama", hidden=1024, layers=8, heads=16, kv_heads=4, vocab=32000, intermediate=2816, batch=2, seq=512,
             steps=120, measure_from=50, host_read="packed", bound="host",
             why="host-bound, and no whole-step graph: two documents per row with `position_ids` restarting at each "
                 "(packed sequences, no mask); transformers asks the host where they start (the partial tier's case)",
             est_step_ms=45.0, est_compile_s=45.0, est_build_s=3.0),
    Workload("gpt-tiny", "GPT tiny (recipes/gpt.py: 4 layers, d 256, seq 256, batch 2)", "gpt", hidden=256, layers=4,
             heads=4, kv_heads=4, vocab=256, batch=2, seq=256, preset="tiny", steps=200, measure_from=80,
             nemo=True, bound="host", why="host-bound", est_step_ms=10.0, est_compile_s=25.0),
    Workload("gpt-small", "GPT small (recipes/gpt.py: 12 layers, d 768, seq 512, batch 4)", "gpt", hidden=768,
             layers=12, heads=12, kv_heads=12, vocab=256, batch=4, seq=512, preset="small", steps=200,
             measure_from=80, nemo=True, why="GPU-bound", est_step_ms=22.0, est_compile_s=35.0),
)}

#: the table's workloads; those with a host read in the step (the partial tier's cases) run when asked for
DEFAULT_WORKLOADS = [n for n, w in WORKLOADS.items() if not w.host_read]


def dry_run(w: Workload) -> Workload:
    """The CPU smoke shape of ``w``: same kind and variants, tiny widths, three steps (nothing timed)."""
    hf = w.kind in ("llama", "moe")
    small = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2 if hf else 4, "batch": 2, "seq": 32,
             "intermediate": 128 if hf else 0, "vocab": 512 if hf else 256, "steps": 3, "measure_from": 1,
             "profile_steps": 1}
    if w.kind == "moe":
        small.update(experts=4, top_k=2, expert_intermediate=64)
    return replace(w, title=f"{w.title} (dry run: d 64, 2 layers, batch 2 × 32)", **small)


def model_flops_per_step(n_matmul_params: int, layers: int, hidden: int, batch: int, seq: int) -> float:
    """Model FLOPs of one training step (forward and backward), the usual MFU count:
    ``6 · N · tokens`` for the matmuls with the weights (N: the parameters that multiply activations, i.e. all but
    the input embedding tables; a tied LM head counts once; of a mixture of experts, the active ones: ``top_k`` of
    ``experts`` experts and the router) plus ``6 · layers · seq² · hidden`` per sequence for
    causal attention's score and value matmuls (``12 · layers · seq² · hidden`` for full attention, halved by the
    causal mask). Recomputation, optimizer and elementwise work are not counted."""
    return 6.0 * n_matmul_params * batch * seq + 6.0 * layers * seq * seq * hidden * batch


FLOPS_FORMULA = ("6 · N · tokens + 6 · layers · seq² · hidden · batch (N: parameters that multiply activations, "
                 "input embeddings excluded; of mixture-of-experts layers the active ones, top-k of the experts)")


def mfu(flops_per_step: Optional[float], ms_per_step: Optional[float],
        peak_tflops: float = PEAK_BF16_TFLOPS) -> Optional[float]:
    """Model FLOPs per second over ``peak_tflops``; None when either figure is missing."""
    if not flops_per_step or not ms_per_step:
        return None
    return flops_per_step / (ms_per_step / 1e3) / (peak_tflops * 1e12)
