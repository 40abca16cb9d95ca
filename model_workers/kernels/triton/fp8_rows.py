"""The FP8 row writer as a Triton kernel: [T, q + p] computed keys -> the FP8 row layout of
kernels/torch/fp8_rows.py ([q float8_e4m3fn | ceil(q/128) float32 scales | p bf16] as bytes), bit for bit the
torch encoder's bytes.

Every rounding step is spelled out in integer operations on the float32 bits, so the bytes are the same on a GPU
and in Triton's interpreter (whose own float8 / bf16 casts round differently):
- the scale is 2^ceil(log2(amax / 448)) read off the bits of the correctly rounded ratio (`div_rn`, as torch
  divides), subnormal ratios included; 1 for an all-zero block (and, as torch's frexp gives, for inf / NaN);
- values are divided by it with `div_rn` (exact: a power of two) and rounded to e4m3 nearest-even as c10's
  float8 constructor does (NaN at 480 and above, subnormals by the 2^14 add);
- the trailing p values are rounded to bf16 nearest-even on their bits (NaN stays NaN).
`TritonFp8Rows` encodes with the kernel and decodes with the torch code; `TritonRowCodecs` hands out the formats.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_workers.kernels.torch.fp8_rows import Fp8Rows, PlainRows
from model_workers.kernels.triton.launch import pow2

BLOCK_T = 16  # rows per program
NUM_WARPS = 4


@triton.jit
def _pow2_scale_bits(ratio):
    """float32 ratio >= 0 [...] -> int32 bits of the smallest power of two >= ratio (1.0 for 0, inf and NaN)."""
    bits = ratio.to(tl.int32, bitcast=True)
    exp_field = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    normal_exp = exp_field - 127 + (mant != 0).to(tl.int32)  # 1.m · 2^(E-127): ceil(log2)
    # a subnormal is mant · 2^-149; mant < 2^23 converts to float32 exactly, and its bits give mant's top bit
    mant_bits = mant.to(tl.float32).to(tl.int32, bitcast=True)
    top_bit = ((mant_bits >> 23) & 0xFF) - 127
    subnormal_exp = top_bit - 149 + ((mant_bits & 0x7FFFFF) != 0).to(tl.int32)
    exponent = tl.where(exp_field == 0, subnormal_exp, normal_exp)
    exponent = tl.where((bits == 0) | (exp_field == 0xFF), 0, exponent)
    subnormal_shift = tl.minimum(tl.maximum(exponent + 149, 0), 22)  # 2^e below 2^-126 is bit e + 149
    return tl.where(exponent >= -126, (exponent + 127) << 23, 1 << subnormal_shift)


@triton.jit
def _e4m3_bits(values):
    """float32 [...] -> int32 in [0, 255]: the float8_e4m3fn byte, rounded nearest-even (c10's conversion)."""
    bits = values.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # below 2^-6 (e4m3's smallest normal): add 2^14 in float32, whose ulp there is e4m3's subnormal step 2^-9
    small = (tl.abs(values) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    mant_odd = (magnitude >> 20) & 1
    normal = (magnitude - (120 << 23) + 0x7FFFF + mant_odd) >> 20  # rebias 127 -> 7, round the 20 dropped bits
    byte = tl.where(magnitude < (121 << 23), small, normal)
    byte = tl.where(magnitude >= (1087 << 20), 0x7F, byte)  # 480 and above, inf, NaN -> NaN
    return byte | sign


@triton.jit
def _bf16_bits(values):
    """float32 [...] -> int32 in [0, 0xFFFF]: the bfloat16 bits, rounded nearest-even (NaN kept quiet)."""
    bits = values.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, ((bits >> 16) & 0xFFFF) | 0x40, rounded)


@triton.jit
def _encode_kernel(rows_ptr, out_ptr, out32_ptr, out16_ptr, num_rows, row_stride, Q: tl.constexpr,
                   P: tl.constexpr, NUM_BLOCKS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_P: tl.constexpr):
    """BLOCK_T rows: each 128-value block's scale and e4m3 bytes, then the bf16 tail. out8 / out32 / out16 are the
    same [T, WIDTH] bytes viewed as uint8 / int32 / int16."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    row_ok = t < num_rows
    t = t.to(tl.int64)
    src = rows_ptr + t[:, None] * row_stride  # [BT, 1]
    for b in range(NUM_BLOCKS):
        cols = b * 128 + tl.arange(0, 128)  # [128]
        ok = row_ok[:, None] & (cols < Q)[None, :]
        values = tl.load(src + cols[None, :], mask=ok, other=0.0).to(tl.float32)  # [BT, 128]
        amax = tl.max(tl.abs(values), axis=1)  # [BT]
        scale_bits = _pow2_scale_bits(tl.math.div_rn(amax, 448.0))  # [BT]
        scale = scale_bits.to(tl.float32, bitcast=True)
        codes = _e4m3_bits(tl.math.div_rn(values, tl.broadcast_to(scale[:, None], values.shape)))  # [BT, 128]
        tl.store(out_ptr + t[:, None] * WIDTH + cols[None, :], codes.to(tl.uint8), mask=ok)
        tl.store(out32_ptr + t * (WIDTH // 4) + Q // 4 + b, scale_bits, mask=row_ok)
    if P > 0:
        tail = tl.arange(0, BLOCK_P)  # [BP]
        ok = row_ok[:, None] & (tail < P)[None, :]
        values = tl.load(src + Q + tail[None, :], mask=ok, other=0.0).to(tl.float32)  # [BT, BP]
        dst = out16_ptr + t[:, None] * (WIDTH // 2) + (Q + 4 * NUM_BLOCKS) // 2 + tail[None, :]
        tl.store(dst, _bf16_bits(values).to(tl.int16), mask=ok)


def encode_rows(rows: torch.Tensor, quantized_dim: int, plain_dim: int, out: torch.Tensor | None = None,
                block_t: int = BLOCK_T) -> torch.Tensor:
    """[T, q + p] float rows -> [T, fp8_row_bytes(q, p)] uint8, the bytes of `Fp8Rows(q, p).encode(rows)`.
    out: a [T, width] uint8 buffer to write (every byte of its rows is written)."""
    layout = Fp8Rows(quantized_dim, plain_dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    if out is None:
        out = torch.empty((num_rows, layout.width), dtype=torch.uint8, device=rows.device)  # [T, width]
    if num_rows == 0:
        return out
    _encode_kernel[(triton.cdiv(num_rows, block_t),)](
        rows, out, out.view(torch.int32), out.view(torch.int16), num_rows, rows.stride(0), Q=quantized_dim,
        P=plain_dim, NUM_BLOCKS=layout.num_blocks, WIDTH=layout.width, BLOCK_T=block_t,
        BLOCK_P=pow2(plain_dim), num_warps=NUM_WARPS)
    return out


class TritonFp8Rows(Fp8Rows):
    """`Fp8Rows` whose encode is the Triton kernel (the same bytes); decode is the torch one."""

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """[T, q + p] computed keys (after RoPE) -> [T, width] uint8 rows."""
        return encode_rows(rows, self.quantized_dim, self.plain_dim)


class TritonRowCodecs:
    """`RowCodecs`: plain rows as the torch set keeps them, FP8 rows written by the kernel."""

    def plain(self, dim: int, dtype: torch.dtype) -> PlainRows:
        return PlainRows(dim, dtype)

    def fp8(self, quantized_dim: int, plain_dim: int) -> TritonFp8Rows:
        return TritonFp8Rows(quantized_dim, plain_dim)


def _compile_config(name: str, q: int, p: int, dtype: str = "bf16") -> dict:
    """The compile record of one launch: DeepSeek-V3.2's latent rows (512 + 64) or indexer keys (128)."""
    layout = Fp8Rows(q, p)
    cx = {"Q": q, "P": p, "NUM_BLOCKS": layout.num_blocks, "WIDTH": layout.width, "BLOCK_T": BLOCK_T,
          "BLOCK_P": pow2(p)}
    types = {"rows_ptr": f"*{dtype}", "out_ptr": "*u8", "out32_ptr": "*i32", "out16_ptr": "*i16",
             "num_rows": "i32", "row_stride": "i32", **{k: "constexpr" for k in cx}}
    return {"name": name, "kernel": _encode_kernel, "signature": {a: types[a] for a in _encode_kernel.arg_names},
            "constexprs": cx, "num_warps": NUM_WARPS, "num_stages": 1, "wgmma": False}


COMPILE_CONFIGS = [_compile_config("fp8_rows_latent_bf16", 512, 64), _compile_config("fp8_rows_index_key_bf16", 128, 0)]
