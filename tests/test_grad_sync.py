"""The replicas' gradient sum (distributed/runtime/grad_sync.py) on real gloo process groups of 2 and 3 processes.

Gradients are small integers (exact in float32 and float16), so the oracle is exact: every rank must end
with the sum over ranks and micro-batches, bit for bit the same on every rank, whatever its number of
micro-batches (unequal batch shares), with buckets launched during the last backward (before `finish`),
a parameter no gradient reached back to None, a late (tied) parameter reduced only after `ready`, and the
bytes of the ring formula.  A DDP communication hook plugs in (torch's fp16 compression, PowerSGD).
"""
from __future__ import annotations

import contextlib
import time
import traceback
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from vgraph.backends.torch.distributed.runtime.grad_sync import (Bucket, GradientSync, bucket_layout, ring_bytes_sent,
                                                        summed)
from ranks_util import run_ranks

SHAPES = {"a": (3, 4), "b": (5,), "d": (6,), "unused": (2, 2), "late": (4,)}
USERS = {"t1": ["a", "d"], "t0": ["b", "d", "unused", "late"]}  # d: one Parameter in two tasks (a local tie)
MICRO = {0: 2, 1: 1, 2: 3}  # micro-batches per rank: unequal shares


def _x(rank: int, task: str, m: int, name: str) -> torch.Tensor:
    """The gradient rank `rank` contributes to `name` in task `task`'s micro-batch m: small integers."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((rank, task, m, name)).encode()))
    return torch.randint(-8, 9, SHAPES[name], generator=g).float()


def _expected(world: int, name: str) -> torch.Tensor:
    total = torch.zeros(SHAPES[name])
    for r in range(world):
        for task, names in USERS.items():
            if name in names and name != "unused":
                for m in range(MICRO[r]):
                    total += _x(r, task, m, name)
        if name == "late":
            total += 100 * (r + 1)  # the tied replica's gradient, added before ready()
    return total


def _member(rank: int, port: int, world: int, hook: str, out) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
        order = [params[n] for n in ("a", "d", "b", "unused", "late")]
        users = {t: [params[n] for n in names] for t, names in USERS.items()}
        kwargs = {}
        if hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
            kwargs = dict(hook=summed(fp16_compress_hook, world), hook_state=dist.group.WORLD)
        sync = GradientSync(order, dist.group.WORLD, size=world, position=rank, users=users,
                            late=[params["late"]], bucket_bytes=32, **kwargs)  # 32 bytes: several buckets
        results = []
        for _ in range(2):  # two steps: the buckets are re-armed and emptied
            sync.begin()
            last = MICRO[rank] - 1
            for m in range(MICRO[rank]):  # 1F1B-like: the later task's backward first
                for task in ("t1", "t0"):
                    ctx = sync.last_backward(task) if m == last else contextlib.nullcontext()
                    with ctx:
                        loss = sum((params[n] * _x(rank, task, m, n)).sum() for n in USERS[task] if n != "unused")
                        loss.backward()
            launched_before_late = sync.launched
            with torch.no_grad():
                params["late"].grad.add_(100 * (rank + 1))  # the tied replica's gradient arrives
            sync.ready(params["late"])
            launched = (launched_before_late, sync.launched)  # ... both before finish()
            sent = sync.finish()
            results.append(({n: (None if p.grad is None else p.grad.tolist()) for n, p in params.items()},
                            launched, len(sync.buckets), sent))
            for p in params.values():
                p.grad = None
        out.put((rank, results))
    except Exception:
        out.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _grouped_member(rank: int, port: int, out) -> None:
    """2 replicas x 2 stages (replica_groups.stage_groups): world ranks 0, 2 sum stage 0, ranks 1, 3 stage 1."""
    import torch.distributed as dist

    from vgraph.backends.torch.distributed.runtime.replica_groups import stage_groups

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
        group = stage_groups(replicas=2, plan_ranks=2)[rank % 2]
        param = torch.nn.Parameter(torch.zeros(5))
        sync = GradientSync([param], group, size=2, position=rank // 2, users={"t": [param]})
        sync.begin()
        with sync.last_backward("t"):
            (param.sum() * (rank + 1)).backward()
        sync.finish()
        out.put((rank, param.grad.tolist()))
    except Exception:
        out.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_each_stage_group_sums_its_own_members_only() -> None:
    """The sum runs on the stage group it is given (a replica's stage with the same stage of the others), not
    on the whole world, which also holds the other stages' ranks."""
    results = run_ranks(_grouped_member, 4)
    assert results == {0: [4.0] * 5, 2: [4.0] * 5, 1: [6.0] * 5, 3: [6.0] * 5}, results


def _run(world: int, hook: str = "") -> dict[int, list]:
    results = run_ranks(_member, world, world, hook)
    for r, res in results.items():
        assert not isinstance(res, str), f"rank {r}:\n{res}"
        for grads, *_ in res:  # tensors travel as lists (a queue's shared memory would die with the sender)
            grads.update({n: torch.tensor(g) for n, g in grads.items() if g is not None})
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_ends_with_the_exact_sum(world: int) -> None:
    results = _run(world)
    total_bytes = 0
    for step in range(2):
        grads0 = results[0][step][0]
        for r in range(world):
            grads, (before_late, after_late), buckets, sent = results[r][step]
            # 32-byte buckets [a] [d] [b] [unused, late]: every bucket went out during the last backwards (the
            # unused parameter when its task's last backward returned) but the late one's, which waits for
            # the tied gradient, and goes out when it is ready, all before finish()
            assert buckets == 4 and (before_late, after_late) == (3, 4)
            assert grads["unused"] is None  # no gradient reached it: the optimizer skips it, as in `vgraph train`
            for name in ("a", "b", "d", "late"):
                assert torch.equal(grads[name], _expected(world, name)), (r, name)
                assert torch.equal(grads[name], grads0[name])  # bit for bit the same on every rank
            total_bytes += sent
    grad_bytes = 4 * sum(torch.Size(s).numel() for s in SHAPES.values())
    assert total_bytes == 2 * 2 * (world - 1) * grad_bytes  # the ring formula, two steps


def test_a_ddp_comm_hook_plugs_in() -> None:
    """torch's fp16 compression hook (an averaging hook, made summing): small integers survive fp16 exactly."""
    results = _run(2, "fp16")
    for r in (0, 1):
        grads = results[r][1][0]
        for name in ("a", "b", "d", "late"):
            assert torch.equal(grads[name], _expected(2, name)), (r, name)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(numel=st.integers(0, 10_000), size=st.integers(1, 9), element=st.sampled_from([2, 4, 8]))
def test_ring_bytes_add_up_to_the_formula(numel: int, size: int, element: int) -> None:
    per_member = [ring_bytes_sent(numel, element, size, position) for position in range(size)]
    assert sum(per_member) == 2 * (size - 1) * numel * element  # vgraph.cost.stepcost.ring_allreduce_bytes
    assert all(b >= 0 for b in per_member)
    if numel % size == 0 and size > 1:
        assert set(per_member) == {2 * (size - 1) * numel // size * element}


def ring_by_hand(numel: int, size: int) -> list[int]:
    """Elements each member sends in the textbook ring all-reduce (Patarasuk and Yuan 2009; NCCL's ring) of
    a buffer cut as torch.tensor_split cuts it: in reduce-scatter step k member r sends chunk r - k, in
    all-gather step k chunk r - k + 1 (mod size), for k = 0 .. size - 2."""
    chunks = [len(c) for c in torch.tensor_split(torch.zeros(numel), size)]
    sent = [0] * size
    for r in range(size):
        for k in range(size - 1):
            sent[r] += chunks[(r - k) % size] + chunks[(r - k + 1) % size]
    return sent


@settings(derandomize=True, max_examples=60, deadline=None)
@given(numel=st.integers(0, 200), size=st.integers(2, 9), element=st.sampled_from([2, 4]))
def test_each_member_sends_what_the_textbook_ring_sends(numel: int, size: int, element: int) -> None:
    """Per member, not only in total: with uneven chunks the members send different amounts (each PNode's
    measured bytes in the run's figures)."""
    assert [ring_bytes_sent(numel, element, size, r) for r in range(size)] == \
        [n * element for n in ring_by_hand(numel, size)]


@settings(derandomize=True, max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 50), st.sampled_from([torch.float32, torch.float16])), max_size=12),
       cap=st.integers(1, 200))
