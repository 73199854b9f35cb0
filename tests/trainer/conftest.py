"""Fixtures of the trainer tests."""

from __future__ import annotations

from typing import Callable

import pytest
from trainer_helpers import compose_config


@pytest.fixture
def config_factory(tiny_model_dir) -> Callable:
    return lambda *overrides: compose_config(tiny_model_dir, *overrides)
