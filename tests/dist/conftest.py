"""Module-scoped fixtures of the Ray + gloo suites. A test module names its model in `MODEL`
and, to place ranks on fake GPU bundles, the number of fake GPUs in `FAKE_GPUS`."""
import pytest

from actors.local import LocalExecutor
from tests.dist._helpers import CoordinatorCache, ray_session, runtime_cfg


@pytest.fixture(scope="module")
def ray_mod(request):
    ray = ray_session(num_gpus=getattr(request.module, "FAKE_GPUS", None))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(request):
    """One in-process rank of the module's model: the single-rank yardstick."""
    loc = LocalExecutor(runtime_cfg(request.module.MODEL))
    loc.start()
    return loc.runtime


@pytest.fixture(scope="module")
def cache(ray_mod):
    c = CoordinatorCache()
    yield c
    c.close()
