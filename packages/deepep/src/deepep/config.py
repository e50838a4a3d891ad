"""Tuning knobs of the dispatch/combine kernels (DeepEP's `Config`, reduced to what we use)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    """How the NVLink kernels split their work.

    `num_sms`: thread blocks of one dispatch/combine kernel (half send, half receive).
    `chunk_tokens`: rows a sender writes before raising the chunk's ready flag; smaller chunks let
    the receiver start copying sooner, larger ones cost fewer flag round trips.
    The torch.distributed transport ignores both (the engine picks its own channels).
    """

    num_sms: int = 64
    chunk_tokens: int = 32

    def __post_init__(self) -> None:
        if self.num_sms < 2 or self.num_sms % 2:
            raise ValueError(f"num_sms: expected an even number >= 2, got {self.num_sms}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: expected >= 1, got {self.chunk_tokens}")


def default_dispatch_config(num_ranks: int, num_sms: int) -> Config:
    # Few ranks: each peer link wants many senders; many ranks: the links share them.
    return Config(num_sms=num_sms, chunk_tokens=32 if num_ranks <= 4 else 16)


def default_combine_config(num_ranks: int, num_sms: int) -> Config:
    return Config(num_sms=num_sms, chunk_tokens=32 if num_ranks <= 4 else 16)
