"""Training with `remat` equals training without it: losses, gradients, resume and checkpoints."""
from __future__ import annotations

import pytest
import torch

import vgraph
from conftest import TINY
from vgraph.backends.torch import compile_network, prepare_graph
from vgraph.backends.torch.lowering.dropout import dropout_key
from vgraph.backends.torch.training.train import train
from vgraph.backends.torch.training.config import TrainConfig
from vgraph.cost.costmodel import cost_model
from vgraph.cost.remat import RECOMPUTE, marked_ids, remat_layout
from vgraph.ir.graph import VNode
from vgraph.ops.registry import REGISTRY
from vgraph.passes.remat import candidates, closed, plain_activation, scopes_of

FUSED = "dead-nodes,precision,fuse-heads,fuse-lm-head-ce"
UNFUSED = "dead-nodes,precision"


def mark_all(graph):
    """Every candidate of every group recomputed (the block input kept, its interior recomputed)."""
    cm = cost_model(graph, batch=2)
    cands = candidates(graph, cm, list(graph.node_ids()), {})
    for nid in closed(graph, [c for cs in cands.values() for c in cs]):
        graph.node(nid).set_config(remat=RECOMPUTE)
    return graph


def step(graph, ids, targets, offset=0):
    module = compile_network(graph, seed=0)
    program = module.program_for(tuple(module.cost_names), training=True)
    args = [ids if name.startswith("embedder") else targets for name in program.feeds]
    with dropout_key(7, 3, offset):
        loss = program.module(*args)[module.cost_names[0]]
    loss.backward()  # outside the key: a recomputed dropout must use the key its forward saw
    return loss.detach(), {k: p.grad for k, p in module.named_parameters()}, program.module


def token_batch(graph, samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets) of `samples` random sequences in the graph's vocabulary, drawn from `seed`."""
    emb = graph.nodes_of_type("embedder")[0].cfg
    gen = torch.Generator().manual_seed(seed)
    shape = (samples, int(emb["seq_len"]))
    ids = torch.randint(0, int(emb["vocab_size"]), shape, generator=gen)
    return ids, torch.randint(0, int(emb["vocab_size"]), shape, generator=gen)


def assert_same_step(loss, grads, loss_ref, grads_ref) -> None:
    """The same loss and every parameter's gradient as the reference step, to float32 rounding."""
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    assert grads.keys() == grads_ref.keys()
    for k in grads_ref:
        torch.testing.assert_close(grads[k], grads_ref[k], rtol=1e-6, atol=1e-9, msg=k)


@pytest.mark.parametrize("passes", [FUSED, UNFUSED])
def test_same_loss_and_gradients_with_dropout(passes):
    plain = prepare_graph(vgraph.load(TINY), passes=passes, target="cpu")
    assert any(float(n.cfg.get("rate", 0) or 0) > 0 for n in plain.nodes_of_type("dropout"))
    marked = mark_all(plain.copy())
    ids, targets = token_batch(plain, 3, seed=0)
    loss0, grads0, _ = step(plain, ids, targets)
    loss1, grads1, gm = step(marked, ids, targets)
    regions = [m for name, m in gm.named_children() if name.startswith("remat_")]
    assert len(regions) >= 3  # two blocks and the head were cut out and checkpointed
    bodies = "\n".join(r.body.code for r in regions)
    if passes == FUSED:  # the fused kernels survive inside and around the regions
        assert "attention" in bodies and "tied_lm_head_ce" in gm.code
    assert "dropout" in bodies
    assert_same_step(loss1, grads1, loss0, grads0)


def test_a_micro_batch_at_a_sample_offset_recomputes_its_own_masks():
    """A micro-batch or replica holding samples 5..7 of the step draws those samples' dropout masks (the key's
    offset), in the checkpointed forward and again in its recompute: the same loss and gradients as without
    remat, and not those of samples 0..2 (a recompute that lost the offset would mix the two)."""
    plain = prepare_graph(vgraph.load(TINY), passes=FUSED, target="cpu")
    marked = mark_all(plain.copy())
    ids, targets = token_batch(plain, 3, seed=1)
    loss0, grads0, _ = step(plain, ids, targets, offset=5)
    loss1, grads1, _ = step(marked, ids, targets, offset=5)
    _, at_zero, _ = step(plain, ids, targets, offset=0)
    moved = max(float((at_zero[k] - grads0[k]).abs().max() / grads0[k].abs().max()) for k in grads0)
    assert moved > 0.01  # the offset chooses other masks: gradients move by percents, far above the tolerance
    assert_same_step(loss1, grads1, loss0, grads0)


