"""One real one-node Slurm cluster (``tests/slurm_cluster``) for every Slurm test of the
session: started once, stopped at the end. (Every process the tests start is bound to the
session by the root conftest: ``tests/processes``.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import slurm_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment Slurm's commands need (``SLURM_CONF``)."""
    missing = slurm_cluster.missing()
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not found: run scripts/install-slurm.sh to install Slurm and "
            "MUNGE for the Slurm tests"
        )
    with slurm_cluster.one_node_cluster(tmp_path_factory.mktemp(slurm_cluster.ROOT_PREFIX)) as env:
        yield env
