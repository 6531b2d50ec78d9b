"""Data for training at scale: a token file on disk and a loader that reads each rank's share.

    from autopart.data import TokenLoader, write_tokens
    write_tokens("corpus.tokens", ids)                      # once, from the tokenizer's ids
    loader = TokenLoader("corpus.tokens", seq=64, global_batch=16, shard=pm.batch_shard)

tokens.py: the file (a 32-byte header, then uint16 or uint32 ids, memory-mapped);
loader.py: the mesh-independent stream of samples, each rank's share of it, its state.
"""
from autopart.data.loader import Batch, SampleOrder, TokenLoader
from autopart.data.tokens import HEADER_BYTES, TokenFile, write_tokens

__all__ = ["Batch", "HEADER_BYTES", "SampleOrder", "TokenFile", "TokenLoader", "write_tokens"]
