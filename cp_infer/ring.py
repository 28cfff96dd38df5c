"""Ring attention: the queries of one ring block attend every block of keys/values, one block per step, the blocks
passed around the ring by point-to-point sends and merged by their log-sum-exp.

Invariants:
- A ring of ``R`` ranks holds a sequence cut into ``R`` equal blocks (padding included); ring rank ``r`` starts with
  block ``r`` and, at step ``i``, holds block ``(r - i) mod R``. Every step but the last sends the held block to
  ring rank ``r + 1`` and receives the next from ``r - 1`` while this step's block is attended (the transfer
  overlaps the attention), into one spare buffer: a call holds two blocks of keys/values, never the whole
  sequence.
- Padding sits at the end of the whole sequence (``cp_infer.shard``), so block ``j`` holds the keys
  ``[j * BLOCK, (j + 1) * BLOCK)`` and its padded keys are its tail past the sequence's real length: a step cuts
  the block it holds to its real keys (no mask, SDPA stays on its fast kernels); a block with no real key is not
  attended and contributes exactly nothing.
- Blocks merge in fp32 by the max/exp form of the online softmax: ``m = max(m, lse_b)``, ``acc = acc * exp(m_old
  - m) + out_b * exp(lse_b - m)``, ``l = l * exp(m_old - m) + exp(lse_b - m)``, the result ``acc / l``. A row with
  no attended key anywhere (every block padding, or masked by ``key_mask``) keeps ``m = -inf`` and gets 0, never
  NaN (the sigmoid form ``out - sigmoid(lse_b - lse) * (out - out_b)`` gives NaN there: ``-inf - -inf``).
- The log-sum-exp of a block comes from a fused kernel that returns it: on the CPU flash attention
  (``aten._scaled_dot_product_flash_attention_for_cpu``), which returns 0, not -inf, for a row with every key
  masked: such rows are set to -inf here; on CUDA, for a block without a key mask, flash attention (fp16, bf16) or
  the memory-efficient kernel (fp32, or where flash refuses the shape), whose log-sum-exp is cut to the queries (it
  pads them to a multiple of 32). A CUDA kernel is used on a device and dtype only once a small problem has given
  the fp32-matmul result through it (:func:`fused_lse_ok`, checked once per process): a kernel that fails or
  disagrees there is never used, and the same maths runs in fp32 matmuls instead (``fused=False``, also the path of
  a block with a key mask on CUDA, and of every other device).
- Inference only: a ring step's receive is not differentiable, so a call under autograd is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["RingGroup", "BlockMerge", "attention_lse", "fused_lse_ok", "ring_attention"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RingGroup:
    """One rank's ring: the group over the ring's ranks (group rank = ring index) and this rank's index."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 2 or not 0 <= self.rank < self.size:
            raise ValueError(f"a ring has >= 2 ranks and rank in [0, size); got rank={self.rank} size={self.size}")


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_mask: torch.Tensor | None = None,
                  scale: float | None = None, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, H, S_Q, D]`` over ``k``/``v`` ``[B, H, S_K, D]`` and its log-sum-exp.

    ``key_mask``: bool ``[B, S_K]``, True = attend. Returns ``(out [B, H, S_Q, D] in q's dtype, lse [B, H, S_Q]
    fp32)``; a row whose keys are all masked has ``lse = -inf`` (its ``out`` is then meaningless, weighted 0).
    ``fused``: a kernel that returns the log-sum-exp (see the module docstring; the default where one applies) or
    fp32 matmuls.
    """
    if fused is None:
        fused = q.device.type == "cpu" or (q.device.type == "cuda" and key_mask is None
                                           and fused_lse_ok(q.device, q.dtype, q.shape[-1]))
    if fused and q.device.type == "cuda":
        if key_mask is not None:
            raise ValueError("the CUDA kernels' log-sum-exp is used without a key mask; give fused=False")
        return _cuda_lse(q, k, v, scale)
    if fused:
        bias = None
        if key_mask is not None:
            # B, S_K -> B, 1, 1, S_K additive float mask (the CPU kernel takes no bool mask with its lse)
            bias = torch.zeros(key_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~key_mask, float("-inf"))
            bias = bias[:, None, None, :]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)
        lse = lse.float()
    else:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # B, H, S_Q, S_K
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        out = torch.matmul(probs, v.float()).to(q.dtype)
    if key_mask is not None:
        # NOTE(empty-row): CPU flash attention returns lse 0 for a row with every key masked; no key, no weight.
        empty = ~key_mask.any(dim=1)  # B
        lse = lse.masked_fill(empty[:, None, None], float("-inf"))
    return out, lse


def _cuda_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A CUDA kernel's attention and log-sum-exp: flash attention for fp16/bf16, the memory-efficient kernel for fp32
    or where flash refuses the shape (its log-sum-exp is padded to a multiple of 32 queries: cut here)."""
    if q.dtype in (torch.float16, torch.bfloat16):
        try:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
            return out, lse.float()
        except RuntimeError:
            pass  # a head size or GPU flash attention does not take: the memory-efficient kernel does
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False,
                                                                      scale=scale)[:2]
    return out, lse[..., :q.shape[2]].float()


_FUSED_OK: dict[tuple[str, torch.dtype, int], bool] = {}


