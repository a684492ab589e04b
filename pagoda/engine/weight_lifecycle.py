"""An engine core's weights over its life: the version it serves, hot updates from a checkpoint, and
sleep / wake.

A hot update loads the checkpoint on a thread while the current weights keep serving, checks that it
fits the served model tensor for tensor, and then, between two steps, copies its values into the
served tensors in place (`pagoda.exec.weight_tensors`). The swap waits for the mode:

- `drain`: requests that arrive once the checkpoint is loaded are held here; the swap happens when
  every request the core already has is finished, so each request runs on one version only.
- `abort`: requests that have started end at the swap with an error; those not started yet run on
  the new weights.
- `in_place`: the swap happens at once; running requests continue on the new weights (their outputs
  carry both versions).

The prefix cache is flushed at every swap (blocks in use included, `KVCacheManager.flush_prefix_cache`).
A checkpoint that does not load or does not fit is refused and the served weights are untouched.

Sleep level 1 gives the KV cache's memory back; level 2 also parks the weights in a mapped file
(`park_weights`), so that waking up costs page faults, not a load. CPU, one rank in process.

The core process calls `poll()` between steps (through `EngineCore.step`) and sends what
`pop_results()` returns as the answers to the update calls.
"""

from __future__ import annotations

import gc
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.contracts.messages import EngineCoreOutput, EngineCoreRequest
from pagoda.engine.errors import WeightUpdateRefused, refusal
from pagoda.exec.cpu_memory import trim_heap
from pagoda.exec.weight_tensors import (ParkedWeights, check_same_layout, copy_weights, park_weights,
                                        prepare_like_runner, weight_slots, weight_tensors)
from pagoda.model.errors import ModelLoadError
from pagoda.model.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)

UPDATE_MODES = ("drain", "abort", "in_place")
# Config fields a replacement checkpoint must share with the served model (the KV cache, the runner
# and the input checks were sized by them).
_SAME_CONFIG = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size")


@dataclass
class _Update:
    call_id: int | None
    model_path: str
    version: str
    mode: str
    future: Future | None
    started: float
    loaded: tuple[LoadedModel, dict] | None = None
    loaded_time: float = 0.0