def test_buckets_hold_every_parameter_once_in_one_dtype_under_the_cap(sizes, cap) -> None:
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in sizes]
    layout = bucket_layout(params, cap)
    assert sorted(i for b in layout for i in b) == list(range(len(params)))
    for b in layout:
        assert len({params[i].dtype for i in b}) == 1
        assert b == sorted(b)
        nbytes = sum(params[i].numel() * params[i].element_size() for i in b)
        assert nbytes <= cap or len(b) == 1
    assert [b[0] for b in layout] == sorted(b[0] for b in layout)
    for dtype in {p.dtype for p in params}:  # full buckets: one closes only when its dtype's next would not fit
        mine = [b for b in layout if params[b[0]].dtype == dtype]
        for b, following in zip(mine, mine[1:]):
            nbytes = sum(params[i].numel() * params[i].element_size() for i in b)
            nxt = params[following[0]]
            assert nbytes + nxt.numel() * nxt.element_size() > cap


def test_a_bucket_answers_what_ddp_hooks_ask() -> None:
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    bucket = Bucket(1, 2, params)
    assert bucket.index() == 1 and bucket.is_last() and bucket.buffer().shape == (10,)
    assert [g.shape for g in bucket.gradients()] == [(2, 3), (4,)] and bucket.parameters() == params
    bucket.set_buffer(torch.arange(10.0))
    assert bucket.gradients()[1].tolist() == [6.0, 7.0, 8.0, 9.0]  # views into the one flat buffer
    exact = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]  # 8 bytes each
    assert bucket_layout(exact, 16) == [[0, 1], [2]]  # a bucket filled to exactly the cap is full, not over
    assert bucket_layout(exact * 2, 16) == [[0, 1], [2, 3], [4, 5]]  # every bucket, not only the first
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_layout(params, 0)
    with pytest.raises(ValueError, match="twice"):
        GradientSync([params[0], params[0]], None, size=2, position=0, users={})


