"""The engine loop never leaves a caller waiting: a dying loop fails every waiter loudly, stop() fails what is
queued and keeps a thread that did not join, a slow reader holds one output per choice, counters move under lock."""
import asyncio
import threading

import pytest

from kvforge.sampling_params import SamplingParams
from kvforge.server.engine_loop import EngineLoop, Submission
from kvforge.server.errors import APIError

DEADLINE = 10  # seconds; on a hang the test fails instead of waiting forever
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


class Boom(RuntimeError):
    pass


def boom(*args, **kwargs):
    raise Boom("broken on purpose")


def started(engine, **kwargs) -> EngineLoop:
    loop = EngineLoop(engine, **kwargs)
    loop.start()
    return loop


async def first_item(group):
    return (await asyncio.wait_for(group.mailbox.get(), DEADLINE))[0][1]


async def last_item(group):
    """The error or final output of group's (single) request."""
    while True:
        item = await first_item(group)
        if isinstance(item, Exception) or item.finished:
            return item


async def until_running(group):
    """Wait for the first token of group's request, so it is in the engine, mid-generation."""
    item = await first_item(group)
    assert not isinstance(item, Exception) and not item.finished


def assert_dead(loop: EngineLoop, item, deaths: list) -> None:
    assert isinstance(item, APIError) and item.status == 503 and "Boom" in item.message, item
    assert not loop.alive and isinstance(loop.error, Boom) and deaths == [loop.error]


@pytest.mark.parametrize("broken", ["abort", "step error path"])
def test_a_dying_loop_fails_every_waiter_and_every_later_call(char_engine, broken):
    engine = char_engine()
    deaths: list = []
    loop = started(engine, on_death=deaths.append)

    async def scenario():
        running = await loop.submit([Submission([5, 6, 7], LONG)])
        await until_running(running)
        if broken == "abort":  # an exception inside a command handler
            engine.abort = boom
            loop.abort(running.ids)
        else:  # a step that raises, then an abort in its error path that raises too
            engine.step, engine.abort = boom, boom
        assert_dead(loop, await last_item(running), deaths)
        for later in (loop.submit([Submission([5], LONG)]), loop.call(lambda e: e.stats())):
            with pytest.raises(APIError) as e:
                await asyncio.wait_for(later, DEADLINE)
            assert e.value.status == 503 and "died" in e.value.message

    asyncio.run(scenario())
    assert loop.stop()


def test_a_failed_step_fails_its_requests_with_a_500_and_the_loop_serves_on(char_engine, monkeypatch):
    import kvforge.engine.runner as runner_module

    engine = char_engine(max_num_seqs=1)  # A runs alone; B waits, so it is not in A's failing step
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = char_engine()
    want.add_request([8, 9, 10], params, "b")
    reference = []
    while want.has_unfinished_requests():
        reference += [o.token_ids for o in want.step() if o.finished]
    loop = started(engine)
    sample = runner_module.sample
    calls = []

    def fails_third_call(*args):
        calls.append(1)
        if len(calls) == 3:
            raise Boom("sampler broke")
        return sample(*args)

    monkeypatch.setattr(runner_module, "sample", fails_third_call)

    async def scenario():
        a = await loop.submit([Submission([5, 6, 7], params)])
        b = await loop.submit([Submission([8, 9, 10], params)])
        failed, done = await last_item(a), await last_item(b)
        assert isinstance(failed, APIError) and failed.status == 500 and "Boom: sampler broke" in failed.message
        assert done.finish_reason == "length" and [done.token_ids] == reference

    asyncio.run(scenario())
    assert loop.alive and engine.requests == {}
    loop.stop()


def test_stop_fails_queued_commands_and_keeps_a_thread_that_did_not_join(char_engine):
    engine = char_engine()
    loop = started(engine)
    release, stuck = threading.Event(), threading.Event()
    step = engine.step

    def slow_step():
        stuck.set()
        release.wait(DEADLINE)
        return step()

    async def scenario():
        running = await loop.submit([Submission([5, 6, 7], LONG)])
        await until_running(running)
        engine.step = slow_step
        assert await asyncio.to_thread(stuck.wait, DEADLINE)
        queued = asyncio.ensure_future(loop.submit([Submission([8, 9], LONG)]))
        await asyncio.sleep(0.05)  # its command is queued behind the stuck step
        assert await asyncio.to_thread(loop.stop, 0.2) is False
        with pytest.raises(APIError) as e:
            await asyncio.wait_for(queued, DEADLINE)
        assert e.value.status == 503 and "shutting down" in e.value.message
        item = await last_item(running)  # told at once, while the thread is still stuck
        assert isinstance(item, APIError) and item.status == 503
        release.set()
        assert await asyncio.to_thread(loop.stop, DEADLINE) is True  # the same thread, now joined

    asyncio.run(scenario())
    assert engine.requests == {}  # the loop aborted what it held on its way out


def test_a_slow_reader_holds_one_output_per_choice(char_engine):
    engine = char_engine()
    loop = started(engine)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def scenario():
        group = await loop.submit([Submission([5, 6, 7], params), Submission([9, 9], params)])
        while await loop.call(lambda e: e.has_unfinished_requests()):
            await asyncio.sleep(0.01)
        assert loop.held_outputs() == (2, 120)  # 60 steps ran; one coalesced output per choice waits
        items = await group.mailbox.get()
        assert [(i, o.finished, len(o.new_token_ids), len(o.token_ids)) for i, o in items] == [(0, True, 60, 60),
                                                                                                   (1, True, 60, 60)]

    asyncio.run(scenario())
    loop.stop()


def test_the_waiting_counters_change_under_the_lock(char_engine):
    """The 429 check reads _num_waiting + _pending_adds under the lock; every write must hold it too."""

    class Checked(EngineLoop):
        def __setattr__(self, name, value):
            if name in ("_num_waiting", "_pending_adds") and self.__dict__.get("checking"):
                assert self._lock.locked(), f"{name} written without the lock"
            super().__setattr__(name, value)

    loop = Checked(char_engine(), max_waiting=4)
    loop.checking = True
    loop.start()
    errors = []
    loop.on_death = errors.append

    async def scenario():
        groups = [await loop.submit([Submission([5, 6], SamplingParams(max_tokens=3))]) for _ in range(3)]
        for g in groups:
            while not (await asyncio.wait_for(g.mailbox.get(), DEADLINE))[-1][1].finished:
                pass

    asyncio.run(scenario())
    loop.stop()
    assert errors == []
