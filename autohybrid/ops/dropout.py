"""Dropout on a tensor-parallel shard that drops exactly the elements eager dropout drops.

Under tensor or sequence parallelism each rank of the tp group holds an equal slice of an
activation along one dim (heads, hidden features, or the sequence). Plain `aten.dropout`
on that shard would draw a shard-sized mask: a valid dropout, but not the one eager
PyTorch draws for the whole tensor, and (on CPU, where the draw consumes one generator
step per element) it also leaves the generator at another position, so every later
random op of the step diverges from eager too. The ops here instead draw the mask of the
FULL tensor exactly as eager would, with the same generator consumption, and keep this
rank's slice. With the same seed on every rank, every rank's generator then stays in step
with the eager run, the tp run drops exactly the elements eager drops, and the replicated
regions can keep plain `aten.dropout` (every rank draws the same full mask there).

    op                                                   returns
    sharded_dropout(x_shard, p, train, full_shape,       (out, mask): out = x_shard scaled by
                    dim, index, ways)                    this rank's slice of the full mask
    sharded_sdpa(q, k, v, attn_mask, dropout_p,          (out, mask): math-backend attention of
                 is_causal, scale, full_heads,           this rank's heads, attention-weight
                 index, ways)                            dropout sliced from the full
                                                         (B, full_heads, Tq, Tk) mask

`index` is this rank's position among `ways` equal slices (its tp rank); slices are in
rank order. Both ops return the bool mask slice as a second, non-differentiable output
because a custom op's autograd `setup_context` sees only inputs and outputs: the backward
needs the mask and cannot redraw it. Callers take `getitem 0`. Fake impls are registered,
so a pass can insert the ops as fx nodes. Bad shapes raise `RuntimeFailure`.

How eager draws the mask (checked against torch 2.13, see tests/test_sharded_dropout.py)
---------------------------------------------------------------------------------------
* CPU: `aten.dropout` (Dropout.cpp `_dropout_impl`) does `noise = empty_like(x)`,
  `noise.bernoulli_(1 - p)`, `noise.div_(1 - p)`, `x * noise`. The CPU `bernoulli_`
  draws element by element in memory order, independently of the dtype and of the thread
  count (a mask of n elements is the prefix of one of 2n), and advances the generator by
  an amount that depends on n. Drawing one full-shape `bernoulli_` and slicing
  it therefore reproduces eager bit for bit (the rounding too: `x * (m / (1 - p))`, not
  `x * m / (1 - p)`, which differs in the last bit). p == 0, train=False or an empty
  tensor: eager returns the input itself and draws nothing (these ops return a copy);
  p == 1: eager returns `x * 0` without drawing (inf and NaN give NaN, -x gives -0.).
  `empty_like` keeps the strides of a dense non-contiguous input and the draw follows
  memory order, so the ops assume the eager full tensor is contiguous (row-major), as
  activations produced by linear/matmul/softmax are.
* CUDA (also xpu, lazy, privateuse1): eager takes the fused `native_dropout` kernel
  (Philox 4x32-10; one `curand_uniform4` per 4 elements; the subsequence is the global
  thread id, the grid depends on numel and on the device's SM count, the vectorized or
  scalar kernel on alignment and contiguity; the generator offset advances by a count
  computed from that grid). `bernoulli_` runs another kernel and cannot reproduce it. So
  on those devices these ops call `native_dropout` itself on a fresh full-shape scratch
  tensor of the same dtype and device and keep its mask: the same kernel and launch as
  eager's, hence the same mask, provided eager's full tensor is contiguous and aligned
  (fresh allocations are); the output is `x * mask * (1 / (1 - p))` as that kernel
  computes it. This follows from the source only: no test here runs on a GPU.
* Exactness holds when the graph runs `aten.dropout` through the ordinary dispatcher (as
  an exported GraphModule does). Under torch's Python decompositions (inductor),
  `native_dropout` becomes `rand_like(x) > p`, which consumes the generator differently:
  neither plain nor sharded dropout is then eager-exact.

The trade-off
-------------
Each rank draws the whole mask: one full-size tensor of x's dtype (on CUDA also a
full-size scratch input and output plus a bool mask) and one full-size random draw per
call, i.e. `ways` times the memory and time of a shard's draw, transient (only the bool
slice is kept for backward). That is the price of exactness: the tp run reproduces the
eager run's dropout decisions, and the RNG stream of every rank stays where eager's is,
so losses and gradients can be compared with eager's step for step. The alternative,
per-shard scheme (Megatron's "model-parallel" RNG tracker: every tp rank draws only its
slice from its own generator, seeded with seed + tp rank) costs 1/ways of the draw and is
a statistically valid dropout, but it is NOT eager-exact: other elements are dropped, and
the generator positions differ from eager's, so no later random op matches either.

Scaled-dot-product attention with dropout
-----------------------------------------
On CPU, `F.scaled_dot_product_attention` with dropout_p > 0 always runs the math backend
(the CPU flash kernel rejects dropout; `torch._fused_sdp_choice` returns math): it scales
q by +-sqrt(scale) and k^T by sqrt(scale), matmuls, adds the (bool masks: 0/-inf; causal:
top-left `tril`) mask, `_safe_softmax`es, applies `aten.dropout` to the attention weights
of shape (B, H, Tq, Tk) (so the CPU path above, on a contiguous tensor) and matmuls with
v (half/bfloat16 inputs are upcast to float32 unless fp16/bf16 reduction is allowed).
Heads are independent, so drawing the full (B, H, Tq, Tk) mask and slicing heads
reproduces eager; `sharded_sdpa` does that with the same op sequence, and its backward
(recomputing the softmax rather than saving it) applies autograd's formulas. On CUDA
eager SDPA picks flash / memory-efficient / cuDNN kernels whose in-kernel dropout RNG is
tied to (batch, head) coordinates and the kernel's own Philox layout: `sharded_sdpa`
matches eager there only when eager is forced onto the math backend.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import RuntimeFailure

#: Device types on which eager `aten.dropout` takes the fused `native_dropout` kernel
#: (Dropout.cpp `is_fused_kernel_acceptable`; the privateuse1 backend may be renamed).
_FUSED_DEVICE_TYPES = frozenset({"cuda", "xpu", "lazy", "privateuseone"})


def _fused(device: torch.device, p: float) -> bool:
    return 0 < p < 1 and (device.type in _FUSED_DEVICE_TYPES
                          or device.type == torch._C._get_privateuse1_backend_name())


def _check_p(op: str, p: float) -> None:
    if not 0 <= p <= 1:
        raise RuntimeFailure(f"autohybrid::{op}: dropout probability {p} is not in [0, 1]")


def _check_slice(op: str, shard_shape: Sequence, full_shape: Sequence, dim: int,
                 index: int, ways: int, what: str = "x_shard") -> int:
    """Validate that `shard_shape` is slice `index` of `ways` along `dim`; returns dim >= 0."""
    shard, full = list(shard_shape), list(full_shape)
    if ways < 1 or not 0 <= index < ways:
        raise RuntimeFailure(f"autohybrid::{op}: index {index} is not a slice of {ways} ways; "
                             f"pass the tp rank (0 <= index < ways) and the tp size (>= 1)")
    if len(full) != len(shard):
        raise RuntimeFailure(f"autohybrid::{op}: full_shape {tuple(full)} has {len(full)} "
                             f"dims but {what} of shape {tuple(shard)} has {len(shard)}")
    if not -len(shard) <= dim < len(shard):
        raise RuntimeFailure(f"autohybrid::{op}: dim {dim} is out of range for {what} of "
                             f"shape {tuple(shard)}")
    dim %= len(shard)
    for d, (s, f) in enumerate(zip(shard, full)):
        want = s * ways if d == dim else s
        if f != want:
            raise RuntimeFailure(
                f"autohybrid::{op}: full_shape {tuple(full)} does not match {what} of shape "
                f"{tuple(shard)} split {ways} ways along dim {dim}: dim {d} should be "
                f"{want}, got {f}")
    return dim


def _draw(full_shape: Sequence, dtype: torch.dtype, device: torch.device, p: float
          ) -> torch.Tensor:
    """The full mask eager dropout draws (0 < p < 1): 0/1 in `dtype`, or bool when fused."""
    if _fused(device, p):
        scratch = torch.empty(list(full_shape), dtype=dtype, device=device)
        return torch.ops.aten.native_dropout(scratch, p, True)[1]
    noise = torch.empty(list(full_shape), dtype=dtype, device=device)
    return noise.bernoulli_(1 - p)


def _apply(t: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """`t` times the dropout noise of `mask` (0/1 or bool), rounded as eager rounds it.

    Used for the forward on the input and for the backward on the gradient: eager's
    backward multiplies the gradient by the same noise (MulBackward) on CPU, and by
    mask * scale (native_dropout_backward) when fused.
    """
    if p == 1:
        return t * mask.to(t.dtype)  # eager: x * 0, and grad * 0
    if _fused(t.device, p):
        return t * mask * (1.0 / (1.0 - p))
    return t * mask.to(t.dtype).div(1 - p)  # eager: noise.div_(1 - p), then x * noise


def _identity(p: float, train: bool, numel) -> bool:
    return p == 0 or not train or numel == 0


# ================================================================== sharded dropout

@torch.library.custom_op("autohybrid::sharded_dropout", mutates_args=())
def sharded_dropout(x_shard: torch.Tensor, p: float, train: bool, full_shape: list[int],
                    dim: int, index: int, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice `index` of eager dropout on the full tensor; returns (out, bool mask slice)."""
    _check_p("sharded_dropout", p)
    dim = _check_slice("sharded_dropout", x_shard.shape, full_shape, dim, index, ways)
    if _identity(p, train, math.prod(full_shape)):
        return (x_shard.clone(memory_format=torch.contiguous_format),
                torch.ones_like(x_shard, dtype=torch.bool))
    if p == 1:
        return x_shard * x_shard.new_zeros(()), torch.zeros_like(x_shard, dtype=torch.bool)
    size = x_shard.shape[dim]
    mask = _draw(full_shape, x_shard.dtype, x_shard.device, p).narrow(dim, index * size, size)
    return _apply(x_shard, mask, p), mask.to(torch.bool)


