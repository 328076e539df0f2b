"""One int4 matmul where the captured decode step has several on the same input (q/k/v, gate/up).

At one row, torch's int4 CPU kernel costs a fixed start-up per call (threads, tiles) on top of
reading the weights: on SmolLM2's shapes (2 threads, weights not in cache), q, k and v as three calls
took 0.56 ms per 30 layers and one call on the three concatenated took 0.35; gate and up 1.07 vs 0.95.
The model's code is left alone: this is a pass over the graph `CapturedStep` captured, so it applies
to every family whose projections read the same tensor, and to none whose do not.

The fused weights are new tensors (the originals stay: the eager prefill still uses them), so the
lean step holds a second copy of the fused projections' int4 weights.
"""

from __future__ import annotations

import torch
from torch import fx

INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu


_PURE_METHODS = ("reshape", "view", "to", "contiguous", "float", "bfloat16")


def _value_key(arg):
    """A key equal for two nodes that compute the same value: the same chain of reshapes / casts
    (each Linear reshapes and casts its own input) applied to the same node."""
    if isinstance(arg, fx.Node) and arg.op == "call_method" and arg.target in _PURE_METHODS and not arg.kwargs \
            and not any(isinstance(a, fx.Node) for a in arg.args[1:]):
        return (arg.target, _value_key(arg.args[0]), tuple(map(repr, arg.args[1:])))
    return arg


def _is_int4_mm(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (INT4_MM, INT4_MM.default)


def _same_result(tiles: list, scales: list, fused_tiles: torch.Tensor, fused_scales: torch.Tensor,
                 group_size: int) -> bool:
    """Whether the concatenated weights give exactly the separate results (checked, not assumed: the
    CPU kernel packs rows in blocks of 64, so a part whose width is not a multiple of 64 does not)."""
    probe = torch.randn(2, scales[0].shape[0] * group_size, dtype=torch.bfloat16)
    with torch.no_grad():
        separate = torch.cat([INT4_MM(probe, t, group_size, s) for t, s in zip(tiles, scales)], dim=-1)
        return torch.equal(separate, INT4_MM(probe, fused_tiles, group_size, fused_scales))


def fuse_int4_siblings(gm: fx.GraphModule, example_inputs: list) -> tuple[list, int]:
    """Rewrite `gm` in place; returns (example inputs with the fused weights appended, calls removed).

    A group is every int4 matmul reading the same input value with the same group size whose weight
    and scales are graph inputs (placeholders). The group's call becomes one call on the weights
    concatenated along the output dimension, and each former call a column slice of its result;
    a group whose merged call does not reproduce the separate ones exactly is left as it was.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(placeholders)}
    groups: dict[tuple, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if not _is_int4_mm(node) or len(node.args) != 4 or node.kwargs:
            continue
        x, tiles, group_size, scales = node.args
        if tiles in position and scales in position and isinstance(group_size, int):
            groups.setdefault((_value_key(x), group_size), []).append(node)
    inputs = list(example_inputs)
    removed = 0
    for (_, group_size), nodes in groups.items():
        if len(nodes) < 2:
            continue
        x = nodes[0].args[0]  # computes the same value as the others' inputs, and comes first
        tiles = [inputs[position[n.args[1]]] for n in nodes]
        scales = [inputs[position[n.args[3]]] for n in nodes]
        if len({t.shape[1:] for t in tiles}) != 1 or len({s.shape[0] for s in scales}) != 1:
            continue
        widths = [t.shape[0] for t in tiles]
        fused_tiles = torch.cat(tiles, dim=0).contiguous()
        fused_scales = torch.cat(scales, dim=1).contiguous()
        if not _same_result(tiles, scales, fused_tiles, fused_scales, group_size):
            continue
        with gm.graph.inserting_after(placeholders[-1]):
            scales_node = gm.graph.placeholder(f"fused_int4_scales_{len(inputs)}")
        with gm.graph.inserting_after(placeholders[-1]):
            tiles_node = gm.graph.placeholder(f"fused_int4_tiles_{len(inputs)}")
        for node in (tiles_node, scales_node):  # inputs with no source in user code (aot_autograd asks)
            node._dynamo_source = None
        placeholders.append(scales_node)
        inputs += [fused_tiles, fused_scales]
        with gm.graph.inserting_before(nodes[0]):
            fused = gm.graph.call_function(INT4_MM, (x, tiles_node, group_size, scales_node))
        offset = 0
        for node, width in zip(nodes, widths):
            with gm.graph.inserting_after(fused):
                part = gm.graph.call_function(torch.narrow, (fused, -1, offset, width))
            node.replace_all_uses_with(part)
            gm.graph.erase_node(node)
            offset += width
        removed += len(nodes) - 1
    if removed:
        gm.graph.lint()
        gm.recompile()
    return inputs, removed