def _local(hook_result, users=True, log=None):
    """A one-member sync whose hook completes at once with `hook_result(bucket)` (no process group); `log`
    gets each launched bucket's index."""
    def hook(state, bucket):
        if log is not None:
            log.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(hook_result(bucket))
        return fut

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    sync = GradientSync(params, None, size=1, position=0, users={"t": params} if users else {}, bucket_bytes=8,
                        hook=hook)
    return params, sync


def test_buckets_go_out_during_the_backward_that_finishes_them() -> None:
    """The overlap: a bucket is handed to the collective from the gradient hook, before backward() returns,
    not when the task's last backward is over.  A sync outside any round does nothing; finish() launches
    what no task's backward made ready, and ignores a parameter it does not hold."""
    launched: list = []
    params, sync = _local(lambda bucket: bucket.buffer(), log=launched)
    assert sync.finish() == 0 and launched == []  # no round begun: nothing to wait for
    sync.begin()
    with sync.last_backward("t"):
        (params[0].sum() + params[1].sum() * 2).backward()
        during = list(launched)
    sync.ready(torch.nn.Parameter(torch.zeros(1)))  # not one of its parameters: ignored
    sync.finish()
    assert during == [0, 1]  # both went out from the gradient hooks, in bucket order, before backward returned
    assert params[1].grad.tolist() == [2.0, 2.0]
    unused, idle = _local(lambda bucket: bucket.buffer(), users=False, log=(left := []))
    idle.begin()
    (unused[0].sum() * 3).backward()
    assert left == []  # no task said this backward was its last
    idle.finish()
    assert left == [0, 1] and unused[0].grad.tolist() == [3.0] * 3 and unused[1].grad is None


