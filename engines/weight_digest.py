"""Per-tensor weight digests: what an engine holds, compared with what the trainer pushed.

A logprob drift says that an engine and the actor disagree, not where. After each push the engine
reports a digest of every tensor it serves under its HF name, and the trainer computes the same of
each tensor it sent; a tensor whose two digests differ by more than its dtype's noise is named.

The digest of a tensor W is two numbers from one vector v: a 2-D weight [N, K] gives v = W @ x
with a fixed probe x of length K (what a linear layer computes, so an engine can produce it with
its own kernel, packed or fused, and a stale kernel copy is caught, not only a stale parameter);
any other tensor gives v = its values. The digest is (s . v, ||v||) with s a fixed +-1 pattern:
one row lost or changed moves s . v by its own size, and a fused tensor (vLLM's qkv_proj) splits
its output rows back into the HF tensors it holds. Probe and pattern are functions of the index
alone, so any length is the prefix of a longer one and both sides need nothing but this module.

`TOLERANCE`: the relative difference |s.v_engine - s.v_trainer| / ||v|| allowed per engine dtype.
Measured on CPU: a fp32 oneDNN kernel against torch's matmul differs by ~1e-6 (relative); a one-
step AdamW change at lr 1e-6 moves a typical weight's digest by ~5e-5, at lr 5e-5 by ~1e-3. In bf16
(fp16) an engine's kernel rounds each output to 8 (11) bits: ~2e-3 (3e-4) relative; there only a
tensor that is wrong by more than rounding (not sent, garbage, many steps stale) is named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch

TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 3e-3}
_SIGN_MULT = 2654435761  # Knuth's multiplicative hash: a bit of i * it is a well-mixed sign for index i


def probe(k: int, device: "torch.device | str" = "cpu") -> "torch.Tensor":
    """The probe vector of length k (float32), the same prefix for every length."""
    import torch

    i = torch.arange(k, dtype=torch.float64, device=device)
    return torch.cos(0.7 * i + 0.3).float()


def signs(n: int, device: "torch.device | str" = "cpu") -> "torch.Tensor":
    """The +-1 pattern of length n (float64), the same prefix for every length."""
    import torch

    i = torch.arange(n, dtype=torch.int64, device=device)
    return (1 - 2 * (((i * _SIGN_MULT) >> 13) & 1)).double()


def of_output(v: "torch.Tensor") -> tuple[float, float]:
    """The digest of a vector an engine computed (a layer's output rows for the probe, or raw values)."""
    v = v.detach().double().flatten()
    return float(signs(v.numel(), v.device) @ v), float(v.norm())


def probe_output(t: "torch.Tensor") -> "torch.Tensor":
    """The vector a tensor's digest is taken of: W @ probe for a 2-D weight, else its values."""
    if t.dim() == 2:
        return t.detach().float() @ probe(t.shape[1], t.device)
    return t.detach().flatten()


def of_tensor(t: "torch.Tensor") -> tuple[float, float]:
    """The digest of a tensor as held (the trainer's side, and an engine that holds HF tensors)."""
    return of_output(probe_output(t))


def compare(sent: dict[str, tuple[float, float]], held: dict[str, tuple[float, float]], dtype: str,
            tied: bool = False) -> tuple[list[tuple[str, float]], int]:
    """(tensors whose engine copy differs from what was sent, with the relative difference, largest
    first; how many tensors were compared). Compared: the names both sides have; with `tied` word
    embeddings an engine's `lm_head.weight` is compared with the sent embedding."""
    tol = TOLERANCE.get(dtype, TOLERANCE["float32"])
    alias = {}
    if tied and "lm_head.weight" not in sent:
        alias = {"lm_head.weight": next((n for n in sent if n.endswith("embed_tokens.weight")), "")}
    bad, compared = [], 0
    for name, (value, scale) in held.items():
        mine = sent.get(alias.get(name, name))
        if mine is None:
            continue
        compared += 1
        rel = abs(value - mine[0]) / max(mine[1], scale, 1e-30)
        if rel > tol:
            bad.append((name, rel))
    return sorted(bad, key=lambda b: -b[1]), compared


def digests(named: Iterable[tuple[str, "torch.Tensor"]]) -> dict[str, tuple[float, float]]:
    """The digest of every named tensor (an engine holding HF tensors reports these)."""
    return {name: of_tensor(t) for name, t in named}
