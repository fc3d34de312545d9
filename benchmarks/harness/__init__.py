"""The step-time harness: every workload and variant of the results table, from one command.

    python -m benchmarks.harness --plan                      # the runs and their estimated duration
    python -m benchmarks.harness --out benchmarks/results --write-docs
    python -m benchmarks.harness --dry-run --rounds 1        # CPU smoke run of the plumbing

Each variant of each workload trains in a process of its own (:mod:`.child`); rounds alternate the variants
(:mod:`.runner`); the report (:mod:`.report`, pure Python) gives ms/step (median and per round, ratio to a baseline
within each round), max |Δloss| against eager and against each variant's own reference (ours against eager with the
optimizer prepared as ours prepares it, compile + ours against compile with it: the same kernels, so bitwise), peak
memory, MFU, the kernel floor and the kernels that make two floors differ, and writes README.md's results table and
``docs/results/step-time.md``.

Modules: :mod:`.workloads` (models and shapes, FLOPs), :mod:`.variants`, :mod:`.models` (the LightningModule and
data), :mod:`.nemo_reference` (NeMo 3.0.0's callback from its wheel), :mod:`.rawstep` (a hand-written whole-step
graph for the probes that study graphs), :mod:`.cli`.
"""