def _elsewhere(pool: list[torch.Tensor], than: torch.Tensor, side: str) -> torch.Tensor:
    """A tensor taken from `pool`, stored below or above `than` (the checks compare storage addresses, so both
    sides are tried); the allocator decides, so a side it never gives is skipped."""
    found = [t for t in pool if (t.data_ptr() < than.data_ptr()) == (side == "below")]
    if not found:
        pytest.skip(f"no tensor of the pool was allocated {side} the bucket")
    pool[:] = [t for t in pool if t is not found[0]]
    return found[0]


@pytest.mark.parametrize("side", ["below", "above"])
def test_a_hook_may_return_a_new_tensor(side: str) -> None:
    """A communication hook that answers with a tensor of its own (not the bucket's buffer), wherever it is
    stored: the gradients become that tensor's values."""
    pool = [torch.empty(3) for _ in range(8)]
    answers: dict = {}
    params, sync = _local(lambda bucket: answers[bucket.index()].copy_(bucket.buffer() * 10))
    pool += [torch.empty(3) for _ in range(8)]
    for bucket in sync.buckets:
        answers[bucket.index()] = _elsewhere(pool, bucket.flat, side)[:bucket.flat.numel()]
    sync.begin()
    with sync.last_backward("t"):
        (params[0].sum() * 2 + params[1].sum() * 3).backward()
    start = time.perf_counter()
    assert sync.finish() == 0  # one member sends nothing
    assert params[0].grad.tolist() == [20.0] * 3 and params[1].grad.tolist() == [30.0] * 2
    assert 0 <= sync.wait_s <= time.perf_counter() - start  # the seconds finish() waited, no more


@pytest.mark.parametrize("side", ["below", "above"])
def test_a_gradient_replaced_instead_of_accumulated_is_refused(side: str) -> None:
    pool = [torch.ones(2) for _ in range(8)]
    params, sync = _local(lambda bucket: bucket.buffer())
    pool += [torch.ones(2) for _ in range(8)]
    sync.begin()
    with sync.last_backward("t"):
        (params[0].sum() + params[1].sum()).backward()
    params[1].grad = _elsewhere(pool, sync.buckets[1].flat, side)  # not a view into its bucket: not summed
    with pytest.raises(RuntimeError, match="replaced during the round"):
        sync.finish()


