"""Compile-time errors that name the graph node, the user's source line, the numbers and a remedy."""
from __future__ import annotations

import functools
import re

import torch.fx as fx


class AutopartError(ValueError):
    """A model, mesh or plan autopart cannot compile. The message says what to change."""


def user_source_line(node: fx.Node | None) -> str:
    """The innermost frame of the node's stack trace that is not inside torch: the user's line."""
    trace = (node.meta.get("stack_trace") or "") if node is not None else ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    for path, line, func, code in reversed(frames):
        # "<eval_with_key>.5": code torch generated (flex_attention's traced wrapper), no file
        if "/torch/" not in path and "/autopart/" not in path and not path.startswith("<"):
            return f"{path}:{line} in {func}: {code.strip()}"
    if frames:
        path, line, func, code = frames[-1]
        return f"{path}:{line} in {func}: {code.strip()}"
    return "<source line unknown>"


def module_path(node: fx.Node | None) -> str:
    """The dotted path of the innermost user module the node was traced in ('' at top level)."""
    stack = (node.meta.get("nn_module_stack") or {}) if node is not None else {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return _clean_path(path)


@functools.lru_cache(maxsize=1 << 16)
def _clean_path(path: str) -> str:
    # torch.export writes paths like "L['self'].transformer.h[0]" or "transformer.h.0".
    # Cached: passes ask for every node's stack, a few hundred distinct paths ~100k times at 1T.
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def node_error(node: fx.Node | None, problem: str, remedy: str) -> AutopartError:
    """An AutopartError naming `node`, its module and source line, the problem and a remedy."""
    where = ""
    if node is not None:
        mod = module_path(node)
        where = f"\n  node:   {node.name} ({node.target})" + (f" in module '{mod}'" if mod else "")
        where += f"\n  source: {user_source_line(node)}"
    return AutopartError(f"{problem}{where}\n  remedy: {remedy}")
