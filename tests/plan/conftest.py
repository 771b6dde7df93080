"""The plan's tests share `registered`: stages registered for one test, the registry as it was afterwards."""

import pytest

from torchspeed.plan.stages import Stage, register_stage, unregister_stage


@pytest.fixture
def registered():
    """Register stages for one test; the registry is as it was afterwards."""
    names: list[str] = []

    def add(stage: Stage) -> Stage:
        names.append(stage.name)
        return register_stage(stage)

    yield add
    for n in names:
        unregister_stage(n)
