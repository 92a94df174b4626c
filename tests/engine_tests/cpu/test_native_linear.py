"""The native few-row linear (``cpu/csrc/skinny_linear.c``) and its router
(``cpu/linear.py``).

The kernel must compute ``x @ W.T + b`` to rounding (another summation order than the BLAS:
compared with a float64 product at 1e-5 relative to the size of the terms, where fp32 rounding
is ~1e-7) for every tile shape and tail (rows 1-16 across row groups of at most 6, odd N
across the 2-row tiles, K not a multiple of the 8 lanes) and in the blocked order above 16 rows
(blocks of W, K in chunks of 512), give a row the same bits whatever rows, loop order and thread
count surround it, and refuse tensors it cannot read with ``ValueError``. The router must send
only fp32 inference calls of at most ``MAX_ROWS`` rows to it and everything else to torch
unchanged. The HF equivalence suite (``test_llm_equivalence.py``) runs through it: on CPU every
engine routes its fp32 linears (checked below).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quire_engine.cpu import linear as linear_cpu
from quire_engine.cpu import native
from tests.engine_tests.toolchain import require_native_kernels

TOL = 1e-5


@pytest.fixture(scope="module")
def kernel() -> native.SkinnyLinear:
    require_native_kernels()
    built = native.skinny_linear()
    assert built is not None
    return built


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    err = ((got.double() - exact).abs() / scale.clamp_min(1e-30)).max().item()
    assert err < TOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 16, 17, 19, 23, 25, 40])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (2, 8), (3, 7), (37, 100), (64, 512), (5, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_a_float64_product(
    kernel: native.SkinnyLinear, rows: int, n: int, k: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    out = torch.full((rows, n), float("nan"))
    kernel(x, w, b, out)
    _close(out, x, w, b)


def test_strided_rows_and_output(kernel: native.SkinnyLinear) -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(14, 40, generator=gen)
    x = base[::2, 3:35]  # row stride 80, K contiguous
    w = torch.randn(11, 32, generator=gen)
    # 1-4 rows: the tiles wide in W (8, 4, 4, 3); 5-6: 2-row tiles (their own ones with
    # AVX-512); 7: two row groups.
    for rows in range(1, 8):
        wide = torch.full((rows, 20), float("nan"))
        out = wide[:, 4:15]  # row stride 20, N contiguous
        kernel(x[:rows], w, None, out)
        _close(out, x[:rows], w, None)
        assert wide[:, :4].isnan().all() and wide[:, 15:].isnan().all(), "wrote outside out"


def test_each_row_is_independent_of_batch_and_threads(kernel: native.SkinnyLinear) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 300, generator=gen)
    w = torch.randn(45, 300, generator=gen)
    b = torch.randn(45, generator=gen)
    full = torch.empty(16, 45)
    kernel(x, w, b, full)
    # Every tile shape: 1-4 rows (wide in W), one group of 5-6 (with AVX-512, 1-6 rows keep
    # their accumulators as 8-lane halves and 7 or more do not: the same bits either way),
    # groups of near-equal sizes (7 rows: 4 + 3; 11: 6 + 5; 16: 6 + 5 + 5).
    slices: tuple[range, ...] = (
        range(1), range(3, 4), range(2, 4), range(4, 7), range(8, 12), range(0, 5)
    )  # fmt: skip
    slices = (*slices, range(5, 12))
    for rows in (*slices, range(10, 16), range(1, 8), range(0, 11)):
        part = torch.empty(len(rows), 45)
        kernel(x[rows.start : rows.stop], w, b, part, num_threads=2)
        assert torch.equal(part, full[rows.start : rows.stop]), f"rows {rows} changed bits"


@pytest.mark.parametrize(("n", "k"), [(150, 1541), (131, 300), (9, 5)])
def test_the_blocked_order_gives_each_row_the_same_bits(
    kernel: native.SkinnyLinear, n: int, k: int
) -> None:
    """40 rows run blocked: W in blocks (150 x 1541: 20-row blocks, K in three 512-float chunks
    and a 5-float tail; 131 x 300: two 64-row blocks and a 3-row one, its last tile one row;
    9 x 5: no vector part at all). Each row must be the bits it gets alone (one row: the
    unblocked order) and in a 16-row call (6-row groups, unblocked), on one thread or two."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(40, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    full = torch.empty(40, n)
    kernel(x, w, b, full)
    _close(full, x, w, b)
    two = torch.empty(40, n)
    kernel(x, w, b, two, num_threads=2)
    assert torch.equal(two, full), "two threads changed bits"
    first = torch.empty(16, n)
    kernel(x[:16], w, b, first)
    assert torch.equal(first, full[:16]), "the unblocked 16-row call differs"
    for row in range(40):
        alone = torch.empty(1, n)
        kernel(x[row : row + 1], w, b, alone)
        assert torch.equal(alone, full[row : row + 1]), f"row {row} changed bits"


def test_refuses_tensors_it_cannot_read(kernel: native.SkinnyLinear) -> None:
    x, w, out = torch.randn(2, 8), torch.randn(3, 8), torch.empty(2, 3)
    with pytest.raises(ValueError, match="does not fit"):
        kernel(x, torch.randn(3, 9), None, out)
    with pytest.raises(ValueError, match="does not fit"):
        kernel(x, w, None, torch.empty(2, 4))
    with pytest.raises(ValueError, match="fp32"):
        kernel(x.double(), w.double(), None, out.double())
    with pytest.raises(ValueError, match="fp32"):
        kernel(x, w, torch.zeros(3, dtype=torch.float64), out)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(x, torch.randn(8, 3).T, None, out)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(torch.randn(8, 2).T, w, None, out)
    with pytest.raises(ValueError, match="bias"):
        kernel(x, w, torch.zeros(4), out)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        kernel(x[0], w, None, out)