def fused_lse_ok(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this CUDA device's kernels give the log-sum-exp for ``dtype`` and ``head_dim``: a small problem (19
    queries over 45 keys, query rows not a multiple of 32) through :func:`_cuda_lse` against fp32 matmuls, once per
    process; a failure or a disagreement is logged once and answered ``False`` (the matmuls are used)."""
    key = (str(device), dtype, head_dim)
    if key not in _FUSED_OK:
        g = torch.Generator("cpu").manual_seed(0)
        q, k, v = (torch.randn(2, 3, n, head_dim, generator=g).to(device, dtype) for n in (19, 45, 45))
        try:
            with torch.inference_mode():
                out, lse = _cuda_lse(q, k, v, None)
                ref_out, ref_lse = attention_lse(q, k, v, fused=False)
            tol = 1e-3 if dtype == torch.float32 else 3e-2
            ok = lse.shape == ref_lse.shape and out.shape == ref_out.shape \
                and bool(torch.allclose(lse, ref_lse, atol=tol, rtol=tol)) \
                and bool(torch.allclose(out.float(), ref_out.float(), atol=tol, rtol=tol))
            why = "its result differs from fp32 matmuls"
        except RuntimeError as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            log.warning("ring attention on %s in %s (head size %d): no fused kernel gives the log-sum-exp (%s); the "
                        "blocks are attended with fp32 matmuls", device, dtype, head_dim, why)
        _FUSED_OK[key] = ok
    return _FUSED_OK[key]


class BlockMerge:
    """The running merge of attention blocks over disjoint key sets, in fp32 (the max/exp form, see the module)."""

    def __init__(self, like: torch.Tensor) -> None:
        """``like``: a query tensor ``[B, H, S_Q, D]`` (shape, device; the result takes its dtype)."""
        self._dtype = like.dtype
        self._m = torch.full(like.shape[:-1], float("-inf"), dtype=torch.float32, device=like.device)
        self._l = torch.zeros_like(self._m)
        self._acc = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        self._empty = True

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge one block's normalised output ``[B, H, S_Q, D]`` and its log-sum-exp ``[B, H, S_Q]``."""
        if self._empty:  # the first block: weight 1 relative to itself (0 on rows it left without a key)
            self._empty = False
            live = ~torch.isneginf(lse)
            self._m = lse.float()
            self._l = live.float()
            self._acc = torch.where(live[..., None], out.float(), 0.0)
            return
        m = torch.maximum(self._m, lse)
        m_safe = torch.where(torch.isinf(m), 0.0, m)  # m = -inf: both weights below are exp(-inf) = 0
        old = torch.exp(self._m - m_safe)
        new = torch.exp(lse - m_safe)
        self._acc.mul_(old[..., None]).add_(out.float() * new[..., None])
        self._l.mul_(old).add_(new)
        self._m = m

    def result(self) -> torch.Tensor:
        """The merged attention ``[B, H, S_Q, D]`` in the query dtype; 0 on rows no block attended."""
        denom = torch.where(self._l > 0, self._l, 1.0)
        return (self._acc / denom[..., None]).to(self._dtype)

    @property
    def lse(self) -> torch.Tensor:
        """The log-sum-exp over every merged key, ``[B, H, S_Q]`` fp32 (-inf where no key was attended)."""
        return self._m + torch.log(torch.where(self._l > 0, self._l, 1.0))


@torch.compiler.disable  # point-to-point sends do not trace: a compiled block runs the ring eagerly
def ring_attention(q: torch.Tensor, kv: torch.Tensor, *, ring: RingGroup, kv_len: int,
                   key_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the keys/values of every ring block.

    ``q``: ``[B, H, S_Q, D]``, this rank's queries (any ring block's; padding rows get finite values).
    ``kv``: ``[2, B, H, BLOCK, D]``, contiguous: keys and values of ring block ``ring.rank`` (padding included); it
    is sent on as is and its memory reused for a later block.
    ``kv_len``: real keys in the whole sequence (``R * BLOCK`` padded); ``key_mask``: optional bool ``[B, kv_len]``.
    Returns ``[B, H, S_Q, D]`` in q's dtype.
    """
    if torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad):
        raise ValueError("ring attention runs inference only (its point-to-point receives are not differentiable); "
                         "run under torch.no_grad()/inference_mode, or with ring_degree 1")
    if kv.ndim != 5 or kv.shape[0] != 2 or not kv.is_contiguous():
        raise ValueError(f"kv must be a contiguous [2, B, H, BLOCK, D] tensor; got {list(kv.shape)}")
    block = kv.shape[3]
    if not 0 < kv_len <= ring.size * block:
        raise ValueError(f"kv_len={kv_len} must be in [1, {ring.size} blocks x {block}]")
    if key_mask is not None and tuple(key_mask.shape) != (q.shape[0], kv_len):
        raise ValueError(f"key_mask must be bool [B, kv_len]=[{q.shape[0]}, {kv_len}]; got {list(key_mask.shape)}")
    merge = BlockMerge(q)
    buffers = (kv, torch.empty_like(kv))
    send_to, recv_from = (ring.rank + 1) % ring.size, (ring.rank - 1) % ring.size
    for step in range(ring.size):
        held, spare = buffers[step % 2], buffers[(step + 1) % 2]
        pending = []
        if step < ring.size - 1:  # pass the held block on while attending it
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, held, group=ring.group, group_peer=send_to),
                dist.P2POp(dist.irecv, spare, group=ring.group, group_peer=recv_from),
            ])
        j = (ring.rank - step) % ring.size  # the block held at this step
        start = j * block
        real = min(block, kv_len - start)  # its padded keys are its tail
        if real > 0:
            mask = None if key_mask is None else key_mask[:, start:start + real]
            if mask is None or mask.any():
                out, lse = attention_lse(q, held[0, :, :, :real], held[1, :, :, :real], key_mask=mask, scale=scale)
                merge.add(out, lse)
        for work in pending:
            work.wait()
    return merge.result()