def saved_bytes(graph, ids, targets) -> int:
    """Bytes autograd keeps for backward over one training step (each storage once, parameters included)."""
    module = compile_network(graph, seed=0)
    program = module.program_for(tuple(module.cost_names), training=True)
    args = [ids if name.startswith("embedder") else targets for name in program.feeds]
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), dropout_key(7, 3):
        loss = program.module(*args)[module.cost_names[0]]
    loss.backward()
    return sum(kept.values())


def test_regions_keep_only_their_inputs_for_backward():
    """What remat is for: a checkpointed region keeps its inputs, not its interior, so the step keeps far
    fewer bytes for backward (measured with autograd's saved-tensor hooks), and every region with something
    to recompute is cut out, also after a region with nothing to recompute (the embedder marked alone: its
    output is read by the next block, outside its group)."""
    plain = prepare_graph(vgraph.load(TINY), passes=FUSED, target="cpu")
    marked = mark_all(plain.copy())
    marked.node("embedder").set_config(remat=RECOMPUTE)
    layout = remat_layout(marked)
    assert layout.regions[0] == ("embedder",) and "embedder" not in layout.recomputed
    ids, targets = token_batch(plain, 3, seed=3)
    gm = step(marked, ids, targets)[2]
    cut = [name for name, _ in gm.named_children() if name.startswith("remat_")]
    assert len(cut) == sum(1 for r in layout.regions if set(r) & layout.recomputed) >= 3
    assert saved_bytes(marked, ids, targets) < 0.5 * saved_bytes(plain, ids, targets)  # measured: 0.12


def test_a_region_may_read_the_networks_inputs():
    """A user's `remat: recompute` on the last projection puts the fused loss in its region (a frontier node),
    and the loss reads the targets, an input of the network: the region takes it as an input like any other
    outside value, and trains the same."""
    plain = prepare_graph(vgraph.load(TINY), passes=FUSED, target="cpu")
    marked = plain.copy()
    marked.node("head_down").set_config(remat=RECOMPUTE)
    ids, targets = token_batch(plain, 3, seed=2)
    loss0, grads0, _ = step(plain, ids, targets)
    loss1, grads1, gm = step(marked, ids, targets)
    (region,) = [m for name, m in gm.named_children() if name.startswith("remat_")]
    (call,) = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("remat_")]
    assert "tied_lm_head_ce" in region.body.code and any(a.op == "placeholder" for a in call.args)
    assert_same_step(loss1, grads1, loss0, grads0)


def test_a_region_fed_only_by_the_tokens_trains_its_parameters():
    """The embedder and a norm after it in its group, the embedder marked: the region's only input is the
    token ids (no gradient flows into it), yet its parameters must get their gradients (non-reentrant
    checkpointing; a reentrant one gives them None, and the run would silently stop training them)."""
    graph = vgraph.load(TINY)
    values, problems = REGISTRY.get("layernorm").schema.parse(
        {"dim": "32", "colocate_group": "token_embedding", "colocate_policy": "required", "optimizer": "adam"})
    assert not problems
    graph.add_node(VNode("emb_norm", "layernorm", values))
    (out,) = graph.out_edges("embedder")
    graph.remove_edge(out)
    graph.add_edge("embedder", 0, "emb_norm", 0)
    graph.add_edge("emb_norm", 0, out.dst, out.dst_slot)
    plain = prepare_graph(graph, passes=FUSED, target="cpu")
    marked = plain.copy()
    marked.node("embedder").set_config(remat=RECOMPUTE)
    assert remat_layout(marked).recomputed == {"embedder"}
    ids, targets = token_batch(plain, 3, seed=4)
    loss0, grads0, _ = step(plain, ids, targets)
    loss1, grads1, gm = step(marked, ids, targets)
    assert any(name.startswith("remat_") for name, _ in gm.named_children())
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    for k in grads0:
        assert grads1[k] is not None, k
        torch.testing.assert_close(grads1[k], grads0[k], rtol=1e-6, atol=1e-9, msg=k)


def test_eval_programs_are_not_checkpointed():
    marked = mark_all(prepare_graph(vgraph.load(TINY), passes=FUSED, target="cpu"))
    module = compile_network(marked, seed=0)
    assert "remat_" not in module.code(tuple(module.cost_names), training=False)


