#!/usr/bin/env python3
"""Planted breaks ("mutants") of the product code, each of which named tests must catch.

Every mutant is one deliberate break: a file, an exact snippet of today's code, its replacement and the
pytest node ids that must fail with it. For each selected mutant this script copies the package, tests,
recipes and pyproject into a temporary directory, applies the break there (a snippet that is not found
exactly once is an error: the list must follow the code), and runs the listed tests in the copy with this
interpreter (``PYTHONPATH`` = the copy, checked: the copy's package is the one imported). A mutant is
*caught* when at least one listed test fails (pytest exit 1); it is *missed* when they all pass. Before any
mutant, the union of the listed tests runs on an unbroken copy and must pass without skips: only a test
that passes without the break can be said to catch it.

    python ci/mutants.py --tier cpu          # CI (ci/stages.sh mutants); CPU-only tests
    python ci/mutants.py --tier gpu          # on the GPU host (tests/gpu; TransformerEngine for the FP8 one)
    .venv-nemo/bin/python ci/mutants.py --tier nemo   # CI (ci/stages.sh nemo): the NeMo-marked tests, real NeMo 2.7.3
    python ci/mutants.py --list              # the mutants, their files and tests
    python ci/mutants.py --only NAME[,NAME]  # some of them
    python ci/mutants.py --tier gpu --out build/mutants-gpu.md    # the table as a record (docs/results/mutants-gpu.md)

Exit status: 0 when every selected mutant is caught; 1 when one is missed, a snippet is stale, the
baseline fails, or a run errors (collection error, timeout). The last line is the verdict.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY = ("nemo_cudagraph_plugin", "tests", "recipes", "benchmarks", "pyproject.toml", "ci", ".ci", "Jenkinsfile")
PKG = "nemo_cudagraph_plugin"

E = "nemo_cudagraph_plugin/core/engine.py"
ADDR = "nemo_cudagraph_plugin/core/addresses.py"
PARITY = "nemo_cudagraph_plugin/core/parity.py"
RUNNER = "nemo_cudagraph_plugin/lightning/runner.py"
ADAPTER = "nemo_cudagraph_plugin/lightning/adapter.py"
COMPAT = "nemo_cudagraph_plugin/lightning/_compat.py"
MSTATE = "nemo_cudagraph_plugin/core/module_state.py"
OPTIM = "nemo_cudagraph_plugin/core/optim.py"
NAN = "nemo_cudagraph_plugin/core/nan_guard.py"
FINITE = "nemo_cudagraph_plugin/core/finite.py"
NODES = "nemo_cudagraph_plugin/core/_cuda_nodes.py"
ADAM = "nemo_cudagraph_plugin/core/adam_step.py"
AS = "tests/test_adam_step.py::"
TAIL = "nemo_cudagraph_plugin/core/adam_tail.py"
UADAM = "nemo_cudagraph_plugin/core/user_adam.py"
USGD = "nemo_cudagraph_plugin/core/user_sgd.py"
US = "tests/test_user_sgd.py::"
UA = "tests/test_user_adam.py::"
UOG = "tests/gpu/test_user_optimizer_gpu.py::"
ATL = "tests/test_adam_tail.py::"
LT = "tests/test_lightning_cpu.py::"
ET_ = "tests/test_engine_tape.py::"
GPU = "tests/gpu/test_can_fail_gpu.py::"
NF = "tests/test_nemo_flag.py::"
GRAPH_FIELDS = "nemo_cudagraph_plugin/integrations/megatron/graph_fields.py"
MEGATRON_CAPS = "nemo_cudagraph_plugin/integrations/megatron/capabilities.py"
MEGATRON_CALLBACKS = "nemo_cudagraph_plugin/integrations/megatron/callbacks.py"
FP8_PIPELINE = "nemo_cudagraph_plugin/fp8/pipeline.py"
NEMO_MEGATRON = "nemo_cudagraph_plugin/integrations/nemo/_megatron_recipe.py"
NEMO_LIGHTNING = "nemo_cudagraph_plugin/integrations/nemo/_lightning_recipe.py"
PARTIAL = "nemo_cudagraph_plugin/core/partial.py"
POPT = "nemo_cudagraph_plugin/core/partial_optimizer.py"
GMOD = "nemo_cudagraph_plugin/core/graphed_module.py"
PT = "tests/test_partial_cpu.py::"
FM = "tests/test_fp8_master_cpu.py::"
UFA = "tests/test_user_fused_adam.py::"


@dataclass(frozen=True)
class Mutant:
    name: str
    tier: str  # "cpu" | "gpu" | "nemo" (tests that need NeMo, nemo_run and megatron-core: .venv-nemo)
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


MUTANTS: list[Mutant] = [
    # -- CI scripts ------------------------------------------------------------------------------------------------------------------------
    Mutant("gpu-suite-limit-without-kill", "cpu", "ci/gpu_tests.sh",
           'timeout -k "${KILL_AFTER:-20}" "${NEW_TIMEOUT:-420}" python3 -m pytest',
           'timeout "${NEW_TIMEOUT:-420}" python3 -m pytest',
           ("tests/test_ci_jenkinsfile.py::test_gpu_tests_sh_stops_a_suite_that_ignores_the_timeouts_sigterm",),
           "the GPU suite's time limit only sends SIGTERM, which Lightning turns into one test's failure"),
    # -- the step's core: progress, outputs, guards, parity ---------------------------------------------------------------------------------
    Mutant("progress-delta-apply-noop", "cpu", COMPAT,
           "        for o, n, d in self.incs:\n            setattr(o, n, getattr(o, n) + d)",
           "        for o, n, d in self.incs:\n            pass",
           (LT + "test_graphed_fit_equals_eager_lightning_bitwise[1-12]",),
           "ProgressDelta.apply does nothing: global_step stands still on replays"),
    Mutant("outputs-not-cloned", "cpu", E,
           "            copy_all(fresh, leaves)\n        return self._build(fresh)",
           "            copy_all(fresh, leaves)\n        return self._build(list(leaves))",
           (ET_ + "test_returned_outputs_are_copies_that_later_replays_do_not_overwrite[copies-around]",
            LT + "test_graphed_fit_equals_eager_lightning_bitwise[1-12]"),
           "GraphEntry.outputs returns the static output buffers: a kept loss changes on the next replay"),
    Mutant("hyperparam-guard-returns-none", "cpu", ADAPTER,
           "    def _hyperparam_guard(self) -> Optional[str]:\n",
           "    def _hyperparam_guard(self) -> Optional[str]:\n        return None\n",
           (LT + "test_lr_scheduler_changes_the_lr_every_replayed_step_reads",
            LT + "test_float_lr_assigned_around_the_capture_step_is_used_by_the_graph"),
           "the adapter's guard never syncs the learning rate into the device tensor"),
    Mutant("close-always-true", "cpu", PARITY,
           "def _close(a: float, b: float, rtol: float) -> bool:\n",
           "def _close(a: float, b: float, rtol: float) -> bool:\n    return True\n",
           (ET_ + "test_verify_steps_raise_parity_error_when_the_graph_differs_from_eager[loss]",
            LT + "test_parity_error_fires_when_the_graph_differs_from_eager_on_purpose"),
           "verify_steps' scalar comparison always agrees"),
    Mutant("on-capture-emptied", "cpu", ADAPTER,
           "    def on_capture(self, entry: GraphEntry) -> None:\n",
           "    def on_capture(self, entry: GraphEntry) -> None:\n        return\n",
           (LT + "test_graphed_fit_equals_eager_lightning_bitwise[1-12]",
            LT + "test_python_values_logged_in_the_step_are_re_emitted_as_captured"),
           "the adapter keeps nothing at capture (progress delta, log records)"),
    Mutant("batch-copy-skipped", "cpu", "nemo_cudagraph_plugin/core/buffers.py",
           "        if leaves:\n            copy_all(self.leaves, leaves)",
           "        pass",
           (ET_ + "test_graphed_steps_equal_eager_bitwise[False-copies-around]",
            LT + "test_graphed_fit_equals_eager_lightning_bitwise[1-12]"),
           "StaticInputs.copy_from skips the copy: every replay trains on the capture's batch"),
    Mutant("generator-registration-skipped", "cpu", "nemo_cudagraph_plugin/core/rng.py",
           "            graph.register_generator_state(gen)",
           "            pass",
           (ET_ + "test_registered_generator_advances_each_replay_like_eager",),
           "GeneratorRegistry.apply registers nothing: extra generators repeat their numbers"),
    Mutant("fp8-refresh-hook-skipped", "cpu", "nemo_cudagraph_plugin/fp8/refresh.py",
           "        self.last_refreshed = self.plan.refresh()",
           "        self.last_refreshed = 0",
           ("tests/test_fp8_refresh.py::test_install_refreshes_after_each_step_in_order",
            "tests/test_fp8_refresh.py::test_install_without_writer_reset_still_fixes_stale_bytes"),
           "install_fp8_refresh's optimizer post-hook refreshes nothing (TE doubles)"),
    Mutant("fp8-refresh-event-not-attached", "cpu", "nemo_cudagraph_plugin/fp8/refresh.py",
           "            self._detach = where(self.run)  # type: ignore[operator]",
           "            self._detach = lambda: None",
           ("tests/test_fp8_refresh.py::test_one_installer_for_optimizers_and_framework_events_with_the_modes_of_the_option",
            "tests/test_pipeline_alignment.py::test_aligner_refresh_is_installed_by_the_one_installer_and_removed_with_it"),
           "install_fp8_refresh on a framework event (attach) never hands the refresh to the event"),
    Mutant("pp-aligner-refreshes-nothing", "cpu", "nemo_cudagraph_plugin/fp8/pipeline.py",
           "        n = self._refresh() if self._refresh is not None else 0\n",
           "        n = 0\n",
           ("tests/test_pipeline_alignment.py::test_align_refreshes_shared_params_once_and_counts",
            "tests/test_pipeline_alignment.py::test_aligned_refreshes_every_chunk_before_microbatch_0"),
           "the pipeline aligner's call never runs the refresh the one installer handed it"),
    Mutant("capture-keeps-previous-grads", "cpu", E,
           "            for _, p in self.named_params:\n                p.grad = None\n        book = ",
           "            self._kept = [p.grad for _, p in self.named_params]\n"
           "            for _, p in self.named_params:\n                p.grad = None\n        book = ",
           (ET_ + "test_a_step_that_zeroes_its_gradients_is_warmed_and_captured_without_the_previous_ones[raise]",),
           "the capture of a step that zeroes its gradients keeps the previous ones alive (one more set at the peak)"),
    Mutant("warmup-copies-fresh-grads", "cpu", E,
           'on_capture_error == "eager" or self.fallback is not None) and not fresh_grads:',
           'on_capture_error == "eager" or self.fallback is not None):',
           (ET_ + "test_a_step_that_zeroes_its_gradients_is_warmed_and_captured_without_the_previous_ones[eager]",),
           "the sync-checked warm-up copies the gradients of a step that zeroes them anyway"),
    Mutant("param-address-scan-skipped", "cpu", ADDR,
           "self._flag.dirty or list(map(_data_ptr, self._scan)) != self._scan_ptrs",
           "self._flag.dirty",
           (LT + "test_parameters_reallocated_after_capture_are_detected",
            ET_ + "test_reallocated_state_after_capture_is_detected_and_recaptured[swap_tensors]"),
           "no per-replay parameter address scan: p.data = ..., swap_tensors, weight swaps go unseen"),
    Mutant("revalidate-skipped", "cpu", E,
           "        book.dirty = False\n        if not len(self.cache):\n            return\n",
           "        book.dirty = False\n        return\n",
           (ET_ + "test_reallocated_state_after_capture_is_detected_and_recaptured[optimizer_state]",
            LT + "test_parameters_reallocated_after_capture_are_detected[data]"),
           "revalidate compares no addresses: stale graphs replay"),
    Mutant("lr-tensor-frozen", "cpu", "nemo_cudagraph_plugin/core/optim.py",
           "                    obj.fill_(cur if isinstance(cur, Tensor) else float(cur))",
           "                    pass",
           (LT + "test_lr_scheduler_changes_the_lr_every_replayed_step_reads[capturable]",
            LT + "test_float_lr_assigned_around_the_capture_step_is_used_by_the_graph[capturable]"),
           "OptimizerPrep.sync_hyperparams leaves the learning-rate tensor as it was"),
    Mutant("log-reemission-dropped", "cpu", "nemo_cudagraph_plugin/lightning/logs.py",
           "                    value = next(it)\n",
           "                    continue\n",
           (LT + "test_graphed_fit_equals_eager_lightning_bitwise[1-12]",),
           "StepLogs.emit drops the self.log calls of tensor values"),
    Mutant("progress-delta-not-applied", "cpu", ADAPTER,
           "        if delta is not None:\n            delta.apply()",
           "        pass",
           (LT + "test_graphed_fit_equals_eager_lightning_bitwise[2-8]",),
           "the adapter does not re-apply the counter increments after a replay"),
    Mutant("nan-guard-grad-check-skipped", "cpu", "nemo_cudagraph_plugin/core/nan_guard.py",
           "        if self.mode != \"full\" and found_inf is None:\n            return\n",
           "        return\n",
           (LT + "test_nan_guard_names_the_parameter_whose_gradient_went_bad_in_a_replay",
            ET_ + "test_nan_guard_sees_a_bad_gradient_on_a_replayed_step"),
           "NanGuard.observe_grads checks no gradient"),
    Mutant("nan-read-waits", "cpu", "nemo_cudagraph_plugin/core/nan_guard.py",
           "        if self._read is None or (self._read[1] is not None and not self._read[1].query()):\n",
           "        if self._read is None:\n",
           ("tests/test_core.py::test_nan_guard_snapshot_reads_without_waiting",),
           "NanGuard.poll reads a snapshot the GPU has not written yet (a host wait every nan_check_every steps)"),
    Mutant("nan-snapshot-not-cleared", "cpu", "nemo_cudagraph_plugin/core/nan_guard.py",
           "        self.reset()  # in stream order after the copy: the next window starts from zero\n",
           "",
           ("tests/test_core.py::test_nan_guard_snapshot_reads_without_waiting",),
           "NanGuard.snapshot leaves the accumulators set: every later window reports the old bad step"),
    Mutant("nan-snapshot-never-polled", "cpu", NAN,
           "        if guard.read_pending:\n",
           "        if False:\n",
           (LT + "test_nan_guard_read_is_reported_by_the_first_step_after_the_gpu_wrote_it",),
           "the runner never reads a queued NaN-guard snapshot before the next one is due"),
    Mutant("classifier-reads-comments", "cpu", "nemo_cudagraph_plugin/core/errors.py",
           "    code = _code_only(frame.line or \"\").lower()",
           "    code = (frame.line or \"\").lower()",
           (ET_ + "test_capture_errors_name_the_users_line_and_rule[True-_commented-host-sync]",),
           "the capture-error classifier matches text in comments"),
    Mutant("lr-left-a-float", "cpu", "nemo_cudagraph_plugin/core/optim.py",
           "            if lr_t:\n",
           "            if False:\n",
           (LT + "test_lr_scheduler_changes_the_lr_every_replayed_step_reads[capturable]",),
           "OptimizerPrep leaves the learning rate a Python float: the graph bakes the capture's value"),
    Mutant("signature-without-shapes", "cpu", "nemo_cudagraph_plugin/core/buffers.py",
           "    return (spec, tuple((t.shape, t.dtype, t.device, t.stride()) for t in leaves))",
           "    return (spec, tuple((t.dtype, t.device) for t in leaves))",
           (LT + "test_variable_shapes_and_graph_cache_limit[evict]",),
           "the input signature ignores shapes: a graph replays batches of another length"),
    Mutant("grads-not-reattached-after-validation", "cpu", ADAPTER,
           "        for p, g in self._grads:\n            if p.grad is None:\n                p.grad = g\n",
           "",
           (LT + "test_validation_in_between_keeps_graphs_and_results[2]",),
           "gradients Lightning drops around validation are not given back (every graph is re-captured)"),
    Mutant("verify-rng-not-restored", "cpu", PARITY,
           "            be.set_rng_state(rng, self.device)\n",
           "",
           (LT + "test_dropout_masks_differ_per_replay_and_equal_eager",),
           "verify_steps lets the eager half advance the default generator: the graph draws other masks"),
    # -- values baked into a graph, re-allocated state, verify_steps ---------------------------------------------------------------------------------
    Mutant("step-key-without-k", "cpu", COMPAT,
           "    return StepKey(zero, step, k, ",
           "    return StepKey(zero, step, 0, ",
           (LT + "test_gradient_accumulation_scheduler_changes_k_between_graphs",),
           "accumulate_grad_batches is not part of the graph key"),
    Mutant("guards-only-on-cache-hit", "cpu", E,
           "        reasons = [r for r in map(_call, self.guards) if r is not None]\n        if reasons:\n"
           "            self.invalidate(\"; \".join(reasons))\n        entry = self.cache.get(full_key)\n",
           "        entry = self.cache.get(full_key)\n"
           "        reasons = [r for r in map(_call, self.guards if entry is not None else ()) if r is not None]\n"
           "        if reasons:\n            self.invalidate(\"; \".join(reasons))\n            entry = None\n",
           (LT + "test_float_lr_assigned_around_the_capture_step_is_used_by_the_graph",
            ET_ + "test_guards_run_before_the_capture_not_only_before_replays"),
           "guards (learning-rate sync) run only before replays, not before the capture"),
    Mutant("param-group-watch-skipped", "cpu", ADAPTER,
           "    if not watch.changes:\n        return\n",
           "    return\n",
           (LT + "test_lr_assigned_inside_optimizer_step_is_refused_at_capture_naming_the_line",),
           "an optimizer_step override assigning pg['lr'] inside the captured step is not refused"),
    Mutant("verify-restore-skipped", "cpu", PARITY,
           "            rec.restore()\n",
           "",
           (ET_ + "test_verify_steps_leave_parameters_and_optimizer_state_as_an_unverified_run",
            LT + "test_verify_steps_pass_and_leave_training_as_eager"),
           "verify_steps does not undo the eager half's writes (the step runs twice)"),
    # (No mutant drops the runner's buffer snapshot for verify_steps: since the write recorder also snapshots the
    # batch-norm running statistics by argument name, that snapshot only matters for kernels outside torch's
    # dispatcher — a TE or custom CUDA extension — which no CPU test can run; the break would be equivalent here.)
    Mutant("verify-unmarked-writes-skipped", "cpu", PARITY,
           "            if not written and name not in _UNMARKED_WRITES:\n",
           "            if not written:\n",
           (ET_ + "test_verify_steps_leave_batchnorm_statistics_as_an_unverified_run[False]",),
           "the write recorder misses BatchNorm running statistics (their schemas do not mark them written)"),
    Mutant("after-eager-not-dirty", "cpu", E,
           "        if len(self.cache):\n            self.addresses.dirty = True\n",
           "        pass\n",
           (LT + "test_gradient_first_created_by_a_longer_sequence_recaptures_the_earlier_graph",
            ET_ + "test_gradient_created_by_a_later_signature_invalidates_the_earlier_graph"),
           "state created by an eager step (a first gradient) does not re-check earlier graphs"),
    Mutant("nan-plan-host-built", "cpu", "nemo_cudagraph_plugin/core/finite.py",
           "                index = host.to(device, non_blocking=True)",
           "                index = torch.tensor(slot_ids, dtype=torch.long, device=device)",
           (LT + "test_nan_guard_set_up_when_first_gradients_appear_on_the_sync_checked_warmup_step[gradient-read]",
            ET_ + "test_nan_guard_plan_built_inside_the_sync_checked_step_does_not_sync"),
           "the NaN guard builds its index tensor with a blocking host-to-device copy"),
    Mutant("callback-with-ddp-allowed", "cpu", "nemo_cudagraph_plugin/lightning/checks.py",
           "    if owner == \"CudaGraphCallback\" and \"DDPStrategy\" in names:",
           "    if False:",
           (LT + "test_callback_with_ddp_strategy_is_refused_naming_the_strategy_to_use",),
           "CudaGraphCallback accepts a DDPStrategy"),
    Mutant("per-layer-parity-note-dropped", "cpu", GRAPH_FIELDS,
           "        if note is not None:\n            notes.append(note)\n",
           "        pass\n",
           ("tests/test_nemo_flag.py::test_per_layer_graphs_on_a_megatron_core_that_reuses_saved_inputs",
            "tests/test_nemo_flag.py::test_apply_fields_to_a_plain_config_object"),
           "the NeMo flag turns megatron-core's per-layer graphs on without saying they differ from eager"),
    Mutant("per-layer-refusal-ignored", "cpu", GRAPH_FIELDS,
           "    refused = _capabilities.per_layer_refusal(capabilities)\n",
           "    refused = None\n",
           ("tests/test_nemo_flag.py::test_per_layer_graphs_on_a_megatron_core_that_reuses_saved_inputs",),
           "the NeMo flag gives megatron-core 0.16.1's per-layer graphs (not equal to eager) instead of the whole "
           "iteration, and accepts a per-layer scope there"),
    Mutant("pool-kept-after-every-graph-dropped", "cpu", "nemo_cudagraph_plugin/core/backend.py",
           "        if self._handle is None or not self._live() or (self._sealed and not keeps_nothing):\n",
           "        if self._handle is None or (self._sealed and not keeps_nothing):\n",
           ("tests/test_engine_tape.py::test_reallocated_state_after_capture_is_detected_and_recaptured[data]",),
           "the engine captures into the memory pool of graphs it has all dropped (torch's allocator asserts)"),
    Mutant("finite-fallback-ignores-slots", "cpu", "nemo_cudagraph_plugin/core/finite.py",
           "                acc.index_add_(0, index, bad)\n            if step_acc is not None:",
           "                acc[: len(tensors)].add_(bad)\n            if step_acc is not None:",
           ("tests/test_core.py::test_finite_check_counts_non_finite_elements_per_slot_on_the_fallback_path",
            "tests/test_core.py::test_nan_guard_partial_gradients_use_index_plan"),
           "the guard's _foreach_norm path adds each count into the wrong parameter's slot"),
    Mutant("bed-one-comparison-group", "cpu", "benchmarks/megatron_bed.py",
           "    return tuple(key.items())\n",
           "    return ()\n",
           ("tests/test_megatron_bed.py::test_every_arm_is_compared_with_the_eager_arms_of_its_own_configuration",),
           "the Megatron bed compares every arm with one eager run, whatever its configuration"),
    Mutant("bed-noise-ignores-grad-norms", "cpu", "benchmarks/megatron_bed.py",
           "                  and (gd[\"max_rel\"] or 0.0) <= (g[\"noise_grad_norm_max_rel\"] or 0.0)):",
           "                  ):",
           ("tests/test_megatron_bed.py::test_report_verdicts",),
           "the Megatron bed calls equal losses with different gradient norms eager noise"),
    # -- GPU only: the CUDA backend and real TransformerEngine ---------------------------------------------
    Mutant("cuda-sync-check-off", "gpu", "nemo_cudagraph_plugin/core/backend.py",
           "        torch.cuda.set_sync_debug_mode(\"error\")\n",
           "",
           (GPU + "test_sync_check_of_the_last_warmup_step_runs_on_cuda",),
           "CudaBackend.sync_errors does not turn host syncs into errors"),
    Mutant("generator-registration-skipped-cuda", "gpu", "nemo_cudagraph_plugin/core/rng.py",
           "            graph.register_generator_state(gen)",
           "            pass",
           (GPU + "test_registered_cuda_generator_draws_new_masks_per_replay_equal_to_eager[extra]",),
           "GeneratorRegistry.apply registers nothing with torch.cuda.CUDAGraph"),
    Mutant("close-always-true-cuda", "gpu", PARITY,
           "def _close(a: float, b: float, rtol: float) -> bool:\n",
           "def _close(a: float, b: float, rtol: float) -> bool:\n    return True\n",
           (GPU + "test_parity_error_fires_for_a_step_that_differs_from_eager",),
           "verify_steps' scalar comparison always agrees (on CUDA)"),
    Mutant("lr-tensor-frozen-cuda", "gpu", "nemo_cudagraph_plugin/core/optim.py",
           "                    obj.fill_(cur if isinstance(cur, Tensor) else float(cur))",
           "                    pass",
           (GPU + "test_lr_schedule_reaches_the_replayed_optimizer_and_matches_torch_adamw[float_callback]",),
           "the learning-rate tensor a CUDA graph reads is never updated"),
    Mutant("finite-kernel-adds-nothing-cuda", "gpu", "nemo_cudagraph_plugin/core/finite.py",
           "        tl.atomic_add(acc + tl.load(table + 3 * n_tensors + t), n_bad, mask=n_bad > 0)",
           "        tl.atomic_add(acc + tl.load(table + 3 * n_tensors + t), n_bad, mask=n_bad < 0)",
           ("tests/gpu/test_finite_gpu.py::test_counts_equal_torch_per_tensor_and_slot[dtype0]",
            "tests/gpu/test_finite_gpu.py::test_loss_watch_kernel_counts_at_the_first_non_finite_loss_only_and_in_a_graph"),
           "the chunk count both Triton kernels inline (the gradient check, the loss watch) never adds a bad element "
           "into its slot"),
    Mutant("capture-keeps-previous-grads-cuda", "gpu", E,
           "            for _, p in self.named_params:\n                p.grad = None\n        book = ",
           "            self._kept = [p.grad for _, p in self.named_params]\n"
           "            for _, p in self.named_params:\n                p.grad = None\n        book = ",
           ("tests/gpu/test_capture_gpu.py::test_graphed_peak_memory_is_that_of_eager_training_with_the_same_optimizer",),
           "the capture keeps the previous step's gradients alive: the graphed run peaks a set of gradients above eager"),
    Mutant("adam-tail-approximate-division-cuda", "gpu", TAIL,
           "tl.store(p + offs, tl.load(p + offs) + tl.math.div_rn(tl.load(m + offs), d))",
           "tl.store(p + offs, tl.load(p + offs) + tl.load(m + offs) / d)",
           ("tests/gpu/test_capture_gpu.py::"
            "test_group_scalar_adam_update_replayed_in_a_cuda_graph_is_torchs_capturable_step_bit_for_bit[triton-tail]",),
           "the fused Adam tail divides with Triton's approximate float32 division (exact in the CPU interpreter)"),
    Mutant("adam-tail-approximate-sqrt-cuda", "gpu", TAIL,
           "d = tl.math.div_rn(tl.math.div_rn(tl.math.sqrt_rn(tl.load(v + offs)), bc2s) + eps, step_size)",
           "d = tl.math.div_rn(tl.math.div_rn(tl.sqrt(tl.load(v + offs)), bc2s) + eps, step_size)",
           ("tests/gpu/test_capture_gpu.py::"
            "test_group_scalar_adam_update_replayed_in_a_cuda_graph_is_torchs_capturable_step_bit_for_bit[triton-tail]",),
           "the fused Adam tail takes Triton's approximate square root"),
    Mutant("finite-check-keeps-tensor-cuda", "gpu", FINITE,
           "        self.ref = tensors[0].new_empty(1)",
           "        self.ref = tensors[0]",
           ("tests/gpu/test_finite_gpu.py::test_checks_keep_addresses_not_the_tensors_they_checked",),
           "a kept check holds the first tensor it checked alive (an eager step's gradient for the rest of the run)"),
    Mutant("watch-kernel-adds-nothing-cuda", "gpu", "nemo_cudagraph_plugin/core/finite.py",
           "                found += count_chunk(table, n_tensors, c, acc, ref, BLOCK, ITERS)",
           "                count_chunk(table, n_tensors, c, acc, ref, BLOCK, ITERS)",
           ("tests/gpu/test_finite_gpu.py::test_loss_watch_kernel_counts_at_the_first_non_finite_loss_only_and_in_a_graph",),
           "the loss watch's Triton kernel ignores what its chunks found: every watch that found bad gradients "
           "counts them again at the next step"),
    Mutant("finite-kernel-whole-chunk-short-cuda", "gpu", "nemo_cudagraph_plugin/core/finite.py",
           "            for i in tl.static_range(ITERS):\n                x = tl.load(base + (start + i * BLOCK",
           "            for i in tl.static_range(ITERS - 1):\n                x = tl.load(base + (start + i * BLOCK",
           ("tests/gpu/test_finite_gpu.py::test_counts_equal_torch_per_tensor_and_slot[dtype0]",),
           "the chunk count's whole-chunk path skips its last load: a NaN there is never counted"),
    # -- memset nodes run as fill kernels -------------------------------------------------------
    Mutant("fill-plan-16bit-pattern-not-repeated", "cpu", NODES,
           "        word = (value & 0xFFFF) * 0x00010001",
           "        word = value & 0xFFFF",
           ("tests/test_core.py::test_memset_fill_plans_write_exactly_the_bytes_of_the_memset_and_say_which_they_cannot",),
           "a 16-bit memset's value fills only every other half-word of the 4- and 16-byte stores"),
    Mutant("fill-plan-v4-ignores-size", "cpu", NODES,
           "    if dst % 16 == 0 and nbytes % 16 == 0:",
           "    if dst % 16 == 0:",
           ("tests/test_core.py::test_memset_fill_plans_write_exactly_the_bytes_of_the_memset_and_say_which_they_cannot",),
           "a 16-byte-aligned memset whose size is not a multiple of 16 is filled short"),
    Mutant("memset-option-ignored", "cpu", "nemo_cudagraph_plugin/core/backend.py",
           '"memsets_as_kernels=False" if not memsets_as_kernels else surgery',
           '"memsets_as_kernels=False" if not True else surgery',
           ("tests/test_core.py::test_memsets_as_kernels_is_an_option_and_graphs_keep_their_memsets_without_the_driver",),
           "CudaBackend(memsets_as_kernels=False) rewrites memsets all the same"),
    Mutant("memsets-not-rewritten-cuda", "gpu", "nemo_cudagraph_plugin/core/backend.py",
           "                self.memsets_rewritten += _cuda_nodes.rewrite_memsets(raw, sms).replaced",
           "                pass",
           ("tests/gpu/test_capture_gpu.py::test_memset_nodes_run_as_kernels_and_training_equals_eager_bitwise[True]",),
           "captured graphs keep their memset nodes (the idle gap after each stays)"),
    Mutant("fill-kernel-short-cuda", "gpu", NODES,
           '        return FillPlan("ncg_fill_v4", word, nbytes // 16)',
           '        return FillPlan("ncg_fill_v4", word, nbytes // 16 - 1)',
           ("tests/gpu/test_graph_nodes_gpu.py::test_memset_nodes_become_fill_kernels_that_write_the_same_bytes",),
           "the 16-byte fill kernel leaves the last 16 bytes of a memset unwritten"),
    # -- the batch and outputs copied by the graph's own nodes (io_in_graph) -----------------------
    Mutant("io-not-bound", "cpu", E,
           "        io.bind(leaves, fresh)",
           "        pass",
           (ET_ + "test_graphed_steps_equal_eager_bitwise[False-io-in-graph]",
            ET_ + "test_a_graph_that_copies_its_own_io_is_bound_to_each_batch_and_fresh_outputs_before_its_replay"),
           "the graph's copy nodes are never pointed at the step's batch: every replay trains on the captured one"),
    Mutant("io-outputs-not-fresh", "cpu", E,
           "        fresh = [torch.empty_like(t) for t in self.out_leaves]\n        io.bind(leaves, fresh)",
           "        fresh = list(self.out_leaves)\n        io.bind(leaves, fresh)",
           (ET_ + "test_returned_outputs_are_copies_that_later_replays_do_not_overwrite[io-in-graph]",),
           "the graph's output copy writes the static outputs: a kept loss changes on the next replay"),
    Mutant("io-option-ignored-by-engine", "cpu", "nemo_cudagraph_plugin/core/backend.py",
           "CudaBackend(config.memsets_as_kernels, config.io_in_graph)",
           "CudaBackend(config.memsets_as_kernels, True)",
           ("tests/test_core.py::test_memsets_as_kernels_is_an_option_and_graphs_keep_their_memsets_without_the_driver",),
           "the engine's default backend ignores io_in_graph=False: the graph copies the batch and outputs all the same"),
    Mutant("io-option-ignored-by-backend", "cpu", "nemo_cudagraph_plugin/core/backend.py",
           '"io_in_graph=False" if not io_in_graph else surgery',
           '"io_in_graph=False" if not True else surgery',
           ("tests/test_core.py::test_memsets_as_kernels_is_an_option_and_graphs_keep_their_memsets_without_the_driver",),
           "CudaBackend(io_in_graph=False) adds the copy nodes all the same"),
    Mutant("rewrite-undo-keeps-added-nodes", "cpu", NODES,
           "            for node in reversed(self.added):\n                drv.destroy(node)",
           "            pass",
           ("tests/test_graph_rewrites_cpu.py::test_memset_rewrite_failing_at_any_change_leaves_the_graph_as_captured",
            "tests/test_graph_rewrites_cpu.py::test_graph_io_failing_at_any_change_leaves_the_graph_as_captured"),
           "a rewrite that fails midway leaves its added fill kernels or copy nodes in the graph"),
    Mutant("rewrite-undo-drops-memset-edges", "cpu", NODES,
           "            if edges:\n                src, dst = zip(*edges.values())",
           "            if False:\n                src, dst = zip(*edges.values())",
           ("tests/test_graph_rewrites_cpu.py::test_memset_rewrite_failing_at_any_change_leaves_the_graph_as_captured",),
           "undoing a memset rewrite adds the removed memsets back without their edges (they would run unordered)"),
    Mutant("rewrite-removed-memsets-not-recorded", "cpu", NODES,
           "        self.removed.append((params, self.drv.key(node), deps, after))",
           "        pass",
           ("tests/test_graph_rewrites_cpu.py::test_memset_rewrite_failing_at_any_change_leaves_the_graph_as_captured",),
           "a memset removed before the rewrite fails is not added back by the undo"),
    Mutant("rewrite-failure-not-contained-by-backend", "cpu", "nemo_cudagraph_plugin/core/backend.py",
           "            except _cuda_nodes.RewriteError as exc:\n                warn_once(\"memsets-as-kernels\"",
           "            except _cuda_nodes.GraphDamaged as exc:\n                warn_once(\"memsets-as-kernels\"",
           ("tests/test_graph_rewrites_cpu.py::test_the_backend_keeps_the_graph_as_captured_after_a_failed_rewrite_and_fails_the_capture_on_a_damaged_one",),
           "a failed memset rewrite (graph as captured) fails the capture instead of keeping the graph's memsets"),
    Mutant("rewrites-unavailable-silently", "cpu", "nemo_cudagraph_plugin/core/backend.py",
           "        if surgery is not None and (memsets_as_kernels or io_in_graph):",
           "        if False:",
           ("tests/test_graph_rewrites_cpu.py::test_without_the_driver_bindings_graphs_stay_as_captured_with_one_warning",),
           "without cuda-bindings (or the driver) graphs stay as captured and nothing says why"),
    Mutant("io-copy-kernel-short-cuda", "gpu", NODES,
           "    shr.u64 %rd8, %rd3, 4;",
           "    shr.u64 %rd8, %rd3, 5;",
           ("tests/gpu/test_graph_nodes_gpu.py::test_graph_io_nodes_copy_the_bound_batch_in_and_outputs_out_at_any_alignment[0-0-4096]",
            "tests/gpu/test_capture_gpu.py::test_graph_copies_batch_and_outputs_itself_and_training_equals_eager_bitwise[io-in-graph]"),
           "the copy kernel's 16-byte path copies half of an aligned batch and output"),
    Mutant("io-copy-byte-path-skips-cuda", "gpu", NODES,
           "    st.global.u8 [%rd13], %rs1;\n    add.u64 %rd5, %rd5, %rd7;",
           "    st.global.u8 [%rd13], %rs1;\n    add.u64 %rd5, %rd5, %rd7;\n    add.u64 %rd5, %rd5, %rd7;",
           ("tests/gpu/test_graph_nodes_gpu.py::test_graph_io_nodes_copy_the_bound_batch_in_and_outputs_out_at_any_alignment[1-0-1048579]",
            "tests/gpu/test_capture_gpu.py::test_graph_copies_batch_and_outputs_itself_and_training_equals_eager_bitwise[unaligned-batch]"),
           "the copy kernel's byte path (a batch or output off 16-byte alignment) skips every other grid stride"),
    Mutant("io-bind-input-not-set-cuda", "gpu", NODES,
           "        for nodes, tensors in ((self._in, iter(srcs)), (self._out, iter(dsts))):",
           "        for nodes, tensors in ((self._out, iter(dsts)),):",
           ("tests/gpu/test_graph_nodes_gpu.py::test_graph_io_a_queued_replay_keeps_the_addresses_it_was_launched_with",
            "tests/gpu/test_capture_gpu.py::test_graph_copies_batch_and_outputs_itself_and_training_equals_eager_bitwise[io-in-graph]"),
           "bind() never sets the batch addresses on the executable graph: every replay reads the batch it was "
           "captured with"),
    # -- one copy node per side, for up to _COPY_SEGMENTS buffers ------------------------------------
    Mutant("io-bind-spans-shifted-cuda", "gpu", NODES,
           "                for arg, t in zip(far, tensors):",
           "                for t, arg in zip(tensors, far):",
           ("tests/gpu/test_graph_nodes_gpu.py::test_graph_io_copies_many_buffers_of_any_size_and_alignment_with_a_node_per_eight",),
           "bind() takes one tensor too many for a full copy node: the next node's buffers get their neighbours' "
           "addresses"),
    Mutant("io-copy-span-start-not-reset-cuda", "gpu", NODES,
           "    cvta.to.global.u64 %rd2, %rd2;\n    mov.u64 %rd5, %rd14;\n",
           "    cvta.to.global.u64 %rd2, %rd2;\n",
           ("tests/gpu/test_graph_nodes_gpu.py::test_graph_io_copies_many_buffers_of_any_size_and_alignment_with_a_node_per_eight",
            "tests/gpu/test_capture_gpu.py::test_graph_copies_batch_and_outputs_itself_and_training_equals_eager_bitwise[io-in-graph]"),
           "the copy kernel starts each span where the previous one's loop ended: every buffer after the first is "
           "copied short (or not at all)"),
    Mutant("ptx-copy-span-left-a-template", "cpu", NODES,
           '    + "".join(_PTX_COPY_SPAN.replace("{i}", str(i)) for i in range(_COPY_SEGMENTS))',
           '    + "".join(_PTX_COPY_SPAN for i in range(_COPY_SEGMENTS))',
           ("tests/test_core.py::test_memset_fill_plans_write_exactly_the_bytes_of_the_memset_and_say_which_they_cannot",),
           "the copy kernel's spans keep their {i} placeholders (duplicate labels the driver refuses, on a GPU only)"),
    # -- NeMo flag planning, options, error reports, keys --------
    Mutant("plan-full-iteration-mixed-with-layers", "cpu", GRAPH_FIELDS,
           "    if full_iteration and effective_scope != [\"full_iteration\"]:",
           "    if False:",
           (NF + "test_plan_016_full_iteration_is_planned_not_refused",),
           "the NeMo flag accepts 'full_iteration' combined with per-layer scopes"),
    Mutant("plan-deprecated-flags-left-on", "cpu", GRAPH_FIELDS,
           "            if deprecated in current:\n                updates[deprecated] = False",
           "            if deprecated in current:\n                pass",
           (NF + "test_plan_016_repairs_nemo_perf_script_style",),
           "on megatron-core >= 0.16 the flag leaves enable_cuda_graph on next to cuda_graph_impl (connect() asserts)"),
    Mutant("plan-scope-left-a-list", "cpu", GRAPH_FIELDS,
           "            updates[\"cuda_graph_scope\"] = \",\".join(new_scope) if new_scope else []",
           "            updates[\"cuda_graph_scope\"] = list(new_scope) if new_scope else []",
           (NF + "test_plan_scope_spellings",),
           "a per-layer scope is written as a list, which nemo_run's YAML turns into its repr"),
    Mutant("plan-warmup-unchecked", "cpu", GRAPH_FIELDS,
           "        if not isinstance(warmup_steps, int) or warmup_steps < 1:",
           "        if False:",
           (NF + "test_plan_bad_input_says_what_to_change",),
           "warmup_steps=0 or a float reaches megatron-core's config"),
    Mutant("plan-reports-unchanged-fields", "cpu", GRAPH_FIELDS,
           "    changed = {k: v for k, v in updates.items() if not _field_equal(k, current.get(k, UNSET), v)}",
           "    changed = dict(updates)",
           (NF + "test_plan_is_idempotent",),
           "the plan re-sets fields that already hold the value (the flag is not idempotent)"),
    Mutant("scope-full-is-a-layer-name", "cpu", GRAPH_FIELDS,
           "    return [] if out == [\"full\"] else out",
           "    return out",
           (NF + "test_plan_scope_spellings",),
           "megatron's old scope spelling 'full' (the whole layer) is read as a layer named 'full'"),
    Mutant("unknown-option-accepted", "cpu", "nemo_cudagraph_plugin/core/config.py",
           "        if unknown:\n",
           "        if False:\n",
           ("tests/test_refusals_cpu.py::test_unknown_option_lists_the_options",),
           "CudaGraphCallback(warmup_step=3) (a typo) is silently ignored"),
    Mutant("align-pp-without-refresh", "cpu", "nemo_cudagraph_plugin/core/config.py",
           "        cfg.fp8_refresh = True",
           "        pass",
           ("tests/test_core.py::test_align_pp_transposes_requires_the_fp8_refresh",),
           "align_pp_transposes=True leaves fp8_refresh='auto' (aligned transposes with no refresh on a non-FP8 start)"),
    Mutant("classifier-cpu-tensor-as-host-sync", "cpu", "nemo_cudagraph_plugin/core/errors.py",
           "            return \"cpu-tensor\"",
           "            return \"host-sync\"",
           ("tests/test_core.py::test_capture_errors_are_classified_from_the_user_line[_raise_sync_to-cpu-tensor]",),
           "a CPU tensor created in the step is reported as a host sync (the wrong fix is suggested)"),
    Mutant("library-frame-claimed-as-user-code", "cpu", "nemo_cudagraph_plugin/core/errors.py",
           "    if user is not None:\n        return user, False\n    return library, library is not None",
           "    if user is not None:\n        return user, False\n    return library, False",
           ("tests/test_core.py::test_location_in_library_code_is_named_and_marked",),
           "an error inside installed library code is reported as the user's own line"),
    Mutant("signature-ignores-strides", "cpu", "nemo_cudagraph_plugin/core/buffers.py",
           "    return (spec, tuple((t.shape, t.dtype, t.device, t.stride()) for t in leaves))",
           "    return (spec, tuple((t.shape, t.dtype, t.device) for t in leaves))",
           ("tests/test_core.py::test_signature_tracks_shape_dtype_and_non_tensor_leaves",),
           "a transposed batch of the same shape replays the graph captured for the contiguous one"),
    Mutant("fp16-not-refused", "cpu", "nemo_cudagraph_plugin/lightning/checks.py",
           "    if precision.startswith(\"16\") or precision in (\"fp16\", \"half\"):",
           "    if False:",
           ("tests/test_refusals_cpu.py::test_fp16_precision_is_refused_at_setup_before_any_optimizer_exists",),
           "precision='16-mixed' (a GradScaler reading found_inf on the host every step) is captured"),
    Mutant("manual-optimization-not-refused", "cpu", "nemo_cudagraph_plugin/lightning/checks.py",
           "    if not pl_module.automatic_optimization:",
           "    if False:",
           ("tests/test_refusals_cpu.py::test_module_that_cannot_be_graphed_is_refused_on_a_cpu_machine[<lambda>-kw0-manual optimization]",),
           "a manual-optimization module is captured as if Lightning's automatic step were the whole step"),
    Mutant("callback-with-ddp-not-refused", "cpu", "nemo_cudagraph_plugin/lightning/checks.py",
           "    if owner == \"CudaGraphCallback\" and \"DDPStrategy\" in names:",
           "    if False:",
           ("tests/test_refusals_cpu.py::test_callback_with_ddp_strategy_points_to_the_strategy",),
           "CudaGraphCallback under DDP (no NCCL set-up, too few warm-ups) is not pointed to CudaGraphStrategy"),
    Mutant("two-owners-allowed", "cpu", RUNNER,
           "    if len(owners) > 1:",
           "    if len(owners) > 2:",
           ("tests/test_refusals_cpu.py::test_callback_and_strategy_together_is_one_clear_error",),
           "a CudaGraphCallback and a CudaGraphStrategy both capture the same step"),
    Mutant("pp-barrier-allowed-in-capture", "cpu", FP8_PIPELINE,
           "def _refuse_sync_in_capture() -> None:\n    if _is_capturing():",
           "def _refuse_sync_in_capture() -> None:\n    if False:",
           ("tests/test_pipeline_alignment.py::test_group_barrier_is_refused_inside_a_capture",),
           "align_fp8_transposes(sync_group=True) inside a capture records a host-blocking barrier"),
    Mutant("fused-wgrad-safe-without-megatron", "cpu", MEGATRON_CAPS,
           "    if capabilities is None:\n        return False, (",
           "    if capabilities is None:\n        return True, (",
           ("tests/test_megatron_hooks.py::test_fused_wgrad_safety_reasons",),
           "fused wgrad accumulation is called safe under per-layer graphs when megatron-core cannot be inspected"),
    Mutant("fused-wgrad-safe-on-old-megatron", "cpu", MEGATRON_CAPS,
           "    return False, (\n        f\"megatron-core {capabilities.version}'s per-layer graph replay does not restore",
           "    return True, (\n        f\"megatron-core {capabilities.version}'s per-layer graph replay does not restore",
           ("tests/test_megatron_hooks.py::test_fused_wgrad_safety_reasons",),
           "fused wgrad accumulation is called safe on a megatron-core whose replay does not restore TE's "
           "grad_added_to_main_grad (Megatron-LM #1279: NaN gradients)"),
    Mutant("megatron-shape-probe-skipped", "cpu", MEGATRON_CAPS,
           "    tested = known is not None and _hooks_have_their_shape(ddp, pgb)\n",
           "    tested = known is not None\n",
           ("tests/test_megatron_hooks.py::test_capabilities_fail_closed_when_unsure_and_say_so_once",),
           "a tested megatron-core version whose DDP methods lost the parameters the all-gather refresh wraps is "
           "trusted anyway"),
    Mutant("megatron-unknown-version-trusted-to-rebuild", "cpu", MEGATRON_CAPS,
           "    \"rebuild_after_overlapped_gather\": False,\n    \"rebuild_after_sync_gather\": False,\n",
           "    \"rebuild_after_overlapped_gather\": True,\n    \"rebuild_after_sync_gather\": True,\n",
           ("tests/test_megatron_hooks.py::test_capabilities_fail_closed_when_unsure_and_say_so_once",),
           "on an unknown megatron-core the FP8 transposes are left to a rebuild nobody checked it does"),
    Mutant("first-microbatch-false-allowed", "cpu", "nemo_cudagraph_plugin/fp8/hazards.py",
           "            if value is False and self._fp8_enabled() and not _weights_all_fp8(mod):",
           "            if False:",
           ("tests/test_fp8_refresh.py::test_first_microbatch_false_refused[False]",
            "tests/test_fp8_refresh.py::test_first_microbatch_false_refused[True]"),
           "is_first_microbatch=False on the captured step's first call (a frozen FP8 weight cache) is not refused"),
    Mutant("first-microbatch-positional-ignored", "cpu", "nemo_cudagraph_plugin/fp8/hazards.py",
           "            elif 0 <= index < len(args):\n                value = args[index]",
           "            elif False:\n                value = args[index]",
           ("tests/test_fp8_refresh.py::test_first_microbatch_false_refused[True]",),
           "is_first_microbatch=False passed positionally escapes the check"),
    Mutant("delayed-scaling-unregistered-allowed", "cpu", "nemo_cudagraph_plugin/fp8/hazards.py",
           "    missing = te.delayed_scaling_unregistered(module)\n    if missing:",
           "    missing = te.delayed_scaling_unregistered(module)\n    if False:",
           ("tests/test_fp8_refresh.py::test_delayed_scaling_registration",),
           "a TE module whose first delayed-scaling forward ran inside the capture (amax never reduced) is accepted"),
    Mutant("refused-optimizer-accepted", "cpu", "nemo_cudagraph_plugin/core/optim.py",
           "    if fam in _REFUSED or name in _REFUSED:",
           "    if False:",
           ("tests/test_refusals_cpu.py::test_module_that_cannot_be_graphed_is_refused_on_a_cpu_machine[<lambda>-kw1-LBFGS cannot run]",),
           "LBFGS (a closure that reads the loss on the host) is captured"),
    Mutant("differentiable-group-accepted", "cpu", "nemo_cudagraph_plugin/core/optim.py",
           "        if group.get(\"differentiable\", False):",
           "        if False:",
           ("tests/test_core.py::test_unsupported_optimizers_are_named_with_an_alternative",),
           "a param group with differentiable=True is captured"),
    Mutant("sparse-param-accepted", "cpu", "nemo_cudagraph_plugin/core/optim.py",
           "            if p.is_sparse:",
           "            if False:",
           ("tests/test_core.py::test_unsupported_optimizers_are_named_with_an_alternative",),
           "a sparse parameter's update is captured"),
    Mutant("verify-compares-untransposed", "cpu", "nemo_cudagraph_plugin/fp8/verify.py",
           "    want = data.reshape(-1, n_cols).t()",
           "    want = data.reshape(n_cols, -1)",
           ("tests/test_fp8_refresh.py::test_verify_reports_stale_flagged_and_skipped",),
           "the FP8 transpose check compares the cache with the data not transposed (a fresh cache reads as stale)"),
    Mutant("verify-skips-flagged", "cpu", "nemo_cudagraph_plugin/fp8/verify.py",
           "                if not include_flagged:",
           "                if True:",
           ("tests/test_fp8_refresh.py::test_verify_reports_stale_flagged_and_skipped",),
           "caches TE flagged invalid are never compared, although a graph captured before the flag reads them"),
    Mutant("verify-runs-in-capture", "cpu", "nemo_cudagraph_plugin/fp8/verify.py",
           "    if _refresh._capturing():\n        raise RuntimeError(",
           "    if False:\n        raise RuntimeError(",
           ("tests/test_fp8_refresh.py::test_refresh_under_capture_runs_same_python_path",),
           "the host-syncing transpose check runs inside a capture"),
    Mutant("refresh-without-reset-caches", "cpu", "nemo_cudagraph_plugin/fp8/refresh.py",
           "    ptr = buf.data_ptr()\n    te.reset_caches(t)\n    te.recompute_transpose(t, gen)",
           "    ptr = buf.data_ptr()\n    te.recompute_transpose(t, gen)",
           ("tests/test_fp8_refresh.py::test_refresh_recomputes_in_place_after_write[False-te1.8]",
            "tests/test_fp8_refresh.py::test_refresh_recomputes_in_place_after_write[False-te1.6]",
            "tests/test_fp8_refresh.py::test_refresh_recomputes_in_place_after_write[False-te2]"),
           "the refresh recomputes without _reset_caches(): TE's valid cache is returned as is, still stale"),
    Mutant("moved-transpose-not-detected", "cpu", "nemo_cudagraph_plugin/fp8/refresh.py",
           "    if new is None or new.data_ptr() != ptr:",
           "    if new is None:",
           ("tests/test_fp8_refresh.py::test_moving_buffer_refused_in_capture[te2]",),
           "a TE that recomputes the transpose into a new buffer goes unnoticed (graphs keep reading the old one)"),
    Mutant("buffer-size-unchecked", "cpu", "nemo_cudagraph_plugin/fp8/refresh.py",
           "        buf.numel() != data.numel()\n        or buf.element_size() != data.element_size()",
           "        False\n        and buf.element_size() != data.element_size()",
           ("tests/test_fp8_refresh.py::test_wrong_size_buffer_is_refused_before_writing[too-few-bytes]",),
           "a cached transpose smaller than the data is written out of bounds by TE's kernel"),
    Mutant("buffer-element-size-unchecked", "cpu", "nemo_cudagraph_plugin/fp8/refresh.py",
           "        or buf.element_size() != data.element_size()\n",
           "        or False\n",
           ("tests/test_fp8_refresh.py::test_wrong_size_buffer_is_refused_before_writing[element-size]",),
           "a cached transpose of another element size takes TE's byte kernel (half of it written, half stale)"),
    Mutant("ddp-nccl-async-left-on", "cpu", "nemo_cudagraph_plugin/lightning/strategy.py",
           "        os.environ[_ENV] = \"0\"\n",
           "        pass\n",
           (LT + "test_strategy_creates_the_process_group_with_nccl_async_error_handling_off_then_restores_it[None]",),
           "the DDP process group is created with NCCL async error handling on (its watchdog may query captured work)"),
    Mutant("ddp-nccl-env-not-restored", "cpu", "nemo_cudagraph_plugin/lightning/strategy.py",
           "            else:\n                os.environ[_ENV] = prev",
           "            else:\n                pass",
           (LT + "test_strategy_creates_the_process_group_with_nccl_async_error_handling_off_then_restores_it[1]",),
           "the user's TORCH_NCCL_ASYNC_ERROR_HANDLING is left at 0 after the process group is created"),
    Mutant("ddp-warmup-not-raised", "cpu", "nemo_cudagraph_plugin/lightning/strategy.py",
           "            cfg.warmup_steps = max(cfg.warmup_steps, DDP_MIN_WARMUP)",
           "            pass",
           (LT + "test_strategy_wraps_ddp_and_refuses_what_it_cannot_capture",),
           "DDP is captured after 3 warm-ups, while its reducer still syncs the host (its first 10 iterations)"),
    Mutant("pp-callback-never-falls-back", "cpu", MEGATRON_CALLBACKS,
           "            if self._hook_calls == 0 and not self.fallback:",
           "            if False:",
           ("tests/test_pipeline_alignment.py::test_lightning_callback_falls_back_when_step_hooks_do_not_run[1]",),
           "an optimizer whose torch step post-hook never runs (NeMo's McoreDistributedOptimizer) gets no refresh"),
    Mutant("pp-callback-fallback-refreshes-nothing", "cpu", MEGATRON_CALLBACKS,
           "        if self.fallback and self.hook is not None:\n            self.hook.align()",
           "        if self.fallback and self.hook is not None:\n            pass",
           ("tests/test_pipeline_alignment.py::test_lightning_callback_falls_back_when_step_hooks_do_not_run[1]",
            "tests/test_pipeline_alignment.py::test_lightning_callback_falls_back_without_register_step_post_hook"),
           "in the fallback the callback warns but never refreshes the transposes"),
    Mutant("pp-callback-refreshes-accumulating-batches", "cpu", MEGATRON_CALLBACKS,
           "or trainer.global_step == self._last_step:\n            return",
           "or False:\n            return",
           ("tests/test_pipeline_alignment.py::test_lightning_callback_falls_back_when_step_hooks_do_not_run[2]",),
           "the end-of-batch path runs on batches that did not step (gradient accumulation)"),
    # -- the NeMo flag on real NeMo recipes (tier nemo: .venv-nemo, ci/stages.sh nemo) ----------------
    Mutant("megatron-rng-tracker-left-off", "nemo", NEMO_MEGATRON,
           '"use_te_rng_tracker", True,\n',
           '"use_te_rng_tracker", False,\n',
           (NF + "test_llama3_8b_flag_passes_megatron_strategy_connect_on_cpu", NF + "test_undo_leaves_what_was_there_before_the_flag"),
           "the flag leaves TE's graph-safe RNG tracker off on a MegatronStrategy recipe"),
    Mutant("full-iteration-nan-checks-kept", "nemo", NEMO_MEGATRON,
           "    if setup.full_iteration:\n        _megatron_nan_checks_off(strategy, editor)",
           "    if setup.full_iteration:\n        pass",
           (NF + "test_llama3_8b_full_iteration_wires_the_step_wrapper", NF + "test_llama3_8b_default_on_megatron_core_0161_is_the_whole_iteration_graph"),
           "Megatron DDP's host-side NaN check stays on inside the full-iteration graph"),
    Mutant("full-iteration-wrapper-not-added", "nemo", NEMO_MEGATRON,
           "            _add_our_callback(trainer, editor, MegatronFullIterationGraph, _OUR_FULL,",
           "            (lambda *a: None)(trainer, editor, MegatronFullIterationGraph, _OUR_FULL,",
           (NF + "test_llama3_8b_full_iteration_wires_the_step_wrapper", NF + "test_llama3_8b_default_on_megatron_core_0161_is_the_whole_iteration_graph"),
           "megatron-core >= 0.16: nothing wraps the step in FullCudaGraphWrapper, so nothing is captured"),
    Mutant("fp8-pp-align-not-added", "nemo", NEMO_MEGATRON,
           '    if fp8_refresh is True or (fp8_refresh == "auto" and has_fp8 and pp > 1):',
           "    if fp8_refresh is True:",
           (NF + "test_fp8_recipe_gets_transpose_care_and_serializes",),
           "an FP8 pipeline-parallel recipe gets no AlignPipelineTransposes"),
    Mutant("megatron-off-keeps-our-callbacks", "nemo", NEMO_MEGATRON,
           "        if editor.record.pop(key, None) or fallback:",
           "        if False:",
           (NF + "test_idempotent_and_undo_restores_exactly", NF + "test_undo_leaves_what_was_there_before_the_flag"),
           "with_cuda_graph(enabled=False) leaves our callbacks in a Megatron recipe"),
    Mutant("megatron-mode-accepted", "nemo", NEMO_MEGATRON,
           '    if mode != "auto":\n        raise ValueError(\n            f"mode={mode!r} does not apply',
           '    if False:\n        raise ValueError(\n            f"mode={mode!r} does not apply',
           (NF + "test_megatron_recipe_refuses_what_does_not_apply",),
           "mode='callback' on a MegatronStrategy recipe is accepted (its step is Megatron's schedule)"),
    Mutant("lightning-strategy-over-callback", "nemo", NEMO_LIGHTNING,
           '    if mode == "strategy" and ours_callbacks:',
           "    if False:",
           (NF + "test_lightning_tree_callback_mode_builds_trains_and_undoes",),
           "mode='strategy' on a recipe that already holds CudaGraphCallback captures the step twice"),
    Mutant("lightning-anomaly-detection-kept", "nemo", NEMO_LIGHTNING,
           '    if get_attr(trainer, "detect_anomaly") is True:',
           "    if False:",
           (NF + "test_lightning_tree_callback_mode_builds_trains_and_undoes",),
           "Trainer(detect_anomaly=True) (a host check of every backward op) stays on under the flag"),
    Mutant("verify-generators-not-restored", "cpu", PARITY,
           "            self.generators.set_states(gens)",
           "            pass",
           (ET_ + "test_verify_steps_with_a_registered_generator_leave_its_numbers_as_an_unverified_run",),
           "verify_steps' eager half advances a registered generator that is not put back: verification changes "
           "training"),
    Mutant("generator-registered-twice", "cpu", "nemo_cudagraph_plugin/core/rng.py",
           "        if any(g is generator for g in self._gens):\n            return",
           "        if False:\n            return",
           (ET_ + "test_generator_registry_takes_each_generator_once_and_only_of_its_device",),
           "a generator registered twice is registered twice with every graph"),
    Mutant("generator-of-another-device-accepted", "cpu", "nemo_cudagraph_plugin/core/rng.py",
           "        if not isinstance(generator, torch.Generator) or generator.device.type != self.device_type:",
           "        if not isinstance(generator, torch.Generator):",
           (ET_ + "test_generator_registry_takes_each_generator_once_and_only_of_its_device",),
           "a CPU generator is registered for CUDA graphs (its numbers are not the graph's to advance)"),
    Mutant("eager-log-records-kept", "cpu", "nemo_cudagraph_plugin/lightning/logs.py",
           "        if token not in self._kept:\n            self._records.pop(token, None)",
           "        if token not in self._kept:\n            pass",
           (LT + "test_log_records_of_eager_steps_are_dropped_once_emitted",),
           "the self.log records of every eager step stay in memory for the whole run"),
    # -- the replayed step's host path: batch transfer, logging ------------------------------------------------------------
    Mutant("logged-copy-not-converted", "cpu", COMPAT,
           "    if value.is_floating_point() and value.dtype not in _FULL:\n        return value.to(_default_dtype())",
           "    if False:\n        return value.to(_default_dtype())",
           (LT + "test_logged_tensors_become_step_outputs_in_the_dtype_lightning_keeps",),
           "a bf16 value given to self.log stays bf16 in the step's outputs: every replay converts it again"),
    Mutant("transfer-not-awaited-cuda", "gpu", COMPAT,
           "        copied.record(stream)\n        main.wait_event(copied)",
           "        copied.record(stream)",
           ("tests/gpu/test_capture_gpu.py::test_step_waits_for_its_batch_copied_on_the_transfer_stream",),
           "the training stream does not wait for the batch copied on the transfer stream: a step reads its batch "
           "before it arrives"),
    Mutant("fp8-refresh-hook-skipped-te", "gpu", "nemo_cudagraph_plugin/fp8/refresh.py",
           "        self.last_refreshed = self.plan.refresh()",
           "        self.last_refreshed = 0",
           (GPU + "test_fp8_refresh_keeps_real_te_transposes_current_under_graphs",),
           "the FP8 refresh post-hook refreshes nothing (real TE Float8Tensor weights)"),
    # -- the replayed step's host path: progress and log re-emission ------------------------------------------------------------
    Mutant("fast-log-skips-count", "cpu", COMPAT,
           "    metric._update_count += 1\n",
           "    pass\n",
           (LT + "test_fast_log_leaves_the_metric_as_lightnings_update[True-False-dtype0-shape0]",),
           "the fast re-emission of self.log leaves torchmetrics' update count behind Lightning's"),
    Mutant("logged-values-handed-over-static", "cpu", E,
           "            copy_all(fresh, leaves)\n        return self._build(fresh)",
           "            copy_all(fresh, leaves)\n        return self._build(fresh[:1] + leaves[1:])",
           (LT + "test_graphed_fit_equals_eager_lightning_bitwise[1-12]",),
           "the logged values are the graph's outputs themselves (only the loss is copied): Lightning keeps, without a "
           "copy of its own, a value the next replay overwrites"),
    Mutant("unflattener-reorders-dict", "cpu", "nemo_cudagraph_plugin/core/buffers.py",
           "        return lambda it: {k: b(it) for k, b in zip(keys, subs)}",
           "        return lambda it: {k: b(it) for k, b in zip(keys, reversed(subs))}",
           ("tests/test_core.py::test_unflattener_rebuilds_what_unflatten_rebuilds[obj0]",),
           "the per-structure output builder hands a nested dict's leaves to the wrong keys"),
    Mutant("step-key-steps-every-batch", "cpu", COMPAT,
           "    step = k == 1 or trainer.strategy",
           "    step = True or trainer.strategy",
           (LT + "test_graphed_fit_equals_eager_lightning_bitwise[3-6]",),
           "the step key says every batch steps the optimizer: at k = 3 the middle and last batch of a window share a "
           "graph"),
    Mutant("clip-value-not-in-key", "cpu", COMPAT,
           "(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)",
           "(None, None)",
           (LT + "test_gradient_clip_value_changed_after_capture_is_used_by_the_next_steps",),
           "the step key leaves out the clipping value: a changed gradient_clip_val replays the old graph"),
    Mutant("skip-flag-not-written", "cpu", NAN,
           "        guard.observe_grads(found_inf)",
           "        guard.observe_grads(None)",
           (LT + "test_nan_action_skip_drops_the_poisoned_update_inside_a_replay",),
           "nan_action='skip' never sets the optimizer's found_inf: a non-finite gradient is applied"),
    Mutant("nan-skip-count-read-dropped", "cpu", "nemo_cudagraph_plugin/core/nan_guard.py",
           "        vals = host.tolist()\n        self._skipped_host = int(vals[1])",
           "        vals = host.tolist()\n        self._skipped_host = 0",
           (LT + "test_nan_action_skip_drops_the_poisoned_update_inside_a_replay",),
           "the queued NaN-guard read drops the count of skipped updates (stats show it only at fit end)"),
    Mutant("nan-check-drops-queued-report", "cpu", "nemo_cudagraph_plugin/core/nan_guard.py",
           "        return \" \".join(r for r in (first, report) if r) or None",
           "        return report",
           ("tests/test_core.py::test_nan_guard_snapshot_reads_without_waiting",),
           "the synchronous read at epoch/fit end loses what a still-queued snapshot found (skip mode)"),
    Mutant("unbind-keeps-step-routed", "cpu", RUNNER,
           "        undo.callback(undo_route)",
           "        pass",
           (LT + "test_everything_bind_changed_is_given_back_after_fit_and_after_a_refusal_raised_halfway",),
           "after fit (or a bind that raised halfway) the trainer's loop still routes its steps through the runner"),
    Mutant("unbind-undoes-nothing", "cpu", RUNNER,
           "        self._undo.close()",
           "        pass",
           (LT + "test_everything_bind_changed_is_given_back_after_fit_and_after_a_refusal_raised_halfway",),
           "unbind leaves Lightning's objects as bind changed them (the loop's run and result class, the NaN guard's "
           "points in backward, the closure and the clipping)"),
    Mutant("adapter-close-undoes-nothing", "cpu", ADAPTER,
           "        self._undo.close()\n        self.engine.note_peak_memory()",
           "        self.engine.note_peak_memory()",
           (LT + "test_everything_bind_changed_is_given_back_after_fit_and_after_a_refusal_raised_halfway",
            LT + "test_optimizer_is_given_back_as_the_user_built_it_after_fit"),
           "after fit the model and optimizer keep the adapter's changes (zero_grad, load-state hooks, lr tensors)"),
    Mutant("nan-loss-point-not-routed", "cpu", RUNNER,
           "            undo.callback(_compat.around_backward(self.trainer, points.before_backward))",
           "            pass",
           (LT + "test_the_strategy_reaches_the_nan_guard_at_the_same_points_as_the_callback[None]",
            LT + "test_nan_guard_names_the_parameter_when_its_read_comes_long_after_the_bad_step[None]"),
           "the loss is never watched: every step without clipping reads every gradient"),
    Mutant("nan-grad-point-not-routed", "cpu", RUNNER,
           "            undo.callback(_compat.after_closure(self.trainer, points.after_backward))",
           "            pass",
           (LT + "test_the_strategy_reaches_the_nan_guard_at_the_same_points_as_the_callback[value]",
            LT + "test_nan_guard_names_the_parameter_when_gradients_are_clipped[value]"),
           "no gradient check before clipping: a value clip turns an Inf gradient into a number, unreported"),
    Mutant("nan-clip-point-not-routed", "cpu", RUNNER,
           "                undo.callback(_compat.around_clip_by_norm(self.trainer, points.around_clip_by_norm))",
           "                pass",
           (LT + "test_the_strategy_reaches_the_nan_guard_at_the_same_points_as_the_callback[norm]",
            LT + "test_nan_guard_names_the_parameter_when_gradients_are_clipped[norm]"),
           "the check deferred to the clipping norms runs after the clip: every parameter named, not the bad one"),
    Mutant("fp8-fit-start-refresh-skipped", "cpu", "nemo_cudagraph_plugin/lightning/fp8_callback.py",
           "                once.run()\n",
           "                pass\n",
           ("tests/test_fp8_refresh.py::test_callback_refreshes_every_fp8_parameter_once_at_fit_start[True]",),
           "Fp8TransposeRefresh leaves transposes stale that were loaded before fit (refresh_at_fit_start)"),
    Mutant("engine-adapter-guards-not-bound", "cpu", E,
           "        self.guards: list[Guard] = list(self.adapter.guards())",
           "        self.guards: list[Guard] = []",
           (LT + "test_lr_scheduler_changes_the_lr_every_replayed_step_reads",
            LT + "test_float_lr_assigned_around_the_capture_step_is_used_by_the_graph"),
           "the engine never binds the adapter's guards: a learning rate a scheduler assigns is not copied into the "
           "tensor the graph reads"),
    Mutant("engine-adapter-capture-checks-skipped", "cpu", E,
           "            for check in self.adapter.post_capture_checks():\n                check()",
           "            for check in ():\n                check()",
           (LT + "test_lr_assigned_inside_optimizer_step_is_refused_at_capture_naming_the_line",),
           "the adapter's checks after a capture never run: an lr assigned inside the step is baked in silently"),
    Mutant("unbind-keeps-optimizer-flags", "cpu", ADAPTER,
           "        self._undo.callback(self.prep.restore)",
           "        pass",
           (LT + "test_optimizer_is_given_back_as_the_user_built_it_after_fit",),
           "after fit the optimizer keeps capturable=True and device-tensor learning rates"),
    Mutant("scheduled-hyperparameter-not-refused", "cpu", ADAPTER,
           "        if self._hp_changes > _MAX_HP_RECAPTURES:",
           "        if False:",
           (LT + "test_a_baked_hyperparameter_scheduled_every_step_is_refused_after_two_recaptures",),
           "a hyperparameter baked into the graph and changed every step is re-captured every step, never refused"),
    # -- module state baked into a graph ------------------------------------------------------
    Mutant("module-guard-ignores-changes", "cpu", MSTATE,
           "            ):\n                return None\n        except Exception:",
           "            ) or True:\n                return None\n        except Exception:",
           (LT + "test_module_state_changed_after_capture_is_followed_like_eager[dropout-p]",
            LT + "test_module_state_changed_after_capture_is_followed_like_eager[submodule-eval]"),
           "a Dropout.p or train/eval mode changed after capture is replayed with the captured value, silently"),
    Mutant("module-watch-keeps-modules-with-nothing-to-watch", "cpu", MSTATE,
           "if type(m) not in _STATELESS and (keys := _watched_keys(m))]",
           "if type(m) not in _STATELESS and ((keys := _watched_keys(m)) or True)]",
           ("tests/test_core.py::test_module_state_watch_takes_a_compiled_submodule_and_names_it_as_the_user_does",
            LT + "test_torch_compiled_submodule_is_graphed_and_equals_eager[aot_eager]"),
           "a torch.compile'd submodule (no plain value of its own) crashes the callback at on_train_start"),
    Mutant("module-watch-names-the-compile-wrapper", "cpu", MSTATE,
           'return ".".join(part for part in name.split(".") if part != "_orig_mod") if "_orig_mod" in name else name',
           "return name",
           ("tests/test_core.py::test_module_state_watch_takes_a_compiled_submodule_and_names_it_as_the_user_does",),
           "a change inside a compiled submodule is reported under torch's internal `_orig_mod` name"),
    Mutant("hf-mask-asks-the-host", "cpu", "nemo_cudagraph_plugin/hf.py",
           '        kwargs["allow_is_causal_skip"] = False',
           "        pass",
           ("tests/test_hf_cpu.py::test_right_padded_batches_are_graphed_and_train_as_the_unmodified_eager_model",),
           "the graph-safe HF mask builder still reads the attention_mask on the host: padded batches are refused"),
    Mutant("hf-attention-never-switched", "cpu", RUNNER,
           'if self.config.hf_attention == "graph_safe" and (switched := graph_safe_attention(pl_module)):',
           'if False and (switched := graph_safe_attention(pl_module)):',
           ("tests/test_hf_cpu.py::test_right_padded_batches_are_graphed_and_train_as_the_unmodified_eager_model",),
           "the callback leaves HF models on 'sdpa': padded batches are refused"),
    Mutant("hf-attention-not-given-back", "cpu", RUNNER,
           "            self._undo.callback(restore_attention, pl_module, switched)",
           "            pass",
           ("tests/test_hf_cpu.py::test_right_padded_batches_are_graphed_and_train_as_the_unmodified_eager_model",),
           "HF models stay on the graph-safe attention after fit"),
    Mutant("library-site-fix-not-named", "cpu", "nemo_cudagraph_plugin/core/errors.py",
           "        if known is not None:\n            did, fix = known",
           "        if known is not None:\n            pass",
           ("tests/test_hf_cpu.py::test_hf_attention_as_is_refuses_at_hfs_line_and_says_what_to_change",
            "tests/test_hf_cpu.py::test_hf_experts_as_is_refuses_the_eager_experts_at_hfs_line_and_says_what_to_change"),
           "a refusal inside HF's mask builder or MoE routing gives the generic host-sync fix, not what to change"),
    # -- transformers 5: unmasked calls and mixture-of-experts layers -----------------------------------------------
    Mutant("hf-unmasked-calls-ask-the-host", "cpu", "nemo_cudagraph_plugin/hf.py",
           "    return _major_version() >= 5\n",
           "    return False\n",
           ("tests/test_hf_cpu.py::test_unpadded_batches_without_a_mask_are_graphed_and_train_as_the_unmodified_eager_model",),
           "transformers 5 asks the host whether its own position ids pack sequences: unmasked batches are refused"),
    Mutant("hf-ones-mask-kept-as-a-mask", "cpu", "nemo_cudagraph_plugin/hf.py",
           "    if _ONES_FOR_NO_MASK and _ONES_FOR_NO_MASK[-1]:\n",
           "    if False:\n",
           ("tests/test_hf_cpu.py::test_a_call_without_a_mask_keeps_sdpas_is_causal_as_the_unmodified_model",),
           "the mask of ones stays a mask: SDPA with a mask instead of is_causal"),
    Mutant("hf-ones-mask-only-when-not-compiling", "cpu", "nemo_cudagraph_plugin/hf.py",
           "    if len(args) > 1:  # the model called",
           "    if torch.compiler.is_compiling():\n        return None\n    if len(args) > 1:  # the model called",
           ("tests/test_hf_cpu.py::test_a_compiled_model_that_dynamo_runs_eagerly_never_asks_about_packing",),
           "a compiled model's code that dynamo runs eagerly (recompile limit, graph breaks) asks the host about packing"),
    Mutant("hf-experts-never-switched", "cpu", "nemo_cudagraph_plugin/hf.py",
           '        if current in ("eager", "grouped_mm", "batched_mm"):\n',
           "        if current in ():\n",
           ("tests/test_hf_cpu.py::test_graph_safe_experts_switches_every_hf_implementation_and_restore_gives_each_back",
            "tests/test_hf_cpu.py::test_moe_models_train_graphed_with_the_experts_switched_for_the_fit_and_given_back[mixtral]"),
           "MoE models keep their own experts: the FP32 grouped GEMM and the eager experts read the host"),
    Mutant("hf-experts-not-given-back", "cpu", RUNNER,
           "            self._undo.callback(restore_experts, pl_module, experts)",
           "            pass",
           ("tests/test_hf_cpu.py::test_moe_models_train_graphed_with_the_experts_switched_for_the_fit_and_given_back[mixtral]",),
           "MoE models keep the graph-safe experts after fit"),
    Mutant("hf-experts-weights-not-cast", "cpu", "nemo_cudagraph_plugin/hf.py",
           "                if isinstance(w, torch.Tensor) and w.dtype != dtype:\n",
           "                if False:\n",
           ("tests/test_hf_cpu.py::test_graph_safe_experts_run_their_gemms_in_the_autocast_dtype_and_train_fp32_weights",),
           "the experts' GEMMs run on the FP32 weights under autocast: torch's FP32 grouped GEMM copies from the host"),
    Mutant("hf-packing-site-named-as-padding", "cpu", "nemo_cudagraph_plugin/core/errors.py",
           '                 if re.search(pattern, path) and fn in ("", function)), None)',
           '                 if re.search(pattern, path) and fn in ("",)), None)',
           ("tests/test_hf_cpu.py::test_position_ids_without_a_mask_are_refused_naming_hfs_packing_question",),
           "position_ids passed without a mask are refused with the padding mask's message, not what to pass"),
    Mutant("compile-with-cuda-graphs-not-refused", "cpu", "nemo_cudagraph_plugin/core/_torch_compat.py",
           '        if config is not None and config.get("triton.cudagraphs"):',
           "        if False:",
           (LT + "test_torch_compile_with_its_own_cuda_graphs_is_refused_before_the_first_step[compile_kw0]",),
           "torch.compile(mode='reduce-overhead') inside the step fails at capture in inductor's generated code"),
    Mutant("module-guard-skips-requires-grad", "cpu", MSTATE,
           "            if list(map(call, self._getters, self._dicts)) == self._values and (\n"
           "                list(map(_requires_grad, self._params)) == self._grads\n            ):",
           "            if list(map(call, self._getters, self._dicts)) == self._values:",
           (LT + "test_module_state_changed_after_capture_is_followed_like_eager[requires-grad-off]",),
           "layers frozen after capture keep being trained by the replayed graph"),
    Mutant("frozen-grads-kept", "cpu", ADAPTER,
           "            if not p.requires_grad:\n                p.grad = None",
           "            if not p.requires_grad:\n                pass",
           (LT + "test_module_state_changed_after_capture_is_followed_like_eager[requires-grad-off-k2]",
            LT + "test_module_state_changed_after_capture_is_followed_like_eager[requires-grad-off-k3-mid-window]"),
           "a frozen parameter keeps a zeroed gradient in accumulating steps, so AdamW still moves it"),
    Mutant("frozen-grads-dropped-mid-window", "cpu", ADAPTER,
           "            if self._drop_grads and self._key.zero_grad:\n                self._drop_frozen_grads()",
           "            if self._drop_grads:\n                self._drop_frozen_grads()",
           (LT + "test_module_state_changed_after_capture_is_followed_like_eager[requires-grad-off-k3-mid-window]",),
           "frozen mid-window, the window's gradients of those parameters are dropped before eager would apply them"),
    Mutant("trainable-set-not-followed", "cpu", ADAPTER,
           "            self._set_trainable(trainable)\n        # (the partial tier",
           "            pass\n        # (the partial tier",
           (LT + "test_layers_unfrozen_with_a_new_param_group_are_trained_and_checked_like_eager",),
           "layers unfrozen during training are not checked by the NaN guard"),
    Mutant("new-param-group-not-prepared", "cpu", OPTIM,
           "        if len(self.optimizer.param_groups) != len(self._saved):",
           "        if False:",
           (LT + "test_layers_unfrozen_with_a_new_param_group_are_trained_and_checked_like_eager",),
           "a param group added during training keeps a float learning rate baked into the graph"),
    Mutant("module-state-schedule-not-refused", "cpu", ADAPTER,
           "        if self._rapid > _MAX_RAPID_MODULE_CHANGES:",
           "        if False:",
           (LT + "test_module_state_changed_every_step_is_refused_naming_it",),
           "a module value changed every step makes every step eager + capture, silently"),
    Mutant("module-state-not-rebased-after-step", "cpu", ADAPTER,
           "        self.modules.rebase()\n",
           "",
           (LT + "test_module_attribute_set_inside_the_step_does_not_recapture",),
           "an attribute the step's own Python sets is taken for a user's change: a re-capture after every capture"),
    # -- the NaN guard reading the clipping norms ---------------------------------------------
    Mutant("norm-tap-marks-nothing", "cpu", NAN,
           "        torch.where(bad.any(), bad, stacked.sub(stacked), out=bad)\n        return True",
           "        return True",
           (LT + "test_nan_guard_names_the_parameter_when_gradients_are_clipped[norm]",),
           "clipping by norm: a NaN gradient goes unreported (the guard trusts norms it never marked)"),
    Mutant("norm-tap-needs-every-gradient", "cpu", NAN,
           "        else:  # parameters without a gradient this step: a zero norm in their slot\n",
           "        else:  # parameters without a gradient this step: a zero norm in their slot\n            return False\n",
           (LT + "test_clipping_norms_cover_a_step_where_some_parameters_have_no_gradient",),
           "a parameter without a gradient makes the guard read every gradient again despite the clipping norms"),
    Mutant("norm-tap-after-clip", "cpu", NAN,
           "        with self.guard.norm_tap() as tap:\n            out = clip(*args, **kwargs)\n"
           "        if not tap.covered:",
           "        out = clip(*args, **kwargs)\n        with self.guard.norm_tap() as tap:\n            pass\n"
           "        if not tap.covered:",
           (LT + "test_nan_guard_names_the_parameter_when_gradients_are_clipped[norm]",),
           "the gradients are read after the NaN clip factor spoiled all of them: every parameter is named"),
    Mutant("deferred-check-dropped", "cpu", NAN,
           "            self._defer = False\n            self.guard.observe_grads()\n",
           "            self._defer = False\n",
           (LT + "test_nan_guard_names_the_parameter_when_gradients_are_clipped[norm-not-run]",),
           "a check deferred to clipping that never ran is lost: no gradient check at all"),
    Mutant("loss-watch-never-disarms", "cpu", FINITE,
           "            state[-1, 0].copy_(torch.where(fire, nxt, stage))\n",
           "            pass\n",
           ("tests/test_core.py::test_nan_guard_loss_watch_reads_the_parameters_at_the_first_non_finite_loss_only",
            LT + "test_nan_guard_names_the_parameter_when_its_read_comes_long_after_the_bad_step[None]"),
           "every non-finite loss counts the parameters again: a read after the NaN spread names every parameter"),
    Mutant("loss-watch-no-second-count", "cpu", FINITE,
           "            nxt = torch.where((stage == 2) & (found == 0), 1.0, 0.0)\n",
           "            nxt = torch.where((stage == 2) & (found == 0), 0.0, 0.0)\n",
           ("tests/test_core.py::test_nan_guard_loss_watch_reads_the_parameters_at_the_first_non_finite_loss_only",),
           "a loss that went bad first (every parameter finite) names nothing, not what that step's update spoiled"),
    Mutant("read-scans-after-the-watch-fired", "cpu", NAN,
           "        check.watch(self.grad_bad, self._nan, self._scratch, state)\n",
           "        check.run(self.grad_bad)\n",
           ("tests/test_core.py::test_nan_guard_loss_watch_reads_the_parameters_at_the_first_non_finite_loss_only",
            LT + "test_nan_guard_names_the_parameter_when_its_read_comes_long_after_the_bad_step[None]"),
           "a read scans the parameters although a non-finite loss was watched: it names every parameter spoiled since"),
    Mutant("read-builds-its-own-watch", "cpu", NAN,
           "        triton = (cur[0][1] if cur is not None and cur[0][0] == ptrs else True) if loss is None else "
           "FiniteCheck.can_watch(loss)",
           "        triton = loss is None or FiniteCheck.can_watch(loss)",
           ("tests/test_core.py::test_nan_guard_read_keeps_the_watch_of_a_float64_loss",),
           "a read builds a fresh, armed watch instead of the one the steps used (a float64 loss): it counts every "
           "parameter the NaN spread to"),
    Mutant("loss-watch-not-re-armed", "cpu", NAN,
           "            arm(self._param_check[2])",
           "            pass",
           ("tests/test_core.py::test_nan_guard_loss_watch_reads_the_parameters_at_the_first_non_finite_loss_only",),
           "after a read the watch stays disarmed: a later window's NaN names nothing"),
    Mutant("loss-not-watched", "cpu", NAN,
           "        if (self.may_watch and self.may_defer",
           "        if (False and self.may_defer",
           (LT + "test_nan_guard_names_the_parameter_when_its_read_comes_long_after_the_bad_step[None]",),
           "the guard reads every gradient each step instead of watching the loss: the read names the first of every "
           "parameter the NaN spread to"),
    Mutant("watched-step-reads-gradients", "cpu", NAN,
           "            guard.scan_params = True  # a bad gradient stays in its own parameter: the reads scan them\n"
           "            return\n",
           "            guard.scan_params = True\n",
           (LT + "test_nan_guard_names_the_parameter_when_its_read_comes_long_after_the_bad_step[None]",),
           "a watched step still reads every gradient (the per-step cost the watch removes)"),
    Mutant("loss-watched-despite-clipping", "cpu", NAN,
           "                and not clips and isinstance(loss, Tensor)):",
           "                and isinstance(loss, Tensor)):",
           (LT + "test_nan_guard_names_the_parameter_when_gradients_are_clipped[norm]",),
           "with clipping the loss is watched and no gradient read: the NaN clip factor spoils every parameter in the "
           "bad step itself, so every parameter is named"),
    Mutant("deferred-despite-own-clipping", "cpu", RUNNER,
           "                default_clipping=hook is pl.LightningModule.configure_gradient_clipping,",
           "                default_clipping=True,",
           (LT + "test_nan_guard_names_the_parameter_when_gradients_are_clipped[norm-overridden]",),
           "a module's own value clip runs before the deferred check and turns an Inf gradient into a number"),
    Mutant("ptx-copy-loop-start-left-a-template", "cpu", NODES,
           '_PTX = _PTX_HEAD + _PTX_COPY.replace("{grid}", _grid_stride("%rd5", "%rd6", "%rd7")) + "".join(',
           '_PTX = _PTX_HEAD + _PTX_COPY + "".join(',
           ("tests/test_core.py::test_memset_fill_plans_write_exactly_the_bytes_of_the_memset_and_say_which_they_cannot",),
           "the copy kernel's PTX keeps its {grid} placeholder: only the driver would refuse it, on a GPU"),
    Mutant("tap-marks-every-step", "cpu", NAN,
           "        torch.where(bad.any(), bad, stacked.sub(stacked), out=bad)",
           "        bad.add_(stacked.sub(stacked))",
           (LT + "test_nan_guard_names_the_parameter_when_its_read_comes_long_after_the_bad_step[norm]",),
           "the clipping norms mark every step of the window: a read after the NaN clip factor spread names the first "
           "of every parameter"),
    Mutant("tap-marks-every-step-cuda", "gpu", NAN,
           "        torch.where(bad.any(), bad, stacked.sub(stacked), out=bad)",
           "        bad.add_(stacked.sub(stacked))",
           ("tests/gpu/test_capture_gpu.py::test_nan_guard_with_clipping_names_parameter_long_after_the_bad_step[all-grads]",
            "tests/gpu/test_capture_gpu.py::test_nan_guard_with_clipping_names_parameter_long_after_the_bad_step[a-param-without-grad]"),
           "on the GPU (torch._foreach_norm, in a replayed graph): the clipping norms mark every step of the window"),
    # -- the loss's division by accumulate_grad_batches == 1 left out of the step ------------------
    Mutant("undivided-at-k-above-1", "cpu", COMPAT,
           "        if normalize == 1:\n            mapping",
           "        if normalize >= 1:\n            mapping",
           (LT + "test_the_loss_is_not_divided_by_one_inside_the_step_and_training_equals_eager[2]",
            LT + "test_undivided_closure_result_is_lightnings_own_except_the_division_by_one"),
           "the loss is not divided by accumulate_grad_batches = 2 either: gradients twice eager's"),
    Mutant("undivided-integer-loss", "cpu", COMPAT,
           "            if isinstance(loss, torch.Tensor) and loss.is_floating_point():",
           "            if isinstance(loss, torch.Tensor):",
           (LT + "test_undivided_closure_result_is_lightnings_own_except_the_division_by_one",),
           "an integer loss is handed on as it is, where Lightning's division makes it a float"),
    Mutant("undivided-not-installed", "cpu", RUNNER,
           "        undo_divide = _compat.undivided_loss(self._loop)",
           "        undo_divide = None",
           (LT + "test_the_loss_is_not_divided_by_one_inside_the_step_and_training_equals_eager[1]",),
           "every captured step keeps Lightning's two division kernels of the loss by 1"),
    Mutant("undivided-not-undone", "cpu", COMPAT,
           "        if loop.__dict__.get(\"output_result_cls\") is _UndividedClosureResult:\n            del loop.output_result_cls",
           "        if loop.__dict__.get(\"output_result_cls\") is _UndividedClosureResult:\n            pass",
           (LT + "test_the_loss_is_not_divided_by_one_inside_the_step_and_training_equals_eager[1]",),
           "the trainer's loop keeps the runner's result class after fit"),
    # -- fast_adam: the capturable Adam update with one bias-correction scalar per group -------------------------------
    Mutant("fast-adam-skips-eps", "cpu", ADAM,
           "    torch._foreach_add_(denom, eps)\n",
           "",
           (AS + "test_the_group_scalar_update_is_torchs_capturable_step_bit_for_bit[adamw]",
            LT + "test_fast_adam_captures_the_group_scalar_update_and_trains_as_eager_bit_for_bit[same-counters]"),
           "the group-scalar update leaves eps out of the denominator"),
    Mutant("fast-adam-trusts-unequal-counters", "cpu", ADAM,
           "                equal = i < len(self._equal) and self._equal[i]",
           "                equal = True",
           (AS + "test_a_group_whose_counters_differ_is_updated_by_torch_and_stays_exact",
            LT + "test_fast_adam_captures_the_group_scalar_update_and_trains_as_eager_bit_for_bit[late-parameter]"),
           "a group whose parameters took different numbers of steps gets the first one's bias corrections"),
    Mutant("fast-adam-ignores-new-states", "cpu", ADAM,
           "new in (0, len(stepping))",
           "True",
           (AS + "test_a_step_that_creates_some_states_of_a_group_but_not_all_is_left_to_torch",),
           "a step that creates some parameters' state gives them the group's (older) bias corrections"),
    Mutant("fast-adam-divides-per-parameter", "cpu", ADAM,
           "    torch._foreach_div_(denom, bias_correction2_sqrt)",
           "    torch._foreach_div_(denom, [bias_correction2_sqrt] * len(denom))",
           (AS + "test_it_divides_the_moments_by_one_tensor_per_group_where_torch_divides_by_one_per_parameter",),
           "the group-scalar update divides by a list of 0-d tensors again (one kernel per parameter on CUDA)"),
    Mutant("fast-adam-drops-scheduler-wrapper", "cpu", ADAM,
           "            if own is _ABSENT:\n                opt.__dict__.pop(\"step\", None)\n            else:\n"
           "                opt.step = own",
           "            opt.__dict__.pop(\"step\", None)",
           (LT + "test_fast_adam_with_an_lr_scheduler_trains_as_eager_and_gives_the_scheduler_its_step_wrapper_back",),
           "after a capture the optimizer loses the step wrapper its LR scheduler put on it"),
    Mutant("adam-tail-skips-eps", "cpu", TAIL,
           "tl.math.sqrt_rn(tl.load(v + offs, mask=mask, other=1.0)), bc2s) + eps, step_size)",
           "tl.math.sqrt_rn(tl.load(v + offs, mask=mask, other=1.0)), bc2s), step_size)",
           (ATL + "test_each_element_is_torchs_five_operations_rounded_as_torch_rounds_them",),
           "the fused tail leaves eps out of the denominator of a tensor's last chunk"),
    Mutant("adam-tail-writes-past-the-end", "cpu", TAIL,
           "                mask = offs < numel\n",
           "                mask = offs <= numel\n",
           (ATL + "test_each_element_is_torchs_five_operations_rounded_as_torch_rounds_them",),
           "the fused tail writes one element past the end of each tensor"),
    Mutant("adam-tail-chunks-from-zero", "cpu", TAIL,
           "        start = (c - tl.load(table + 4 * n_tensors + t)) * (BLOCK * ITERS)  # int64",
           "        start = c * 0 * (BLOCK * ITERS)  # int64",
           (ATL + "test_each_element_is_torchs_five_operations_rounded_as_torch_rounds_them",),
           "every program of the fused tail updates its tensor's first chunk"),
    Mutant("fast-adam-not-installed", "cpu", ADAPTER,
           "                self._contexts.append(self.fast_adam.during_capture)\n",
           "",
           (LT + "test_fast_adam_captures_the_group_scalar_update_and_trains_as_eager_bit_for_bit[same-counters]",),
           "fast_adam=True captures torch's own step"),
    Mutant("fast-adam-off-by-default", "cpu", "nemo_cudagraph_plugin/core/config.py",
           "    fast_adam: bool = True\n",
           "    fast_adam: bool = False\n",
           (LT + "test_fast_adam_is_on_by_default",),
           "fast_adam is off unless asked for"),
    Mutant("fast-adam-reports-on-any-optimizer", "cpu", ADAPTER,
           "            if self.config.fast_adam and isinstance(optimizer, torch.optim.Adam) and self.prep.user is None:",
           "            if self.config.fast_adam and self.prep.user is None:",
           (LT + "test_fast_adam_says_nothing_about_an_optimizer_that_is_not_adam",),
           "fast_adam's default names every optimizer that is not Adam as a reason it was not used"),
    # -- optimizer_math="eager": the user's own Adam/AdamW update, its host scalars read from the device ----------------
    Mutant("user-adam-step-size-in-float32", "cpu", UADAM,
           " else ((lr / row[0]) * -1).to(torch.float32)",
           " else (lr.float() / row[0].float()) * -1",
           (UA + "test_device_scalars_are_torchs_host_scalars_bit_for_bit_over_a_million_steps[0.9-0.999-0.001-0.01]",
            UA + "test_a_graphed_fit_with_the_users_adamw_equals_their_eager_fit_bitwise[adamw-foreach]"),
           "the step size is computed in float32 on the device instead of the host's float64"),
    Mutant("user-adam-decay-in-float32", "cpu", UADAM,
           "    return (1 - lr * weight_decay).to(torch.float32)",
           "    return 1 - lr.float() * weight_decay",
           (UA + "test_the_decay_factor_is_the_hosts_double_rounded_once_to_float32",
            UA + "test_the_update_is_the_users_eager_step_bit_for_bit[AdamW-True-False-False-0.1]"),
           "AdamW's decay factor 1 - lr * wd is computed in float32 instead of the host's float64"),
    Mutant("user-adam-lr-not-synced", "cpu", UADAM,
           "                g.lr.fill_(float(lr))\n",
           "                pass\n",
           (UA + "test_a_graphed_fit_with_the_users_adamw_equals_their_eager_fit_bitwise[adamw-foreach]",),
           "a scheduler's float lr never reaches the device: graphs keep the first lr"),
    Mutant("eager-tail-two-roundings", "cpu", TAIL,
           "            new = tl.math.fma(s, q, tl.load(p + offs, mask=mask, other=0.0).to(tl.float32))",
           "            new = s * q + tl.load(p + offs, mask=mask, other=0.0).to(tl.float32)",
           (UA + "test_the_eager_tail_kernel_rounds_as_torchs_cuda_addcdiv",),
           "the eager tail rounds s * q before adding it (torch's CUDA addcdiv is one FMA); in the interpreter"),
    Mutant("user-sgd-two-roundings", "cpu", USGD,
           "            p.copy_(fma_f32(g, alpha, p))",
           "            p.add_(g * alpha)",
           (US + "test_the_update_is_the_users_eager_sgd_step_bit_for_bit[foreach=True-momentum=0.9-dampening=0.0-"
                 "nesterov=True-weight_decay=0.01-maximize=False]",
            US + "test_the_update_is_the_users_eager_sgd_step_bit_for_bit[foreach=False-momentum=0.9-dampening=0.1-"
                 "nesterov=False-weight_decay=0.0-maximize=False]"),
           "SGD's p + alpha * g rounds the product and the sum (torch's kernels: one FMA)"),
    Mutant("fma-f32-double-rounding", "cpu", USGD,
           "    return torch.where(inexact_even, torch.nextafter(s, toward), s).to(torch.float32)",
           "    return s.to(torch.float32)",
           (US + "test_fma_f32_rounds_once_where_a_float64_sum_would_round_twice",),
           "the float32 FMA rounds the float64 sum to nearest, then to float32: two roundings at a midpoint"),
    Mutant("user-sgd-lr-not-synced", "cpu", USGD,
           "                g.tensor.fill_(float(lr))\n",
           "                pass\n",
           (US + "test_a_graphed_fit_with_the_users_sgd_equals_their_eager_fit_bitwise[sgd-foreach-momentum]",),
           "a scheduler's float lr never reaches SGD's device lr: graphs keep the first lr"),
    Mutant("user-sgd-alpha-rounded-before-negation-as-bf16", "cpu", USGD,
           "    add_scaled(params, grads, (-lr).to(torch.float32), tail)",
           "    add_scaled(params, grads, (-lr).to(torch.bfloat16).float(), tail)",
           (US + "test_the_update_is_the_users_eager_sgd_step_bit_for_bit[foreach=True-momentum=0.9-dampening=0.0-"
                 "nesterov=True-weight_decay=0.01-maximize=False]",),
           "SGD's alpha is not the float32 a Python -lr becomes"),
    Mutant("sgd-tail-two-roundings", "cpu", TAIL,
           "            tl.store(p + offs, tl.math.fma(tl.load(g + offs, mask=mask, other=0.0), alpha, x), mask=mask)",
           "            tl.store(p + offs, x + tl.load(g + offs, mask=mask, other=0.0) * alpha, mask=mask)",
           (US + "test_the_sgd_tail_kernel_rounds_as_torchs_add_with_alpha",),
           "the SGD kernel multiplies and adds with two roundings (torch's CUDA add with alpha: one FMA)"),
    Mutant("sgd-tail-bf16-truncates", "cpu", TAIL,
           "                u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # RNE of the SGD update",
           "                u = u & 0xFFFF0000",
           (US + "test_the_sgd_tail_kernel_on_bf16_rounds_as_torchs_cuda_add_with_alpha",),
           "the SGD kernel truncates BFloat16 parameters' update instead of rounding to nearest even; in the "
           "interpreter"),
    Mutant("user-sgd-bf16-cpu-truncates", "cpu", USGD,
           "    return torch.where(x.isnan(), nan, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)",
           "    return torch.where(x.isnan(), nan, u >> 16)",
           (US + "test_torchs_cpu_add_of_bf16_with_alpha_is_mirrored_bit_for_bit",
            US + "test_the_update_of_bf16_parameters_is_the_users_eager_sgd_step_bit_for_bit[foreach=True-momentum=0.9-"
                 "dampening=0.0-nesterov=True-weight_decay=0.01-maximize=False]"),
           "the CPU mirror of torch's BFloat16 add truncates to BFloat16 instead of rounding to nearest even"),
    Mutant("user-sgd-bf16-cpu-alpha-float32", "cpu", USGD,
           "    a = _as_bf16(_bf16_bits(alpha.to(torch.float32), NAN_SCALAR)).float()",
           "    a = alpha.to(torch.float32)",
           (US + "test_torchs_cpu_add_of_bf16_with_alpha_is_mirrored_bit_for_bit",
            US + "test_the_update_of_bf16_parameters_is_the_users_eager_sgd_step_bit_for_bit[foreach=False-momentum=0.0-"
                 "dampening=0.0-nesterov=False-weight_decay=0.0-maximize=False]"),
           "the CPU mirror of torch's BFloat16 add keeps alpha in float32 (torch's CPU kernel rounds it to BFloat16)"),
    Mutant("bf16-tail-float32-denominator", "cpu", TAIL,
           "            if ROUND:  # each rounded to BFloat16 as the bits of a float32 (see RNE below)",
           "            if False:",
           (UA + "test_the_eager_tail_and_scale_kernels_on_bf16_round_each_operation_as_torchs_cuda_kernels",),
           "the BFloat16 denominator is kept in float32 (torch stores sqrt, / and + eps as BFloat16 each)"),
    Mutant("bf16-rne-truncates", "cpu", TAIL,
           "            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # RNE, as in the Adam tail",
           "            u = u & 0xFFFF0000",
           (UA + "test_the_eager_tail_and_scale_kernels_on_bf16_round_each_operation_as_torchs_cuda_kernels",),
           "the BFloat16 decay truncates instead of rounding to nearest even"),
    Mutant("bf16-decay-factor-rounded-to-bf16", "cpu", TAIL,
           "            x = tl.load(p + offs, mask=mask, other=0.0).to(tl.float32) * f",
           "            x = tl.load(p + offs, mask=mask, other=0.0).to(tl.float32) * f.to(tl.bfloat16).to(tl.float32)",
           (UA + "test_the_eager_tail_and_scale_kernels_on_bf16_round_each_operation_as_torchs_cuda_kernels",),
           "AdamW's decay factor is rounded to BFloat16 (what CUDA's mul_ with a float32 0-d tensor does)"),
    Mutant("user-adam-cpu-addcdiv-in-bf16", "cpu", UADAM,
           "        p.copy_(p.float() + (s * m.float()) / d.float())",
           "        p.add_((s * m) / d)",
           (UA + "test_the_update_of_bf16_parameters_is_the_users_eager_step_bit_for_bit[AdamW-True-False-False-0.1]",),
           "the CPU update of BFloat16 parameters rounds s * m and / d to BFloat16 (torch: float32, stored once)"),
    Mutant("user-adam-fused-false-is-foreach", "cpu", "nemo_cudagraph_plugin/core/_torch_compat.py",
           '    if foreach is None and group.get("fused") is None:\n',
           '    if foreach is None:\n',
           (US + "test_adam_with_fused_false_and_foreach_unset_runs_the_for_loop_update_on_cuda",),
           "AdamW(fused=False) with foreach unset counts as multi-tensor on CUDA (torch runs its for-loop update)"),
    Mutant("eager-tail-for-loop-divides", "cpu", TAIL,
           "                d = tl.math.sqrt_rn(d) * bc2s + eps  # the reciprocal",
           "                d = tl.math.div_rn(tl.math.sqrt_rn(d), tl.math.div_rn(1.0, bc2s)) + eps  # the reciprocal",
           (UA + "test_the_for_loop_denominator_multiplies_by_the_reciprocal_as_torchs_cuda_division[float32]",),
           "the for-loop denominator divides (torch's CUDA division by a Python float multiplies by a reciprocal); "
           "in the interpreter"),
    Mutant("eager-tail-for-loop-bf16-reciprocal-rounded", "cpu", TAIL,
           "                    d = d * bc2s  # RECIP: bc2s holds the reciprocal",
           "                    d = d * bc2s.to(tl.bfloat16).to(tl.float32)  # RECIP: bc2s holds the reciprocal",
           (UA + "test_the_for_loop_denominator_multiplies_by_the_reciprocal_as_torchs_cuda_division[bf16]",),
           "the for-loop denominator of BFloat16 tensors multiplies by the reciprocal rounded to BFloat16 (torch's "
           "CUDA kernel keeps it in float32, the opmath type); in the interpreter"),
    Mutant("for-loop-reciprocal-in-float32", "cpu", "nemo_cudagraph_plugin/core/user_adam.py",
           "        return (1.0 / divisor).to(dtype)\n",
           "        return 1.0 / divisor.to(torch.float32)\n",
           (UA + "test_the_for_loop_reciprocal_is_formed_in_double_or_in_float32_as_asked_bit_for_bit",),
           "the reciprocal torch 2.11 forms in double is formed in float32 (off by one unit in the last place for "
           "some steps)"),
    Mutant("for-loop-reciprocal-not-passed", "cpu", "nemo_cudagraph_plugin/core/user_adam.py",
           '    multiplies = kind in ("double", "float32")\n',
           "    multiplies = False\n",
           (UA + "test_warm_compiles_every_kernel_variant_the_update_launches",),
           "the for-loop update on CUDA divides by bias_correction2_sqrt instead of multiplying by the reciprocal"),
    Mutant("unknown-division-still-claims-the-users-math", "cpu", "nemo_cudagraph_plugin/core/user_adam.py",
           "        if scalar_division(device) is None:\n",
           "        if False:\n",
           (UA + "test_the_for_loop_update_on_cuda_keeps_the_users_math",),
           "a for-loop update whose CUDA division is of no known form still claims the user's own math"),
    Mutant("tensor-lr-step-size-in-double", "cpu", "nemo_cudagraph_plugin/core/user_adam.py",
           "        return (-divided(self.value.expand(bias_correction1.shape), bias_correction1, self.division)).to(torch.float32)\n",
           "        return (-(self.value.double() / bias_correction1)).to(torch.float32)\n",
           (UA + "test_a_tensor_lr_update_is_the_users_eager_for_loop_step_bit_for_bit",),
           "a tensor lr's step size computed as a float lr's (in double), not as torch's tensor division in its dtype"),
    Mutant("tensor-lr-decay-factor-in-double", "cpu", "nemo_cudagraph_plugin/core/user_adam.py",
           "        return 1 - self.value * weight_decay\n",
           "        return (1 - self.value.double() * weight_decay).to(self.value.dtype)\n",
           (UA + "test_a_tensor_lrs_decay_factor_is_torchs_tensor_arithmetic_in_its_dtype",),
           "a tensor lr's AdamW decay factor computed in double, not with torch's tensor operations in its dtype"),
    Mutant("tensor-lr-copy-filled-once", "cpu", "nemo_cudagraph_plugin/core/user_adam.py",
           "                    changed = f\"param group {i}: lr is now a {lr.dtype} tensor on {lr.device.type}\"\n"
           "                g.tensor_lr.fill(lr, group[\"weight_decay\"])\n",
           "                    changed = f\"param group {i}: lr is now a {lr.dtype} tensor on {lr.device.type}\"\n"
           "                    g.tensor_lr.fill(lr, group[\"weight_decay\"])\n",
           (UA + "test_a_tensor_lr_update_is_the_users_eager_for_loop_step_bit_for_bit",),
           "a tensor lr is copied when it first appears only: a schedule's in-place writes never reach the graph"),
    Mutant("tensor-lr-host-factor-kept", "cpu", "nemo_cudagraph_plugin/core/user_adam.py",
           "            if key != self._host:\n",
           "            if self._host is None:\n",
           (UA + "test_a_host_tensor_lr_with_gpu_parameters_computes_its_decay_factor_as_the_cpu_does",),
           "a host tensor lr's decay factor is computed once: a new lr keeps the first factor"),
    Mutant("runs-foreach-ignores-a-tensor-lr", "cpu", "nemo_cudagraph_plugin/core/_torch_compat.py",
           "        tensor_lr = adam and isinstance(group.get(\"lr\"), Tensor) and not group.get(\"capturable\")\n",
           "        tensor_lr = False\n",
           (UA + "test_torchs_adam_runs_its_for_loop_update_for_a_tensor_lr_where_foreach_is_unset",),
           "a tensor lr with foreach unset counts as the multi-tensor update on CUDA (torch runs its for-loop)"),
    Mutant("tensor-lr-kind-change-not-recaptured", "cpu", "nemo_cudagraph_plugin/core/user_adam.py",
           "                    changed = f\"param group {i}: lr is now a {lr.dtype} tensor on {lr.device.type}\"\n",
           "                    pass\n",
           (UA + "test_a_tensor_lr_that_changes_kind_asks_for_a_new_capture",),
           "a tensor lr of another dtype or place is followed without a new capture (the graph holds the old ops)"),
    Mutant("tensor-lr-odd-tensor-accepted", "cpu", "nemo_cudagraph_plugin/core/user_adam.py",
           "    if lr.numel() != 1 or lr.dtype not in (torch.float32, torch.float64) or lr.requires_grad:\n",
           "    if False:\n",
           (UA + "test_a_tensor_lr_keeps_the_capturable_math_where_torch_does_not_run_the_for_loop_or_the_tensor_is_odd",),
           "a BFloat16 or differentiable tensor lr is claimed to get the user's math"),
    Mutant("division-probe-takes-the-first-match", "cpu", "nemo_cudagraph_plugin/core/_torch_compat.py",
           "    return found[0] if len(found) == 1 else None\n",
           '    return found[0] if found else "double"\n',
           (UA + "test_the_division_probe_names_each_form_of_torchs_division_by_a_python_float",),
           "a division of a kind not known is taken for the double reciprocal"),
    Mutant("eager-tail-for-loop-not-warmed", "cpu", TAIL,
           "            for reciprocal in (False, True):\n",
           "            for reciprocal in (False,):\n",
           (UA + "test_warm_compiles_every_kernel_variant_the_update_launches",),
           "the warm-up leaves the for-loop variant of the eager tail to be compiled by the first capture"),
    Mutant("optimizer-gap-measures-the-graphed-math", "cpu", OPTIM,
           "                group[k] = v\n",
           "                pass\n",
           (US + "test_where_the_math_differs_the_first_verified_step_measures_by_how_much",
            US + "test_the_users_settings_are_back_only_inside_the_block"),
           "the second eager step of verify_steps runs the prepared optimizer, not the user's: a gap of 0"),
    Mutant("optimizer-gap-forgets-the-schedulers-double", "cpu", OPTIM,
           "        self.assigned = value if not isinstance(value, Tensor) else None",
           "        self.assigned = None",
           (US + "test_the_users_settings_are_back_only_inside_the_block",),
           "the user's step is measured with the float32 lr the device holds, not the scheduler's double"),
    # -- the user's fused Adam/AdamW: its float lr a kernel argument set before each replay ---------------------------
    Mutant("host-scalar-change-not-counted", "cpu", "nemo_cudagraph_plugin/core/kernel_args.py",
           "            self.values[i] = float(value)\n            self.version += 1\n",
           "            self.values[i] = float(value)\n",
           ("tests/test_user_fused_adam.py::test_a_graphed_fit_with_the_users_fused_adamw_equals_their_eager_fit_bitwise",
            "tests/test_user_fused_adam.py::test_the_node_scan_sets_exactly_the_sentinel_arguments_and_only_after_a_change"),
           "a new learning rate does not reach the graph's kernel nodes: replays keep the rate they were last set to"),
    Mutant("fused-lr-frozen-at-capture", "cpu", "nemo_cudagraph_plugin/core/user_fused_adam.py",
           "adam_functional(opt, group, *lists, lr=self.lrs.argument(i) if own is None else own)",
           "adam_functional(opt, group, *lists, lr=self.lrs.values[i] if own is None else own)",
           ("tests/test_user_fused_adam.py::test_a_graphed_fit_with_the_users_fused_adamw_equals_their_eager_fit_bitwise",
            PT + "test_lightning_partial_graphs_clip_and_follow_the_schedule_inside_the_optimizer_graph",
            PT + "test_lightning_partial_graphs_resume_from_a_checkpoint_as_eager_training_does"),
           "the capture passes the learning rate itself: the graph replays the capture's rate for ever"),
    Mutant("fused-lr-scalars-renewed-on-reapply", "cpu", "nemo_cudagraph_plugin/core/user_fused_adam.py",
           "            self.lrs = previous.lrs\n",
           "            self.lrs = HostScalars(float(g[\"lr\"]) for g in optimizer.param_groups)\n",
           ("tests/test_user_fused_adam.py::test_an_optimizer_state_loaded_mid_fit_keeps_the_graphs_learning_rate_current",),
           "a loaded optimizer state prepares the update again with new host scalars: the graphs captured before keep "
           "the learning rate they were last set to"),
    Mutant("host-scalar-missing-from-the-graph-accepted", "cpu", "nemo_cudagraph_plugin/core/_cuda_nodes.py",
           "        if len(found) != len(sentinels):\n",
           "        if False:\n",
           ("tests/test_user_fused_adam.py::test_a_sentinel_found_in_no_node_fails_the_scan",),
           "a graph whose kernels did not all get their learning rate's place found is kept: it would run a sentinel"),
    Mutant("fused-step-counters-moved-to-the-host-cuda", "gpu", "nemo_cudagraph_plugin/core/optim.py",
           "            on_host = not user_fused_adam.all_fused(self.optimizer)\n",
           "            on_host = True\n",
           (UOG + "test_the_fused_update_200_steps_equals_the_users_eager_run[adamw-fused-32-true-1.0]",),
           "after fit a fused optimizer's step counters are moved to the CPU, where torch's fused update refuses them"),
    Mutant("fused-lr-node-not-set-cuda", "gpu", "nemo_cudagraph_plugin/core/_cuda_nodes.py",
           "            for arg, owner, slot in slots:\n                arg.value = owner.values[slot]\n",
           "            for arg, owner, slot in slots[:0]:\n                arg.value = owner.values[slot]\n",
           (UOG + "test_the_fused_kernels_lr_argument_is_set_in_the_graph_before_each_replay",
            UOG + "test_the_fused_update_200_steps_equals_the_users_eager_run[adamw-fused-32-true-1.0]"),
           "the kernel nodes are set without the new value: the fused kernel keeps the capture's sentinel"),
    Mutant("sgd-kernel-alpha-rounded-cuda", "gpu", TAIL,
           "        alpha = tl.load(alpha_ptr)\n",
           "        alpha = tl.load(alpha_ptr).to(tl.bfloat16).to(tl.float32)\n",
           (UOG + "test_the_sgd_kernel_is_torchs_cuda_add_with_alpha_bit_for_bit[True-float32]",
            UOG + "test_clipping_and_a_schedule_200_steps_equal_the_users_eager_run[sgd-foreach-momentum-32-true]"),
           "the SGD kernel reads a BFloat16-rounded alpha: graphed SGD differs from torch's own on CUDA"),
    Mutant("sgd-kernel-bf16-truncates-cuda", "gpu", TAIL,
           "                u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # RNE of the SGD update",
           "                u = u & 0xFFFF0000",
           (UOG + "test_the_sgd_kernel_is_torchs_cuda_add_with_alpha_bit_for_bit[True-bf16]",
            UOG + "test_bf16_parameters_200_steps_equal_the_users_eager_run[sgd-foreach-momentum]"),
           "the SGD kernel truncates BFloat16 parameters' update on CUDA (torch rounds to nearest even)"),
    Mutant("bf16-tail-float32-denominator-cuda", "gpu", TAIL,
           "            if ROUND:  # each rounded to BFloat16 as the bits of a float32 (see RNE below)",
           "            if False:",
           (UOG + "test_the_bf16_adam_kernels_are_torchs_cuda_foreach_ops_bit_for_bit",
            UOG + "test_bf16_parameters_200_steps_equal_the_users_eager_run[adamw-foreach]"),
           "the BFloat16 denominator is kept in float32 on CUDA (torch stores each step as BFloat16)"),
    Mutant("eager-tail-for-loop-divides-cuda", "gpu", TAIL,
           "                d = tl.math.sqrt_rn(d) * bc2s + eps  # the reciprocal",
           "                d = tl.math.div_rn(tl.math.sqrt_rn(d), tl.math.div_rn(1.0, bc2s)) + eps  # the reciprocal",
           (UOG + "test_the_for_loop_adam_kernel_is_torchs_cuda_for_loop_ops_bit_for_bit[float32]",
            UOG + "test_clipping_and_a_schedule_200_steps_equal_the_users_eager_run[adamw-for-loop-32-true]"),
           "the for-loop denominator divides by bias_correction2_sqrt: graphed for-loop AdamW differs from torch's own "
           "on CUDA"),
    Mutant("eager-tail-for-loop-fp-fusion-cuda", "gpu", TAIL,
           '        options = {"enable_fp_fusion": False} if reciprocal else {}\n',
           "        options = {}\n",
           (UOG + "test_the_for_loop_adam_kernel_is_torchs_cuda_for_loop_ops_bit_for_bit[float32]",
            UOG + "test_clipping_and_a_schedule_200_steps_equal_the_users_eager_run[adamw-for-loop-32-true]"),
           "the for-loop variant is compiled with FP fusion: the denominator's multiply and + eps become one FMA"),
    Mutant("bf16-decay-factor-rounded-cuda", "gpu", TAIL,
           "            x = tl.load(p + offs, mask=mask, other=0.0).to(tl.float32) * f",
           "            x = tl.load(p + offs, mask=mask, other=0.0).to(tl.float32) * f.to(tl.bfloat16).to(tl.float32)",
           (UOG + "test_the_bf16_adam_kernels_are_torchs_cuda_foreach_ops_bit_for_bit",
            UOG + "test_bf16_parameters_200_steps_equal_the_users_eager_run[adamw-foreach]"),
           "AdamW's decay of BFloat16 parameters on CUDA multiplies by a BFloat16-rounded factor"),
    Mutant("user-adam-math-off-by-default", "cpu", "nemo_cudagraph_plugin/core/config.py",
           '    optimizer_math: Literal["eager", "capturable"] = "eager"\n',
           '    optimizer_math: Literal["eager", "capturable"] = "capturable"\n',
           (UA + "test_a_graphed_fit_with_the_users_adamw_equals_their_eager_fit_bitwise[adamw-foreach]",),
           "the capturable math is the default: graphed fits differ from the user's eager run"),
    # -- the step-time harness's report: the figures of the results table -----------------------------
    Mutant("fp8-format-read-from-the-enums-str", "cpu", "nemo_cudagraph_plugin/fp8/_te_compat.py",
           '    name = getattr(dt, "name", None)\n',
           "    name = str(dt)\n",
           ("tests/test_fp8_master_cpu.py::test_the_fp8_format_is_read_from_tes_dtype_enum_as_each_te_version_shapes_it",),
           "the FP8 format read from str(_fp8_dtype), the number of TE 2.17+'s IntEnum: every FP8 weight refused"),
    Mutant("fp8-scale-runs-a-recipe-without-a-master-writer", "cpu", "benchmarks/fp8_scale.py",
           '        if ok[0] and j["kind"] == "variant" and j["workload"]["recipe"] not in MASTER_WRITES:\n',
           '        if False:\n',
           ("tests/test_fp8_scale.py::test_a_recipe_whose_weights_no_fp32_master_optimizer_here_writes_is_not_run_and_says_why",),
           "the block-scaling group runs, and every FP8 row fails inside fit (MasterWeightAdamW refuses its weights)"),
    Mutant("resume-keeps-a-timeout-kill", "cpu", "benchmarks/harness/runner.py",
           '    return not record.get("ok") and not record.get("skipped") and record.get("rc") != 124 and bool(record.get("error"))\n',
           '    return not record.get("ok") and not record.get("skipped") and bool(record.get("error"))\n',
           ("tests/test_harness.py::test_resume_keeps_the_runs_that_succeeded_and_refuses_other_settings",),
           "--keep-failed keeps a run killed at the child timeout (the budget's kill), which never ran to its end"),
    Mutant("resume-keep-failed-ignored", "cpu", "benchmarks/harness/runner.py",
           '    keep = [r for r in data.get("runs", []) if r.get("ok") or (keep_failed and failed_of_its_own(r))]\n',
           '    keep = [r for r in data.get("runs", []) if r.get("ok")]\n',
           ("tests/test_harness.py::test_resume_keeps_the_runs_that_succeeded_and_refuses_other_settings",),
           "--keep-failed runs a variant that failed with its own error again (two minutes for reduce-overhead on "
           "the MoE model)"),
    Mutant("report-pairs-rounds-by-position", "cpu", "benchmarks/harness/report.py",
           "            ratio_rounds = [ok_by_round[v][k][\"ms_per_step\"] / ok_by_round[base][k][\"ms_per_step\"]\n"
           "                            for k in sorted(ok_by_round[v]) if k in ok_by_round.get(base, {})]",
           "            ratio_rounds = [a[\"ms_per_step\"] / b[\"ms_per_step\"]\n"
           "                            for a, b in zip(ok_by_round[v].values(), ok_by_round.get(base, {}).values())]",
           ("tests/test_harness.py::test_ratio_to_the_baseline_pairs_runs_of_the_same_round_and_leaves_out_a_round_without_both",),
           "the step-time report pairs a variant with its baseline by position: after a failed round every pair is of "
           "two rounds"),
    Mutant("report-loss-against-another-rounds-eager", "cpu", "benchmarks/harness/report.py",
           "        ref = ref_runs.get(r[\"round\"])",
           "        ref = next(iter(ref_runs.values()), None)",
           ("tests/test_harness.py::test_loss_differences_are_against_the_same_rounds_eager_and_compiled_ones_also_against_compile",),
           "the step-time report compares every round's losses with the first round's eager run"),
    Mutant("mfu-full-attention", "cpu", "benchmarks/harness/workloads.py",
           "6.0 * layers * seq * seq * hidden * batch",
           "12.0 * layers * seq * seq * hidden * batch",
           ("tests/test_harness.py::test_mfu_counts_six_n_tokens_plus_causal_attention_over_the_datasheet_peak",),
           "MFU counts full rather than causal attention FLOPs"),
    # -- the partial tier: discovery, the autograd wiring, its guards -------------------------------------------------
    Mutant("partial-failed-module-children-not-tried", "cpu", PARTIAL,
           "            return\n        for child in node.children:\n            self._assign(child)\n",
           "            return\n",
           (PT + "test_discovery_graphs_the_largest_modules_around_a_module_that_reads_the_host",
            PT + "test_a_module_whose_own_code_reads_the_host_keeps_its_children_graphed"),
           "a module whose capture failed runs eagerly with its whole subtree: no child is tried"),
    Mutant("partial-compiled-model-not-wrapped", "cpu", PARTIAL,
           "        if node.compiled and callable(own):",
           "        if False:",
           (PT + "test_a_compiled_model_is_one_graphed_module_and_its_host_read_splits_it_open",),
           "torch.compile's wrapper is not a module of the tier: a compiled model gets no graph at all"),
    Mutant("partial-compiled-forward-not-given-back", "cpu", PARTIAL,
           "                    node.module.__dict__[\"forward\"] = node.restore  # torch.compile's own instance forward",
           "                    del node.module.__dict__[\"forward\"]",
           (PT + "test_a_compiled_model_is_one_graphed_module_and_its_host_read_splits_it_open",),
           "close() deletes torch.compile's own instance forward: the compiled model runs uncompiled after fit"),
    Mutant("partial-opened-submodules-run-uncompiled", "cpu", PARTIAL,
           "                node.plain, call = call, node.compiler(call)",
           "                node.plain, call = call, call",
           (PT + "test_a_compiled_model_is_one_graphed_module_and_its_host_read_splits_it_open[True]", PT + "test_compiled_code_reading_the_host_is_split_open_once_with_one_warning_and_given_back"),
           "a compiled model split open runs its submodules uncompiled: the user's torch.compile is dropped"),
    Mutant("partial-compiled-model-never-opened", "cpu", PARTIAL,
           "        if node.plain is not None and node.children:",
           "        if False:",
           (PT + "test_a_compiled_model_is_one_graphed_module_and_its_host_read_splits_it_open[True]", PT + "test_compiled_code_reading_the_host_is_split_open_once_with_one_warning_and_given_back"),
           "a host read inside compiled code leaves the whole compiled model one island (no graph of its submodules)"),
    Mutant("partial-opened-module-keeps-its-compiled-call", "cpu", PARTIAL,
           "            node.restore, call, node.plain = own, own, module._orig_mod.__call__",
           "            node.restore, call, node.plain = own, own, own",
           (PT + "test_a_compiled_model_is_one_graphed_module_and_its_host_read_splits_it_open[True]", PT + "test_compiled_code_reading_the_host_is_split_open_once_with_one_warning_and_given_back"),
           "a compiled model split open keeps running its whole compiled call: dynamo traces the tier's wrappers"),
    Mutant("partial-opened-submodules-counted-as-warm-up", "cpu", PARTIAL,
           "                n.status = _OPENED",
           "                n.status = _WATCH",
           (PT + "test_compiled_code_whose_backward_reads_the_host_is_split_open_after_its_eager_gradients",),
           "submodules opened are marked as in the warm-up: the next step assigns the whole tree again"),
    Mutant("partial-opened-submodules-assigned-a-step-late", "cpu", PARTIAL,
           "            if step == self._step_no and not any(n.calls for n in nodes):",
           "            if step == self._step_no:",
           (PT + "test_a_compiled_model_is_one_graphed_module_and_its_host_read_splits_it_open[True]",),
           "submodules opened in a forward wait for another whole step: each level of the model costs a step more"),
    Mutant("partial-compiled-submodules-wrapped-without-a-compiler", "cpu", PARTIAL,
           "                compiler = compiler_of(module)\n                if compiler is None:\n                    return\n",
           "                compiler = compiler_of(module)\n",
           (PT + "test_compiled_code_reading_the_host_stays_one_island_where_nothing_can_compile_its_submodules",),
           "where nothing can compile a compiled module's submodules, the tier wraps them from the start: dynamo traces "
           "the tier's wrappers inside the user's compiled code"),
    Mutant("partial-compiled-warm-up-on-the-callers-views", "cpu", PARTIAL,
           "        laid = capture_layout(leaves) if node.compiled else None",
           "        laid = None",
           (PT + "test_a_compiled_module_given_a_view_compiles_before_its_capture[model-False]",
            PT + "test_a_compiled_module_given_a_view_compiles_before_its_capture[child-False]",
            PT + "test_a_compiled_gpt2_reading_the_host_is_split_open_without_compiling_inside_a_capture"),
           "a compiled module's eager calls before its capture get the caller's views: dynamo compiles for a "
           "broadcast input and compiles again inside the capture, for the dense copy the capture reads"),
    Mutant("capture-layout-copies-broadcast-views-only", "cpu", "nemo_cudagraph_plugin/core/buffers.py",
           "    if not any(is_view(t) for t in leaves):\n        return None\n"
           "    return [static_like(t).copy_(t) if is_view(t) else t for t in leaves]",
           "    if not any(is_broadcast(t) for t in leaves):\n        return None\n"
           "    return [static_like(t).copy_(t) if is_broadcast(t) else t for t in leaves]",
           (PT + "test_a_compiled_module_given_a_view_compiles_before_its_capture[model-True]",
            PT + "test_a_compiled_module_given_a_view_compiles_before_its_capture[child-True]",
            "tests/test_hf_cpu.py::test_a_compiled_model_fed_views_compiles_outside_its_captures[llama]"),
           "a compiled module's eager calls before its capture get a view that is not broadcast as it is: dynamo's "
           "guards on its base fail on the capture's copy, which compiles inside the capture"),
    Mutant("warm-up-on-the-callers-views", "cpu", E,
           "            warm = batch if laid is None else unflatten(spec, laid)",
           "            warm = batch",
           ("tests/test_hf_cpu.py::test_a_compiled_model_fed_views_compiles_outside_its_captures[llama]",
            "tests/test_hf_cpu.py::test_a_compiled_model_fed_views_compiles_outside_its_captures[gpt2]"),
           "the eager steps before a capture read the loader's views: a compiled model that dynamo compiled with "
           "dynamic shapes is compiled again inside the capture, for its buffers"),
    Mutant("partial-compiled-call-keeps-the-autocast-cache", "cpu", PARTIAL,
           "        with autocast_cache_disabled():\n            return compiled(*args, **kwargs)",
           "        with contextlib.nullcontext():\n            return compiled(*args, **kwargs)",
           (PT + "test_a_compiled_model_is_one_graphed_module_and_its_host_read_splits_it_open",),
           "a compiled module's eager calls keep autocast's cache on, which its capture turns off: dynamo compiles "
           "anew inside the capture"),
    Mutant("dispatch-modes-stop-compiled-code", "cpu", "nemo_cudagraph_plugin/core/_torch_compat.py",
           "    def ignore_compile_internals(cls) -> bool:\n        return True",
           "    def ignore_compile_internals(cls) -> bool:\n        return False",
           (PT + "test_a_compiled_model_is_one_graphed_module_and_its_host_read_splits_it_open",
            PT + "test_a_compiled_model_stays_compiled_through_the_verified_steps"),
           "the package's dispatch modes make dynamo skip the user's compiled code: uncompiled for the rest of the "
           "process after one counted or verified step"),
    Mutant("op-counter-stops-compiled-code", "cpu", PARTIAL,
           "class _OpCounter(ObservingMode):",
           "class _OpCounter(__import__('torch').utils._python_dispatch.TorchDispatchMode):",
           (PT + "test_a_compiled_model_is_one_graphed_module_and_its_host_read_splits_it_open",),
           "the partial tier's operator counter is a plain dispatch mode: the counted step runs the compiled model "
           "uncompiled, and every step after it"),
    Mutant("old-torch-counts-compiled-steps", "cpu", PARTIAL,
           " and self._countable() else None",
           " else None",
           (PT + "test_before_torch_2_9_a_step_with_a_compiled_module_is_not_counted",),
           "on torch before 2.9 the operator counter runs around a compiled module: uncompiled from the counted step on"),
    Mutant("old-torch-verifies-compiled-models", "cpu", "nemo_cudagraph_plugin/lightning/checks.py",
           "    if config.verify_steps and not compiled_runs_under_modes():",
           "    if False:",
           (PT + "test_before_torch_2_9_verify_steps_with_a_compiled_model_is_refused_naming_it",),
           "verify_steps with a compiled model on torch before 2.9 is not refused: the verified step runs it uncompiled"),
    Mutant("compiled-backward-capture-keeps-donated-check", "cpu", GMOD,
           "        with donated_buffers_off():  # a compiled module's backward refuses retain_graph with donated buffers",
           "        with torch.autograd.set_grad_enabled(torch.is_grad_enabled()):",
           (PT + "test_a_compiled_model_is_one_graphed_module_and_its_host_read_splits_it_open",),
           "a torch.compile'd module's backward capture (retain_graph=True) raises AOTAutograd's donated-buffer error"),
    Mutant("partial-untouched-grads-kept", "cpu", GMOD,
           "                    p.grad = None\n                    self.dropped.append((p, g))",
           "                    self.dropped.append((p, g))",
           (PT + "test_lightning_partial_graphs_leave_a_module_not_called_in_a_step_without_gradient_as_eager_does",),
           "a parameter whose module was not called in a step keeps its zeroed gradient: the optimizer steps it "
           "with zeros (momentum, weight decay), which eager training skips"),
    Mutant("partial-untouched-dropped-after-clipping", "cpu", ADAPTER,
           "            self.partial.grads.drop_untouched()  # the window's backward is done",
           "            pass  # the window's backward is done",
           (PT + "test_lightning_partial_graphs_clip_without_the_gradients_a_step_did_not_give",),
           "the untouched gradients are dropped after the clipping: its norm counts their zeros"),
    Mutant("partial-untouched-not-restored", "cpu", ADAPTER,
           "                grads.restore()  # what the last window",
           "                pass  # what the last window",
           (PT + "test_lightning_partial_graphs_leave_a_module_not_called_in_a_step_without_gradient_as_eager_does",),
           "the gradients set aside for one step are not given back: new tensors, the graphs captured again"),
    Mutant("partial-second-call-replays", "cpu", PARTIAL,
           "            if entry.last_step == self._step_no and entry.needs_grad and torch.is_grad_enabled():",
           "            if False:",
           (PT + "test_a_second_call_with_the_same_signature_in_a_step_runs_eagerly",),
           "a module called twice in a step with one signature replays its graph twice: the first call's backward "
           "reads the second call's activations"),
    Mutant("partial-failed-capture-keeps-its-draws", "cpu", PARTIAL,
           "            be.set_rng_state(rng[0], self.device)\n",
           "",
           (PT + "test_discovery_graphs_the_largest_modules_around_a_module_that_reads_the_host",),
           "a failed capture's random draws are not given back: the eager call after it draws other dropout masks"),
    Mutant("partial-module-state-guard-off", "cpu", PARTIAL,
           "        why = self.watch.changed()\n        if why is not None:",
           "        why = None\n        if why is not None:",
           (PT + "test_train_eval_change_recaptures",),
           "train/eval (and every module value a graph baked in) is not checked before a step"),
    Mutant("partial-address-guard-off", "cpu", PARTIAL,
           "                why = difference(node.cache.peek(key).state, False, now)",
           "                why = None",
           (PT + "test_a_moved_parameter_recaptures",),
           "a graphed module's re-allocated parameter is not noticed: its graphs read the old memory"),
    Mutant("partial-pool-shared-across-steps", "cpu", PARTIAL,
           "        self._pool.seal()\n",
           "",
           (PT + "test_a_moved_parameter_recaptures",),
           "a module captured again in a later step shares the pool of graphs that replay between its forward and its "
           "backward: their temporaries overwrite the activations it keeps"),
    Mutant("partial-optimizer-graph-in-a-pool-of-its-own", "cpu", POPT,
           "            with self._pool.capture(graph, self._stream(), keeps_nothing=True):",
           "            with self._pool.capture(graph, self._stream()):",
           (PT + "test_the_optimizer_graph_shares_the_pool_of_the_module_graphs_before_it",),
           "the optimizer side's graph, captured a step after the modules', takes a pool of its own: its temporaries "
           "do not reuse theirs (memory)"),
    Mutant("partial-optimizer-graph-ignores-moved-parameters", "cpu", POPT,
           "                    for n, p, g, ptr in entry.grads if p.grad is not g or p.data_ptr() != ptr), None)",
           "                    for n, p, g, ptr in entry.grads if p.grad is not g), None)",
           (PT + "test_a_moved_parameter_recaptures_the_optimizer_graph",),
           "a parameter re-allocated with p.data = ... is not noticed by the optimizer side's graph: it keeps updating "
           "the old memory"),
    Mutant("partial-key-without-shapes", "cpu", PARTIAL,
           "        key = (signature_of(leaves, spec), tuple(t.requires_grad for t in leaves)",
           "        key = (spec, tuple(t.requires_grad for t in leaves)",
           (PT + "test_a_new_input_shape_is_a_new_capture",),
           "a module call of a new input shape replays the graph of another shape"),
    Mutant("partial-grad-buffers-adopted", "cpu", GMOD,
           "        self._replay(self.bwd)\n        return self.grad_ins",
           "        self._replay(self.bwd)\n        return tuple(None if g is None else g.detach() for g in self.grad_ins)",
           (PT + "test_gradients_accumulate_into_grad_as_in_eager_training",),
           "the backward hands autograd tensors nobody else holds: it adopts the graph's gradient memory as .grad, "
           "which the next replay overwrites"),
    Mutant("partial-outputs-not-copied", "cpu", GMOD,
           "            copy_all(fresh, self.outs)\n        return fresh",
           "            copy_all(fresh, self.outs)\n        return list(self.outs)",
           (PT + "test_outputs_are_copies_that_later_replays_do_not_overwrite",),
           "a graphed module returns its static outputs: a kept output changes on the next replay"),
    Mutant("partial-backward-failure-not-reported", "cpu", PARTIAL,
           "        entry.on_failure = lambda exc: self._backward_failed(node, exc)\n",
           "",
           (PT + "test_a_backward_that_reads_the_host_makes_an_island_after_its_eager_gradients",),
           "a module whose backward does not capture stays graphed: every step's backward retries the capture"),
    Mutant("partial-steps-counted-as-rapid-module-changes", "cpu", ADAPTER,
           "        rapid = self.partial is None and self.stats.replays - self._replays_at_change < _RAPID_REPLAYS",
           "        rapid = self.stats.replays - self._replays_at_change < _RAPID_REPLAYS",
           (PT + "test_lightning_partial_graphs_follow_module_state_changes_every_step",),
           "the whole-step tier's refusal of module state changed every step or two also counts partial-tier steps, "
           "where no whole-step graph replays: a few changes stop a fit the partial tier follows"),
    Mutant("partial-broadcast-input-kept-strided", "cpu", "nemo_cudagraph_plugin/core/buffers.py",
           "    if is_broadcast(t):\n        return torch.empty(t.shape, dtype=t.dtype, device=t.device)",
           "    if False:\n        return torch.empty(t.shape, dtype=t.dtype, device=t.device)",
           (PT + "test_a_broadcast_input_is_copied_into_dense_static_memory",),
           "a module called with an expand()ed tensor gets a static input of the same overlapping layout, which "
           "nothing can be copied into: the module becomes an island"),
    # -- the partial tier's optimizer graph ------------------------------------------------------------------------
    Mutant("partial-optimizer-grads-not-guarded", "cpu", POPT,
           "                    for n, p, g, ptr in entry.grads if p.grad is not g or p.data_ptr() != ptr), None)",
           "                    for n, p, g, ptr in entry.grads if p.data_ptr() != ptr), None)",
           (PT + "test_a_gradient_set_to_none_recaptures_the_optimizer_graph",),
           "a gradient set to None and made anew is not noticed: the optimizer graph replays the old gradients"),
    Mutant("partial-optimizer-dirty-ignored", "cpu", POPT,
           "        if why is None and self.dirty:",
           "        if why is None and False:",
           (PT + "test_a_moved_optimizer_state_is_found_when_marked_dirty",),
           "a loaded optimizer state is not compared: the graph keeps updating the old state's memory"),
    Mutant("partial-optimizer-deferred-clipping-dropped", "cpu", POPT,
           "        self._deferred.append((fn, args, kwargs))\n        return True",
           "        return True",
           (PT + "test_the_optimizer_side_is_one_graph_equal_to_eager",
            PT + "test_lightning_partial_graphs_clip_and_follow_the_schedule_inside_the_optimizer_graph"),
           "the clipping handed to the optimizer graph is never run: training silently unclipped"),
    Mutant("partial-optimizer-deferred-left-over", "cpu", POPT,
           "        self._deferred = []\n\n    def _deferred_now",
           "        pass\n\n    def _deferred_now",
           (PT + "test_a_step_without_update_leaves_nothing_deferred_for_the_next",),
           "what a step that skipped its update deferred is not cleared: the next step clips twice"),
    Mutant("partial-fresh-grads", "cpu", ADAPTER,
           "                               and not self._ddp and partial is None)",
           "                               and not self._ddp)",
           (PT + "test_lightning_partial_graphs_clip_and_follow_the_schedule_inside_the_optimizer_graph",),
           "the partial tier keeps zero_grad(set_to_none=True): every step makes new gradients and the optimizer graph "
           "is captured again every step"),
    Mutant("partial-optimizer-grads-not-kept-for-validation", "cpu", ADAPTER,
           "        self._grads = [(p, p.grad) for _, p in self.engine.named_params if p.grad is not None]\n\n"
           "    def around_clip_gradients",
           "        pass\n\n    def around_clip_gradients",
           (PT + "test_lightning_partial_graphs_keep_the_optimizer_graph_across_validation",),
           "the gradients Lightning frees before validation are not given back: a re-capture after each validation"),
    Mutant("partial-optimizer-hyperparameter-change-kept", "cpu", ADAPTER,
           "        if opt_graph is not None:\n            opt_graph.invalidate()\n",
           "",
           (PT + "test_lightning_partial_graphs_recapture_the_optimizer_graph_when_a_baked_hyperparameter_changes",),
           "a changed momentum keeps the optimizer graph captured with the old one"),
    Mutant("partial-clipping-not-deferred", "cpu", RUNNER,
           "        if self.config.scope != \"step\":  # the partial tier's optimizer graph takes Lightning's clipping in",
           "        if False:  # the partial tier's optimizer graph takes Lightning's clipping in",
           (PT + "test_lightning_partial_graphs_clip_and_follow_the_schedule_inside_the_optimizer_graph",),
           "Lightning's clipping stays eager in the partial tier: a few dozen launches per step outside graphs"),
    Mutant("partial-inputs-copied-with-a-version-bump", "cpu", GMOD,
           "        self._input_data = [t.data for t in inputs]",
           "        self._input_data = list(inputs)",
           (PT + "test_discovery_graphs_the_largest_modules_around_a_module_that_reads_the_host",),
           "the inputs are copied into the static tensors the capture's autograd graph saved: the backward's capture "
           "finds them modified in place and no module stays a graph"),
    Mutant("partial-modules-under-ddp-accepted", "cpu", "nemo_cudagraph_plugin/lightning/checks.py",
           '    if config.scope == "modules" and "DDPStrategy" in names:\n',
           '    if False:\n',
           (LT + "test_callback_with_ddp_strategy_is_refused_naming_the_strategy_to_use",),
           "scope='modules' under DDP starts partial graphs, which are not proven there"),
    Mutant("partial-auto-under-ddp", "cpu", "nemo_cudagraph_plugin/lightning/adapter.py",
           '        elif config.scope == "auto" and not self._ddp and not self._te:',
           '        elif config.scope == "auto" and not self._te:',
           (PT + "test_under_ddp_auto_keeps_whole_steps_and_refuses_as_scope_step_does",),
           "under DDP a step that does not capture whole trains with partial graphs, which are not proven there"),
    Mutant("zero-in-place-kernel-per-gradient", "cpu", "nemo_cudagraph_plugin/lightning/adapter.py",
           "            zeroed = zero_grads_in_place(optimizer)  # one multi-tensor zero, not a kernel per gradient\n",
           "            zeroed = None\n",
           (PT + "test_lightning_partial_graphs_zero_the_gradients_with_one_kernel",),
           "gradients zeroed in place get a kernel each (torch's zero_grad without foreach): a few dozen launches per "
           "step outside the partial tier's graphs"),
    Mutant("island-host-time-counts-submodules", "cpu", "nemo_cudagraph_plugin/core/partial.py",
           "            node.host_s += dt - inner.pop()\n",
           "            inner.pop()\n            node.host_s += dt\n",
           (PT + "test_islands_report_the_host_time_of_their_own_code",),
           "an island's host time includes its submodules' calls: the summary blames the island for its children"),
    Mutant("failed-capture-pool-reused", "cpu", "nemo_cudagraph_plugin/core/backend.py",
           "        except BaseException:\n            self._handle = None\n            raise\n",
           "        except BaseException:\n            raise\n",
           (PT + "test_discovery_graphs_the_largest_modules_around_a_module_that_reads_the_host",
            PT + "test_a_backward_that_reads_the_host_makes_an_island_after_its_eager_gradients",
            PT + "test_an_optimizer_that_reads_the_host_is_eager_with_its_reason"),
           "the pool a failed capture left the allocator recording into is used again: on CUDA every later capture "
           "into it fails and the modules after the first island stay eager"),
    Mutant("partial-backward-captured-into-the-forwards-pool", "cpu", GMOD,
           "lambda graph, keeps_nothing=False: pool.capture(graph, stream, keeps_nothing)",
           "lambda graph, keeps_nothing=False, fixed=pool.get(): backend.capture(graph, fixed, stream)",
           (PT + "test_discovery_graphs_the_largest_modules_around_a_module_that_reads_the_host",),
           "a backward is captured into the pool its forward had, which a failed capture in between left unusable"),
    Mutant("partial-grads-added-in-autograd-grad", "cpu", GMOD,
           "        if not self.alone() or not acc.full_pass():\n",
           "        if not self.alone():\n",
           (PT + "test_a_backward_that_takes_input_gradients_only_leaves_grad_alone",),
           "the backward graphs add the parameters' gradients into .grad in a torch.autograd.grad pass too, which "
           "eager training leaves .grad alone in: the gradients the update reads are counted twice"),
    Mutant("partial-verify-eager-half-through-the-graphs", "cpu", PARTIAL,
           "        in_step, self._in_step = self._in_step, False\n",
           "        in_step = self._in_step\n",
           (PT + "test_lightning_partial_graphs_verify_steps_leave_training_as_an_unverified_run_and_eager",
            PT + "test_lightning_partial_graphs_verify_steps_raise_parity_error_when_a_graph_differs_from_eager[module]"),
           "verify_steps' eager half in the partial tier replays the modules' graphs instead of their own forwards: a "
           "graph that differs from eager compares equal, and the calls it counts change what the graphed half does"),
    Mutant("fp8-weights-under-a-masterless-torch-optimizer-accepted", "cpu", "nemo_cudagraph_plugin/fp8/_te_compat.py",
           '    if module == "torch.optim" or module.startswith("torch.optim."):\n',
           "    if False:\n",
           ("tests/test_fp8_refusals_cpu.py::test_a_torch_optimizer_on_fp8_weights_is_refused_on_any_machine[AdamW]",
            "tests/test_fp8_refusals_cpu.py::test_the_masterless_refusal_holds_with_on_capture_error_eager"),
           "torch's AdamW on FP8 primary weights is not refused: every step rounds the weights back to FP8 and the "
           "updates smaller than FP8's spacing are lost, silently"),
    Mutant("fused-tensor-lr-copied-once", "cpu", "nemo_cudagraph_plugin/core/user_fused_adam.py",
           "            if own is not None:\n                own.fill_(lr.reshape(()))\n",
           "            if own is not None and changed is not None:\n                own.fill_(lr.reshape(()))\n",
           (UFA + "test_a_graphed_fit_with_the_users_fused_adamw_equals_their_eager_fit_bitwise[adamw-fused-tensor-lr]",
            UFA + "test_a_group_lr_replaced_between_steps_is_what_the_graph_reads[tensor-replaced-at0]"),
           "a fused group's tensor lr reaches the graph's tensor only when it is first seen: a scheduler's in-place "
           "changes and a replaced tensor never reach the kernel, which keeps the first rate silently"),
    Mutant("fused-lr-kind-change-not-recaptured", "cpu", "nemo_cudagraph_plugin/core/user_fused_adam.py",
           "                lrs.set(i, lr)\n        return changed\n",
           "                lrs.set(i, lr)\n        return None\n",
           (UFA + "test_a_group_lr_replaced_between_steps_is_what_the_graph_reads[float-to-tensor-at2]",),
           "a fused group's float lr replaced by a tensor keeps the graph of the float kernel, whose argument no "
           "longer follows the group"),
    Mutant("fused-user-skip-flag-not-given", "cpu", OPTIM,
           "            self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)  # 0-d, like GradScaler's\n"
           "            set_found_inf(opt, self.found_inf)\n        self._live = []\n",
           "            self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)  # 0-d, like GradScaler's\n"
           "        self._live = []\n",
           (LT + "test_nan_action_skip_drops_the_poisoned_update_inside_a_replay",
            UFA + "test_nan_action_skip_keeps_the_users_fused_update_and_gives_its_kernel_the_flag"),
           "nan_action='skip' with the user's own fused update: the guard raises its flag but the kernel never sees it, "
           "and the poisoned update is applied"),
    Mutant("fp8-master-write-keeps-the-transpose-valid", "cpu", "nemo_cudagraph_plugin/fp8/_te_compat.py",
           "    if reset:\n        t._reset_caches()\n",
           "    pass\n",
           (FM + "test_each_step_updates_fp32_masters_with_adamw_and_writes_every_weight_from_its_master[te2]",),
           "MasterWeightAdamW writes new FP8 bytes without TE's _reset_caches(): eager TE's backward keeps reading the "
           "transpose of the old bytes"),
    Mutant("own-device-lr-not-followed", "cpu", OPTIM,
           "        lr_t = lr_t or (fam is None and bool(opt.param_groups) and all(\n",
           "        lr_t = lr_t or (False and all(\n",
           (FM + "test_a_graphed_fit_trains_the_fp8_weights_as_the_eager_fit_with_schedule_clipping_and_a_float_lr[0]",),
           "an optimizer holding its own device-tensor lr (MasterWeightAdamW, TE's FusedAdam) is not followed: a float "
           "lr assigned between steps never reaches the graph, which keeps the old rate silently"),
    Mutant("fp8-master-load-rounds-the-masters", "cpu", "nemo_cudagraph_plugin/fp8/master.py",
           '    def load_state_dict(self, state_dict: dict[str, Any]) -> None:\n',
           '    def _unused_load_state_dict(self, state_dict: dict[str, Any]) -> None:\n',
           (FM + "test_a_resumed_run_equals_the_uninterrupted_one_with_fp32_masters_kept",),
           "MasterWeightAdamW's checkpoint loads through torch's path: the FP32 masters of BF16 weights are rounded to "
           "BF16 on resume, and the resumed run drifts from the uninterrupted one"),
    # -- a hyperparameter the step's own code assigns, before the update it runs eagerly or replays on its own ----------
    Mutant("user-update-reads-the-value-synced-before-the-step", "cpu", "nemo_cudagraph_plugin/core/user_step.py",
           "        if self.before_update is not None and not kernel_args.capture_open():\n",
           "        if False:\n",
           (LT + "test_lr_assigned_inside_optimizer_step_trains_as_eager_when_the_refusal_falls_back_to_eager[eager]",),
           "the captured user update run eagerly reads the lr copied before the step: one set in optimizer_step lags"),
    Mutant("optimizer-graph-replays-without-the-step-s-assignments", "cpu", POPT,
           "        self._before_update()\n        deferred, self._deferred = self._deferred, []\n",
           "        deferred, self._deferred = self._deferred, []\n",
           (PT + "test_lightning_partial_graphs_use_the_lr_optimizer_step_assigns_in_that_step[capturable_math-modules]",),
           "the partial tier's optimizer graph replays with the lr of the step before, not the one optimizer_step set"),
    Mutant("refused-stand-in-capture-keeps-its-writes", "cpu", E,
           "            if isinstance(writes, WriteRecorder):\n                writes.restore()\n            undo()\n"
           "            return self._handle_capture_error(err, err, fn, batch)\n",
           "            undo()\n            return self._handle_capture_error(err, err, fn, batch)\n",
           (LT + "test_lr_assigned_inside_optimizer_step_trains_as_eager_when_the_refusal_falls_back_to_eager[capturable]",),
           "a capture that ran the step (the stand-in) and was refused keeps what it wrote: the step runs twice"),
    Mutant("auto-hands-te-models-to-partial-graphs", "cpu", ADAPTER,
           "        elif config.scope == \"auto\" and not self._ddp and not self._te:\n",
           "        elif config.scope == \"auto\" and not self._ddp:\n",
           (PT + "test_lightning_partial_graphs_are_refused_for_transformer_engine_models_and_auto_keeps_whole_steps",),
           "scope='auto' hands a TransformerEngine model to partial graphs, which run none of TE's hazard checks"),
    Mutant("modules-scope-takes-te-models", "cpu", "nemo_cudagraph_plugin/lightning/checks.py",
           "        if te is not None:\n",
           "        if False:\n",
           (PT + "test_lightning_partial_graphs_are_refused_for_transformer_engine_models_and_auto_keeps_whole_steps",),
           "scope='modules' graphs the modules of a TransformerEngine model, whose hazards it does not check"),
    Mutant("user-update-in-step-sync-skipped-cuda", "gpu", "nemo_cudagraph_plugin/core/user_step.py",
           "        if self.before_update is not None and not kernel_args.capture_open():\n",
           "        if False:\n",
           ("tests/gpu/test_partial_gpu.py::test_an_lr_set_in_optimizer_step_scope_auto_trains_with_partial_graphs_bitwise[fused]",
            "tests/gpu/test_partial_gpu.py::test_an_lr_set_in_optimizer_step_scope_auto_trains_with_partial_graphs_bitwise[foreach]"),
           "on CUDA, the user's update run eagerly reads the lr of the step before, not the one optimizer_step set"),
    Mutant("optimizer-graph-in-step-sync-skipped-cuda", "gpu", POPT,
           "        self._before_update()\n        deferred, self._deferred = self._deferred, []\n",
           "        deferred, self._deferred = self._deferred, []\n",
           ("tests/gpu/test_partial_gpu.py::test_an_lr_set_in_optimizer_step_scope_auto_trains_with_partial_graphs_bitwise[fused]",
            "tests/gpu/test_partial_gpu.py::test_an_lr_set_in_optimizer_step_scope_auto_trains_with_partial_graphs_bitwise[foreach]"),
           "on CUDA, the partial tier's optimizer graph replays with the lr of the step before"),
]


# ----------------------------------------------------------------------------------------------------------
def _copy_tree(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "results")
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dst / name)


def _apply(root: Path, m: Mutant) -> None:
    path = root / m.file
    text = path.read_text()
    n = text.count(m.old)
    if n != 1:
        raise StaleSnippet(f"{m.name}: the snippet occurs {n} times in {m.file} (must be exactly once); update MUTANTS")
    path.write_text(text.replace(m.old, m.new))


class StaleSnippet(Exception):
    pass


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # parallel runs on few cores: no oversubscription
    return env


def _check_import(root: Path) -> None:
    """The copy's package must be the one imported (not the editable install of the checkout)."""
    out = subprocess.run([sys.executable, "-c", f"import {PKG}, os; print(os.path.realpath({PKG}.__file__))"],
                         cwd=root, env=_env(root), capture_output=True, text=True, timeout=300)
    got = out.stdout.strip()
    if out.returncode != 0 or not got.startswith(str(root.resolve())):
        raise RuntimeError(f"the copy's package is not the one imported (got {got!r}): {out.stderr[-2000:]}")


