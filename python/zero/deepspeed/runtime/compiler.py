"""deepspeed.runtime.compiler's is_compile_supported (also
deepspeed.is_compile_supported): whether torch.compile is there, torch 2.1
and later as DeepSpeed asks. The engine takes a compiled model
(docs/stage3.md, "torch.compile")."""
import torch


def is_compile_supported() -> bool:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 1) and hasattr(torch, "compile")


__all__ = ["is_compile_supported"]
