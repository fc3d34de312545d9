"""Adapters for the frameworks that drive the training step themselves.

* :mod:`.megatron`: megatron-core loops and NeMo's ``MegatronStrategy`` (megatron-core's own CUDA graphs, FP8
  transposes on its all-gather path, its whole-iteration graph, and the Lightning callbacks for Megatron-style
  pipeline chunks).
* :mod:`.nemo`: the NeMo 2 recipe flag (``with_cuda_graph``), its command line and its ``nemo_run`` plugin.

Imports point down only: ``core`` <- ``fp8`` <- ``lightning`` <- ``integrations``.
"""
