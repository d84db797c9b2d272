"""`pagoda worker --help` and `pagoda router --help` say what each flag does and what runs when
it is not given (before: a bare flag list, "--max-num-seqs MAX_NUM_SEQS" and no default)."""
from __future__ import annotations

import argparse

import pytest

from pagoda.gpu_worker.serving.args import build_parser as worker_parser
from pagoda.router.args import build_parser as router_parser


@pytest.mark.parametrize("build", [worker_parser, router_parser], ids=["worker", "router"])
def test_every_flag_has_help_and_shows_its_default(build):
    parser = build()
    text = " ".join(parser.format_help().split())      # argparse wraps lines at the terminal width
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0]
        assert action.help, f"{flag} has no help"
        shown = action.default not in (None, False, "", []) and action.default is not argparse.SUPPRESS
        if shown and "default" not in action.help.lower():
            assert f"{action.help.split()[-1]} (default: {action.default})" in text, flag


def test_examples_of_defaults_users_look_for():
    text = " ".join(worker_parser().format_help().split())
    assert "(default: 50051)" in text and "(default: 0.5)" in text        # --port, --heartbeat-interval
    text = " ".join(router_parser().format_help().split())
    assert "(default: prefix_aware)" in text and "(default: 50050)" in text
