"""One training step of a network as `vgraph train` runs it, on fixed random tokens: what the memory
benchmarks (bench_memory.py, bench_remat.py) measure, built in one place so they measure the same step."""
from __future__ import annotations

from pathlib import Path


def training_step(network: Path, passes: str | None, batch: int, *, keyed_dropout: bool):
    """(graph, module, optimizers, step, vocabulary, sequence length).  `step()` runs forward, backward and
    Adam once and returns the loss; with `keyed_dropout` each call draws its masks under the next step's key
    (as `vgraph train` does), else from torch's global RNG."""
    import torch

    import vgraph
    from vgraph.backends.torch import compile_network, prepare_graph
    from vgraph.backends.torch.lowering.dropout import dropout_key
    from vgraph.backends.torch.training.train import NodeOptimizers

    graph = prepare_graph(vgraph.load(network), passes=passes, target="cpu")
    module = compile_network(graph, device="cpu", train=True, seed=0)
    optimizers = NodeOptimizers(module, 6e-4)
    costs = tuple(module.cost_names)
    program = module.program_for(costs, training=True)
    embed = graph.nodes_of_type("embedder")[0].cfg
    vocab, seq = int(embed["vocab_size"]), int(embed["seq_len"])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    args = [ids if name.startswith("embedder") else targets for name in program.feeds]
    steps = [0]

    def forward():
        return program.module(*args)[costs[0]]

    def step() -> float:
        steps[0] += 1
        if keyed_dropout:
            with dropout_key(0, steps[0]):
                loss = forward()
        else:
            loss = forward()
        loss.backward()
        for opt in optimizers.optimizers:
            opt.step()
        optimizers.zero_grad()
        return float(loss)

    return graph, module, optimizers, step, vocab, seq
