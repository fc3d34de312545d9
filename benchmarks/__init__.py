"""Benchmarks: the step-time harness (``python -m benchmarks.harness``) and the specialised probes beside it.

Run everything from the repository root as modules (``python -m benchmarks.<name>``): the repository root is then on
``sys.path`` and ``recipes``, ``nemo_cudagraph_plugin`` and ``benchmarks`` import without path edits.
"""
