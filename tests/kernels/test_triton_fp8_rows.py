"""The Triton FP8 row writer (model_workers/kernels/triton/fp8_rows.py) against the torch encoder, byte for byte,
in Triton's interpreter on CPU (set in tests/conftest.py): all-zero blocks, huge, tiny and subnormal values,
ratios that are exact powers of two, every e4m3 value and every rounding tie, q not a multiple of 128, p = 0 and
p > 0, bf16 and strided input; outputs poisoned with 0xFF bytes first."""

from __future__ import annotations

import pytest
import torch

from model_workers.kernels.torch.fp8_rows import Fp8Rows, PlainRows
from model_workers.kernels.triton.fp8_rows import COMPILE_CONFIGS, TritonFp8Rows, TritonRowCodecs, encode_rows

POISON = 0xFF  # the byte of -NaN in e4m3: never written for finite rows


def poisoned(num_rows: int, layout: Fp8Rows) -> torch.Tensor:
    return torch.full((num_rows, layout.width), POISON, dtype=torch.uint8)


def varied_rows(num_rows: int, dim: int, seed: int) -> torch.Tensor:
    """[T, dim] float32: each 32-value run scaled by 10^u, u in [-44, 37] (subnormal to near float32's max), one
    all-zero run in every row, and runs whose max is 448 · 2^j exactly."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_rows, dim, generator=gen)
    runs = -(-dim // 32)
    exponents = torch.randint(-44, 38, (num_rows, runs), generator=gen).float()  # [T, runs]
    rows = rows * (10.0 ** exponents.double()).float().repeat_interleave(32, dim=1)[:, :dim]
    rows[:, 32:64] = 0.0
    for t in range(num_rows):
        rows[t, 0] = 448.0 * 2.0 ** (t % 40 - 20)  # an exact power-of-two ratio when it is the block's max
    return rows


@pytest.mark.parametrize("quantized_dim,plain_dim", [(512, 64), (128, 0), (200, 0), (200, 6), (4, 2)])
def test_encode_equals_the_torch_bytes(quantized_dim, plain_dim):
    layout = Fp8Rows(quantized_dim, plain_dim)
    rows = varied_rows(37, quantized_dim + plain_dim, seed=quantized_dim + plain_dim)
    got = encode_rows(rows, quantized_dim, plain_dim, out=poisoned(37, layout))
    assert torch.equal(got, layout.encode(rows))


def test_every_e4m3_value_and_every_rounding_tie():
    """Blocks with max 448 (scale 1): the 126 positive finite e4m3 values, their midpoints (ties to even),
    points just off them, and the same below e4m3's subnormal range, both signs."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # [127] ascending
    mids = (codes[1:] + codes[:-1]) / 2
    values = torch.cat([codes, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.tensor([2.0**-10, 2.0**-11])])
    values = torch.cat([values, -values])
    pad = -values.numel() % 127
    blocks = torch.cat([values, torch.zeros(pad)]).view(-1, 127)  # [n, 127]
    rows = torch.cat([torch.full((blocks.shape[0], 1), 448.0), blocks], dim=1)  # [n, 128]
    layout = Fp8Rows(128, 0)
    got = encode_rows(rows, 128, 0, out=poisoned(rows.shape[0], layout))
    assert torch.equal(got, layout.encode(rows))


def test_subnormal_and_huge_blocks():
    """A block whose amax / 448 is a float32 subnormal (its scale is one too), float32 subnormal inputs, and a
    block near float32's largest value."""
    rows = torch.zeros(4, 256)
    rows[0, :128] = torch.linspace(-1, 1, 128) * 1e-37
    rows[1, :128] = torch.linspace(-1, 1, 128) * 1e-44  # subnormal inputs
    rows[2, :128] = torch.linspace(-1, 1, 128) * 3.0e38
    rows[3, :128] = 2.0**-149
    rows[:, 128:] = torch.linspace(-5, 5, 128)
    layout = Fp8Rows(192, 64)
    assert torch.equal(encode_rows(rows, 192, 64, out=poisoned(4, layout)), layout.encode(rows))


def test_block_maxima_around_every_power_of_two():
    """Blocks whose max is 448 · 2^n moved by -3..3 ulps, n from -152 to 100: the ratio is then a power of two
    (normal or subnormal), just above or just below one; where torch's correctly rounded division decides."""
    maxima = torch.tensor([448.0 * 2.0**n for n in range(-152, 101)], dtype=torch.float64).float()  # [N]
    maxima = maxima[maxima > 0]
    bits = maxima.view(torch.int32)[:, None] + torch.arange(-3, 4, dtype=torch.int32)  # [N, 7]
    rows = bits.clamp(min=1).view(torch.float32).reshape(-1, 1) * torch.tensor([1.0, -0.5, 0.25, 0.0])  # [7N, 4]
    layout = Fp8Rows(4, 0)
    assert torch.equal(encode_rows(rows, 4, 0, out=poisoned(rows.shape[0], layout)), layout.encode(rows))


def test_bf16_tail_ties_round_to_even():
    """Tail values exactly halfway between two bf16 values, on even and odd neighbours, both signs."""
    gen = torch.Generator().manual_seed(6)
    halves = torch.randn(8, 64, generator=gen).to(torch.bfloat16).float().view(torch.int32) + 0x8000  # [8, 64]
    rows = torch.cat([torch.randn(8, 128, generator=gen), halves.view(torch.float32)], dim=1)
    layout = Fp8Rows(128, 64)
    assert torch.equal(encode_rows(rows, 128, 64, out=poisoned(8, layout)), layout.encode(rows))


def test_bf16_and_strided_rows():
    wide = varied_rows(9, 700, seed=5)
    rows = wide[:, 10:10 + 512 + 64]  # [T, 576], row stride 700
    layout = Fp8Rows(512, 64)
    assert torch.equal(encode_rows(rows, 512, 64), layout.encode(rows))
    bf16 = (torch.randn(9, 576) * 30).to(torch.bfloat16)
    assert torch.equal(encode_rows(bf16, 512, 64), layout.encode(bf16))
    assert encode_rows(bf16[:0], 512, 64).shape == (0, layout.width)


def test_the_row_codecs():
    codecs = TritonRowCodecs()
    assert codecs.plain(64, torch.bfloat16) == PlainRows(64, torch.bfloat16)
    fp8 = codecs.fp8(128, 64)
    assert isinstance(fp8, TritonFp8Rows) and isinstance(fp8, Fp8Rows)
    assert (fp8.width, fp8.dim) == (Fp8Rows(128, 64).width, 192)
    rows = torch.randn(3, 192)
    stored = fp8.encode(rows)
    assert torch.equal(stored, Fp8Rows(128, 64).encode(rows))
    assert torch.equal(fp8.decode(stored, torch.float32), Fp8Rows(128, 64).decode(stored, torch.float32))


def test_compile_configs_name_the_kernel_arguments_in_order():
    for config in COMPILE_CONFIGS:
        assert list(config["signature"]) == list(config["kernel"].arg_names)
        assert {k for k, v in config["signature"].items() if v == "constexpr"} == set(config["constexprs"])
