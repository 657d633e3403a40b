from __future__ import annotations

import os

import pytest

from specserve.ports import free_port

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_collection_modifyitems(config, items):
    """Test tiers: ``service`` = needs a Ray cluster (the shared ``service`` fixture, or its
    own); every other test is ``unit`` (no Ray). ``slow`` is marked by hand (> ~5 s)."""
    for item in items:
        if "service" in item.fixturenames and not item.get_closest_marker("service"):
            item.add_marker(pytest.mark.service)
        if not item.get_closest_marker("service") and not item.get_closest_marker("unit"):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="session", autouse=True)
def _quiet():
    import torch
    import transformers

    # The suite shares 2 cores with Ray replicas and subprocesses: oversubscribed OpenMP
    # threads make every op 10x slower, one thread each is fastest.
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="session")
def builtin_pair():
    from specserve.models.load import load_pair

    return load_pair("builtin-target", "builtin-drafter")


@pytest.fixture(scope="session")
def generator(builtin_pair):
    from specserve.engine.generator import SpeculativeGenerator

    return SpeculativeGenerator(builtin_pair)


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory):
    """A pair trained from scratch by the real builder in a few seconds."""
    from specserve.models.build import PRESETS, build_pair

    out = tmp_path_factory.mktemp("tiny-pair")
    build_pair(out, PRESETS["tiny"], "tiny")
    return out


@pytest.fixture(scope="session")
def heldout():
    from specserve.models.corpus import heldout_prompts

    return heldout_prompts(n=20)


@pytest.fixture(scope="session")
def service():
    """The distributed service on a local Ray cluster (shared by every service test file)."""
    from deployments.local import start_local

    svc = start_local({}, port=free_port(), num_cpus=4)
    yield svc
    svc.stop()
