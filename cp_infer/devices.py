"""What the device decides at start-up: the defaults that depend on it (dtype, TF32) and which GPU a rank takes.

Invariants:
- ``auto`` settings are resolved here and nowhere else, as pure functions of the device (:func:`device_defaults`):
  on CUDA bf16 and TF32 for float32 matmuls and convolutions (what diffusers' pipeline examples and every peer
  run); on the CPU float32 and no TF32, so a CPU run's numbers do not depend on the defaults changing.
- A rank takes a GPU of its own, or start-up fails naming the fix (:func:`cuda_ordinal`, a pure function of the
  rank's place on its node, the devices it sees and its environment): two ranks on one device is a group NCCL
  refuses to form, and an ordinal past the visible devices fails at the first CUDA call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["AUTO", "DTYPES", "DeviceDefaults", "DeviceError", "apply_device_defaults", "cuda_ordinal",
           "device_defaults", "resolve_dtype"]

AUTO = "auto"
DTYPES = (AUTO, "fp32", "bf16", "fp16")
"""``--dtype``'s choices: ``auto`` is :func:`device_defaults`'s."""

# torchrun sets these in every rank it starts; its ranks share the agent's environment, CUDA_VISIBLE_DEVICES included.
_TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID",)


class DeviceError(ValueError):
    """This rank cannot have a GPU of its own; the message names the fix."""


@dataclass(frozen=True)
class DeviceDefaults:
    """What ``auto`` means on a device."""

    dtype: str
    """The weights' and activations' dtype (``--dtype auto``): ``bf16`` on CUDA, ``fp32`` elsewhere."""
    tf32: bool
    """TF32 for float32 matmuls and cuDNN convolutions (what stays float32 under bf16: a family's float32 VAE, the
    schedulers' arithmetic) on CUDA; never on the CPU, which has none."""


def device_defaults(device: str | torch.device) -> DeviceDefaults:
    """The ``auto`` settings on ``device``."""
    if torch.device(device).type == "cuda":
        return DeviceDefaults(dtype="bf16", tf32=True)
    return DeviceDefaults(dtype="fp32", tf32=False)


def resolve_dtype(dtype: str, device: str | torch.device) -> str:
    """``dtype`` with ``auto`` resolved for ``device`` (any other value unchanged)."""
    return device_defaults(device).dtype if dtype == AUTO else dtype


def apply_device_defaults(device: str | torch.device) -> DeviceDefaults:
    """Set this process's backend flags for ``device`` (TF32 on CUDA); returns the defaults applied."""
    defaults = device_defaults(device)
    if defaults.tf32:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    return defaults


def cuda_ordinal(*, local_rank: int, local_world_size: int | None, visible: int, env: Mapping[str, str]) -> int:
    """The CUDA ordinal of the rank ``local_rank`` of ``local_world_size`` on its node (``None``: unknown, the rank
    was not started by torchrun), which sees ``visible`` devices under ``env`` (its environment). Raises
    :class:`DeviceError` naming the fix where the rank would share a device or name one it cannot see.

    Under torchrun every rank of a node has the agent's ``CUDA_VISIBLE_DEVICES``, so rank R takes device R and the
    node needs a device per rank. Ranks started one by one (SLURM's ``srun`` with ``--gpus-per-task=1``) may each see
    only their own device (a per-rank ``CUDA_VISIBLE_DEVICES`` of one entry): each takes device 0.
    """
    shown = env.get("CUDA_VISIBLE_DEVICES")
    where = "" if shown is None else f" (CUDA_VISIBLE_DEVICES={shown!r})"
    if visible < 1:
        raise DeviceError(f"rank {local_rank} sees no CUDA device{where}; unset CUDA_VISIBLE_DEVICES or list the "
                          "node's GPUs in it, or run with --device cpu")
    torchrun = any(name in env for name in _TORCHRUN_ENV)
    own = shown is not None and len([d for d in shown.split(",") if d.strip()]) == 1
    if not torchrun and own and visible == 1:
        return 0  # a per-rank CUDA_VISIBLE_DEVICES: the one device this rank sees is its own
    ranks = local_world_size if local_world_size is not None else local_rank + 1
    if ranks > visible or local_rank >= visible:
        raise DeviceError(
            f"{ranks} ranks on this node and {visible} visible CUDA device(s){where}: each rank needs a GPU of its "
            f"own (NCCL does not run two ranks on one device); start at most {visible} ranks per node "
            f"(--nproc / torchrun --nproc_per_node {visible}), make more GPUs visible, or run with --device cpu")
    return local_rank
