"""PowerSGD on the replicas' gradient buckets: torch's own hook, its bytes counted, its state checkpointed.

`vgraph launch --grad-compress powersgd[:rank=R,start=N]` all-reduces each
stage group's gradient buckets (grad_sync.py) with torch's implementation of
PowerSGD with error feedback and warm start
(`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`, Vogels et al.,
NeurIPS 2019): `Bucket` answers the `GradBucket` methods the hook calls, and
`summed` turns its mean into the sum the replicas need.  What this module
adds around the hook:

* **bytes**: `wire_numels` says what the hook all-reduces for a bucket,
  decided before the hook runs: the whole bucket during the first `start`
  steps; after that the gradients it does not compress (decided with the
  hook's own `_should_compress`), the P factors and the Q factors, each a ring
  all-reduce (grad_sync.py counts 2 (R - 1) / R of each).  The cost model
  (vgraph/cost/grad_compression.py) predicts the same numbers without torch;
* **recovery**: a step whose gradients are not finite (fp16 loss scaling
  skips it) would leave NaN in the error-feedback buffer and the warm-start
  factors for ever: `forget` drops them (the hook starts those buckets afresh,
  as on its first compressed step);
* **checkpoints**: `state_dict` / `load_state_dict`: the step counter, the
  seeded generator that draws the first Q factors, and per bucket the error
  buffer (each replica's own) and the warm-start P and Q, so an interrupted
  run resumes exactly.  The state depends on the bucket layout; a resume on
  another layout (another plan) starts the compression afresh and says so.

Why torch's hook and not the published algorithm written again: the engine
exists, is maintained and is what users of DDP get; it plugs in unchanged
because the buckets speak GradBucket.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

from vgraph.cost.grad_compression import GradCompression

from .grad_sync import Bucket, summed

__all__ = ["PowerSGD"]


class PowerSGD:
    """A stage group's PowerSGD: the hook, its state, and what it sends per bucket."""

    def __init__(self, group: Any, spec: GradCompression, size: int, seed: int) -> None:
        self.spec = spec
        self.state = ps.PowerSGDState(process_group=group, matrix_approximation_rank=spec.rank,
                                      start_powerSGD_iter=spec.start, min_compression_rate=spec.min_rate,
                                      use_error_feedback=True, warm_start=True, random_seed=seed,
                                      compression_stats_logging_frequency=2**62)
        self.hook = summed(ps.powerSGD_hook, size)

    def wire_numels(self, bucket: Bucket) -> list[int]:
        """Elements of each all-reduce the hook will run for `bucket` now."""
        if self.state.iter < self.state.start_powerSGD_iter:
            return [bucket.buffer().numel()]
        whole = p = q = 0
        for grad in bucket.gradients():
            n = grad.shape[0]
            m = grad.numel() // n
            r = min(n, m, self.state.matrix_approximation_rank)
            if ps._should_compress(n, m, r, self.state.min_compression_rate)[0]:
                p += n * r
                q += m * r
            else:
                whole += grad.numel()
        return [whole, p, q]

    def forget(self) -> None:
        """Drop the error buffers and warm-start factors (after a step whose gradients were not finite)."""
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()

    def state_dict(self, layout: list[int]) -> dict[str, Any]:
        """What a checkpoint keeps for this rank (`layout`: the numel of each bucket, checked on resume)."""
        s = self.state

        def cpu(d: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {int(k): v.detach().cpu().clone() for k, v in d.items()}
        return {"spec": self.spec.text(), "layout": list(layout), "iter": int(s.iter), "rng": s.rng.get_state(),
                "error": cpu(s.error_dict), "p": cpu(s.p_memory_dict), "q": cpu(s.q_memory_dict)}

    def load_state_dict(self, saved: Mapping[str, Any] | None, layout: list[int], device: torch.device) -> str | None:
        """Restore a checkpoint's state; a reason (and a fresh start) when it does not fit this run."""
        if not saved:
            return "the checkpoint holds no PowerSGD state for this rank"
        if saved.get("spec") != self.spec.text() or list(saved.get("layout") or ()) != list(layout):
            return (f"the checkpoint's PowerSGD state is for {saved.get('spec')} on buckets {saved.get('layout')}, "
                    f"this run has {self.spec.text()} on {layout}")
        s = self.state
        s.iter = int(saved["iter"])
        s.rng.set_state(saved["rng"])
        for name, target in (("error", s.error_dict), ("p", s.p_memory_dict), ("q", s.q_memory_dict)):
            target.clear()
            target.update({int(k): v.to(device) for k, v in saved[name].items()})
        return None
