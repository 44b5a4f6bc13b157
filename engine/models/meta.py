"""``on_meta``: build a model on the meta device (its weights assigned afterwards) without paying for its
initialisers.

Under ``torch.device("meta")`` every module still runs its ``reset_parameters``. ``nn.init.normal_`` (an
``nn.Embedding``'s initialiser) has no native meta kernel: it runs torch's Python reference, whose first
call imports ``torch._dynamo`` (about 1 s of a process's start on a CPU, 2-3 s under load; nothing else a
replica or a command does at start needs it). A meta tensor holds no values, so there is nothing for the
initialiser to fill: inside ``on_meta`` it returns the tensor as it is. A tensor on any other device is
initialised as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def on_meta() -> Iterator[None]:
    """``with torch.device("meta")``, with ``nn.init.normal_`` a no-op on meta tensors for its duration."""
    original = torch.nn.init.normal_

    def normal_(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if tensor.is_meta:
            return tensor
        return original(tensor, *args, **kwargs)

    torch.nn.init.normal_ = normal_
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.nn.init.normal_ = original