@sharded_dropout.register_fake
def _(x_shard, p, train, full_shape, dim, index, ways):
    _check_p("sharded_dropout", p)
    _check_slice("sharded_dropout", x_shard.shape, full_shape, dim, index, ways)
    return torch.empty_like(x_shard), torch.empty_like(x_shard, dtype=torch.bool)


def _dropout_setup_context(ctx, inputs, output) -> None:
    _, mask = output
    ctx.mark_non_differentiable(mask)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(mask)
    ctx.p, ctx.identity = inputs[1], _identity(inputs[1], inputs[2], math.prod(inputs[3]))


def _dropout_backward(ctx, grad_out, _grad_mask):
    grad = grad_out if ctx.identity or grad_out is None \
        else _apply(grad_out, ctx.saved_tensors[0], ctx.p)
    return grad, None, None, None, None, None, None


sharded_dropout.register_autograd(_dropout_backward, setup_context=_dropout_setup_context)


# ================================================================== sharded SDPA

def _acc(t: torch.Tensor) -> torch.Tensor:
    """The math backend's upcast of half/bfloat16 inputs (unless reduction is allowed)."""
    if t.dtype in (torch.float16, torch.bfloat16) \
            and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        return t.to(torch.float32)
    return t


def _scaling(q: torch.Tensor, scale: float | None) -> tuple[float, float]:
    """(factor for q, factor for k^T): the square root of |scale|, q's negated if scale < 0."""
    negative = scale is not None and scale < 0
    base = abs(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    root = math.sqrt(base)
    return (-root if negative else root), root


def _additive_mask(attn_mask: torch.Tensor | None, is_causal: bool, q: torch.Tensor,
                   k: torch.Tensor) -> torch.Tensor | None:
    """The float mask the math backend adds to the scores (bool: 0 where True, else -inf)."""
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                               device=q.device).tril()
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    zero = torch.scalar_tensor(0.0, dtype=q.dtype, device=q.device)
    return torch.where(attn_mask, zero, torch.scalar_tensor(-math.inf, dtype=q.dtype,
                                                            device=q.device))


