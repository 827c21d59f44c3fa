"""start_eagerly: a coroutine that never waits finishes in the caller; one that waits goes on in a
task that receives results, exceptions and cancellation as a task of its own would."""

import asyncio

import pytest

from rollout.bus.eager import start_eagerly


def test_a_coroutine_that_never_waits_finishes_in_the_caller() -> None:
    async def main() -> None:
        seen: list[str] = []

        async def quick() -> None:
            seen.append("ran")

        assert start_eagerly(quick()) is None
        assert seen == ["ran"]  # before any loop turn

        async def broken() -> None:
            raise ValueError("bad")

        with pytest.raises(ValueError, match="bad"):
            start_eagerly(broken())

    asyncio.run(main())


def test_a_coroutine_that_waits_goes_on_in_a_task() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        steps: list[object] = []

        async def slow() -> str:
            steps.append("start")
            steps.append(await first)
            try:
                await second
            except ValueError as e:
                steps.append(f"caught {e}")
            await asyncio.sleep(0)
            return "done"

        task = start_eagerly(slow())
        assert steps == ["start"] and isinstance(task, asyncio.Task)
        first.set_result(1)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        second.set_exception(ValueError("thrown in"))
        assert await asyncio.wait_for(task, 5) == "done"
        assert steps == ["start", 1, "caught thrown in"]

        async def yields_first() -> str:
            await asyncio.sleep(0)  # a bare yield: "run me again next turn"
            return "after a turn"

        task = start_eagerly(yields_first())
        assert task is not None and await asyncio.wait_for(task, 5) == "after a turn"

        cleaned: list[str] = []

        async def forever() -> None:
            try:
                await loop.create_future()
            finally:
                cleaned.append("finally ran")

        task = start_eagerly(forever())
        assert task is not None
        task.cancel()  # before the task's first step: the cancellation must still reach the coroutine
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == ["finally ran"]

    asyncio.run(main())