@dataclass
class Outcome:
    rc: int
    failed: list[str]
    passed: list[str]
    skipped: list[str]
    seconds: float
    tail: str


_CHILDREN: set[subprocess.Popen] = set()


def _kill_children(signum: int, frame: object) -> None:
    """Stop the pytest runs this script started (each in its own process group), then exit."""
    for proc in list(_CHILDREN):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    os._exit(128 + signum)


def _pytest(root: Path, tests: list[str], timeout: float) -> Outcome:
    xml = root / f"junit-{os.getpid()}-{time.monotonic_ns()}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", f"--junitxml={xml}", *tests]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, env=_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    _CHILDREN.add(proc)
    try:
        text, _ = proc.communicate(timeout=timeout)
        rc, tail = proc.returncode, text[-3000:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        rc, tail = -1, f"timeout after {timeout:.0f} s\n" + (text or "")[-2000:]
    finally:
        _CHILDREN.discard(proc)
    failed, passed, skipped = [], [], []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            node = _node_id(case)
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(node)
            elif case.find("skipped") is not None:
                skipped.append(node)
            else:
                passed.append(node)
    return Outcome(rc, failed, passed, skipped, time.perf_counter() - t0, tail)


def _matches(listed: str, node: str) -> bool:
    """``node`` is ``listed`` or one of its parametrizations (a listed id without ``[...]`` runs them all)."""
    return node == listed or ("[" not in listed and node.startswith(listed + "["))


def _all_passed(listed: str, out: Outcome) -> bool:
    ran = [n for n in out.passed + out.failed + out.skipped if _matches(listed, n)]
    return bool(ran) and all(n in out.passed for n in ran)


def _node_id(case: ET.Element) -> str:
    cls, name = case.get("classname", ""), case.get("name", "")
    parts = cls.split(".")
    # tests.test_x -> tests/test_x.py; tests.gpu.test_y -> tests/gpu/test_y.py
    return "/".join(parts) + ".py::" + name if parts else name


def _short(node: str) -> str:
    return node.split("/")[-1].replace(".py::", "::")


def _run_mutant(m: Mutant, base: Path, timeout: float) -> tuple[Mutant, str, Outcome]:
    work = Path(tempfile.mkdtemp(prefix=f"mutant-{m.name}-"))
    try:
        root = work / "repo"
        shutil.copytree(base, root, symlinks=True)
        _apply(root, m)
        out = _pytest(root, list(m.tests), timeout)
        if out.rc == 1 and out.failed:
            verdict = "caught"
        elif out.rc == 0:
            verdict = "MISSED"
        else:
            verdict = "ERROR" if out.rc != -1 else "TIMEOUT"
        return m, verdict, out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", choices=("cpu", "gpu", "nemo", "all"), default="cpu")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--only", action="append", default=[], help="NAME[,NAME...] (repeatable)")
    ap.add_argument("--jobs", type=int, default=0, help="parallel mutants (default: CPU cores, 1 for gpu)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run (the baseline: 3x)")
    ap.add_argument("--out", help="also write the result table (markdown) to this file")
    args = ap.parse_args(argv)

    only = {n for part in args.only for n in part.split(",") if n}
    unknown = only - {m.name for m in MUTANTS}
    if unknown:
        print(f"unknown mutant(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if (m.name in only if only else args.tier in ("all", m.tier))]
    if args.list:
        for m in chosen:
            print(f"{m.name:38} {m.tier:3}  {m.file}\n    {m.what}\n" + "".join(f"    - {t}\n" for t in m.tests))
        return 0
    if not chosen:
        print("mutants: no mutant selected")
        return 1

    t_start = time.perf_counter()
    signal.signal(signal.SIGTERM, _kill_children)
    signal.signal(signal.SIGINT, _kill_children)
    # Stale snippets first: no test time is spent when the list no longer matches the code.
    stale = []
    for m in chosen:
        n = (ROOT / m.file).read_text().count(m.old)
        if n != 1:
            stale.append(f"{m.name}: snippet found {n} times in {m.file}")
    if stale:
        print("\n".join(stale))
        print(f"mutants: FAILED: {len(stale)} stale snippet(s); update ci/mutants.py to the code")
        return 1

    if any(m.tier == "gpu" for m in chosen):
        import torch

        if not torch.cuda.is_available():
            print("mutants: FAILED: the gpu tier needs a CUDA device (its tests are in tests/gpu)")
            return 1

    tmp = Path(tempfile.mkdtemp(prefix="mutants-base-"))
    try:
        base = tmp / "repo"
        base.mkdir()
        _copy_tree(base)
        _check_import(base)
        tests = sorted({t for m in chosen for t in m.tests})
        print(f"baseline: {len(tests)} tests on the unbroken copy ({base}) ...", flush=True)
        out = _pytest(base, tests, 3 * args.timeout)
        not_passed = [t for t in tests if not _all_passed(t, out)]
        if out.rc != 0 or not_passed:
            print(out.tail)
            why = f"failed: {', '.join(_short(t) for t in out.failed)}" if out.failed else ""
            why += f" skipped: {', '.join(_short(t) for t in out.skipped)}" if out.skipped else ""
            missing = [t for t in not_passed if not any(_matches(t, n) for n in out.failed + out.skipped)]
            why += f" not run: {', '.join(_short(t) for t in missing)}" if missing else ""
            print(f"mutants: FAILED: the listed tests do not all pass on the unbroken code ({why.strip()})")
            return 1
        print(f"baseline: {len(tests)} passed in {out.seconds:.0f} s", flush=True)

        # GPU: tiny models, a few processes share the one GPU (the tests compare runs within one process).
        jobs = args.jobs or (3 if args.tier == "gpu" else max(1, min(4, os.cpu_count() or 1)))
        results: list[tuple[Mutant, str, Outcome]] = []
        with cf.ThreadPoolExecutor(max_workers=jobs) as pool:
            futs = [pool.submit(_run_mutant, m, base, args.timeout) for m in chosen]
            for f in cf.as_completed(futs):
                m, verdict, o = f.result()
                print(f"  {verdict:7} {m.name} ({o.seconds:.0f} s)", flush=True)
                if verdict in ("ERROR", "TIMEOUT"):
                    print("    " + o.tail.replace("\n", "\n    ")[-1500:])
                results.append((m, verdict, o))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    order = {m.name: i for i, m in enumerate(chosen)}
    results.sort(key=lambda r: order[r[0].name])
    lines = ["| mutant | tier | file | result | caught by (failing tests) | s |", "|---|---|---|---|---|---|"]
    for m, verdict, o in results:
        by = ", ".join(_short(t) for t in o.failed) or "-"
        lines.append(f"| {m.name} | {m.tier} | {m.file.replace(PKG + '/', '')} | {verdict} | {by} | {o.seconds:.0f} |")
    table = "\n".join(lines)
    print()
    print(table)
    bad = [m.name for m, v, _ in results if v != "caught"]
    total = time.perf_counter() - t_start
    if args.out:
        import platform

        head = (f"# ci/mutants.py --tier {args.tier}\n\nPython {platform.python_version()}, "
                f"{'torch ' + _torch_version()}; {len(results)} mutants in {total:.0f} s.\n\n")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(head + table + "\n")
    print()
    if bad:
        print(f"mutants: FAILED: {len(bad)} of {len(results)} not caught ({', '.join(bad)}) in {total:.0f} s")
        return 1
    print(f"mutants: {len(results)} of {len(results)} caught (tier {args.tier}) in {total:.0f} s")
    return 0


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__ + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
    except Exception:  # noqa: BLE001 - informational only
        return "?"


if __name__ == "__main__":
    sys.exit(main())
