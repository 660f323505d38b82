"""Packed linears that multiply the same input, computed as one product.

Most decoders project one hidden state several times in a row — queries, keys and values; the MLP's gate and up
projections. Computing such siblings as one wider product reads the input once and makes one oneDNN call instead of
three: measured on SmolLM2 (BENCHMARKS.md, "Runtime"), 30 layers' linears fall from 26.5 to 21.1 ms (float32, 4
rows) and from 17.1 to 13.2 ms (bfloat16).

Which linears share an input is found, not assumed: :func:`find_shared_inputs` runs one short forward with hooks and
groups the linears that received the very same input tensor (with the same contents) exactly once each. No model's
module names are known here. At run time a member called with another input still gets the right result (the group's
product over that input), so a code path the probe did not see costs time, never correctness.
"""

from __future__ import annotations

import torch
from torch import nn

from hierspec.runtime.onednn import PackedLinear, pack_weight, packed_linear


class SharedInputGroup:
    """Linears multiplying the same input: one packed product, each member reading its own columns."""

    def __init__(self, members: list[PackedLinear]) -> None:
        self.in_features = members[0].in_features
        weight = torch.cat([m.weight.detach() for m in members])
        self.packed = pack_weight(weight)
        if all(m.bias is None for m in members):
            self.bias = None
        else:
            self.bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                                   for m in members])
        widths = [m.out_features for m in members]
        self.bounds = [(sum(widths[:i]), sum(widths[: i + 1])) for i in range(len(widths))]
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor | None] = [None] * len(members)
        for index, member in enumerate(members):
            member.join(self, index)

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s product with ``x`` (``[..., in]``), computing the whole group's once per input."""
        if x is not self._input or self._outputs[index] is None:
            rows = x.reshape(-1, self.in_features)
            product = packed_linear(rows, self.packed, self.bias)
            self._outputs = [product[:, start:end].contiguous() for start, end in self.bounds]
            self._input = x
        out = self._outputs[index]
        self._outputs[index] = None
        if all(o is None for o in self._outputs):
            self._input = None  # every member has its result: hold no activations between forwards
        return out.view(*x.shape[:-1], out.shape[-1])


@torch.inference_mode()
def find_shared_inputs(model: nn.Module, probe_ids: torch.Tensor) -> list[list[PackedLinear]]:
    """Groups of :class:`PackedLinear` modules that receive one same input tensor in a forward over ``probe_ids``.

    A linear joins a group only if it ran exactly once, on the same tensor object as the others and with the same
    contents when each of them ran (so no in-place change happened between them), with the same input width and
    weight dtype.
    """
    calls: dict[PackedLinear, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def record(module, args):
        calls.setdefault(module, []).append((args[0], args[0].detach().clone()))

    modules = [m for m in model.modules() if isinstance(m, PackedLinear)]
    hooks = [m.register_forward_pre_hook(record) for m in modules]
    try:
        model(input_ids=probe_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    by_input: dict[int, list[PackedLinear]] = {}
    for module, seen in calls.items():
        if len(seen) == 1:
            by_input.setdefault(id(seen[0][0]), []).append(module)
    groups = []
    for members in by_input.values():
        first = calls[members[0]][0][1]
        if len(members) > 1 and all(
                m.in_features == members[0].in_features and m.weight.dtype == members[0].weight.dtype
                and torch.equal(calls[m][0][1], first) for m in members):
            groups.append(members)
    return groups


def fuse_shared_inputs(model: nn.Module, probe_ids: torch.Tensor) -> list[SharedInputGroup]:
    """Make every group of linears found by :func:`find_shared_inputs` compute as one product."""
    return [SharedInputGroup(members) for members in find_shared_inputs(model, probe_ids)]
