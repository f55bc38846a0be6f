"""``--shuffle-seed N``: run the collected tests in a seeded random order, to show that none needs another first.

No plugin: the order is ``random.Random(N).shuffle`` of the collected items,
printed in the header so that a failing order can be run again.
"""

from __future__ import annotations

import random

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shuffle-seed",
        type=int,
        default=None,
        help="run the collected tests in the order random.Random(N).shuffle gives (tests/conftest.py)",
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("--shuffle-seed")
    return None if seed is None else f"tests shuffled with --shuffle-seed {seed}"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = config.getoption("--shuffle-seed")
    if seed is not None:
        random.Random(seed).shuffle(items)