class WeightLifecycle:
    def __init__(self, core: Any, version: str) -> None:
        """`core`: the EngineCore that owns this (not imported: it imports this module)."""
        self.core = core
        self.version = version
        self.loaded_at = time.time()
        self.model_path = str(core.loaded.source.path)
        self.sleep_level = 0
        self._update: _Update | None = None
        self._held: list[EngineCoreRequest] = []
        self._results: list[tuple[int, dict]] = []
        self.rejected: dict[str, str] = {}  # held requests the core refused at release
        self._parked: ParkedWeights | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- state -------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """An update is loading or waiting for its swap: the core loop polls rather than sleeps."""
        return self._update is not None

    @property
    def num_held(self) -> int:
        return len(self._held)

    def info(self) -> dict:
        return {"weight_version": self.version, "weights_loaded_at": self.loaded_at, "model_path": self.model_path,
                "sleep_level": self.sleep_level, "updating": self._update is not None}

    def hold(self, req: EngineCoreRequest) -> bool:
        """Keep a new request back (True) while a loaded `drain` update waits for running ones."""
        if self.sleep_level:
            raise ValueError("the engine is sleeping (wake it up first)")
        u = self._update
        if u is None or u.loaded is None or u.mode != "drain":
            return False
        self._held.append(req)
        return True

    def pop_results(self) -> list[tuple[int, dict]]:
        out, self._results = self._results, []
        return out

    # -- updates -----------------------------------------------------------------------------------
    def _check_can_update(self, mode: str) -> None:
        if mode not in UPDATE_MODES:
            raise WeightUpdateRefused(f"mode must be one of {', '.join(UPDATE_MODES)}; got {mode!r}")
        if self._update is not None:
            raise WeightUpdateRefused(f"an update to version {self._update.version!r} is in progress", "conflict")
        if self.sleep_level:
            raise WeightUpdateRefused("the engine is sleeping: wake it up before updating its weights", "conflict")
        if not self.core.runner_is_local():
            raise WeightUpdateRefused("weight updates need the model in the engine process "
                                      "(one rank: --distributed-executor-backend uni)")

    def begin_update(self, call_id: int | None, model_path: str, version: str | None, mode: str = "drain") -> None:
        """Start loading `model_path` on a thread; the answer to `call_id` comes from pop_results()
        once the swap is done or the checkpoint is refused. Refusals of the call itself raise."""
        self._check_can_update(mode)
        if not isinstance(model_path, str) or not model_path:
            raise WeightUpdateRefused("model_path must be a non-empty string")
        version = version if version else Path(model_path).name
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-weight-load")
        future = self._pool.submit(self._load, model_path)
        self._update = _Update(call_id, model_path, str(version), mode, future, time.monotonic())
        logger.info("loading weights version %s from %s (mode %s)", version, model_path, mode)

    def update_now(self, model_path: str, version: str | None = None) -> dict:
        """Load and swap at once (offline: between generate() calls nothing runs)."""
        self._check_can_update("drain")
        if self.core.has_unfinished_requests():
            raise WeightUpdateRefused("requests are running", "conflict")
        version = version if version else Path(model_path).name
        u = _Update(None, model_path, str(version), "drain", None, time.monotonic())
        u.loaded = self._load(model_path)
        u.loaded_time = time.monotonic()
        self._update = u
        return self._swap(u)

    def _load(self, model_path: str) -> tuple[LoadedModel, dict]:
        core = self.core
        served = core.loaded
        try:
            new = load_model(model_path, served.dtype, core.device)
        except ModelLoadError as exc:
            raise WeightUpdateRefused(str(exc)) from None
        except (OSError, ValueError, RuntimeError) as exc:
            raise WeightUpdateRefused(f"{model_path}: cannot load ({type(exc).__name__}: {exc})") from None
        if new.architecture != served.architecture:
            raise WeightUpdateRefused(f"{model_path}: architecture {new.architecture} differs from the served "
                                      f"model's {served.architecture}")
        for name in _SAME_CONFIG:
            a, b = getattr(new.config, name, None), getattr(served.config, name, None)
            if a != b:
                raise WeightUpdateRefused(f"{model_path}: {name} is {a}, the served model's is {b}")
        fresh = weight_tensors(new.model, prepare_like_runner(new.model, core.device))
        try:
            check_same_layout(weight_tensors(core.runner.model, core.runner.compute_logits), fresh, model_path)
        except ValueError as exc:
            raise WeightUpdateRefused(str(exc)) from None
        return new, fresh

    def poll(self) -> list[EngineCoreOutput]:
        """Between steps: swap when the loaded update's mode allows. Returns the outputs of requests
        it ended (mode `abort`)."""
        u = self._update
        if u is None or (u.loaded is None and not u.future.done()):
            return []
        if u.loaded is None:
            try:
                u.loaded = u.future.result()
            except Exception as exc:
                logger.warning("weights version %s refused: %s", u.version, exc)
                self._update = None
                self._answer(u, refusal(exc))
                return []
            u.loaded_time = time.monotonic()
        outputs: list[EngineCoreOutput] = []
        if u.mode == "drain" and self.core.has_unfinished_requests():
            return []  # running requests finish on the old weights; new ones are held meanwhile
        if u.mode == "abort":
            outputs = self._abort_started(u.version)
        self._answer(u, self._swap(u))
        return outputs

    def _abort_started(self, version: str) -> list[EngineCoreOutput]:
        started = [r.request_id for r in self.core.scheduler.requests.values()
                   if r.num_computed_tokens > 0 or r.num_output_tokens > 0]
        if not started:
            return []
        self.core.abort_requests(started)
        why = f"aborted: the weights were updated to version {version!r} (mode abort); retry the request"
        return [EngineCoreOutput(rid, [], finish_reason="abort", error=why) for rid in started]

    def _swap(self, u: _Update) -> dict:
        core = self.core
        t0 = time.monotonic()
        new, fresh = u.loaded
        copied = copy_weights(weight_slots(core.runner.model, core.runner.compute_logits), fresh)
        _release_fused_plan(core)  # it held the packed weights just handed over
        core.kv_manager.flush_prefix_cache()
        previous = self.version
        self.version, self.loaded_at, self.model_path = u.version, time.time(), str(new.source.path)
        u.loaded = None
        del new, fresh
        self._update = None
        # The replacement's memory is freed with its last reference; what malloc keeps of it goes back
        # at the core's next heap check (EngineCore.trim_kv_memory), not in this pause.
        swap_s = time.monotonic() - t0
        held, self._held = self._held, []
        for req in held:
            try:
                core.add_request(req)
            except Exception as exc:
                self.rejected[req.request_id] = str(exc)
        logger.info("weights updated: version %s -> %s from %s (mode %s, loaded in %.2f s, swapped in %.3f s, "
                    "%d request(s) had waited)", previous, self.version, self.model_path, u.mode,
                    u.loaded_time - u.started, swap_s, len(held))
        return {"weight_version": self.version, "previous_version": previous, "mode": u.mode,
                "weights_loaded_at": self.loaded_at, "load_s": u.loaded_time - u.started, "swap_s": swap_s,
                "bytes_copied": copied, "num_held": len(held)}

    def _answer(self, u: _Update, result: dict) -> None:
        if u.call_id is not None:
            self._results.append((u.call_id, result))

    # -- sleep and wake ----------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Give back the KV cache's memory (level 1) and the weights' (level 2). Needs no request in
        the core (the server drains first)."""
        core = self.core
        if level not in (1, 2):
            raise WeightUpdateRefused(f"level must be 1 or 2, got {level!r}")
        if self._update is not None:
            raise WeightUpdateRefused("a weight update is in progress", "conflict")
        if core.has_unfinished_requests():
            raise WeightUpdateRefused("requests are running", "conflict")
        if core.device.type != "cpu" or core.kv_cache is None or not core.runner_is_local():
            raise WeightUpdateRefused("sleep mode is implemented for one CPU rank in the engine process")
        pool = core.kv_manager.block_pool
        core.kv_manager.reset_prefix_cache()
        kv_bytes = core.kv_cache.release_blocks(pool.release_reusable(pool.num_reusable_blocks))
        weight_bytes = 0
        if level == 2 and self._parked is None:
            _release_fused_plan(core)  # it holds the packed weights that parking frees
            self._parked = park_weights(weight_slots(core.runner.model, core.runner.compute_logits))
            weight_bytes = self._parked.nbytes
        gc.collect()
        trim_heap()
        self.sleep_level = max(self.sleep_level, level)
        logger.info("sleeping at level %d: %.1f MiB of KV cache released, %.1f MiB of weights parked",
                    self.sleep_level, kv_bytes / 2**20, weight_bytes / 2**20)
        return {"level": self.sleep_level, "kv_bytes_released": kv_bytes, "weight_bytes_parked": weight_bytes}

    def wake_up(self) -> dict[str, Any]:
        t0 = time.monotonic()
        if self._parked is not None:
            self._parked.restore()
            self._parked = None
        was, self.sleep_level = self.sleep_level, 0
        if was:
            logger.info("awake (was at level %d) in %.3f s", was, time.monotonic() - t0)
        return {"was_level": was, "wake_s": time.monotonic() - t0}


def _release_fused_plan(core: Any) -> None:
    """The fused CPU decode step keeps the tensors it was built with; let the replaced ones go now."""
    if core.runner.fused_decode is not None:
        core.runner.fused_decode.release()
