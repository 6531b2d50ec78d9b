"""Models named by FILE.py:NAME, as the command line and the planner take them: the file loaded
by path, NAME built (a class from `--config`, or a function), its example inputs, target and loss.

NAME is a model class or a function in FILE.py. A class is built from the config spec: through the
module's `config(spec)` function when it has one (so `gpt3-175b,n_layer=30` names a config and
overrides fields), else from the string itself. A function is called with whichever of `config`,
`batch` and `device` it names, and returns the model, or `(model, inputs)`, or
`(model, inputs, target)`. Without returned inputs, the module's `example_inputs(cfg, batch,
device)` makes them; the module's `lm_loss`, when present, is the loss, with a target shaped like
the input. Models over META_THRESHOLD parameters are built on the meta device.
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autopart.materialize import meta_device

META_THRESHOLD = 1e9     # parameters; above it the model is built on the meta device


class ModelFileError(Exception):
    """A FILE.py:NAME that does not give a model (no such file, it does not load, no NAME, a bad
    config): the command line prints it without a traceback and exits 2."""


def load_target(target: str):
    """FILE.py:NAME -> (module loaded by path, NAME)."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise ModelFileError(f"{target!r}: write FILE.py:NAME, e.g. examples/gpt.py:GPT")
    file = Path(path)
    if not file.is_file():
        raise ModelFileError(f"no such file: {file}")
    mod_name = f"_autopart_user_{file.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module     # dataclasses and pickling look the module up here
    sys.path.insert(0, str(file.resolve().parent))   # so the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001  (the user's file does not run: where, in one line)
        raise ModelFileError(f"{file} does not load: {type(e).__name__}: {e}{_where(e, file)}") from e
    finally:
        sys.path.remove(str(file.resolve().parent))
    if not hasattr(module, name):
        found = [k for k, v in vars(module).items() if not k.startswith("_") and callable(v)
                 and getattr(v, "__module__", None) == mod_name]
        raise ModelFileError(f"{file} has no {name!r}; it defines {', '.join(found) or 'nothing callable'}")
    return module, name


class Built:
    def __init__(self, model, inputs, target, loss_fn, meta, n_params):
        self.model, self.inputs, self.target = model, inputs, target
        self.loss_fn, self.meta, self.n_params = loss_fn, meta, n_params


def _where(e: Exception, file: Path) -> str:
    """' (FILE:LINE)' of the deepest frame in the user's file, if the traceback has one."""
    import traceback
    if isinstance(e, SyntaxError):
        return ""            # its message already says the file and line
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if Path(f.filename).resolve() == file.resolve()]
    return f" ({file}:{frames[-1].lineno})" if frames else ""


def build(module, name: str, spec: str | None, batch: int, meta: bool,
           loss_name: str | None = None, adjust=None) -> Built:
    """Build the model (on meta when asked or when too large), its inputs, target and loss.
    `adjust(config) -> config` (autopart verify's --shrink) changes the config first."""
    with meta_device():               # counting parameters allocates and initializes nothing
        model, cfg, extra = _make(module, name, spec, batch, "meta", adjust)
    n_params = sum(p.numel() for p in _unique_params(model))
    meta = meta or n_params > META_THRESHOLD
    if not meta:
        model, cfg, extra = _make(module, name, spec, batch, "cpu", adjust)
    device = "meta" if meta else "cpu"
    inputs, target = extra if extra is not None else (None, None)
    if inputs is None:
        inputs = _example_inputs(module, model, cfg, batch, device)
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    loss_fn = _loss_fn(module, loss_name)
    if loss_fn is None and target is not None:
        inputs, target = inputs + (target,), None     # model(*inputs, target) returns the loss
    elif loss_fn is not None and target is None and isinstance(inputs[0], torch.Tensor):
        target = torch.zeros_like(inputs[0])        # a target like the input (token ids)
    if target is not None:
        target = target.to(device)
    return Built(model, inputs, target, loss_fn, meta, n_params)


