"""Session fixtures for the catalog tests: tiny random bases built with transformers."""
from __future__ import annotations

import pytest

from catalog_fixtures import make_dense_base, make_moe_base


@pytest.fixture(scope="session")
def dense_base(tmp_path_factory):
    return make_dense_base(tmp_path_factory.mktemp("dense") / "base")


@pytest.fixture(scope="session")
def moe_base(tmp_path_factory):
    return make_moe_base(tmp_path_factory.mktemp("moe") / "base")


@pytest.fixture(scope="session")
def other_dense_base(tmp_path_factory):
    """Same architecture as dense_base, different weights and hidden size."""
    return make_dense_base(tmp_path_factory.mktemp("other") / "base", seed=7, hidden=48)
