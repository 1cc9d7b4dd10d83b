"""The CUDA precision paths, run on the CPU: bf16 autocast (sm80+), fp16 autocast with dynamic loss scaling
(below sm80), and the SDPA attention kernels under both, against float32.

A GPU runs these same programs (`vgraph train` picks the dtype from the
`precision` pass for the device target); CPU autocast rounds the same ops to
the same dtypes, so the numerics are checked here on the tiny network.  The
chunked LM-head cross-entropy under autocast with ignored rows has its own
tests (test_ce_reduced_precision.py).

Tolerances (relative, against float32; eps = 2**-8 for bf16, 2**-11 for fp16):

* attention output: max error / max |reference| below 8 eps (every value is
  a softmax-weighted mean of values rounded once);
* a training step's loss: 4 eps relative (a mean over 32 tokens of an fp32 CE);
* a training step's gradients: L2 error of every parameter's gradient
  below 0.1 (bf16) or 0.02 (fp16) of its norm (each passes through ~10
  rounded matmuls; bf16 keeps 8 bits), cosine similarity above 0.99; a
  gradient smaller than 1e-3 of the largest (key biases, zero in exact
  arithmetic; query biases at initialisation) is float32 rounding noise on
  both sides, so its error is measured against that floor instead.
"""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch

import vgraph
from vgraph.backends.torch import compile_network, compute_dtype, prepare_graph
from vgraph.backends.torch.lowering import kernels as K
from vgraph.backends.torch.lowering.dropout import dropout_key
from vgraph.backends.torch.lowering.ops import attention_head_sdpa

TINY = Path(__file__).parent / "fixtures" / "tiny_2l.yml"
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
GRAD_REL = {torch.bfloat16: 0.1, torch.float16: 0.02}
TARGET = {torch.bfloat16: "cuda-sm80", torch.float16: "cuda-sm75"}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


# -- attention kernels ----------------------------------------------------------------------------

def _head_weights(dim: int, hd: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [t for _ in range(3) for t in (torch.randn(hd, dim, generator=gen) * dim**-0.5,
                                         torch.randn(hd, generator=gen) * 0.1)]


@DTYPES
@pytest.mark.parametrize("rope", [None, 10000.0], ids=["no-rope", "rope"])
def test_sdpa_head_under_autocast_matches_the_float32_reference(dtype, rope) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 32, generator=gen)
    w = _head_weights(32, 16, gen)
    ref = K.attention_head(x, *w, causal=True, rope_theta=rope)
    with torch.autocast("cpu", dtype=dtype):
        out = attention_head_sdpa(x, *w, causal=True, rope_theta=rope)
    assert out.dtype == dtype
    assert float((out.float() - ref).abs().max() / ref.abs().max()) < 8 * EPS[dtype]


@DTYPES
def test_fused_multihead_attention_under_autocast_matches_the_float32_heads(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 32, generator=gen, requires_grad=True)
    heads = [_head_weights(32, 16, gen) for _ in range(2)]
    qkv_w = torch.cat([h[i] for i in (0, 2, 4) for h in heads])  # all q, then all k, then all v
    qkv_b = torch.cat([h[i] for i in (1, 3, 5) for h in heads])
    ref = torch.cat([K.attention_head(x, *h, causal=True, rope_theta=10000.0) for h in heads], dim=-1)
    with torch.autocast("cpu", dtype=dtype):
        out = K.multihead_attention(x, qkv_w, qkv_b, None, None, num_heads=2, head_dim=16, causal=True,
                                    rope_theta=10000.0)
    assert out.dtype == dtype
    assert float((out.detach().float() - ref.detach()).abs().max() / ref.detach().abs().max()) < 8 * EPS[dtype]
    (g_ref,) = torch.autograd.grad(ref.square().sum(), x)
    (g,) = torch.autograd.grad(out.float().square().sum(), x)
    assert rel_err(g, g_ref) < 16 * EPS[dtype]


