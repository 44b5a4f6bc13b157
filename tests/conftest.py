"""Fixtures shared by the test modules, and the test tiers. Builders and fakes live in support modules
(tests/builders.py, tests/fakes.py, tests/serving.py, tests/checkpoints.py); no test module imports another.

The tiers: `make test` runs every test; `make test-fast` deselects the marks ``ray`` and ``slow``. A test
over ~3 s on the shared 2-core machine carries ``@pytest.mark.slow`` itself; a test that uses the shared Ray
cluster (fixture ``ray_serve``) is marked ``ray`` here, and under ``-n 2 --dist loadgroup`` the ``ray`` tests run
on one worker (``RayTogether``)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
# the online learners' refit worker processes (predictors/refit_worker.py) at the normal CPU policy: with the
# default idle policy they wait for a free core, which two busy test workers rarely leave (tests/test_online.py
# checks the default on a worker of its own)
os.environ.setdefault("REMASK_REFIT_SCHED", "normal")


@pytest.fixture
def tok():
    from engine.tokenizer import CharTokenizer

    return CharTokenizer.default()


def pytest_collection_modifyitems(config, items):
    """Marks ``ray`` the tests on the shared Ray cluster; GPU tests run only where CUDA is available
    (never on CI). Under pytest-xdist, a worker also tells the controller which of its tests carry ``ray``
    (``RayTogether`` keeps them on one worker)."""
    for item in items:
        if "ray_serve" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and "remask_marked_dir" in workerinput:
        marked = {mark: [item.nodeid for item in items if item.get_closest_marker(mark) is not None]
                  for mark in ("ray", "slow")}
        path = Path(workerinput["remask_marked_dir"]) / f"{workerinput['workerid']}.json"
        path.write_text(json.dumps(marked))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- the Ray tests on one worker (pytest-xdist) -------------------------------------------------------------
# `make test` runs `-n 2 --dist loadgroup`. pytest-xdist 3.8 groups `xdist_group` marks by rewriting the items'
# private `_nodeid`, which pytest 9.2's nodeid no longer reads: its groups never form (checked on two small files,
# whose marked tests ran on both workers). So under `--dist loadgroup` the controller schedules with
# ``RayTogether``, written against xdist's public scheduler interface (``pytest_xdist_make_scheduler``, the
# ``Scheduling`` protocol): every test alone, as `--dist load` would, but the tests marked ``ray`` (told by the
# workers as they collect: ``pytest_configure_node`` hands each a directory for the list) one unit, sent first to
# one worker, which alone starts the Ray cluster.


MARKED_DIR = pytest.StashKey[Path]()


def _controller_dir(config) -> Path:
    """The controller's directory for the workers' lists of ``ray`` tests (made once)."""
    if MARKED_DIR not in config.stash:
        config.stash[MARKED_DIR] = Path(tempfile.mkdtemp(prefix="remask-marked-"))
    return config.stash[MARKED_DIR]


def pytest_unconfigure(config):
    if MARKED_DIR in config.stash:
        shutil.rmtree(config.stash[MARKED_DIR], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    if node.config.getvalue("dist") == "loadgroup":
        node.workerinput["remask_marked_dir"] = str(_controller_dir(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.workermanage import parse_tx_spec_config

    return RayTogether(len(parse_tx_spec_config(config)), _controller_dir(config), log)


class RayTogether:
    """A pytest-xdist scheduler: each test a unit of its own, but the ``ray``-marked ones one unit, first; then
    the ``slow``-marked ones, then the rest (each group in collection order)."""

    def __init__(self, numnodes: int, marked_dir: Path, log) -> None:
        self.numnodes, self.marked_dir, self.log = numnodes, marked_dir, log
        self.node2collection: dict = {}
        self.node2pending: dict = {}
        self.queue: list[list[int]] = []  # units not sent yet
        self.collection: list[str] | None = None
        self.scheduled = False

    @property
    def nodes(self) -> list:
        return list(self.node2pending)

    @property
    def collection_is_completed(self) -> bool:
        return len(self.node2collection) >= self.numnodes

    @property
    def tests_finished(self) -> bool:
        return (self.collection_is_completed and not self.queue
                and all(len(p) < 2 for p in self.node2pending.values()))

    @property
    def has_pending(self) -> bool:
        return bool(self.queue) or any(self.node2pending.values())

    def add_node(self, node) -> None:
        self.node2pending[node] = []

    def add_node_collection(self, node, collection) -> None:
        if self.collection is not None and list(collection) != self.collection:  # a replacement that differs
            self.log(f"{node.gateway.id} collected other tests than the first workers: left idle")
            return
        self.node2collection[node] = list(collection)

    def _marked(self, mark: str) -> set[str]:
        marked = set()
        for path in self.marked_dir.glob("*.json"):
            marked.update(json.loads(path.read_text())[mark])
        return marked

    def schedule(self) -> None:
        if self.scheduled or not self.collection_is_completed:
            for node in self.nodes:  # a worker that replaced a crashed one
                if self.scheduled and not self.node2pending[node]:
                    self._top_up(node)
            return
        collections = list(self.node2collection.values())
        if any(c != collections[0] for c in collections[1:]):
            self.log("the workers collected different tests: stopping")
            for node in self.nodes:
                node.shutdown()
            return
        self.collection, self.scheduled = collections[0], True
        marked, slow = self._marked("ray"), self._marked("slow")
        ray = [i for i, nodeid in enumerate(self.collection) if nodeid in marked]
        rest = [i for i in range(len(self.collection)) if i not in set(ray)]
        # the slow tests (marked at the test, ~3 s and more) next, the quick ones last: the two workers then end
        # within a quick test of each other, not one idle while the other runs a 40 s test that came late
        rest.sort(key=lambda i: self.collection[i] not in slow)
        self.queue = ([ray] if ray else []) + [[i] for i in rest]
        for node in self.nodes:
            self._top_up(node)

    def _top_up(self, node) -> None:
        """Keep two tests known to ``node`` (a worker runs a test once it knows the next one or is told to
        stop); with nothing left to send, tell it to stop after what it holds."""
        if node.shutting_down:
            return
        pending = self.node2pending[node]
        while len(pending) < 2 and self.queue:
            unit = self.queue.pop(0)
            pending.extend(unit)
            node.send_runtest_some(unit)
        if not self.queue:
            node.shutdown()

    def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
        self.node2pending[node].remove(item_index)
        self._top_up(node)

    def mark_test_pending(self, item: str) -> None:
        self.queue.insert(0, [self.collection.index(item)])
        for node in self.nodes:
            self._top_up(node)

    def remove_pending_tests_from_node(self, node, indices) -> None:
        pending = self.node2pending[node]
        for i in indices:
            if i in pending:
                pending.remove(i)

    def remove_node(self, node) -> str | None:
        pending = self.node2pending.pop(node)  # its collection stays: the collection is complete for good
        if not pending:
            return None
        crashed = self.collection[pending.pop(0)]
        self.queue[:0] = [[i] for i in pending]  # the rest runs elsewhere (the crash is reported)
        return crashed


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the session's last ``ray`` test (in collection order: the last one that runs, on the one worker that
    runs them), its module's apps deleted, Ray stops: not idle (its controller and agents ~5% of a core) beside
    the tests that follow on this worker, nor stopping at the session's end, when the other worker may be done."""
    yield
    if item.get_closest_marker("ray") is None or "ray" not in sys.modules:
        return
    if item is next((i for i in reversed(item.session.items) if i.get_closest_marker("ray") is not None), None):
        from tests import serving

        serving.stop()


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
