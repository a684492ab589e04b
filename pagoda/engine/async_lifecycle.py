"""The server's calls on its engine core's weights: hot updates, sleep and wake, and the version
served (see `pagoda.engine.weight_lifecycle`, where the core does the work). A mixin of `AsyncLLM`,
which supplies `call_utility` and keeps `weight_version` current from the core's messages."""

from __future__ import annotations

from typing import Any

# A checkpoint loads in seconds here; the answer also waits for a drain, bounded by the longest request.
UPDATE_TIMEOUT_S = 3600.0


class WeightLifecycleCalls:
    weight_version: str = ""
    weights_loaded_at: float = 0.0
    sleep_level: int = 0
    updating_weights: bool = False  # an update call is out (loading, or waiting for its swap)

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:  # AsyncLLM's
        raise NotImplementedError

    async def update_weights(self, model_path: str, version: str | None = None, mode: str = "drain",
                             timeout: float = UPDATE_TIMEOUT_S) -> dict:
        """Load `model_path` beside the served weights and swap it in (modes: drain, abort, in_place).
        Returns the swap's report, or {"error": why, "kind": "invalid" | "conflict"} when refused (the
        served weights are then unchanged)."""
        self.updating_weights = True
        try:
            result = await self.call_utility("update_weights", model_path, version, mode, timeout=timeout)
        finally:
            self.updating_weights = False
        if "error" not in result:
            self.weight_version = result["weight_version"]
            self.weights_loaded_at = result["weights_loaded_at"]
        return result

    async def sleep(self, level: int = 1) -> dict:
        """Free the KV cache (level 1) and the weights too (level 2); needs no request in flight."""
        result = await self.call_utility("sleep", level, timeout=120.0)
        if "error" not in result:
            self.sleep_level = result["level"]
        return result

    async def wake_up(self) -> dict:
        result = await self.call_utility("wake_up", timeout=120.0)
        self.sleep_level = 0
        return result
