"""The engine core's side of the process split: `run_engine_core`, the entry point of the core
process, and `EngineCoreProc`, its loop around an `EngineCore` and two ZMQ sockets. The API side,
which spawns this process and talks to it, is `pagoda.engine.core_client`.

Why a process: the core's step loop is CPU/GPU bound Python; in the API process it would share the
GIL with HTTP parsing, tokenization and detokenization, and every request would slow every step.
Here the API process only encodes small msgspec messages and the core never waits on HTTP.

Wire (all messages defined in `pagoda.contracts.messages`):
- input  (API PUSH, bound  -> core PULL, connected): two frames, [kind byte, msgpack payload]
- output (core PUSH, connected -> API PULL, bound): one frame, an `EngineCoreOutputs`

The loop (`EngineCoreProc.run`): idle, it blocks on its input socket (waking once a second only to
notice that its parent died); busy, it drains every pending input without blocking and runs one
`EngineCore.step()` per iteration, sending each step's outputs with a stats snapshot.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any, Callable

import msgspec
import zmq

from pagoda.config import EngineArgs
from pagoda.engine.input_processor import eos_token_id_of
from pagoda.engine.errors import WeightUpdateRefused, refusal
from pagoda.contracts.messages import (
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineCoreStats,
    UtilityRequest,
    UtilityResult,
    decoder,
    encode,
)

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # idle wake-up period, only to check that the parent is still alive
_STALLED_POLL_MS = 5  # a step that scheduled nothing while requests exist: wait briefly for input


class EngineCoreProc:
    """Runs inside the core process: owns an `EngineCore` and the two sockets."""

    def __init__(self, args: EngineArgs, input_addr: str, output_addr: str, parent_pid: int) -> None:
        self.args = args
        self.parent_pid = parent_pid
        self.ctx = zmq.Context(io_threads=1)
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.RCVHWM, 0)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_addr)
        self.core = None
        self.num_aborted = 0
        self._shutdown = False
        self._last_sent_stats: EngineCoreStats | None = None
        self._decode_add = decoder(EngineCoreRequest)
        self._decode_ids = decoder(list[str])
        self._decode_utility = decoder(UtilityRequest)
        # Utility calls the front end may make; each returns something msgpack can encode.
        self.utilities: dict[str, Callable[..., Any]] = {
            "stats": lambda: msgspec.structs.asdict(self.stats()),
            "ping": lambda: "pong",
            # False while requests hold blocks (the KV manager refuses then).
            "reset_prefix_cache": lambda: bool(self.core.kv_manager.reset_prefix_cache()),
            "timeline": lambda request_id: self.core.timeline(request_id),
            "weight_info": lambda: self.core.lifecycle.info(),
            "sleep": lambda level=1: self.core.lifecycle.sleep(level),
            "wake_up": lambda: self.core.lifecycle.wake_up(),
        }

    # -- setup ---------------------------------------------------------------------------------
    def load(self) -> None:
        from pagoda.engine.core import EngineCore
        from pagoda.engine.devices import share_cpu_threads
        from pagoda.exec.cpu_threads import bind_engine_threads, check_threads_bind
        from pagoda.exec.executor import resolve_backend

        args = self.args
        if not str(args.device).startswith("cuda"):
            share_cpu_threads(args.data_parallel_size)
        backend = resolve_backend(args.distributed_executor_backend, args.tensor_parallel_size * args.pipeline_parallel_size)
        single_rank = args.data_parallel_size == 1 and backend == "uni"
        check_threads_bind(single_rank)
        self.core = EngineCore(args)
        core = self.core
        if single_rank and core.device.type == "cpu":
            bind_engine_threads()
        core.record_iteration_tokens = True
        core.kv_manager.block_pool.record_events()
        dtype = str(core.loaded.dtype).removeprefix("torch.")
        self._send(
            EngineCoreOutputs(
                ready=EngineCoreReady(
                    max_model_len=core.max_model_len,
                    vocab_size=int(core.loaded.config.vocab_size),
                    num_blocks=core.kv_manager.num_blocks,
                    num_usable_blocks=core.kv_manager.num_usable_blocks,
                    block_size=core.kv_manager.block_size,
                    model_name=core.loaded.source.name,
                    architecture=core.loaded.architecture,
                    dtype=dtype,
                    device=str(core.device),
                    eos_token_id=eos_token_id_of(None, core.loaded.config),
                    pid=os.getpid(),
                    weight_version=core.lifecycle.version,
                    weights_loaded_at=core.lifecycle.loaded_at,
                ),
                stats=self.stats(),
                timestamp=time.time(),
            )
        )

    # -- messages ------------------------------------------------------------------------------
    def _send(self, msg: EngineCoreOutputs) -> None:
        self.output.send(encode(msg), copy=False)

    def stats(self) -> EngineCoreStats:
        stats = self.core.stats()
        stats.num_aborted_requests = self.num_aborted
        stats.pid = os.getpid()
        return stats

    def _handle(self, frames: list[bytes]) -> None:
        kind, payload = frames[0], frames[1] if len(frames) > 1 else b""
        core = self.core
        if kind == EngineCoreRequestType.ADD:
            req = self._decode_add.decode(payload)
            try:
                core.add_request(req)
            except Exception as exc:  # the front end validates; this is a last line of defence
                logger.warning("core refused request %s: %s", req.request_id, exc, extra={"request_id": req.request_id})
                self._send(EngineCoreOutputs(rejected={req.request_id: str(exc)}, timestamp=time.time()))
        elif kind == EngineCoreRequestType.ABORT:
            ids = self._decode_ids.decode(payload)
            self.num_aborted += sum(1 for rid in ids if self._knows(rid))
            core.abort_requests(ids)
        elif kind == EngineCoreRequestType.FINISH:
            core.finish_requests(self._decode_ids.decode(payload))
        elif kind == EngineCoreRequestType.UTILITY:
            call = self._decode_utility.decode(payload)
            fn = self.utilities.get(call.method)
            if call.method == "update_weights":  # answered once loaded and swapped (send_lifecycle_results)
                try:
                    core.lifecycle.begin_update(call.call_id, *call.args)
                    return
                except Exception as exc:
                    result = UtilityResult(call.call_id, result=refusal(exc))
            elif fn is None:
                result = UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
            else:
                try:
                    result = UtilityResult(call.call_id, result=fn(*call.args))
                except WeightUpdateRefused as exc:  # sleep / wake: an answer, not a failure
                    result = UtilityResult(call.call_id, result=refusal(exc))
                except Exception as exc:
                    result = UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")
            self._send(EngineCoreOutputs(utility=result, timestamp=time.time()))
        elif kind == EngineCoreRequestType.SHUTDOWN:
            self._shutdown = True
        else:
            logger.error("unknown input kind %r", kind)

    def _knows(self, rid: str) -> bool:
        return self.core.has_request(rid)

    def _drain_inputs(self) -> None:
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames)

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        core = self.core
        while not self._shutdown:
            self._send_lifecycle_results()
            if not core.has_work():
                # Idle: let the front end see the final state (running 0, blocks free), then block.
                self._send_stats_if_changed()
                while not self.input.poll(_IDLE_POLL_MS):
                    # An idle engine still gives back what a burst left resident.
                    core.trim_kv_memory()
                    if not self._parent_alive():
                        logger.warning("parent process died; engine core exiting")
                        return
                    core.check_health()  # a worker that died while idle: fail now, not at the next request
            self._drain_inputs()
            if self._shutdown or not core.has_work():
                continue
            steps_before = core.num_steps
            outputs = core.step()
            if outputs:
                stats = self.stats()
                self._last_sent_stats = stats
                self._send(
                    EngineCoreOutputs(
                        outputs=outputs, stats=stats, timestamp=time.time(), iteration_tokens=core.pop_iteration_tokens(),
                        kv_events=core.pop_kv_events(),
                        weight_version=core.lifecycle.version,
                    )
                )
            elif core.num_steps == steps_before:
                # Nothing could be scheduled (e.g. only requests waiting on a sibling's prompt):
                # don't spin hot; any input wakes us at once.
                self.input.poll(_STALLED_POLL_MS)
                if not self._parent_alive():
                    return

    def _send_lifecycle_results(self) -> None:
        """Answers to weight updates that finished (swapped or refused), and held requests refused."""
        lifecycle = self.core.lifecycle
        for call_id, result in lifecycle.pop_results():
            self._send(EngineCoreOutputs(utility=UtilityResult(call_id, result=result), timestamp=time.time()))
        if lifecycle.rejected:
            rejected, lifecycle.rejected = lifecycle.rejected, {}
            self._send(EngineCoreOutputs(rejected=rejected, timestamp=time.time()))

    def _send_stats_if_changed(self) -> None:
        stats = self.stats()
        events = self.core.pop_kv_events()
        if stats != self._last_sent_stats or self.core.iteration_tokens or events is not None:
            self._last_sent_stats = stats
            self._send(
                EngineCoreOutputs(stats=stats, timestamp=time.time(), iteration_tokens=self.core.pop_iteration_tokens(),
                                  kv_events=events)
            )

    def close(self) -> None:
        if self.core is not None:
            self.core.shutdown()  # the executor's workers
        self.input.close(linger=0)
        self.output.close()
        self.ctx.term()


def run_engine_core(
    args: EngineArgs, input_addr: str, output_addr: str, parent_pid: int, log_level: str,
    log_setup: Callable[[], None] | None = None,
) -> None:
    """Entry point of the core process. `log_setup` (picklable) configures logging; else a plain format."""
    # The API process alone decides when the core stops (SHUTDOWN message, else SIGKILL), and the
    # core exits by itself if the API process dies. Ctrl-C in a terminal, or SIGTERM sent to the
    # whole process group (systemd, `kill -- -PGID`), reaches the core too: obeying it would look
    # like a crash to the API process in the middle of its graceful shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if log_setup is not None:
        log_setup()
    else:
        logging.basicConfig(
            level=getattr(logging, log_level.upper(), logging.INFO),
            format="%(asctime)s %(levelname)s [engine-core] %(name)s: %(message)s",
        )
    proc = EngineCoreProc(args, input_addr, output_addr, parent_pid)
    code = 0
    loaded = False
    try:
        proc.load()
        loaded = True
        proc.run()
    except Exception as exc:
        code = 1
        from pagoda.errors import DistributedInitError, WorkerDiedError
        from pagoda.model.errors import ModelLoadError

        user_error = isinstance(exc, (ModelLoadError, ValueError))  # a user error (model, sizes): no traceback
        if user_error or isinstance(exc, (DistributedInitError, WorkerDiedError)):  # one line says it all
            logger.error("engine core failed: %s", exc)
        else:
            logger.error("engine core failed:\n%s", traceback.format_exc())
        # Only while loading does a ValueError mean bad arguments; once running it is a bug.
        config_error = str(exc) if user_error and not loaded else None
        try:
            proc._send(EngineCoreOutputs(
                failed=f"{type(exc).__name__}: {exc}", config_error=config_error, timestamp=time.time(),
            ))
        except Exception:
            pass
    finally:
        proc.close()
    if code:
        os._exit(code)
