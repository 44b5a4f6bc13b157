"""The CLI on the shipped default models."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.loading import DEFAULTS_DIR
from tools.cli import COMMAND_MODULES, build_parser, main

needs_models = pytest.mark.skipif(not (DEFAULTS_DIR / "tiny-bd" / "config.json").exists(),
                                  reason="embedded models not present")


@pytest.mark.slow
@needs_models
@pytest.mark.parametrize("model", ["tiny-bd", "tiny-mdm"])
def test_eval_prints_the_json_of_the_issue(capsys, model):
    assert main(["eval", "--model", model, "--thresholds", "0.5,0.9", "--n", "60", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == model
    lo, hi = out["results"]
    assert {"threshold", "accuracy", "mean_rounds", "requests", "by_category"} <= set(hi)
    assert hi["requests"] == 60 and set(hi["by_category"]) == {"arith", "choice", "lookup", "prose", "reverse"}
    assert lo["mean_rounds"] < hi["mean_rounds"]  # a lower threshold commits more per round
    assert hi["accuracy"] >= 0.6  # the shipped weights really solve the task suite


@needs_models
def test_generate_shows_the_canvas(capsys):
    assert main(["generate", "--model", "tiny-bd", "--prompt", "rev: abcde", "--show-steps"]) == 0
    out = capsys.readouterr().out
    assert "edcba" in out and "denoise" in out and "prefill" in out


@needs_models
def test_bad_arguments_get_a_clear_error_before_any_work(capsys):
    assert main(["simulate", "--scenario", "dilaserve-bench", "--plot", "x.png"]) == 2
    assert "dilaserve-trace" in capsys.readouterr().err
    assert main(["faults", "--replicas", "1"]) == 2
    assert "--replicas >= 2" in capsys.readouterr().err


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _registered(module) -> dict[str, argparse.ArgumentParser]:
    """The subcommands ``module.add_parsers`` adds to a parser of its own."""
    sub = argparse.ArgumentParser(prog="remask").add_subparsers(dest="command")
    module.add_parsers(sub)
    return dict(sub.choices)


def _handlers(parser: argparse.ArgumentParser, inherited=None):
    """(path, handler) of every runnable command under ``parser``: a leaf's own ``func`` or its parent's."""
    func = parser._defaults.get("func", inherited)
    sub = _subparsers(parser)
    if sub is None:
        yield parser.prog, func
        return
    for child in sub.choices.values():
        yield from _handlers(child, func)


def test_every_registered_subcommand_is_in_the_help_and_no_name_twice():
    root = build_parser()
    shown = set(_subparsers(root).choices)
    help_text = root.format_help()
    owner: dict[str, str] = {}
    for module in COMMAND_MODULES:
        names = _registered(module)
        assert names, f"{module.__name__}.add_parsers registers no subcommand"
        for name in names:
            assert name not in owner, f"remask {name} is registered by {owner[name]} and {module.__name__}"
            owner[name] = module.__name__
            assert name in shown and f"\n    {name} " in help_text, f"remask {name} ({module.__name__}) not in --help"
    assert set(owner) == shown, f"subcommands from no module of COMMAND_MODULES: {sorted(shown - set(owner))}"


def test_each_package_handles_its_own_subcommands():
    """Every runnable command has a handler, defined in the package of the module that registers it."""
    for module in COMMAND_MODULES:
        package = module.__name__.split(".")[0]
        for parser in _registered(module).values():
            for prog, func in _handlers(parser):
                assert callable(func), f"{prog} sets no handler"
                assert func.__module__.split(".")[0] == package, \
                    f"{prog}: handler {func.__module__}.{func.__name__} is outside {module.__name__}'s package"


def test_the_help_imports_neither_torch_nor_ray():
    """Building the parser stays cheap: handlers import the runtime when they run."""
    code = ("import sys; from tools.cli import build_parser; build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
