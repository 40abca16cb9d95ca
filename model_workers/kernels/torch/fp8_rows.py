"""The row codecs of the KV cache (the torch reference): plain rows of a float dtype, or the FP8 layout.

`--kv-cache-dtype` picks one per cache (model_workers/kv_format.py): `auto` and `bfloat16` store plain rows
(`PlainRows`), `fp8_e4m3` stores each token as one row of bytes (`Fp8Rows`, docs/kv_cache.md, 'FP8 layout'):

    [ q FP8 e4m3 values | ceil(q / 128) float32 scales | p bfloat16 values ]

The first q values (the latent c_kv, or the whole indexer key) are quantized in blocks of 128, one scale per
block; the trailing p values (the latent's k_pe) stay bf16. At DeepSeek-V3.2's shapes a latent row is
512 + 4·4 + 64·2 = 656 bytes (FlashMLA's sparse FP8 token) and an indexer key 128 + 4 = 132 bytes.

A scale is the power of two 2^ceil(log2(amax / 448)) of its block (448: e4m3's largest finite value), as
DeepSeek's `ue8m0` scale format: dividing by it is exact, so a token's bytes depend only on its own values
(CP, batch composition and the rank that computes it cannot change them). Encoding happens once, on the
rank that computes the token, after RoPE; the CP gathers and the cache move the bytes, and readers decode
only the rows they gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_BLOCK = 128  # FP8 values per float32 scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES, PLAIN_BYTES = 4, 2  # float32 scale, bfloat16 trailing value


def fp8_row_bytes(quantized_dim: int, plain_dim: int = 0) -> int:
    """Bytes of one token in the FP8 layout: q FP8 values, their float32 scales, p bf16 values."""
    return quantized_dim + SCALE_BYTES * -(-quantized_dim // FP8_BLOCK) + PLAIN_BYTES * plain_dim


@dataclass(frozen=True)
class PlainRows:
    """Keys stored as they are, in `dtype` (float32 or bfloat16): [slots, dim]."""

    dim: int
    dtype: torch.dtype

    @property
    def width(self) -> int:
        return self.dim

    @property
    def store_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.dim * self.dtype.itemsize

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """[T, dim] computed keys -> [T, dim] stored rows."""
        return rows.to(self.dtype)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., dim] stored rows -> [..., dim] in `dtype`."""
        return stored.to(dtype)


@dataclass(frozen=True)
class Fp8Rows:
    """Keys stored in the FP8 layout of the module docstring: [slots, fp8_row_bytes(q, p)] uint8."""

    quantized_dim: int  # leading values stored FP8 e4m3 (c_kv, or the whole indexer key)
    plain_dim: int = 0  # trailing values stored bfloat16 (k_pe)

    def __post_init__(self):
        if self.quantized_dim % SCALE_BYTES or self.quantized_dim <= 0:
            raise ValueError(f"the fp8_e4m3 KV cache needs a positive FP8 part divisible by {SCALE_BYTES} "
                             f"(its float32 scales follow it in the row), got {self.quantized_dim}")
        if self.plain_dim % 2:
            raise ValueError(f"the fp8_e4m3 KV cache needs an even bf16 part (qk_rope_head_dim), got {self.plain_dim}")

    @property
    def num_blocks(self) -> int:
        return -(-self.quantized_dim // FP8_BLOCK)

    @property
    def dim(self) -> int:
        return self.quantized_dim + self.plain_dim

    @property
    def width(self) -> int:
        return fp8_row_bytes(self.quantized_dim, self.plain_dim)

    @property
    def store_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def bytes_per_token(self) -> int:
        return self.width

    def _blocks(self, values: torch.Tensor) -> torch.Tensor:
        """[..., q] -> [..., num_blocks, FP8_BLOCK] (the last block zero-padded)."""
        pad = self.num_blocks * FP8_BLOCK - self.quantized_dim
        return torch.nn.functional.pad(values, (0, pad)).unflatten(-1, (self.num_blocks, FP8_BLOCK))

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """[T, q + p] computed keys (after RoPE) -> [T, width] uint8 rows."""
        rows = rows.float()
        blocks = self._blocks(rows[:, : self.quantized_dim])  # [T, nb, 128]
        scales = power_of_two_scales(blocks.abs().amax(dim=-1))  # [T, nb] float32
        fp8 = (blocks / scales[..., None]).to(torch.float8_e4m3fn).flatten(1)[:, : self.quantized_dim]  # [T, q]
        plain = rows[:, self.quantized_dim :].to(torch.bfloat16)  # [T, p]
        parts = (fp8.view(torch.uint8), scales.view(torch.uint8), plain.view(torch.uint8))
        return torch.cat(parts, dim=-1)  # [T, width]

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., width] uint8 rows -> [..., q + p] in `dtype`: FP8 values times their block's scale (exact products:
        the scales are powers of two), then k_pe, written into one output."""
        q, scales_end = self.quantized_dim, self.quantized_dim + SCALE_BYTES * self.num_blocks
        out = torch.empty((*stored.shape[:-1], self.dim), dtype=dtype, device=stored.device)
        fp8 = e4m3_over_256(stored[..., :q])  # [..., q] the FP8 values / 256
        scales = stored[..., q:scales_end].view(torch.float32) * 256  # [..., nb] (exact: a power of two)
        if self.num_blocks == 1:
            out[..., :q] = fp8 * scales  # one block: the scale broadcasts
        elif q % FP8_BLOCK == 0:
            out[..., :q] = (fp8.unflatten(-1, (self.num_blocks, FP8_BLOCK)) * scales[..., None]).flatten(-2)
        else:
            out[..., :q] = fp8 * scales.repeat_interleave(FP8_BLOCK, dim=-1)[..., :q]
        out[..., q:] = stored[..., scales_end:].view(torch.bfloat16)  # [..., p]
        return out


def e4m3_over_256(raw: torch.Tensor) -> torch.Tensor:
    """uint8 bytes of finite float8_e4m3fn values [...] -> float32 values / 256, exactly.

    The e4m3 bits s eeee mmm moved into a float16's sign, low exponent and high mantissa bits are the same
    number times 2^-8 (normal and subnormal alike: the exponent biases differ by 8); float16 -> float32 is
    exact. 4x faster on a CPU than torch's float8 -> float32 cast, which is not vectorized.
    """
    bits = raw.to(torch.int16)
    return (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).view(torch.float16).float()


def power_of_two_scales(amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two s with amax / s <= FP8_MAX, per block (1 for an all-zero block); float32."""
    mantissa, exponent = torch.frexp(amax.float() / FP8_MAX)  # ratio = mantissa · 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).int()  # an exact power of two is its own scale
    return torch.ldexp(torch.ones_like(mantissa), exponent)


KeyFormat = PlainRows | Fp8Rows