def _powersgd_step(psgd, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> torch.Tensor:
    """One bucket of `params` holding `grads` through `psgd`'s hook, as GradientSync hands it over."""
    bucket = Bucket(0, 1, params)
    for view, g in zip(bucket.views, grads):
        view.copy_(g)
    return psgd.hook(psgd.state, bucket).wait().clone()


def _powersgd_member(rank: int, port: int, world: int, check: str, out) -> None:
    import torch.distributed as dist

    from vgraph.backends.torch.distributed.runtime.powersgd import PowerSGD
    from vgraph.cost.grad_compression import GradCompression

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        spec = GradCompression("powersgd", rank=1, start=2)
        params = [torch.nn.Parameter(torch.zeros(8, 8)), torch.nn.Parameter(torch.zeros(8))]
        u, v = torch.arange(1.0, 9.0), torch.arange(-3.0, 5.0)
        if check == "sum":
            # Rank r's gradients: (r + 1) u v^T (rank 1: lossless at rank 1) and a bias of small integers.
            psgd = PowerSGD(dist.group.WORLD, spec, size=world, seed=3)
            grads = [(rank + 1) * torch.outer(u, v), torch.arange(8.0) * (rank + 1)]
            sent = [psgd.wire_numels(Bucket(0, 1, params)) for _ in range(1)]
            outs = [_powersgd_step(psgd, params, grads) for _ in range(3)]  # 2 plain steps, then compressed
            sent.append(psgd.wire_numels(Bucket(0, 1, params)))
            out.put((rank, ([o.tolist() for o in outs], sent)))
            return
        # forget: a step whose gradients hold inf, then forget(); the next step is a fresh state's
        used = PowerSGD(dist.group.WORLD, spec, size=world, seed=3)
        g = [torch.outer(u, v), torch.arange(8.0)]
        for _ in range(2):
            _powersgd_step(used, params, g)
        bad = [g[0].clone(), g[1]]
        bad[0][2, 3] = float("inf")
        _powersgd_step(used, params, bad)
        poisoned = not all(bool(torch.isfinite(e).all()) for e in used.state.error_dict.values())
        used.forget()
        fresh = PowerSGD(dist.group.WORLD, spec, size=world, seed=3)
        fresh.state.iter = used.state.iter  # the same step and generator: only the buffers may differ
        fresh.state.rng.set_state(used.state.rng.get_state())
        nxt = [2 * torch.outer(v, u) + 1, torch.ones(8)]
        a, b = _powersgd_step(used, params, nxt), _powersgd_step(fresh, params, nxt)
        out.put((rank, (poisoned, used.wire_numels(Bucket(0, 1, params)), a.tolist(), b.tolist())))
    except Exception:
        out.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_powersgd_after_a_non_finite_step_and_forget_is_a_fresh_states() -> None:
    """fp16 loss scaling skips a step whose gradients hold inf, and PowerSGD.forget() drops the error-feedback
    buffers and warm-start factors the hook filled with it: the next compressed step is bit for bit what a
    state that never saw it computes (same step counter and generator), not NaN for ever."""
    (res,) = run_ranks(_powersgd_member, 1, 1, "forget").values()
    assert not isinstance(res, str), res
    poisoned, sent, after, fresh = res
    assert poisoned and sent[1] > 0  # the premise: the inf reached the error buffer; the step is compressed
    assert torch.isfinite(torch.tensor(after)).all() and after == fresh


def test_powersgd_replicas_end_with_the_sum_not_the_mean() -> None:
    """Two replicas whose gradient matrices are multiples of one rank-1 matrix, (r + 1) u v^T: their sum 3 u v^T
    is rank 1, so PowerSGD of rank 1 reconstructs it (up to the float32 rounding of one orthogonalisation:
    relative 1e-5 covers a norm over 8 elements, a division and two 8-term products, each a few 6e-8
    roundings), and the bias (not compressed) and the two plain first steps are exact sums of small integers.
    torch's hook returns the mean; the replicas need the sum (as without compression)."""
    results = run_ranks(_powersgd_member, 2, 2, "sum")
    u, v = torch.arange(1.0, 9.0), torch.arange(-3.0, 5.0)
    want = torch.cat([3 * torch.outer(u, v).flatten(), 3 * torch.arange(8.0)])
    for rank, res in results.items():
        assert not isinstance(res, str), f"rank {rank}:\n{res}"
        outs, sent = res
        assert sent[0] == [72] and sent[1] == [8, 8, 8]  # the premise: plain, then the matrix as two factors
        assert outs[0] == want.tolist() and outs[1] == want.tolist()  # plain all-reduce: exact
        torch.testing.assert_close(torch.tensor(outs[2]), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_powersgd_says_what_it_sends_and_refuses_a_state_of_other_buckets() -> None:
    """No process group needed: the plain steps send the bucket; then a 16 x 12 matrix at rank 2 goes as P (16 x 2)
    and Q (12 x 2) ((16 + 12) x 2 x min_rate 2 < 16 x 12: worth compressing), a vector whole.  A checkpoint's state for other buckets (larger or smaller) is refused with
    a reason, and a fresh start; the state of these buckets loads."""
    from vgraph.backends.torch.distributed.runtime.powersgd import PowerSGD
    from vgraph.cost.grad_compression import GradCompression

    params = [torch.nn.Parameter(torch.zeros(16, 12)), torch.nn.Parameter(torch.zeros(5))]
    psgd = PowerSGD(None, GradCompression("powersgd", rank=2, start=2), size=2, seed=0)
    assert psgd.wire_numels(Bucket(0, 1, params)) == [197]
    psgd.state.iter = 2
    assert psgd.wire_numels(Bucket(0, 1, params)) == [5, 32, 24]
    saved = psgd.state_dict([197])
    for other in ([196], [198], [197, 1], []):
        assert "on buckets [197]" in psgd.load_state_dict(saved, other, torch.device("cpu")), other
    assert psgd.load_state_dict(saved, [197], torch.device("cpu")) is None
