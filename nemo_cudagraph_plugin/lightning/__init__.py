"""Lightning adapter: the callback and the strategy plugin (one runner serves both)."""

from .callback import CudaGraphCallback
from .strategy import CudaGraphStrategy

__all__ = ["CudaGraphCallback", "CudaGraphStrategy"]