def _sdpa_weights(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None,
                  is_causal: bool, scale: float | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    """(scaled q, scaled k^T, softmax weights, q factor, k factor) in the compute dtype."""
    q_acc, k_acc = _acc(q), _acc(k)
    q_factor, k_factor = _scaling(q_acc, scale)
    qs = q_acc * q_factor
    bias = _additive_mask(attn_mask, is_causal, qs, k_acc)
    kt = k_acc.transpose(-2, -1) * k_factor
    scores = torch.matmul(qs, kt)
    if bias is not None:
        scores.add_(bias)
    return qs, kt, torch.ops.aten._safe_softmax(scores, -1), q_factor, k_factor


def _check_sdpa(q, k, v, attn_mask, dropout_p, is_causal, full_heads, index, ways) -> None:
    _check_p("sharded_sdpa", dropout_p)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RuntimeFailure(
            f"autohybrid::sharded_sdpa: q, k, v must be 4-D (batch, heads, seq, head_dim), "
            f"got {q.dim()}-D, {k.dim()}-D and {v.dim()}-D")
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3] or k.shape[-1] != q.shape[-1]:
        raise RuntimeFailure(
            f"autohybrid::sharded_sdpa: q {tuple(q.shape)}, k {tuple(k.shape)} and v "
            f"{tuple(v.shape)} must share batch and heads (no grouped-query attention), k and "
            f"v the sequence, q and k the head dim")
    if is_causal and attn_mask is not None:
        raise RuntimeFailure("autohybrid::sharded_sdpa: pass attn_mask or is_causal, not both")
    full = [q.shape[0], full_heads, q.shape[2], q.shape[3]]
    _check_slice("sharded_sdpa", q.shape, full, 1, index, ways, what="q")


