"""Expert parallelism as a transform: each rank keeps ``E / W`` routed experts of every MoE layer and the
tokens travel to the experts (DeepEP-style dispatch and combine over ``all_to_all``).

Per MoE layer and step, on each rank (``tokens`` = the rows this rank dispatches)::

    owner[t, j] = topk_ids[t, j] // (E / W)                          rank holding each chosen expert
    send token t once to every rank in {owner[t, :]}                 (not once per expert)
      with its k ids made local to that rank (-1 for the others') and its k routing weights
    counts:   all_to_all_single(int64 [W])                           rows to / from each rank
    dispatch: all_to_all_single(x rows [R, H]), all_to_all_single(ids ; weights as int32 [R, 2k])
    experts:  fused_moe over the received rows (ids -1 are skipped): one partial sum per row, fp32 inside
    combine:  all_to_all_single(partials back [R, H]); out[t] = Σ partials (fp32) + shared[t], rounded once

``tokens="replicated"`` (default) is for models whose MoE input is the same on every rank of the group
(TP attention, or attention replicated): rank r dispatches only rows ``[r·⌈T/W⌉, ...)`` and the outputs are
all-gathered. ``tokens="local"``: every rank has its own tokens (data-parallel attention) and keeps its
output rows. The host reads the counts (one sync per layer): not capturable by CUDA graphs.
"""
from __future__ import annotations

import torch
from torch import nn

from ..modules.experts import StackedExperts
from ..modules.moe import MoE
from .comm import GroupInfo, ProcessGroup, all_gather_rows, all_to_all_rows, exchange_counts, group_info
from .shard import EXPERTS, TP_ATTR, Split, narrow_copy, record_split, shards_of, split_range

TOKEN_MODES = ("replicated", "local")


