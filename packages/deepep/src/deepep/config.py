"""Tuning knobs of the dispatch/combine kernels: DeepEP's `Config` with its five fields."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    """How the normal-mode kernels split their work, in DeepEP's field order:
    `Config(num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
    num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)`.

    NVLink engine: `num_sms` thread blocks per dispatch/combine kernel (half send, half receive);
    `num_max_nvl_chunked_send_tokens` rows a sender writes before raising the chunk's ready flag
    (smaller chunks let the receiver start sooner, larger ones cost fewer flag round trips). Our
    kernels write straight into the receiver's buffer, so the receive-side window
    (`num_max_nvl_chunked_recv_tokens`) is only checked (>= the send chunk, as DeepEP asserts).
    The RDMA fields are kept for DeepEP code (inter-node traffic goes through torch.distributed).
    The torch.distributed engines have no SMs to pick and ignore the config (logged at DEBUG).
    """

    num_sms: int = 64
    num_max_nvl_chunked_send_tokens: int = 32
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 128

    def __post_init__(self) -> None:
        if self.num_sms < 2 or self.num_sms % 2:
            raise ValueError(f"num_sms: expected an even number >= 2, got {self.num_sms}")
        if self.num_max_nvl_chunked_send_tokens < 1:
            raise ValueError(f"num_max_nvl_chunked_send_tokens: expected >= 1, got {self.num_max_nvl_chunked_send_tokens}")
        if self.num_max_nvl_chunked_recv_tokens < self.num_max_nvl_chunked_send_tokens:
            raise ValueError(f"num_max_nvl_chunked_recv_tokens: expected >= num_max_nvl_chunked_send_tokens="
                             f"{self.num_max_nvl_chunked_send_tokens}, got {self.num_max_nvl_chunked_recv_tokens}")
        if self.num_max_rdma_chunked_send_tokens < 1 or self.num_max_rdma_chunked_recv_tokens < 1:
            raise ValueError(f"num_max_rdma_chunked_send_tokens / _recv_tokens: expected >= 1, got "
                             f"{self.num_max_rdma_chunked_send_tokens} / {self.num_max_rdma_chunked_recv_tokens}")

    @property
    def chunk_tokens(self) -> int:
        """The NVLink send chunk (our earlier name for num_max_nvl_chunked_send_tokens)."""
        return self.num_max_nvl_chunked_send_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink receive window this config implies per rank (DeepEP's sizing helper)."""
        return num_ranks * self.num_sms // 2 * self.num_max_nvl_chunked_recv_tokens * (hidden_bytes + 64)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of RDMA window this config implies (0 here: no RDMA engine)."""
        return 0


def default_dispatch_config(num_ranks: int, num_sms: int) -> Config:
    # Few ranks: each peer link wants many senders; many ranks: the links share them.
    return Config(num_sms, 32 if num_ranks <= 4 else 16, 256)


def default_combine_config(num_ranks: int, num_sms: int) -> Config:
    return Config(num_sms, 32 if num_ranks <= 4 else 16, 256)
