"""One int4 matmul where the captured decode step has several on the same input (q/k/v, gate/up), for
torch's int4pack op and the project's w4a8 kernel alike.

At one row, torch's int4 CPU kernel costs a fixed start-up per call (threads, tiles) on top of
reading the weights: on SmolLM2's shapes (2 threads, weights not in cache), q, k and v as three calls
took 0.56 ms per 30 layers and one call on the three concatenated took 0.35; gate and up 1.07 vs 0.95.
The model's code is left alone: this is a pass over the graph `CapturedStep` captured, so it applies
to every family whose projections read the same tensor, and to none whose do not.

The fused weights are new tensors (the originals stay: the eager prefill still uses them), so the
lean step holds a second copy of the fused projections' int4 weights.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import fx

INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu


@dataclass(frozen=True)
class Fusable:
    """An int4 matmul op whose calls on the same input merge: `tensors` are its (argument index, dimension
    the weights concatenate along) pairs, `group` the index of its group-size argument, `probe` the
    dtype its input is given in."""

    name: str
    tensors: tuple[tuple[int, int], ...]
    group: int
    probe: torch.dtype


def _fusable_ops() -> dict:
    """op (overload packet and default) -> Fusable: torch's int4pack op, and the w4a8 kernel's when loaded."""
    ops = {INT4_MM: Fusable("int4pack", ((1, 0), (3, 1)), 2, torch.bfloat16)}
    native = torch.ops.infer_tune_native
    packet = native.w4a8_mm if hasattr(native, "w4a8_mm") else None
    if packet is not None:
        ops[packet] = Fusable("w4a8", ((1, 0),), 2, torch.float32)
    return {**ops, **{op.default: spec for op, spec in ops.items()}}


_PURE_METHODS = ("reshape", "view", "to", "contiguous", "float", "bfloat16")


def _value_key(arg):
    """A key equal for two nodes that compute the same value: the same chain of reshapes / casts
    (each Linear reshapes and casts its own input) applied to the same node."""
    if isinstance(arg, fx.Node) and arg.op == "call_method" and arg.target in _PURE_METHODS and not arg.kwargs \
            and not any(isinstance(a, fx.Node) for a in arg.args[1:]):
        return (arg.target, _value_key(arg.args[0]), tuple(map(repr, arg.args[1:])))
    return arg


def _same_result(op, spec: Fusable, parts: list[list[torch.Tensor]], fused: list[torch.Tensor], group_size: int,
                 in_features: int) -> bool:
    """Whether the concatenated weights give exactly the separate results (checked, not assumed: the
    int4pack CPU kernel packs rows in blocks of 64, so a part whose width is not a multiple of 64 does not)."""
    probe = torch.randn(2, in_features, dtype=spec.probe)

    def call(tensors):
        args = [probe, None, None, None, None][:len(spec.tensors) + 2]
        for (index, _), tensor in zip(spec.tensors, tensors):
            args[index] = tensor
        args[spec.group] = group_size
        return op(*args)
    with torch.no_grad():
        separate = torch.cat([call(p) for p in parts], dim=-1)
        return torch.equal(separate, call(fused))


def fuse_int4_siblings(gm: fx.GraphModule, example_inputs: list) -> tuple[list, int]:
    """Rewrite `gm` in place; returns (example inputs with the fused weights appended, calls removed).

    A group is every int4 matmul of one op (torch's int4pack, the w4a8 kernel) reading the same input value
    with the same group size whose weight tensors are graph inputs (placeholders). The group's call becomes
    one call on the weights concatenated along the output dimension, and each former call a column slice of
    its result; a group whose merged call does not reproduce the separate ones exactly is left as it was.
    """
    ops = _fusable_ops()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(placeholders)}
    groups: dict[tuple, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        spec = ops.get(node.target) if node.op == "call_function" else None
        if spec is None or len(node.args) != len(spec.tensors) + 2 or node.kwargs:
            continue
        group_size = node.args[spec.group]
        if all(node.args[i] in position for i, _ in spec.tensors) and isinstance(group_size, int):
            groups.setdefault((spec.name, _value_key(node.args[0]), group_size), []).append(node)
    inputs = list(example_inputs)
    removed = 0
    for (_, _, group_size), nodes in groups.items():
        if len(nodes) < 2:
            continue
        op, spec = nodes[0].target, ops[nodes[0].target]
        x = nodes[0].args[0]  # computes the same value as the others' inputs, and comes first
        parts = [[inputs[position[n.args[i]]] for i, _ in spec.tensors] for n in nodes]
        if not all(_agree(column, d) for (_, d), column in zip(spec.tensors, zip(*parts))):
            continue
        widths = [_width(spec, p) for p in parts]
        fused = [torch.cat(column, dim=d).contiguous() for (_, d), column in zip(spec.tensors, zip(*parts))]
        in_features = _in_features(spec, parts[0], group_size)
        if not _same_result(op, spec, parts, fused, group_size, in_features):
            continue
        new_nodes = []
        for k in range(len(fused)):
            with gm.graph.inserting_after(placeholders[-1]):
                node = gm.graph.placeholder(f"merged_weights_{len(inputs) + k}")
            node._dynamo_source = None  # an input with no source in user code (aot_autograd asks)
            placeholders.append(node)
            new_nodes.append(node)
        inputs += fused
        args = list(nodes[0].args)
        for (index, _), node in zip(spec.tensors, new_nodes):
            args[index] = node
        args[0] = x
        with gm.graph.inserting_before(nodes[0]):
            merged = gm.graph.call_function(op, tuple(args))
        _fake_like(merged, nodes[0], sum(widths))
        offset = 0
        for node, width in zip(nodes, widths):
            with gm.graph.inserting_after(merged):
                part = gm.graph.call_function(torch.narrow, (merged, -1, offset, width))
            _fake_like(part, node, width)
            node.replace_all_uses_with(part)
            gm.graph.erase_node(node)
            offset += width
        removed += len(nodes) - 1
    if removed:
        gm.graph.lint()
        gm.recompile()
    return inputs, removed


def _fake_like(node: fx.Node, like: fx.Node, width: int) -> None:
    """Give a new node the value dynamo records on each node it traced (`example_value`: a fake tensor of `like`'s
    but `width` columns), which inductor's compiled-graph caches read to key the graph; without it they compile it
    again every time."""
    value = like.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        with value.fake_mode if hasattr(value, "fake_mode") else contextlib.nullcontext():
            node.meta["example_value"] = value.new_empty((*value.shape[:-1], width))


def _width(spec: Fusable, tensors: list[torch.Tensor]) -> int:
    """A call's output width: int4pack's tiles [N, ...], w4a8's tiles of 8 outputs [N/8, ...] (padded N)."""
    return tensors[0].shape[0] * (8 if spec.name == "w4a8" else 1)


def _agree(tensors, dim: int) -> bool:
    """Whether the tensors have one shape but along `dim` (so they concatenate along it)."""
    return len({tuple(n for i, n in enumerate(t.shape) if i != dim) for t in tensors}) == 1


def _in_features(spec: Fusable, tensors: list[torch.Tensor], group_size: int) -> int:
    """The input width of a call, from its weights: int4pack's scales [K/g, N, 2], w4a8's [N/8, K/g, bytes]."""
    if spec.name == "w4a8":
        return tensors[0].shape[1] * group_size
    return tensors[1].shape[0] * group_size