# -- a whole training step ------------------------------------------------------------------------

def _step(target: str, fuse: bool, scaler_scale: float | None = None):
    """One forward + backward of the tiny network prepared for `target`; (loss, grads, module, dtype)."""
    graph = prepare_graph(vgraph.load(TINY), fuse=fuse, target=target)
    dtype = compute_dtype(graph)
    module = compile_network(graph, train=True, seed=0)
    costs = tuple(module.cost_names)
    program = module.program_for(costs, training=True)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (4, 16), generator=gen)
    targets = torch.randint(0, 96, (4, 16), generator=gen)
    targets[0, :5] = -100  # ignored rows, as padding gives them
    args = [ids if name.startswith("embedder") else targets for name in program.feeds]
    amp = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with dropout_key(0, 1), amp:
        out = program.module(*args)
    loss = sum(out[c] for c in costs)
    scaler = None
    if scaler_scale is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=scaler_scale)
        scaler.scale(loss).backward()
    else:
        loss.backward()
    return loss.detach(), module, dtype, scaler


def _grads(module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in module.named_parameters() if p.grad is not None}


@DTYPES
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_a_reduced_precision_training_step_matches_float32(dtype, fuse) -> None:
    ref_loss, ref_module, ref_dtype, _ = _step("cpu", fuse)
    assert ref_dtype == torch.float32
    loss, module, got_dtype, scaler = _step(TARGET[dtype], fuse, 2.0**8 if dtype == torch.float16 else None)
    assert got_dtype == dtype
    assert loss.dtype == torch.float32  # losses stay float32 whatever the compute dtype
    assert abs(float(loss) - float(ref_loss)) < 4 * EPS[dtype] * abs(float(ref_loss))
    if scaler is not None:
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        scaler.unscale_(optimizer)
        assert not any(float(v) for v in scaler._found_inf_per_device(optimizer).values())
    ref, got = _grads(ref_module), _grads(module)
    assert set(ref) == set(got) and ref
    largest = max(float(g.norm()) for g in ref.values())
    floor = 1e-3 * largest  # gradients far below the others are float32 rounding noise on both sides
    for key in ref:
        assert got[key].dtype == torch.float32, key  # master weights and their gradients stay float32
        size = float(ref[key].norm())
        assert float((got[key].double() - ref[key].double()).norm()) < GRAD_REL[dtype] * max(size, floor), key
        if size >= floor:
            cos = torch.nn.functional.cosine_similarity(got[key].flatten().double(), ref[key].flatten().double(),
                                                        dim=0)
            assert float(cos) > 0.99, key


def test_fp16_loss_scaling_skips_an_overflowing_step_and_halves_the_scale() -> None:
    """The fp16 path's GradScaler: a scale that overflows fp16 gradients skips the update, then halves."""
    _, module, dtype, scaler = _step("cuda-sm75", True, scaler_scale=2.0**40)
    assert dtype == torch.float16
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    before = copy.deepcopy(module.state_dict())
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**39
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the step was skipped


@DTYPES
def test_a_node_declared_float32_runs_without_autocast(dtype) -> None:
    """A VNode declared `precision: float32` in a reduced-precision network computes in float32 under
    autocast (its inputs upcast, lower.float32_region), its neighbours in the compute dtype."""
    source = vgraph.load(TINY)
    source.node("final_norm").set_config(precision="float32")
    source.node("head_up").set_config(precision="float32")
    graph = prepare_graph(source, fuse=False, target=TARGET[dtype])
    assert graph.node("head_up").meta["precision"]["activation"] == "float32"
    module = compile_network(graph, train=False, seed=0)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=dtype), torch.no_grad():
        out = module({"embedder:in0": ids}, want=("head_up:0", "head_down:0", "block1_ffn_up:0"))
    assert out["head_up:0"].dtype == torch.float32
    assert out["head_down:0"].dtype == dtype and out["block1_ffn_up:0"].dtype == dtype
