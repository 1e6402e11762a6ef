"""`PassThrough`: the inner of a `KvbusConnector` configured without one.

It answers every hook as vLLM runs with no KV connector at all: nothing matched,
loaded or saved, no metadata bound (so vLLM skips the per-layer hooks), no events,
stats or transfers to report. The wrapper asks it like any inner and so records
nothing, and opens no publisher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig


class PassThrough(KVConnectorBase_V1, SupportsHMA):
    """vLLM's answers with no KV connector, where `KVConnectorBase_V1`'s defaults
    differ from them (the defaults not overridden here are those answers already)."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # the base says "a producer role", but nothing is produced

    # --- worker side: nothing bound, nothing to run ------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        pass  # never bound, so has_connector_metadata() is False: no per-layer hooks

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    # --- scheduler side: no external hit, nothing to plan -------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        pass  # no block pool to hold

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NOTHING

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        pass  # no handshake to check or take, whatever its pipeline ranks

    def reset_cache(self) -> bool | None:
        return None  # nothing cached (and nothing to log about it)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM 0.33: no KV held outside the engine's caches, so sleep is possible."""
        return True


_NOTHING = KVConnectorMetadata()
"""Every step's metadata of a pass-through (binding it is a no-op)."""