def _make(module, name: str, spec: str | None, batch: int, device: str, adjust=None):
    """(model, config, (inputs, target) or None) from NAME in `module`; `adjust(config)`, when
    given, changes the config before the model is built (a function's model is rebuilt from
    its adjusted `.config`, as `type(model)(config)`, and its returned inputs are dropped)."""
    obj = getattr(module, name)
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        cfg = _config(module, spec)
        if adjust is not None:
            cfg = adjust(cfg)
        try:
            model = obj(cfg) if cfg is not None else obj()
        except Exception as e:   # noqa: BLE001  (a bad config: say which, without a traceback)
            raise ModelFileError(f"building {name}({spec or ''}) failed: {type(e).__name__}: {e}") from e
        return model, cfg, None
    if not callable(obj):
        raise ModelFileError(f"{name} is a {type(obj).__name__}, not a model class or a function")
    params = inspect.signature(obj).parameters
    kwargs: dict[str, Any] = {}
    if "config" in params and spec is not None:
        kwargs["config"] = spec
    elif spec is not None:
        models = [k for k, v in vars(module).items() if isinstance(v, type)
                  and issubclass(v, nn.Module) and v.__module__ == module.__name__]
        raise ModelFileError(f"{name} is a function taking no 'config' argument, so it cannot take "
                          f"--config; NAME must be a model class (nn.Module) or a function "
                          f"returning a model. Model classes in the file: "
                          f"{', '.join(models) or 'none'}")
    if "batch" in params:
        kwargs["batch"] = batch
    if adjust is not None and device != "meta":
        # the function builds the full-size model: look at its config on the meta device (the
        # full model may not fit in memory), and build for real only what the adjusted config says
        with meta_device():
            probe, _, _ = _make(module, name, spec, batch, "meta")
        cfg = getattr(probe, "config", None)
        new = adjust(cfg)
        if new is not cfg:
            return _rebuild(probe, new, device), new, None
        adjust = None
    if "device" in params:
        kwargs["device"] = torch.device(device)
    try:
        out = obj(**kwargs)
    except Exception as e:   # noqa: BLE001
        raise ModelFileError(f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) failed: "
                          f"{type(e).__name__}: {e}") from e
    parts = out if isinstance(out, tuple) else (out,)
    if not parts or not isinstance(parts[0], nn.Module):
        raise ModelFileError(f"{name}() must return a model, or (model, inputs[, target]); "
                          f"it returned {type(out).__name__}")
    model = parts[0]
    extra = None
    if len(parts) > 1:
        extra = (parts[1], parts[2] if len(parts) > 2 else None)
    if adjust is not None:           # on meta: the model to count
        cfg = getattr(model, "config", None)
        new = adjust(cfg)
        if new is not cfg:
            model, extra = _rebuild(model, new, device), None
    return model, getattr(model, "config", None), extra


def _rebuild(model: nn.Module, config, device: str) -> nn.Module:
    """`type(model)(config)` on `device`: a function's model built again from an adjusted
    config (its returned inputs, made for the old config, are not used)."""
    try:
        with torch.device(device):
            return type(model)(config)
    except Exception as e:  # noqa: BLE001
        raise ModelFileError(f"rebuilding {type(model).__name__} from its changed config failed "
                          f"({type(e).__name__}: {e}); make NAME a model class built from "
                          f"--config") from e


def _config(module, spec: str | None):
    make = getattr(module, "config", None)
    if not callable(make):
        return spec
    try:
        return make(spec) if spec is not None else make()
    except TypeError:
        if spec is None:
            return None          # config() needs an argument: build the class with its defaults
        raise
    except (KeyError, ValueError) as e:
        raise ModelFileError(f"--config {spec!r}: {e.args[0] if e.args else e}") from e


def _loss_fn(module, name: str | None):
    """--loss-fn NAME from the file, else the file's lm_loss, else None (the model's output is
    the loss)."""
    if name is None:
        return getattr(module, "lm_loss", None)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ModelFileError(f"--loss-fn {name}: the file has no function {name!r}")
    return fn


def _unique_params(model: nn.Module):
    return list(model.parameters())      # nn.Module.parameters() yields tied weights once


def _example_inputs(module, model, cfg, batch: int, device: str):
    make = getattr(module, "example_inputs", None)
    if callable(make):
        return make(cfg if cfg is not None else getattr(model, "config", None), batch, device)
    seq = _seq_len(getattr(model, "config", cfg))
    if seq is None:
        raise ModelFileError(
            "no example inputs: give the module an example_inputs(cfg, batch, device) function, "
            "or make NAME a function returning (model, inputs)")
    return (torch.zeros(batch, seq, dtype=torch.long, device=device),)   # token ids


def _seq_len(cfg) -> int | None:
    for attr in ("block_size", "n_positions", "max_position_embeddings", "seq_len"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int):
            return value
    return None


__all__ = ["META_THRESHOLD", "Built", "ModelFileError", "build", "load_target"]
