"""Fixtures shared by the test modules, and the test tiers. Builders and fakes live in support modules
(tests/builders.py, tests/fakes.py, tests/serving.py, tests/checkpoints.py); no test module imports another.

The tiers: `make test` runs every test; `make test-fast` deselects the marks ``ray`` and ``slow``. A test
over ~3 s on the shared 2-core machine carries ``@pytest.mark.slow`` itself; a test that uses the shared Ray
cluster (fixture ``ray_serve``) is marked ``ray`` here."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def tok():
    from engine.tokenizer import CharTokenizer

    return CharTokenizer.default()


def pytest_collection_modifyitems(config, items):
    """Marks ``ray`` the tests on the shared Ray cluster; GPU tests run only where CUDA is available
    (never on CI)."""
    for item in items:
        if "ray_serve" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``make test``'s ``-n 2 --dist loadgroup``: the test files that use ``ray_serve`` are one work unit,
    sent to one worker, which alone starts the Ray cluster; every other test is scheduled alone. (pytest-xdist
    3.8 groups ``xdist_group`` marks by rewriting the items' ``_nodeid``, which pytest 9.2's nodeid no longer
    reads, so the group is made here, in the controller, from the files.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from pathlib import Path

    from xdist.scheduler import LoadGroupScheduling

    here = Path(__file__).parent
    ray_files = {p.name for p in here.glob("test_*.py") if "ray_serve" in p.read_text()}

    class RayTogether(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.split("::", 1)[0].rsplit("/", 1)[-1] in ray_files:
                return "ray"
            return super()._split_scope(nodeid)

    return RayTogether(config, log)


@pytest.fixture
def noop_server():
    """Starts loadgen's no-op OpenAI-style server with the given options (``noop_server("--reply", "42")``: its
    base URL), each in a process of its own, stopped when the test ends."""
    from loadgen.noop_server import spawn

    procs = []

    def start(*args: str) -> str:
        proc, url = spawn(*args)
        procs.append(proc)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def ray_serve():
    """One Ray cluster and Serve instance for the session (tests/serving.py): its base URL. Modules deploy
    their applications on it and delete them when they end."""
    pytest.importorskip("ray")
    from tests import serving

    base = serving.start()
    yield base
    serving.stop()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict:
    """Tiny real-format checkpoints (config, weights, BPE tokenizer, chat template) of every diffusion-LM
    family, built once per session: {arch: directory} (tests/checkpoints.py)."""
    from tests.checkpoints import ARCHS, build_checkpoint

    root = tmp_path_factory.mktemp("hf_checkpoints")
    return {arch: build_checkpoint(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def hf_checkpoint_notemplate(tmp_path_factory):
    """The tiny Dream checkpoint without a chat template in its tokenizer_config.json."""
    from tests.checkpoints import build_checkpoint

    return build_checkpoint("dream", tmp_path_factory.mktemp("hf_notemplate") / "dream", chat_template=False)