def test_router_sends_few_fp32_rows_to_the_kernel_and_the_rest_to_torch(
    kernel: native.SkinnyLinear,
) -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 40), torch.nn.Linear(40, 7, bias=False), torch.nn.Linear(7, 3)
    )
    model[2].double()  # float64 weights: the kernel cannot read them, so never routed
    big: list[int] = []

    def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        big.append(x.numel() // x.shape[-1])
        return F.linear(x, w, b)

    assert linear_cpu.install(model, kernel, gemm) == 2
    assert linear_cpu.install(model, kernel, gemm) == 0, "installing twice routes nothing twice"
    assert [linear_cpu.routed(m) for m in model] == [True, True, False]
    calls: list[int] = []
    real = kernel._fn

    def counting(*args: object) -> None:
        calls.append(int(args[2]))  # type: ignore[call-overload]
        real(*args)

    kernel._fn = counting  # type: ignore[assignment]
    try:
        first = model[0]
        assert isinstance(first, torch.nn.Linear)
        with torch.inference_mode():
            few = torch.randn(2, 8, 24)  # 16 rows: the kernel
            got = first(few)
            assert got.shape == (2, 8, 40) and calls == [16]
            _close(got.reshape(16, 40), few.reshape(16, 24), first.weight, first.bias)
            many = torch.randn(linear_cpu.MAX_ROWS + 1, 24)  # the GEMM, bit for bit
            assert torch.equal(first(many), F.linear(many, first.weight, first.bias))
            assert big == [linear_cpu.MAX_ROWS + 1]
            with pytest.raises(RuntimeError):  # float64 input: torch's own dtype error
                first(torch.randn(3, 24, dtype=torch.float64))
            assert calls == [16]
        # Autograd keeps torch's path, so gradients still flow.
        x = torch.randn(3, 24, requires_grad=True)
        first(x).sum().backward()
        y = torch.randn(linear_cpu.MAX_ROWS + 1, 24, requires_grad=True)
        first(y).sum().backward()
        assert x.grad is not None and y.grad is not None
        assert calls == [16] and big == [linear_cpu.MAX_ROWS + 1]
    finally:
        kernel._fn = real


def test_the_gemm_above_the_few_row_range_matches_torch() -> None:
    gemm = linear_cpu.gemm()
    if torch.backends.mkldnn.is_available():  # the official wheels' case: oneDNN's linear
        assert gemm is not F.linear
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen)
    for shape in ((17, 80), (3, 64, 80), (1, 300, 80)):  # prefill chunks arrive as [1, T, K]
        x = torch.randn(shape, generator=gen)
        for bias in (b, None):
            with torch.inference_mode():
                got = gemm(x, w, bias)
            # Another summation order than MKL's: equal within float32 rounding of 80 terms.
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert got.shape == want.shape and got.dtype == torch.float32
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)


class _Scaled(torch.nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(input)


def test_router_leaves_linears_with_another_forward_alone(kernel: native.SkinnyLinear) -> None:
    hooked = torch.nn.Linear(4, 4)
    hooked.forward = lambda input: input  # type: ignore[method-assign]  # e.g. an offload hook
    scaled = _Scaled(4, 4)
    model = torch.nn.Sequential(scaled, hooked, torch.nn.Linear(4, 4))
    assert linear_cpu.install(model, kernel) == 1
    assert [linear_cpu.routed(m) for m in model] == [False, False, True]
    x = torch.randn(2, 4)
    with torch.inference_mode():
        assert torch.equal(model[0](x), 2 * F.linear(x, scaled.weight, scaled.bias))
        assert model[1](x) is x


def test_router_rechecks_the_weight_and_width_at_every_call(kernel: native.SkinnyLinear) -> None:
    lin = torch.nn.Linear(6, 5)
    assert linear_cpu.install(lin, kernel) == 1
    x = torch.randn(3, 6)
    with torch.inference_mode():
        with pytest.raises(RuntimeError):  # a wrong width: torch's own error, never a C read
            lin(torch.randn(3, 7))
        lin.double()  # float64 in place (same parameters): no longer readable, torch's path
        assert torch.equal(lin(x.double()), F.linear(x.double(), lin.weight, lin.bias))
        lin.float()
        lin.weight.data = torch.randn(6, 5).T  # non-contiguous: torch's path, bit for bit
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_engine_runner_routes_its_linears_on_cpu(kernel: native.SkinnyLinear) -> None:
    from quire_engine import LLM, SamplingParams

    llm = LLM(device="cpu", num_blocks=64, max_model_len=64)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert llm.engine.runner.native_linears == len(linears) > 0
    assert all(linear_cpu.routed(m) for m in linears)
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_bench_linear_small(kernel: native.SkinnyLinear) -> None:
    from quire_engine.bench import linear as linear_bench
    from quire_engine.cli import build_parser

    argv = ["bench", "linear", "--hidden-size", "64", "--layers", "1", "--vocab-size", "128"]
    argv += ["--rows", "1,3", "--warmup", "0", "--iters", "1"]
    result = linear_bench.run(build_parser(argv).parse_args(argv))
    assert result["num_linears"] == 8  # q, k, v, o, gate, up, down, LM head
    assert sorted(result["by_rows"]) == ["1", "3"]
    for entry in result["by_rows"].values():
        assert entry["max_rel_diff"] < TOL
        assert entry["torch_ms"] > 0 and entry["native_ms"] > 0 and entry["speedup"] > 0
    bad = ["bench", "linear", "--rows", "0"]
    with pytest.raises(ValueError, match="--rows"):
        linear_bench.run(build_parser(bad).parse_args(bad))
