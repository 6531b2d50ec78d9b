"""A model file built at another sequence length than its own (`autopart plan --seq`): the
profile (profile.py) captures the model with its config's sequence-length fields set
(`with_sequence`) and example inputs of that length (`WithSequence`).
"""
from __future__ import annotations

import dataclasses


# config fields holding the sequence length (or its maximum), set to `--seq`
SEQ_FIELDS = ("block_size", "n_positions", "max_position_embeddings", "seq_len", "max_seq_len")


def with_sequence(seq: int):
    """config -> the config with its sequence-length fields (SEQ_FIELDS: nanoGPT's block_size,
    Meta Llama's max_seq_len, ...) set to `seq`, for a dataclass config; others are kept."""

    def adjust(cfg):
        if cfg is None or not dataclasses.is_dataclass(cfg):
            return cfg
        fields = {f.name for f in dataclasses.fields(cfg)} & set(SEQ_FIELDS)
        return dataclasses.replace(cfg, **{f: seq for f in fields}) if fields else cfg
    return adjust


class WithSequence:
    """A model file's module whose example inputs are `seq` tokens long: its own
    example_inputs(cfg, batch, device) (after with_sequence changed the config), or token ids."""

    def __init__(self, module, seq: int):
        self._module, self._seq = module, seq

    def __getattr__(self, key):
        return getattr(self._module, key)

    def example_inputs(self, cfg, batch, device):
        import torch
        make = getattr(self._module, "example_inputs", None)
        if callable(make):
            return make(cfg, batch, device)
        return (torch.zeros(batch, self._seq, dtype=torch.long, device=device),)


__all__ = ["SEQ_FIELDS", "with_sequence", "WithSequence"]