class ExpertParallelExperts(StackedExperts):
    """This rank's routed experts ``[first_expert, first_expert + num_experts)`` of ``num_global_experts``, in
    the format of the stacked experts they came from; ``forward`` has :class:`StackedExperts`' signature
    and result (module docstring for the dispatch).

    The state dict names experts by their global index (``{first_expert + e}.gate_proj.weight_packed``...),
    as the checkpoint does; loading a state dict that holds every expert takes this rank's share.
    """

    def __init__(self, experts: StackedExperts, info: GroupInfo, tokens: str = "replicated", name: str = "experts"):
        if experts.qat is not None:
            raise NotImplementedError(f"apply_ep: {name} is in QAT mode; call export_qat_() first")
        total = experts.num_experts
        start, stop = split_range(total, info, 1, f"{name}: n_routed_experts", unit=" experts")
        super().__init__(stop - start, experts.hidden_size, experts.intermediate_size, fmt=experts.fmt,
                         dtype=experts.dtype, device="meta")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for suffix in self._specs(proj):
                attr = self._param_name(proj, suffix)
                full = getattr(experts, attr)
                setattr(self, attr, nn.Parameter(narrow_copy(full, 0, start, stop), requires_grad=full.requires_grad))
        record_split(self, Split(EXPERTS, start, stop, total))
        self.first_expert, self.num_global_experts = start, total
        self.ep, self.tokens = info, tokens

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared_out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"ExpertParallelExperts: x must be [T, {self.hidden_size}], got {tuple(x.shape)}")
        if self.tokens == "local":
            return self._finish(self.dispatch_combine(x, topk_weights, topk_ids), shared_out, x.dtype)
        tokens, info = x.shape[0], self.ep
        per = -(-tokens // info.world)
        bounds = [min(r * per, tokens) for r in range(info.world + 1)]
        rows = [bounds[r + 1] - bounds[r] for r in range(info.world)]
        mine = slice(bounds[info.rank], bounds[info.rank + 1])
        y = self.dispatch_combine(x[mine], topk_weights[mine], topk_ids[mine])
        y = self._finish(y, shared_out[mine] if shared_out is not None else None, x.dtype)
        return all_gather_rows(y, rows, info) if per else y

    @staticmethod
    def _finish(routed: torch.Tensor, shared_out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if shared_out is not None:
            routed = routed + shared_out.float()
        return routed.to(dtype)

    def dispatch_combine(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's tokens x [T, H] with their routing [T, k] -> the routed experts' sum fp32 [T, H],
        computed by the ranks that hold the experts."""
        info, local_experts = self.ep, self.num_experts
        tokens, k = topk_ids.shape
        owner = topk_ids.long() // local_experts                                       # [T, k]
        needs = torch.zeros(tokens, info.world, dtype=torch.bool, device=x.device)
        needs.scatter_(1, owner, True)                                                 # [T, W]
        dest, tok = needs.t().nonzero(as_tuple=True)                                   # [R], by rank then token
        send_counts = torch.bincount(dest, minlength=info.world)
        local_ids = torch.where(owner[tok] == dest[:, None], topk_ids[tok].long() - dest[:, None] * local_experts,
                                -1).to(torch.int32)
        weights = topk_weights[tok].float().contiguous().view(torch.int32)
        meta = torch.cat([local_ids, weights], dim=1)                                  # int32 [R, 2k]
        recv_counts = exchange_counts(send_counts, info.group)
        sent, received = send_counts.tolist(), recv_counts.tolist()
        x_in = all_to_all_rows(x[tok], sent, received, info.group)                     # [R_in, H]
        meta_in = all_to_all_rows(meta, sent, received, info.group)                    # [R_in, 2k]
        ids_in = meta_in[:, :k]
        weights_in = meta_in[:, k:].contiguous().view(torch.float32)
        partial = super().forward(x_in, weights_in, ids_in)                            # [R_in, H] x.dtype
        back = all_to_all_rows(partial, received, sent, info.group)                    # [R, H]
        return torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, back.float())

    # ---- checkpoint layout: global expert indices ---------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        local: dict[str, torch.Tensor] = {}
        super()._save_to_state_dict(local, prefix, keep_vars)
        for key, t in local.items():
            e, _, rest = key[len(prefix):].partition(".")
            destination[f"{prefix}{int(e) + self.first_expert}.{rest}"] = t

    def _to_global(self, key: str, prefix: str) -> str:
        e, _, rest = key[len(prefix):].partition(".")
        return f"{prefix}{int(e) + self.first_expert}.{rest}" if e.isdigit() else key

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        local = {}
        for key, t in state_dict.items():
            if not key.startswith(prefix):
                continue
            e, _, rest = key[len(prefix):].partition(".")
            if e.isdigit() and self.first_expert <= int(e) < self.first_expert + self.num_experts:
                local[f"{prefix}{int(e) - self.first_expert}.{rest}"] = t
            elif not (e.isdigit() and int(e) < self.num_global_experts):
                local[key] = t  # not an expert of this layer: let the parent class report it
        missing, unexpected, errors = [], [], []
        super()._load_from_state_dict(local, prefix, local_metadata, strict, missing, unexpected, errors)
        missing_keys.extend(self._to_global(k, prefix) for k in missing)
        unexpected_keys.extend(unexpected)
        for msg in errors:
            key, sep, rest = msg.partition(":")
            error_msgs.append(self._to_global(key, prefix) + sep + rest if key.startswith(prefix) else msg)

    def extra_repr(self) -> str:
        return (f"experts [{self.first_expert}, {self.first_expert + self.num_experts}) of {self.num_global_experts}, "
                f"rank {self.ep.rank}/{self.ep.world}, tokens={self.tokens!r}, " + super().extra_repr())


def apply_ep(model: nn.Module, group: ProcessGroup | None = None, *, tokens: str = "replicated") -> nn.Module:
    """Partition the routed experts of every ``MoE`` in ``model`` over ``group`` (None = the default group):
    rank r keeps experts ``[r·E/W, (r+1)·E/W)`` in their format and receives the tokens routed to them.
    Returns ``model``.

    ``tokens``: ``"replicated"`` when every rank runs the MoE on the same tokens (TP attention, or
    attention replicated; the default), ``"local"`` when each rank has its own (data-parallel attention).
    Compose with tensor parallelism by calling ``apply_ep`` first, then :func:`~mla_quant.parallel.apply_tp`
    (attention, dense MLPs, shared experts and vocabulary over its group; the routed experts stay EP).
    """
    info = group_info(group, "apply_ep")
    if tokens not in TOKEN_MODES:
        raise ValueError(f"apply_ep: tokens={tokens!r}, expected one of {TOKEN_MODES}")
    moes = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
    if not moes:
        raise ValueError("apply_ep: the model has no MoE layer (no routed experts to partition)")
    for name, moe in moes:
        experts = moe.experts
        if isinstance(experts, ExpertParallelExperts):
            raise RuntimeError(f"apply_ep: {name}.experts is already expert-parallel (apply_ep was applied twice)")
        if getattr(experts, TP_ATTR, None) is not None or shards_of(experts):
            raise RuntimeError(f"apply_ep: {name}.experts was already sharded by apply_tp; call apply_ep first, "
                               "then apply_tp")
        moe.experts = ExpertParallelExperts(experts, info, tokens, f"{name}.experts")
    return model


__all__ = ["apply_ep", "ExpertParallelExperts", "TOKEN_MODES"]
