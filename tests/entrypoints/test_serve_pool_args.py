"""The flags of `pagoda serve` with several models: names, the models file, what each model's own
server is given."""

from __future__ import annotations

import argparse
import json

import pytest

from pagoda.entrypoints.serve import add_serve_parser
from pagoda.entrypoints.serve_pool import member_args, read_models
from pagoda.serve.model_pool import ModelPool, PoolError


def _parse(argv: list[str]) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    return add_serve_parser(sub).parse_args(argv)


def test_model_names_from_flags_and_file(tmp_path):
    assert read_models(["/m/llama-a", "b=/m/x.gguf", "/m/c.gguf"], None) == {
        "llama-a": "/m/llama-a", "b": "/m/x.gguf", "c": "/m/c.gguf"}
    (tmp_path / "m.json").write_text(json.dumps({"d": "/m/d"}))
    (tmp_path / "m.txt").write_text("# two models\ne /m/e\nf /m/f\n")
    assert read_models(["/m/a"], str(tmp_path / "m.json")) == {"a": "/m/a", "d": "/m/d"}
    assert read_models([], str(tmp_path / "m.txt")) == {"e": "/m/e", "f": "/m/f"}
    with pytest.raises(ValueError, match="two models are named 'a'"):
        read_models(["/x/a", "/y/a"], None)


def test_each_model_server_gets_the_engine_and_serving_flags_given():
    ns = _parse(["--model", "a=/m/a", "--model", "b=/m/b", "--max-loaded-models", "1", "--dtype", "float32",
                 "--no-enable-prefix-caching", "--num-gpu-blocks-override", "64", "--api-key", "k1"])
    assert ns.model_flag == ["a=/m/a", "b=/m/b"] and ns.max_loaded_models == 1
    args = member_args(ns)
    assert args[:6] == ["--dtype", "float32", "--no-enable-prefix-caching", "--num-gpu-blocks-override", "64",
                        "--api-key"] and "k1" in args
    assert "--max-loaded-models" not in args and "--model" not in args


def test_pool_refuses_unknown_models_and_bad_k():
    pool = ModelPool({"a": "/m/a", "b": "/m/b"}, 1, [])
    assert pool.member(None).name == "a" and pool.member("b").name == "b"
    with pytest.raises(PoolError, match="The model `c` does not exist"):
        pool.member("c")
    with pytest.raises(ValueError, match="--max-loaded-models must be >= 1"):
        ModelPool({"a": "/m/a"}, 0, [])


def test_pool_members_leave_their_threads_unbound_when_several_can_run(monkeypatch):
    """Two busy members bound to the same CPUs would compete pair against pair for them: above one loaded model the
    members default to nobind; one at a time they bind as a single server does; a user's choice wins."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert ModelPool({"a": "/m/a", "b": "/m/b"}, 2, [])._member_env()["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in ModelPool({"a": "/m/a", "b": "/m/b"}, 1, [])._member_env()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert ModelPool({"a": "/m/a", "b": "/m/b"}, 2, [])._member_env()["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_a_model_loaded_for_a_waiting_request_is_not_unloaded_under_it():
    """With one model loadable, requests for a and b at once: a's load counts against the limit from
    the moment it is decided (b's request, taking the lock before a's load task runs, started b as
    well), and a's request counts from its start, so that b's request waiting for room does not take
    a for idle between a's load finishing and a's request going on (it stopped a under its request:
    503 "aborted"). The members' processes are scripted here; end to end:
    tests/serve/test_model_pool_server.py."""
    import asyncio

    async def scenario() -> list[str]:
        pool = ModelPool({"a": "/m/a", "b": "/m/b"}, max_loaded=1, member_args=[])
        in_use: set[str] = set()
        stopped_in_use: list[str] = []

        async def start(m):
            assert m.state == "loading"  # counted against the limit before the task first ran
            m.loads += 1
            await asyncio.sleep(0.01)
            m.state, m._starting = "loaded", None
            # The waiting request already counts: from here b's wait for room must not find a idle.
            assert m.inflight == 1, f"{m.name} loaded with {m.inflight} requests counted"
            async with pool._changed:
                pool._changed.notify_all()  # wakes b's wait for room before a's request resumes

        def stop_process(name, proc):
            if name in in_use:
                stopped_in_use.append(name)

        pool._start, pool._stop_process = start, stop_process

        async def use(name: str) -> None:
            m = await pool.acquire(name)
            in_use.add(name)
            assert m.state == "loaded"
            await asyncio.sleep(0.02)
            assert m.state == "loaded", f"{name} was unloaded under its request"
            in_use.discard(name)
            await pool.release(m)

        await asyncio.gather(use("a"), use("b"))
        # a served first, then b: each loaded once (a taken for idle at once would load twice)
        assert {m.name: (m.state, m.loads, m.inflight) for m in pool.members.values()} == {
            "a": ("unloaded", 1, 0), "b": ("loaded", 1, 0)}
        return stopped_in_use

    assert asyncio.run(scenario()) == []
