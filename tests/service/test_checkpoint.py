"""The service's records checkpoint: writes land in order, and nothing saved is lost when the service stops."""

from __future__ import annotations

import pytest

from isolators.service._checkpoint import Checkpoint
from isolators.service._records import ContainerRecord, RecordsFile
from runtime import Process, Runtime, dispatch, spawn, terminate, wait

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Keeper(Process):
    """A process that checkpoints its records as the service does."""

    def __init__(self, path: str) -> None:
        super().__init__("keeper")
        self.records: dict[str, ContainerRecord] = {}
        self.checkpoint = Checkpoint(self.records, RecordsFile(path, "gpu-isolator"), self)

    def change_and_stop(self, name: str, pid: int) -> None:
        self.records[name] = ContainerRecord(container_id=name, command=["sleep"], uid=1000, pid=pid)
        self.checkpoint.save()
        terminate(self.pid)  # the termination goes before the save's queued write

    async def finalize(self) -> None:
        await self.checkpoint.close()


async def test_a_save_whose_write_the_termination_dropped_still_lands(tmp_path) -> None:
    path = str(tmp_path / "service" / "containers.json")
    async with Runtime():
        keeper = Keeper(path)
        spawn(keeper)
        assert await keeper.checkpoint.save()  # an empty file first
        keeper.records["a"] = ContainerRecord(container_id="a", command=["true"], uid=1000, pid=41)
        assert await keeper.checkpoint.save()
        dispatch(keeper.pid, Keeper.change_and_stop, "b", 42)  # saved, and the service stops at once
        await wait(keeper.pid)
    assert [(r.container_id, r.pid) for r in RecordsFile(path, "gpu-isolator").load()] == [("a", 41), ("b", 42)]
