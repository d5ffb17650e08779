"""ringflash: exact attention over sequences sharded across a process group."""

from .kernels import flash_attn

__version__ = "0.1.0"
__all__ = ["flash_attn"]