@torch.library.custom_op("autohybrid::sharded_sdpa", mutates_args=())
def sharded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
                 scale: float | None, full_heads: int, index: int, ways: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Math-backend SDPA of this rank's heads with eager's full-shape dropout mask sliced on
    heads; returns (out, bool mask slice of shape (B, heads, Tq, Tk))."""
    _check_sdpa(q, k, v, attn_mask, dropout_p, is_causal, full_heads, index, ways)
    _, _, weights, _, _ = _sdpa_weights(q, k, attn_mask, is_causal, scale)
    if dropout_p > 0:
        if dropout_p == 1:
            mask = torch.zeros_like(weights, dtype=torch.bool)
        else:
            heads = q.shape[1]
            full = [weights.shape[0], full_heads, *weights.shape[2:]]
            mask = _draw(full, weights.dtype, weights.device, dropout_p).narrow(
                1, index * heads, heads)
        weights = _apply(weights, mask, dropout_p)
        mask = mask.to(torch.bool)
    else:
        mask = torch.ones_like(weights, dtype=torch.bool)
    return torch.matmul(weights, _acc(v)).to(q.dtype), mask


@sharded_sdpa.register_fake
def _(q, k, v, attn_mask, dropout_p, is_causal, scale, full_heads, index, ways):
    _check_sdpa(q, k, v, attn_mask, dropout_p, is_causal, full_heads, index, ways)
    b, h, tq, tk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    return q.new_empty(b, h, tq, v.shape[-1]), q.new_empty(b, h, tq, tk, dtype=torch.bool)


def _sdpa_setup_context(ctx, inputs, output) -> None:
    q, k, v, attn_mask, dropout_p, is_causal, scale, *_ = inputs
    _, mask = output
    ctx.mark_non_differentiable(mask)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, attn_mask, mask)
    ctx.dropout_p, ctx.is_causal, ctx.scale = dropout_p, is_causal, scale


def _sdpa_backward(ctx, grad_out, _grad_mask):
    """Autograd's formulas for the forward's op sequence; the softmax is recomputed."""
    if grad_out is None:
        return (None,) * 10
    q, k, v, attn_mask, mask = ctx.saved_tensors
    qs, kt, weights, q_factor, k_factor = _sdpa_weights(q, k, attn_mask, ctx.is_causal,
                                                        ctx.scale)
    v_acc = _acc(v)
    grad = grad_out.to(v_acc.dtype)
    dropped = _apply(weights, mask, ctx.dropout_p) if ctx.dropout_p > 0 else weights
    grad_v = torch.matmul(dropped.transpose(-2, -1), grad).to(v.dtype)
    grad_w = torch.matmul(grad, v_acc.transpose(-2, -1))
    if ctx.dropout_p > 0:
        grad_w = _apply(grad_w, mask, ctx.dropout_p)
    grad_s = torch.ops.aten._softmax_backward_data(grad_w, weights, -1, weights.dtype)
    grad_q = (torch.matmul(grad_s, kt.transpose(-2, -1)) * q_factor).to(q.dtype)
    grad_k = (torch.matmul(qs.transpose(-2, -1), grad_s) * k_factor).transpose(-2, -1)
    grad_mask = None
    if attn_mask is not None and ctx.needs_input_grad[3]:
        grad_mask = grad_s.sum_to_size(attn_mask.shape).to(attn_mask.dtype)
    return grad_q, grad_k.to(k.dtype), grad_v, grad_mask, None, None, None, None, None, None


sharded_sdpa.register_autograd(_sdpa_backward, setup_context=_sdpa_setup_context)