def remat_spec(passes: str, batch: int, fraction: float = 0.7) -> str:
    graph = prepare_graph(vgraph.load(TINY), passes=passes, target="cpu")
    cm = cost_model(graph, batch=batch)
    base = scopes_of(graph, cm, 10**15, None)[0]
    budget = base.static_bytes + int(sum(plain_activation(cm).values()) * fraction) * base.resident
    return f"{passes},remat{{budget={budget},batch={batch}}}"


def run(tmp_path, name, corpus, passes, steps, resume=False):
    return train(TrainConfig(network=str(TINY), data=corpus, steps=steps, batch=2, lr=1e-3, val_every=0,
                             checkpoint_every=2, out=tmp_path / name, passes=passes, progress=False,
                             resume=resume, tensorboard=False, seed=3))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "c.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return str(path)


def test_training_resume_and_checkpoints_interchangeable(tmp_path, corpus):
    spec = remat_spec(FUSED, 2)
    graph = prepare_graph(vgraph.load(TINY), passes=spec, target="cpu")
    assert marked_ids(graph)
    without = run(tmp_path, "plain", corpus, FUSED, 4)
    with_remat = run(tmp_path, "remat", corpus, spec, 4)

    def losses(result):
        return {row["step"]: row["loss"] for row in result.history if "loss" in row}

    assert sorted(losses(without)) == [1, 2, 3, 4]
    assert losses(with_remat) == pytest.approx(losses(without), rel=1e-6)
    # stopped after 2 steps and resumed with remat: the same 4 steps
    run(tmp_path, "resumed", corpus, spec, 2)
    resumed = run(tmp_path, "resumed", corpus, spec, 4, resume=True)
    assert losses(resumed) == pytest.approx(losses(without), rel=1e-6)  # the history is the run's
    # a remat run's checkpoint resumes without remat, and the other way round
    run(tmp_path, "swap1", corpus, spec, 2)
    swapped = run(tmp_path, "swap1", corpus, FUSED, 4, resume=True)
    assert losses(swapped) == pytest.approx(losses(without), rel=1e-6)  # the history is the run's
    run(tmp_path, "swap2", corpus, FUSED, 2)
    swapped = run(tmp_path, "swap2", corpus, spec, 4, resume=True)
    assert losses(swapped) == pytest.approx(losses(without), rel=1e-6)  # the history is the run's


def test_memory_estimate_counts_remat():
    from vgraph.backends.torch import estimate_training_memory

    plain = prepare_graph(vgraph.load(TINY), passes=FUSED, target="cpu")
    marked = mark_all(plain.copy())
    before, after = estimate_training_memory(plain, 4), estimate_training_memory(marked, 4)
    assert after.activations < before.activations
    assert (after.parameters, after.gradients, after.optimizer) == (before.parameters, before.gradients,
                                                                    before.optimizer)
    # One marked VNode alone saves nothing at the peak: backward rebuilds its output (and its reader,
    # a linear, keeps no internals) while that region's backward runs.
    one = plain.copy()
    one.node("block0_ffn_gelu").set_config(remat=RECOMPUTE)
    assert estimate_training_memory(one, 4).activations == before.activations


@pytest.mark.parametrize("kind", ["ffn_gelu", "attn_dropout"])
def test_a_region_of_one_vnode_is_cut_out_and_recomputed(kind):
    """A lone marked VNode between kept ones (the policy marks single cheap elementwise VNodes where that
    pays: a GELU; a dropout, whose region also holds the residual add it feeds) is a region of its own,
    checkpointed as a submodule named in order (remat_0, remat_1), and the step's loss and gradients are
    unchanged."""
    plain = prepare_graph(vgraph.load(TINY), passes=UNFUSED, target="cpu")
    marked = plain.copy()
    for nid in (f"block0_{kind}", f"block1_{kind}"):
        marked.node(nid).set_config(remat=RECOMPUTE)
    assert len(remat_layout(marked).regions) == 2
    ids, targets = token_batch(plain, 2, seed=1)
    loss0, grads0, _ = step(plain, ids, targets)
    loss1, grads1, gm = step(marked, ids, targets)
    regions = {name: m for name, m in gm.named_children() if name.startswith("remat_")}
    assert sorted(regions) == ["remat_0", "remat_1"]
    assert all(kind.split("_")[1] in m.body.code for m in regions.values())
    assert_same_step(loss1, grads1, loss0, grads0)
